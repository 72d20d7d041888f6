"""Checks of values users give (arguments, JSON fields, adapter configs) that Python's types leave loose."""

from __future__ import annotations

import numbers

__all__ = ["is_integer", "is_real"]


def is_integer(value) -> bool:
    """Whether `value` is an integer, Python's or numpy's; a bool is not one (True would pass as a count of 1)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_real(value) -> bool:
    """Whether `value` is a real number (integer or floating, Python's or numpy's, inf and NaN included); a bool is
    not one."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)
