"""Session 58, review58b: a user who fine-tunes and evaluates from a trainguard checkpoint, not only
resumes (docs/checkpoints.md, "Fine-tuning from a checkpoint"). All in one process, no ranks.

- ``tg.load`` returns what a ``strict=False`` load left alone (``missing_keys``, ``unexpected_keys``,
  ``mismatched_keys``), as torch's ``load_state_dict`` does; before, only a warning's text said it.
- A strict load into a model whose layers were wrapped by LoRA-style adapters named a rename that is not
  one (``'0.bias', '0.weight' -> '0.A', '0.B' (in some order)``); it names the wrapped layers now.
- A plain dict saved from a DDP or compiled model's ``state_dict()`` (``module.``/``_orig_mod.`` keys) was
  refused for the bare module with advice no existing checkpoint could follow; it loads now.
- An optimizer with other parameter groups (a fine-tune's) was told only to rebuild the saved one.
- A fine-tune started from a pretrained checkpoint and stopped resumes bit-identically (module entry, and
  adapters only in an ``nn.ParameterDict``).
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest
import torch

import trainguard as tg

ROOT = Path(__file__).resolve().parent.parent


def _backbone():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


class _LoRA(torch.nn.Module):
    def __init__(self, base, rank=2, names=("base", "A", "B")):
        super().__init__()
        self._names = names
        setattr(self, names[0], base)
        setattr(self, names[1], torch.nn.Parameter(torch.randn(rank, base.in_features) * 0.01))
        setattr(self, names[2], torch.nn.Parameter(torch.zeros(base.out_features, rank)))

    def forward(self, x):
        base, a, b = (getattr(self, n) for n in self._names)
        return base(x) + x @ a.t() @ b.t()


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    root = tmp_path_factory.mktemp("pre")
    model = _backbone()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    path = str(root / "step-000000001")
    tg.save(path, {"model": model, "optim": opt, "sched": torch.optim.lr_scheduler.StepLR(opt, 5),
                   "progress": tg.StateDict(step=1)})
    return path, model


def test_strict_false_returns_what_it_left_alone(pretrained):
    path, _ = pretrained
    model = _backbone()
    model[2] = torch.nn.Linear(16, 10)  # a new classification head
    model.extra = torch.nn.Linear(2, 2)  # a layer the checkpoint lacks
    state = {"model": model, "progress": tg.StateDict(step=0, tokens=0), "new": tg.StateDict(a=1)}
    with pytest.warns(UserWarning, match="keep their current values"):
        got = tg.load(path, state, strict=False)
    assert got.missing_keys == ["new", "model/extra.weight", "model/extra.bias", "progress/tokens"]
    assert got.unexpected_keys == ["optim", "sched"]
    assert got.mismatched_keys == ["model/2.weight", "model/2.bias"]
    assert got.step == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = tg.load(path, {"model": _backbone()}, only=["model"])
    assert got.missing_keys == got.unexpected_keys == got.mismatched_keys == []


@pytest.mark.parametrize("names", [("base", "A", "B"), ("base_layer", "lora_A", "lora_B")])
def test_lora_wrapped_layers_named_not_called_renamed(pretrained, names):
    path, _ = pretrained
    model = _backbone()
    model[0] = _LoRA(model[0], names=names)
    base = names[0]
    with pytest.raises(tg.StateMismatchError) as e:
        tg.load(path, {"model": model}, only=["model"])
    text = str(e.value)
    assert f"'0' -> '0.{base}' (2 tensors)" in text, text
    assert f"0.{names[1]}, 0.{names[2]}: the adapters?" in text, text
    assert "in some order" not in text and "look renamed" not in text, text  # before: '0.bias', '0.weight' -> '0.A', '0.B'
    assert "before adding the adapters" in text
    with pytest.warns(UserWarning, match=re.escape(f"'0' -> '0.{base}' (2 tensors)")):
        got = tg.load(path, {"model": model}, only=["model"], strict=False)
    assert got.unexpected_keys == ["model/0.weight", "model/0.bias"]


def test_a_real_rename_is_still_named():
    from trainguard.prefixhint import wrap_hints

    text = wrap_hints(["model/out.weight", "model/out.bias"], ["model/2.weight", "model/2.bias"])
    assert "'2' -> 'out' (2 tensors)" in text and "wrapped since the save" not in text


@pytest.mark.parametrize("prefix", ["module.", "_orig_mod.", "module._orig_mod."])
def test_state_dict_of_a_wrapped_model_loads_into_the_bare_module(pretrained, tmp_path, prefix):
    _, source = pretrained
    path = str(tmp_path / "step-000000001")
    tg.save(path, {"model": {prefix + k: v for k, v in source.state_dict().items()}})
    for dest in (_backbone(), torch.nn.DataParallel(_backbone())):  # DataParallel: CPU, no import of dynamo
        with torch.no_grad():
            for p in dest.parameters():
                p.zero_()
        got = tg.load(path, {"model": dest})  # before: refused, "saved from a container of this module?"
        assert got.missing_keys == got.unexpected_keys == []
        inner = getattr(dest, "module", dest)
        assert all(torch.equal(a, b) for a, b in zip(inner.state_dict().values(), source.state_dict().values(), strict=True))


def test_prefixed_state_dict_with_a_layer_added_loads_what_fits_with_strict_false(pretrained, tmp_path):
    _, source = pretrained
    path = str(tmp_path / "step-000000001")
    tg.save(path, {"model": {"module." + k: v for k, v in source.state_dict().items()}})
    dest = _backbone()
    dest[2] = torch.nn.Linear(16, 10)
    dest.extra = torch.nn.Linear(2, 2)
    with pytest.raises(tg.StateMismatchError) as e:
        tg.load(path, {"model": dest})
    assert "model/extra.weight" in str(e.value) and "model/module.0.weight" not in str(e.value)
    with pytest.warns(UserWarning):
        got = tg.load(path, {"model": dest}, strict=False)  # before: nothing loaded, every tensor "left as they are"
    assert got.missing_keys == ["model/extra.weight", "model/extra.bias"] and got.unexpected_keys == []
    assert got.mismatched_keys == ["model/module.2.weight", "model/module.2.bias"]  # the checkpoint's paths
    assert torch.equal(dest[0].weight, source[0].weight) and torch.equal(dest[0].bias, source[0].bias)


def test_other_param_groups_are_told_how_to_start_a_new_optimizer(pretrained):
    path, _ = pretrained
    model = _backbone()
    opt = torch.optim.AdamW([{"params": [model[2].weight]}, {"params": [model[2].bias], "weight_decay": 0.0}])
    with pytest.raises(tg.CheckpointError) as e:
        tg.load(path, {"model": model, "optim": opt}, only=["model", "optim"])
    assert "to start a new optimizer" in str(e.value) and "only=[" in str(e.value)


def _finetune(root, pretrained_path, until, stop=None, adapters_only=False):
    model = _backbone()
    tg.load(pretrained_path, {"model": model}, only=["model"])
    for p in model.parameters():
        p.requires_grad_(False)
    model[0] = _LoRA(model[0])
    model[2] = torch.nn.Linear(16, 10)
    optim = torch.optim.AdamW([{"params": [model[0].A, model[0].B], "lr": 1e-2},
                               {"params": list(model[2].parameters()), "lr": 1e-3}])
    sched = torch.optim.lr_scheduler.StepLR(optim, 3)
    weights = (torch.nn.ParameterDict({n.replace(".", "_"): p for n, p in model.named_parameters() if p.requires_grad})
               if adapters_only else model)
    state = {"model": weights, "optim": optim, "sched": sched, "rng": tg.RNGState(), "progress": tg.StateDict(step=0)}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no index-keyed optimizer, no frozen-parameter warning
        with tg.CheckpointManager(root, save=tg.EveryNSteps(1), handle_signals=False) as mgr:
            start = mgr.restore(state)
            for step in range(0 if start is None else start + 1, until):
                x, y = torch.randn(4, 8), torch.randint(0, 10, (4,))
                loss = torch.nn.functional.cross_entropy(model(x), y)
                optim.zero_grad()
                loss.backward()
                optim.step()
                sched.step()
                state["progress"]["step"] = step
                mgr.save(step, state)
                if step == stop:
                    break
    return model, optim, start


@pytest.mark.parametrize("adapters_only", [False, True])
def test_finetune_resumes_bit_identically(pretrained, tmp_path, adapters_only):
    path, source = pretrained
    torch.manual_seed(5)
    whole, whole_opt, _ = _finetune(str(tmp_path / "a"), path, 8, adapters_only=adapters_only)
    torch.manual_seed(5)
    _finetune(str(tmp_path / "b"), path, 8, stop=3, adapters_only=adapters_only)
    torch.manual_seed(99)  # the restored RNG decides
    resumed, resumed_opt, start = _finetune(str(tmp_path / "b"), path, 8, adapters_only=adapters_only)
    assert start == 3  # the fine-tune's own checkpoint, not the pretrained one
    for a, b in zip(whole.state_dict().values(), resumed.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    assert torch.equal(resumed[0].base.weight, source[0].weight)  # the frozen base: the pretrained one
    sa, sb = whole_opt.state_dict(), resumed_opt.state_dict()
    assert sa["param_groups"] == sb["param_groups"]
    for k in sa["state"]:
        assert all(torch.equal(sa["state"][k][n], sb["state"][k][n]) for n in sa["state"][k])


def test_docs_finetune_example_runs(tmp_path, monkeypatch):
    doc = (ROOT / "docs/checkpoints.md").read_text()
    section = doc[doc.index("## Fine-tuning from a checkpoint"):doc.index("## The manager")]
    (code,) = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    monkeypatch.chdir(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        exec(compile(code, "docs/checkpoints.md", "exec"), {"__name__": "__doc_example__"})
