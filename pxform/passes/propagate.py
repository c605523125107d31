"""The conversion rule's layouts and greedy strategy propagation (DESIGN.md §7).

- `gradient_layout` G(L): the layout gradients of a value laid out as L are kept in;
- `consumer_gradient_layout` C: the layout an op's strategy delivers an input's gradient in;
- `propagate`: a strategy per op, greedily in program order, for programs whose ops nobody
  chose strategies for (`pxform.shard` without a plan, and the search's data layout).
"""

from __future__ import annotations

import math
from functools import lru_cache

from pxform.core.ir import Graph, TensorType
from pxform.core.layout import LOCAL_STEPS, AxisCost, Layout, Relayout, plan_relayout
from pxform.core.mesh import AbstractMesh
from pxform.core.spec import P
from pxform.frontend.precision import INPUT_CAST
from pxform.frontend.regions import PIECE
from pxform.ops.strategy import REPLICATE, Strategy
from pxform.ops.strategy import strategies as all_strategies


def gradient_layout(layout: Layout) -> Layout:
    """G(L): the layout gradients of a value laid out as L are kept in."""
    return Layout(layout.dims)


def consumer_gradient_layout(strategy: Strategy, index: int) -> Layout:
    """C: the layout in which the op delivers the gradient of its input `index`."""
    need = strategy.inputs[index]
    partial = {axis for axis, choice in strategy.choices
               if choice != REPLICATE and axis not in need.used_axes()}
    return Layout(need.dims, frozenset(partial))


def typed_layout(t: TensorType, layout: Layout) -> TensorType:
    """`t` with `layout`'s spec and partial axes."""
    return TensorType(t.shape, t.dtype, layout.to_spec(), layout.partial)


def layout_of(t: TensorType) -> Layout:
    """The layout a value's type carries (unconstrained specs read as replicated)."""
    spec = t.spec if isinstance(t.spec, P) else P()
    return Layout.of(spec, len(t.shape), t.partial)


@lru_cache(maxsize=65536)
def relayout(shape: tuple[int, ...], itemsize: int, src: Layout, dst: Layout,
          mesh: AbstractMesh) -> Relayout:
    """`plan_relayout`, cached: programs convert the same shapes between the same layouts
    many times over."""
    return plan_relayout(shape, itemsize, src, dst, mesh)


