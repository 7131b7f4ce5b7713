"""Cases on a model of one's own (``docs/models.md``) that cannot be judged: the model cannot run in
float64, so there is no float64 reference -- every such case is a ``skip`` saying why, whatever its
run gave (a float64 run of it crashes in the model, not in the target)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Dict, Optional

from ...models.catalog import MODEL_DIMS, contract_path
from ...verdict import Verdict

if TYPE_CHECKING:  # pragma: no cover
    from .contract import Case

_PROBLEMS: Dict[str, str] = {}


def float64_problem(model: str) -> str:
    """Why ``model`` (a contract model) has no float64 reference, '' when it has one or is built in.
    Cached per process: the model is built and differentiated once (``models.contract.float64_problem``)."""
    if model in MODEL_DIMS or contract_path(model) is None:
        return ""
    if model not in _PROBLEMS:
        from ...models import contract

        _PROBLEMS[model] = contract.float64_problem(model)
    return _PROBLEMS[model]


def float64_skip(case: "Case") -> Optional[Verdict]:
    """The ``skip`` of a case whose model has no float64 reference; ``None`` otherwise."""
    problem = float64_problem(case.spec.model)
    if not problem:
        return None
    return case.verdict("skip", None, f"{problem}: the model cannot run in float64, so there is no float64 "
                                      "reference to judge it against (docs/models.md)")


__all__ = ["float64_problem", "float64_skip"]
