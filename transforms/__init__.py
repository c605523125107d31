"""Floor 10, transforms: `shard`, `pipeline`, `recompute`, `coshard`, `auto` and
`value_and_grad`, installed as `pxform.transforms`.

    base     the transform protocol: `Transform`, `Executable`, `Nested`, `Region`
    compile  the one compile path: trace -> prepare -> strategies -> lower
    specs    in_specs / out_specs -> layouts

Transforms annotate the IR while tracing and compile through `compile`; what runs is the
runtime's. May import every floor below: core, schedules, ops, frontend, passes, cost,
search, lower, runtime."""
