"""Reports of a gate run: JSON (``schema/report.schema.json``), JUnit XML, markdown, the terminal
table and the exit line, each the wording of one ``result.RunResult`` (the verdicts judged once:
expectations, causes, labels, exit code; ``result.py``). ``finish(plan, result)`` prints the summary,
writes every report the plan asks for and returns the exit code.

All four are pure functions of the one result, so they cannot disagree. Every verdict is named by
its ``config_label`` (``RunResult.labels``), which renders every config key that has a value:
labels are unique within a run and stable across runs (JUnit history and CI reporters key on them).
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
from typing import TYPE_CHECKING, Any, Dict, List, cast

from .. import __version__
from ..verdict import FAILING, INTERNAL_ERROR, STATUSES, Verdict, config_label  # noqa: F401
from .result import EXIT_FAIL, EXIT_INTERNAL, EXIT_OK, EXIT_USAGE, RunResult, exit_code

if TYPE_CHECKING:  # pragma: no cover
    from .expectations import Entry
    from .plan import Reports, RunPlan

#: version of the JSON report's layout (``schema/report.schema.json``); bumped on any change that
#: can break a reader (a removed/renamed field or a changed meaning), not for added fields
SCHEMA_VERSION = 1
#: how long a JUnit ``message`` may be before ``headline`` shortens it at a clause boundary
HEADLINE_CHARS = 500


def summary(r: RunResult) -> Dict[str, int]:
    """Counts per status, plus ``expected``: how many of the failing ones an expectations file
    listed (0 without one). ``fail``/``hang``/``error`` count expected failures too."""
    out = {s: 0 for s in STATUSES}
    for v in r.verdicts:
        out[v.status] += 1
    out["expected"] = sum(1 for v in r.verdicts if r.expected(v))
    return out


def is_internal_error(v: Verdict) -> bool:
    return v.diagnosis == INTERNAL_ERROR


def result_json(r: RunResult, i: int) -> Dict[str, Any]:
    """One ``results[]`` entry: the verdict's fields plus ``label`` and ``expected`` (and, for an
    expected failure, the ``expectation`` that listed it)."""
    v = r.verdicts[i]
    d = v.to_json()
    d["label"] = r.labels[i]
    entry = r.outcome.entry_for(v) if r.outcome is not None else None
    d["expected"] = entry is not None
    if entry is not None:
        d["expectation"] = entry.to_json()
    return d


def to_json(r: RunResult) -> Dict[str, Any]:
    import torch

    return {
        "schema_version": SCHEMA_VERSION,
        "tool": "dpfsdp-verify",
        "version": __version__,
        "target": r.target,
        "environment": {"torch": torch.__version__, "backend": r.backend, "python": platform.python_version()},
        "results": [result_json(r, i) for i in range(len(r.verdicts))],
        "summary": summary(r),
        "expectations": r.outcome.to_json() if r.outcome is not None else None,
        "exit_code": r.code,
        "seed": r.seed,
    }


def dumps_json(r: RunResult) -> str:
    return json.dumps(to_json(r), indent=2, default=_jsonable) + "\n"


def write_json(path: str, r: RunResult) -> None:
    write_atomically(path, dumps_json(r))


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


def junit_names(r: RunResult) -> List[tuple]:
    """``(classname, name)`` per verdict. Labels are unique by construction (every config key is in
    them); should two verdicts ever share one, the later gets `` #2``, `` #3`` so that reporters
    that key on (classname, name) still see every result."""
    seen: Dict[tuple, int] = {}
    out = []
    for v, label in zip(r.verdicts, r.labels):
        key = (f"dpfsdp_verify.{v.property}", label)
        seen[key] = seen.get(key, 0) + 1
        out.append(key if seen[key] == 1 else (key[0], f"{key[1]} #{seen[key]}"))
    return out


def headline(text: str, limit: int = HEADLINE_CHARS) -> str:
    """``text`` if it fits in ``limit`` characters, else cut at its last clause boundary ("; ",
    ". ") that fits, marked as cut: for fields of fixed size (JUnit's ``message`` attribute) whose
    full text travels elsewhere (the testcase's body)."""
    if len(text) <= limit:
        return text
    mark = " [...]"
    room = text[:limit - len(mark)]
    cut = max(room.rfind("; "), room.rfind(". "))
    if cut < limit // 2:  # no boundary late enough: cut at a word
        cut = room.rfind(" ")
    return room[:cut if cut > 0 else len(room)].rstrip(" ;,.") + mark


def write_junit(path: str, r: RunResult) -> None:
    """One testcase per property x config; failure text = the diagnosis message (the ``message``
    attribute: its ``headline``, cut at a clause boundary if it is long; the body: all of it). An expected
    failure (``--expect``) is a ``skipped`` testcase of type ``expected_failure`` whose message is
    the expectation's reason (as pytest reports an xfail); an expectation that no longer holds is
    a failed testcase ``dpfsdp_verify.expectations`` named after the entry."""
    verdicts = r.verdicts
    unmet = r.outcome.unmet if r.outcome is not None else []
    expected = [r.expected(v) for v in verdicts]
    failures = sum(1 for v, x in zip(verdicts, expected) if v.status == "fail" and not x) + len(unmet)
    errors = sum(1 for v, x in zip(verdicts, expected) if v.status in ("error", "hang") and not x)
    skipped = sum(1 for v, x in zip(verdicts, expected) if v.status == "skip" or x)
    suite = ET.Element("testsuite", name=f"dpfsdp-verify[{r.target['name']}]", tests=str(len(verdicts) + len(unmet)),
                       failures=str(failures), errors=str(errors), skipped=str(skipped),
                       time=f"{sum(v.seconds for v in verdicts):.3f}")
    for v, x, (classname, name) in zip(verdicts, expected, junit_names(r)):
        case = ET.SubElement(suite, "testcase", classname=classname, name=name, time=f"{v.seconds:.3f}")
        head = f"[{v.diagnosis}] {v.message}" if v.diagnosis else v.message
        body = head + (f"\nrepro: {v.repro}" if v.repro else "") + (f"\n\n{v.details}" if v.details else "")
        if x:
            entry = cast("Entry", r.outcome.entry_for(v) if r.outcome is not None else None)  # x: expected
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


def norm_ratio_rows(r: RunResult) -> List[Dict[str, Any]]:
    """Per verdict that measured per-sample norms (evidence ``mean_ratio``: the mean ratio of the
    target's norms to the reference's): that ratio next to sqrt(N)."""
    rows = []
    for v, label in zip(r.verdicts, r.labels):
        ratio = v.evidence.get("mean_ratio")
        if ratio is None:
            continue
        ws = v.config.get("world_size", 1)
        rows.append({"world_size": ws, "data_layout": v.config.get("data_layout"), "model": v.config.get("model"),
                     "reduction": v.config.get("reduction"), "dtype": v.config.get("dtype"),
                     "label": label,
                     "mean_ratio": float(ratio), "sqrt_n": math.sqrt(ws), "status": v.status,
                     "diagnosis": v.diagnosis})
    return rows


def _status_text(r: RunResult, v: Verdict) -> str:
    if r.expected(v):
        return "xfail"
    return v.status.upper() if v.status != "pass" else "pass"


def _md(text: str) -> str:
    """Text safe inside a markdown table cell."""
    return str(text).replace("|", "\\|").replace("\n", " ")


def to_markdown(r: RunResult) -> str:
    """A page a GitHub step summary renders as is: text and tables only (no images, no links to
    files beside it)."""
    s, target, outcome = summary(r), r.target, r.outcome
    lines = [f"# dpfsdp-verify: {target.get('name')} {target.get('version', '')}", ""]
    opacus = target.get("opacus")
    if opacus:
        lines += [f"opacus imported: {opacus.get('version')} from `{opacus.get('path')}`", ""]
    lines += [f"**{counts_text(r)}**", ""]
    if outcome is not None:
        lines += [f"expectations: `{outcome.file}` ({len(outcome.entries)} entries; {s['expected']} expected "
                  f"failures; {len(outcome.unmet)} no longer hold)", ""]
    if r.causes:  # one cause, one finding: the blocks first, every verdict folded below
        lines += [f"## {len(r.unexpected)} unexpected failure(s), {len(r.causes)} cause(s)", ""]
        for i, c in enumerate(r.causes, 1):
            lines += [c.markdown(i), ""]
    lines += ["<details><summary>every verdict</summary>", "",
              "| property | config | status | diagnosis | seconds |", "|---|---|---|---|---|"]
    for v, label in zip(r.verdicts, r.labels):
        status = _badge(_status_text(r, v))
        if outcome is not None and outcome.is_expected(v):
            status += f" #{cast('Entry', outcome.entry_for(v)).index}"
        lines.append(f"| `{v.property}` | {_md(label)} | {status} | {v.diagnosis or ''} | {v.seconds:.1f} |")
    lines += ["", "</details>"]
    rows = norm_ratio_rows(r)
    if rows:
        lines += ["", "## Per-sample norm ratio (target / reference) vs the sqrt(N) line", "",
                  "| world size | layout | model | reduction | dtype | measured ratio | sqrt(N) | status |",
                  "|---|---|---|---|---|---|---|---|"]
        for row in rows:
            lines.append(f"| {row['world_size']} | {row['data_layout']} | {row['model']} | {row['reduction'] or ''} | "
                         f"{row['dtype'] or ''} | {row['mean_ratio']:.6f} | {row['sqrt_n']:.6f} | "
                         f"{row['status']} {row['diagnosis'] or ''} |")
    if outcome is not None and outcome.unmet:
        lines += ["", "## Expectations that no longer hold", ""]
        lines += [f"- {u.message}" for u in outcome.unmet]
    if outcome is not None and outcome.entries:
        lines += ["", "## Expectations", "", "| entry | expected failures this run | reason |", "|---|---|---|"]
        for e in outcome.entries:
            n = sum(1 for v in r.verdicts if outcome.entry_for(v) is e)
            lines.append(f"| {_md(e.label())} | {n} | {_md(e.describe_reason())} |")
    return "\n".join(lines) + "\n"


def plot_norm_ratios(r: RunResult, path: str) -> bool:
    """A small PNG of measured ratios vs sqrt(N) when matplotlib is importable; False otherwise.
    Written beside the markdown page for CI artifacts; the page itself never links it."""
    rows = norm_ratio_rows(r)
    if not rows:
        return False
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(4, 3))
    ns = sorted({row["world_size"] for row in rows})
    ax.plot(ns, [math.sqrt(n) for n in ns], "--", label="sqrt(N)")
    ax.plot(ns, [1.0] * len(ns), ":", label="correct (1)")
    for layout, marker in (("replicated", "o"), ("split", "s")):
        pts = [(row["world_size"], row["mean_ratio"]) for row in rows if row["data_layout"] == layout]
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


def terminal_table(r: RunResult, width: int = 0) -> str:
    """The per-verdict table (``-v``; ``xfail`` = a failure the expectations file lists). ``width``:
    the terminal's columns, which the config column is cut to fit (0: no limit)."""
    rows = [(v.property, label, _status_text(r, v), v.diagnosis or "", f"{v.seconds:.1f}s")
            for v, label in zip(r.verdicts, r.labels)]
    head = ("property", "config", "status", "diagnosis", "time")
    widths = [max(len(str(row[i])) for row in rows + [head]) for i in range(len(head))]
    if width:  # the config column gives way; a label cut short ends in "~"
        widths[1] = max(len(head[1]), min(widths[1], width - sum(widths) + widths[1] - 2 * (len(head) - 1)))
        rows = [(row[0], row[1] if len(row[1]) <= widths[1] else row[1][:widths[1] - 1] + "~", *row[2:])
                for row in rows]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    out = [fmt.format(*head), fmt.format(*("-" * w for w in widths))]
    out += [fmt.format(*row).rstrip() for row in rows]
    return "\n".join(out)


def counts_text(r: RunResult) -> str:
    """The run in pytest's words: ``114 passed, 33 xfailed, 0 unmet`` (an expected failure counts as
    ``xfailed`` only; ``unmet``: expectations that no longer hold, with ``--expect``)."""
    words = {"pass": "passed", "fail": "failed", "hang": "hung", "error": "errors", "skip": "skipped"}
    n = {w: 0 for w in words.values()}
    xfailed = 0
    for v in r.verdicts:
        if r.expected(v):
            xfailed += 1
        else:
            n[words[v.status]] += 1
    parts = [f"{c} {'error' if w == 'errors' and c == 1 else w}" for w, c in n.items() if c or w == "passed"]
    if r.outcome is not None:
        parts += [f"{xfailed} xfailed", f"{len(r.outcome.unmet)} unmet"]
    return ", ".join(parts)


def last_line(code: int, counts: str, causes: int) -> str:
    """What a run's output ends on: the outcome and the exit code, in words."""
    word = {EXIT_OK: "PASSED", EXIT_FAIL: "FAILED", EXIT_INTERNAL: "INTERNAL ERROR"}.get(code, "FAILED")
    why = f"; {causes} cause{'s' if causes != 1 else ''} above" if causes else ""
    return f"dpfsdp-verify: {word} (exit {code}): {counts}{why}"


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


def finish(plan: "RunPlan", r: RunResult) -> int:
    """Print the summary of ``r``, write every requested report; the exit code. With ``--json -``
    the JSON is the only thing on stdout (the table and messages go to stderr)."""
    reports, code = plan.reports, r.code
    json_to_stdout = reports.json == "-"
    out = sys.stderr if json_to_stdout else sys.stdout
    width = shutil.get_terminal_size((100, 24)).columns
    names = {id(v): r.name(i) for i, v in enumerate(r.verdicts)}
    if plan.verbose:  # every verdict: the table, then each unexpected failure on its own
        print(terminal_table(r, width), file=out)
        for v in r.unexpected:
            print(f"\n{names[id(v)]} {v.status} ({v.diagnosis}): {v.message}"
                  + (f"\n  repro: {v.repro}" if v.repro else ""), file=out)
    for v in r.unexpected:
        if is_internal_error(v):
            print(f"\n{names[id(v)]}: this is a bug in dpfsdp-verify, not a verdict on the target; please "
                  "report it with:\n" + "\n".join("    " + line for line in (v.details or "").rstrip().splitlines()),
                  file=out)
    _print_context(r, names, plan.verbose, out)
    if r.seed is not None:
        print(f"\nseed {r.seed}: 'dpfsdp-verify run ... --seed {r.seed}' replays this run's noise and sampling draws",
              file=out)
    if r.causes:
        print(f"\n{len(r.unexpected)} unexpected failure(s), {len(r.causes)} cause(s)"
              + ("" if plan.verbose else " (every verdict: -v, or the JSON / JUnit report)") + ":", file=out)
        for i, c in enumerate(r.causes, 1):
            print(c.block(i, width), file=out)
    if plan.write_expect and r.baseline is not None:  # ``--write-expect FILE`` (``expectations.baseline``)
        write_atomically(plan.write_expect, r.baseline)
        print(f"\nwrote {r.baseline.count('[[expect]]')} expectation(s) to {plan.write_expect}: 'dpfsdp-verify run "
              f"... --expect {plan.write_expect}' accepts these failures and fails on any other", file=out)
    note = capped_note(r.verdicts)  # exploration's time cap hit: the last line says so
    print("\n" + last_line(code, counts_text(r), len(r.causes)) + (f" ({note})" if note else ""), file=out)
    if reports.json and json_to_stdout:
        sys.stdout.write(dumps_json(r))
        sys.stdout.flush()
    write_reports(reports, r)
    return code


def _print_context(r: RunResult, names: Dict[int, str], verbose: bool, out) -> None:
    """Skips (each, with ``-v``; else one line per reason) and how the expectations file fared."""
    skipped = [v for v in r.verdicts if v.status == "skip"]
    if skipped:  # a skip is never silent: it says which part of the selection made it inapplicable
        print("\nskipped:", file=out)
        if verbose:
            for v in skipped:
                print(f"  {names[id(v)]}: {v.message}", file=out)
        else:
            reasons: Dict[str, List[Verdict]] = {}
            for v in skipped:
                reasons.setdefault(v.message, []).append(v)
            for message, vs in reasons.items():
                print(f"  {names[id(vs[0])]}" + (f" and {len(vs) - 1} more" if len(vs) > 1 else "")
                      + f": {message}", file=out)
    outcome = r.outcome
    if outcome is not None:
        for e in outcome.entries:
            n = sum(1 for v in r.verdicts if outcome.entry_for(v) is e)
            if n:
                print(f"\nexpected ({n} verdict(s), xfail): expectation {e.label()}: {e.describe_reason()}",
                      file=out)
        for u in outcome.unmet:
            print(f"\n{u.message}", file=out)
        if outcome.not_exercised:
            print(f"\n{len(outcome.not_exercised)} expectation(s) not exercised by this selection: "
                  + "; ".join(e.label() for e in outcome.not_exercised), file=out)


def write_reports(reports: "Reports", r: RunResult, plot: bool = True) -> None:
    """Every report file ``reports`` asks for (``--json`` unless ``-``, ``--junit``, ``--markdown``
    and, with ``plot``, its PNG), each written atomically (``write_atomically``)."""
    if reports.json and reports.json != "-":
        write_json(reports.json, r)
    if reports.junit:
        write_junit(reports.junit, r)
    if reports.markdown:
        # a PNG for the CI artifacts, beside the page; the page does not link it (a step summary
        # cannot show a file from the runner's disk)
        if plot:
            plot_norm_ratios(r, os.path.splitext(reports.markdown)[0] + "-norm-ratio.png")
        write_atomically(reports.markdown, to_markdown(r))


__all__ = ["EXIT_OK", "EXIT_FAIL", "EXIT_USAGE", "EXIT_INTERNAL", "SCHEMA_VERSION", "HEADLINE_CHARS", "summary",
           "is_internal_error", "result_json", "to_json", "dumps_json", "write_json", "junit_names", "headline",
           "write_junit", "norm_ratio_rows", "to_markdown", "plot_norm_ratios", "terminal_table", "counts_text",
           "last_line", "exit_code", "capped_note", "finish", "write_reports", "write_atomically"]
