"""Session 57, review57f: a hostile review of ``trainguard doctor`` and ``trainguard plan`` with
training scripts written the way users write them, odd inputs, and the Young/Daly figures
computed here independently of :mod:`trainguard.reliability`."""

from __future__ import annotations

import json
import math

from click.testing import CliRunner

from trainguard.commands.plan import doctor_cmd, plan_cmd


def _doctor(script, *args):
    res = CliRunner().invoke(doctor_cmd, [str(script), "--json", *args])
    return res


DATACLASS_SCRIPT = '''
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

import trainguard as tg


@dataclass
class Config:
    lr: float = 3e-4
    tags: list[str] = field(default_factory=list)


def trainguard_state():
    cfg = Config()
    model = nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=cfg.lr)
    return {"model": model, "optim": opt, "rng": tg.RNGState()}


if __name__ == "__main__":
    raise SystemExit("training runs here")
'''


def test_a_script_with_a_dataclass_config_is_imported(tmp_path):
    # A config @dataclass under `from __future__ import annotations` (HF-style scripts): dataclasses looks
    # its module up in sys.modules, where the doctor had not put it: exit 2, "AttributeError: 'NoneType'
    # object has no attribute '__dict__'", and no finding at all.
    script = tmp_path / "train_cfg.py"
    script.write_text(DATACLASS_SCRIPT)
    res = _doctor(script)
    assert "NoneType" not in res.output, res.output
    checks = {f["check"]: f["severity"] for f in json.loads(res.output[res.output.index("["):])}
    assert checks["model"] == "ok" and checks["rng"] == "ok", checks


ACCUM_LOOP = '''
import torch
from torch import nn

ACCUM = 4
model = nn.Linear(4, 1)
optimizer = torch.optim.AdamW(model.parameters())


def train(mgr, state, loader):
    step = 0
    for i, (x, y) in enumerate(loader):
        loss = nn.functional.mse_loss(model(x), y) / ACCUM
        loss.backward()
{early}        if (i + 1) % ACCUM != 0:
            continue
        optimizer.step()
        optimizer.zero_grad()
{late}        step += 1
'''


def _accum_finding(early: str, late: str):
    from trainguard.doctor import Settings
    from trainguard.doctor_accum import mid_accumulation

    return mid_accumulation([], Settings(source=ACCUM_LOOP.format(early=early, late=late)))


def test_a_save_before_the_accumulation_guard_clause_is_reported():
    # `if (i + 1) % accum != 0: continue` then the optimizer step: a save before the guard runs on every
    # micro-batch. It was "ok" (the step is in the loop, not under an `if`, so the loop was taken as stepping).
    f = _accum_finding("        mgr.save(step, state)\n", "")
    assert f is not None and f.severity == "warning", f
    assert "line 15" in f.message and "continue" in f.message, f.message


def test_a_save_after_the_accumulation_guard_clause_is_fine():
    f = _accum_finding("", "        mgr.save(step, state)\n")
    assert f is not None and f.severity == "ok", f


def test_plan_agrees_with_young_daly_and_the_exact_optimum_computed_here():
    # Independent of trainguard.reliability: M = node MTBF / nodes; Young sqrt(2 d M); Daly's estimate
    # sqrt(2 d M) (1 + sqrt(d / 2M) / 3 + d / 18M) - d (d < 2M); the expected wall time of one interval
    # tau, failures and restarts R included, M e^(R/M) (e^((tau + d)/M) - 1) (Daly 2006).
    nodes, rate, d, r = 256, 0.0065, 30.0, 600.0
    res = CliRunner().invoke(plan_cmd, ["--nodes", str(nodes), "--node-failures-per-day", str(rate), "--save-stall",
                                        "30s", "--restart", "10m", "--step-time", "2s", "--every", "500", "--json"])
    assert res.exit_code == 0, res.output
    p = json.loads(res.output)
    m = 86400 / (rate * nodes)
    young = math.sqrt(2 * d * m)
    daly = young * (1 + math.sqrt(d / (2 * m)) / 3 + d / (18 * m)) - d

    def eff(tau):
        return tau / (m * math.exp(r / m) * math.expm1((tau + d) / m))

    lo, hi = 1.0, 10 * young  # golden-section search for the exact optimum of eff
    for _ in range(200):
        a, b = hi - (hi - lo) / 1.618033988749895, lo + (hi - lo) / 1.618033988749895
        lo, hi = (lo, b) if eff(a) > eff(b) else (a, hi)
    best = (lo + hi) / 2
    assert math.isclose(p["job_mtbf_s"], m, rel_tol=1e-5)
    assert math.isclose(p["p_failure_day"], -math.expm1(-86400 / m), rel_tol=1e-5)
    assert math.isclose(p["young_interval_s"], young, rel_tol=1e-5)
    assert math.isclose(p["daly_interval_s"], daly, rel_tol=1e-5)
    assert math.isclose(p["optimal_interval_s"], best, rel_tol=1e-3)
    assert math.isclose(p["efficiency_at_young"], eff(young), rel_tol=1e-5)
    assert math.isclose(p["efficiency_at_optimum"], eff(best), rel_tol=1e-5)
    assert p["intervals"][0]["interval_s"] == 1000.0 and math.isclose(p["intervals"][0]["efficiency"], eff(1000.0), rel_tol=1e-5)
    assert math.isclose(p["lost_gpu_hours_per_day"], (1 - eff(best)) * nodes * 8 * 24, rel_tol=1e-4)


