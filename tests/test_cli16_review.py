"""Review 16 of the ``trainguard`` command and the manifest: ``inspect --filter`` and its output
for many tensors, click's usage errors as one ``error:`` line, ``verify`` and the RAM tier,
help texts, hostile manifests (block sizes, duplicate keys), a step whose ``stat`` fails."""

from __future__ import annotations

import json
import os
import re

import pytest
import torch
from click.testing import CliRunner

import trainguard as tg
from trainguard.cli import main
from trainguard.tiers import ram_dir


def _run(*args, **kw):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False, **kw)


def _layers(path, n: int = 3) -> None:
    """A checkpoint whose entry ``model`` holds ``layers.I.weight``/``layers.I.bias`` for I < n."""
    model = torch.nn.Sequential(*(torch.nn.Linear(2, 2) for _ in range(n)))
    tg.save(path, {"model": {f"layers.{k}": v for k, v in model.state_dict().items()},
                   "progress": tg.StateDict(step=1, lr=torch.ones(1))})


# ----------------------------------------------------------------------------- inspect --filter


def test_inspect_filter_selects_tensors_by_entry_and_name(tmp_path):
    """``inspect`` of a checkpoint of 100,000 tensors printed all of them (50 s as text); now
    ``--filter GLOB`` (repeatable) keeps the tensors whose ``ENTRY/NAME`` matches, and only the
    entries that hold one, in the text tree and in ``--json`` (the same schema)."""
    ck = tmp_path / "c"
    _layers(ck)
    r = _run("inspect", ck, "--json", "--filter", "model/*.1.weight", "--filter", "*/lr")
    assert r.exit_code == 0, r.output
    d = json.loads(r.output)
    assert {k: sorted(v["tensors"]) for k, v in d["entries"].items()} == {"model": ["layers.1.weight"], "progress": ["lr"]}
    assert d["entries"]["model"]["tensors"]["layers.1.weight"] == {"dtype": "float32", "shape": [2, 2], "bytes": 16, "chunks": 1}
    assert d["bytes"] == sum(d["files"].values())  # the checkpoint's facts, not the selection's

    r = _run("inspect", ck, "--filter", "*bias")
    shown = [ln for ln in r.output.splitlines() if "float32" in ln]
    assert r.exit_code == 0 and len(shown) == 3 and all("bias" in ln for ln in shown), r.output
    assert "progress" not in r.output  # no tensor of it matches
    r = _run("inspect", ck, "--filter", "nothing*")
    assert r.exit_code == 0 and "no tensor matches nothing*" in r.output and "float32" not in r.output


def test_inspect_text_and_json_of_every_tensor_one_line_each(tmp_path):
    """Unfiltered: the tree as rich drew it (one line per tensor, the last with ``└──``) and JSON
    whose every tensor is one line (``json.dumps(indent=1)`` spent 11 s in pure Python on 100,000
    tensors, ten lines each), parsed to the same values."""
    ck = tmp_path / "c"
    _layers(ck, n=2)
    out = _run("inspect", ck).output.splitlines()
    i = next(k for k, ln in enumerate(out) if ln.startswith("├── model"))
    assert out[i + 1 : i + 5] == ["│   ├── layers.0.weight  float32 (2, 2)  16 B  (1 chunk(s))",
                                  "│   ├── layers.0.bias  float32 (2,)  8 B  (1 chunk(s))",
                                  "│   ├── layers.1.weight  float32 (2, 2)  16 B  (1 chunk(s))",
                                  "│   └── layers.1.bias  float32 (2,)  8 B  (1 chunk(s))"], out
    # Its plain values beside it since session 49 (commands/values.py)
    assert out[i + 5] == "└── progress  step=1" and out[i + 6].startswith("    └── lr  float32 (1,)")
    text = _run("inspect", ck, "--json").output
    line = next(ln for ln in text.splitlines() if '"layers.0.bias"' in ln)
    assert json.loads("{" + line.strip().rstrip(",") + "}") == {"layers.0.bias": {"dtype": "float32", "shape": [2], "bytes": 8, "chunks": 1}}
    assert len(json.loads(text)["entries"]["model"]["tensors"]) == 4


