"""Object storage under network faults: a TCP proxy of the test's own on 127.0.0.1 between s3fs and
the SeaweedFS server (``tests/test_storage_s3.py``'s session fixture) cuts, stalls or answers chosen
requests: connections reset mid-upload or mid-download, a request that is never answered, an HTTP
500/503 in the server's place, a lost answer to a PUT the server did store.

The proxy passes one HTTP request per connection (it asks the server for ``Connection: close``),
so that each request can be matched (method and target) and given its fault.
"""

from __future__ import annotations

import re
import socket
import struct
import threading
import uuid
from collections.abc import Callable

import pytest
import torch

import trainguard as tg

s3fs = pytest.importorskip("s3fs")
from test_objstore19_review import _in_thread  # noqa: E402  (fn on a daemon thread, bounded: 120 s there too)
from test_storage_s3 import weed  # noqa: E402,F401  (the session's server; skips without `weed`)
from trainguard.commit import list_steps  # noqa: E402
from trainguard.storage import fsspec as tgfs  # noqa: E402

BOUND = 120  # a call still running after this long is hung (each test's faults end within a few store bounds)


# ---------------------------------------------------------------- the proxy

class Rule:
    """``action`` for the requests ``match(method, target)`` accepts, the first ``times`` of them (None: all)."""

    def __init__(self, match: Callable[[str, str], bool], action: str, times: int | None, arg: int) -> None:
        self.match, self.action, self.times, self.arg = match, action, times, arg
        self.hits = 0


def _rst(s: socket.socket) -> None:
    """Close ``s`` with a TCP RST (linger 0): the peer reads ECONNRESET, not a clean end. Shut for
    reading first: the other thread of the connection blocked in ``recv`` on it returns, else its
    syscall holds the socket open and nothing is sent at all (the peer waits)."""
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        s.shutdown(socket.SHUT_RD)
    except OSError:
        pass
    s.close()


