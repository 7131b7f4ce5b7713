"""What a case of each property costs, measured: the figures ``run --dry-run`` estimates a gate's
time from. Kept with the properties (no module outside ``properties/`` names one)."""

from __future__ import annotations

from typing import Dict

#: wall seconds per property of the default gate on 2 idle cores (docs/benchmarks.md, "Time against
#: cores", 2026-11-26: 63.4 s in all)
BENCH_SECONDS_2_CORES: Dict[str, float] = {
    "norm_fidelity": 16.7, "clipped_step": 5.1, "sensitivity_bound": 1.6, "noise_calibration": 16.6,
    "mode_equivalence": 4.8, "trajectory": 4.7, "deadlock_free": 5.3, "sampling_accounting": 0.7,
    "checkpoint_resume": 2.9}
#: cases each property runs in the default gate (``dpfsdp-verify run --dry-run``, 2026-11-27: 137):
#: the benchmark's seconds are shared out among them (planning them again would cost seconds: a plan
#: computes the reference norms its clip bounds are picked from)
DEFAULT_GATE_CASES: Dict[str, int] = {
    "norm_fidelity": 35, "clipped_step": 34, "sensitivity_bound": 6, "noise_calibration": 14,
    "mode_equivalence": 6, "trajectory": 18, "deadlock_free": 12, "sampling_accounting": 10,
    "checkpoint_resume": 2}
#: a property the benchmark did not measure (a new one): this many seconds per case
FALLBACK_SECONDS_PER_CASE = 0.5


def seconds_per_case(property_id: str) -> float:
    """Measured wall seconds per case of ``property_id`` on 2 idle cores (the fallback for one the
    benchmark did not measure)."""
    total, n = BENCH_SECONDS_2_CORES.get(property_id), DEFAULT_GATE_CASES.get(property_id)
    return total / n if total is not None and n else FALLBACK_SECONDS_PER_CASE


__all__ = ["BENCH_SECONDS_2_CORES", "DEFAULT_GATE_CASES", "FALLBACK_SECONDS_PER_CASE", "seconds_per_case"]
