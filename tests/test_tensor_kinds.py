"""Tensors that are not flat, contiguous, dense CPU arrays: what a save keeps, what it refuses
(at save time, saying what to do), and what a load does with them. One process."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import trainguard as tg


def _bits(t: torch.Tensor) -> list[int]:
    return t.contiguous().reshape(-1).view(torch.uint8).tolist()


# ------------------------------------------------------------------ non-contiguous tensors
def test_channels_last_model_and_its_adam_state_save_and_load(tmp_path):
    # The standard recipe for conv nets on GPUs: the weights and Adam's moments (zeros_like
    # keeps the memory format) are channels_last, not contiguous.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 4, 3)).to(memory_format=torch.channels_last)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    x = torch.randn(2, 3, 8, 8).to(memory_format=torch.channels_last)
    model(x).square().mean().backward()
    opt.step()
    assert not model[0].weight.is_contiguous() and not opt.state[model[0].weight]["exp_avg"].is_contiguous()
    tg.save(tmp_path / "c", {"model": model, "optim": opt})

    fresh = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 4, 3)).to(memory_format=torch.channels_last)
    fopt = torch.optim.Adam(fresh.parameters(), lr=1e-2)
    before = fresh[0].weight
    assert not torch.equal(fresh[0].weight, model[0].weight)
    tg.load(tmp_path / "c", {"model": fresh, "optim": fopt})
    for a, b in zip(fresh.parameters(), model.parameters()):
        assert _bits(a) == _bits(b)
        assert a.is_contiguous(memory_format=torch.channels_last) == b.is_contiguous(memory_format=torch.channels_last)
        assert all(torch.equal(fopt.state[a][k], opt.state[b][k]) for k in ("exp_avg", "exp_avg_sq", "step"))
    assert fresh[0].weight is before and fopt.param_groups[0]["params"][0] is before


@pytest.mark.parametrize(
    "make",
    [lambda b: b.t(), lambda b: b[::2], lambda b: b[:, 1:3], lambda b: b.reshape(2, 3, 2, 2).permute(0, 2, 3, 1)],
    ids=["transposed", "every_other_row", "column_slice", "permuted"],
)
def test_non_contiguous_tensor_saves_its_values_and_leaves_the_live_tensor_alone(tmp_path, make):
    base = torch.randn(6, 4)
    v = make(base)
    assert not v.is_contiguous()
    kept = (v.data_ptr(), v.stride())
    tg.save(tmp_path / "c", {"x": {"w": v}})
    assert (v.data_ptr(), v.stride()) == kept  # not replaced or moved
    out = {"x": {"w": torch.zeros(v.shape)}}
    tg.load(tmp_path / "c", out)
    assert _bits(out["x"]["w"]) == _bits(v)


def test_expanded_view_is_refused_naming_its_path_and_what_to_save(tmp_path):
    row = torch.randn(1, 4)
    with pytest.raises(tg.UnsupportedValueError, match=r"x/w: .*share memory.*expand"):
        tg.save(tmp_path / "c", {"x": {"w": row.expand(1000, 4)}})
    assert not (tmp_path / "c").exists()


def test_async_save_of_a_channels_last_model_keeps_the_values_of_the_save_call(tmp_path):
    model = nn.Conv2d(3, 8, 3).to(memory_format=torch.channels_last)
    want = model.weight.detach().clone()
    with tg.CheckpointManager(tmp_path / "run", save=tg.EveryNSteps(1), async_save=True) as mgr:
        handle = mgr.save(1, {"model": model})
        with torch.no_grad():
            model.weight.add_(1.0)  # after the call: not in the checkpoint
        handle.result(timeout=120)
    fresh = nn.Conv2d(3, 8, 3)
    tg.load(tmp_path / "run" / "step-000000001", {"model": fresh})
    assert _bits(fresh.weight) == _bits(want)


# ------------------------------------------------------------------ dtypes
@pytest.mark.parametrize("name", ["float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu", "float4_e2m1fn_x2", "complex32"])
def test_low_precision_dtypes_round_trip_bit_exactly_in_place_and_into_new_tensors(tmp_path, name):
    # MX training's e8m0 scales and packed fp4, the fnuz float8s, complex32: refused before.
    dt = getattr(torch, name)
    x = torch.empty(3 << 18, dtype=dt)  # 0.75 MiB (1-byte dtypes) or 3 MiB (complex32), and a 5-element head
    x.view(torch.uint8).copy_(torch.randint(0, 256, (x.nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1)))
    tg.save(tmp_path / "c", {"model": {"w": x, "head": x[:5].clone()}})
    live = {"w": torch.empty_like(x), "head": torch.empty_like(x[:5])}
    for t in live.values():
        t.view(torch.uint8).zero_()
    out = {"model": live}
    tg.load(tmp_path / "c", out)
    assert out["model"]["w"] is live["w"] and _bits(live["w"]) == _bits(x) and _bits(live["head"]) == _bits(x[:5])
    fresh = {"model": None}
    tg.load(tmp_path / "c", fresh)
    assert fresh["model"]["w"].dtype == dt and _bits(fresh["model"]["w"]) == _bits(x)


# ------------------------------------------------------------------ refused at save, saying what to do
@pytest.mark.parametrize(
    "make, says",
    [
        (lambda: torch.randn(3, 3).to_sparse(), r"sparse_coo.*to_dense\(\)"),
        (lambda: torch.randn(3, 3).to_sparse_csr(), r"sparse_csr.*to_dense\(\)"),
        (lambda: torch.nested.nested_tensor([torch.randn(2), torch.randn(3)]), r"nested.*unbind\(\)"),
        (lambda: torch.empty(3, device="meta"), r"a meta tensor holds no data.*to_empty"),
        (lambda: torch.quantize_per_tensor(torch.randn(4), 0.1, 3, torch.qint8), r"quantized.*int_repr\(\).*dequantize\(\)"),
        (lambda: torch.zeros(4, dtype=torch.int4) if hasattr(torch, "int4") else torch.zeros(4, dtype=torch.bits8),
         r"dtype torch\.\w+ is not supported.*float32.*\.to\("),
    ],
    ids=["sparse_coo", "sparse_csr", "nested", "meta", "qint8", "unsupported_dtype"],
)
def test_tensor_kinds_without_a_dense_byte_layout_are_refused_at_save(tmp_path, make, says):
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # nested/sparse CSR constructors warn that they are prototypes
        t = make()
    with pytest.raises(tg.UnsupportedValueError, match=r"model/w: " + says):
        tg.save(tmp_path / "c", {"model": {"w": t}})
    assert not (tmp_path / "c").exists()


@pytest.mark.parametrize(
    "shape, says",
    [([1] * 16 + [2], r"17 dimensions.*at most 16.*reshape"), ([0, 2**50], r"dimension of 1125899906842624")],
    ids=["17_dims", "huge_empty_dim"],
)
def test_a_shape_the_loader_would_refuse_is_refused_at_save(tmp_path, shape, says):
    # These saved and committed, and then every load refused the manifest as corrupt.
    with pytest.raises(tg.UnsupportedValueError, match=r"x: .*" + says):
        tg.save(tmp_path / "c", {"x": torch.empty(shape)})
    assert not (tmp_path / "c").exists()
    ok = torch.arange(6.0).reshape([1] * 14 + [2, 3])  # 16 dimensions: the limit, saved and loaded
    tg.save(tmp_path / "d", {"x": ok})
    out = {"x": torch.zeros_like(ok)}
    tg.load(tmp_path / "d", out)
    assert torch.equal(out["x"], ok)


# ------------------------------------------------------------------ loading into meta tensors
def test_load_into_a_model_built_on_meta_is_refused_naming_to_empty(tmp_path):
    # A model built under torch.device("meta") holds no memory: the load read nothing into it
    # and returned as if it had loaded.
    model = nn.Linear(4, 3)
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    tg.save(tmp_path / "c", {"model": model, "optim": opt})
    with torch.device("meta"):
        fresh = nn.Linear(4, 3)
    with pytest.raises(tg.StateMismatchError, match=r"model/weight \(the state's tensor is on the meta device.*to_empty"):
        tg.load(tmp_path / "c", {"model": fresh}, only=["model"])
    with pytest.warns(UserWarning, match=r"model/bias \(the state's tensor is on the meta device"):
        tg.load(tmp_path / "c", {"model": fresh}, strict=False, only=["model"])
    assert fresh.weight.is_meta
    fresh.to_empty(device="cpu")  # the fix the message names
    fopt = torch.optim.Adam(fresh.parameters())
    tg.load(tmp_path / "c", {"model": fresh, "optim": fopt})
    assert torch.equal(fresh.weight, model.weight) and torch.equal(fopt.state[fresh.weight]["exp_avg"], opt.state[model.weight]["exp_avg"])


def test_plain_meta_tensor_entries_are_replaced_by_the_loaded_tensor(tmp_path):
    tg.save(tmp_path / "c", {"x": torch.arange(3.0), "extra": {"w": torch.ones(2, 2)}})
    state = {"x": torch.empty(3, device="meta"), "extra": {"w": torch.empty(2, 2, device="meta")}}
    tg.load(tmp_path / "c", state)
    assert torch.equal(state["x"], torch.arange(3.0)) and torch.equal(state["extra"]["w"], torch.ones(2, 2))


# ------------------------------------------------------------------ interop
def test_convert_of_a_torch_file_holding_a_sparse_tensor_is_one_error_line(tmp_path):
    from click.testing import CliRunner

    from trainguard.cli import main

    torch.save({"emb": torch.randn(4, 3).to_sparse(), "b": torch.ones(2)}, tmp_path / "sparse.pt")
    res = CliRunner().invoke(main, ["convert", str(tmp_path / "sparse.pt"), str(tmp_path / "out")])
    assert res.exit_code == 2, res.output  # before: a RuntimeError traceback from .contiguous()
    assert "error: model/emb: sparse_coo tensors cannot be saved" in res.output and "to_dense()" in res.output
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------ in-place loads keep identity
def test_load_into_a_non_contiguous_parameter_outside_a_module_keeps_it_and_its_grad_flag(tmp_path):
    # A plain entry's tensors are the user's own (no state_dict() detaches them): a Parameter
    # or a view of a leaf that requires grad, read through a staging tensor, then copied in.
    src = {"ema": {"conv": torch.randn(2, 3, 4, 5), "proj": torch.randn(4, 3)}}
    tg.save(tmp_path / "c", src)
    conv = nn.Parameter(torch.zeros(2, 3, 4, 5).to(memory_format=torch.channels_last))
    leaf = torch.zeros(3, 4, requires_grad=True)
    state = {"ema": {"conv": conv, "proj": leaf.t()}}
    tg.load(tmp_path / "c", state)  # before: RuntimeError 'a leaf Variable that requires grad ... in-place'
    assert state["ema"]["conv"] is conv and conv.requires_grad and torch.equal(conv, src["ema"]["conv"])
    assert conv.is_contiguous(memory_format=torch.channels_last)
    assert leaf.requires_grad and leaf.grad_fn is None and torch.equal(leaf.t(), src["ema"]["proj"])


def test_a_read_through_scratch_into_a_tensor_that_requires_grad_lands_in_place(tmp_path):
    # Columns of a saved matrix (what a load of a dim-1-sharded checkpoint reads) are copied
    # from a scratch buffer into the destination: a plain entry's Parameter refused that copy_.
    from trainguard import io
    from trainguard.commit import read_manifest
    from trainguard.index import ChunkSource, plan_args
    from trainguard.planner import Box, plan_reads
    from trainguard.storage.local import LocalStorage

    w = torch.randn(8, 6)
    tg.save(tmp_path / "c", {"w": w})
    storage, d = LocalStorage(), str(tmp_path / "c")
    m = read_manifest(storage, d)
    box = Box((0, 3), (8, 3))
    ops = plan_reads(plan_args(ChunkSource.of(storage, d, m).chunks("w", m.tensors["w"], box)), box, 4, m.block_size, True)
    assert ops and all(op.dest_byte is None for op in ops)  # through a scratch buffer
    dest = nn.Parameter(torch.zeros(8, 3))
    io.read_targets(storage, d, [io.ReadTarget("w", dest, box, ops)])
    assert torch.equal(dest, w[:, 3:]) and dest.requires_grad and dest.grad_fn is None


# ------------------------------------------------------------------ tied weights
class _TiedLM(nn.Module):
    """A GPT's tie: ``lm_head.weight`` IS ``wte.weight`` (two state_dict keys, one Parameter)."""

    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(10, 4)
        self.ln = nn.LayerNorm(4)
        self.lm_head = nn.Linear(4, 10, bias=False)
        self.lm_head.weight = self.wte.weight


