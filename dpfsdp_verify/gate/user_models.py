"""The models of ``--models`` given by their own code (``docs/models.md``), used once before a run:
a model that cannot be imported, made, built, batched or forwarded stops the gate with one line
(``UsageError``: exit 2) before any rank starts, never a traceback from inside torch."""

from __future__ import annotations

from typing import Sequence

from ..models.catalog import MODEL_DIMS, contract_path
from .plan import UsageError


def check_user_models(names: Sequence[str]) -> None:
    """``UsageError`` naming the first contract model of ``names`` that cannot be used (the built-in
    models are not looked at). Imports torch and the model's module."""
    wanted = [n for n in names if n not in MODEL_DIMS and contract_path(n) is not None]
    if not wanted:
        return
    from ..models import contract

    for name in wanted:
        try:
            contract.check(name)
        except contract.ContractError as e:
            raise UsageError(str(e), "a model needs build(seed), batch(n, seed) and loss(output, targets): "
                                     "see docs/models.md") from None


__all__ = ["check_user_models"]