def propagate(graph: Graph, mesh: AbstractMesh, input_layouts: list[Layout],
              sequential: frozenset[str] = frozenset(),
              zero3: frozenset[str] = frozenset()) -> list[Strategy]:
    """Choose a strategy per op, greedily in program order: the one needing the least
    forward communication to bring its inputs into layout (planner's default costs); costs
    within 1% are ties (bytes that small do not matter next to a collective's latency), and
    ties go to strategies that keep inputs as they are, then to those that split less. So a
    partial sum is all-reduced where it is (Megatron's g) rather than reduce-scattered into
    a layout nothing asked for (sequence parallelism is asked for with specs, or chosen by
    the search). Backward
    communication is what the forward choice implies (DP's gradient all-reduce). The search
    of a later issue replaces this.

    `sequential` names axes whose coordinates run one after another (a pipeline's
    microbatches): no collective can run over them, so strategies needing one are taken
    only when nothing else exists (the lowering then explains why the op cannot run).

    `zero3` names axes (`zero3_axes`) over which gathering a parameter for an op that
    still splits its work over the axis is priced as the runtime runs it: grouped per
    block and prefetched (no latency), its bytes moved three times (gathered, gathered
    again in backward, gradient reduce-scattered), against twice (forward and backward)
    for every other re-layout. `pxform.shard` propagates both ways and keeps the program
    that moves less (`pxform.lower.comm.comm_cost`)."""
    layouts: dict[str, Layout] = {v.name: lay for v, lay in zip(graph.inputs, input_layouts)}
    # parameters, and their mixed-precision casts made on the parameter's own layout (the
    # lowering folds those into the parameter's conversion: ZeRO-3 gathers the cast shard)
    inputs = {v.name for v in graph.inputs}
    for c in graph.constants:
        layouts[c.value.name] = Layout.replicated(c.value.type.rank)
    # layouts a value is already converted to for an earlier consumer: free to reuse
    # (the lowering converts once per value and layout)
    made: set[tuple[str, Layout]] = set()
    chosen = []
    for op in graph.ops:
        best: tuple[float, int, int, float] | None = None
        pick = None
        for s in all_strategies(op, mesh):
            comm = 0.0
            moves = 0
            splits = {a for a, choice in s.choices if choice != REPLICATE}
            for i, v in enumerate(op.inputs):
                if (v.name, s.inputs[i]) in made:
                    continue
                t = v.type
                fwd = relayout(t.shape, t.dtype.itemsize, layouts[v.name], s.inputs[i], mesh)
                if v.name in inputs and _zero3_gather(fwd, splits, zero3):
                    # a parameter stored sharded, gathered for an op that still splits its
                    # work over the axis (ZeRO-3): the runtime packs a block's gathers into
                    # one collective launched a block ahead, so no latency; its bytes move
                    # three times (gathered, gathered again in backward, gradient
                    # reduce-scattered)
                    comm += 3 * sum(b for _, b in fwd.volume) * AxisCost().seconds_per_byte
                    continue
                comm += 2 * fwd.cost  # forward, and its mirror in backward
                moves += len(fwd.steps)
                if any(st.axis in sequential and st.kind not in LOCAL_STEPS
                       for st in fwd.steps):
                    comm = math.inf
            if zero3:
                # priced as the runtime runs ZeRO-3, a partial sum over its axis is not
                # free: it is reduced before its first non-linear use (greedy propagation
                # would otherwise only see that at the next op)
                for v, lay in zip(op.outputs, s.outputs):
                    if lay.partial & zero3:
                        t = v.type
                        whole = Layout(lay.dims, lay.partial - zero3)
                        comm += 2 * relayout(t.shape, t.dtype.itemsize, lay, whole,
                                             mesh).cost
            held = 0  # partial sums a piece of an overlapped region hands on
            if op.tag(PIECE) is not None:
                # coshard(overlap=True): a partial sum is reduced inside its piece, where
                # the collective runs under the next piece's compute, not carried out of
                # the region to be reduced whole and exposed: carrying it is priced as
                # reducing it, and the tie goes to reducing
                for v, lay in zip(op.outputs, s.outputs):
                    if lay.partial:
                        t = v.type
                        held += len(lay.partial)
                        comm += 2 * relayout(t.shape, t.dtype.itemsize, lay,
                                             Layout(lay.dims), mesh).cost
            ways = sum(math.log(mesh.axis_size(a)) for a, c in s.choices if c != REPLICATE)
            key = (comm, held, moves, ways)
            if best is None or _better(key, best):
                best, pick = key, s
        assert pick is not None  # "replicate everywhere" is always a strategy
        chosen.append(pick)
        if op.tag(INPUT_CAST, False) is not False and op.inputs[0].name in inputs and \
                pick.inputs[0] == layouts[op.inputs[0].name] == pick.outputs[0]:
            inputs.add(op.outputs[0].name)
        made.update((v.name, need) for v, need in zip(op.inputs, pick.inputs))
        for v, lay in zip(op.outputs, pick.outputs):
            layouts[v.name] = lay
    return chosen


def _zero3_gather(fwd: Relayout, splits: set[str], zero3: frozenset[str]) -> bool:
    """Is the re-layout all-gathers over `zero3` axes the op splits its work over?"""
    return bool(fwd.steps) and all(st.kind == "all_gather" and st.axis in splits
                                   and st.axis in zero3 for st in fwd.steps)


