"""Floor 9, runtime: the only part of pxform that calls `torch.distributed`.

    collectives   conversions between layouts as autograd functions, process groups per axis
    buckets       gradient buckets overlapped with backward
    graph_module  a lowered `Program` -> an fx GraphModule, and the binding it runs under
    program       running an SPMD program with autograd
    pipeline      the executor of pipeline actions (any schedule)
    calibrate     measuring this machine's compute and collectives (`pxform calibrate`)
    worker        `exit_worker`: ending a torchrun script without a gloo abort

May import every floor below it: core, schedules, ops, frontend, passes, cost, search,
lower.
"""
