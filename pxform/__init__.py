"""pxform: composable function transforms that make a plain PyTorch training function run
on many devices.

The public API is re-exported here and only here.
"""

import pxform.hardware as hardware
import pxform.schedules as schedules
from pxform import ops
from pxform.boundary import stage_boundary
from pxform.errors import (
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
from pxform.ir import Graph, Op, TensorType, Value, check
from pxform.measure import Measured, measure
from pxform.memory import MemoryMeter, MemoryReport, MemoryStats, memory_report
from pxform.mesh import AbstractMesh, Mesh
from pxform.ops import OpInfo, Signature, register_rule
from pxform.plan import FrontierPoint, Plan
from pxform.regions import Policy, RegionError
from pxform.report import PlanReport
from pxform.search import Pin, SearchError
from pxform.spec import UNCONSTRAINED, P
from pxform.trace import Traced, module_fn, trace
from pxform.transforms.auto import Auto, auto, profile
from pxform.transforms.coshard import Cosharded, coshard
from pxform.transforms.grad import value_and_grad
from pxform.transforms.pipeline import Pipelined, pipeline
from pxform.transforms.recompute import Recomputed, checkpoint_name, recompute
from pxform.transforms.shard import Sharded, gather, shard
from pxform.worker import exit_worker

__version__ = "0.1.0"

__all__ = [
    "MemoryMeter", "MemoryReport", "MemoryStats", "memory_report", "measure", "Measured",
    "PlanReport", "exit_worker",
    "AbstractMesh", "auto", "Auto", "check", "FrontierPoint", "hardware", "Pin", "Plan",
    "profile", "SearchError", "checkpoint_name", "coshard", "Cosharded", "gather", "Graph",
    "GraphCheckError", "Mesh", "module_fn", "Op", "OpInfo", "ops", "P", "pipeline", "Pipelined",
    "PipelineError", "Policy", "PxformError", "PxformWarning", "recompute", "Recomputed",
    "RegionError", "register_rule", "RuleError", "ScheduleError", "schedules", "shard",
    "Sharded", "Signature", "SignatureMismatchError", "SpecError", "stage_boundary",
    "TensorType", "trace", "Traced", "TraceError", "UNCONSTRAINED", "UnsupportedOpError",
    "Value", "value_and_grad",
]
