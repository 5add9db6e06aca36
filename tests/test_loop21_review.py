"""Real training-loop shapes resumed from a save: gradient accumulation, a save between
backward() and step(), bfloat16 autocast + GradScaler with a skipped step, clipping, validation
passes that draw random numbers, train and validation DataLoaders with workers, epoch ends,
early-stopping counters, EveryNSteps(1) with async saves. Each resumed run is compared with an
uninterrupted one bit for bit (losses and final weights)."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

import trainguard as tg

ACC = 4  # micro-batches per optimizer step


def _build() -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.1), nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
    return {"model": model, "optim": opt, "scaler": scaler, "rng": tg.RNGState(), "progress": tg.StateDict(step=0)}


def _accumulating(root: str, total: int, stop: int | None = None, between: bool = False):
    """Micro-batches 0..total-1, an optimizer step every ACC of them (micro-batch 7's loss is
    inf: the scaler skips that step). ``stop``: force a save after micro-batch ``stop`` and end;
    ``between``: that save comes right after its backward(), before the window's step."""
    st = _build()
    model, opt, scaler = st["model"], st["optim"], st["scaler"]
    losses = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with tg.CheckpointManager(root, save=tg.EveryNSteps(10**9)) as mgr:
            s = mgr.restore(st)
            for mi in range(0 if s is None else s + 1, total):
                x = torch.randn(4, 8) * (float("inf") if mi == 7 else 1.0)
                loss = model(x).square().mean()
                scaler.scale(loss / ACC).backward()
                losses.append(repr(loss.item()))
                if between and mi == stop:
                    mgr.save(mi, st, force=True)
                    break
                if (mi + 1) % ACC == 0:
                    scaler.unscale_(opt)
                    nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                    scaler.step(opt)
                    scaler.update()
                    opt.zero_grad()
                if mi == stop:
                    mgr.save(mi, st, force=True)
                    break
    pending = [str(w.message) for w in caught if issubclass(w.category, tg.PendingGradientsWarning)]
    return losses, [p.detach().clone() for p in model.parameters()], pending


@pytest.mark.parametrize("stop,between", [(9, False), (9, True), (10, True)])
def test_save_that_leaves_gradients_behind_is_warned(tmp_path, stop, between):
    # Before: no warning at all, and the resumed run's weights differed from the uninterrupted
    # run's (the window's earlier micro-batches' gradients were lost).
    L0, W0, _ = _accumulating(str(tmp_path / "a"), 16)
    L1, _, warned = _accumulating(str(tmp_path / "b"), 16, stop=stop, between=between)
    L2, W2, _ = _accumulating(str(tmp_path / "b"), 16)
    assert L0[: stop + 1] == L1 and L0[stop + 1] == L2[0]  # resumed after the same micro-batch ...
    assert not all(torch.equal(a, b) for a, b in zip(W0, W2))  # ... but the window's gradients were lost
    assert len(warned) == 1 and f"save of step {stop}" in warned[0] and "'optim'.step()" in warned[0]


@pytest.mark.parametrize("stop", [3, 7, 11])  # window ends; 7: a step the scaler skipped (inf gradients)
def test_save_at_window_end_resumes_bit_identically_without_warning(tmp_path, stop):
    L0, W0, w0 = _accumulating(str(tmp_path / "a"), 16)
    L1, _, w1 = _accumulating(str(tmp_path / "b"), 16, stop=stop)
    L2, W2, w2 = _accumulating(str(tmp_path / "b"), 16)
    assert L0 == L1 + L2
    assert all(torch.equal(a, b) for a, b in zip(W0, W2))
    assert w0 == w1 == w2 == []


def test_zero_grad_first_loop_saving_every_step_is_not_warned(tmp_path):
    # README's order: zero_grad(), backward(), step(), save(): .grad is still set at the save, but
    # a step() used it. EveryNSteps(1), async: no warning at any step.
    st = _build()
    model, opt = st["model"], st["optim"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with tg.CheckpointManager(str(tmp_path), save=tg.EveryNSteps(1), keep=tg.KeepLatest(2), async_save=True) as mgr:
            for step in range(5):
                opt.zero_grad()
                model(torch.randn(4, 8)).square().mean().backward()
                opt.step()
                mgr.save(step, st)
    assert [w for w in caught if issubclass(w.category, tg.PendingGradientsWarning)] == []


class _Wrapped(torch.optim.Optimizer):
    """Like accelerate's AcceleratedOptimizer: an Optimizer subclass that skips its __init__ (torch
    never patches its step(), the step hooks run for the inner optimizer only)."""

    def __init__(self, inner: torch.optim.Optimizer) -> None:
        self.inner = inner

    @property
    def param_groups(self):
        return self.inner.param_groups

    @property
    def state(self):
        return self.inner.state

    def state_dict(self):
        return self.inner.state_dict()

    def load_state_dict(self, sd) -> None:
        self.inner.load_state_dict(sd)

    def step(self, closure=None) -> None:
        self.inner.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none)


