"""What a detector found, as values: the findings ``analysis`` and ``engine`` return and
``wording`` turns into sentences (never the other way round: a sentence is made from a finding,
not edited after). Plain data, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, List, Optional, Tuple


@dataclass(frozen=True)
class HistoryFinding:
    """What is wrong with a told accountant history, and the values its sentence names. ``kind``:
    ``ranks_disagree`` (``told_by``: each rank and its history, ``None`` where it reports none),
    ``no_history`` (some ranks of run ``run`` report none), ``step_count`` (``told_steps`` against
    ``taken``; ``how``: ``per_pass`` / ``lost_restored`` / ``restored_twice`` / ``load_other`` /
    ``not_per_step``, or ``""`` where not named), ``sigma`` / ``rate`` (the ``wrong`` values told against
    ``expected``), ``epsilons_differ`` (``reported`` by the ranks), ``epsilon`` (``got`` against the suite's
    ``want`` at ``delta``). ``resume_at``: the step a resumed load half resumed after (else ``None``)."""
    kind: str
    history: Any = None
    resume_at: Optional[int] = None
    run: int = 0
    told_by: Tuple[Tuple[int, Any], ...] = ()
    told_steps: int = 0
    taken: int = 0
    how: str = ""
    first_step: int = 0
    after_resume: int = 0
    wrong: Tuple[float, ...] = ()
    expected: float = 0.0
    physical_batch_size: Optional[int] = None
    reported: List[Any] = field(default_factory=list)
    delta: float = 0.0
    want: float = 0.0
    got: float = 0.0
    accountant: Optional[str] = None
    floor: float = 0.0
    #: ``epsilon``: the other delta at which the told history's RDP epsilon is the reported one, if any
    at_delta: Optional[float] = None
    #: ``epsilon``: the other step count whose RDP epsilon (at the told sigma and q) is the reported
    #: one, if any; ``steps_how``: which count that is (``since_resume``, ``per_pass``, or ``""``)
    at_steps: Optional[int] = None
    steps_how: str = ""
    #: ``epsilon``: the interval a valid epsilon of the told history lies in (``floor`` above: the
    #: sound lower bound, ``accounting_bounds.epsilon_floor``; this: the classic RDP conversion)
    ceiling: float = 0.0

    @property
    def direction(self) -> str:
        """``"under"`` when what the accountant reports is smaller than the run's privacy loss (a
        privacy violation in the accounting), ``"over"`` when larger (the guarantee understated:
        utility, not privacy), ``""`` where the finding has no direction (ranks disagree, none told)."""
        if self.kind == "epsilon":
            return "under" if self.got < self.floor else "over"
        if self.kind == "rate" and self.wrong:  # a larger q: more privacy loss composed
            return "over" if self.wrong[0] > self.expected else "under"
        if self.kind == "sigma" and self.wrong:  # a larger sigma: less privacy loss composed
            return "under" if self.wrong[0] > self.expected else "over"
        return ""


__all__ = ["HistoryFinding"]
