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
