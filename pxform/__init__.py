"""pxform: composable function transforms that make a plain PyTorch training function run
on many devices.

The public API is re-exported here and only here.
"""

from pxform import ops
from pxform.errors import (
    GraphCheckError,
    PxformError,
    PxformWarning,
    RuleError,
    SignatureMismatchError,
    SpecError,
    TraceError,
    UnsupportedOpError,
)
from pxform.ir import Graph, Op, TensorType, Value, check
from pxform.mesh import AbstractMesh, Mesh
from pxform.ops import OpInfo, Signature, register_rule
from pxform.spec import UNCONSTRAINED, P
from pxform.trace import Traced, module_fn, trace
from pxform.transforms.grad import value_and_grad
from pxform.transforms.shard import Sharded, gather, shard

__version__ = "0.1.0"

__all__ = [
    "AbstractMesh", "Graph", "GraphCheckError", "Mesh", "Op", "OpInfo", "P", "PxformError",
    "PxformWarning", "RuleError", "Sharded", "Signature", "SignatureMismatchError",
    "SpecError", "TensorType", "TraceError", "Traced", "UNCONSTRAINED", "UnsupportedOpError",
    "Value", "check", "gather", "module_fn", "ops", "register_rule", "shard", "trace",
    "value_and_grad",
]
