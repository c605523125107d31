"""One exception hierarchy for pxform.

Every message names the pxform function that failed, what it was given (argument path,
shapes, op, source line) and how to fix it, so a user never has to read pxform's code to
act on an error. Messages are part of the API: tests match their text.
"""

from __future__ import annotations


class PxformError(Exception):
    """Base class of every error pxform raises on purpose."""


class TraceError(PxformError):
    """The user's function could not be traced into the IR."""


class UnsupportedOpError(TraceError):
    """An op in the traced function has no sharding rule."""


class SignatureMismatchError(PxformError):
    """Arguments given to a traced function do not match those it was traced with."""


class GraphCheckError(PxformError):
    """`pxform.check` found a malformed graph (broken SSA form or wrong types)."""


class SpecError(PxformError):
    """A partition spec does not fit a tensor or a mesh."""


class RuleError(PxformError):
    """An op rule was registered or applied incorrectly."""


class ScheduleError(PxformError):
    """A pipeline schedule is malformed, incomplete or deadlocks (the message has the
    step-by-rank grid with the failing step marked)."""


class PipelineError(PxformError):
    """A function cannot be pipelined as asked (stage cuts, microbatches, boundaries)."""


class CollectiveError(PxformError):
    """A collective did not complete: another rank failed, runs another program, or is
    slower than the mesh's timeout. The message names this rank, the collective and where
    in the program it ran."""


class PxformWarning(UserWarning):
    """Something pxform did on the user's behalf that the user should know about."""
