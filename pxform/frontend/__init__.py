"""Floor 4, frontend: from user code to the IR.

    trace     fn + example arguments -> `Graph` (make_fx on fake tensors); `module_fn`
    boundary  `stage_boundary(x)`, the marker where a pipeline may cut
    regions   the tags `recompute` and `coshard` leave on traced ops, and the `mark` op

May import core, schedules and ops.
"""
