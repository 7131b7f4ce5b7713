"""Reports of a gate run: JSON (the schema in the README), JUnit XML, markdown, and the terminal table.

All four are pure functions of the verdict list plus run metadata, so they cannot disagree.
"""

from __future__ import annotations

import json
import math
import platform
import xml.etree.ElementTree as ET
from typing import Any, Dict, List, Optional

from . import __version__
from .verdict import STATUSES, Verdict


def summary(verdicts: List[Verdict]) -> Dict[str, int]:
    out = {s: 0 for s in STATUSES}
    for v in verdicts:
        out[v.status] += 1
    return out


def config_label(config: Dict[str, Any]) -> str:
    """``ws=2 split mlp mean mode=default`` -- the short form used in tables and test names."""
    parts = [f"ws={config.get('world_size')}", str(config.get("data_layout", "")), str(config.get("model", "")),
             str(config.get("reduction", "")), f"mode={config.get('mode', 'default')}"]
    return " ".join(p for p in parts if p)


def to_json(verdicts: List[Verdict], target: Dict[str, str], backend: str) -> Dict[str, Any]:
    import torch

    return {
        "tool": "dpfsdp-verify",
        "version": __version__,
        "target": target,
        "environment": {"torch": torch.__version__, "backend": backend, "python": platform.python_version()},
        "results": [v.to_json() for v in verdicts],
        "summary": summary(verdicts),
    }


def write_json(path: str, verdicts: List[Verdict], target: Dict[str, str], backend: str) -> None:
    with open(path, "w") as f:
        json.dump(to_json(verdicts, target, backend), f, indent=2, default=_jsonable)
        f.write("\n")


def _jsonable(o):
    if hasattr(o, "tolist"):
        return o.tolist()
    return str(o)


def write_junit(path: str, verdicts: List[Verdict], target_name: str) -> None:
    """One testcase per property x config; failure text = the diagnosis message."""
    s = summary(verdicts)
    suite = ET.Element("testsuite", name=f"dpfsdp-verify[{target_name}]", tests=str(len(verdicts)),
                       failures=str(s["fail"]), errors=str(s["error"] + s["hang"]), skipped=str(s["skip"]),
                       time=f"{sum(v.seconds for v in verdicts):.3f}")
    for v in verdicts:
        case = ET.SubElement(suite, "testcase", classname=f"dpfsdp_verify.{v.property}",
                             name=config_label(v.config), time=f"{v.seconds:.3f}")
        head = f"[{v.diagnosis}] {v.message}" if v.diagnosis else v.message
        body = head + (f"\nrepro: {v.repro}" if v.repro else "") + (f"\n\n{v.details}" if v.details else "")
        if v.status == "fail":
            ET.SubElement(case, "failure", message=head[:500], type=v.diagnosis or "fail").text = body
        elif v.status in ("error", "hang"):
            ET.SubElement(case, "error", message=head[:500], type=v.diagnosis or v.status).text = body
        elif v.status == "skip":
            ET.SubElement(case, "skipped", message=v.message[:500])
    root = ET.Element("testsuites")
    root.append(suite)
    ET.indent(root)
    ET.ElementTree(root).write(path, encoding="utf-8", xml_declaration=True)


def norm_ratio_rows(verdicts: List[Verdict]) -> List[Dict[str, Any]]:
    """Per verdict that measured per-sample norms (evidence ``mean_ratio``: the mean ratio of the
    target's norms to the reference's): that ratio next to sqrt(N)."""
    rows = []
    for v in verdicts:
        ratio = v.evidence.get("mean_ratio")
        if ratio is None:
            continue
        ws = v.config.get("world_size", 1)
        rows.append({"world_size": ws, "data_layout": v.config.get("data_layout"), "model": v.config.get("model"),
                     "mean_ratio": float(ratio), "sqrt_n": math.sqrt(ws), "status": v.status,
                     "diagnosis": v.diagnosis})
    return rows


def to_markdown(verdicts: List[Verdict], target: Dict[str, str], plot_path: Optional[str] = None) -> str:
    s = summary(verdicts)
    lines = [f"# dpfsdp-verify: {target.get('name')} {target.get('version', '')}", "",
             " ".join(f"**{k}** {n}" for k, n in s.items()), "",
             "| property | config | status | diagnosis | seconds |", "|---|---|---|---|---|"]
    for v in verdicts:
        lines.append(f"| `{v.property}` | {config_label(v.config)} | {_badge(v.status)} | {v.diagnosis or ''} | "
                     f"{v.seconds:.1f} |")
    rows = norm_ratio_rows(verdicts)
    if rows:
        lines += ["", "## Per-sample norm ratio (target / reference) vs the sqrt(N) line", ""]
        if plot_path:
            lines += [f"![norm ratio vs sqrt(N)]({plot_path})", ""]
        lines += ["| world size | layout | model | measured ratio | sqrt(N) | status |", "|---|---|---|---|---|---|"]
        for r in rows:
            lines.append(f"| {r['world_size']} | {r['data_layout']} | {r['model']} | {r['mean_ratio']:.6f} | "
                         f"{r['sqrt_n']:.6f} | {r['status']} {r['diagnosis'] or ''} |")
    bad = [v for v in verdicts if v.status in ("fail", "error", "hang")]
    if bad:
        lines += ["", "## What went wrong", ""]
        for v in bad:
            lines.append(f"- **{v.property}** ({config_label(v.config)}): {v.message}" +
                         (f"  \n  repro: `{v.repro}`" if v.repro else ""))
    return "\n".join(lines) + "\n"


def plot_norm_ratios(verdicts: List[Verdict], path: str) -> bool:
    """A small PNG of measured ratios vs sqrt(N) when matplotlib is importable; False otherwise."""
    rows = norm_ratio_rows(verdicts)
    if not rows:
        return False
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(4, 3))
    ns = sorted({r["world_size"] for r in rows})
    ax.plot(ns, [math.sqrt(n) for n in ns], "--", label="sqrt(N)")
    ax.plot(ns, [1.0] * len(ns), ":", label="correct (1)")
    for layout, marker in (("replicated", "o"), ("split", "s")):
        pts = [(r["world_size"], r["mean_ratio"]) for r in rows if r["data_layout"] == layout]
        if pts:
            ax.scatter(*zip(*pts), marker=marker, label=layout)
    ax.set_xlabel("world size N")
    ax.set_ylabel("norm ratio")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def _badge(status: str) -> str:
    return {"pass": "pass", "fail": "**FAIL**", "hang": "**HANG**", "error": "**ERROR**", "skip": "skip"}[status]


def terminal_table(verdicts: List[Verdict]) -> str:
    """The summary table printed at the end of a run."""
    rows = [(v.property, config_label(v.config), v.status.upper() if v.status != "pass" else "pass",
             v.diagnosis or "", f"{v.seconds:.1f}s") for v in verdicts]
    head = ("property", "config", "status", "diagnosis", "time")
    widths = [max(len(str(r[i])) for r in rows + [head]) for i in range(len(head))]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    out = [fmt.format(*head), fmt.format(*("-" * w for w in widths))]
    out += [fmt.format(*r) for r in rows]
    s = summary(verdicts)
    out.append(", ".join(f"{n} {k}" for k, n in s.items() if n or k in ("pass", "fail")))
    return "\n".join(out)