# ----------------------------------------------------------------------------- click's usage errors


@pytest.mark.parametrize("args, says", [
    (["ls", "--bogus", "x"], "No such option:? '?--bogus"),  # click 8.1 words it "No such option: --bogus"
    (["ls"], "Missing argument 'RUN_DIR'"),
    (["lss"], "No such command 'lss'"),
    (["--bogus"], "No such option:? '?--bogus"),
    (["inspect", "x", "--filter"], "Option '--filter' requires an argument"),
    (["demo", "--steps", "0"], "0 is not in the range"),
])
def test_usage_errors_are_one_error_line_exit_2(args, says):
    """click printed ``Usage: ...``, ``Try ... for help.``, a blank line and ``Error: ...``; every
    other error of the CLI is one ``error:`` line, exit 2. Now so are click's, with the usage of the
    command concerned and where its help is; ``--help`` is unchanged."""
    r = CliRunner().invoke(main, args, prog_name="trainguard")
    lines = r.output.strip().splitlines()
    assert r.exit_code == 2 and len(lines) == 1 and lines[0].startswith("error: "), r.output
    assert re.search(says, lines[0]) and "--help`" in lines[0] and "Traceback" not in r.output, r.output
    if args[0] in ("ls", "inspect"):
        assert f"usage: trainguard {args[0]} [OPTIONS]" in lines[0], r.output
    r = CliRunner().invoke(main, [args[0] if not args[0].startswith("--") and args[0] != "lss" else "ls", "--help"], prog_name="trainguard")
    assert r.exit_code == 0 and r.output.startswith("Usage: trainguard ")


def test_run_usage_errors_are_one_error_line_exit_2(capsys):
    """``trainguard run`` parses with torchrun's argparse parser: 15 lines of usage before
    ``trainguard run: error: ...``. Now one line, exit 2."""
    from trainguard.elastic.launcher import build_parser

    for argv in ([], ["--hang-timeout", "-1", "train.py"]):
        with pytest.raises(SystemExit) as e:
            build_parser().parse_args(argv)
        err = capsys.readouterr().err.strip().splitlines()
        assert e.value.code == 2 and len(err) == 1 and err[0].startswith("error: "), err
        assert "`trainguard run --help`" in err[0]


# ----------------------------------------------------------------------------- verify and the RAM tier


def _ram_run(tmp_path):
    """A run directory whose step 1 has a RAM copy kept (the restart case) under ``tmp_path/shm``."""
    root, shm = tmp_path / "run", tmp_path / "shm"
    shm.mkdir()
    with tg.CheckpointManager(root, save=tg.EveryNSteps(1), ram_tier=str(shm)) as mgr:
        mgr.save(1, {"model": torch.nn.Linear(4, 2)})
        mgr.close(keep_ram_tier=True)
    return root, shm


def test_verify_of_a_run_names_a_valid_ram_copy_restore_would_use(tmp_path):
    """``verify RUN`` said "no committed checkpoint verified: restore would find none to load"
    while this node's RAM tier held a valid copy, from which a manager with ``ram_tier=`` restored
    that step. Now it names the RAM copy (``--ram-tier DIR`` as for ``ls``); the exit code stays
    the run directory's (1), and without a RAM copy the verdict is as before."""
    root, shm = _ram_run(tmp_path)
    data = root / "step-000000001" / "data-00000.bin"
    data.write_bytes(bytes(b ^ 0xFF for b in data.read_bytes()))
    r = _run("verify", root, "--ram-tier", shm, terminal_width=400)
    assert r.exit_code == 1 and "CORRUPT" in r.output, r.output
    assert "restore would find none" not in r.output and "RAM tier" in r.output, r.output
    assert "holds a valid copy of step 1" in " ".join(r.output.split()), r.output
    with tg.CheckpointManager(root, ram_tier=str(shm)) as mgr:  # what the note promises
        assert mgr.restore({"model": torch.nn.Linear(4, 2)}) == 1
    (tmp_path / "elsewhere").mkdir()  # a RAM tier base holding no copy of this run (one not there: exit 2)
    r = _run("verify", root, "--ram-tier", tmp_path / "elsewhere")
    assert r.exit_code == 1 and "restore would find none to load" in r.output, r.output


