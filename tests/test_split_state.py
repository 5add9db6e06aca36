"""``split_state=True``: ranks that hold different parts of the model (pipeline stages, keeping
the full model's names as torchtitan does) save one checkpoint, which loads into another split
of the stages and into the whole model on one process (docs/distributed.md)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from torch import nn

import trainguard as tg

from dist_helper import run_ranks

N_LAYERS = 4


def full_model() -> nn.Module:
    torch.manual_seed(0)
    m = nn.Module()
    m.layers = nn.ModuleDict({str(i): nn.Linear(6, 6) for i in range(N_LAYERS)})
    m.register_buffer("freqs", torch.arange(6.0))  # every stage keeps it (torchtitan's freqs_cis)
    return m


def stage(layers: list[int]) -> nn.Module:
    """The full model with the other stages' layers deleted (torchtitan's pipeline split)."""
    m = full_model()
    for i in range(N_LAYERS):
        if i not in layers:
            del m.layers[str(i)]
    return m


def optimizer(m: nn.Module) -> torch.optim.Optimizer:
    decay = [p for n, p in m.named_parameters() if n.endswith("weight")]
    rest = [p for n, p in m.named_parameters() if not n.endswith("weight")]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}], lr=0.01)


def train_step(m: nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    """A step whose gradients depend only on the seed and each layer's name (the same on any split)."""
    for name, layer in m.layers.items():
        g = torch.Generator().manual_seed(seed * 100 + int(name))
        x = torch.randn(3, 6, generator=g)
        layer(x).pow(2).sum().backward()
    opt.step()
    opt.zero_grad()


SPLITS = {2: [[0, 1], [2, 3]], 3: [[0], [1, 2], [3]]}


def _save_split(rank: int, world: int, root: str) -> dict[str, torch.Tensor]:
    m = stage(SPLITS[world][rank])
    opt = optimizer(m)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    for s in range(2):
        train_step(m, opt, s)
        sched.step()
    tg.save(f"{root}/step-2", {"model": m, "optim": opt, "sched": sched}, split_state=True)
    train_step(m, opt, 2)  # what the resumed runs below must reproduce
    return {k: v.clone() for k, v in m.state_dict().items()}


def _load_split(rank: int, world: int, root: str) -> tuple[bool, dict[str, torch.Tensor]]:
    m = stage(SPLITS[world][rank])
    opt = optimizer(m)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    before = {k: v.clone() for k, v in m.state_dict().items()}
    tg.load(f"{root}/step-2", {"model": m, "optim": opt, "sched": sched}, split_state=True)
    changed = any(not torch.equal(before[k], v) for k, v in m.state_dict().items() if k != "freqs")
    train_step(m, opt, 2)
    return changed, {k: v.clone() for k, v in m.state_dict().items()}


def _merge(results: list) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for r in results:
        out.update(r.value if isinstance(r.value, dict) else r.value[1])
    return out


def test_pipeline_stages_reload_on_another_split_and_whole(tmp_path):
    saved = run_ranks(_save_split, 2, str(tmp_path), timeout=90)
    expected = _merge(saved)
    assert set(expected) == {f"layers.{i}.{w}" for i in range(N_LAYERS) for w in ("weight", "bias")} | {"freqs"}

    # The same checkpoint on three stages split differently: each continues bit for bit.
    loaded = run_ranks(_load_split, 3, str(tmp_path), timeout=90)
    assert all(r.value[0] for r in loaded)  # the load changed each stage's weights
    got = _merge(loaded)
    assert got.keys() == expected.keys() and all(torch.equal(got[k], expected[k]) for k in expected)

    # The whole model and one optimizer over all of it, on one process, with no flag.
    m = full_model()
    opt = optimizer(m)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    man = tg.load(tmp_path / "step-2", {"model": m, "optim": opt, "sched": sched})
    assert man.world_size == 2 and sched.last_epoch == 2
    assert [len(g["params"]) for g in opt.param_groups] == [N_LAYERS, N_LAYERS]
    train_step(m, opt, 2)
    assert all(torch.equal(v, expected[k]) for k, v in m.state_dict().items())


def _save_conflict(rank: int, world: int, root: str, what: str) -> str:
    m = stage(SPLITS[world][rank])
    if rank == 1 and what == "value":
        m.freqs.add_(rank)  # a value each stage holds, different on rank 1
    elif rank == 1:
        m.freqs = torch.arange(8.0)  # the same name, another shape
    try:
        tg.save(f"{root}/step-1", {"model": m}, split_state=True)
    except tg.CheckpointError as e:
        return str(e)
    return "saved"


@pytest.mark.parametrize("what,says", [("value", "different values"), ("shape", "same shape and dtype")])
def test_a_shared_tensor_that_differs_between_stages_is_refused(tmp_path, what, says):
    out = run_ranks(_save_conflict, 2, str(tmp_path), what, timeout=90)
    for r in out:
        assert "freqs" in r.value and says in r.value, r.value
    assert not (tmp_path / "step-1").exists()


