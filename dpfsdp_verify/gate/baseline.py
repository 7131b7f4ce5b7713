"""A baseline in one command: ``dpfsdp-verify run --write-expect FILE`` writes the run's failures as
an expectations file (``expectations.py``'s format) that a following ``--expect FILE`` run accepts
exactly -- mypy's and ruff's baselines, phpstan's ``--generate-baseline``.

One entry per cause (``causes.py``) and property (an entry names one property): its ``config`` is
generalised as far as the run's verdicts allow -- a key is left out when the entry selects no
verdict that did not fail this way without it; a world size from which every verdict failed is
``">= N"`` -- its ``reason`` is the cause in words, its ``when`` the environment (the opacus
release, the torch minor series, the backend). Before it is written the file is parsed and judged
against the run's own verdicts (``expectations.apply``): it must hold, or the cause falls back to
one entry per verdict with its whole configuration.
"""

from __future__ import annotations

import json
from typing import Any, Dict, List, Optional, Sequence

from ..verdict import FAILING, INTERNAL_ERROR, Verdict
from . import causes
from .expectations import FORMAT_VERSION, _matches as matches, apply, parse, release

#: config keys never written: one value per run, and matching them would only narrow the entry
SKIP_KEYS = ("grad_sample_mode",)


def _constraint(key: str, group: Sequence[Verdict], others: Sequence[Verdict]) -> Optional[Any]:
    """What ``key`` must match for the verdicts of ``group`` (``None``: not every one has a value)."""
    values: List[Any] = []
    for v in group:
        x = v.config.get(key)
        if x is None:
            return None
        if x not in values:
            values.append(x)
    if key == "world_size" and all(isinstance(x, int) and not isinstance(x, bool) for x in values):
        low = min(values)
        if all(o.config.get(key) in values for o in others if isinstance(o.config.get(key), int)
               and o.config[key] >= low):
            return f">= {low}"
    return values[0] if len(values) == 1 else sorted(values, key=str)


def generalise(group: Sequence[Verdict], others: Sequence[Verdict]) -> Optional[Dict[str, Any]]:
    """The smallest ``config`` (greedy) that selects every verdict of ``group`` and none of ``others``
    (the same property's other non-skipped verdicts); ``None`` when the keys cannot tell them apart."""
    config: Dict[str, Any] = {}
    left = list(others)
    keys = [k for k in dict.fromkeys(k for v in group for k in v.config) if k not in SKIP_KEYS]
    while left:
        best, best_out = None, 0
        for k in keys:
            want = None if k in config else _constraint(k, group, left)
            if want is None:
                continue
            out = sum(1 for o in left if k not in o.config or not matches(want, o.config[k]))
            if out > best_out:
                best, best_out = (k, want), out
        if best is None:
            return None
        config[best[0]] = best[1]
        left = [o for o in left if best[0] in o.config and matches(best[1], o.config[best[0]])]
    return config


def when(env: Dict[str, Optional[str]]) -> Dict[str, str]:
    """The environment an entry was seen in: this opacus release, this torch minor series, backend."""
    out: Dict[str, str] = {}
    if env.get("opacus") and release(env["opacus"] or ""):
        out["opacus"] = "== " + ".".join(map(str, release(env["opacus"] or "") or ()))
    torch = release(env.get("torch") or "")
    if torch and len(torch) >= 2:
        out["torch"] = f">= {torch[0]}.{torch[1]}, < {torch[0]}.{torch[1] + 1}"
    if env.get("backend"):
        out["backend"] = str(env["backend"])
    return out


def entries(verdicts: Sequence[Verdict], env: Dict[str, Optional[str]], exact: bool = False) -> List[Dict[str, Any]]:
    """The ``[[expect]]`` tables of ``verdicts``' failures (module doc); ``exact``: every entry with
    a verdict's whole configuration."""
    failing = [v for v in verdicts if v.status in FAILING and v.diagnosis != INTERNAL_ERROR]
    stamp = when(env)
    out = []
    for cause in causes.group(failing):
        reason = cause.reason()
        for prop in cause.properties():
            group = [v for v in cause.verdicts if v.property == prop]
            others = [v for v in verdicts if v.property == prop and v.status != "skip" and v not in group]
            config = None if exact else generalise(group, others)
            configs = [config] if config is not None else [
                {k: x for k, x in v.config.items() if x is not None and k not in SKIP_KEYS} for v in group]
            statuses = sorted({v.status for v in group})
            for cfg in configs:
                out.append({"property": prop, "config": cfg, "status": statuses[0] if len(statuses) == 1
                            else statuses, "diagnosis": group[0].diagnosis, "reason": reason,
                            "when": dict(stamp)})
    return out


def _toml_value(x: Any) -> str:
    if isinstance(x, bool):
        return "true" if x else "false"
    if isinstance(x, (int, float)):
        return repr(x)
    if isinstance(x, list):
        return "[" + ", ".join(_toml_value(y) for y in x) + "]"
    if isinstance(x, dict):
        return "{ " + ", ".join(f"{k} = {_toml_value(y)}" for k, y in x.items()) + " }"
    # a JSON string is a TOML basic string, but for JSON's surrogate-pair escapes of characters
    # beyond the BMP, which TOML refuses: those are written as themselves
    return json.dumps(str(x), ensure_ascii=False)


def to_toml(tables: Sequence[Dict[str, Any]], description: str) -> str:
    lines = [f"version = {FORMAT_VERSION}", f"description = {_toml_value(description)}", ""]
    for t in tables:
        lines.append("[[expect]]")
        lines += [f"{k} = {_toml_value(x)}" for k, x in t.items()]
        lines.append("")
    return "\n".join(lines)


def baseline(verdicts: Sequence[Verdict], env: Dict[str, Optional[str]], description: str) -> str:
    """The expectations file's text; checked to hold on ``verdicts`` (module doc)."""
    text = to_toml(entries(verdicts, env), description)
    if not apply(parse(text), verdicts, env).holds:  # a generalisation too wide: list every verdict
        text = to_toml(entries(verdicts, env, exact=True), description)
    return text


__all__ = ["SKIP_KEYS", "generalise", "when", "entries", "to_toml", "baseline"]
