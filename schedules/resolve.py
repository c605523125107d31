"""`resolve`: whatever the user passed as a pipeline schedule, as a validated `Schedule`.

Accepted forms:

- a name from `NAMES` ("gpipe", "1f1b", "interleaved", "zb", "shifted", "nf1b"); options
  (`virtual_stages=`, `forwards=`) go to the generator, which must take them;
- a callable `(stages, microbatches, **options) -> Schedule`;
- text in `to_text` form (lines `rank r: ...`), or CSV in `to_csv` form;
- a `Schedule` dict, used as given.

The result must have `stages` ranks and `microbatches` microbatches, and is validated.
Send/receive actions in a given schedule are kept as given.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

from pxform.core.errors import ScheduleError
from pxform.schedules.actions import Schedule
from pxform.schedules.gpipe import gpipe
from pxform.schedules.interleaved import interleaved
from pxform.schedules.multi_forward import nf1b
from pxform.schedules.one_f_one_b import one_f_one_b
from pxform.schedules.shifted_critical_path import shifted_critical_path
from pxform.schedules.text import from_csv, from_text
from pxform.schedules.validate import check
from pxform.schedules.zero_bubble import zero_bubble

Generator = Callable[..., Schedule]

NAMES: Mapping[str, Generator] = MappingProxyType({
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "interleaved": interleaved,
    "zb": zero_bubble,
    "shifted": shifted_critical_path,
    "nf1b": nf1b,
})
"""Schedule names `resolve` accepts, and their generators."""


def _options_of(fn: Generator) -> list[str]:
    params = list(inspect.signature(fn).parameters.values())[2:]
    return [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]


def _generate(name: str, stages: int, microbatches: int, options: dict[str, Any]) -> Schedule:
    fn = NAMES[name]
    takes = _options_of(fn)
    for key in options:
        if key not in takes:
            raise ValueError(f"pxform.schedules.resolve: schedule {name!r} takes no option "
                             f"{key!r}; it takes {', '.join(takes) if takes else 'none'}")
    return fn(stages, microbatches, **options)


def resolve(schedule: str | Generator | Schedule, stages: int, microbatches: int,
            **options: Any) -> Schedule:
    """The validated schedule `schedule` stands for (see module doc for the forms).

    Raises:
        ValueError: an unknown name, or an option the generator does not take.
        ScheduleError: text that does not parse, a schedule of another size, or an invalid
            schedule.

    Example:
        >>> s = resolve("interleaved", 4, 8, virtual_stages=2)
        >>> len(s), resolve("rank 0: 0F0 0B0", 1, 1)[0][1].kind
        (4, 'B')
    """
    if isinstance(schedule, str):
        text = schedule.strip()
        if text.lower() in NAMES:
            out = _generate(text.lower(), stages, microbatches, options)
        else:
            if options:
                raise ValueError(f"pxform.schedules.resolve: options {sorted(options)} apply "
                                 f"only to a named schedule")
            lines = [x.strip() for x in text.splitlines()]
            first = next((x for x in lines if x and not x.startswith("#")), "")
            if first.lower().startswith("rank") and ":" in first:
                out = from_text(text)
            elif "," in text:
                out = from_csv(text)
            else:
                raise ValueError(f"pxform.schedules.resolve: {schedule!r} is not a schedule "
                                 f"name ({', '.join(NAMES)}), nor schedule text "
                                 f"('rank 0: 0F0 ...') or CSV ('0,0F0,...')")
    elif callable(schedule):
        out = schedule(stages, microbatches, **options)
    elif isinstance(schedule, dict):
        if options:
            raise ValueError(f"pxform.schedules.resolve: options {sorted(options)} apply "
                             f"only to a named schedule or a callable")
        out = schedule
    else:
        raise TypeError(f"pxform.schedules.resolve: a schedule is a name, a callable, text, "
                        f"CSV or a dict {{rank: [Action | None]}}, got "
                        f"{type(schedule).__name__}")
    shape = check(out, "resolve")
    if shape.ranks != stages or shape.microbatches != microbatches:
        raise ScheduleError(f"pxform.schedules.resolve: the schedule has {shape.ranks} ranks "
                            f"and {shape.microbatches} microbatches, but the pipeline has "
                            f"{stages} ranks and {microbatches} microbatches")
    return out
