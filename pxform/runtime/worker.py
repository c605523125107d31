"""Ending a torchrun worker cleanly: `exit_worker(code)`, the last call of a script.

Why a script needs it (gloo, CPU): a gloo worker thread frees a finished collective's work
object, and with it the work's tensors, a moment after the caller's `wait()` has returned.
When the caller has already dropped such a tensor (a temporary flag, a gradient bucket),
freeing it needs the GIL. If the interpreter is shutting down by then, Python ends that
thread inside a destructor that may not throw, and the C++ runtime aborts the process:
"terminate called without an active exception", SIGABRT, after every step succeeded.
`destroy_process_group` does not prevent it, because torch keeps the WORLD group alive after
it (`torch.distributed.nn.functional` holds it in default arguments), so its threads
outlive the script. torch has no fix (pytorch/pytorch#179291 was abandoned). Under load it
failed about one 2-rank run in six here; `tests/test_worker.py` makes it happen every time.

`exit_worker` destroys the process groups, runs the `atexit` handlers and flushes output
while the interpreter is whole, then ends the process with `os._exit`, so there is no
interpreter teardown for a late gloo thread to trip over.
"""

from __future__ import annotations

import atexit
import os
import sys
from typing import NoReturn

import torch.distributed as dist


def exit_worker(code: int = 0) -> NoReturn:
    """End this process with exit code `code` after destroying its process groups, running
    its `atexit` handlers and flushing stdout and stderr; skips Python's interpreter teardown
    (see the module docstring for the gloo abort it avoids). Call it last, with `main()`'s
    result, in scripts run under torchrun; an exception before it still exits the usual way.
    Close your own files first: without the teardown, objects are not finalized (`__del__`
    does not run, other open files' buffers are not flushed).

    Example:
        >>> if __name__ == "__main__":          # doctest: +SKIP
        ...     pxform.exit_worker(main())      # instead of sys.exit(main())
    """
    if not isinstance(code, int) or isinstance(code, bool):
        raise TypeError(f"exit_worker: the exit code must be an int; got {code!r} "
                        f"({type(code).__name__}). Fix: return an int from main(), "
                        f"e.g. 0 for success")
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    # what sys.exit would still do and os._exit skips: atexit handlers (logging's flush
    # among them) and the standard streams' buffers
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed or broken: nothing left to save
            pass
    os._exit(code)
