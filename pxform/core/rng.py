"""Plan-independent random numbers: a counter-based generator (Philox4x32-10) evaluated at
each element's global position, and the tag that fixes a random op's positions.

Every random op of a traced function (tagged by `pxform.frontend.rng`) draws the value at global
element index i from `philox(counter=(i, op key), key=seed)`: a pure function, like JAX's
partitionable threefry. A rank computes only the positions it holds, so the numbers at
each position are the same under every plan, mesh, world size, microbatching, coshard
piece and recompute (a recompute replays the same bits because nothing is stateful).

The seed is drawn from torch's default generator once per call of a step (`draw_seed`):
scripts that call `torch.manual_seed(s)` on every rank get the same seed on every rank,
and each call advances the generator, so successive steps draw new masks. The numbers
differ from eager PyTorch's (its CPU and CUDA generators are sequential streams, whose
n-th number depends on how many came before on that device, so no sharded program could
reproduce them).

Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC'11) is
written with int64 tensor ops, 32-bit words in int64 lanes: the low half of a 32x32-bit
product is exact under int64's wrapping multiply, the high half is assembled from two
products with a 16-bit split, so it runs unchanged on any device torch has.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch


@dataclass(frozen=True, slots=True)
class PieceMap:
    """Where a piece's elements sit along one dim of the traced output: piece index q is
    traced index `(q // block) * stride + offset + q % block`. A plain slice starting at
    `s` is `PieceMap(block=len, stride=0, offset=s)`; coshard's piece c of a dim that the
    mesh also splits g ways takes `block` elements from each of the g shards."""

    block: int
    stride: int
    offset: int


@dataclass(frozen=True, slots=True)
class RandomTag:
    """What fixes a random op's numbers: its key (rank among the trace's random ops), the
    traced (global) shape of its output, and, per dim, the piece maps passes applied (in the
    order applied; empty when the op produces the whole traced output)."""

    key: int
    shape: tuple[int, ...]
    pieces: tuple[tuple[PieceMap, ...], ...] = ()

    def with_piece(self, maps: tuple[PieceMap | None, ...]) -> RandomTag:
        """This tag for an op now producing a piece (one map per dim, None: whole)."""
        per_dim = list(self.pieces) or [() for _ in self.shape]
        for d, m in enumerate(maps):
            if m is not None:
                per_dim[d] = per_dim[d] + (m,)
        return replace(self, pieces=tuple(per_dim))


_MASK = 0xFFFFFFFF
_M0, _M1 = 0xD2511F53, 0xCD9E8D57  # Philox multipliers
_W0, _W1 = 0x9E3779B9, 0xBB67AE85  # Weyl key increments
_ROUNDS = 10


def _mulhilo(a: torch.Tensor, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """High and low 32-bit words of `a * m` for 32-bit `a` (int64 lanes) and constant `m`."""
    lo = (a * m) & _MASK  # int64 multiply wraps: its low 32 bits are exact
    hi = (a * (m >> 16) + ((a * (m & 0xFFFF)) >> 16)) >> 16  # < 2^49: no overflow
    return hi, lo


def philox(counter: Sequence[torch.Tensor | int], key: tuple[int, int],
           rounds: int = _ROUNDS) -> list[torch.Tensor]:
    """Philox4x32: four 32-bit counter words (tensors or ints, broadcast) and two key words
    -> four 32-bit output words (int64 tensors).

    Example:
        >>> [hex(int(w)) for w in philox([torch.tensor(0)] * 4, (0, 0))]
        ['0x6627e8d5', '0xe169c58d', '0xbc57ac4c', '0x9b00dbd8']
    """
    like = next(c for c in counter if isinstance(c, torch.Tensor))
    c = [x if isinstance(x, torch.Tensor) else torch.full_like(like, x) for x in counter]
    c = [x.to(torch.int64) for x in torch.broadcast_tensors(*c)]
    k0, k1 = key[0] & _MASK, key[1] & _MASK
    for _ in range(rounds):
        hi0, lo0 = _mulhilo(c[0], _M0)
        hi1, lo1 = _mulhilo(c[2], _M1)
        c = [hi1 ^ c[1] ^ k0, lo1, hi0 ^ c[3] ^ k1, lo0]
        k0, k1 = (k0 + _W0) & _MASK, (k1 + _W1) & _MASK
    return c


def draw_seed(generator: torch.Generator | None = None) -> int:
    """A 64-bit seed from `generator` (default: torch's default CPU generator), advancing
    it: the same on every rank that seeded it alike."""
    with _real_tensors():
        words = torch.randint(0, 2**32, (2,), dtype=torch.int64, device="cpu",
                              generator=generator)
        return int(words[0]) | (int(words[1]) << 32)


def generator_of(target: Any, args: Sequence[Any], kwargs: dict[str, Any]
                 ) -> torch.Generator | None:
    """The `generator=` a random op's call names (None: torch's default)."""
    g = bind(target, args, kwargs).get("generator")
    return g if isinstance(g, torch.Generator) else None


@dataclass(frozen=True)
class Seeds:
    """One call's seeds: one from torch's default generator, and one from each generator
    the function's random ops name with `generator=` (so `torch.randn(..., generator=g)`
    follows `g`'s seed, as a user passing it expects)."""

    default: int | None
    named: tuple[tuple[int, int], ...] = ()  # (id of the generator, seed)

    def of(self, generator: torch.Generator | None) -> int:
        if generator is not None:
            for key, seed in self.named:
                if key == id(generator):
                    return seed
        if self.default is None:
            raise RuntimeError("pxform: a random op ran without a seed for its generator")
        return self.default