def test_tied_model_round_trips_and_keeps_the_tie_and_the_optimizer_parameters(tmp_path):
    model = _TiedLM()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model.lm_head(model.ln(model.wte(torch.tensor([1, 2])))).sum().backward()
    opt.step()
    tg.save(tmp_path / "c", {"model": model, "optim": opt})
    fresh = _TiedLM()
    fopt = torch.optim.AdamW(fresh.parameters(), lr=0.1)
    tied = fresh.wte.weight
    assert not torch.equal(tied, model.wte.weight)
    tg.load(tmp_path / "c", {"model": fresh, "optim": fopt})
    assert fresh.lm_head.weight is fresh.wte.weight is tied and fopt.param_groups[0]["params"][0] is tied
    assert torch.equal(tied, model.wte.weight)
    assert torch.equal(fopt.state[tied]["exp_avg"], opt.state[model.wte.weight]["exp_avg"])


def test_a_strict_load_takes_one_name_of_a_tie_for_both(tmp_path):
    # safetensors refuses shared tensors, so its save_model (and Hugging Face's save_pretrained)
    # keep one name of a tie; a converted file of theirs has no 'lm_head.weight'.
    from safetensors.torch import save_model

    from trainguard.convert import convert

    model = _TiedLM()
    save_model(model, str(tmp_path / "m.safetensors"))
    convert(tmp_path / "m.safetensors", tmp_path / "imported")
    fresh = _TiedLM()
    tg.load(tmp_path / "imported", {"model": fresh})  # before: StateMismatchError, one name 'missing'
    assert fresh.lm_head.weight is fresh.wte.weight and torch.equal(fresh.wte.weight, model.wte.weight)
    tg.save(tmp_path / "b", {"model": {"bias": torch.zeros(10)}})
    with pytest.raises(tg.StateMismatchError, match=r"missing from the checkpoint \(1\): model/weight"):
        tg.load(tmp_path / "b", {"model": nn.Linear(4, 10)})  # a missing name with no tie: still reported


