"""One cause, one finding: a run's failing verdicts grouped by what made them fail.

A fork's first run can give a hundred ``error (rank_crash)`` verdicts from one line of its code;
read one by one they hide that there is one thing to fix. Verdicts share a cause when they failed
with the same status and diagnosis and

* for a crash, the same exception type raised at the same frame (``evidence["crash"]``, written by
  ``targets.crash_site``) -- whatever the property, since a setup crash fails every one;
* otherwise, in the same property (the same named mismatch).

``group`` returns the causes, largest first; ``Cause`` says what a summary block shows: the cause
in words, the count, the properties and the configuration ranges it covers, one repro command.
Pure functions of the verdicts; the sentences wrap to a width the caller gives.
"""

from __future__ import annotations

import textwrap
from dataclasses import dataclass, field
from typing import Any, Dict, List, Sequence, Tuple

from ..verdict import FAILING, Verdict, config_label

#: distinct values of a config key listed in a block; more are counted
MAX_VALUES = 6
#: config keys that say nothing about where a cause lies (one value per run)
QUIET_KEYS = ("grad_sample_mode",)


def cause_key(v: Verdict) -> Tuple[Any, ...]:
    """What identifies ``v``'s cause (module doc)."""
    crash = (v.evidence or {}).get("crash") if isinstance(v.evidence, dict) else None
    if isinstance(crash, dict) and crash.get("at"):
        exc = str(crash.get("exception", "")).split(":", 1)[0]
        return (v.status, v.diagnosis, "crash", exc, crash["at"])
    return (v.status, v.diagnosis, "property", v.property)


@dataclass
class Cause:
    """Failing verdicts with one cause (``cause_key``), in run order."""

    key: Tuple[Any, ...]
    verdicts: List[Verdict] = field(default_factory=list)

    @property
    def first(self) -> Verdict:
        return self.verdicts[0]

    @property
    def crash(self) -> Dict[str, Any]:
        """The first verdict's ``evidence["crash"]`` (``{}`` when the cause is not a crash)."""
        ev = self.first.evidence if isinstance(self.first.evidence, dict) else {}
        return ev.get("crash") or {} if self.key[2] == "crash" else {}

    @property
    def title(self) -> str:
        """The cause in one line: ``error (rank_crash) at fork/x.py:12 in wrap: TypeError: ...`` or
        ``PROPERTY fail (mismatch)``."""
        status, diagnosis = self.key[0], self.key[1]
        if self.crash:
            return f"{status} ({diagnosis}) at {self.crash['at']}: {self.crash.get('exception', '')}"
        return f"{self.first.property} {status} ({diagnosis})"

    @property
    def reason(self) -> str:
        """The cause in words (an expectation's ``reason``, ``expectations.baseline``): a crash's title names its
        line; another cause adds its first verdict's message (its first sentence or 300 characters)."""
        if self.crash:
            return self.title
        message = " ".join(self.first.message.split())
        return f"{self.title}: {message[:300]}" + ("..." if len(message) > 300 else "")

    @property
    def properties(self) -> List[str]:
        return sorted({v.property for v in self.verdicts})

    @property
    def ranges(self) -> List[str]:
        """Each config key with the values this cause's verdicts have (``world_size 1-2``, ``model
        mlp, transformer``), keys in first-seen order."""
        values: Dict[str, list] = {}
        for v in self.verdicts:
            for k, x in v.config.items():
                if x is None or k in QUIET_KEYS:
                    continue
                seen = values.setdefault(k, [])
                if x not in seen:
                    seen.append(x)
        return [f"{k} {_values_text(k, xs)}" for k, xs in values.items()]

    def block(self, index: int, width: int) -> str:
        """The summary block: title, count and coverage, the first verdict's message, one repro."""
        n = len(self.verdicts)
        props = self.properties
        head = f"[{index}] {self.title}"
        cover = (f"{n} verdict{'s' if n != 1 else ''} in {', '.join(props)}; " + "; ".join(self.ranges))
        lines = _wrap(head, width, "", "    ") + _wrap(cover, width, "    ", "    ")
        lines += _wrap(f"e.g. {self.first.property} [{config_label(self.first.config)}]: {self.first.message}",
                       width, "    ", "      ")
        if self.first.repro:
            lines.append(f"    repro: {self.first.repro}")  # a command is never wrapped: it is copied
        return "\n".join(lines)

    def markdown(self, index: int) -> str:
        n = len(self.verdicts)
        out = [f"### {index}. {_md(self.title)}", "",
               f"{n} verdict{'s' if n != 1 else ''} in {', '.join(f'`{p}`' for p in self.properties)}; "
               + "; ".join(_md(r) for r in self.ranges), "",
               f"e.g. **{self.first.property}** ({_md(config_label(self.first.config))}): {_md(self.first.message)}"]
        if self.first.repro:
            out += ["", f"repro: `{self.first.repro}`"]
        return "\n".join(out)


def _values_text(key: str, xs: list) -> str:
    if key == "world_size" and all(isinstance(x, int) for x in xs):
        xs = sorted(xs)
        if xs == list(range(xs[0], xs[-1] + 1)) and len(xs) > 1:
            return f"{xs[0]}-{xs[-1]}"
    shown = [str(x) for x in xs[:MAX_VALUES]]
    return ", ".join(shown) + (f" (+{len(xs) - MAX_VALUES} more)" if len(xs) > MAX_VALUES else "")


def _md(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _wrap(text: str, width: int, first: str, rest: str) -> List[str]:
    return textwrap.wrap(" ".join(text.split()), width=max(40, width), initial_indent=first,
                         subsequent_indent=rest, break_on_hyphens=False, break_long_words=False) or [first]


def group(verdicts: Sequence[Verdict]) -> List[Cause]:
    """The causes of the failing verdicts among ``verdicts``, largest first (ties: run order)."""
    causes: Dict[Tuple[Any, ...], Cause] = {}
    for v in verdicts:
        if v.status in FAILING:
            key = cause_key(v)
            causes.setdefault(key, Cause(key)).verdicts.append(v)
    return sorted(causes.values(), key=lambda c: -len(c.verdicts))


__all__ = ["MAX_VALUES", "QUIET_KEYS", "cause_key", "Cause", "group"]
