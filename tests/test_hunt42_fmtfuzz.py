"""Session 42's format fuzz (structured edits of real checkpoints, every consumer): what it found.

- ``trainguard inspect`` of a checkpoint whose tensor name holds a lone surrogate (a state key
  ``"w\\ud800"``, which ``tg.save`` writes as is) died with UnicodeEncodeError: ``printable``
  escaped only surrogate-escaped bytes.
- ``inspect``'s header printed the manifest's ``library``/``torch`` strings whole: rich's
  highlighter is quadratic in an unbroken word (100,000 characters: minutes).
- ``convert --to dcp`` of a manifest whose skeleton refers to another entry's tensor (valid for
  ``manifest.validate``, loaded by ``tg.load``) raised a bare KeyError.
- Retention read ``metadata["metrics"]`` of a checkpoint it did not write with ``dict()``: a
  ``tg.save(..., metadata={"metrics": [...]})`` in the run directory failed every retention.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import torch
from click.testing import CliRunner

import trainguard as tg
from trainguard.cli import main as cli_main
from trainguard.commands import printable
from trainguard.manifest import checksum


def _rewrite(ckpt: Path, edit) -> None:
    """Edit the manifest body of ``ckpt``, its checksum recomputed (only semantic checks see the edit)."""
    body = json.loads((ckpt / "manifest.json").read_bytes())["manifest"]
    edit(body)
    raw = json.dumps(body, separators=(",", ":")).encode()
    (ckpt / "manifest.json").write_bytes(b'{"checksum":"' + checksum(raw).encode() + b'","manifest":' + raw + b"}\n")


def test_inspect_shows_a_lone_surrogate_in_a_tensor_name(tmp_path: Path) -> None:
    ckpt = tmp_path / "step-000000001"
    tg.save(ckpt, {"m": {"w\ud800": torch.ones(2)}})
    r = CliRunner().invoke(cli_main, ["inspect", str(ckpt)], catch_exceptions=True)
    assert r.exception is None or isinstance(r.exception, SystemExit), repr(r.exception)
    assert r.exit_code == 0, r.output
    assert "w\\ud800" in r.output
    assert printable("a\ud800b\udc80") == "a\\ud800b\\x80"  # a surrogate-escaped byte stays \xNN


def test_inspect_header_clips_a_huge_library_string(tmp_path: Path) -> None:
    ckpt = tmp_path / "step-000000001"
    tg.save(ckpt, {"w": torch.ones(2)})
    _rewrite(ckpt, lambda b: b.update(library="x" * 3000))
    r = CliRunner().invoke(cli_main, ["inspect", str(ckpt)], catch_exceptions=True)
    assert r.exit_code == 0, r.output
    header = r.output.splitlines()[0]
    assert "(3000 characters)" in header and len(header) < 1000, header[:300]


def test_convert_to_dcp_refuses_a_reference_to_another_entrys_tensor(tmp_path: Path) -> None:
    ckpt = tmp_path / "step-000000001"
    tg.save(ckpt, {"model": {"a": torch.ones(2), "b": torch.zeros(3)}, "plain": {"s": torch.tensor(2.0)}})
    _rewrite(ckpt, lambda b: b["objects"]["model"]["skeleton"].update(a={"$t": "plain/s"}))
    state = {"model": None}
    tg.load(ckpt, state, strict=False)  # the manifest validates: a load takes the other entry's tensor
    assert torch.equal(state["model"]["a"], torch.tensor(2.0))
    r = CliRunner().invoke(cli_main, ["convert", str(ckpt), str(tmp_path / "dcp"), "--to", "dcp", "--entry", "*"],
                           catch_exceptions=True)
    assert isinstance(r.exception, SystemExit) and r.exit_code == 2, (repr(r.exception), r.output)
    assert "refers to tensor 'plain/s', which is not one of its own" in r.output
    assert not os.path.exists(tmp_path / "dcp")


def test_retention_reads_metrics_that_are_not_a_dict_as_none(tmp_path: Path) -> None:
    run = tmp_path / "run"
    state = {"w": torch.ones(3)}
    tg.save(run / "step-000000001", state, metadata={"metrics": [1, 2]})  # the user's own metadata
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with tg.CheckpointManager(run, save=tg.EveryNSteps(1), keep=tg.KeepBest("loss", n=1)) as mgr:
            assert mgr.restore(state) == 1
            for step in (2, 3):
                mgr.save(step, state, metrics={"loss": float(step)})
    assert not [w for w in caught if "retention" in str(w.message)], [str(w.message) for w in caught]
    assert sorted(os.listdir(run)) == [".lock", ".trainguard-run-id", "events.jsonl", "step-000000002", "step-000000003"]


def test_skeleton_errors_quote_a_bounded_part_of_the_value(tmp_path: Path) -> None:
    """A ``$float`` or ``$t`` marker holding 100,000 characters: the error (printed by verify, ls,
    logged by restore) quotes the start of it, as every other manifest error does, not all of it."""
    for n, edit in enumerate([lambda b: b["metadata"].update(x={"$float": "z" * 100_000}),
                              lambda b: b["objects"]["p"]["skeleton"].update(w={"$t": [0] * 100_000})]):
        ckpt = tmp_path / f"step-00000000{n}"
        tg.save(ckpt, {"p": {"w": torch.ones(2)}})
        _rewrite(ckpt, edit)
        try:
            tg.load(ckpt, {"p": None}, strict=False)
        except tg.CorruptCheckpointError as e:
            assert len(str(e)) < 500, len(str(e))
        else:
            raise AssertionError("the edited manifest loaded")


def test_a_rank_local_entry_with_a_skeleton_list_of_another_length_than_the_world_is_corrupt(tmp_path: Path) -> None:
    ckpt = tmp_path / "step-000000001"
    tg.save(ckpt, {"rng": tg.RNGState(), "w": torch.ones(2)})
    tg.load(ckpt, {"rng": tg.RNGState()}, strict=False)  # as saved: loads

    def two_ranks(body: dict) -> None:
        assert len(body["objects"]["rng"]["ranks"]) == body["world_size"] == 1
        body["objects"]["rng"]["ranks"].append(body["objects"]["rng"]["ranks"][0])

    _rewrite(ckpt, two_ranks)
    try:
        tg.load(ckpt, {"rng": tg.RNGState()}, strict=False)
    except tg.CheckpointError as e:
        assert "object 'rng' is malformed" in str(e)
    else:
        raise AssertionError("a manifest whose rank-local entry lists 2 ranks in a world of 1 loaded")