# ------------------------------------------------------------------ tensor subclasses
class _Tagged(torch.Tensor):
    """A ``__torch_function__`` subclass: its own memory holds its values."""


def test_torch_function_subclass_saves_its_values_and_loads_in_place_keeping_its_type(tmp_path):
    x = torch.randn(5).as_subclass(_Tagged)
    tg.save(tmp_path / "c", {"x": {"w": x}})
    live = torch.zeros(5).as_subclass(_Tagged)
    out = {"x": {"w": live}}
    tg.load(tmp_path / "c", out)
    assert out["x"]["w"] is live and type(live) is _Tagged and _bits(live) == _bits(x)


def test_wrapper_subclass_without_its_own_memory_is_refused_at_save(tmp_path):
    # torchao's Float8/NF4 tensors and the like keep their data in inner tensors: the save
    # failed in its write phase with ".numpy() is not supported for tensor subclasses".
    two_tensor = pytest.importorskip("torch.testing._internal.two_tensor")
    t = two_tensor.TwoTensor(torch.randn(4), torch.randn(4))
    for value in (t, nn.Parameter(t)):
        with pytest.raises(tg.UnsupportedValueError, match=r"model/w: tensor subclass TwoTensor .*__tensor_flatten__"):
            tg.save(tmp_path / "c", {"model": {"w": value}})
    assert not (tmp_path / "c").exists()


