"""Floor 8, lower: Graph + a strategy per op + mesh -> per-rank programs, as plain data
(DESIGN.md §7).

    spmd   one SPMD `Program`: local ops and the conversions between layouts
    mpmd   a `PipelineProgram`: one SPMD program per stage and the transfers between them
    check  `check(graph | program)`: a graph against its rules, a program against its layouts

Programs are data; the runtime builds and runs them. May import core, schedules, ops,
frontend, passes, cost and search; never the runtime.
"""