class FaultProxy:
    """Forwards 127.0.0.1:<port> to the server's S3 port; ``add(match, action)`` gives a fault to the
    requests ``match`` accepts:

    - ``"status"``: answered ``arg`` (500, 503) with an S3 XML error, not forwarded;
    - ``"stall"``: its bytes are read and never answered (a hung load balancer);
    - ``"reset_upload"``: forwarded until ``arg`` bytes of its body went up, then both sides reset;
    - ``"reset_download"``: forwarded, ``arg`` bytes of the answer passed on, then the client is reset;
    - ``"lose_answer"``: forwarded whole (the server does it), the client reset when the answer comes.

    ``seen`` lists ``(method, target)`` of every request, in arrival order."""

    def __init__(self, upstream: int) -> None:
        self.upstream = upstream
        self.rules: list[Rule] = []
        self.seen: list[tuple[str, str]] = []
        self._lock = threading.Lock()
        self._socks: set[socket.socket] = set()
        self._stop = threading.Event()
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self._accept = threading.Thread(target=self._serve, name="netfault-proxy", daemon=True)
        self._accept.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def add(self, match: Callable[[str, str], bool], action: str, times: int | None = None, arg: int = 0) -> Rule:
        rule = Rule(match, action, times, arg)
        with self._lock:
            self.rules.append(rule)
        return rule

    def clear(self) -> None:
        with self._lock:
            self.rules.clear()

    def close(self) -> None:
        self._stop.set()
        try:
            self.server.shutdown(socket.SHUT_RDWR)  # wakes the thread blocked in accept()
        except OSError:
            pass
        self.server.close()
        with self._lock:
            socks, self._socks = list(self._socks), set()
        for s in socks:  # shut down first: wakes a thread blocked reading it (a stalled request)
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()
        self._accept.join(10)

    def _track(self, s: socket.socket) -> socket.socket:
        with self._lock:
            self._socks.add(s)
        return s

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self.server.accept()
            except OSError:
                return
            threading.Thread(target=self._handle, args=(self._track(client),), name="netfault-proxy",
                             daemon=True).start()

    def _rule_for(self, method: str, target: str) -> Rule | None:
        with self._lock:
            self.seen.append((method, target))
            for r in self.rules:
                if (r.times is None or r.hits < r.times) and r.match(method, target):
                    r.hits += 1
                    return r
        return None

    def _handle(self, client: socket.socket) -> None:
        try:
            head = b""
            while b"\r\n\r\n" not in head:
                got = client.recv(65536)
                if not got:
                    return client.close()
                head += got
            head, rest = head.split(b"\r\n\r\n", 1)
            lines = head.decode("latin-1").split("\r\n")
            method, target, _ = lines[0].split(" ", 2)
            rule = self._rule_for(method, target)
            action = rule.action if rule else "pass"
            if action == "status":
                return self._answer(client, rule.arg if rule else 500)
            if action == "stall":
                while not self._stop.is_set() and client.recv(65536):
                    pass  # read, never answered
                return client.close()
            kept = [ln for ln in lines[1:] if not ln.lower().startswith(("connection:", "keep-alive:"))]
            out = "\r\n".join([lines[0], *kept, "Connection: close"]).encode("latin-1") + b"\r\n\r\n"
            upstream = self._track(socket.create_connection(("127.0.0.1", self.upstream), timeout=30))
            upstream.settimeout(None)
            arg = rule.arg if rule else 0
            if action == "reset_upload":
                rest = rest[:arg]  # no more than arg bytes of its body reach the server
            upstream.sendall(out + rest)
            up = threading.Thread(target=self._up, args=(client, upstream, action, arg, len(rest)),
                                  name="netfault-proxy", daemon=True)
            up.start()
            self._down(client, upstream, action, arg)
            up.join(30)
        except Exception:  # a refused upstream, a peer gone; or a bug here: the client sees its connection end
            client.close()

    def _up(self, client: socket.socket, upstream: socket.socket, action: str, arg: int, sent: int) -> None:
        try:
            while True:
                if action == "reset_upload" and sent >= arg:
                    _rst(client)
                    _rst(upstream)
                    return
                got = client.recv(65536)
                if not got:
                    upstream.shutdown(socket.SHUT_WR)
                    return
                if action == "reset_upload":
                    got = got[: arg - sent]
                upstream.sendall(got)
                sent += len(got)
        except OSError:
            return

    def _down(self, client: socket.socket, upstream: socket.socket, action: str, arg: int) -> None:
        acc, passed = b"", 0
        try:
            while True:
                got = upstream.recv(65536)
                if not got:
                    client.sendall(acc)
                    client.close()
                    upstream.close()
                    return
                acc += got
                while re.match(rb"HTTP/1\.1 1\d\d ", acc) and b"\r\n\r\n" in acc:  # 100 Continue: passed on
                    interim, acc = acc.split(b"\r\n\r\n", 1)
                    client.sendall(interim + b"\r\n\r\n")
                if b"HTTP/1.1 1".startswith(acc[:10]):
                    continue  # maybe the start of an interim answer: wait for more
                if action in ("lose_answer", "reset_upload"):  # (reset_upload: the server answered early)
                    _rst(client)
                    upstream.close()
                    return
                if action == "reset_download" and passed + len(acc) >= arg:
                    client.sendall(acc[: max(0, arg - passed)])
                    _rst(client)
                    _rst(upstream)
                    return
                client.sendall(acc)
                passed += len(acc)
                acc = b""
        except OSError:
            client.close()
            upstream.close()

    @staticmethod
    def _answer(client: socket.socket, status: int) -> None:
        code = {500: "InternalError", 503: "ServiceUnavailable"}.get(status, "InternalError")
        body = (f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code><Message>injected by the '
                f"test's proxy</Message></Error>").encode()
        reason = {500: "Internal Server Error", 503: "Service Unavailable"}.get(status, "Error")
        client.sendall(f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/xml\r\nContent-Length: {len(body)}"
                       f"\r\nConnection: close\r\n\r\n".encode() + body)
        client.close()


