"""The one error class every user-facing mistake derives from: a one-line message and a hint.

The CLI prints any of them as ``dpfsdp-verify: error: MESSAGE (hint: HINT)`` and exits 2; the
Python API raises them as the ``ValueError`` they are. Subclasses only say *what* was wrong
(``plan.UsageError`` for the command line, ``modes.ModeSyntaxError``, ``expectations.ExpectationsError``,
``scale.ScaleUsageError``).
"""

from __future__ import annotations


class HintedError(ValueError):
    """A mistake in what the user gave: ``str(e)`` says what is wrong, ``hint`` how to fix it."""

    def __init__(self, message: str, hint: str = ""):
        super().__init__(message)
        self.hint = hint


__all__ = ["HintedError"]
