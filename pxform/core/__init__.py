"""Floor 1, core: the vocabulary every other floor speaks.

    errors   the exception types (every pxform error is a `PxformError`)
    units    byte and time parsing and formatting
    spec     `P`, the dim-major sharding spec
    mesh     `AbstractMesh` (named axes and sizes) and `Mesh` (bound to the world)
    layout   a value's layout on a mesh, and re-layouts as steps of collectives
    ir       the typed IR: `TensorType`, `Value`, `Op`, `Graph` and its evaluator

Imports nothing from pxform above it (nothing but torch and optree).
"""
