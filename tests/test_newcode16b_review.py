"""Review of session 16's new code (CLI, manifests, doctor, convert, FSDP loads): what broke it."""

from __future__ import annotations

import pytest

from trainguard.doctor import Settings
from trainguard.doctor_source import single_rank

# ----------------------------------------------------------------------------- doctor: text files


@pytest.mark.parametrize(("src", "severity"), [
    # a config file's *name* saved inside the state or the metadata: the save is still a checkpoint
    ("if rank == 0:\n    mgr.save(step, state, metadata={'config': 'configs/7b.yaml'})\n", "error"),
    ("import torch\nif rank == 0:\n    torch.save({'model': m.state_dict(), 'cfg': 'base.yaml'}, f'{out}/c.pt')\n", "warning"),
    ("if rank == 0:\n    mgr.save(step, {'model': model, 'notes': ['see README.md']})\n", "error"),
    # the file written is a text file: no checkpoint (as before)
    ("if rank == 0:\n    parser.save(config, 'hparams.yaml')\n", "ok"),
    ("if rank == 0:\n    writer.save(cfg, out / 'config.json')\n", "ok"),
    ("if rank == 0:\n    writer.save(cfg, f'{out}/config.yaml')\n", "ok"),
    ("import os\nif rank == 0:\n    writer.save(cfg, os.path.join(out, 'config.toml'))\n", "ok"),
    ("if rank == 0:\n    writer.save(cfg, '{}/args.txt'.format(out))\n", "ok"),
    ("if rank == 0:\n    writer.save(cfg, path=out / 'config.json', overwrite=True)\n", "ok"),
    ("if rank == 0:\n    writer.save(cfg, str(out / 'config.json'))\n", "ok"),
    ("if rank == 0:\n    writer.save(cfg, '%s/config.yaml' % out)\n", "ok"),
    ("if rank == 0:\n    writer.save(state, str(out / 'model.pt'))\n", "error"),
])
def test_a_text_file_named_inside_the_saved_state_does_not_hide_a_rank0_save(src: str, severity: str) -> None:
    """doctor took any string ending in .yaml/.json/... anywhere in a save's arguments for the file
    it writes: ``mgr.save(step, state, metadata={"config": "configs/7b.yaml"})`` under ``if rank ==
    0:`` (a collective save every other rank never joins: a hang) was reported 'ok'."""
    f = single_rank([], Settings(source=src))
    assert f is not None and f.severity == severity, (src, f)


# ----------------------------------------------------------------------------- convert: torchtitan-like DCP


def test_a_scalar_saved_beside_a_top_level_model_is_no_model_key(tmp_path) -> None:
    """A DCP save laid out as torchtitan's (the model's keys at the top level, the optimizer
    flattened) plus a top-level ``step`` and ``loss_scale``: the import put those two into the
    ``model`` entry (every top-level key was taken for the model's), so ``tg.load(..., {"model": m,
    "step": ...})`` failed ('missing from the checkpoint: step; ... not in the state: model/step').
    They are entries of their own again, as before the torchtitan import; a root buffer of the
    model (torchtitan llama's persistent ``freqs_cis``) stays the model's."""
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    import trainguard as tg
    from test_memory16_review import _titan_model, _titan_step
    from trainguard.convert import convert

    def build() -> torch.nn.Module:  # torchtitan's llama: a persistent freqs_cis buffer at the root
        m = _titan_model()
        m.register_buffer("freqs_cis", torch.arange(12.0).reshape(3, 4), persistent=True)
        return m

    m = build()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    _titan_step(m, opt)
    states = {**get_model_state_dict(m), "step": torch.tensor(7), "loss_scale": torch.tensor(2.0),
              "optimizer": get_optimizer_state_dict(m, opt, options=StateDictOptions(flatten_optimizer_state_dict=True))}
    dcp.save(states, storage_writer=dcp.FileSystemWriter(str(tmp_path / "titan")), no_dist=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the DCP-is-a-pickle warning
        convert(tmp_path / "titan", tmp_path / "tg")
    m2 = build()
    with torch.no_grad():
        for p in m2.state_dict().values():
            p.zero_()
    opt2 = torch.optim.AdamW(m2.parameters(), lr=1e-2)
    state = {"model": m2, "optimizer": opt2, "step": torch.tensor(0), "loss_scale": torch.tensor(0.0)}
    tg.load(tmp_path / "tg", state)
    assert state["step"].item() == 7 and state["loss_scale"].item() == 2.0
    assert all(torch.equal(a, b) for a, b in zip(m.state_dict().values(), m2.state_dict().values(), strict=True))
    assert all(torch.equal(opt.state[p]["exp_avg"], opt2.state[q]["exp_avg"])
               for p, q in zip(m.parameters(), m2.parameters(), strict=True))


# ----------------------------------------------------------------------------- doctor: `or` with one process


@pytest.mark.parametrize(("test", "severity"), [
    # every part but the rank test holds only when there is one process: still rank 0's save
    ("not dist.is_available() or not dist.is_initialized() or dist.get_rank() == 0", "error"),
    ("not torch.distributed.is_available() or dist.get_rank() == 0", "error"),
    ("not utils.is_dist_avail_and_initialized() or dist.get_rank() == 0", "error"),  # DETR's, MAE's utils
    ("not is_dist_avail_and_initialized() or get_rank() == 0", "error"),
    # another condition lets every rank in: no rank-0 save (11e05c6)
    ("not torch.cuda.is_available() or rank == 0", "ok"),  # a CPU run of many ranks
    ("rank == 0 or args.save_all_ranks", "ok"),
])
def test_dist_unavailable_or_rank0_is_still_a_rank0_test(test: str, severity: str) -> None:
    """11e05c6 made a rank-0 test or-ed with another condition no rank-0 test, except where the
    other condition holds only in a single process; ``not dist.is_available()`` and DETR/MAE's
    ``not is_dist_avail_and_initialized()`` were not among those, so the common ``if not
    dist.is_available() or not dist.is_initialized() or dist.get_rank() == 0: mgr.save(...)`` (a
    collective save only rank 0 makes: a hang) became 'ok'; it was an error before."""
    f = single_rank([], Settings(source=f"import torch\nimport torch.distributed as dist\nif {test}:\n    mgr.save(step, state)\n"))
    assert f is not None and f.severity == severity, (test, f)


# ----------------------------------------------------------------------------- doctor: imports read once


@pytest.mark.parametrize("first", ["", "import utils\n"])
def test_a_module_imported_through_another_first_is_still_followed_from_the_script(tmp_path, first: str) -> None:
    """The doctor read each project module once (8ec016e) and kept the result of the first read:
    ``ckpt`` reached first through ``utils`` (two imports deep, its own imports not followed) then
    stood for the script's own ``import ckpt`` too, so ``ckpt.save_all`` -> ``iohelp.write_all`` ->
    ``mgr.save`` under ``if rank == 0:`` was found without ``import utils`` and missed with it."""
    files = {"utils.py": "import ckpt\ndef log(x):\n    print(x)\n",
             "ckpt.py": "from iohelp import write_all\ndef save_all(mgr, step, state):\n    write_all(mgr, step, state)\n",
             "iohelp.py": "def write_all(mgr, step, state):\n    mgr.save(step, state)\n"}
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    src = f"{first}import ckpt\nif rank == 0:\n    ckpt.save_all(mgr, step, state)\n"
    (tmp_path / "train.py").write_text(src)
    f = single_rank([], Settings(source=src, path=str(tmp_path / "train.py")))
    assert f is not None and f.severity == "error" and "save_all" in f.message, f
