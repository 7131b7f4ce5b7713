"""The unit every property produces and every report consumes: one ``Verdict`` per property x config.

Its fields are one entry of ``results`` in the JSON report (schema:
``dpfsdp_verify/schema/report.schema.json``): ``status`` in ``STATUSES``, ``diagnosis`` in
``DIAGNOSES`` (or ``None``), ``config`` with at least ``world_size``, ``data_layout``, ``model``,
``mode``, ``grad_sample_mode`` (a value may be ``None`` where it does not apply); every key a
property may put in ``config`` is listed in ``CONFIG_KEYS`` (expectation files are checked against it).

``deadlock`` (and ``step_divergence`` for a hang) is said only of a *proven* deadlock (the harness's
``proof.py``); a deadline that passed with nothing proven is ``hang`` / ``timeout`` -- a slow
target and a stuck one look the same until the slow one comes back.

``internal_error`` is the one diagnosis that is about the suite, not the target: property code in
the gate process raised (a bug in a check). The CLI exits 3 when any verdict carries it.
"""

from __future__ import annotations

import builtins
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, Optional

STATUSES = ("pass", "fail", "hang", "error", "skip")
#: the statuses that make a gate run (and a fuzz example) fail
FAILING = ("fail", "hang", "error")
#: what the runner and the harness say of a case of any property (a hang, a crash, a refusal, data
#: that is not what was asked, non-finite or frozen values released, a privacy step count that is not
#: one per DP step, a bug in a check, a rank refused by DTensor for a tensor whose placement differs
#: from its parameter's)
RUN_DIAGNOSES = ("mismatch", "non_finite", "deadlock", "rank_crash", "step_divergence", "timeout", "refused",
                 "frozen_updated", "step_count_wrong", "internal_error", "placement_mismatch", "accountant_mismatch",
                 "epsilon_under_reported", "epsilon_over_reported")
#: every diagnosis a verdict may carry: ``RUN_DIAGNOSES`` and each property's own
#: (``Property.diagnoses``); the report schema's enum is this list (tests/properties/test_contract.py ties them)
DIAGNOSES = RUN_DIAGNOSES + ("sqrt_n_inflation", "sample_mixing", "undercount", "correlated_sampling",
                             "wrong_sample_rate", "non_gaussian_noise", "dependent_noise", "step_count_reset",
                             "noise_replayed", "mask_replayed", "noise_bypassed",
                             "replica_divergence", "replicated_counted", "audit_violation", "post_processed")
#: a bug inside the suite's own check code (not a verdict about the target)
INTERNAL_ERROR = "internal_error"
#: every key a property or the fuzzer puts in ``Verdict.config`` (keep in step with them: the
#: expectations file rejects other keys, and a test checks every property's plan against this list)
CONFIG_KEYS = ("world_size", "data_layout", "model", "reduction", "dtype", "mode", "grad_sample_mode",
               "local_batches", "model_kwargs", "fuzz", "sampling", "sample_rate", "dataset_size", "epochs",
               "seeding", "dataset", "physical_batch_size", "processes", "resume_at", "precision",
               "noise_multiplier", "momentum", "horizon", "mesh", "audit_canaries", "audit_steps", "audit_confidence",
               "releases", "explore")


@dataclass
class Verdict:
    property: str
    status: str
    config: Dict[str, Any]
    diagnosis: Optional[str] = None
    message: str = ""
    evidence: Dict[str, Any] = field(default_factory=dict)
    repro: str = ""
    seconds: float = 0.0
    details: str = ""  # long text (stacks, tracebacks); not part of the JSON contract

    def __post_init__(self):
        if self.status not in STATUSES:
            raise ValueError(f"status must be one of {STATUSES}, got {self.status!r}")
        if self.diagnosis is not None and self.diagnosis not in DIAGNOSES:
            raise ValueError(f"diagnosis must be one of {DIAGNOSES} or None, got {self.diagnosis!r}")

    def to_json(self) -> Dict[str, Any]:
        d = asdict(self)
        d.pop("details")
        return d

    @builtins.property  # the field ``property`` shadows the builtin in this class body
    def label(self) -> str:
        """``property [config label]``: the name of this verdict in messages, reports and
        expectations (``config_label``)."""
        return f"{self.property} [{config_label(self.config)}]"


#: config keys shown by value, not as ``key=value``, right after the world size
_POSITIONAL = ("data_layout", "model", "reduction")


def _scalar(v: Any) -> str:
    if isinstance(v, float) and v.is_integer():
        return str(int(v))
    return str(v)


def _value(v: Any) -> Optional[str]:
    """A config value as label text; ``None`` for values that are absent (None / empty)."""
    if v is None or v == "" or v == {} or v == [] or v == ():
        return None
    if isinstance(v, dict):
        # one level of settings (fuzz examples/seed, model sizes); nested dicts (e.g. the fuzzer's
        # per-status counts) are outcomes, not configuration, and stay out of the label
        items = [f"{k}={_scalar(x)}" for k, x in sorted(v.items()) if x is not None and not isinstance(x, dict)]
        return "(" + ",".join(items) + ")" if items else None
    if isinstance(v, (list, tuple)):
        return ",".join(_scalar(x) for x in v)
    return _scalar(v)


def config_label(config: Dict[str, Any]) -> str:
    """``ws=2 split mlp mean mode=default grad_sample_mode=ghost_fsdp local_batches=even``: every
    config key with a value (absent ones -- ``None`` -- are left out), world size first, then data
    layout, model and reduction by value, then ``mode`` and the other keys alphabetically as
    ``key=value``. Used in the terminal table, progress lines, JUnit names and markdown."""
    parts = []
    if config.get("world_size") is not None:
        parts.append(f"ws={_value(config['world_size'])}")
    for k in _POSITIONAL:
        text = _value(config.get(k))
        if text is not None:
            parts.append(text)
    rest = sorted(k for k in config if k not in ("world_size",) + _POSITIONAL)
    if "mode" in rest:
        rest.remove("mode")
        rest.insert(0, "mode")
    for k in rest:
        text = _value(config[k])
        if text is not None:
            parts.append(f"{k}{text}" if text.startswith("(") else f"{k}={text}")
    return " ".join(parts)


def verdict_label(v: Verdict) -> str:
    """``v.label`` (kept for callers that map over verdicts)."""
    return v.label


__all__ = ["Verdict", "STATUSES", "FAILING", "RUN_DIAGNOSES", "DIAGNOSES", "INTERNAL_ERROR", "CONFIG_KEYS",
           "config_label", "verdict_label"]
