"""Interop review: what users already have (DCP directories written by torch, Hugging Face
checkpoints) through ``trainguard convert`` and back, and the errors when it cannot be done."""

from __future__ import annotations

import os
import warnings

import pytest
import torch
from click.testing import CliRunner

import trainguard as tg
from trainguard.cli import main
from trainguard.convert import convert


def _dcp_of_linear(tmp_path) -> str:
    src = str(tmp_path / "lin" / "step-000000001")
    tg.save(src, {"model": torch.nn.Linear(4, 3)})
    out = str(tmp_path / "lin_dcp")
    convert(src, out, dst_format="dcp", entry=None)
    return out


def test_a_damaged_dcp_directory_is_a_checkpoint_error_and_the_cli_exits_2(tmp_path):
    # DCP raises its CheckpointException, a BaseException: before, it escaped foreign_errors
    # and the command ended in a traceback (exit 1) instead of one error line (exit 2).
    out = _dcp_of_linear(tmp_path)
    os.remove(os.path.join(out, "__0_0.distcp"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the trusted-source warning
        with pytest.raises(tg.CheckpointError, match=r"cannot read .*FileNotFoundError.*__0_0\.distcp"):
            convert(out, tmp_path / "imported")
    res = CliRunner().invoke(main, ["convert", out, str(tmp_path / "imported2")])
    assert res.exit_code == 2, res.output
    assert "error: cannot read" in res.output and "Traceback" not in res.output
    assert not (tmp_path / "imported").exists() and not (tmp_path / "imported2").exists()


def _make(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.ReLU(), torch.nn.Linear(10, 3))


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int) -> None:
    for s in range(steps):
        g = torch.Generator().manual_seed(s)
        x, y = torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def _fsdp2(seed: int, lr: float) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    from torch.distributed.fsdp import fully_shard

    from dist_helper import cpu_mesh

    model, mesh = _make(seed), cpu_mesh()
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.Adam(model.parameters(), lr=lr)


def _whole(sd: dict) -> dict:
    return {k: _whole(v) if isinstance(v, dict) else v.full_tensor() if hasattr(v, "full_tensor") else v
            for k, v in sd.items()}


def _dcp_load_into_fsdp2(rank: int, world: int, path: str) -> dict:
    """A rank of a FSDP2 job resuming from a DCP directory as torch documents it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model, opt = _fsdp2(99, lr=0.5)
    _train(model, opt, 1)
    msd, osd = get_state_dict(model, opt)
    dcp.load({"model": msd, "optim": osd}, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
    msd, osd = get_state_dict(model, opt)
    return {"model": _whole(msd), "optim": _whole(osd["state"]), "lr": osd["param_groups"][0]["lr"]}


def test_export_to_dcp_loads_into_an_fsdp2_model_and_optimizer_on_two_ranks(tmp_path):
    # Before: optimizer tensors went to DCP as 'optim.state/0.weight/exp_avg' and param_groups
    # not at all, so dcp.load into get_state_dict(model, optim) raised "Missing key in checkpoint
    # state_dict: optim.state.0.weight.step" on every rank.
    from dist_helper import run_ranks

    model = _make(1)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    _train(model, opt, 2)
    src = str(tmp_path / "ck" / "step-000000002")
    tg.save(src, {"model": model, "optim": opt, "progress": tg.StateDict(step=2), "rng": tg.RNGState()})
    res = CliRunner().invoke(main, ["convert", src, str(tmp_path / "dcp"), "--to", "dcp", "--entry", "*"])
    assert res.exit_code == 0, res.output
    got = run_ranks(_dcp_load_into_fsdp2, 2, str(tmp_path / "dcp"), timeout=90)[1].value
    for k, v in model.state_dict().items():
        assert torch.equal(got["model"][k], v), k
    for i, (name, _p) in enumerate(model.named_parameters()):
        for k, v in opt.state_dict()["state"][i].items():
            assert torch.equal(got["optim"][name][k], v), (name, k)
    assert got["lr"] == 1e-2  # param_groups travel too


def test_convert_to_dcp_never_writes_into_an_existing_checkpoint(tmp_path):
    # Before: --to dcp into a trainguard checkpoint directory (even its own source) added
    # .metadata and __0_0.distcp beside manifest.json, and into a DCP directory overwrote its
    # files in place.
    src = str(tmp_path / "ck")
    tg.save(src, {"model": torch.nn.Linear(4, 3)})
    before = sorted(os.listdir(src))
    for dst in (src, _dcp_of_linear(tmp_path)):
        listing = sorted(os.listdir(dst))
        with pytest.raises(tg.CheckpointError, match="not an empty directory.*Remove it or pick another"):
            convert(src, dst, dst_format="dcp", entry=None)
        assert sorted(os.listdir(dst)) == listing
    assert sorted(os.listdir(src)) == before
    (tmp_path / "empty").mkdir()
    convert(src, tmp_path / "empty", dst_format="dcp", entry=None)
    assert (tmp_path / "empty" / ".metadata").is_file()
    assert [p for p in os.listdir(tmp_path) if p.startswith(".")] == []  # no temporary directory left


class _Note:
    """A custom object in a DCP checkpoint: pickled by DCP, refused by weights_only=True."""


def _dcp_save_from_fsdp2(rank: int, world: int, path: str) -> dict:
    """A FSDP2 job's DCP checkpoint as torch documents it: get_state_dict + dcp.save."""
    import io

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, opt = _fsdp2(1, lr=1e-2)
    _train(model, opt, 2)
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd, "step": 2, "blob": io.BytesIO(b"raw"), "note": _Note()}, checkpoint_id=path)
    return {"model": _whole(msd), "optim": _whole(osd["state"])}


