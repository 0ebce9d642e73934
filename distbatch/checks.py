"""The one integer check every argument and checkpoint reader uses, so refusals read alike.

Phrased as TransferQueue's samplers phrase theirs ("must be positive", "must be greater than or
equal to 0"): code ported from TransferQueue matches on those words.
"""

from __future__ import annotations

import operator
from typing import Any

from distbatch.errors import InvalidArgumentError


def check_int(value: Any, name: str, minimum: int = 0) -> int:
    """`value` as an int >= `minimum`, else `InvalidArgumentError` (a `ValueError`) naming `name`.

    bools and floats are refused; numpy integers are taken (`operator.index`).
    """
    if isinstance(value, bool):
        raise InvalidArgumentError(f"{name} must be an int, got {value!r}")
    try:
        number = operator.index(value)
    except TypeError:
        raise InvalidArgumentError(f"{name} must be an int, got {value!r}") from None
    if number < minimum:
        bound = {0: "greater than or equal to 0", 1: "positive"}.get(minimum, f">= {minimum}")
        raise InvalidArgumentError(f"{name} must be {bound}, got {number}")
    return number
