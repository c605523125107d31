"""Floor 11, tools: what users run around a training step.

    memory   `MemoryMeter`, `memory_report`
    measure  `measure`: step time and peak memory on every rank
    cli      the `pxform` command (`plan`, `profile`, `calibrate`)
    testing  a reusable gloo world for tests, fake worlds, hypothesis strategies

May import every floor below: core ... runtime, and transforms.
"""
