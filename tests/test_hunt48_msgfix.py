"""Session 48, helper msgfix: ``tg.verify(url).path`` on an object store is the URL (it was the store's
key, which ``tg.load`` read as a local path); ``convert --to safetensors`` into a ``.bin``/``.pt`` name
is refused (it wrote a safetensors file that ``torch.load`` refuses); the step-name mismatch of
``read_manifest`` and export's "has no entry" / "rank-local" messages name the checkpoint by its URL."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import trainguard as tg
from trainguard.cli import main as cli
from trainguard.errors import CheckpointError, CorruptCheckpointError
from trainguard.inspect import list_checkpoints
from trainguard.storage import for_path

pytest.importorskip("fsspec")


@pytest.fixture
def run_url() -> Iterator[str]:
    """A fresh memory:// run directory, removed afterwards."""
    url = f"memory://msgfix-{uuid.uuid4().hex[:10]}/run"
    yield url
    storage, root = for_path(url)
    if storage.exists(root):
        storage.fs.rm(root.rsplit("/", 1)[0], recursive=True)


def test_verify_path_is_the_url_and_loads_back(run_url: str, tmp_path: Path) -> None:
    tg.save(f"{run_url}/step-000000003", {"w": torch.arange(4.0)})
    v = tg.verify(f"{run_url}/step-000000003")
    assert v.ok and v.step == 3
    assert v.path.startswith("memory://") and v.path.endswith("/run/step-000000003"), v.path
    back = {"w": torch.zeros(4)}
    tg.load(v.path, back)  # the store's key (/msgfix-.../run/step-N) was read as a local path: no such directory
    assert torch.equal(back["w"], torch.arange(4.0))
    rows = list_checkpoints(run_url)
    assert [r.path for r in rows] == [v.path]
    r = CliRunner().invoke(cli, ["verify", f"{run_url}/step-000000003", "--json"])
    assert r.exit_code == 0 and json.loads(r.output)[0]["path"] == v.path, r.output
    r = CliRunner().invoke(cli, ["ls", run_url, "--json"])
    assert r.exit_code == 0 and json.loads(r.output)[0]["path"] == v.path, r.output
    # Local paths are given back as they were.
    local = str(tmp_path / "run" / "step-000000001")
    tg.save(local, {"w": torch.arange(4.0)})
    assert tg.verify(local).path == local
    assert [x.path for x in list_checkpoints(tmp_path / "run")] == [local]


@pytest.mark.parametrize("name", ["out.bin", "out.pt", "out.pth"])
def test_convert_to_safetensors_into_a_torch_name_is_refused(tmp_path: Path, name: str) -> None:
    ck = tmp_path / "run" / "step-000000001"
    tg.save(ck, {"model": {"w": torch.arange(3.0)}})
    r = CliRunner().invoke(cli, ["convert", str(ck), str(tmp_path / name), "--to", "safetensors"])
    assert r.exit_code == 2, r.output
    assert "name it .safetensors" in r.output and "drop --to" in r.output, r.output
    assert not (tmp_path / name).exists()
    # Without --to the name's format (torch.save) is written, and torch.load reads it.
    r = CliRunner().invoke(cli, ["convert", str(ck), str(tmp_path / name)])
    assert r.exit_code == 0, r.output
    assert torch.equal(torch.load(tmp_path / name, weights_only=True)["w"], torch.arange(3.0))


def test_messages_name_the_url(run_url: str, tmp_path: Path) -> None:
    from trainguard.convert import convert
    from trainguard.export import export

    tg.save(f"{run_url}/step-000000003", {"model": {"w": torch.arange(3.0)}, "rng": tg.RNGState()})
    storage, root = for_path(run_url)
    for f in storage.fs.find(storage.join(root, "step-000000003")):  # a step copied by hand under another name
        storage.fs.pipe(f.replace("step-000000003", "step-000000005"), storage.fs.cat(f))
    with pytest.raises(CorruptCheckpointError, match="is named step 5 but holds the checkpoint of step 3") as e:
        tg.load(f"{run_url}/step-000000005", {"model": {"w": torch.zeros(3)}})
    assert str(e.value).startswith("memory://"), e.value
    src = f"{run_url}/step-000000003"
    for call in (lambda: export(src, tmp_path / "x.safetensors", entry="nope"),
                 lambda: convert(src, tmp_path / "x.pt", entry="nope"),
                 lambda: convert(src, tmp_path / "d", dst_format="dcp", entry="nope")):
        with pytest.raises(CheckpointError, match="has no entry 'nope'") as e:
            call()
        assert str(e.value).startswith("memory://"), e.value
    for call in (lambda: export(src, tmp_path / "r.pt", entry="rng"),
                 lambda: convert(src, tmp_path / "r.pt", entry="rng")):
        with pytest.raises(CheckpointError, match="is rank-local") as e:
            call()
        assert "of memory://" in str(e.value), e.value
