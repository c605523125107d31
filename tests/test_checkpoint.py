"""`load_checkpoint`: a full checkpoint (torch.save, safetensors, a Hugging Face folder) loads
into this rank's shards (DTensors of any layout, None placeholders of a pipeline rank)
without any rank holding the whole model; errors name the leaf, the key and the fix on
every rank; DCP reshards sharded checkpoints across plans. 4 gloo ranks."""

from __future__ import annotations

import json
import os

import checkpoint_workers as W
import pytest
import torch

from pxform.core.errors import SpecError
from pxform.runtime.checkpoint import _entries, load_checkpoint
from pxform.tools.testing import World

TIMEOUT_S = 240
MIB = 1 << 20


@pytest.fixture(scope="module")
def world():
    # glibc returns freed blocks over 128 KiB to the system at once, so the resident-set
    # high-water mark measures what loading holds, not what the allocator kept
    old = os.environ.get("MALLOC_MMAP_THRESHOLD_")
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "131072"
    try:
        with World(4, timeout=TIMEOUT_S) as w:
            yield w
    finally:
        if old is None:
            del os.environ["MALLOC_MMAP_THRESHOLD_"]
        else:
            os.environ["MALLOC_MMAP_THRESHOLD_"] = old


def _assert_all_equal(results: list[dict]) -> None:
    for rank, r in enumerate(results):
        for path, leaf in r.items():
            if leaf is None:
                continue
            assert leaf == {"equal": True, "kind": True, "like_untouched": True}, \
                (rank, path, leaf)


@pytest.mark.parametrize("layout", ["tp", "zero3"])
def test_torch_save_loads_into_shards(world, tmp_path, layout):
    path = str(tmp_path / "model.pt")
    torch.save(W.small_model(), path)
    results = world.run(W.load, path, layout)
    _assert_all_equal(results)
    nones = {"tp": {"layers.1.w"}, "zero3": {"layers.0"}}[layout]
    loaded = {"tp": {"layers.0.w", "layers.0.b", "layers.1.b", "head.w", "steps"},
              "zero3": {"layers.1.w", "layers.1.b", "head.w", "steps"}}[layout]
    for r in results:
        assert {p for p, v in r.items() if v is None} == nones
        assert {p for p, v in r.items() if v is not None} == loaded


def test_safetensors_loads_into_shards_and_matches_the_library(world, tmp_path):
    path = str(tmp_path / "model.safetensors")
    # a Hugging Face style name prefix, mapped with key=
    W.write_safetensors(path, {"model." + k: v for k, v in W.flat(W.small_model()).items()},
                        metadata={"format": "pt"})
    for layout in ("tp", "zero3"):
        _assert_all_equal(world.run(W.load, path, layout, "model."))

    mixed = str(tmp_path / "mixed.safetensors")
    W.write_safetensors(mixed, W.mixed_dtypes())
    results = world.run(W.load_mixed_dtypes, mixed)
    _assert_all_equal(results)
    assert set(results[0]) == {"f32", "f64", "f16", "bf16", "i64", "i32", "bool", "bf16_as_f32"}

    st = pytest.importorskip("safetensors.torch")
    for file in (path, mixed):  # our writer, read by the library and by our reader
        ours = {k: e.open() for k, e in _entries(file, file).items()}
        theirs = st.load_file(file)
        assert set(ours) == set(theirs)
        for k in theirs:
            assert ours[k].dtype == theirs[k].dtype and torch.equal(ours[k], theirs[k]), k
    lib = str(tmp_path / "lib.safetensors")  # the library's writer, read by our reader
    st.save_file(W.mixed_dtypes(), lib)
    loaded = load_checkpoint(lib, {k: torch.empty_like(v) for k, v in W.mixed_dtypes().items()})
    for k, v in W.mixed_dtypes().items():
        assert loaded[k].dtype == v.dtype and torch.equal(loaded[k], v), k


def test_no_rank_holds_the_whole_model(world, tmp_path):
    n, rows, cols = 8, 2048, 1024  # 8 x 8 MiB float32 = 64 MiB, split 4 ways
    g = torch.Generator().manual_seed(0)
    model = {f"w{i}": torch.randn(rows, cols, generator=g) for i in range(n)}
    full = n * rows * cols * 4
    files = {"torch.save": str(tmp_path / "big.pt"),
             "safetensors": str(tmp_path / "big.safetensors")}
    torch.save(model, files["torch.save"])
    W.write_safetensors(files["safetensors"], model)
    del model
    for fmt, path in files.items():
        results = world.run(W.memory, path, n, rows, cols)
        for rank, r in enumerate(results):
            print(f"{fmt} rank {rank}: resident set {r['before'] / MIB:.1f} MiB before, "
                  f"peak {r['peak'] / MIB:.1f} MiB, growth {r['growth'] / MIB:.1f} MiB, "
                  f"after {r['after'] / MIB:.1f} MiB; "
                  f"pieces held {r['held'] / MIB:.1f} MiB; whole model {full / MIB:.0f} MiB")
            assert r["ok"], (fmt, rank)
            assert r["held"] == full // 4
            assert r["growth"] < full, (fmt, rank, r)
            # the pieces (a quarter) plus about one tensor's slice of file pages: holding the
            # touched file pages until the end would make it half the model
            assert r["growth"] < full // 2, (fmt, rank, r)