def test_verify_of_a_run_without_steps_names_a_ram_copy(tmp_path):
    """A run whose only checkpoint is in RAM (the copy to the run directory never finished):
    ``verify RUN`` exits 2 as for any run without checkpoints, and says the RAM tier holds one."""
    import shutil

    root, shm = _ram_run(tmp_path)
    shutil.rmtree(root / "step-000000001")
    # ... and the RAM tier's record that step 1 reached disk, which a copy cut short never writes
    # (with it, the RAM copy is one removed from the run directory since: a restart discards it).
    os.remove(os.path.join(ram_dir(str(root), str(shm)), ".trainguard-on-disk"))
    r = _run("verify", root, "--ram-tier", shm, terminal_width=400)
    assert r.exit_code == 2 and r.output.startswith("error: ") and "holds a valid copy of step 1" in r.output, r.output


# ----------------------------------------------------------------------------- help texts


def test_demo_help_names_only_its_own_options_or_trainguard_runs():
    """``demo --help`` said ``--spawn``: "instead of --run-path", ``--start-method``: "with
    --run-path", an option ``demo`` does not have (it is ``trainguard run``'s, which the demo uses).
    Every option the help names is now ``demo``'s own or quoted as ``trainguard run``'s."""
    import re

    from trainguard.commands.demo import demo

    text = " ".join(_run("demo", "--help", terminal_width=400).output.split())
    own = {o for p in demo.params for o in p.opts}
    outside = re.sub(r"`trainguard run [^`]*`", "", text)  # what `trainguard run ...` quotes is its own
    named = set(re.findall(r"--[a-z][a-z-]*", outside))
    assert named <= own | {"--help"}, named - own


def test_export_help_says_the_output_is_a_local_file():
    """``export --to`` could not be an object store's URL (refused at run time), which its help did
    not say; nor that .pth/.bin are torch.save files too."""
    text = " ".join(_run("export", "--help", terminal_width=400).output.split())
    assert "local" in text and "object store" in text and ".pth" in text, text


# ----------------------------------------------------------------------------- hostile manifests


def _rewrite(d, body: bytes) -> None:
    """Write manifest body ``body`` (bytes of JSON) into checkpoint ``d`` with a valid checksum."""
    from trainguard.manifest import checksum

    (d / "manifest.json").write_bytes(b'{"checksum":"' + checksum(body).encode() + b'","manifest":' + body + b"}\n")


def _body(d) -> dict:
    return json.loads((d / "manifest.json").read_bytes())["manifest"]


def test_a_block_size_that_is_no_multiple_of_an_item_size_is_refused_as_corrupt(tmp_path):
    """A hand-made manifest with ``block_size`` 6 and float32 tensors (checksums recomputed: it
    verified): a resharding read of a column band (the planner's whole blocks viewed as float32)
    failed in torch with a bare RuntimeError ("must be divisible by 4 to view Byte as Float").
    Now the manifest is refused as corrupt, naming the tensor: load, verify, inspect."""
    from trainguard.errors import CorruptCheckpointError
    from trainguard.manifest import checksum

    d = tmp_path / "c"
    w = torch.arange(60 * 70, dtype=torch.float32).reshape(60, 70)
    tg.save(d, {"w": w})
    body = _body(d)
    c = body["tensors"]["w"]["chunks"][0]
    data = (d / c[2]).read_bytes()[c[3]: c[3] + c[4]]
    c[5] = [checksum(data[i: i + 6]) for i in range(0, len(data), 6)]
    body["block_size"] = 6
    _rewrite(d, json.dumps(body, separators=(",", ":")).encode())
    with pytest.raises(CorruptCheckpointError, match=r"tensor 'w': block_size 6 is not a multiple of its float32 item size"):
        tg.load(d, {"w": torch.zeros(60, 70)})
    res = tg.verify(d)
    assert not res.ok and "hand-edited" in res.errors[0], res.errors
    r = _run("inspect", d)
    assert r.exit_code == 2 and r.output.startswith("error: ") and "block_size 6" in r.output, r.output