def zero3_axes(graph: Graph, input_layouts: list[Layout], mesh: AbstractMesh
               ) -> frozenset[str]:
    """Mesh axes that split inputs as ZeRO-3 does (FSDP's `P("dp")`): every input split
    over the axis is split on its dim 0 only, and at least two are (parameters and the
    batch). Propagation may gather parameters over them instead of moving activations."""
    out = set()
    for a in mesh.names:
        if mesh.axis_size(a) == 1:
            continue
        split = [lay for lay in input_layouts if a in lay.used_axes()]
        if len(split) >= 2 and all(a in lay.dims[0] and not lay.partial
                                   and all(a not in d for d in lay.dims[1:])
                                   for lay in split if lay.dims):
            out.add(a)
    return frozenset(out)


def _better(key: tuple[float, int, int, float], best: tuple[float, int, int, float]) -> bool:
    cost, best_cost = key[0], best[0]
    if math.isinf(cost) != math.isinf(best_cost):  # impossible ones lose to any other
        return cost < best_cost
    if abs(cost - best_cost) > 0.01 * max(cost, best_cost):
        return cost < best_cost
    return key[1:] < best[1:]


def split_constants(graph: Graph, mesh: AbstractMesh, chosen: list[Strategy],
                    output_layouts: list[Layout | None]) -> list[Strategy]:
    """Re-choose, backward from what their consumers need, the strategies of ops whose
    values depend on no graph input (factories and what is computed from them: an
    initialiser's whole body, masks built from `ones`), so each rank computes only its own
    piece of a value that is wanted split instead of the whole value then a slice of it.
    That is how `pxform.shard(init_fn, in_specs=(), out_specs=...)` initialises each shard
    in place, as JAX's `jit(init, out_shardings=...)` does.

    An op is changed only when every reader wants its output in one layout that slices
    alone reach from the current one, and a strategy produces exactly that layout from
    inputs that slices alone reach too: no communication is added, none needs a gradient.

    Example:
        >>> strategies = split_constants(graph, mesh, propagate(graph, mesh, layouts), outs)
    """
    inputs = {v.name for v in graph.inputs}
    dependent: set[str] = set(inputs)
    for op in graph.ops:
        if any(v.name in dependent for v in op.inputs):
            dependent.update(v.name for v in op.outputs)
    chosen = list(chosen)
    readers: dict[str, list[tuple[int, int]]] = {}
    for k, op in enumerate(graph.ops):
        for i, v in enumerate(op.inputs):
            readers.setdefault(v.name, []).append((k, i))
    outputs: dict[str, list[Layout | None]] = {}
    for o, want in zip(graph.outputs, output_layouts):
        if hasattr(o, "name"):
            outputs.setdefault(o.name, []).append(want)
    producer = {v.name: k for k, op in enumerate(graph.ops) for v in op.outputs}

    def layout(name: str) -> Layout | None:
        k = producer.get(name)
        if k is None:
            return None  # an input or a captured constant: as it is
        op = graph.ops[k]
        return chosen[k].outputs[[v.name for v in op.outputs].index(name)]

    def slices_only(t: TensorType, src: Layout, dst: Layout) -> bool:
        steps = relayout(t.shape, t.dtype.itemsize, src, dst, mesh).steps
        return all(s.kind == "slice" or mesh.axis_size(s.axis) == 1 for s in steps)

    for k in range(len(graph.ops) - 1, -1, -1):
        op = graph.ops[k]
        if len(op.outputs) != 1 or op.outputs[0].name in dependent:
            continue
        v = op.outputs[0]
        current = chosen[k].outputs[0]
        wanted = {chosen[j].inputs[i] for j, i in readers.get(v.name, [])}
        wanted |= {w if w is not None else current for w in outputs.get(v.name, [])}
        if len(wanted) != 1:
            continue
        (want,) = wanted
        if want == current or want.partial or not slices_only(v.type, current, want):
            continue
        for s in all_strategies(op, mesh):
            if s.outputs[0] != want:
                continue
            if all((have := layout(x.name)) is None and not s.inputs[i].used_axes()
                   or have is not None and slices_only(x.type, have, s.inputs[i])
                   for i, x in enumerate(op.inputs)):
                chosen[k] = s
                break
    return chosen