@pytest.fixture
def proxy(weed, monkeypatch):  # noqa: F811
    p = FaultProxy(weed.ports["s3"])
    monkeypatch.setenv("AWS_ENDPOINT_URL", p.endpoint)
    monkeypatch.setenv("TRAINGUARD_STORE_TIMEOUT", "60")  # a loaded machine's uploads pass; hangs: short_bound()
    monkeypatch.setattr(s3fs.S3FileSystem, "retries", 2)  # s3fs's own tries of each call (5, with backoff)
    s3fs.S3FileSystem.clear_instance_cache()
    try:
        yield p
    finally:
        p.close()
        s3fs.S3FileSystem.clear_instance_cache()


def short_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    """From here on each store call of a storage built (a manager, a ``tg.save``) gives up after 3 s."""
    monkeypatch.setenv("TRAINGUARD_STORE_TIMEOUT", "3")


def _url() -> str:
    return f"s3://tgtest/{uuid.uuid4().hex[:10]}"


def _small(v: float) -> dict:
    return {"model": {"w": torch.full((1000,), float(v))}}




def _is_part(method: str, target: str) -> bool:
    return method == "PUT" and "partNumber=" in target


def _restores(url: str, step: int, v: float | None = None) -> None:
    dest = _small(0)
    with tg.CheckpointManager(url, handle_signals=False) as mgr:
        assert mgr.restore(dest) == step
    assert torch.equal(dest["model"]["w"], _small(step if v is None else v)["model"]["w"])


def _upload_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("trainguard-upload")]



# ---------------------------------------------------------------- uploads

def test_a_save_whose_part_uploads_hang_stops_at_the_first_part_that_times_out(proxy, monkeypatch):
    # The endpoint accepts each part upload and never answers. The first parts in flight time out
    # after TRAINGUARD_STORE_TIMEOUT, but the writer went on sending every later part of the file, and
    # each waited out the bound in its turn: a save of N parts took N/4 bounds (4 in flight), a 1 GB
    # rank file 8 x 600 s with the default, where docs/storage.md promises "a few times the bound".
    # The multipart upload was also aborted twice (two more bounds against a hung endpoint).
    monkeypatch.setattr(tgfs.FsspecStorage.__init__, "__kwdefaults__", {"part_size": 5 << 20})  # S3's smallest
    url = _url()
    tg.save(f"{url}/step-000000001", _small(1))
    short_bound(monkeypatch)
    with tg.CheckpointManager(url, save=tg.EveryNSteps(1), keep=tg.KeepLatest(2), handle_signals=False) as mgr:
        proxy.add(_is_part, "stall")
        big = {"model": {"w": torch.arange(15 << 20, dtype=torch.float32)}}  # 60 MB: 12 parts of 5 MiB
        done, got = _in_thread(mgr.save, 2, big)
        assert done, f"save(2) with hung part uploads still running after {BOUND} s"
        assert isinstance(got, tg.CheckpointError) and "TRAINGUARD_STORE_TIMEOUT" in str(got), repr(got)
        parts = {t.split("partNumber=")[1] for m, t in proxy.seen if _is_part(m, t)}
        assert len(parts) <= tgfs.UPLOAD_THREADS, f"parts sent after the first had failed: {sorted(parts, key=int)}"
        aborts = [t for m, t in proxy.seen if m == "DELETE" and "uploadId=" in t]
        assert len(aborts) == 1, aborts
        assert not _upload_threads()
        proxy.clear()
        assert [s.step for s in list_steps(mgr.storage, mgr._root)] == [1]  # step 2 removed, step 1 kept
    _restores(url, 1)



