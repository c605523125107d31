"""Floor 3, ops: the dim signature, FLOPs and view-ness of every supported aten op; the
sharding strategies they give (`strategy`), how an op runs on local shards (`local`), and
the graph checker (`check`).

One module per family; importing this package registers them all. Extend pxform with
`register_rule` (see `pxform.ops.registry`). May import core and schedules.
"""

from pxform.ops import (  # noqa: F401  (imported for their registrations)
    attention,
    einsum,
    factory,
    indexing,
    loss,
    norm,
    pointwise,
    pooling,
    reduction,
    view,
)
from pxform.ops.registry import (
    FALLBACK_TAG,
    OpInfo,
    bind,
    fallback_info,
    has_rule,
    infer_types,
    meta_types,
    register_family,
    register_rule,
    rule_info,
    unsupported_error,
)
from pxform.ops.signature import LabelMaker, Signature

__all__ = [
    "FALLBACK_TAG", "LabelMaker", "OpInfo", "Signature", "bind", "fallback_info", "has_rule",
    "infer_types", "meta_types", "register_family", "register_rule", "rule_info",
    "unsupported_error",
]
