"""The ``trainguard`` command as an operator runs it at 3 a.m. on the directory of a job that is
still saving into it: retention deleting old steps under the command's feet is not corruption
(no red "corrupt", no exit 1, no traceback)."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

import trainguard as tg
from trainguard import commit, layout
from trainguard import inspect as inspect_mod
from trainguard.cli import main
from trainguard.storage.local import LocalStorage


def _run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def _run_dir(root) -> None:
    with tg.CheckpointManager(root, save=tg.EveryNSteps(1), keep=tg.KeepAll(), handle_signals=False) as m:
        for s in (1, 2, 3):
            m.save(s, {"w": torch.full((64,), float(s))})


def _retention_deletes_step_1_when(monkeypatch, root, obj, name):
    """Patch ``obj.name`` so that its first call on step 1 first deletes step 1 the way the job's
    retention does (``Storage.remove_tree``: manifest first, then the data)."""
    orig = getattr(obj, name)
    victim = str(root / layout.step_dir(1))
    done = []

    def patched(*a, **kw):
        if not done and any(isinstance(x, str) and x.startswith(victim) for x in a):
            done.append(1)
            LocalStorage().remove_tree(victim)
        return orig(*a, **kw)

    monkeypatch.setattr(obj, name, patched)
    return done


def _rows(r):
    assert r.exception is None or isinstance(r.exception, SystemExit), r.exception
    return [(x["step"], x["status"]) for x in json.loads(r.output)]


def test_ls_of_a_step_retention_deletes_after_the_listing_says_deleted_not_corrupt(tmp_path, monkeypatch):
    orig = commit.list_steps

    def listed_then_deleted(storage, root, **kw):  # noqa: ANN003
        out = orig(storage, root, **kw)
        storage.remove_tree(storage.join(root, layout.step_dir(1)))
        return out

    monkeypatch.setattr(inspect_mod, "list_steps", listed_then_deleted)
    for i, opts in enumerate((["--json"], ["--json", "--verify"], [])):
        _run_dir(tmp_path / str(i))
        r = _run("ls", tmp_path / str(i), *opts)
        if opts:
            assert r.exit_code == 0 and _rows(r) == [(1, "deleted"), (2, "valid"), (3, "valid")], r.output
        else:  # the table shows the new status (rich markup of an unknown status raised)
            assert r.exit_code == 0 and "deleted" in r.output and "corrupt" not in r.output, r.output


def test_ls_of_a_step_deleted_while_its_file_sizes_are_read_has_no_traceback(tmp_path, monkeypatch):
    _run_dir(tmp_path)
    # exists() said the data file is there, then retention removed it before the stat
    done = _retention_deletes_step_1_when(monkeypatch, tmp_path, LocalStorage, "size")
    r = _run("ls", tmp_path, "--json")
    assert done and r.exit_code == 0 and _rows(r) == [(1, "deleted"), (2, "valid"), (3, "valid")], r.output


def test_ls_verify_and_verify_of_a_step_half_deleted_after_its_manifest_was_read(tmp_path, monkeypatch):
    """Retention's delete removes the manifest, then the data files, then the directory: a
    checker that read the manifest first finds the files missing while the directory is still
    there. ``verify`` reported such a step corrupt and exited 1 on a healthy run."""
    for args in (("ls", "--json", "--verify"), ("verify", "--json")):
        root = tmp_path / args[0]
        _run_dir(root)
        victim = root / layout.step_dir(1)
        orig = inspect_mod.read_manifest

        def read_then_half_deleted(storage, directory, victim=victim, orig=orig):
            m = orig(storage, directory)
            if directory == str(victim) and (victim / layout.MANIFEST).exists():
                (victim / layout.MANIFEST).unlink()  # remove_tree cut short here: the directory stays
                for f in victim.iterdir():
                    f.unlink()
            return m

        monkeypatch.setattr(inspect_mod, "read_manifest", read_then_half_deleted)
        r = _run(args[0], root, *args[1:])
        assert r.exit_code == 0 and _rows(r) == [(1, "deleted"), (2, "valid"), (3, "valid")], (args, r.output)
        monkeypatch.undo()


def test_a_corrupt_checkpoint_is_still_corrupt(tmp_path):
    _run_dir(tmp_path)
    data = tmp_path / layout.step_dir(2) / layout.data_file(0)
    data.write_bytes(data.read_bytes()[:-1])
    for args in (("ls", "--json"), ("ls", "--json", "--verify"), ("verify", "--json")):
        r = _run(args[0], tmp_path, *args[1:])
        assert _rows(r) == [(1, "valid"), (2, "corrupt"), (3, "valid")], (args, r.output)
        assert r.exit_code == (1 if args[0] == "verify" else 0)


def test_a_file_the_operator_may_not_read_is_a_one_line_error_saying_what_to_do(tmp_path, monkeypatch):
    """chmod 000 (or checkpoints owned by the job's service account): ls, verify, inspect, export
    ended in a PermissionError traceback. Simulated at the open (tests may run as root, whom
    chmod does not stop)."""
    from trainguard.storage import local

    _run_dir(tmp_path)
    orig = local._open_regular
    locked = {str(tmp_path / layout.step_dir(2) / layout.MANIFEST), str(tmp_path / layout.step_dir(3) / layout.data_file(0))}

    def open_regular(path):
        if path in locked:
            raise PermissionError(13, "Permission denied", path)
        return orig(path)

    monkeypatch.setattr(local, "_open_regular", open_regular)
    step2, step3 = tmp_path / layout.step_dir(2), tmp_path / layout.step_dir(3)
    for args in (("ls", tmp_path), ("verify", tmp_path), ("inspect", step2), ("verify", step3),
                 ("export", step3, "--entry", "w", "--to", tmp_path / "w.safetensors")):
        r = _run(*args)
        assert r.exit_code == 2 and isinstance(r.exception, SystemExit), (args, r.output, r.exception)
        assert r.output.startswith("error: ") and "Permission denied" in r.output and "read access" in r.output, r.output
        assert str(step2 / layout.MANIFEST) in r.output or str(step3 / layout.data_file(0)) in r.output
    assert not (tmp_path / "w.safetensors").exists()


def test_a_run_directory_given_where_one_checkpoint_is_expected_is_named_as_such(tmp_path):
    """``inspect``/``export``/``consolidate`` of the run directory said "not a committed checkpoint
    ... it may be a save that crashed or is still running": the operator was sent looking for a
    crash. Now: it is a run directory, pass one of its steps, and the `ls` command (quoted)."""
    root = tmp_path / "run 1"
    _run_dir(root)
    for args in (("inspect", root), ("export", root, "--to", tmp_path / "w.pt"), ("consolidate", root, tmp_path / "out")):
        r = _run(*args)
        assert r.exit_code == 2 and r.output.startswith("error: "), (args, r.output)
        assert "is a run directory" in r.output and f"trainguard ls '{root}'" in r.output, (args, r.output)
        assert "crashed" not in r.output
    with pytest.raises(tg.NotACheckpointError, match="is a run directory, not one checkpoint"):
        tg.load(root, {"w": torch.zeros(64)})
    url = f"memory://cli14-{tmp_path.name}"  # an object store: the command to run names the URL
    _run_dir(url)
    r = _run("inspect", url)
    assert r.exit_code == 2 and f"trainguard ls memory://cli14-{tmp_path.name}`" in r.output, r.output


def test_an_object_store_that_cannot_be_reached_is_a_one_line_error(tmp_path, monkeypatch):
    """``trainguard ls s3://...`` with a wrong AWS_ENDPOINT_URL or no credentials ended in a
    botocore traceback (EndpointConnectionError, NoCredentialsError: not OSErrors), exit 1.
    The client's error is raised here by a memory:// store (no 14 s of connection retries)."""
    botocore = pytest.importorskip("botocore.exceptions")
    from trainguard.storage.fsspec import FsspecStorage

    url = f"memory://cli14-{tmp_path.name}"
    _run_dir(url)
    for exc in (botocore.EndpointConnectionError(endpoint_url="http://127.0.0.1:9/b/run"), botocore.NoCredentialsError()):
        def fail(self, *a, exc=exc, **kw):
            raise exc

        monkeypatch.setattr(FsspecStorage, "listdir_marked", fail)
        monkeypatch.setattr(FsspecStorage, "read_bytes", fail)
        for args in (("ls", url), ("verify", url), ("inspect", f"{url}/{layout.step_dir(1)}")):
            r = _run(*args)
            assert r.exit_code == 2 and isinstance(r.exception, SystemExit), (args, r.output, r.exception)
            assert r.output.startswith("error: the object store failed: ") and "AWS_ENDPOINT_URL" in r.output, r.output
    monkeypatch.undo()
    r = CliRunner().invoke(main, ["ls", url, "--bogus"])  # click's own errors are untouched
    assert r.exit_code == 2 and "No such option" in r.output


def test_ls_names_the_checkpoints_a_cut_short_overwrite_or_a_rollback_set_aside(tmp_path):
    """Step 3's only copy in ``step-3.old-<id>`` (an overwrite cut short between its renames) and
    step 2 set aside by a rollback: ``ls`` listed neither, so the operator read step 3 as lost
    while the next manager puts it back and restores it. The table is unchanged (and --json)."""
    import os

    _run_dir(tmp_path)
    os.rename(tmp_path / layout.step_dir(3), tmp_path / layout.old_dir(layout.step_dir(3), "ab12"))
    os.rename(tmp_path / layout.step_dir(2), tmp_path / layout.aside_dir(layout.step_dir(2), "cd34"))
    (tmp_path / layout.old_dir(layout.step_dir(1), "ef56")).mkdir()  # a stale one (step 1 is there): no note
    r = _run("ls", tmp_path)
    assert r.exit_code == 0, r.output
    text = " ".join(r.output.split())
    assert "step-000000003.old-ab12: step 3's previous checkpoint" in text and "puts it back" in text
    assert "step-000000002.abandoned-cd34: step 2, set aside by a rollback" in text
    assert "ef56" not in text
    assert _rows(_run("ls", tmp_path, "--json")) == [(1, "valid")]
    with tg.CheckpointManager(tmp_path, handle_signals=False) as m:  # what the note promises
        assert m.restore({"w": torch.zeros(64)}) == 3


def test_paths_are_printed_as_given_never_as_markup_or_control_characters(tmp_path):
    """``export --to 'out[x]/[bold]w.pt'`` said "wrote 2 tensors to out/w.pt" (rich took the
    brackets for markup: the operator is shown a file that does not exist), and an ``error:``
    line printed a path's newline and escape sequences raw (a run directory named by a script)."""
    ckpt = tmp_path / "c"
    tg.save(ckpt, {"model": torch.nn.Linear(2, 2)})
    out = tmp_path / "out[x]"
    out.mkdir()
    r = _run("export", ckpt, "--to", out / "[bold]w.pt")
    assert r.exit_code == 0 and (out / "[bold]w.pt").exists()
    assert f"to {out / '[bold]w.pt'}" in " ".join(r.output.split()), r.output
    odd = tmp_path / "run\nx\x1b[31m"
    _run_dir(odd)
    r = _run("inspect", odd)
    assert r.exit_code == 2 and "\x1b" not in r.output and "\n" not in r.output.rstrip("\n"), repr(r.output)
    assert "run\\x0ax\\x1b[31m is a run directory" in r.output, repr(r.output)