def test_a_notebook_is_refused_saying_how_to_export_it(tmp_path):
    # Its JSON parses as one Python dict: the source checks found nothing and said "ok" (exit 1 only for the
    # missing hook), though no line of its code was read.
    nb = tmp_path / "train.ipynb"
    nb.write_text(json.dumps({"cells": [{"cell_type": "code", "metadata": {"collapsed": False}, "source": [
        "import torch\n", "if dist.get_rank() == 0:\n", "    mgr.save(step, state)\n"]}],
        "metadata": {}, "nbformat": 4, "nbformat_minor": 5}))
    res = _doctor(nb)
    assert res.exit_code == 2, res.output
    assert "notebook" in res.output and "nbconvert --to script" in res.output, res.output
    assert '"ok"' not in res.output, res.output


def test_tg_doctor_refuses_a_notebooks_path(tmp_path):
    import pathlib

    import pytest

    import trainguard as tg

    nb = tmp_path / "train.ipynb"
    nb.write_text(json.dumps({"cells": [], "metadata": {}, "nbformat": 4, "nbformat_minor": 5}))
    # Before: Path(...) read the JSON and parsed it as one dict; "train.ipynb" parsed as the expression
    # `train.ipynb`: every static check passed on no code, silently.
    for source in (pathlib.Path(nb), str(nb)):
        with pytest.raises(ValueError, match="nbconvert"):
            tg.doctor({}, source=source)


def test_a_script_in_a_package_with_a_relative_import_is_imported(tmp_path):
    # `torchrun -m proj.train` layouts: `from .config import LR` failed the import, exit 2, "ImportError:
    # attempted relative import with no known parent package", with nothing checked.
    pkg = tmp_path / "proj"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "config.py").write_text("LR = 0.1\n")
    (pkg / "train.py").write_text(
        "import torch\nfrom .config import LR\n\n\ndef trainguard_state():\n    m = torch.nn.Linear(2, 2)\n"
        "    return {'model': m, 'optim': torch.optim.SGD(m.parameters(), lr=LR)}\n")
    res = _doctor(pkg / "train.py")
    assert "relative import" not in res.output, res.output
    checks = {f["check"]: f["severity"] for f in json.loads(res.output[res.output.index("["):])}
    assert checks["model"] == "ok", checks


def test_the_loader_check_reads_the_scripts_functions_once_not_once_per_dataloader(monkeypatch):
    # A script with many DataLoader(...) calls (one per dataset or eval split, generated configs): the
    # "data randomness" check mapped every node to its parent and recomputed which functions train for each
    # loader: 300 loaders took 6 s in that check, a 5,000-line script of 1,000 of them over 100 s in all.
    import ast

    from trainguard.doctor import Settings
    from trainguard.doctor_source import loader_generator

    src = "from torch.utils.data import DataLoader\n" + "".join(
        f"def f{i}(model, opt, data, mgr, state):\n    for x in DataLoader(data):\n        model(x).backward()\n"
        f"        opt.step()\n        mgr.save({i}, state)\n" for i in range(30))
    whole: list[int] = []
    real = ast.iter_child_nodes

    def counting(node):
        if isinstance(node, ast.Module):
            whole.append(1)
        return real(node)

    monkeypatch.setattr(ast, "iter_child_nodes", counting)
    f = loader_generator([], Settings(source=src))
    assert f is not None and f.severity == "warning" and "line 3" in f.message, f
    assert len(whole) <= 2, f"the script's tree was mapped {len(whole)} times for 30 loaders"
