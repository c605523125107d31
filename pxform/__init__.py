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
    TraceError,
    UnsupportedOpError,
)
from pxform.ir import Graph, Op, TensorType, Value, check
from pxform.ops import OpInfo, Signature, register_rule
from pxform.spec import UNCONSTRAINED, P
from pxform.trace import Traced, module_fn, trace

__version__ = "0.1.0"

__all__ = [
    "Graph", "GraphCheckError", "Op", "OpInfo", "P", "PxformError", "PxformWarning",
    "RuleError", "Signature", "SignatureMismatchError", "TensorType", "TraceError", "Traced",
    "UNCONSTRAINED", "UnsupportedOpError", "Value", "check", "module_fn", "ops",
    "register_rule", "trace",
]
