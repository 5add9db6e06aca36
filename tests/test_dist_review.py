"""Review of the distributed save/load path: failures that only one rank sees must fail the save on
every rank, in the same collective round, and commit nothing (real gloo ranks, bounded)."""

from __future__ import annotations

import os
from pathlib import Path

import torch

import trainguard as tg

from dist_helper import attempt, run_ranks

ENV = {"TRAINGUARD_DEAD_AFTER": "3"}


def listing_fails_on_rank0_group(rank: int, world: int, root: str) -> dict:
    state = {"w": torch.arange(6.0)}
    # Rank 0 alone looks at the target before the "begin" round; its listing fails (ENAMETOOLONG).
    out = {"listing": attempt(lambda: tg.save(f"{root}/{'x' * 300}/c", state, timeout=20))}  # a parent too long
    out["next"] = attempt(lambda: tg.save(f"{root}/step-000000004", state, timeout=20))  # the ranks are still in step
    return out


def bad_metadata_on_rank1_group(rank: int, world: int, root: str) -> dict:
    state = {"w": torch.arange(6.0)}
    # Metadata only rank 1 cannot store (rank 0's is the one the manifest would hold).
    bad = {"acc": 0.5} if rank == 0 else {"acc": object()}
    out = {"metadata": attempt(lambda: tg.save(f"{root}/step-000000002", state, metadata=bad, timeout=20))}
    out["metadata_async"] = attempt(
        lambda: tg.save(f"{root}/step-000000003", state, metadata=bad, async_=True, timeout=20).result()
    )
    out["next"] = attempt(lambda: tg.save(f"{root}/step-000000004", state, timeout=20))  # the ranks are still in step
    return out


def _only_the_next_save_committed(root: str) -> None:
    assert sorted(os.listdir(root)) == ["step-000000004"]  # nothing else committed, no temp directory left
    got = {"w": torch.zeros(6)}
    tg.load(f"{root}/step-000000004", got)
    assert torch.equal(got["w"], torch.arange(6.0))


def test_rank0_failing_to_look_at_the_target_fails_the_save_on_every_rank(tmp_path: Path) -> None:
    root = str(tmp_path)
    out = [r.value for r in run_ranks(listing_fails_on_rank0_group, 2, root, timeout=90, env=ENV)]
    for o in out:
        assert o["listing"]["type"] == "RankFailureError" and o["listing"]["ranks"] == [0], o["listing"]
        assert "File name too long" in o["listing"]["msg"]
        assert o["next"]["type"] is None, o["next"]
    assert len({o["listing"]["msg"] for o in out}) == 1
    _only_the_next_save_committed(root)


def test_metadata_one_rank_cannot_store_fails_the_save_on_every_rank(tmp_path: Path) -> None:
    root = str(tmp_path)
    out = [r.value for r in run_ranks(bad_metadata_on_rank1_group, 2, root, timeout=90, env=ENV)]
    for o in out:
        for case in ("metadata", "metadata_async"):
            assert o[case]["type"] == "RankFailureError" and o[case]["ranks"] == [1], o[case]
            assert "metadata/acc" in o[case]["msg"]
        assert o["next"]["type"] is None, o["next"]
    assert len({o["metadata"]["msg"] for o in out}) == 1
    _only_the_next_save_committed(root)


def submesh_group(rank: int, world: int, root: str) -> dict:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    def state(scale: float) -> dict:
        torch.manual_seed(0)
        full = torch.randn(5, 3) * scale
        return {
            "a": distribute_tensor(full, DeviceMesh("cpu", [0, 1]), [Shard(0)]),  # rank 2 holds none of it
            "b": distribute_tensor(full * 2, DeviceMesh("cpu", [1, 2]), [Replicate()]),  # rank 0 holds none
        }

    saved, fresh = state(1.0), state(0.0)
    # layout="full" gathers each DTensor: a rank outside a mesh got a (0,) tensor from full_tensor()
    # and the save was refused as "ranks passed different entries"; now it names the mesh.
    out = {"full": attempt(lambda: tg.save(f"{root}/full", {"b": saved["b"]}, layout="full", timeout=20))}
    out["save"] = attempt(lambda: tg.save(f"{root}/step-000000001", saved, timeout=20))
    out["load"] = attempt(lambda: tg.load(f"{root}/step-000000001", fresh, timeout=20))
    out["equal"] = all(torch.equal(fresh[k].to_local(), saved[k].to_local()) for k in saved)
    return out


def test_dtensors_on_meshes_of_some_ranks_load_on_every_rank(tmp_path: Path) -> None:
    root = str(tmp_path)
    out = [r.value for r in run_ranks(submesh_group, 3, root, timeout=90, env=ENV)]
    for o in out:
        assert o["full"]["type"] == "RankFailureError" and o["full"]["ranks"] == [0], o["full"]
        assert "layout='full' needs every DTensor on a mesh of all ranks" in o["full"]["msg"], o["full"]["msg"]
        assert o["save"]["type"] is None and o["load"]["type"] is None, (o["save"], o["load"])
        assert o["equal"]
    assert not os.path.exists(f"{root}/full")
    got = {"a": None, "b": None}
    tg.load(f"{root}/step-000000001", got)  # offline, one process: whole tensors
    torch.manual_seed(0)
    full = torch.randn(5, 3)
    assert torch.equal(got["a"], full) and torch.equal(got["b"], full * 2)


