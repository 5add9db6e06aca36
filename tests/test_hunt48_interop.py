"""Session 48, interop hunt: conversions between trainguard checkpoints and torch.save,
safetensors and DCP, each found by a real run."""

from __future__ import annotations

import warnings

import torch
from click.testing import CliRunner

import trainguard as tg
from trainguard.cli import main


def _model_and_adam(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    return model, torch.optim.Adam(model.parameters(), lr=0.01)


def test_convert_dcp_import_with_entry_star_gives_every_entry(tmp_path):
    # Before: `--entry '*'` (every entry, as the docs' export to DCP spells it) on a DCP import put
    # every key, unsplit, into one entry `model` ('model.0.weight', 'optim.state.0.weight.step', ...)
    # and skipped the optimizer's param_groups: {"model": m, "optim": o} did not load it.
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, opt = _model_and_adam(0)
    for _ in range(3):
        model(torch.randn(5, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
    msd, osd = get_state_dict(model, opt)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to load in a single process"
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    out = str(tmp_path / "ck" / "step-000000000")
    res = CliRunner().invoke(main, ["convert", str(tmp_path / "dcp"), out, "--entry", "*"])
    assert res.exit_code == 0, res.output
    assert "skipped" not in res.output  # param_groups are imported, not skipped
    fresh, fopt = _model_and_adam(1)
    assert not torch.equal(fresh[0].weight, model[0].weight)
    tg.load(out, {"model": fresh, "optim": fopt})
    for (name, p), q in zip(model.named_parameters(), fresh.parameters()):
        assert torch.equal(p, q), name
        assert torch.equal(fopt.state[q]["exp_avg"], opt.state[p]["exp_avg"]), name
    assert fopt.param_groups[0]["lr"] == 0.01


class _Counted(torch.nn.Linear):
    """A layer with extra state: a count and a tensor (DCP flattens it into two keys)."""

    def __init__(self) -> None:
        super().__init__(3, 2)
        self.n, self.t = 0, torch.zeros(2)

    def get_extra_state(self) -> dict:
        return {"n": self.n, "t": self.t}

    def set_extra_state(self, state: dict) -> None:
        self.n, self.t = state["n"], state["t"]


def test_a_dcp_of_a_bare_state_dict_imported_into_one_entry_keeps_extra_state(tmp_path):
    # Before: importing it whole (`--entry model`, dcp_split=False, as the docs say for a bare
    # model.state_dict()) skipped every non-tensor value as "neither tensors nor JSON values": the
    # count 7 was lost, the tensor became a flat key '0._extra_state.t', and the strict load into
    # the model refused the checkpoint ("missing from the checkpoint: model/0._extra_state").
    import torch.distributed.checkpoint as dcp

    torch.manual_seed(0)
    model = torch.nn.Sequential(_Counted(), torch.nn.ReLU())
    model[0].n, model[0].t = 7, torch.tensor([1.5, -2.0])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(model.state_dict(), checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    out = str(tmp_path / "ck" / "step-000000000")
    res = CliRunner().invoke(main, ["convert", str(tmp_path / "dcp"), out, "--entry", "model"])
    assert res.exit_code == 0, res.output
    assert "skipped" not in res.output
    torch.manual_seed(1)
    fresh = torch.nn.Sequential(_Counted(), torch.nn.ReLU())
    assert not torch.equal(fresh[0].weight, model[0].weight)
    tg.load(out, {"model": fresh})  # strict
    assert torch.equal(fresh[0].weight, model[0].weight) and torch.equal(fresh[0].bias, model[0].bias)
    assert fresh[0].n == 7 and torch.equal(fresh[0].t, torch.tensor([1.5, -2.0]))


def test_a_torch_file_of_a_whole_pickled_model_is_refused_with_advice_that_works(tmp_path, monkeypatch):
    # Before: the refusal of torch.save(model) advised
    # torch.save(torch.load('model.pt', weights_only=False)['model'], 'weights.pt'), which raises
    # TypeError ('Linear' object is not subscriptable) for a whole model; its state_dict() is what to save.
    import re

    model = torch.nn.Linear(3, 2)
    torch.save(model, tmp_path / "model.pt")
    res = CliRunner().invoke(main, ["convert", str(tmp_path / "model.pt"), str(tmp_path / "ck")])
    assert res.exit_code == 2
    assert len(res.output.strip().splitlines()) == 1, res.output
    assert "torch.nn.modules.linear.Linear" in res.output and not (tmp_path / "ck").exists()
    advice = re.search(r"e\.g\. (torch\.save\(.*\))$", res.output.strip()).group(1)
    monkeypatch.chdir(tmp_path)
    eval(advice, {"torch": torch})  # our own file: what the message tells a user who trusts it to run
    res = CliRunner().invoke(main, ["convert", "weights.pt", str(tmp_path / "ck")])
    assert res.exit_code == 0, res.output
    fresh = torch.nn.Linear(3, 2)
    tg.load(tmp_path / "ck", {"model": fresh})
    assert torch.equal(fresh.weight, model.weight) and torch.equal(fresh.bias, model.bias)
