"""Session 46 review (review46b) of the afternoon's merged changes: defects found by real runs."""

from __future__ import annotations

import warnings

import pytest
import torch

import trainguard as tg


def _epochs(num_workers: int, steps: int, per_step: int | None = None) -> list[str]:
    ds = torch.utils.data.TensorDataset(torch.arange(100.0))
    s = tg.ResumableSampler(ds, seed=0)
    dl = torch.utils.data.DataLoader(ds, batch_size=8, sampler=s, num_workers=num_workers)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for epoch in range(2):
            s.set_epoch(epoch)
            for i, (x,) in enumerate(dl):
                s.advance(len(x) if per_step is None else per_step)
                if i + 1 == steps:  # a steps-per-epoch cap
                    break
    return [str(w.message) for w in seen if "advance" in str(w.message)]


def test_a_capped_epoch_read_ahead_by_worker_processes_is_not_called_a_wrong_advance() -> None:
    # advance(len(x)) after each of 10 steps of 13; two workers had read the sampler to its end
    # ahead of the loop (prefetch): the position (80 of 100) is right, no warning is due.
    assert _epochs(num_workers=2, steps=10) == []


@pytest.mark.parametrize("num_workers", [0, 2])
def test_advance_one_per_step_is_still_warned_about(num_workers: int) -> None:
    out = _epochs(num_workers=num_workers, steps=13, per_step=1)
    assert len(out) == 1 and "counted 13 sample(s) in 13 call(s)" in out[0]


def test_a_meta_models_state_dict_is_a_template_for_load_state_dict_assign(tmp_path) -> None:
    # Large-model loading: build on the meta device, load into its state_dict(), then
    # load_state_dict(assign=True). Worked before 6fb5719 (the meta tensors are replaced, as
    # docs/checkpoints.md says); 6fb5719 refused it as "model.state_dict()'s copy".
    torch.manual_seed(0)
    src = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    tg.save(tmp_path / "ck", {"model": src})
    with torch.device("meta"):
        big = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    with pytest.raises((RuntimeError, NotImplementedError)):  # a module left on meta is no silent mistake
        big(torch.ones(1, 3)).tolist()
    state = {"model": big.state_dict()}
    tg.load(tmp_path / "ck", state)
    big.load_state_dict(state["model"], assign=True)
    assert all(torch.equal(a, b) for a, b in zip(big.state_dict().values(), src.state_dict().values(), strict=True))
    # a bf16 copy is still refused: the module would keep its values, silently
    half = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2)).to(torch.bfloat16)
    with pytest.raises(tg.CheckpointError, match=r"entry 'model': the checkpoint holds a module's state.*bfloat16"):
        tg.load(tmp_path / "ck", {"model": half.state_dict()})


def test_dcps_get_state_dict_pattern_loads_an_optimizer_saved_from_the_optimizer(tmp_path) -> None:
    # docs/interop.md's FSDP2 pattern: get_state_dict(model, optim), load into it, set_state_dict. Its optimizer
    # dict names parameters ("0.weight"); ae5da69 refused it as optimizer.state_dict()'s copy (worked before).
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    def build() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        m = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
        o = torch.optim.Adam(m.parameters(), lr=0.1)
        m(torch.randn(5, 3)).sum().backward()
        o.step()
        o.zero_grad()
        return m, o

    torch.manual_seed(0)
    model, optim = build()
    tg.save(tmp_path / "ck", {"model": model, "optim": optim})
    m2, o2 = build()
    msd, osd = get_state_dict(m2, o2)
    state = {"model": msd, "optim": osd}
    tg.load(tmp_path / "ck", state)
    set_state_dict(m2, o2, model_state_dict=state["model"], optim_state_dict=state["optim"])
    assert torch.equal(o2.state_dict()["state"][0]["exp_avg"], optim.state_dict()["state"][0]["exp_avg"])
    assert torch.equal(m2[0].weight, model[0].weight)
    # optimizer.state_dict()'s copy (parameters by position) is still refused
    with pytest.raises(tg.CheckpointError, match=r"entry 'optim': the checkpoint holds the state of an Adam optimizer"):
        tg.load(tmp_path / "ck", {"model": m2, "optim": torch.optim.Adam(m2.parameters()).state_dict()})


def test_a_stateful_policy_shared_by_two_managers_built_before_either_opened_is_refused_at_open(tmp_path) -> None:
    # b57e835 checked at the constructor only: `a, b = CM(.., save=pol), CM(.., save=pol); with a, b:` passed,
    # and the second manager saved once in 30 steps of EverySeconds(0.05) (its clock was the first's).
    pol = tg.EverySeconds(0.05)
    a = tg.CheckpointManager(tmp_path / "model", save=pol)
    b = tg.CheckpointManager(tmp_path / "ema", save=pol)
    with pytest.raises(ValueError, match=r"already the save policy of the open CheckpointManager of .*model"):
        with a, b:
            pass
    assert not a._opened and not b._opened
    with tg.CheckpointManager(tmp_path / "ema", save=pol) as c:  # a closed manager's policy is reused
        assert c._opened


def test_a_tilde_paths_refusal_names_the_directory_it_would_make(tmp_path, monkeypatch) -> None:
    # '~x/ck' names a directory '~x' in the working directory; the refusal said "a directory called '~'".
    monkeypatch.chdir(tmp_path)
    with pytest.raises(tg.CheckpointError, match=r"in a directory called '~x' in the working directory"):
        tg.save("~x/ck", {"x": torch.ones(2)})
    tg.save("./~x/ck", {"x": torch.ones(2)})  # reached as ./~x: taken, as the refusal says
    assert (tmp_path / "~x" / "ck").is_dir()