def bad_metrics_on_rank1_group(rank: int, world: int, root: str) -> dict:
    state = {"w": torch.arange(6.0)}
    # A validation metric only rank 0 computes: the others pass None, which metrics refuse.
    metrics = {"val": 0.25 if rank == 0 else None}
    out = {}
    with tg.CheckpointManager(f"{root}/run", save=tg.EveryNSteps(1), timeout=20, handle_signals=False) as mgr:
        out["save"] = attempt(lambda: mgr.save(1, state, metrics=metrics))
        out["next"] = attempt(lambda: mgr.save(2, state, metrics={"val": 0.5}))  # the ranks are still in step
        out["latest"] = mgr.latest_step()
    return out


def test_a_metric_refused_on_one_rank_fails_the_managers_save_on_every_rank(tmp_path: Path) -> None:
    # The manager refused metrics before any collective: rank 1 raised at once and rank 0 waited in
    # the "begin" round for it (the heartbeat went on) until the timeout, or paired its next save.
    out = [r.value for r in run_ranks(bad_metrics_on_rank1_group, 2, str(tmp_path), timeout=90, env=ENV)]
    for o in out:
        assert o["save"]["type"] == "RankFailureError" and o["save"]["ranks"] == [1], o["save"]
        assert "metrics['val'] = None" in o["save"]["msg"], o["save"]["msg"]
        assert o["next"]["type"] is None and o["latest"] == 2, o


def regular_and_stream_files_group(rank: int, world: int, root: str) -> dict:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = DeviceMesh("cpu", list(range(world)))
    torch.manual_seed(0)
    big = torch.randn(16 << 20)  # 64 MiB, Shard(0) on the whole mesh: a regular tensor (format 2)
    # Replicated tensors beside it: over 64 MiB a rank writes a second file, data-RRRRR-1.bin.
    extra = {f"t{i}": torch.full((4 << 20,), float(i)) for i in range(8)}
    tg.save(f"{root}/ck", {"w": distribute_tensor(big, mesh, [Shard(0)]), "extra": extra}, timeout=60)
    fresh = {"w": distribute_tensor(torch.zeros_like(big), mesh, [Shard(0)]),
             "extra": {k: torch.zeros_like(v) for k, v in extra.items()}}
    out = {"load": attempt(lambda: tg.load(f"{root}/ck", fresh, timeout=60))}
    out["equal"] = torch.equal(fresh["w"].full_tensor(), big) and all(torch.equal(fresh["extra"][k], v) for k, v in extra.items())
    return out


def test_regular_tensors_beside_a_second_stream_file_load(tmp_path: Path) -> None:
    # The manifest check of what regular parts claim of each rank's file counted the chunks of the
    # rank's second stream file (data-RRRRR-1.bin) against data-RRRRR.bin: a valid FSDP-style
    # checkpoint of over 64 MiB a rank was refused at every load as "tensors claim N bytes of ...".
    out = [r.value for r in run_ranks(regular_and_stream_files_group, 2, str(tmp_path), timeout=120, env=ENV)]
    assert "data-00000-1.bin" in os.listdir(tmp_path / "ck")  # the case: a second stream file
    for o in out:
        assert o["load"]["type"] is None and o["equal"], o


def listing_fails_in_restore_group(rank: int, world: int, root: str) -> dict:
    from trainguard import manager, relist, retention

    state = {"w": torch.arange(4.0)}
    with tg.CheckpointManager(f"{root}/run", save=tg.EveryNSteps(1), timeout=20, handle_signals=False) as mgr:
        mgr.save(1, state)
    if rank == 0:  # rank 0 alone lists the run directory for restore (no permission, an object store's error)
        def refused(*args, **kwargs):
            raise PermissionError(13, "Permission denied")

        retention.list_steps = manager.list_steps = relist.list_steps = refused  # relist: restore's listing
    with tg.CheckpointManager(f"{root}/run", timeout=20, handle_signals=False) as mgr:
        return attempt(lambda: mgr.restore(state))


def test_rank0_failing_to_list_for_restore_fails_restore_on_every_rank(tmp_path: Path) -> None:
    # Rank 0 raised the listing's error alone; the others waited in the "candidates" broadcast
    # until rank 0's process ended (or the timeout).
    out = [r.value for r in run_ranks(listing_fails_in_restore_group, 2, str(tmp_path), timeout=90, env=ENV)]
    for o in out:
        assert o["type"] == "CheckpointError" and "cannot list" in o["msg"] and "Permission denied" in o["msg"], o


def dtensor_of_another_shape_group(rank: int, world: int, root: str) -> dict:
    import warnings

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    tg.save(f"{root}/a", {"t": distribute_tensor(torch.arange(8.0).reshape(8, 1), mesh, (Shard(0),))})
    dst = distribute_tensor(torch.zeros(6, 1), mesh, (Shard(0),))
    state = {"t": dst}
    strict = attempt(lambda: tg.load(f"{root}/a", state))
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        tg.load(f"{root}/a", state, strict=False)
    return {"strict": strict, "kept": state["t"] is dst and float(dst.to_local().abs().sum()) == 0.0,
            "warned": any("keep their current values" in str(x.message) for x in w)}


def test_a_dtensor_entry_of_another_shape_is_refused_not_replaced_by_a_full_tensor(tmp_path: Path) -> None:
    """A plain entry whose shape changed is replaced by the checkpoint's tensor; a DTensor entry
    was too: every rank got the full tensor, as a plain tensor in place of its shard."""
    for r in run_ranks(dtensor_of_another_shape_group, 2, str(tmp_path), timeout=90, env={"TRAINGUARD_DEAD_AFTER": "5"}):
        assert r.value["strict"]["type"] is not None and "checkpoint float32[8, 1]" in r.value["strict"]["msg"], r.value
        assert r.value["kept"] and r.value["warned"], r.value