class _LM(nn.Module):
    """Large enough (2 x 8 MiB) for the two names' reads to run on two threads at once."""

    def __init__(self, tie: bool) -> None:
        super().__init__()
        self.wte = nn.Embedding(2048, 1024)
        self.lm_head = nn.Linear(1024, 2048, bias=False)
        if tie:
            self.lm_head.weight = self.wte.weight


def test_untied_checkpoint_into_a_tied_model_loads_one_name_and_warns_not_corrupt(tmp_path):
    # Both names were read straight into the one tensor on two threads: each checksum saw the
    # other's bytes, and a sound checkpoint was reported corrupt (restore then tried older ones).
    model = _LM(tie=False)
    tg.save(tmp_path / "c", {"model": model})
    for _ in range(2):
        fresh = _LM(tie=True)
        with pytest.warns(UserWarning, match=r"tied weights.*model/lm_head\.weight / model/wte\.weight"):
            tg.load(tmp_path / "c", {"model": fresh})
        assert fresh.lm_head.weight is fresh.wte.weight
        assert torch.equal(fresh.wte.weight, model.wte.weight)  # the later name in path order, as the warning says


def test_overlapping_views_in_a_plain_state_load_in_path_order(tmp_path):
    tg.save(tmp_path / "c", {"a": torch.arange(12.0), "b": -torch.arange(1.0, 7.0)})
    base = torch.zeros(12)
    state = {"a": base, "b": base[2:8]}
    tg.load(tmp_path / "c", state)  # before: CorruptCheckpointError for 'a' (its bytes overwritten by 'b')
    assert base.tolist() == [0.0, 1.0, -1.0, -2.0, -3.0, -4.0, -5.0, -6.0, 8.0, 9.0, 10.0, 11.0]
    assert state["b"].data_ptr() == base.data_ptr() + 8


