"""In-place writes through views inside traced functions (issue 17's initialisers, issue 20's
library code): functionalised into `select_scatter` / `slice_scatter` of the viewed value,
views taken before a write are taken again, and the traced function equals eager PyTorch.
Writes into arguments and through views pxform cannot write back are refused with the fix."""

from __future__ import annotations

import pytest
import torch

import pxform
from pxform import P


def shift_right(input_ids):
    """T5/BART's decoder inputs: labels shifted right by a slice assignment."""
    shifted = input_ids.new_zeros(input_ids.shape)
    shifted[..., 1:] = input_ids[..., :-1].clone()
    shifted[..., 0] = 7
    shifted.masked_fill_(shifted == -100, 0)
    return shifted


def stale_view(x):
    y = x * 2
    first = y[0]            # taken before the writes below
    y[1].zero_()
    y[0].add_(1)
    y.t()[2].mul_(3)        # through a transpose
    return first + 1, y


def padding_row(x):
    w = torch.empty(5, 3)
    torch.nn.init.normal_(w)
    with torch.no_grad():
        w[0].fill_(0)       # nn.Embedding's padding row
    return x @ w.t()


@pytest.mark.parametrize("fn, arg", [
    (shift_right, torch.tensor([[3, 4, -100, 5], [1, 2, 3, 4]])),
    (stale_view, torch.arange(12.0).view(3, 4)),
])
def test_writes_through_views_equal_eager(fn, arg):
    traced = pxform.trace(fn, arg)
    names = {op.name for op in traced.graph.ops}
    assert names & {"select_scatter", "slice_scatter"}
    got, want = traced(arg), fn(arg.clone())
    for g, w in zip(got if isinstance(got, tuple) else (got,),
                    want if isinstance(want, tuple) else (want,)):
        assert torch.equal(g, w)


def test_a_written_padding_row_is_zero_and_the_rest_drawn():
    traced = pxform.trace(padding_row, torch.ones(2, 3))
    out = traced(torch.eye(3)[:2])
    assert torch.equal(out[:, 0], torch.zeros(2)) and bool((out[:, 1:] != 0).all())


def test_scatters_lower_with_the_written_dim_whole():
    # the batch dim splits; the written dim (1) stays whole on every rank
    program = pxform.shard(shift_right, mesh=pxform.AbstractMesh({"dp": 2}),
                           in_specs=(P("dp"),), out_specs=P("dp")).lower(
        torch.zeros(4, 6, dtype=torch.long))
    text = program.as_text()
    assert "slice_scatter" in text and "select_scatter" in text
    assert "all_gather" not in text and "all_to_all" not in text


def test_writing_an_argument_is_refused():
    def bad(x):
        x[0].zero_()
        return x

    with pytest.raises(pxform.TraceError, match=r"mutates the function's argument %x in "
                                                r"place.*\n  Fix: pure functions must not "
                                                r"modify their inputs"):
        pxform.trace(bad, torch.ones(2, 2))


def test_writing_through_an_expand_is_refused_with_the_fix():
    def bad(x):
        y = x * 1
        y.expand(3, 2, 2).add_(1)
        return y

    with pytest.raises(pxform.TraceError, match=r"mutates a view of %0 made by expand.*"
                                                r"\n  Fix: build the new tensor out of place"):
        pxform.trace(bad, torch.ones(2, 2))
