"""pxform: composable function transforms that make a plain PyTorch training function run
on many devices.

The public API is re-exported here and only here. Names load on first use, so `import
pxform` is cheap and a script that only lowers and runs a saved plan never imports the
search or the cost model.

The package is built in floors, each importing only from the floors below it (checked by
the import-linter contract in pyproject.toml; `docs/concepts.md` draws them):

    core      errors, units, spec, mesh, layout, the IR
    schedules pipeline schedules as data (installed from schedules/)
    ops       per-op rules: dim signatures, strategies, local rewrites, the graph checker
    frontend  trace, markers, region tags, the module adapter
    passes    strategy propagation, stage cuts and blocks, region expansion
    cost      hardware profiles and the cost model
    search    the auto-search and the `Plan` value
    lower     graph + strategies -> per-rank programs (plain data)
    runtime   the only floor that calls torch.distributed: collectives, buckets, executor
    transforms  shard, pipeline, recompute, coshard, auto, value_and_grad (from transforms/)
    tools     memory meter, measure, CLI, testing harness
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# public name -> the module that defines it
_EXPORTS: dict[str, str] = {
    **dict.fromkeys(["GraphCheckError", "PipelineError", "PxformError", "PxformWarning",
                     "RuleError", "ScheduleError", "SignatureMismatchError", "SpecError",
                     "TraceError", "UnsupportedOpError"], "pxform.core.errors"),
    **dict.fromkeys(["Graph", "Op", "TensorType", "Value"], "pxform.core.ir"),
    "AbstractMesh": "pxform.core.mesh",
    "Precision": "pxform.core.precision",
    "Mesh": "pxform.runtime.mesh",
    **dict.fromkeys(["UNCONSTRAINED", "P"], "pxform.core.spec"),
    **dict.fromkeys(["OpInfo", "Signature", "register_rule"], "pxform.ops"),
    "stage_boundary": "pxform.frontend.boundary",
    **dict.fromkeys(["Policy", "RegionError"], "pxform.frontend.regions"),
    **dict.fromkeys(["Traced", "module_fn", "trace"], "pxform.frontend.trace"),
    **dict.fromkeys(["FrontierPoint", "Plan"], "pxform.search.plan"),
    **dict.fromkeys(["Pin", "ScheduleChoice", "SearchError"], "pxform.search"),
    **dict.fromkeys(["PlanReport", "Measured"], "pxform.search.report"),
    "check": "pxform.lower.check",
    "exit_worker": "pxform.runtime.worker",
    **dict.fromkeys(["Auto", "auto", "profile"], "pxform.transforms.auto"),
    **dict.fromkeys(["Cosharded", "coshard"], "pxform.transforms.coshard"),
    "value_and_grad": "pxform.transforms.grad",
    **dict.fromkeys(["Pipelined", "pipeline"], "pxform.transforms.pipeline"),
    **dict.fromkeys(["Recomputed", "checkpoint_name", "recompute"],
                    "pxform.transforms.recompute"),
    **dict.fromkeys(["Sharded", "shard"], "pxform.transforms.shard"),
    "gather": "pxform.runtime.boundary",
    "load_checkpoint": "pxform.runtime.checkpoint",
    "module_init": "pxform.frontend.module_init",
    **dict.fromkeys(["MemoryMeter", "MemoryReport", "MemoryStats", "memory_report"],
                    "pxform.tools.memory"),
    "measure": "pxform.tools.measure",
    **dict.fromkeys(["CalibrationSpread", "ProfileCheck", "calibration_spread",
                     "check_profile"], "pxform.tools.profile_check"),
}
# public modules: pxform.hardware.hardware("h100-80gb"), pxform.testing.World(2), ...
_MODULES: dict[str, str] = {
    "hardware": "pxform.cost.hardware",
    "ops": "pxform.ops",
    "schedules": "pxform.schedules",
    "testing": "pxform.tools.testing",
}

__all__ = sorted([*_EXPORTS, *_MODULES])


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
    elif name in _MODULES:
        value = importlib.import_module(_MODULES[name])
    else:
        raise AttributeError(f"module 'pxform' has no attribute {name!r}")
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])


if TYPE_CHECKING:  # for type checkers and IDEs; at run time, names load on first use
    import pxform.cost.hardware as hardware
    import pxform.schedules as schedules
    import pxform.tools.testing as testing
    from pxform import ops
    from pxform.core.errors import (
        GraphCheckError,
        PipelineError,
        PxformError,
        PxformWarning,
        RuleError,
        ScheduleError,
        SignatureMismatchError,
        SpecError,
        TraceError,
        UnsupportedOpError,
    )
    from pxform.core.ir import Graph, Op, TensorType, Value
    from pxform.core.mesh import AbstractMesh
    from pxform.core.precision import Precision
    from pxform.core.spec import UNCONSTRAINED, P
    from pxform.frontend.boundary import stage_boundary
    from pxform.frontend.module_init import module_init
    from pxform.frontend.regions import Policy, RegionError
    from pxform.frontend.trace import Traced, module_fn, trace
    from pxform.lower.check import check
    from pxform.ops import OpInfo, Signature, register_rule
    from pxform.runtime.boundary import gather
    from pxform.runtime.checkpoint import load_checkpoint
    from pxform.runtime.mesh import Mesh
    from pxform.runtime.worker import exit_worker
    from pxform.search import Pin, ScheduleChoice, SearchError
    from pxform.search.plan import FrontierPoint, Plan
    from pxform.search.report import Measured, PlanReport
    from pxform.tools.measure import measure
    from pxform.tools.memory import MemoryMeter, MemoryReport, MemoryStats, memory_report
    from pxform.tools.profile_check import (
        CalibrationSpread,
        ProfileCheck,
        calibration_spread,
        check_profile,
    )
    from pxform.transforms.auto import Auto, auto, profile
    from pxform.transforms.coshard import Cosharded, coshard
    from pxform.transforms.grad import value_and_grad
    from pxform.transforms.pipeline import Pipelined, pipeline
    from pxform.transforms.recompute import Recomputed, checkpoint_name, recompute
    from pxform.transforms.shard import Sharded, shard