def test_wrapped_optimizer_stepped_before_the_save_is_not_warned(tmp_path):
    # Before this case was handled: a warning at every save after the first (the wrapper's own
    # tracker never cleared, the step post-hook saw only the inner optimizer).
    model = nn.Linear(2, 1)
    opt = _Wrapped(torch.optim.SGD(model.parameters(), lr=0.1))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with tg.CheckpointManager(str(tmp_path), save=tg.EveryNSteps(1), keep=tg.KeepLatest(2)) as mgr:
            for step in range(3):
                opt.zero_grad()
                model(torch.randn(3, 2)).sum().backward()
                opt.step()
                mgr.save(step, {"model": model, "optim": opt})
            model(torch.randn(3, 2)).sum().backward()
            mgr.save(3, {"model": model, "optim": opt})  # this one is before the step
    warned = [str(w.message) for w in caught if issubclass(w.category, tg.PendingGradientsWarning)]
    assert len(warned) == 1 and "save of step 3" in warned[0], warned


class _Aug(torch.utils.data.Dataset):
    def __init__(self, n: int) -> None:
        self.x = torch.randn(n, 8, generator=torch.Generator().manual_seed(1))

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i] + 0.1 * torch.randn(8)  # random augmentation, drawn in a worker


SPE = 4  # steps per epoch


def _full_loop(root: str, total: int, stop: int | None = None):
    """bfloat16 autocast + GradScaler (step 6's loss inf: skipped), clipping, a validation pass every
    3 steps (eval mode, torch.randperm, its own loader with 2 workers and random augmentation,
    its generator seeded at each pass as docs/data.md says), early-stopping counters, the train
    loader's SeededDataset + ResumableSampler with 2 workers, EveryNSteps(1) async saves."""
    st = _build()
    model, opt, scaler = st["model"], st["optim"], st["scaler"]
    st["data"] = sampler = tg.ResumableSampler(SPE * 4, seed=0, with_epoch=True)
    st["progress"].update(best=1e9, bad=0)
    p = st["progress"]
    train = DataLoader(tg.SeededDataset(_Aug(SPE * 4), seed=0), batch_size=4, sampler=sampler, num_workers=2,
                       generator=torch.Generator())
    val = DataLoader(_Aug(8), batch_size=4, shuffle=True, num_workers=2, generator=torch.Generator())
    losses = []
    with tg.CheckpointManager(root, save=tg.EveryNSteps(1), keep=tg.KeepLatest(2), async_save=True) as mgr:
        s = mgr.restore(st)
        step = 0 if s is None else s
        while step < total:
            for x in train:
                opt.zero_grad()
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss = model(x).square().mean() * (float("inf") if step == 6 else 1.0)
                scaler.scale(loss).backward()
                scaler.unscale_(opt)
                nn.utils.clip_grad_norm_(model.parameters(), 0.5)
                scaler.step(opt)
                scaler.update()
                losses.append(repr(loss.item()))
                step += 1
                sampler.advance(len(x))
                if step % 3 == 0:
                    model.eval()
                    perm = torch.randperm(5)
                    val.generator.manual_seed(77)
                    with torch.no_grad():
                        v = sum(model(vx).square().mean().item() for vx in val) + perm[0].item() * 1e-6
                    model.train()
                    p["best"], p["bad"] = (v, 0) if v < p["best"] else (p["best"], p["bad"] + 1)
                p["step"] = step
                mgr.save(step, st)
                if step in (stop, total):
                    break
            if step in (stop, total):
                break
            sampler.next_epoch()
    return losses, [t.detach().clone() for t in model.parameters()], (p["best"], p["bad"])


@pytest.mark.parametrize("stop", [4, 6])  # the last step of an epoch; the step the scaler skipped
def test_full_loop_resumes_bit_identically(tmp_path, stop):
    L0, W0, e0 = _full_loop(str(tmp_path / "a"), 10)
    L1, _, _ = _full_loop(str(tmp_path / "b"), 10, stop=stop)
    L2, W2, e2 = _full_loop(str(tmp_path / "b"), 10)
    assert L0 == L1 + L2
    assert all(torch.equal(a, b) for a, b in zip(W0, W2))
    assert e0 == e2
