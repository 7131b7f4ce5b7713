"""Reports of a gate run: JSON (``schema/report.schema.json``), JUnit XML, markdown, the terminal
table, and the exit code (``exit_code``, the one place it is computed; the codes are ``EXIT_*``
below, stated once, in docs/gate.md, "Exit codes"). ``finish(plan, verdicts, target)`` judges the
verdicts against the plan's expectations, writes every report the plan asks for and returns it.

All four are pure functions of the verdict list plus run metadata (and, with ``--expect``, the
``expectations.Outcome`` saying which failures were expected), so they cannot disagree. Every
verdict is named by ``config_label``, which renders every config key that has a value: labels
are unique within a run and stable across runs (JUnit history and CI reporters key on them).
"""

from __future__ import annotations

import io
import json
import math
import os
import platform
import shutil
import sys
import xml.etree.ElementTree as ET
from typing import TYPE_CHECKING, Any, Dict, List, Optional, cast

from .. import __version__
from ..harness.rank_groups import headline
from . import causes
from ..verdict import FAILING, INTERNAL_ERROR, STATUSES, Verdict, config_label, verdict_label  # noqa: F401

if TYPE_CHECKING:  # pragma: no cover
    from .expectations import Entry, Outcome
    from .plan import RunPlan

EXIT_OK, EXIT_FAIL, EXIT_USAGE, EXIT_INTERNAL = 0, 1, 2, 3

#: version of the JSON report's layout (``schema/report.schema.json``); bumped on any change that
#: can break a reader (a removed/renamed field or a changed meaning), not for added fields
SCHEMA_VERSION = 1
#: config keys shown by value alone, in this order, after ``ws=N``; every other key is ``key=value``


def summary(verdicts: List[Verdict], outcome: Optional["Outcome"] = None) -> Dict[str, int]:
    """Counts per status, plus ``expected``: how many of the failing ones an expectations file
    listed (0 without one). ``fail``/``hang``/``error`` count expected failures too."""
    out = {s: 0 for s in STATUSES}
    for v in verdicts:
        out[v.status] += 1
    out["expected"] = sum(1 for v in verdicts if outcome is not None and outcome.is_expected(v))
    return out


def is_internal_error(v: Verdict) -> bool:
    return v.diagnosis == INTERNAL_ERROR


def result_json(v: Verdict, outcome: Optional["Outcome"] = None) -> Dict[str, Any]:
    """One ``results[]`` entry: the verdict's fields plus ``label`` and ``expected`` (and, for an
    expected failure, the ``expectation`` that listed it)."""
    d = v.to_json()
    d["label"] = config_label(v.config)
    entry = outcome.entry_for(v) if outcome is not None else None
    d["expected"] = entry is not None
    if entry is not None:
        d["expectation"] = entry.to_json()
    return d


def to_json(verdicts: List[Verdict], target: Dict[str, Any], backend: str, outcome: Optional["Outcome"] = None,
            exit_code: Optional[int] = None, seed: Optional[int] = None) -> Dict[str, Any]:
    import torch

    return {
        "schema_version": SCHEMA_VERSION,
        "tool": "dpfsdp-verify",
        "version": __version__,
        "target": target,
        "environment": {"torch": torch.__version__, "backend": backend, "python": platform.python_version()},
        "results": [result_json(v, outcome) for v in verdicts],
        "summary": summary(verdicts, outcome),
        "expectations": outcome.to_json() if outcome is not None else None,
        "exit_code": exit_code,
        "seed": seed,
    }


def dumps_json(verdicts: List[Verdict], target: Dict[str, Any], backend: str, outcome: Optional["Outcome"] = None,
               exit_code: Optional[int] = None, seed: Optional[int] = None) -> str:
    return json.dumps(to_json(verdicts, target, backend, outcome, exit_code, seed), indent=2,
                      default=_jsonable) + "\n"


def write_json(path: str, verdicts: List[Verdict], target: Dict[str, Any], backend: str,
               outcome: Optional["Outcome"] = None, exit_code: Optional[int] = None,
               seed: Optional[int] = None) -> None:
    write_atomically(path, dumps_json(verdicts, target, backend, outcome, exit_code, seed))


