"""Byte counts as users write them (`"80GiB"`, `"512 MB"`, `2**30`) and as pxform prints
them."""

from __future__ import annotations

import re

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_PATTERN = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_bytes(value: int | float | str, what: str = "memory") -> int:
    """Bytes from an int or a string with a unit (powers of 2 for KiB/MiB/GiB/TiB, of 10
    for kB/MB/GB/TB).

    Example:
        >>> parse_bytes("80GiB")
        85899345920
        >>> parse_bytes(1024)
        1024
    """
    if isinstance(value, bool):
        raise ValueError(f"{what}: expected bytes, got {value!r}")
    if isinstance(value, (int, float)):
        if value <= 0:
            raise ValueError(f"{what}: must be positive, got {value!r}")
        return int(value)
    match = _PATTERN.match(str(value))
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise ValueError(f"{what}: {value!r} is not a size; write e.g. 80GiB, 512MiB or "
                         f"a number of bytes")
    number = float(match.group(1))
    if number <= 0:
        raise ValueError(f"{what}: must be positive, got {value!r}")
    return int(number * _UNITS[unit])


def format_bytes(n: float | None) -> str:
    """`n` bytes in binary units, e.g. `1.5 GiB`."""
    if n is None:
        return "-"
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            x = n / scale
            return f"{x:.0f} {unit}" if abs(x) >= 100 else f"{x:.3g} {unit}"
    return f"{int(n)} B"