def _save_plain(rank: int, world: int, root: str, split: bool) -> str:
    m = stage(SPLITS[world][rank])
    try:
        tg.save(f"{root}/step-1", {"model": m}, split_state=split and rank == 0)
    except tg.CheckpointError as e:
        return str(e)
    return "saved"


@pytest.mark.parametrize("flag_on_rank0_only", [False, True])
def test_different_entries_without_the_flag_say_what_to_pass(tmp_path, flag_on_rank0_only):
    out = run_ranks(_save_plain, 2, str(tmp_path), flag_on_rank0_only, timeout=90)
    for r in out:
        assert "split_state" in r.value, r.value
    assert not (tmp_path / "step-1").exists()


def test_split_state_with_a_full_layout_is_refused(tmp_path):
    with pytest.raises(tg.CheckpointError, match="consolidate"):
        tg.save(tmp_path / "step-1", {"model": full_model()}, split_state=True, layout="full")
    with pytest.raises(tg.CheckpointError, match="split_state"):
        tg.CheckpointManager(tmp_path / "run", layout="full", split_state=True)


def _managed(rank: int, world: int, root: str, stages: list[list[int]], async_save: bool, step: int) -> dict:
    """Pipeline x data parallel: ``stages[s]`` are stage s's layers; ranks go to stages in
    order, as many per stage as the world allows (the data-parallel replicas of a stage)."""
    per = world // len(stages)
    m = stage(stages[rank // per])
    opt = optimizer(m)
    state = {"model": m, "optim": opt, "progress": {"step": 0}}
    with tg.CheckpointManager(root, save=tg.EveryNSteps(1), async_save=async_save, split_state=True) as mgr:
        start = mgr.restore(state)
        if start is None:
            for s in range(step):
                train_step(m, opt, s)
                state["progress"]["step"] = s + 1
                mgr.save(s + 1, state)
        mgr.wait()
    return {"start": start, "sd": {k: v.clone() for k, v in m.state_dict().items()},
            "exp_avg": {n: opt.state[p]["exp_avg"].clone() for n, p in m.named_parameters() if p in opt.state}}


def test_manager_pipeline_by_data_parallel_async_then_fewer_ranks(tmp_path):
    two = [[0, 1], [2, 3]]
    saved = run_ranks(_managed, 4, str(tmp_path), two, True, 2, timeout=120)
    assert [r.value["start"] for r in saved] == [None] * 4
    step_dir = tmp_path / "step-000000002"
    sizes = sorted(p.stat().st_size for p in step_dir.glob("data-*"))
    assert len(sizes) == 4 and sizes[0] > 0  # the replicas of each stage share its writes

    # The replicas agree, and the checkpoint restores on 2 ranks split another way.
    assert all(torch.equal(saved[0].value["sd"][k], v) for k, v in saved[1].value["sd"].items())
    restored = run_ranks(_managed, 2, str(tmp_path), [[0, 1, 2], [3]], False, 2, timeout=120)
    assert [r.value["start"] for r in restored] == [2, 2]
    want = {**saved[0].value["sd"], **saved[2].value["sd"]}
    want_avg = {**saved[0].value["exp_avg"], **saved[2].value["exp_avg"]}
    for r in restored:
        assert all(torch.equal(v, want[k]) for k, v in r.value["sd"].items())
        assert r.value["exp_avg"] and all(torch.equal(v, want_avg[k]) for k, v in r.value["exp_avg"].items())


DOC = Path(__file__).resolve().parent.parent / "docs" / "distributed.md"


def _run_doc_block(rank: int, world: int, code: str) -> str:
    exec(compile(code, str(DOC), "exec"), {"__name__": "__main__"})
    return "ok"


def test_distributed_doc_split_state_example(tmp_path):
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)
    ranks_block = next(b for b in blocks if "split_state=True" in b)
    whole_block = next(b for b in blocks if "whole = " in b)
    root = tmp_path / "pp"
    res = run_ranks(_run_doc_block, 2, ranks_block, timeout=90, env={"CKPT_DIR": str(root), "TRAINGUARD_DEAD_AFTER": "3"})
    assert [r.value for r in res] == ["ok", "ok"]
    scope: dict = {"root": str(root)}
    exec(compile("import torch\nfrom torch import nn\nimport trainguard as tg\n" + whole_block, str(DOC), "exec"), scope)
    torch.manual_seed(0)
    fresh = nn.ModuleDict({str(i): nn.Linear(16, 16) for i in range(4)})
    # Every layer was trained on its stage and loaded from the checkpoint: none is as initialised.
    assert all(not torch.equal(scope["whole"][k].weight, fresh[k].weight) for k in fresh)
    # A stage loaded without the flag says what to pass.
    stage0 = nn.ModuleDict({str(i): nn.Linear(16, 16) for i in range(2)})
    with pytest.raises(tg.CheckpointError, match="split_state=True"):
        tg.load(root / "step-000000001", {"model": stage0}, only=["model"])
    with pytest.raises(tg.CheckpointError, match="split_state=True"):
        tg.load(root / "step-000000001", {"model": stage0, "optim": torch.optim.AdamW(stage0.parameters())}, only=["optim"])


def _named(rank: int, world: int, root: str, layers: list[list[int]], load: bool) -> dict:
    """Optimizers built from ``named_parameters()`` (torch keeps ``param_names`` in the groups),
    and an entry that only the last stage holds."""
    m = stage(layers[rank])
    opt = torch.optim.AdamW(m.named_parameters(), lr=0.01)
    state = {"model": m, "optim": opt}
    if rank == world - 1:
        state["head"] = {"ema": torch.full((3,), float(len(layers[rank])))}
    if load:
        tg.load(f"{root}/step-1", state, split_state=True)
    else:
        train_step(m, opt, 0)
        tg.save(f"{root}/step-1", state, split_state=True)
    return {"sd": {k: v.clone() for k, v in m.state_dict().items()}, "names": opt.param_groups[0]["param_names"],
            "head": state.get("head")}


def test_named_optimizer_groups_and_an_entry_of_one_stage(tmp_path):
    saved = run_ranks(_named, 2, str(tmp_path), [[0, 1], [2, 3]], False, timeout=90)
    loaded = run_ranks(_named, 2, str(tmp_path), [[0], [1, 2, 3]], True, timeout=90)
    want = {**saved[0].value["sd"], **saved[1].value["sd"]}
    for r in loaded:
        assert all(torch.equal(v, want[k]) for k, v in r.value["sd"].items())
    assert loaded[1].value["names"] == [f"layers.{i}.{w}" for i in (1, 2, 3) for w in ("weight", "bias")]
    assert torch.equal(loaded[1].value["head"]["ema"], torch.full((3,), 2.0))  # the saving stage's value
    m = full_model()
    opt = torch.optim.AdamW(m.named_parameters(), lr=0.01)
    tg.load(tmp_path / "step-1", {"model": m, "optim": opt}, only=["model", "optim"])
    assert opt.param_groups[0]["param_names"] == [n for n, _ in m.named_parameters()]


def _load_missing_layer(rank: int, world: int, root: str) -> tuple[str, bool]:
    m = stage([[0], [1], [3]][rank])  # layer 2 is on no stage
    before = {k: v.clone() for k, v in m.state_dict().items()}
    try:
        tg.load(f"{root}/step-2", {"model": m}, split_state=True)
    except tg.CheckpointError as e:
        return str(e), all(torch.equal(before[k], v) for k, v in m.state_dict().items())
    return "loaded", False


def test_a_checkpoint_tensor_that_no_stage_holds_fails_the_load(tmp_path):
    run_ranks(_save_split, 2, str(tmp_path), timeout=90)
    out = run_ranks(_load_missing_layer, 3, str(tmp_path), timeout=90)
    for r in out:
        msg, untouched = r.value
        assert "no rank's state holds" in msg and "layers.2.weight" in msg, msg
        assert untouched  # refused before a byte was read into any stage


def _sampler_on_stage0(rank: int, world: int, root: str) -> str:
    state: dict = {"model": stage(SPLITS[world][rank])}
    if rank == 0:  # only the first stage reads data here
        sampler = tg.ResumableSampler(20, seed=3)
        sampler.advance(4)
        state["data"] = sampler
    tg.save(f"{root}/step-1", state, split_state=True)
    return "saved"


def test_a_sampler_that_one_stage_holds_is_saved_with_its_position(tmp_path):
    assert [r.value for r in run_ranks(_sampler_on_stage0, 2, str(tmp_path), timeout=90)] == ["saved", "saved"]
    sampler = tg.ResumableSampler(20, seed=0, rank=0, world_size=2)
    tg.load(tmp_path / "step-1", {"data": sampler}, only=["data"])
    assert (sampler.seed, sampler.position) == (3, 8)  # 4 samples on each of 2 ranks


class _Extra(nn.Linear):
    """A layer with extra state (as TransformerEngine's FP8 layers keep their scaling metadata)."""

    def get_extra_state(self) -> dict:
        return {"amax": float(self.weight.abs().max())}

    def set_extra_state(self, state: dict) -> None:
        self.loaded_extra = state


def _extra_stage(rank: int, world: int, root: str, layers: list[list[int]], load: bool) -> list:
    torch.manual_seed(0)
    m = nn.Module()
    m.layers = nn.ModuleDict({str(i): _Extra(4, 4) for i in range(N_LAYERS)})
    for i in range(N_LAYERS):
        if i not in layers[rank]:
            del m.layers[str(i)]
    if load:
        tg.load(f"{root}/step-1", {"model": m}, split_state=True)
        return sorted(k for k, layer in m.layers.items() if hasattr(layer, "loaded_extra"))
    tg.save(f"{root}/step-1", {"model": m}, split_state=True)
    return []


def test_module_extra_state_goes_to_the_stage_that_holds_the_module(tmp_path):
    run_ranks(_extra_stage, 2, str(tmp_path), [[0, 1], [2, 3]], False, timeout=90)
    out = run_ranks(_extra_stage, 2, str(tmp_path), [[0], [1, 2, 3]], True, timeout=90)
    assert [r.value for r in out] == [["0"], ["1", "2", "3"]]