def write_atomically(path: str, text: str) -> None:
    """``text`` into ``path`` through a temporary file beside it and a rename: a reader (or a
    process that dies while writing it) sees the old report or the new one, never half of one."""
    tmp = os.path.join(os.path.dirname(os.path.abspath(path)), f".{os.path.basename(path)}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _jsonable(o):
    if hasattr(o, "tolist"):
        return o.tolist()
    return str(o)


def junit_names(verdicts: List[Verdict]) -> List[tuple]:
    """``(classname, name)`` per verdict. Labels are unique by construction (every config key is in
    them); should two verdicts ever share one, the later gets `` #2``, `` #3`` so that reporters
    that key on (classname, name) still see every result."""
    seen: Dict[tuple, int] = {}
    out = []
    for v in verdicts:
        key = (f"dpfsdp_verify.{v.property}", config_label(v.config))
        seen[key] = seen.get(key, 0) + 1
        out.append(key if seen[key] == 1 else (key[0], f"{key[1]} #{seen[key]}"))
    return out


def write_junit(path: str, verdicts: List[Verdict], target_name: str, outcome: Optional["Outcome"] = None) -> None:
    """One testcase per property x config; failure text = the diagnosis message (the ``message``
    attribute: its ``headline``, cut at a clause boundary if it is long; the body: all of it). An expected
    failure (``--expect``) is a ``skipped`` testcase of type ``expected_failure`` whose message is
    the expectation's reason (as pytest reports an xfail); an expectation that no longer holds is
    a failed testcase ``dpfsdp_verify.expectations`` named after the entry."""
    unmet = outcome.unmet if outcome is not None else []
    expected = [outcome is not None and outcome.is_expected(v) for v in verdicts]
    failures = sum(1 for v, x in zip(verdicts, expected) if v.status == "fail" and not x) + len(unmet)
    errors = sum(1 for v, x in zip(verdicts, expected) if v.status in ("error", "hang") and not x)
    skipped = sum(1 for v, x in zip(verdicts, expected) if v.status == "skip" or x)
    suite = ET.Element("testsuite", name=f"dpfsdp-verify[{target_name}]", tests=str(len(verdicts) + len(unmet)),
                       failures=str(failures), errors=str(errors), skipped=str(skipped),
                       time=f"{sum(v.seconds for v in verdicts):.3f}")
    for v, x, (classname, name) in zip(verdicts, expected, junit_names(verdicts)):
        case = ET.SubElement(suite, "testcase", classname=classname, name=name, time=f"{v.seconds:.3f}")
        head = f"[{v.diagnosis}] {v.message}" if v.diagnosis else v.message
        body = head + (f"\nrepro: {v.repro}" if v.repro else "") + (f"\n\n{v.details}" if v.details else "")
        if x:
            entry = cast("Entry", cast("Outcome", outcome).entry_for(v))  # x: the outcome expects v
            ET.SubElement(case, "skipped", type="expected_failure",
                          message=headline(f"expected {v.status} ({v.diagnosis}): "
                                           f"{entry.describe_reason()}")).text = body
        elif v.status == "fail":
            ET.SubElement(case, "failure", message=headline(head), type=v.diagnosis or "fail").text = body
        elif v.status in ("error", "hang"):
            ET.SubElement(case, "error", message=headline(head), type=v.diagnosis or v.status).text = body
        elif v.status == "skip":
            ET.SubElement(case, "skipped", message=headline(v.message))
    for u in unmet:
        case = ET.SubElement(suite, "testcase", classname="dpfsdp_verify.expectations", name=u.entry.label(), time="0")
        ET.SubElement(case, "failure", message=headline(u.message), type="expectation_not_met").text = u.message
    root = ET.Element("testsuites")
    root.append(suite)
    ET.indent(root)
    buf = io.BytesIO()
    ET.ElementTree(root).write(buf, encoding="utf-8", xml_declaration=True)
    write_atomically(path, buf.getvalue().decode("utf-8"))


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
                     "reduction": v.config.get("reduction"), "dtype": v.config.get("dtype"),
                     "label": config_label(v.config),
                     "mean_ratio": float(ratio), "sqrt_n": math.sqrt(ws), "status": v.status,
                     "diagnosis": v.diagnosis})
    return rows


def _status_text(v: Verdict, outcome: Optional["Outcome"]) -> str:
    if outcome is not None and outcome.is_expected(v):
        return "xfail"
    return v.status.upper() if v.status != "pass" else "pass"


def _md(text: str) -> str:
    """Text safe inside a markdown table cell."""
    return str(text).replace("|", "\\|").replace("\n", " ")


