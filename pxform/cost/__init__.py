"""Floor 6, cost: what things cost on a device.

    hardware  `Hardware` profiles (presets, measured JSON) and collective times
    model     `CostModel`: op compute, re-layout time, memory of parameters and
              activations, bytes saved for backward (measured on fake tensors)

Profiles are measured by `pxform calibrate` (`pxform.runtime.calibrate`, which runs
collectives and so lives in the runtime). May import core, schedules, ops, frontend and
passes.
"""
