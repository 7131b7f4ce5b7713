"""docs/benchmarks.md's one current table, written by ``python benchmarks/run.py --doc docs/benchmarks.md``.

The table lies between two markers (``BEGIN`` and ``END``). A row is one figure of one section
of ``run.py`` (``section``, ``figure``, ``value``, ``measured``: the UTC minute and the load average
when its section ran). Writing it again replaces the rows of the sections just measured and keeps the
others (each with its own date), and the table it replaces goes, dated, to the top of the history
below it (the ``HISTORY`` heading): so the doc keeps one current table and a dated record of every
earlier one, and no hand edits a figure the script measures.
"""

from __future__ import annotations

import re
from typing import Dict, List, Tuple

BEGIN = "<!-- current figures: written by `python benchmarks/run.py --doc docs/benchmarks.md`; do not edit -->"
END = "<!-- end of the current figures -->"
HISTORY = "## History"
HEADER = "| section | figure | value | measured |\n|---|---|---|---|"
#: rows: (section, figure) -> (value, measured)
Rows = Dict[Tuple[str, str], Tuple[str, str]]


def value_text(v) -> str:
    """A figure as the table shows it: floats to 4 significant digits, lists and tuples joined."""
    if isinstance(v, bool):
        return str(v)
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, (list, tuple)):
        return "; ".join(value_text(x) for x in v) or "-"
    return str(v).replace("|", "/").replace("\n", " ")


def rows_of(results: dict, measured: Dict[str, str]) -> Rows:
    """``run.py``'s results (section -> figure -> value) as table rows, each dated by its section's
    ``measured`` text (when, and the load average then)."""
    return {(section, figure): (value_text(v), measured[section])
            for section, figures in results.items() for figure, v in figures.items()}


def parse(block: str) -> Rows:
    """The rows of a current table's block (``render``'s output)."""
    rows: Rows = {}
    for line in block.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[0] not in ("section", "---") and not set(cells[0]) <= {"-"}:
            rows[(cells[0], cells[1])] = (cells[2], cells[3])
    return rows


def render(rows: Rows) -> str:
    """The block between the markers: the table, sections in their first-seen order."""
    lines = [BEGIN, HEADER]
    lines += [f"| {s} | {f} | {v} | {m} |" for (s, f), (v, m) in rows.items()]
    return "\n".join(lines + [END])


def rewrite(doc: str, results: dict, measured: Dict[str, str], when: str) -> str:
    """``doc`` with its current table holding ``results`` (each section's rows dated by
    ``measured[section]``; the rows of sections
    not in ``results`` kept) and the table it held moved, dated, under ``HISTORY``. A doc without the
    markers gets the table after its first heading's paragraph; ``ValueError`` if it has no
    ``HISTORY`` heading."""
    if HISTORY + "\n" not in doc:
        raise ValueError(f"the doc has no {HISTORY!r} heading for the replaced table")
    old_rows: Rows = {}
    match = re.search(re.escape(BEGIN) + r".*?" + re.escape(END), doc, re.S)
    if match:
        old_rows = parse(match.group(0))
    new = rows_of(results, measured)
    sections = list(dict.fromkeys([s for s, _ in old_rows] + [s for s, _ in new]))
    merged: Rows = {}
    for section in sections:  # a section just measured takes its old place; new ones go last
        source = new if section in results else old_rows
        merged.update({k: v for k, v in source.items() if k[0] == section})
    block = render(merged)
    if match:
        doc = doc[:match.start()] + block + doc[match.end():]
    if old_rows:
        dates = sorted({m for _, m in old_rows.values()})
        moved = (f"### The current table until {when} (its rows measured {', '.join(dates) or '-'})\n\n"
                 + HEADER + "\n" + "\n".join(f"| {s} | {f} | {v} | {m} |" for (s, f), (v, m) in old_rows.items())
                 + "\n")
        doc = doc.replace(HISTORY + "\n", HISTORY + "\n\n" + moved, 1)
    if not match:
        at = doc.find("\n\n", doc.find("\n") + 1)
        at = len(doc) if at < 0 else at + 2
        doc = doc[:at] + block + "\n\n" + doc[at:]
    return doc


def current_rows(doc: str) -> List[Tuple[str, str, str, str]]:
    """The current table's rows of ``doc`` (``[]`` without the markers)."""
    match = re.search(re.escape(BEGIN) + r".*?" + re.escape(END), doc, re.S)
    return [(s, f, v, m) for (s, f), (v, m) in parse(match.group(0)).items()] if match else []
