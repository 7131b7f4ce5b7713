"""A run's verdicts judged once (``judge``): the ``RunResult`` every writer of ``report.py`` reads.

Everything the reports say beyond the verdicts themselves is computed here, once, in one pass:
the expectations applied (``expectations.apply``: which failures were expected, which entries no
longer hold), the failures grouped by cause (``causes.group``: the unexpected ones, and those a
``--write-expect`` baseline lists), the baseline's text (``expectations.baseline``), each
verdict's ``config_label``, and the exit code (``exit_code``, the one place it is computed; the
codes are ``EXIT_*`` below, stated once, in docs/gate.md, "Exit codes"). The writers then only
word a finished result, so they cannot disagree, and none of them judges again.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence

from .. import __version__
from ..verdict import FAILING, INTERNAL_ERROR, Verdict, config_label
from . import causes
from .expectations import Expectations, Outcome, apply, baseline, baseline_failures, environment

if TYPE_CHECKING:  # pragma: no cover
    from .plan import RunPlan

EXIT_OK, EXIT_FAIL, EXIT_USAGE, EXIT_INTERNAL = 0, 1, 2, 3


def exit_code(verdicts: Sequence[Verdict], outcome: Optional[Outcome] = None) -> int:
    """3 for a bug in a check (an ``internal_error`` verdict); with an expectations file 0 exactly
    when it holds; else 1 for any failing verdict, 0 for none."""
    if any(v.diagnosis == INTERNAL_ERROR for v in verdicts):
        return EXIT_INTERNAL
    if outcome is not None:
        return EXIT_OK if outcome.holds else EXIT_FAIL
    return EXIT_FAIL if any(v.status in FAILING for v in verdicts) else EXIT_OK


@dataclass
class RunResult:
    """A run's verdicts, judged (module docstring); ``labels[i]`` is ``verdicts[i]``'s config label."""

    verdicts: List[Verdict]
    target: Dict[str, Any]
    backend: str = "gloo"
    seed: Optional[int] = None
    #: the verdicts against the expectations file (``None`` without ``--expect``)
    outcome: Optional[Outcome] = None
    labels: List[str] = field(default_factory=list)
    #: the failures no expectation lists, and their causes, largest first
    unexpected: List[Verdict] = field(default_factory=list)
    causes: List[causes.Cause] = field(default_factory=list)
    #: ``--write-expect``'s file text (``None`` without it)
    baseline: Optional[str] = None
    #: the run ended before every verdict was in (a torchrun job's journal): it cannot pass
    unfinished: bool = False

    @property
    def code(self) -> int:
        code = exit_code(self.verdicts, self.outcome)
        return max(code, EXIT_FAIL) if self.unfinished else code

    def expected(self, v: Verdict) -> bool:
        """Whether the expectations file lists ``v``'s failure."""
        return self.outcome is not None and self.outcome.is_expected(v)

    def name(self, i: int) -> str:
        """``property [config label]`` of ``verdicts[i]`` (``Verdict.label``)."""
        return f"{self.verdicts[i].property} [{self.labels[i]}]"


def judge(verdicts: Sequence[Verdict], target: Dict[str, Any], backend: str = "gloo", seed: Optional[int] = None,
          expectations: Optional[Expectations] = None, env: Optional[Dict[str, Optional[str]]] = None,
          baseline_of: Optional[str] = None, unfinished: bool = False) -> RunResult:
    """``verdicts`` judged (module docstring) in the environment ``env`` (default: ``backend``'s);
    ``baseline_of``: the description of a ``--write-expect`` baseline to write (``None``: none)."""
    env = environment(backend) if env is None else env
    outcome = apply(expectations, verdicts, env) if expectations is not None else None
    listed = baseline_failures(verdicts) if baseline_of is not None else []
    unexpected = [v for v in verdicts if v.status in FAILING and not (outcome is not None and outcome.is_expected(v))]
    found, listed_causes = causes.group(unexpected), causes.group(listed)
    text = baseline(verdicts, env, baseline_of, listed_causes) if baseline_of is not None else None
    labels = [config_label(v.config) for v in verdicts]
    return RunResult(list(verdicts), target, backend, seed, outcome, labels, unexpected, found, text, unfinished)


def judge_plan(plan: "RunPlan", verdicts: Sequence[Verdict], target: Dict[str, Any]) -> RunResult:
    """``judge`` as the plan asks: its backend, seed, expectations and ``--write-expect``."""
    described = (f"baseline of {target.get('name')} {target.get('version', '')}".strip()
                 + f", written by dpfsdp-verify {__version__} --write-expect")
    return judge(verdicts, target, plan.options.backend, plan.options.seed, plan.expectations,
                 baseline_of=described if plan.write_expect else None)


__all__ = ["EXIT_OK", "EXIT_FAIL", "EXIT_USAGE", "EXIT_INTERNAL", "exit_code", "RunResult", "judge", "judge_plan"]