def test_a_dcp_checkpoint_of_fsdp2_model_and_optimizer_imports_and_resumes_both(tmp_path):
    # Before: keys were split at their first dot only, so the optimizer became one flat dict
    # {'state.0.weight.exp_avg': ...} without param_groups (skipped as pickled objects), and
    # loading it into {"optim": optimizer} raised "its load_state_dict() refused the saved
    # state: 'param_groups'".
    from dist_helper import run_ranks

    path = str(tmp_path / "dcp")
    ref = run_ranks(_dcp_save_from_fsdp2, 2, path, timeout=90)[0].value
    with pytest.warns(UserWarning, match="pickle"):
        res = convert(path, tmp_path / "ck")
    assert sorted(res["skipped"]) == ["blob", "note"]  # raw bytes and a custom class: not imported
    assert res["tensors"] == 4 + 4 * 3
    model = _make(7)
    opt = torch.optim.Adam(model.parameters(), lr=0.5)
    state = {"model": model, "optim": opt, "step": None}
    tg.load(tmp_path / "ck", state)
    for k, v in ref["model"].items():
        assert torch.equal(model.state_dict()[k], v), k
    saved = opt.state_dict()
    for i, (name, _p) in enumerate(model.named_parameters()):
        for k, v in ref["optim"][name].items():
            got = saved["state"][i][k]
            assert got.dtype == v.dtype and got.shape == v.shape and torch.equal(got, v), (name, k)
    assert saved["param_groups"][0]["lr"] == 1e-2 and state["step"] == 2
    _train(model, opt, 1)  # and the optimizer steps from it


