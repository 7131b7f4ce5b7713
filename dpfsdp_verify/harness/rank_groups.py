"""Sentences about many ranks that read the same at 2, 8 and 1024 ranks.

Every message that lists ranks (the harness' crash, error and hang verdicts, a target's progress
trail, a torchrun job's outcome) says each *state* once, with the ranks in it as ranges: "ranks
0-6 began step 1 and never finished it; rank 7 finished 1 step(s) and did not end its run", not
one clause per rank. So a verdict's message -- its headline in the terminal, JUnit and the JSON
-- is bounded by the number of distinct states shown (``MAX_GROUPS``) and of rank ranges written
(``MAX_RUNS``), never by the world size; every rank's own detail stays in the verdict's
``details`` and evidence, which the callers keep.

Pure functions of plain data, like ``wording.py``.
"""

from __future__ import annotations

from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple, Union

#: distinct states a grouped sentence names; the rest are counted ("and 9 more ranks in 4 other states")
MAX_GROUPS = 3
#: ranges a rank list writes out before it counts the rest ("0, 2, 4, ... (512 ranks)")
MAX_RUNS = 4


def _runs(ranks: Iterable[int]) -> List[Tuple[int, int]]:
    out: List[Tuple[int, int]] = []
    for r in sorted(set(ranks)):
        if out and r == out[-1][1] + 1:
            out[-1] = (out[-1][0], r)
        else:
            out.append((r, r))
    return out


def rank_list(ranks: Iterable[int]) -> str:
    """``[0, 1, 2, 3, 5, 7, 8]`` -> ``"0-3, 5, 7, 8"``; past ``MAX_RUNS`` ranges the first ones, the
    last rank and the count: ``"0, 2, 4, ..., 1022 (512 ranks)"``."""
    runs = _runs(ranks)
    text = [f"{a}" if a == b else f"{a}, {b}" if b == a + 1 else f"{a}-{b}" for a, b in runs]
    if len(runs) <= MAX_RUNS:
        return ", ".join(text)
    count = sum(b - a + 1 for a, b in runs)
    return ", ".join(text[:MAX_RUNS - 1]) + f", ..., {runs[-1][1]} ({count} ranks)"


def ranks_phrase(ranks: Iterable[int]) -> str:
    """``"rank 3"`` or ``"ranks 0-6, 8"`` (``rank_list``)."""
    ranks = sorted(set(ranks))
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {rank_list(ranks)}"


def were(ranks: Sequence[int]) -> str:
    """The verb after ``ranks_phrase``: ``was`` for one rank, ``were`` for several."""
    return "was" if len(set(ranks)) == 1 else "were"


def by_state(states: Dict[int, str]) -> List[Tuple[List[int], str]]:
    """``{rank: state}`` -> ``[(ranks, state)]``, each state once, ordered by its first rank."""
    groups: Dict[str, List[int]] = {}
    for r in sorted(states):
        groups.setdefault(states[r], []).append(r)
    return sorted(((ranks, s) for s, ranks in groups.items()), key=lambda g: g[0][0])


def grouped(states: Dict[int, str], between: Union[str, Callable[[List[int]], str]] = " ", sep: str = "; ",
            alone: Optional[Callable[[int], str]] = None) -> str:
    """One clause per distinct state: ``"ranks 0-6 <state>; rank 7 <other state>"`` (``between``
    joins the ranks and the state, e.g. ``": "``, or is a function of the ranks, for a verb that
    agrees with them). At most ``MAX_GROUPS`` states are named, the
    rest counted. ``alone(rank)``: the whole clause for a state only that rank is in (its own
    detail, e.g. its local batch sizes), where one rank's detail is worth its length."""
    groups = by_state(states)
    shown, rest = groups[:MAX_GROUPS], groups[MAX_GROUPS:]
    join = between if callable(between) else (lambda ranks: between)
    parts = [alone(ranks[0]) if alone is not None and len(ranks) == 1 else f"{ranks_phrase(ranks)}{join(ranks)}{state}"
             for ranks, state in shown]
    if rest:
        n = sum(len(ranks) for ranks, _ in rest)
        parts.append(f"and {n} more rank(s) in {len(rest)} other state(s) (every rank: the details)")
    return sep.join(parts)


def span(values: Sequence[float], fmt: str = "{:.1f}") -> str:
    """``"2.0"`` or ``"1.9-2.4"``: per-rank figures of a group as their range."""
    lo, hi = min(values), max(values)
    return fmt.format(lo) if fmt.format(lo) == fmt.format(hi) else f"{fmt.format(lo)}-{fmt.format(hi)}"


__all__ = ["MAX_GROUPS", "MAX_RUNS", "rank_list", "ranks_phrase", "were", "by_state", "grouped",
           "span"]
