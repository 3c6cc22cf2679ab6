"""The planner's error type."""

from __future__ import annotations

from tuner.errors import TunerError


class PlanError(TunerError, ValueError):
    """A plan cannot be made: empty dimensions or a quantity that overflows.

    A ``ValueError`` (as the seed's ``Err(String)`` maps to) and a
    ``TunerError`` (so the CLI prints it as one line).
    """