def test_a_multipart_upload_that_cannot_be_created_is_asked_for_once(proxy, monkeypatch):
    # The endpoint hangs from the request that creates the multipart upload of step 2's data on. The
    # first part's thread waited out the bound holding the upload's lock; each of the other 3 parts'
    # threads then took the lock and asked again, one after another: 4 bounds before the save failed.
    monkeypatch.setattr(tgfs.FsspecStorage.__init__, "__kwdefaults__", {"part_size": 5 << 20})
    url = _url()
    tg.save(f"{url}/step-000000001", _small(1))
    short_bound(monkeypatch)
    at = _hang_from(proxy, lambda m, t: m == "POST" and t.endswith("/step-000000002/data-00000.bin?uploads"))
    big = {"model": {"w": torch.arange(6 << 20, dtype=torch.float32)}}  # 24 MB: 5 parts
    done, got = _in_thread(tg.save, f"{url}/step-000000002", big)
    assert done, f"the save still running after {BOUND} s"
    assert isinstance(got, tg.CheckpointError) and "create_multipart_upload" in str(got), repr(got)
    creates = [t for m, t in proxy.seen[at[0]:] if m == "POST" and t.endswith("?uploads")]
    assert len(creates) == 1, creates
    assert not _upload_threads()
    proxy.clear()
    _restores(url, 1)


# ---------------------------------------------------------------- reads

def _hang_from(proxy: FaultProxy, first: Callable[[str, str], bool]) -> list[int]:
    """From the first request ``first`` accepts on, every request hangs (the endpoint froze then);
    returns a list that holds the index of that request in ``proxy.seen`` once it came."""
    at: list[int] = []

    def match(method: str, target: str) -> bool:
        if not at and first(method, target):
            at.append(len(proxy.seen) - 1)
        return bool(at)

    proxy.add(match, "stall")
    return at


@pytest.mark.parametrize("name", ["manifest.json", "data-00000.bin"])
def test_a_read_that_times_out_fails_with_that_call_not_a_second_wait_for_its_size(proxy, monkeypatch, name):
    # The endpoint hangs from a load's GET of the manifest (or of the data) on. That GET timed out
    # after TRAINGUARD_STORE_TIMEOUT, and the reader then asked the hung endpoint for the object's
    # size (its check for S3's 416 of an empty or truncated object): a second wait of the bound, and
    # the error raised named size(), not the read that hung.
    url = _url()
    tg.save(f"{url}/step-000000001", _small(1))
    short_bound(monkeypatch)
    at = _hang_from(proxy, lambda m, t: m == "GET" and t.endswith(f"/step-000000001/{name}"))
    with pytest.raises(tg.CheckpointError, match=r"did not answer cat_file\(.*TRAINGUARD_STORE_TIMEOUT") as e:
        done, got = _in_thread(tg.load, f"{url}/step-000000001", _small(0))
        assert done, f"tg.load against a hung endpoint still running after {BOUND} s"
        raise got
    assert at and proxy.seen[at[0] + 1 :] == [], f"asked of the hung endpoint after the read timed out: {proxy.seen[at[0]:]}"
    assert "an older checkpoint is not tried" in str(e.value)  # an endpoint's fault, not a corrupt checkpoint


@pytest.mark.parametrize("fault", ["reset_download", "status"])
def test_latest_step_whose_listing_fails_raises_a_checkpoint_error(proxy, fault):
    # A connection reset while listing the run directory: mgr.latest_step() (docs/checkpoints.md calls it
    # in the training loop) raised botocore's bare EndpointConnectionError, and a 503 the client's OSError,
    # where the manager's open, save and restore raise a CheckpointError saying what failed.
    url = _url()
    with tg.CheckpointManager(url, save=tg.EveryNSteps(1), keep=tg.KeepAll(), handle_signals=False) as mgr:
        mgr.save(1, _small(1))
        proxy.add(lambda m, t: m == "GET" and "list-type=2" in t, fault, arg=503 if fault == "status" else 0)
        with pytest.raises(tg.CheckpointError, match=rf"latest_step: cannot list {url}: ") as e:
            mgr.latest_step()
        if fault == "reset_download":
            assert "the object store cannot be used (EndpointConnectionError" in str(e.value)
        proxy.clear()
        assert mgr.latest_step() == 1