def draw_seeds(calls: Sequence[tuple[Any, Sequence[Any], dict[str, Any]]]) -> Seeds | None:
    """The seeds for one call of a function whose random ops are `calls` (target, args,
    kwargs), in program order: one draw per generator they use, in order of first use, on
    every rank alike (every rank knows every op, so generators advance the same
    everywhere). None when there is no random op."""
    if not calls:
        return None
    default: int | None = None
    named: list[tuple[int, int]] = []
    for target, args, kwargs in calls:
        g = generator_of(target, args, kwargs)
        if g is None:
            if default is None:
                default = draw_seed()
        elif all(key != id(g) for key, _ in named):
            named.append((id(g), draw_seed(g)))
    return Seeds(default, tuple(named))


def _real_tensors() -> Any:
    """A context where tensors are real even under a FakeTensorMode (device tests)."""
    try:
        from torch._subclasses.fake_tensor import unset_fake_temporarily
    except ImportError:  # pragma: no cover - older torch
        import contextlib
        return contextlib.nullcontext()
    return unset_fake_temporarily()


def coordinates(tag: RandomTag, dims: Sequence[Sequence[str]], shape: Sequence[int],
                index: Any, sizes: Any, device: torch.device) -> list[torch.Tensor]:
    """Per dim, the traced (global) index of each element this rank holds of a random op's
    output: `shape` is the output's shape in the lowered graph (a coshard piece's, or the
    traced one), `dims` the mesh axes splitting each dim (outer first, cut as `torch.chunk`
    cuts), `index`/`sizes` this rank's coordinate and the size of each axis."""
    pieces = tag.pieces or tuple(() for _ in shape)
    out = []
    for d, size in enumerate(shape):
        start, length = 0, size
        for a in dims[d]:
            n, i = sizes[a], index[a]
            chunk = -(-length // n)
            start, length = start + i * chunk, max(0, min(chunk, length - i * chunk))
        q = torch.arange(start, start + length, dtype=torch.int64, device=device)
        for m in reversed(pieces[d]):  # back through each piece map to the traced index
            q = (q // m.block) * m.stride + m.offset + q % m.block
        out.append(q)
    return out


def bits(linear: torch.Tensor, seed: int, key: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Two independent 32-bit words (int64 tensors) per element of `linear` (global
    indices), for op `key` under `seed`."""
    lo = linear & _MASK
    hi = linear >> 32
    w = philox([lo, hi, key & _MASK, (key >> 32) & _MASK], (seed & _MASK, seed >> 32))
    return w[0], w[1]


def uniform(w0: torch.Tensor, w1: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Uniform in [0, 1) with as many bits as `dtype`'s significand holds (so rounding
    never gives 1.0): 53 for float64, 24 for float32, 11 for float16, 8 for bfloat16."""
    digits = {torch.float64: 53, torch.float32: 24, torch.float16: 11,
              torch.bfloat16: 8}.get(dtype, 24)
    m = ((w0 << (digits - 32)) | (w1 >> (64 - digits))) if digits > 32 else \
        w0 >> (32 - digits)
    return (m.to(torch.float64) * 2.0 ** -digits).to(dtype)


def normal(w0: torch.Tensor, w1: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Standard normal by Box-Muller on the two words (computed in float64)."""
    u1 = (w0.to(torch.float64) + 0.5) * 2.0 ** -32  # in (0, 1): log is finite
    u2 = w1.to(torch.float64) * 2.0 ** -32
    return (torch.sqrt(-2.0 * torch.log(u1)) * torch.cos(2 * math.pi * u2)).to(dtype)


def below(w0: torch.Tensor, p: float | torch.Tensor) -> torch.Tensor:
    """Bernoulli: True with probability p (32-bit resolution, exact comparison)."""
    threshold = p * 2.0 ** 32
    if isinstance(threshold, torch.Tensor):
        threshold = threshold.to(torch.float64)
    return w0.to(torch.float64) < threshold


def bind(target: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> dict[str, Any]:
    """An aten call's arguments by schema name, defaults filled in."""
    out: dict[str, Any] = {}
    schema = target._schema
    for i, arg in enumerate(schema.arguments):
        if i < len(args) and not arg.kwarg_only:
            out[arg.name] = args[i]
        elif arg.name in kwargs:
            out[arg.name] = kwargs[arg.name]
        elif arg.has_default_value():
            out[arg.name] = arg.default_value
    return out


def _as_float(x: Any) -> float:
    return float(x) if not isinstance(x, torch.Tensor) else float(x.item())


CHUNK = 1 << 13
"""Elements drawn per pass: the generator's int64 and float64 temporaries stay under
about 1 MiB however large the tensor (an initialiser on a rank must not need more than
the shard it fills)."""


def field(coords: Sequence[torch.Tensor], shape: Sequence[int], dtype: torch.dtype,
          fill: Any, device: torch.device | None = None,
          into: torch.Tensor | None = None) -> torch.Tensor:
    """A tensor over the grid `coords` (per-dim traced indices; its shape is their
    lengths), filled chunk by chunk: `fill(linear, start, stop)` gets the traced linear
    indices (in `shape`) of flat elements [start, stop) and returns their values."""
    lengths = [c.numel() for c in coords]
    device = coords[0].device if coords else device
    fits = (into is not None and into.dtype == dtype and list(into.shape) == lengths
            and into.is_contiguous() and not into.requires_grad)
    out = into if fits else torch.empty(lengths, dtype=dtype, device=device)
    assert out is not None
    flat = out.view(-1)
    strides = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * shape[d + 1]
    n = flat.numel()
    for start in range(0, n, CHUNK):
        stop = min(n, start + CHUNK)
        rest = torch.arange(start, stop, dtype=torch.int64, device=device)
        linear = torch.zeros_like(rest)
        for d in range(len(lengths) - 1, -1, -1):
            linear += coords[d][rest % lengths[d]] * strides[d]
            rest = rest // lengths[d]
        flat[start:stop] = fill(linear, start, stop)
    return out


def _piece(t: Any, shape: Sequence[int], start: int, stop: int) -> Any:
    """Flat elements [start, stop) of `t` broadcast to `shape` (a tensor argument such as
    bernoulli's probabilities), or `t` itself when it is a number."""
    if not isinstance(t, torch.Tensor):
        return t
    return t.expand(*shape).reshape(-1)[start:stop]


def sample(name: str, target: Any, args: Sequence[Any], kwargs: dict[str, Any],
           coords: list[torch.Tensor], tag: RandomTag, seed: int, dtype: torch.dtype,
           device: torch.device | None = None, into: torch.Tensor | None = None) -> Any:
    """Evaluate random op `name` (an aten call with local arguments) on this rank's
    elements, whose traced indices are `coords` (per dim), for the call's `seed`, on
    `device`. `dtype` is the op's output dtype. The semantics follow torch's ops; the
    numbers come from `bits` at each element's global index, drawn `CHUNK` elements at a
    time."""
    b = bind(target, args, kwargs)
    key = tag.key
    shape = [c.numel() for c in coords]

    def draw(out_dtype: torch.dtype, values: Any, grid: Sequence[torch.Tensor] = coords
             ) -> torch.Tensor:
        """`values(w0, w1, start, stop)` over the grid, from the bits at each element."""
        def fill(linear: torch.Tensor, start: int, stop: int) -> torch.Tensor:
            w0, w1 = bits(linear, seed, key)
            return values(w0, w1, start, stop)
        return field(grid, tag.shape, out_dtype, fill, device,
                     into if grid is coords else None)

    if name in ("dropout", "native_dropout", "feature_dropout", "alpha_dropout",
                "feature_alpha_dropout"):
        x, p = b["input"], _as_float(b["p"])
        if p == 0.0 or b.get("train", True) is False:
            # nothing is dropped (eval mode, or p = 0 as GPT configs often set): no bits
            # to draw; torch's dropout then returns its input itself, and so does this
            if name == "native_dropout":
                return x.clone(), torch.ones(x.shape, dtype=torch.bool, device=x.device)
            return x
        grid = coords
        if name.startswith("feature") and x.dim() > 2:  # one draw per (example, channel)
            grid = [c if d < 2 else c[:1] * 0 for d, c in enumerate(coords)]
        keep = draw(torch.bool, lambda w0, w1, i, j: ~below(w0, p), grid)
        if name.endswith("alpha_dropout"):
            alpha = 1.7580993408473766
            a = 1.0 / math.sqrt((alpha * alpha * p + 1) * (1 - p))
            k = keep.to(x.dtype)
            return x * (k * a) + ((k - 1) * (alpha * a) + alpha * a * p)
        scale = 0.0 if p >= 1 else 1.0 / (1 - p)
        out = x * keep.to(x.dtype) * scale
        return (out, keep) if name == "native_dropout" else out
    if name == "bernoulli":
        prob = b["input"] if b.get("p") is None else b["p"]
        return draw(dtype, lambda w0, w1, i, j: below(w0, _piece(prob, shape, i, j)))
    if name in ("rand", "rand_like"):
        return draw(dtype, lambda w0, w1, i, j: uniform(w0, w1, dtype))
    if name in ("randn", "randn_like"):
        return draw(dtype, lambda w0, w1, i, j: normal(w0, w1, dtype))
    if name in ("normal", "normal_functional"):
        mean, std = b.get("mean", 0.0), b.get("std", 1.0)
        return draw(dtype, lambda w0, w1, i, j: (
            _piece(mean, shape, i, j) + _piece(std, shape, i, j)
            * normal(w0, w1, torch.float64)).to(dtype))
    if name == "uniform":
        lo, hi = _as_float(b.get("from", 0.0)), _as_float(b.get("to", 1.0))
        return draw(dtype, lambda w0, w1, i, j: (
            lo + (hi - lo) * uniform(w0, w1, torch.float64)).to(dtype))
    if name in ("randint", "randint_like", "random"):
        low = int(b.get("low", b.get("from", 0)) or 0)
        high = b.get("high", b.get("to"))
        if high is None:
            # torch's default range: every integer the dtype holds exactly
            digits = {torch.float64: 53, torch.float32: 24, torch.float16: 11,
                      torch.bfloat16: 8}
            high = 2 ** digits.get(dtype, 53)
        span = int(high) - low
        return draw(dtype, lambda w0, w1, i, j: (
            low + torch.floor(uniform(w0, w1, torch.float64) * span)).to(dtype))
    if name == "exponential":
        rate = _as_float(b.get("lambd", 1.0))
        return draw(dtype, lambda w0, w1, i, j: (
            -torch.log1p(-uniform(w0, w1, torch.float64)) / rate).to(dtype))
    if name == "geometric":
        log_q = math.log1p(-_as_float(b["p"]))
        return draw(dtype, lambda w0, w1, i, j: torch.ceil(
            torch.log((w0.to(torch.float64) + 0.5) * 2.0 ** -32) / log_q).to(dtype))
    if name == "log_normal":
        mu, sigma = _as_float(b.get("mean", 1.0)), _as_float(b.get("std", 2.0))
        return draw(dtype, lambda w0, w1, i, j: torch.exp(
            mu + sigma * normal(w0, w1, torch.float64)).to(dtype))
    if name == "cauchy":
        median, sigma = _as_float(b.get("median", 0.0)), _as_float(b.get("sigma", 1.0))
        return draw(dtype, lambda w0, w1, i, j: (median + sigma * torch.tan(
            math.pi * (uniform(w0, w1, torch.float64) - 0.5))).to(dtype))
    if name == "randperm":
        # 53 random bits per position (ties improbable), then their order
        keys = draw(torch.int64, lambda w0, w1, i, j: (w0 << 21) | (w1 >> 11))
        return torch.argsort(keys, stable=True).to(dtype)
    raise NotImplementedError(f"pxform: random op {name} has no plan-independent form")
