"""Session 57, review57k: a hostile review of review57f's doctor changes (merge 49a97dc): the import of a
script in a package, the accumulation guard clause, the notebook refusal."""

from __future__ import annotations

import json
import sys
import textwrap

import pytest
import torch
from click.testing import CliRunner

import trainguard as tg
from trainguard.commands.plan import doctor_cmd

HEAD = "import torch\nimport trainguard as tg\nmgr = tg.CheckpointManager('ck')\n"


def _accum(body: str) -> str:
    state = {"model": torch.nn.Linear(2, 2)}
    found = [f for f in tg.doctor(state, source=HEAD + textwrap.dedent(body)) if f.check == "save mid-accumulation"]
    return found[0].severity if found else "none"


@pytest.mark.parametrize("guard", [
    "if i % world_size != rank:",  # a hand-made shard: this rank trains every world_size-th batch
    "if i % 2:",  # every other batch
    "if i < start_step % len(loader):",  # the resume skip of a restarted epoch
])
def test_a_guard_before_the_backward_skips_a_batch_not_an_optimizer_step(guard: str) -> None:
    # The optimizer steps on every batch the loop trains: no accumulation. Since 49a97dc a `%` guard with
    # `continue` before the step was read as an accumulation guard, and the save before it was a warning.
    body = f"""
    for i, batch in enumerate(loader):
        mgr.save(step, state)
        {guard}
            continue
        loss = model(batch)
        loss.backward()
        opt.step()
        opt.zero_grad()
    """
    assert _accum(body) == "ok"


def test_a_save_between_a_resume_skip_and_the_accumulation_guard_is_reported() -> None:
    # The first `%` guard of the loop (the resume skip) was taken for the accumulation guard, and the save
    # after it, on every micro-batch, was "ok".
    body = """
    for i, batch in enumerate(loader):
        if i < start_step % len(loader):
            continue
        (model(batch) / accum).backward()
        mgr.save(step, state)
        if (i + 1) % accum != 0:
            continue
        opt.step()
        opt.zero_grad()
    """
    assert _accum(body) == "warning"


def test_the_accumulation_guard_clause_still_holds() -> None:
    before = """
    for i, batch in enumerate(loader):
        (model(batch) / accum).backward()
        mgr.save(step, state)
        if (i + 1) % accum != 0:
            continue
        opt.step()
    """
    after = """
    for i, batch in enumerate(loader):
        (model(batch) / accum).backward()
        if (i + 1) % accum != 0:
            continue
        opt.step()
        mgr.save(step, state)
    """
    assert _accum(before) == "warning" and _accum(after) == "ok"


HOOK = """
import torch
import trainguard as tg
{imp}

def trainguard_state():
    m = torch.nn.Linear(2, 2)
    return {{"model": m, "optim": torch.optim.SGD(m.parameters(), lr=LR), "rng": tg.RNGState()}}
"""


def _package(root, name: str, init: str, imp: str, cfg: str = "") -> str:
    pkg = root / name
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(init)
    if cfg:
        (pkg / "cfg.py").write_text(cfg)
    (pkg / "train.py").write_text(HOOK.format(imp=imp))
    return str(pkg / "train.py")


@pytest.fixture
def clean_modules():
    before = set(sys.modules)
    yield
    for k in set(sys.modules) - before:
        del sys.modules[k]


def _findings(res) -> dict[str, str]:
    assert res.exit_code in (0, 1), res.output
    return {f["check"]: f["severity"] for f in json.loads(res.output[res.output.index("["):])}


@pytest.mark.parametrize("init", ["raise RuntimeError('set DATA_DIR first')\n", "import os\nDATA = os.environ['TG57K_UNSET']\n",
                                  "import sys\nsys.exit(3)\n"])
def test_a_package_init_is_not_run_for_a_script_without_relative_imports(tmp_path, clean_modules, init) -> None:
    # `python proj/train.py` never runs proj/__init__.py; since 49a97dc the doctor imported the package first:
    # an __init__ that needs the job's environment failed the doctor (exit 2), one that exits ended it with 3.
    script = _package(tmp_path, "proj57k_a", init, "LR = 0.1")
    assert _findings(CliRunner().invoke(doctor_cmd, [script, "--json"]))["model"] == "ok"


def test_a_package_init_that_exits_is_an_error_naming_the_package(tmp_path, clean_modules) -> None:
    # With relative imports the package is imported (python -m proj.train); its sys.exit(3) ended the doctor
    # with exit code 3 and no word.
    script = _package(tmp_path, "proj57k_b", "import sys\nsys.exit(3)\n", "from .cfg import LR", "LR = 0.1\n")
    res = CliRunner().invoke(doctor_cmd, [script, "--json"])
    assert res.exit_code == 2 and "proj57k_b" in res.output and "exited" in res.output, (res.exit_code, res.output)


def test_two_folders_with_a_package_of_one_name_each_read_their_own(tmp_path, clean_modules) -> None:
    # In one process (tests, a notebook), the second folder's `from .cfg import LR, EXTRA` was resolved in the
    # first folder's package, already in sys.modules: "cannot import name 'EXTRA' from 'proj.cfg' (.../a/...)".
    first = _package(tmp_path / "a", "proj57k_c", "", "from .cfg import LR", "LR = 0.1\n")
    second = _package(tmp_path / "b", "proj57k_c", "", "from .cfg import LR, EXTRA", "LR = 0.2\nEXTRA = 1\n")
    assert _findings(CliRunner().invoke(doctor_cmd, [first, "--json"]))["model"] == "ok"
    assert _findings(CliRunner().invoke(doctor_cmd, [second, "--json"]))["model"] == "ok"


def test_a_package_named_like_an_imported_module_says_to_rename_it(tmp_path, clean_modules) -> None:
    # A folder `json/` with __init__.py: the doctor's own json was taken for the script's package
    # ("No module named 'json.cfg'").
    script = _package(tmp_path, "json", "", "from .cfg import LR", "LR = 0.1\n")
    res = CliRunner().invoke(doctor_cmd, [script, "--json"])
    assert res.exit_code == 2 and "already imported" in res.output and "rename" in res.output, res.output


NOTEBOOK = json.dumps({"cells": [{"cell_type": "code", "metadata": {}, "outputs": [], "source": [
    "for x, y in loader:\n", "    loss.backward()\n", "    opt.step()\n", "    mgr.save(step, state)\n"]}],
    "metadata": {}, "nbformat": 4, "nbformat_minor": 5}, indent=1)


def test_tg_doctor_refuses_a_notebooks_json_as_text_or_in_a_py(tmp_path) -> None:
    # The CLI refused a .py holding a notebook's JSON; tg.doctor ran its static checks on the one dict and
    # reported what it found there ("ok") for text, and for such a .py's path.
    state = {"model": torch.nn.Linear(2, 2)}
    with pytest.raises(ValueError, match="notebook"):
        tg.doctor(state, source=NOTEBOOK)
    path = tmp_path / "exported.py"
    path.write_text(NOTEBOOK)
    with pytest.raises(ValueError, match="notebook"):
        tg.doctor(state, source=str(path))