def test_a_tie_saved_as_such_is_read_once(tmp_path, monkeypatch):
    from trainguard import loader

    model = _TiedLM()
    tg.save(tmp_path / "c", {"model": model})
    read = []
    real = loader.read_targets
    monkeypatch.setattr(loader, "read_targets", lambda s, d, ts, **kw: real(s, d, [read.append(t.path) or t for t in ts], **kw))
    fresh = _TiedLM()
    tg.load(tmp_path / "c", {"model": fresh})
    assert torch.equal(fresh.wte.weight, model.wte.weight) and fresh.lm_head.weight is fresh.wte.weight
    assert sorted(read) == ["model/lm_head.weight", "model/ln.bias", "model/ln.weight"]  # not model/wte.weight too


def test_an_optimizer_imported_from_a_torch_save_file_loads_into_the_optimizer(tmp_path):
    # torch keys optimizer state by parameter index; trainguard by name. An imported
    # {"model", "optim"} file failed with "'<' not supported between instances of 'str' and 'int'".
    from trainguard.convert import convert

    model = nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    torch.save({"model": model.state_dict(), "optim": opt.state_dict(), "step": 7}, tmp_path / "ck.pt")
    convert(tmp_path / "ck.pt", tmp_path / "imported")
    fresh = nn.Linear(3, 2)
    fopt = torch.optim.Adam(fresh.parameters(), lr=0.5)
    state = {"model": fresh, "optim": fopt, "step": None}
    tg.load(tmp_path / "imported", state)
    assert state["step"] == 7 and fopt.param_groups[0]["lr"] == 0.01
    assert torch.equal(fopt.state[fresh.weight]["exp_avg"], opt.state[model.weight]["exp_avg"])
    tg.save(tmp_path / "again", state)  # and saved again by name
    assert torch.equal(fopt.state[fresh.bias]["exp_avg_sq"], opt.state[model.bias]["exp_avg_sq"])