def test_a_dcp_of_a_plain_optimizer_state_dict_loads_by_position_not_silently_empty(tmp_path):
    # DCP writes dict keys as strings: the index-keyed state of optimizer.state_dict() came back
    # as {'0': ..., '1': ...} with params [0, 1, ...], and torch's load_state_dict kept those
    # keys aside without error: the optimizer resumed with no Adam moments at all.
    import torch.distributed.checkpoint as dcp

    model = _make(1)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    _train(model, opt, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # single-process DCP and the trusted-source warning
        dcp.save({"model": model.state_dict(), "optim": opt.state_dict()}, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
        convert(tmp_path / "dcp", tmp_path / "ck")
    fresh = _make(2)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1.0)
    tg.load(tmp_path / "ck", {"model": fresh, "optim": fresh_opt})
    want, got = opt.state_dict(), fresh_opt.state_dict()
    assert sorted(got["state"]) == sorted(want["state"]) == [0, 1, 2, 3]
    for i, s in want["state"].items():
        for k, v in s.items():
            assert torch.equal(got["state"][i][k], v), (i, k)
    assert got["param_groups"] == want["param_groups"]


class _TiedLM(torch.nn.Module):
    def __init__(self, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.wte = torch.nn.Embedding(10, 4, dtype=dtype)
        self.h = torch.nn.Linear(4, 4, dtype=dtype)
        self.lm_head = torch.nn.Linear(4, 10, bias=False, dtype=dtype)
        self.lm_head.weight = self.wte.weight


def _hf_shards(model: torch.nn.Module, d, fmt: str) -> str:
    """A Hugging Face sharded checkpoint of ``model`` as save_pretrained writes it: tied names
    once, one shard per tensor, an index mapping names to shards."""
    import json

    from safetensors.torch import save_file

    sd = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    ext = "safetensors" if fmt == "safetensors" else "bin"
    weight_map = {}
    for i, (k, v) in enumerate(sorted(sd.items())):
        shard = f"model-{i + 1:05d}-of-{len(sd):05d}.{ext}"
        if fmt == "safetensors":
            save_file({k: v.clone()}, str(d / shard), metadata={"format": "pt"})
        else:
            torch.save({k: v.clone()}, d / shard)
        weight_map[k] = shard
    name = "model.safetensors.index.json" if fmt == "safetensors" else "pytorch_model.bin.index.json"
    (d / name).write_text(json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map}))
    return str(d / name)


@pytest.mark.parametrize("fmt", ["safetensors", "torch"])
def test_a_sharded_hugging_face_checkpoint_imports_from_its_index(tmp_path, fmt):
    # Before: the index (and the directory) was "not a trainguard checkpoint ... pass --from",
    # and --from safetensors failed to parse the JSON: a model over one shard could not be imported.
    torch.manual_seed(0)
    src = _TiedLM(torch.bfloat16)
    (tmp_path / "hf").mkdir()
    index = _hf_shards(src, tmp_path / "hf", fmt)
    res = CliRunner().invoke(main, ["convert", index, str(tmp_path / "ck")])
    assert res.exit_code == 0, res.output
    assert "converted 3 tensors" in res.output
    dest = _TiedLM(torch.bfloat16)
    tg.load(tmp_path / "ck", {"model": dest})  # strict: the tied name comes from its other name
    assert dest.lm_head.weight is dest.wte.weight
    for k, v in src.state_dict().items():
        got = dest.state_dict()[k]
        assert got.dtype == torch.bfloat16 and torch.equal(got, v), k
    res = CliRunner().invoke(main, ["convert", str(tmp_path / "hf"), str(tmp_path / "ck2")])
    assert res.exit_code == 2 and os.path.basename(index) in res.output  # the directory: use its index


def test_a_sharded_checkpoint_whose_shard_lacks_a_listed_tensor_is_refused(tmp_path):
    import json

    (tmp_path / "hf").mkdir()
    index = _hf_shards(_TiedLM(), tmp_path / "hf", "safetensors")
    body = json.loads(open(index).read())
    body["weight_map"]["h.extra"] = body["weight_map"]["h.bias"]
    open(index, "w").write(json.dumps(body))
    with pytest.raises(tg.CheckpointError, match=r"not in it: \['h.extra'\]"):
        convert(index, tmp_path / "ck")
    body["weight_map"]["h.extra"] = "../elsewhere.safetensors"
    open(index, "w").write(json.dumps(body))
    with pytest.raises(tg.CheckpointError, match="not a file name beside the index"):
        convert(index, tmp_path / "ck")
    assert not (tmp_path / "ck").exists()


