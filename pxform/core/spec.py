"""Partition specs: how a tensor's dims are laid out over named mesh axes.

`P` is dim-major as in JAX: one entry per tensor dim, each `None` (not split), a mesh axis
name, or a tuple of axis names (major to minor). `UNCONSTRAINED` marks a value whose layout is
still open; the search (or simple propagation) fills it in. Partial sums are not part of a
spec: they live on `TensorType.partial`, because users never ask for a partial layout.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

Entry = Union[None, str, tuple[str, ...]]


class _Unconstrained:
    """Singleton type of `UNCONSTRAINED`; prints as `?` inside a type."""

    __slots__ = ()
    _instance: _Unconstrained | None = None

    def __new__(cls) -> _Unconstrained:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "UNCONSTRAINED"

    def __reduce__(self) -> str:
        return "UNCONSTRAINED"


UNCONSTRAINED = _Unconstrained()


@dataclass(frozen=True, slots=True, init=False)
class P:
    """A dim-major partition spec.

    Example:
        >>> P("dp", None)            # dim 0 split over mesh axis "dp"
        P('dp', None)
        >>> P(("dp", "tp"), None).axes_of(0)
        ('dp', 'tp')
    """

    entries: tuple[Entry, ...]

    def __init__(self, *entries: Entry) -> None:
        norm: list[Entry] = []
        for i, entry in enumerate(entries):
            if isinstance(entry, list):
                entry = tuple(entry)
            axes = () if entry is None else (entry,) if isinstance(entry, str) else entry
            if not isinstance(axes, tuple) or not all(isinstance(a, str) and a for a in axes):
                raise TypeError(
                    f"P: entry {i} is {entry!r}; each entry must be None, a mesh axis name "
                    f"or a tuple of axis names, e.g. P('dp', None) or P(('dp', 'tp'),)"
                )
            norm.append(None if not axes else axes[0] if len(axes) == 1 else axes)
        object.__setattr__(self, "entries", tuple(norm))

    def __len__(self) -> int:
        return len(self.entries)

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(self.entries)

    def __getitem__(self, dim: int) -> Entry:
        return self.entries[dim]

    def axes_of(self, dim: int) -> tuple[str, ...]:
        """The mesh axes splitting `dim`, major to minor."""
        entry = self.entries[dim] if dim < len(self.entries) else None
        return () if entry is None else (entry,) if isinstance(entry, str) else entry

    def repeated_axes(self) -> dict[str, list[int]]:
        """Axes that split more than one dim (an error `check_spec` reports with the
        argument's path and mesh), with the dims they split."""
        dims: dict[str, list[int]] = {}
        for d in range(len(self.entries)):
            for axis in self.axes_of(d):
                dims.setdefault(axis, []).append(d)
        return {a: ds for a, ds in dims.items() if len(ds) > 1}

    def __repr__(self) -> str:
        return "P(" + ", ".join(repr(e) for e in self.entries) + ")"


Spec = Union[P, _Unconstrained]
