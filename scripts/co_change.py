"""How scattered a change to ``properties/`` is: over the commits that touched it, how many changed
two or more of its packages, and three or more -- counted by the layout of the files at the time
("before") and by the layout they have now ("after": a file that moved since counts in its new
package, e.g. ``analysis/releases.py`` in ``releases/``). Prints both; a topic cut that is right
makes the "after" counts fall.

    python scripts/co_change.py [--since REV] [--since-move]

``--since-move``: the commits made after the topic cut (``MOVE``), the work done in the new layout,
counted both ways: by the current layout, and as the layout before the cut would have filed the same
files (``MOVED`` read backwards). The history before the cut was shaped by the old layout (a change
landed where the files were), so these later commits are the fairer test of the cut.
"""

from __future__ import annotations

import argparse
import subprocess
from collections import Counter

PREFIX = "dpfsdp_verify/properties/"
#: where a file of the old layout lives now (the package moves of issue 49)
MOVED = {
    "analysis/releases.py": "releases/analysis.py",
    "wording/releases.py": "releases/wording.py",
    "engine/releases.py": "releases/judge.py",
    "checks/noise_calibration.py": "noise/check.py",
    "analysis/noise_stats.py": "noise/stats.py",
    "analysis/noise_exact.py": "noise/exact.py",
    "wording/noise_repeats.py": "noise/repeats.py",
    "checks/norm_fidelity.py": "clipping/norm_fidelity.py",
    "checks/clipped_step.py": "clipping/clipped_step.py",
    "checks/sensitivity_bound.py": "clipping/sensitivity_bound.py",
    "analysis/norm_hypotheses.py": "clipping/norm_hypotheses.py",
    "checks/sampling_accounting.py": "sampling/check.py",
    "checks/deadlock_free.py": "hangs/check.py",
    "checks/privacy_audit.py": "audit/check.py",
    "analysis/audit_bound.py": "audit/bound.py",
    "checks/trajectory.py": "training/trajectory.py",
    "checks/mode_equivalence.py": "training/mode_equivalence.py",
    "checks/checkpoint_resume.py": "training/checkpoint_resume.py",
    "analysis/audit_fdp.py": "audit/fdp.py",
    "analysis/param_shares.py": "clipping/param_shares.py",
}


#: the commit that packaged the checks by topic (issue 49 item 2)
MOVE = "9ffb53b"
BACK = {new: old for old, new in MOVED.items()}


def package(rel: str, now: bool) -> str:
    """The package of ``rel`` (a path under properties/), by the old layout or the current one."""
    if now:
        rel = MOVED.get(rel, rel)
    return rel.split("/")[0] if "/" in rel else "(root)"


def commits(since: str):
    out = subprocess.check_output(["git", "log", "--format=@%H", "--name-only", f"{since}..HEAD", "--", PREFIX],
                                  text=True)
    files: list = []
    for line in out.splitlines():
        if line.startswith("@"):
            if files:
                yield files
            files = []
        elif line.startswith(PREFIX):
            files.append(line[len(PREFIX):])
    if files:
        yield files


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--since", default=subprocess.check_output(
        ["git", "rev-list", "--max-parents=0", "HEAD"], text=True).split()[0])
    ap.add_argument("--since-move", action="store_true", help="the commits after the topic cut, counted both ways")
    args = ap.parse_args()
    if args.since_move:
        rows = list(commits(MOVE))
        ways = (("old layout (the same files filed as before the cut)", lambda f: package(BACK.get(f, f), False)),
                ("topic layout (as they are filed now)", lambda f: package(f, False)))
    else:
        rows = list(commits(args.since))
        ways = (("before (layout at the time)", lambda f: package(f, False)),
                ("after (current layout)", lambda f: package(f, True)))
    for label, where in ways:
        spread = Counter(len({where(f) for f in files}) for files in rows)
        two = sum(n for k, n in spread.items() if k >= 2)
        three = sum(n for k, n in spread.items() if k >= 3)
        print(f"{label}: {len(rows)} commits touched properties/; {two} changed >= 2 of its packages, "
              f"{three} changed >= 3")


if __name__ == "__main__":
    main()