def test_restore_whose_listing_fails_says_what_to_check(proxy):
    # The same reset while restore lists the run directory: "restore: cannot list URL:
    # EndpointConnectionError: ..." without the hint tg.save and latest_step give.
    url = _url()
    with tg.CheckpointManager(url, save=tg.EveryNSteps(1), keep=tg.KeepAll(), handle_signals=False) as mgr:
        mgr.save(1, _small(1))
    with tg.CheckpointManager(url, save=tg.EveryNSteps(1), keep=tg.KeepAll(), handle_signals=False) as mgr:
        proxy.add(lambda m, t: m == "GET" and "list-type=2" in t, "reset_download", arg=0)
        with pytest.raises(tg.CheckpointError, match=rf"restore: cannot list {url}: ") as e:
            mgr.restore(_small(0))
        assert "the object store cannot be used (EndpointConnectionError" in str(e.value)
        proxy.clear()
        assert mgr.restore(_small(0)) == 1


# ---------------------------------------------------------------- saves that fail part-way

@pytest.mark.parametrize("async_save", [False, True])
def test_a_connection_reset_mid_upload_fails_the_save_saying_what_to_check(proxy, async_save):
    # Every upload of step 2's data is reset part-way (the client's retries included). The save
    # failed with "save of ... failed: EndpointConnectionError: Could not connect to the endpoint
    # URL", where docs/storage.md promises tg.save's "the object store cannot be used (...): check its
    # endpoint ... and credentials" (given when the save's first listing fails). Step 1 stays the
    # newest, the next save commits, and no upload thread is left.
    url = _url()
    with tg.CheckpointManager(url, save=tg.EveryNSteps(1), keep=tg.KeepLatest(2), handle_signals=False,
                              async_save=async_save) as mgr:
        mgr.save(1, _small(1))
        mgr.wait()
        proxy.add(lambda m, t: m == "PUT" and "/step-000000002/data-" in t, "reset_upload", arg=1000)
        with pytest.raises(tg.CheckpointError, match=r"save of .*step-000000002 failed: the object store cannot be "
                           r"used \(EndpointConnectionError.*check its endpoint"):
            mgr.save(2, _small(2))
            mgr.wait()
        proxy.clear()
        assert mgr.latest_step() == 1
        mgr.save(3, _small(3))
        mgr.wait()
        assert [s.step for s in list_steps(mgr.storage, mgr._root)] == [1, 3]
    assert not _upload_threads()
    _restores(url, 3)


def _manifest_put(method: str, target: str) -> bool:
    return method == "PUT" and target.endswith("/step-000000002/manifest.json")


@pytest.mark.parametrize("fault", ["status", "lose_answer"])
def test_a_save_whose_commit_marker_put_fails_leaves_the_previous_checkpoint_newest(proxy, fault):
    # The last PUT of a save, its manifest (the commit marker), answered 500 every time, or stored by
    # the server every time while its answer is lost (the client sees a reset). The save fails; what
    # the server did store is removed, so step 2 is not a checkpoint; step 1 restores; step 3 commits.
    url = _url()
    with tg.CheckpointManager(url, save=tg.EveryNSteps(1), keep=tg.KeepLatest(2), handle_signals=False) as mgr:
        mgr.save(1, _small(1))
        proxy.add(_manifest_put, fault, arg=500)
        with pytest.raises(tg.CheckpointError, match=r"save of .*step-000000002 failed") as e:
            mgr.save(2, _small(2))
        assert "TRAINGUARD_STORE_TIMEOUT" not in str(e.value)  # the fault itself, not a wait for an answer
        assert sum(_manifest_put(m, t) for m, t in proxy.seen) >= 2  # the client's retries went through the proxy
        proxy.clear()
        assert [s.step for s in list_steps(mgr.storage, mgr._root)] == [1]
        mgr.save(3, _small(3))
    _restores(url, 3)
    dest = _small(0)
    tg.load(f"{url}/step-000000001", dest)
    assert torch.equal(dest["model"]["w"], _small(1)["model"]["w"])