def test_every_documented_convert_command_line_runs_as_written(tmp_path, monkeypatch):
    """Each ``trainguard convert`` line of docs/interop.md, run literally, on inputs made under
    the names it uses."""
    import re
    import shlex
    from pathlib import Path

    text = (Path(__file__).resolve().parent.parent / "docs" / "interop.md").read_text()
    lines = [ln.split("#")[0].strip() for ln in text.splitlines() if ln.startswith("trainguard convert ")]
    assert len(lines) >= 5
    monkeypatch.chdir(tmp_path)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    tg.save("ckpts/run1/step-000000700", {"model": model})
    torch.save(model.state_dict(), "weights.pt")
    convert("ckpts/run1/step-000000700", "dcp_dir", dst_format="dcp", entry=None)
    Path("hf_model").mkdir()
    _hf_shards(model, tmp_path / "hf_model", "safetensors")
    for line in lines:
        argv = shlex.split(line)[1:]
        res = CliRunner().invoke(main, argv)
        assert res.exit_code == 0, (line, res.output)
        dst = argv[2]
        if re.match(r"ckpts/imported", dst):
            fresh = torch.nn.Linear(4, 3)
            tg.load(dst, {"model": fresh})
            assert torch.equal(fresh.weight, model.weight), line
            tg_dir = Path(dst)
            for p in tg_dir.iterdir():
                p.unlink()
            tg_dir.rmdir()  # the next import goes to the same documented name


def test_a_torch_file_with_a_pickled_class_is_refused_in_one_line_naming_the_class(tmp_path):
    # Before: torch's whole weights_only message (a dozen lines, advising add_safe_globals,
    # which the command has no way to take) was the "one error: line".
    import argparse

    torch.save({"model": torch.nn.Linear(2, 2).state_dict(), "args": argparse.Namespace(lr=1)}, tmp_path / "run.pt")
    res = CliRunner().invoke(main, ["convert", str(tmp_path / "run.pt"), str(tmp_path / "ck")])
    assert res.exit_code == 2
    assert len(res.output.strip().splitlines()) == 1, res.output
    assert "argparse.Namespace" in res.output and "weights_only=False)['model']" in res.output
    assert not (tmp_path / "ck").exists()


def test_sgd_and_multisteplr_through_dcp_and_back_resume_the_same_schedule(tmp_path):
    # Before: SGD without momentum has an empty state, for which DCP writes no key, so the
    # import lacked 'state' and the load refused the optimizer ('state'); and DCP writes dict keys
    # as strings, so MultiStepLR's milestones came back as {'3': 1, '5': 1}: the schedule never
    # matched an epoch and the LR silently stayed at its start value.
    def build(model: torch.nn.Module) -> tuple[torch.optim.Optimizer, object]:
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        return opt, torch.optim.lr_scheduler.MultiStepLR(opt, [3, 5], 0.1)

    model = torch.nn.Linear(2, 2)
    opt, sched = build(model)
    opt.step()
    sched.step()
    src = str(tmp_path / "ck")
    tg.save(src, {"model": model, "optim": opt, "sched": sched})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        convert(src, tmp_path / "dcp", dst_format="dcp", entry=None)
        convert(tmp_path / "dcp", tmp_path / "back")
    opt2, sched2 = build(model)
    tg.load(tmp_path / "back", {"model": model, "optim": opt2, "sched": sched2})
    assert sched2.state_dict() == sched.state_dict()
    for _ in range(5):
        for o, s in ((opt, sched), (opt2, sched2)):
            o.step()
            s.step()
        assert opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"]
    assert opt.param_groups[0]["lr"] < 0.02


