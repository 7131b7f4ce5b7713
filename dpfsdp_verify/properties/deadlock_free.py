"""deadlock_free: every run finishes under the watchdog, including uneven, single-sample and empty
local batches.

DP meaning: none directly -- but a DP job that hangs on some batch compositions is one that users
work around by changing sampling (dropping Poisson sampling, padding batches), which silently
changes the privacy accounting. Poisson sampling makes uneven and empty local batches normal.

Scenarios (each its own job, so a hang is attributed to it), two steps each, noise on:
``even`` (the plain split), ``uneven`` (rank 0 gets more samples than the last rank), ``single``
(one sample per rank), ``empty`` (the last rank gets none; only when the target does not declare
``supports_empty_local_batches = False``). Any hang is ``hang``/``deadlock`` with the harness's
account of where the collective sequences diverge; a crash is ``error``/``rank_crash``.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence

from ..harness import Pool
from ..targets import RunSpec, TargetLoadError, load_target
from ..verdict import Verdict
from .common import Case, run_cases

ID = "deadlock_free"
MEANING = ("every run finishes, whatever the local batch sizes (uneven, one sample, empty): a job that "
           "hangs on some batches pushes users to sampling that breaks the privacy accounting")

DEFAULT_MODELS = ("mlp",)
DEFAULT_LAYOUTS = ("split",)
DEFAULT_REDUCTIONS = ("mean",)
STEPS = 2


def scenarios(ws: int) -> Dict[str, tuple]:
    """``{name: split}`` where ``split[r]`` lists rank r's global indices (same split every step)."""
    b = 2 * ws
    out = {"even": tuple(tuple(range(r, b, ws)) for r in range(ws)), "single": tuple((r,) for r in range(ws))}
    if ws > 1:
        uneven = [[] for _ in range(ws)]
        for i in range(b):  # rank 0 gets one extra, the last rank one fewer
            uneven[0 if i == b - 1 else i % ws].append(i)
        out["uneven"] = tuple(tuple(u) for u in uneven)
        empty = [list(range(r, b, ws - 1)) for r in range(ws - 1)] + [[]]
        out["empty"] = tuple(tuple(e) for e in empty)
    return out


def check(target_ref: str, *, pool: Optional[Pool] = None, world_sizes: Sequence[int] = (1, 2),
          modes: Optional[Dict[str, Dict[str, str]]] = None, grad_sample_mode: str = "ghost_fsdp",
          models: Optional[Sequence[str]] = None, data_layouts: Optional[Sequence[str]] = None,
          reductions: Optional[Sequence[str]] = None, dtype: str = "float64", backend: str = "gloo",
          timeout: float = 60.0, local_batches: Optional[Sequence[str]] = None) -> List[Verdict]:
    """``local_batches``: scenario names to run (default all of ``scenarios``)."""
    try:
        supports_empty = bool(getattr(load_target(target_ref), "supports_empty_local_batches", True))
    except TargetLoadError:
        supports_empty = True  # the ranks report the load error as each case's verdict
    cases, specs, names = [], [], []
    for label, env in (modes or {"default": {}}).items():
        for ws in world_sizes:
            for model in models or DEFAULT_MODELS:
                for red in reductions or DEFAULT_REDUCTIONS:
                    for name, split in scenarios(ws).items():
                        if local_batches is not None and name not in local_batches:
                            continue
                        spec = RunSpec(model=model, data_layout="split", reduction=red, dtype=dtype, steps=STEPS,
                                       grad_sample_mode=grad_sample_mode, global_batch_size=2 * ws,
                                       noise_multiplier=1.0, rank_batches=(split,) * STEPS)
                        cases.append(Case(ID, target_ref, spec, ws, label, dict(env), backend))
                        specs.append([spec])
                        names.append((name, [len(s) for s in split]))
    verdicts = []
    for case, spec_list, (name, sizes) in zip(cases, specs, names):
        if name == "empty" and not supports_empty:
            v = case.verdict("skip", None, "the target declares supports_empty_local_batches = False: an empty "
                             f"local batch {sizes} is not run")
        else:
            # one job per scenario, so a hang is pinned on the scenario that caused it
            out = run_cases([case], [spec_list], pool, timeout, what=f"{name} local batches {sizes}")[0]
            v = out if isinstance(out, Verdict) else case.verdict(
                "pass", None, f"{STEPS} steps with {name} local batches {sizes} finished on all "
                f"{case.world_size} rank(s)", {"local_batch_sizes": sizes})
        v.config["local_batches"] = name
        v.evidence.setdefault("local_batch_sizes", sizes)
        verdicts.append(v)
    return verdicts