def to_markdown(verdicts: List[Verdict], target: Dict[str, Any], outcome: Optional["Outcome"] = None) -> str:
    """A page a GitHub step summary renders as is: text and tables only (no images, no links to
    files beside it)."""
    s = summary(verdicts, outcome)
    lines = [f"# dpfsdp-verify: {target.get('name')} {target.get('version', '')}", ""]
    opacus = target.get("opacus")
    if opacus:
        lines += [f"opacus imported: {opacus.get('version')} from `{opacus.get('path')}`", ""]
    lines += [f"**{counts_text(verdicts, outcome)}**", ""]
    if outcome is not None:
        lines += [f"expectations: `{outcome.file}` ({len(outcome.entries)} entries; {s['expected']} expected "
                  f"failures; {len(outcome.unmet)} no longer hold)", ""]
    bad = [v for v in verdicts if v.status in FAILING and not (outcome is not None and outcome.is_expected(v))]
    found = causes.group(bad)
    if found:  # one cause, one finding: the blocks first, every verdict folded below
        lines += [f"## {len(bad)} unexpected failure(s), {len(found)} cause(s)", ""]
        for i, c in enumerate(found, 1):
            lines += [c.markdown(i), ""]
    lines += ["<details><summary>every verdict</summary>", "",
              "| property | config | status | diagnosis | seconds |", "|---|---|---|---|---|"]
    for v in verdicts:
        status = _badge(_status_text(v, outcome))
        if outcome is not None and outcome.is_expected(v):
            status += f" #{cast('Entry', outcome.entry_for(v)).index}"
        lines.append(f"| `{v.property}` | {_md(config_label(v.config))} | {status} | "
                     f"{v.diagnosis or ''} | {v.seconds:.1f} |")
    lines += ["", "</details>"]
    rows = norm_ratio_rows(verdicts)
    if rows:
        lines += ["", "## Per-sample norm ratio (target / reference) vs the sqrt(N) line", "",
                  "| world size | layout | model | reduction | dtype | measured ratio | sqrt(N) | status |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in rows:
            lines.append(f"| {r['world_size']} | {r['data_layout']} | {r['model']} | {r['reduction'] or ''} | "
                         f"{r['dtype'] or ''} | "
                         f"{r['mean_ratio']:.6f} | {r['sqrt_n']:.6f} | {r['status']} {r['diagnosis'] or ''} |")
    if outcome is not None and outcome.unmet:
        lines += ["", "## Expectations that no longer hold", ""]
        lines += [f"- {u.message}" for u in outcome.unmet]
    if outcome is not None and outcome.entries:
        lines += ["", "## Expectations", "", "| entry | expected failures this run | reason |", "|---|---|---|"]
        for e in outcome.entries:
            n = sum(1 for v in verdicts if outcome.entry_for(v) is e)
            lines.append(f"| {_md(e.label())} | {n} | {_md(e.describe_reason())} |")
    return "\n".join(lines) + "\n"


def plot_norm_ratios(verdicts: List[Verdict], path: str) -> bool:
    """A small PNG of measured ratios vs sqrt(N) when matplotlib is importable; False otherwise.
    Written beside the markdown page for CI artifacts; the page itself never links it."""
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
    return {"pass": "pass", "FAIL": "**FAIL**", "HANG": "**HANG**", "ERROR": "**ERROR**", "SKIP": "skip",
            "xfail": "xfail (expected)"}[status]


def terminal_table(verdicts: List[Verdict], outcome: Optional["Outcome"] = None, width: int = 0) -> str:
    """The per-verdict table (``-v``; ``xfail`` = a failure the expectations file lists). ``width``:
    the terminal's columns, which the config column is cut to fit (0: no limit)."""
    rows = [(v.property, config_label(v.config), _status_text(v, outcome), v.diagnosis or "", f"{v.seconds:.1f}s")
            for v in verdicts]
    head = ("property", "config", "status", "diagnosis", "time")
    widths = [max(len(str(r[i])) for r in rows + [head]) for i in range(len(head))]
    if width:  # the config column gives way; a label cut short ends in "~"
        widths[1] = max(len(head[1]), min(widths[1], width - sum(widths) + widths[1] - 2 * (len(head) - 1)))
        rows = [(r[0], r[1] if len(r[1]) <= widths[1] else r[1][:widths[1] - 1] + "~", *r[2:]) for r in rows]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    out = [fmt.format(*head), fmt.format(*("-" * w for w in widths))]
    out += [fmt.format(*r).rstrip() for r in rows]
    return "\n".join(out)


def counts_text(verdicts: List[Verdict], outcome: Optional["Outcome"] = None) -> str:
    """The run in pytest's words: ``114 passed, 33 xfailed, 0 unmet`` (an expected failure counts as
    ``xfailed`` only; ``unmet``: expectations that no longer hold, with ``--expect``)."""
    words = {"pass": "passed", "fail": "failed", "hang": "hung", "error": "errors", "skip": "skipped"}
    n = {w: 0 for w in words.values()}
    xfailed = 0
    for v in verdicts:
        if outcome is not None and outcome.is_expected(v):
            xfailed += 1
        else:
            n[words[v.status]] += 1
    parts = [f"{c} {'error' if w == 'errors' and c == 1 else w}" for w, c in n.items() if c or w == "passed"]
    if outcome is not None:
        parts += [f"{xfailed} xfailed", f"{len(outcome.unmet)} unmet"]
    return ", ".join(parts)


def last_line(code: int, counts: str, causes: int) -> str:
    """What a run's output ends on: the outcome and the exit code, in words."""
    word = {EXIT_OK: "PASSED", EXIT_FAIL: "FAILED", EXIT_INTERNAL: "INTERNAL ERROR"}.get(code, "FAILED")
    why = f"; {causes} cause{'s' if causes != 1 else ''} above" if causes else ""
    return f"dpfsdp-verify: {word} (exit {code}): {counts}{why}"


def exit_code(verdicts, outcome=None) -> int:
    if any(is_internal_error(v) for v in verdicts):
        return EXIT_INTERNAL
    if outcome is not None:
        return EXIT_OK if outcome.holds else EXIT_FAIL
    return EXIT_FAIL if any(v.status in FAILING for v in verdicts) else EXIT_OK


def capped_note(verdicts: List) -> str:
    """What the exit line adds when exploration's time cap (``--explore-cap``) stopped draws: which
    properties ran fewer of the seed's draws than asked; "" when none did (docs/explore.md)."""
    cut = []
    for v in verdicts:
        ex = (v.config or {}).get("explore") if isinstance(v.config, dict) else None
        if isinstance(ex, dict) and ex.get("capped"):
            cut.append(f"{v.property} {ex.get('draws_asked', 0) - ex.get('unrun_draws', 0)} of "
                       f"{ex.get('draws_asked', 0)} draws")
    if not cut:
        return ""
    return ("exploration hit its time cap, --explore-cap: " + ", ".join(cut) + " ran; the seed's other "
            "configurations were not judged")


def finish(plan: "RunPlan", verdicts: List, target: Dict[str, Any]) -> int:
    """Judge, print, write every requested report; the exit code. With ``--json -`` the JSON is
    the only thing on stdout (the table and messages go to stderr)."""
    from .expectations import apply, environment

    expectations, reports = plan.expectations, plan.reports
    backend, seed = plan.options.backend, plan.options.seed
    outcome = apply(expectations, verdicts, environment(backend)) if expectations is not None else None
    code = exit_code(verdicts, outcome)
    json_to_stdout = reports.json == "-"
    out = sys.stderr if json_to_stdout else sys.stdout
    width = shutil.get_terminal_size((100, 24)).columns
    unexpected = [v for v in verdicts if v.status in FAILING and not (outcome is not None and outcome.is_expected(v))]
    if plan.verbose:  # every verdict: the table, then each unexpected failure on its own
        print(terminal_table(verdicts, outcome, width), file=out)
        for v in unexpected:
            print(f"\n{verdict_label(v)} {v.status} ({v.diagnosis}): {v.message}"
                  + (f"\n  repro: {v.repro}" if v.repro else ""), file=out)
    for v in unexpected:
        if is_internal_error(v):
            print(f"\n{verdict_label(v)}: this is a bug in dpfsdp-verify, not a verdict on the target; please "
                  "report it with:\n" + "\n".join("    " + line for line in (v.details or "").rstrip().splitlines()),
                  file=out)
    _print_context(verdicts, outcome, plan.verbose, out)
    if seed is not None:
        print(f"\nseed {seed}: 'dpfsdp-verify run ... --seed {seed}' replays this run's noise and sampling draws",
              file=out)
    found = causes.group(unexpected)
    if found:
        print(f"\n{len(unexpected)} unexpected failure(s), {len(found)} cause(s)"
              + ("" if plan.verbose else " (every verdict: -v, or the JSON / JUnit report)") + ":", file=out)
        for i, c in enumerate(found, 1):
            print(c.block(i, width), file=out)
    if plan.write_expect:
        _write_baseline(plan, verdicts, target, out)
    note = capped_note(verdicts)  # exploration's time cap hit: the last line says so
    print("\n" + last_line(code, counts_text(verdicts, outcome), len(found)) + (f" ({note})" if note else ""),
          file=out)
    if reports.json and json_to_stdout:
        sys.stdout.write(dumps_json(verdicts, target, backend, outcome, code, seed))
        sys.stdout.flush()
    write_reports(plan, verdicts, target, outcome, code)
    return code


def _write_baseline(plan: "RunPlan", verdicts: List[Verdict], target: Dict[str, Any], out) -> None:
    """``--write-expect FILE``: the run's failures as an expectations file (``baseline.py``)."""
    from .baseline import baseline
    from .expectations import environment

    path = cast(str, plan.write_expect)
    text = baseline(verdicts, environment(plan.options.backend),
                    f"baseline of {target.get('name')} {target.get('version', '')}".strip()
                    + f", written by dpfsdp-verify {__version__} --write-expect")
    write_atomically(path, text)
    n = text.count("[[expect]]")
    print(f"\nwrote {n} expectation(s) to {path}: 'dpfsdp-verify run ... --expect {path}' accepts these failures "
          "and fails on any other", file=out)


def _print_context(verdicts: List[Verdict], outcome: Optional["Outcome"], verbose: bool, out) -> None:
    """Skips (each, with ``-v``; else one line per reason) and how the expectations file fared."""
    skipped = [v for v in verdicts if v.status == "skip"]
    if skipped:  # a skip is never silent: it says which part of the selection made it inapplicable
        print("\nskipped:", file=out)
        if verbose:
            for v in skipped:
                print(f"  {verdict_label(v)}: {v.message}", file=out)
        else:
            reasons: Dict[str, List[Verdict]] = {}
            for v in skipped:
                reasons.setdefault(v.message, []).append(v)
            for message, vs in reasons.items():
                print(f"  {verdict_label(vs[0])}" + (f" and {len(vs) - 1} more" if len(vs) > 1 else "")
                      + f": {message}", file=out)
    if outcome is not None:
        for e in outcome.entries:
            n = sum(1 for v in verdicts if outcome.entry_for(v) is e)
            if n:
                print(f"\nexpected ({n} verdict(s), xfail): expectation {e.label()}: {e.describe_reason()}",
                      file=out)
        for u in outcome.unmet:
            print(f"\n{u.message}", file=out)
        if outcome.not_exercised:
            print(f"\n{len(outcome.not_exercised)} expectation(s) not exercised by this selection: "
                  + "; ".join(e.label() for e in outcome.not_exercised), file=out)


def write_reports(plan: "RunPlan", verdicts: List, target: Dict[str, Any], outcome: Optional["Outcome"], code: int,
                  plot: bool = True) -> None:
    """Every report file the plan asks for (``--json`` unless ``-``, ``--junit``, ``--markdown`` and,
    with ``plot``, its PNG), each written atomically (``write_atomically``)."""
    reports = plan.reports
    backend, seed = plan.options.backend, plan.options.seed
    if reports.json and reports.json != "-":
        write_json(reports.json, verdicts, target, backend, outcome, code, seed)
    if reports.junit:
        write_junit(reports.junit, verdicts, target["name"], outcome)
    if reports.markdown:
        # a PNG for the CI artifacts, beside the page; the page does not link it (a step summary
        # cannot show a file from the runner's disk)
        if plot:
            plot_norm_ratios(verdicts, os.path.splitext(reports.markdown)[0] + "-norm-ratio.png")
        write_atomically(reports.markdown, to_markdown(verdicts, target, outcome))


__all__ = ["EXIT_OK", "EXIT_FAIL", "EXIT_USAGE", "EXIT_INTERNAL", "SCHEMA_VERSION", "summary", "is_internal_error",
           "result_json", "to_json", "dumps_json", "write_json", "junit_names", "write_junit", "norm_ratio_rows",
           "to_markdown", "plot_norm_ratios", "terminal_table", "counts_text", "last_line", "exit_code", "finish",
           "write_reports",
           "write_atomically"]
