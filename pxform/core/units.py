"""Byte counts as users write them (`"80GiB"`, `"512 MB"`, `2**30`) and as pxform prints
them, and the text tables pxform prints."""

from __future__ import annotations

import re
from collections.abc import Sequence

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


def format_bytes(n: float | None, decimals: int | None = None) -> str:
    """`n` bytes in binary units: three significant digits (`1.5 GiB`, `512 MiB`), or
    `decimals` fixed decimals (`1.50 KiB`); whole bytes below 1 KiB (`512 B`).

    Example:
        >>> format_bytes(1.5 * 2**30), format_bytes(1536, decimals=2), format_bytes(None)
        ('1.5 GiB', '1.50 KiB', '-')
    """
    if n is None:
        return "-"
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            x = n / scale
            if decimals is not None:
                return f"{x:.{decimals}f} {unit}"
            return f"{x:.0f} {unit}" if abs(x) >= 100 else f"{x:.3g} {unit}"
    return f"{int(n)} B"


def format_table(rows: Sequence[Sequence[str]], align: str = "", indent: str = "",
                 rule: bool = False) -> list[str]:
    """`rows` (the first is the header) as text lines with columns two spaces apart, each
    as wide as its widest cell. `align` gives each column "l" (left, the default) or "r"
    (right); `rule` puts a line of dashes under the header. Trailing spaces are dropped.

    Example:
        >>> format_table([("stage", "memory"), ("0", "1.2 GiB")], align="lr")
        ['stage   memory', '0      1.2 GiB']
    """
    if not rows:
        return []
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]

    def line(r: Sequence[str]) -> str:
        cells = (c.rjust(w) if align[i:i + 1] == "r" else c.ljust(w)
                 for i, (c, w) in enumerate(zip(r, widths)))
        return (indent + "  ".join(cells)).rstrip()

    out = [line(rows[0])]
    if rule:
        out.append(indent + "  ".join("-" * w for w in widths))
    return out + [line(r) for r in rows[1:]]
