"""Type checks shared by every validator. Python counts ``True`` as the integer 1, but a boolean
where a number belongs (``"temperature": true`` in a request, ``size = true`` in a file) is a
mistake, so these refuse it."""

from __future__ import annotations

import numbers


def is_int(value: object) -> bool:
    """An integer (Python's or numpy's), not a boolean."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_number(value: object) -> bool:
    """A real number (int, float or numpy's), not a boolean."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)