def test_a_torch_file_saved_from_a_wrapped_model_loads_into_plain_and_wrapped_models(tmp_path):
    # Before: the 'module.' (DDP/DataParallel) or '_orig_mod.' (torch.compile) prefix of every key
    # was kept, so neither a plain nor a wrapped model loaded the import (StateMismatchError:
    # missing model/0.weight, unexpected model/module.0.weight).
    model = _make(3)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    _train(model, opt, 1)
    wrapped = torch.nn.DataParallel(model)
    assert all(k.startswith("module.") for k in wrapped.state_dict())
    torch.save({"model": wrapped.state_dict(), "optimizer": opt.state_dict(), "epoch": 1}, tmp_path / "ddp.pt")
    convert(tmp_path / "ddp.pt", tmp_path / "ck")
    for dest in (_make(4), torch.nn.DataParallel(_make(5))):
        dest_opt = torch.optim.Adam(dest.parameters(), lr=1e-2)
        tg.load(tmp_path / "ck", {"model": dest, "optimizer": dest_opt, "epoch": None})
        for k, v in wrapped.state_dict().items():  # .cpu(): with a GPU, DataParallel moved its module there
            got = dest.state_dict()[k if isinstance(dest, torch.nn.DataParallel) else k[7:]]
            assert torch.equal(got.cpu(), v.cpu()), k
        assert torch.equal(dest_opt.state_dict()["state"][0]["exp_avg"].cpu(), opt.state_dict()["state"][0]["exp_avg"].cpu())
    compiled = {f"_orig_mod.{k}": v for k, v in model.state_dict().items()}
    torch.save(compiled, tmp_path / "compiled.bin")
    convert(tmp_path / "compiled.bin", tmp_path / "ck2")
    dest = _make(6)
    tg.load(tmp_path / "ck2", {"model": dest})
    assert all(torch.equal(dest.state_dict()[k], v) for k, v in model.state_dict().items())


def test_a_tied_export_to_safetensors_loads_as_the_docs_say(tmp_path):
    """docs/interop.md: load_file + load_state_dict loads it; safetensors' load_model needs strict=False."""
    from safetensors.torch import load_file, load_model

    torch.manual_seed(0)
    src = _TiedLM()
    tg.save(tmp_path / "ck", {"model": src})
    convert(tmp_path / "ck", tmp_path / "m.safetensors")
    dest = _TiedLM()
    dest.load_state_dict(load_file(tmp_path / "m.safetensors"))
    assert dest.lm_head.weight is dest.wte.weight and torch.equal(dest.wte.weight, src.wte.weight)
    with pytest.raises(RuntimeError, match="Unexpected key"):
        load_model(_TiedLM(), tmp_path / "m.safetensors")
    dest = _TiedLM()
    missing, unexpected = load_model(dest, tmp_path / "m.safetensors", strict=False)
    assert not missing and dest.lm_head.weight is dest.wte.weight and torch.equal(dest.wte.weight, src.wte.weight)
    assert load_file(tmp_path / "m.safetensors")["h.weight"].is_contiguous()


@pytest.mark.parametrize("keys", [["model.x", "model"], ["model", "model.x"]])
def test_a_dcp_key_that_is_a_value_and_a_prefix_of_others_is_refused_not_dropped(tmp_path, keys):
    # Before: whichever came last replaced the other: 'model' (a tensor) dropped every model.* tensor.
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({k: torch.full((2,), float(i)) for i, k in enumerate(keys)}, checkpoint_id=str(tmp_path / "d"), no_dist=True)
        with pytest.raises(tg.CheckpointError, match="is a value"):
            convert(tmp_path / "d", tmp_path / "ck")


def test_dcp_import_gives_int_keys_back_only_to_keys_an_int_writes(tmp_path):
    """DCP writes a dict's int keys as strings; the import makes "7" an int again, but a string
    key of its own ("07", a superscript digit) was taken for one: "07" and "7" collapsed into one
    key, and "²" ended the convert with int()'s ValueError."""
    import torch.distributed.checkpoint as dcp

    from trainguard.dcp_import import _int_key

    assert [k for k in ("7", "07", "²", "-1", "10") if _int_key(k)] == ["7", "10"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"x": torch.ones(1), "d": {"07": 1, "7": 2, "²": 3}}, checkpoint_id=str(tmp_path / "d"), no_dist=True)
        convert(tmp_path / "d", tmp_path / "ck")
    got = {"x": torch.zeros(1), "d": {}}
    tg.load(tmp_path / "ck", got)
    assert got["d"] == {"07": 1, "7": 2, "²": 3}