@pytest.mark.parametrize("where", ["tensors", "objects", "top"])
def test_a_manifest_naming_a_key_twice_is_refused_as_corrupt(tmp_path, where):
    """JSON allows an object to name a key twice; ``json.loads`` keeps the last value, so a
    hand-made manifest describing a tensor, an entry or a field twice loaded silently (which of the
    two was meant?). ``json.dumps`` never writes one: it is refused as corrupt, naming the key."""
    from trainguard.errors import CorruptCheckpointError

    d = tmp_path / "c"
    tg.save(d, {"model": torch.nn.Linear(2, 2)})
    body = _body(d)
    raw = json.dumps(body, separators=(",", ":"))
    if where == "top":
        dup, raw = "step", raw.replace('"step":', '"step":7,"step":', 1)
    else:
        dup, key = ("model/weight", "tensors") if where == "tensors" else ("model", "objects")
        one = json.dumps({dup: body[key][dup]}, separators=(",", ":"))[1:-1]
        raw = raw.replace(f'"{key}":{{', f'"{key}":{{{one},', 1)
    _rewrite(d, raw.encode())
    with pytest.raises(CorruptCheckpointError, match=f"the key '{dup}' appears twice"):
        tg.load(d, {"model": torch.nn.Linear(2, 2)})
    assert not tg.verify(d).ok
    r = _run("verify", d)
    assert r.exit_code == 1 and "appears twice" in r.output, r.output


# ----------------------------------------------------------------------------- a step whose manifest's stat fails


def test_open_stopped_by_an_unreadable_step_says_which_and_how_to_start_from_the_others(tmp_path, monkeypatch):
    """An EIO on the stat of an old step's manifest fails a manager's open (documented in
    docs/reliability.md: the open removes step directories without a manifest and cannot tell that
    one). Its error said only "fix the storage or its permissions"; now it names the step and the
    documented way out (move it away), which works: the run then restores its newest checkpoint."""
    import errno
    import shutil

    from trainguard.errors import CheckpointError
    from trainguard.storage import LocalStorage

    root = tmp_path / "run"
    with tg.CheckpointManager(root, save=tg.EveryNSteps(1), keep=tg.KeepLatest(5)) as mgr:
        for s in (1, 2, 3):
            mgr.save(s, {"m": torch.nn.Linear(2, 2)})
    bad = root / "step-000000001"
    real = LocalStorage.exists

    def exists(self, p):
        if str(p) == str(bad / "manifest.json"):
            raise OSError(errno.EIO, "Input/output error", str(p))
        return real(self, p)

    monkeypatch.setattr(LocalStorage, "exists", exists)
    with pytest.raises(CheckpointError) as ei:
        tg.CheckpointManager(root, save=tg.EveryNSteps(1)).open()
    msg = str(ei.value)
    assert f"whether {bad} holds its manifest cannot be checked" in msg and f"move {bad} out of {root}" in msg, msg
    assert "Input/output error" in msg
    shutil.move(str(bad), str(tmp_path / "aside"))  # what the error says to do
    with tg.CheckpointManager(root, save=tg.EveryNSteps(1)) as mgr:
        assert mgr.restore({"m": torch.nn.Linear(2, 2)}) == 3


def test_a_long_path_is_printed_on_one_line_when_piped(tmp_path):
    """rich wraps piped output at 80 columns: ``export``'s "wrote 2 tensors to <path>" broke a
    path longer than that in two lines (a script reading the path got half of it; test_cli14's
    check failed whenever pytest's temp path was long enough)."""
    ckpt = tmp_path / "c"
    tg.save(ckpt, {"model": torch.nn.Linear(2, 2)})
    out = tmp_path / ("d" * 90)
    out.mkdir()
    r = _run("export", ckpt, "--to", out / "w.pt")
    assert r.exit_code == 0, r.output
    assert f"wrote 2 tensors to {out / 'w.pt'}\n" in r.output, r.output