@pytest.mark.parametrize("fault", ["status", "reset_download"])
def test_a_restore_whose_reads_fail_raises_instead_of_rolling_back(proxy, fault):
    # The newest checkpoint's data GETs fail (a 500; a connection reset after 100 bytes of the answer,
    # retries included): restore raises, it does not take the endpoint's fault for a corrupt checkpoint
    # and resume from step 1 (whose first save would then delete step 2). With the fault gone, step 2.
    url = _url()
    with tg.CheckpointManager(url, save=tg.EveryNSteps(1), keep=tg.KeepAll(), handle_signals=False) as mgr:
        mgr.save(1, _small(1))
        mgr.save(2, _small(2))
    proxy.add(lambda m, t: m == "GET" and "/step-000000002/data-" in t, fault, arg=500 if fault == "status" else 100)
    dest = _small(0)
    with tg.CheckpointManager(url, handle_signals=False) as mgr:
        with pytest.raises(tg.CheckpointError, match=r"cannot read the checkpoint .*step-000000002.*an older "
                           r"checkpoint is not tried"):
            mgr.restore(dest)
    proxy.clear()
    _restores(url, 2)


def test_retention_whose_listing_fails_deletes_nothing_and_catches_up(proxy):
    # Once step 3 is committed, every listing answers 503: retention fails (a warning), deletes nothing,
    # and the save stands; with the store answering again the next save's retention removes the old steps.
    url = _url()
    with tg.CheckpointManager(url, save=tg.EveryNSteps(1), keep=tg.KeepLatest(2), handle_signals=False) as mgr:
        mgr.save(1, _small(1))
        mgr.save(2, _small(2))
        committed: list = []

        def listing_after_commit(method: str, target: str) -> bool:
            if method == "PUT" and target.endswith("/step-000000003/manifest.json"):
                committed.append(1)
            return bool(committed) and method == "GET" and "list-type=2" in target

        proxy.add(listing_after_commit, "status", arg=503)
        with pytest.warns(UserWarning, match=r"retention after step 3 failed; old checkpoints were kept"):
            mgr.save(3, _small(3))
        proxy.clear()
        assert [s.step for s in list_steps(mgr.storage, mgr._root)] == [1, 2, 3]
        mgr.save(4, _small(4))
        assert [s.step for s in list_steps(mgr.storage, mgr._root)] == [3, 4]
    _restores(url, 4)


def test_an_async_save_whose_server_is_killed_mid_upload_fails_and_the_restarted_server_takes_the_next(proxy, weed, monkeypatch):  # noqa: F811
    # The server is SIGKILLed while an async save's parts go up (at the request for part 3); the save
    # reports a CheckpointError; once the server is back the next save commits; restore gives it, and
    # step 1 is still there. No upload thread is left.
    monkeypatch.setattr(tgfs.FsspecStorage.__init__, "__kwdefaults__", {"part_size": 5 << 20})
    url = _url()
    killed: list = []

    def kill_at_part_3(method: str, target: str) -> bool:
        if _is_part(method, target) and "partNumber=3" in target and not killed:
            killed.append(1)
            weed.kill()
        return False

    try:
        with tg.CheckpointManager(url, save=tg.EveryNSteps(1), keep=tg.KeepLatest(2), handle_signals=False,
                                  async_save=True) as mgr:
            mgr.save(1, _small(1))
            mgr.wait()
            proxy.add(kill_at_part_3, "pass")
            mgr.save(2, {"model": {"w": torch.arange(6 << 20, dtype=torch.float32)}})  # 24 MB: 5 parts
            with pytest.raises(tg.CheckpointError, match=r"save of .*step-000000002 failed: the object store cannot be used"):
                mgr.wait()
            assert killed and not _upload_threads()
            weed.start()
            s3fs.S3FileSystem.clear_instance_cache()
            mgr.save(3, _small(3))
            mgr.wait()
    finally:
        if weed.proc is None:  # the session's server is back for the tests after this one
            weed.start()
    _restores(url, 3)
    with tg.CheckpointManager(url, handle_signals=False) as mgr:
        assert [s.step for s in list_steps(mgr.storage, mgr._root)] == [1, 3]
