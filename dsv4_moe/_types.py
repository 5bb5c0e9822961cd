"""Type predicates shared by the argument checks: Python's bool is an int, and no argument of
this package that takes a count, an index or a size means a bool by it (True would pass as 1)."""

from __future__ import annotations

__all__ = ["is_int", "is_real"]


def is_int(v) -> bool:
    """An int that is not a bool."""
    return isinstance(v, int) and not isinstance(v, bool)


def is_real(v) -> bool:
    """An int or float that is not a bool (NaN and inf pass: range checks are the caller's)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool)
