"""The errors of a model given by its own code (``docs/models.md``), torch-free: the gate and the
property runner catch them without importing torch."""

from __future__ import annotations


class ContractError(ValueError):
    """A model given by the contract that cannot be used; the message is one line naming why."""


class Float64Unsupported(ValueError):
    """The model cannot run in float64, so the float64 reference cannot be computed (a ``skip``)."""


__all__ = ["ContractError", "Float64Unsupported"]
