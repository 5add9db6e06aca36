"""Hostile review of README.md and docs/*.md as a new user (review58a, session 58): each claim or
snippet checked against the code; these are the mismatches found, and the snippets no test ran."""

from __future__ import annotations

import ast
import inspect
import io
import re
import shlex
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import trainguard as tg
from trainguard.cli import main

ROOT = Path(__file__).resolve().parent.parent


def _doc(name: str) -> str:
    return (ROOT / name).read_text()


def test_every_n_steps_at_start_is_an_on_off_argument() -> None:
    """``EveryNSteps(n, at_start=False)`` was in no doc (step 0 is never saved without it), and
    ``at_start="no"`` (read from a config) was taken as truthy: step 0 saved, unlike every other
    on/off argument, which refuses a string (docs/checkpoints.md, "Where a save may go")."""
    with pytest.raises(TypeError, match="at_start='no': pass True or False"):
        tg.EveryNSteps(10, at_start="no")
    assert not tg.EveryNSteps(10).should_save(0, 0.0) and tg.EveryNSteps(10, at_start=True).should_save(0, 0.0)
    assert tg.EveryNSteps(10, at_start=1).should_save(0, 0.0)  # 0 and 1 are on/off values, as for overwrite=
    assert repr(tg.EveryNSteps(10, at_start=True)) == "EveryNSteps(10, at_start=True)"


def _signature_span(doc: str, name: str) -> ast.Call:
    """The backticked ``name(...)`` of ``doc`` that lists defaults (``x=...``), as an expression."""
    spans = [s for s in re.findall(r"`((?:tg\.)?" + name + r"\([^`]*\))`", _doc(doc)) if "=" in s]
    assert spans, f"{doc} documents no signature of {name}"
    text = max(spans, key=len).replace("\n", " ").replace("*, ", "")
    call = ast.parse(text, mode="eval").body
    assert isinstance(call, ast.Call)
    return call


@pytest.mark.parametrize(("doc", "obj"), [
    ("docs/checkpoints.md", tg.EveryNSteps),
    ("docs/checkpoints.md", tg.KeepBest),
    ("docs/planning.md", tg.DalyInterval),
])
def test_documented_policy_signatures_are_the_code_s(doc: str, obj: type) -> None:
    """A policy's documented signature names every argument it takes, with its default: before,
    ``DalyInterval``'s ``node_mtbf_s`` and ``window``, ``EveryNSteps``'s ``at_start`` and
    ``KeepBest``'s defaults (``n=1``, ``mode="min"``) were in no doc."""
    call = _signature_span(doc, obj.__name__)
    documented = {a.id: inspect.Parameter.empty for a in call.args}
    documented |= {k.arg: ast.literal_eval(k.value) for k in call.keywords}
    real = {n: p.default for n, p in inspect.signature(obj).parameters.items()}
    assert documented == real


@pytest.mark.parametrize("name", ["gone.safetensors", "gone.pt", "gone/model.safetensors.index.json"])
def test_convert_of_a_missing_foreign_file_says_no_such_file(tmp_path: Path, name: str) -> None:
    """docs/interop.md: "a source that is not there is refused as `SRC: no such file or directory`".
    True of a name without a known suffix only: a missing .safetensors, .pt or HF index said
    ``cannot read SRC as safetensors: FileNotFoundError: [Errno 2] No such file or directory: '...'``."""
    src = tmp_path / name
    r = CliRunner().invoke(main, ["convert", str(src), str(tmp_path / "out" / "step-000000000")])
    assert r.exit_code == 2, r.output
    assert r.output.strip().splitlines() == [f"error: {src}: no such file or directory; check the path"]
    assert not (tmp_path / "out").exists()


def test_the_command_line_examples_of_checkpoints_md_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/checkpoints.md "Command line": its commands (`ls`, `inspect`, `inspect --filter`, `verify`,
    `export`) and the newest-valid-step one-liner ran in no test."""
    text = _doc("docs/checkpoints.md").split("## Command line", 1)[1]
    blocks = re.findall(r"^```\n(.*?)^```", text, flags=re.S | re.M)
    commands = [shlex.split(line, comments=True) for line in blocks[0].splitlines() if line.strip()]
    assert [c[1] for c in commands] == ["ls", "inspect", "inspect", "verify", "export"]
    monkeypatch.chdir(tmp_path)
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(5))
    tg.save("ckpts/run1/step-000000700", {"model": model, "progress": tg.StateDict(step=700)})
    runner = CliRunner()
    out = {}
    for cmd in commands:
        r = runner.invoke(main, cmd[1:])
        assert r.exit_code == 0, (cmd, r.output)
        out[" ".join(cmd)] = r.output
    filtered = out["trainguard inspect ckpts/run1/step-000000700 --filter model/layers.3.*"]
    assert "layers.3.weight" in filtered and "layers.3.bias" in filtered and "layers.2." not in filtered
    assert torch.equal(tg_load_safetensors(tmp_path / "model.safetensors")["layers.3.weight"], model.layers[3].weight)

    (line,) = [b for b in blocks if "--json --verify" in b]
    listing, _, pipe = line.strip().partition(" | ")
    r = runner.invoke(main, shlex.split(listing)[1:])
    assert r.exit_code == 0, r.output
    code = shlex.split(pipe)[2]  # python -c "<code>"
    printed: list = []
    monkeypatch.setattr("sys.stdin", io.StringIO(r.output))
    exec(code, {"print": printed.append})  # the one-liner's print, caught
    assert printed == [700]


def tg_load_safetensors(path: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(path))
