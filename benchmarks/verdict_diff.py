"""Compare the verdicts of two gate reports (``--json``), e.g. before and after a refactor.

    python benchmarks/verdict_diff.py BEFORE.json AFTER.json [--messages]

A verdict is keyed by (property, config label); it is the same when its status and diagnosis are
(``--messages``: and its message). Prints the counts -- same, changed, only before, only after --
and every changed verdict; exit 1 when any verdict present in both reports changed (verdicts only
one report has are listed, not counted as changes: a run that gained cases is not a changed one).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Dict, Tuple

Key = Tuple[str, str]


def verdicts(path: str, messages: bool) -> Dict[Key, tuple]:
    report = json.load(open(path))
    out: Dict[Key, tuple] = {}
    for r in report["results"]:
        key = (r["property"], r.get("label") or json.dumps(r["config"], sort_keys=True))
        value = (r["status"], r.get("diagnosis")) + ((r.get("message", ""),) if messages else ())
        if key in out and out[key] != value:
            value = out[key] + ("+",) + value  # two verdicts of one label (rare): keep both
        out[key] = value
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("before")
    ap.add_argument("after")
    ap.add_argument("--messages", action="store_true", help="a changed message is a changed verdict")
    args = ap.parse_args(argv)
    a, b = verdicts(args.before, args.messages), verdicts(args.after, args.messages)
    both = sorted(set(a) & set(b))
    changed = [k for k in both if a[k] != b[k]]
    print(f"{args.before} -> {args.after}: {len(both) - len(changed)} same, {len(changed)} changed, "
          f"{len(set(a) - set(b))} only before, {len(set(b) - set(a))} only after")
    for k in changed:
        print(f"  changed  {k[0]} [{k[1]}]: {a[k][:2]} -> {b[k][:2]}")
    for k in sorted(set(b) - set(a)):
        print(f"  new      {k[0]} [{k[1]}]: {b[k][:2]}")
    for k in sorted(set(a) - set(b)):
        print(f"  gone     {k[0]} [{k[1]}]: {a[k][:2]}")
    return 1 if changed else 0


if __name__ == "__main__":
    sys.exit(main())
