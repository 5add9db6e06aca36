"""Doc-vs-code review of planning and the doctor: cases that failed before their fix."""

from __future__ import annotations

from pathlib import Path

from click.testing import CliRunner

from trainguard.commands.plan import doctor_cmd
from trainguard.doctor import Finding, Settings, check


def one(name: str, **settings: object) -> Finding:
    (found,) = [f for f in check({}, Settings(**settings)) if f.check == name]  # type: ignore[arg-type]
    return found


def test_doctor_reads_a_script_in_a_declared_non_utf8_encoding(tmp_path: Path) -> None:
    # A valid Python file (PEP 263 coding line) that Python imports fine; the doctor read it as UTF-8.
    script = tmp_path / "train.py"
    script.write_bytes(b"# -*- coding: latin-1 -*-\n# caf\xe9\nimport torch\n\ndef trainguard_state():\n"
                       b"    return {'model': torch.nn.Linear(2, 2)}\n\nif False:\n    print('caf\xe9')\n")
    res = CliRunner().invoke(doctor_cmd, [str(script), "--json"])
    assert res.exception is None or isinstance(res.exception, SystemExit), res.exception
    assert '"check": "model"' in res.output and "all ranks save" in res.output, res.output


def test_doctor_says_so_when_the_script_exits_while_imported(tmp_path: Path) -> None:
    # argparse at module level: it parsed the doctor's own arguments and exited 2 with the script's usage
    script = tmp_path / "train.py"
    script.write_text("import argparse\np = argparse.ArgumentParser()\np.add_argument('--lr', type=float, default=1e-3)\n"
                      "args = p.parse_args()\n\ndef trainguard_state():\n    return {}\n")
    res = CliRunner().invoke(doctor_cmd, [str(script), "--json"])
    assert "unrecognized arguments" not in res.output, res.output
    assert res.exit_code == 1 and '"check": "model"' in res.output, res.output  # defaults: imports, then checks
    # a script that exits at import (sys.exit(3)) exited the doctor silently with the script's code
    script.write_text("import sys\nsys.exit(3)\n\ndef trainguard_state():\n    return {}\n")  # (no hook: not imported)
    res = CliRunner().invoke(doctor_cmd, [str(script)])
    assert res.exit_code == 2 and "exited" in res.output and "__main__" in res.output, res.output


def test_config_and_image_saves_under_rank_zero_are_not_checkpoint_errors() -> None:
    # docs/planning.md: "np.save and the like: not reported"; accelerate's save is torch.save on the main process
    src = ("if rank == 0:\n    OmegaConf.save(cfg, 'config.yaml')\n    yaml.safe_dump(cfg, f)\n"
           "if accelerator.is_main_process:\n    accelerator.save(model.state_dict(), 'model.pt')\n")
    f = one("all ranks save", source=src)
    assert f.severity == "warning" and "line 5" in f.message and "line 2" not in f.message, f.message
    assert "accelerator.save" in f.message, f.message
    f = one("all ranks save", source="if rank == 0:\n    OmegaConf.save(cfg, 'config.yaml')\n")
    assert f.severity == "ok", f.message
    f = one("all ranks save", source="if rank == 0:\n    mgr.save(step, state)\n    OmegaConf.save(c, 'c.yaml')\n")
    assert f.severity == "error" and "line 2" in f.message and "3" not in f.message, f.message


def test_plan_prints_small_failure_odds_without_rounding_them_to_zero() -> None:
    from trainguard.commands.plan import plan_cmd

    # one node failing once in 10,000 days: P(day) = 0.0099995 %, P(week) = 0.07 %; printed as 0.0 % and 0.1 %
    res = CliRunner().invoke(plan_cmd, "--node-failures-per-day 0.0001 --save-stall 10s --restart 5m".split(),
                             terminal_width=200)
    rows = {line.split("│")[1].strip(): line.split("│")[2].strip() for line in res.output.splitlines()
            if line.count("│") == 3}
    assert rows["P(>= 1 failure) per day"] == "0.01%" and rows["P(>= 1 failure) per week"] == "0.07%", res.output


def test_interval_check_takes_the_stall_out_of_an_every_seconds_interval() -> None:
    # EverySeconds counts wall time from one save's start to the next, the save's stall included; the plan's
    # intervals are compute time: EverySeconds(60) with a 30 s stall computes 30 s between saves, not 60 s
    from trainguard.policies import EverySeconds
    from trainguard.reliability import make_plan

    plan = make_plan(nodes=256, node_failures_per_day=0.0065, stall_s=30, restart_s=600, step_time_s=2)
    f = one("interval", save_policy=EverySeconds(60), plan=plan)
    assert f.severity == "warning" and f"efficiency {100 * plan.efficiency(30.0):.2f}%" in f.message, f.message
    f = one("interval", save_policy=EverySeconds(1800 + 30), plan=plan)
    assert f.severity == "ok" and f"efficiency {100 * plan.efficiency(1800.0):.2f}%" in f.message, f.message


def test_rank_zero_conditions_are_recognised_by_the_rank_not_by_the_letters_rank() -> None:
    # "rank" anywhere in a comparison with 0 made it a rank-0 condition: `rank % 2 == 0` (every
    # other rank) and `epoch % eval_ranking_every == 0` were errors; `rank < 1` was not seen.
    fine = ["if rank % 2 == 0:\n    mgr.save(step, state)\n",
            "if epoch % eval_ranking_every == 0:\n    mgr.save(step, state)\n",
            "if num_rankings == 0:\n    mgr.save(step, state)\n"]
    for src in fine:
        assert one("all ranks save", source=src).severity == "ok", src
    flagged = ["if rank < 1:\n    mgr.save(step, state)\n",
               "if 0 == args.local_rank:\n    mgr.save(step, state)\n",
               "if int(os.environ.get('RANK', 0)) == 0:\n    mgr.save(step, state)\n",
               "if os.environ['RANK'] == 0:\n    mgr.save(step, state)\n",
               "if self.global_rank <= 0:\n    mgr.save(step, state)\n",
               "if rank >= 1:\n    pass\nelse:\n    mgr.save(step, state)\n"]
    for src in flagged:
        f = one("all ranks save", source=src)
        assert f.severity == "error", (src, f.message)


def test_amp_check_of_a_run_time_dtype_is_a_warning_and_of_a_disabled_autocast_nothing() -> None:
    # nanoGPT's `torch.amp.autocast(device_type=device_type, dtype=ptdtype)` (bfloat16 by default)
    # and `autocast("cuda", enabled=False)` were float16 AMP errors.
    f = one("amp", source="ctx = torch.amp.autocast(device_type=device_type, dtype=ptdtype)\n")
    assert f.severity == "warning" and "chosen at run time" in f.message, f.message
    assert one("amp", source="with torch.autocast('cuda', enabled=False):\n    pass\n").severity == "ok"
    assert one("amp", source="with torch.autocast('cuda'):\n    pass\n").severity == "error"  # CUDA's default: float16
    assert one("amp", source="with torch.autocast('cuda', dtype=torch.bfloat16):\n    pass\n").severity == "ok"
