"""Argument checks shared across kvkern: one wording for each kind of bad value, a
``ValueError`` naming the argument and the value. (An ``int`` here is a Python int that is not
a bool.)"""

from __future__ import annotations

import math
from typing import Any

__all__ = ["check_finite_positive", "check_fraction", "check_non_negative_int",
           "check_positive_int"]


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_positive_int(name: str, value: Any) -> None:
    if not _is_int(value) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def check_non_negative_int(name: str, value: Any) -> None:
    if not _is_int(value) or value < 0:
        raise ValueError(f"{name} must be an int >= 0, got {value!r}")


def check_finite_positive(name: str, value: Any) -> None:
    if isinstance(value, bool) or not (isinstance(value, (int, float)) and math.isfinite(value)
                                       and value > 0):
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")


def check_fraction(name: str, value: Any) -> None:
    """A share in (0, 1]."""
    if not (isinstance(value, (int, float)) and 0 < value <= 1):
        raise ValueError(f"{name} must be in (0, 1], got {value!r}")