def test_errors_name_the_leaf_the_shapes_and_the_fix_on_every_rank(world, tmp_path):
    path = str(tmp_path / "model.pt")
    torch.save(W.small_model(), path)
    results = world.run(W.errors, path)
    assert all(r == results[0] for r in results), "every rank raises the same error"
    missing, shape, via_none = results[0]
    head = f"pxform.load_checkpoint({path}): "
    assert missing.startswith(head)
    assert "leaf 'layers.0.weight' looks for key 'layers.0.weight'" in missing
    assert "close keys: 'layers.0.w'" in missing and "\n  Fix: pass key=" in missing
    assert shape.startswith(head)
    assert "leaf 'layers.0.w' has shape (48, 64)" in shape and "has shape (64, 48)" in shape
    assert "\n  Fix: " in shape
    # rank 0 holds None for 'extra', the others a tensor: all raise
    assert via_none.startswith(head) and "leaf 'extra' looks for key 'extra'" in via_none


def test_dcp_reshards_across_plans(world, tmp_path):
    results = world.run(W.dcp_reshard, str(tmp_path / "dcp"))
    for rank, r in enumerate(results):
        assert r and all(r.values()), (rank, r)


# ---------------------------------------------------------------- one process


def test_plain_tensors_mappings_and_folders(tmp_path):
    model = W.flat(W.small_model())
    like = {"layers": [{"w": torch.zeros(64, 48, dtype=torch.float64), "b": None},
                       {"w": torch.zeros(64, 48), "b": torch.zeros(50)}],
            "head": {"w": torch.zeros(5, 48, requires_grad=True)}, "steps": 7}
    # a Hugging Face folder: two safetensors files and the index naming them
    names = sorted(model)
    parts = {"model-00001-of-00002.safetensors": names[:3],
             "model-00002-of-00002.safetensors": names[3:]}
    for file, keys in parts.items():
        W.write_safetensors(str(tmp_path / file), {k: model[k] for k in keys})
    with open(tmp_path / "model.safetensors.index.json", "w") as f:
        json.dump({"weight_map": {k: file for file, keys in parts.items() for k in keys}}, f)
    for source in (model, str(tmp_path), str(tmp_path / "model.safetensors.index.json")):
        out = load_checkpoint(source, like)
        assert out["steps"] == 7 and out["layers"][0]["b"] is None
        assert out["layers"][0]["w"].dtype == torch.float64  # cast to the leaf's dtype
        assert torch.equal(out["layers"][0]["w"], model["layers.0.w"].double())
        assert torch.equal(out["layers"][1]["b"], model["layers.1.b"])
        assert out["head"]["w"].requires_grad and out["head"]["w"].is_leaf
        assert not like["head"]["w"].any()  # `like` is never changed


def test_no_match_suggests_the_prefix(tmp_path):
    source = {"model.w": torch.zeros(2), "model.b": torch.zeros(2)}
    with pytest.raises(SpecError) as e:
        load_checkpoint(source, {"w": torch.zeros(2), "b": None})
    assert str(e.value).startswith("pxform.load_checkpoint(<mapping>): no leaf of `like`")
    assert "key=lambda path: 'model.' + path" in str(e.value)
    path = tmp_path / "missing.pt"
    with pytest.raises(SpecError, match="no such file"):
        load_checkpoint(path, {"w": torch.zeros(2)})


def test_tied_and_repeated_keys_read_right_after_pages_are_dropped(tmp_path):
    # "a" and "b" share one storage in the file; three leaves read it, in slices and whole
    t = torch.arange(4096 * 8, dtype=torch.float32).reshape(8, 4096)
    path = str(tmp_path / "tied.pt")
    torch.save({"a": t, "b": t, "c": t[2:5]}, path)
    like = {"a": torch.zeros(8, 4096), "b": torch.zeros(8, 4096), "again": torch.zeros(8, 4096),
            "c": torch.zeros(3, 4096, dtype=torch.float64)}
    out = load_checkpoint(path, like, key={"again": "a"})
    for k in ("a", "b", "again"):
        assert torch.equal(out[k], t), k
    assert torch.equal(out["c"], t[2:5].double())
