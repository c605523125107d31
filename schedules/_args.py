"""Argument checks shared by the schedule generators, so every one fails the same way."""

from __future__ import annotations


def count(fn: str, name: str, value: object, minimum: int = 1) -> int:
    """`value` if it is an int >= `minimum`, else a ValueError naming `fn` and `name`.

    Example:
        >>> count("gpipe", "stages", 4)
        4
    """
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"pxform.schedules.{fn}: {name} must be an int >= {minimum}, "
                         f"got {value!r}")
    return value
