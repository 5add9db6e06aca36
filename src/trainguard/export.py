"""Export a checkpoint's model weights to standard formats: a safetensors file, or a file that
``torch.load(weights_only=True)`` reads. Offline, one process, no process group; tensors are
assembled from their chunks (whatever world size wrote them), read in parallel batches of 256 MiB.
Both formats are streamed (``stwrite``, ``ptwrite``): one batch in memory, not the entry.
"""

from __future__ import annotations

import collections
import contextlib
import os
import uuid
from collections.abc import Iterator
from typing import Any

import torch

from .commit import check_file_sizes, read_manifest
from .consolidate import whole_read
from .errors import CheckpointError, CorruptCheckpointError
from .flatten import single_tensor, unflatten
from .index import ChunkSource
from .io import ReadTarget, read_targets
from .manifest import Manifest, TensorEntry
from .storage import Storage, absolute, for_path, location
from .storage._urls import file_url_path, is_file_url


def iter_tensors(
    storage: Storage, directory: str, manifest: Manifest, prefix: str, *, verify: bool = True, share: bool = False
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, whole tensor)`` for every tensor under ``prefix/``, in batches of about ``BATCH`` bytes
    (names without the prefix; an entry that is one tensor keeps its name). Rank-local entries (``key@rank``) are not included.
    ``share``: the names of a tie (format 3 alias) yield one tensor object, read once, as
    ``torch.load`` gives them and ``torch.save`` stores them (once); else each name gets its own
    copy (safetensors refuses tensors that share memory)."""
    src = ChunkSource.of(storage, directory, manifest)
    read: dict[str, torch.Tensor] = {}  # share: the tensor holding the bytes' path -> its tensor
    mine = selected(manifest, prefix)
    # Sizes on disk first, as a load checks them: a manifest cannot make this allocate more
    # than the files it points at really hold.
    check_file_sizes(storage, directory, manifest, {f for _n, _p, e in mine for f in src.files(e)})
    # Read in batches of about BATCH bytes, each batch's tensors in parallel (one read_targets call),
    # then yielded in order: tensor by tensor, the reads of a 3 GB model took 2.9-4.8 s here.
    ready: list[tuple[str, torch.Tensor]] = []
    targets: list[ReadTarget] = []
    size = 0
    for name, path, e in mine:
        holder = e.alias or path  # an alias may come first in path order: its target's bytes are the same
        if share and holder in read:
            ready.append((name, read[holder]))  # read by now, or in this batch
            continue
        t = torch.empty(e.shape, dtype=e.torch_dtype)
        targets.append(whole_read(src, path, e, t, verify))
        if share:
            read[holder] = t
        ready.append((name, t))
        size += t.nbytes
        if size >= BATCH:
            read_targets(storage, directory, targets)
            yield from ready
            ready, targets, size = [], [], 0
    if targets:
        read_targets(storage, directory, targets)
    yield from ready


BATCH = 256 << 20  # iter_tensors: bytes read in parallel before they are yielded


def selected(manifest: Manifest, prefix: str) -> list[tuple[str, str, TensorEntry]]:
    """``(name, manifest path, entry)`` of every tensor under ``prefix/``, in path order: an entry
    that is one tensor is named after the entry, the others without the prefix."""
    head = prefix.rstrip("/") + "/"
    return [(path if path == prefix else path[len(head) :], path, e) for path, e in manifest.tensors.items()
            if path == prefix or path.startswith(head)]


def export(ckpt: str | os.PathLike[str], to: str | os.PathLike[str], *, entry: str = "model") -> int:
    """Write entry ``entry``'s tensors to ``to`` (``.safetensors`` or ``.pt``/``.pth``).
    Returns the number of tensors written. Called by ``trainguard export``; one process, no collective.
    A corrupt ``ckpt`` raises ``CorruptCheckpointError`` naming it and its earlier steps (``srcnamed``)."""
    from .srcnamed import naming_source

    with naming_source(ckpt):
        return _export(ckpt, to, entry)


def _export(ckpt: str | os.PathLike[str], to: str | os.PathLike[str], entry: str) -> int:
    storage, directory = for_path(ckpt)
    manifest = read_manifest(storage, directory)
    if entry not in manifest.objects:
        raise CheckpointError(
            f"{location(storage, directory)} has no entry {entry!r}; it has {sorted(manifest.objects)}. Pass --entry NAME"
        )
    out = local_file(to)
    mine = selected(manifest, entry)
    if not mine:
        raise CheckpointError(no_tensors(manifest, location(storage, directory), entry))
    check_destination(out)
    if os.path.isdir(out):
        raise CheckpointError(f"{out} is a directory; pass a file name ending in .safetensors or .pt")
    if not out.endswith((".safetensors", ".pt", ".pth", ".bin")):
        raise CheckpointError(f"{out}: unknown export format; use a .safetensors or .pt file name")
    safetensors = out.endswith(".safetensors")
    if safetensors:
        from .stwrite import refuse_names

        refuse_names((n for n, _p, _e in mine), out)
    write_file(storage, directory, manifest, entry, out, safetensors=safetensors)
    return len(mine)


def write_file(storage: Storage, directory: str, manifest: Manifest, entry: str, out: str, *, safetensors: bool) -> None:
    """Entry ``entry`` into the local file ``out`` (``.safetensors`` or, not ``safetensors``, a
    ``torch.save`` file), replaced whole (``replacing``). Called by ``export`` and by
    ``convert.convert`` once they checked the entry and the destination. Both are streamed, one batch
    of up to 256 MiB in memory (``stwrite``, ``ptwrite``; before session 51 a ``.pt`` file, and
    ``convert`` to either, held the entry); a dtype ``stwrite`` has no name for goes through
    ``save_file``, which holds the entry."""
    mine = selected(manifest, entry)
    meta, what = file_metadata(manifest), f"cannot write {out}"
    with replacing(out) as tmp:  # reading errors are raised as they are (the CLI says what to do about them)
        from . import stwrite  # streamed: one batch in memory (a dtype it has no name for: save_file)

        if safetensors and stwrite.write(storage, directory, manifest, mine, tmp, meta, what):
            return
        if not safetensors:  # streamed too: placeholders saved with skip_data, then the bytes written in place
            from . import ptwrite

            held, reads = ptwrite.placeholders(storage, directory, manifest, mine)
            if ptwrite.write(storage, directory, manifest, torch_value(held, location(storage, directory), manifest, entry),
                             reads, tmp, what):
                return
        tensors = dict(iter_tensors(storage, directory, manifest, entry, share=not safetensors))
        with foreign_errors(what):  # e.g. a dtype safetensors cannot store
            if safetensors:
                from safetensors.torch import save_file

                save_file(tensors, tmp, metadata=meta)
            else:
                torch.save(torch_value(tensors, location(storage, directory), manifest, entry), tmp)


def file_metadata(manifest: Manifest) -> dict[str, str]:
    """The metadata of a ``.safetensors`` file written from a trainguard checkpoint, by ``export`` and
    ``convert`` alike (before, convert's lacked ``step``): ``format`` (``pt``: what ``transformers``
    loads), ``source`` and the checkpoint's ``step``, as strings (safetensors keeps str values only)."""
    return {"format": "pt", "source": "trainguard", "step": str(manifest.step)}


def torch_value(tensors: dict[str, Any], directory: str, manifest: Manifest, entry: str) -> Any:
    """``export`` and ``convert`` to a ``.pt`` file: entry ``entry`` as ``torch.load`` should give it back,
    from its tensors by name (``iter_tensors``). An entry saved as a dict (a module's
    ``state_dict()``) is rebuilt from its skeleton, so that non-tensor values stay what they were:
    a module's extra state ``{"n": 3, "t": tensor}`` is ``"0._extra_state"`` again, which
    ``load_state_dict`` needs, not a tensor ``"0._extra_state/t"`` and nothing else. Other entries
    (one tensor, a list, a rank-local entry) stay their tensors by name. Module versions are added
    by :func:`with_versions`."""
    obj = manifest.objects[entry]
    skel = obj.get("skeleton") if isinstance(obj, dict) else None
    if type(skel) is not dict or single_tensor(skel) is not None:
        return with_versions(tensors, obj)
    value = unflatten(skel, own_tensor({f"{entry}/{k}": t for k, t in tensors.items()}, directory, entry),
                      where=f"{directory}: entry {entry[:60]!r}")
    return with_versions(value, obj) if isinstance(value, dict) else tensors


def own_tensor(tensors: dict[str, Any], d: str, entry: str) -> Any:
    """The lookup of a skeleton's tensor among the entry's own (``iter_tensors``, by manifest path): a
    reference to another entry's tensor, which no save writes and ``manifest.validate`` lets pass
    (the tensor exists), is a corrupt manifest, not the bare KeyError it was."""

    def get(path: str) -> Any:
        if path not in tensors:
            raise CorruptCheckpointError(
                f"{d}: entry {entry[:60]!r} refers to tensor {path[:80]!r}, which is not one of its own: the manifest "
                "is corrupt or hand-edited", file="manifest.json", entry=path)
        return tensors[path]

    return get


def with_versions(tensors: dict[str, Any], obj: Any) -> dict[str, Any]:
    """``export`` and ``convert`` to a ``.pt`` file, an entry's tensors by name: as an ``OrderedDict``
    with the ``_metadata`` a module's ``state_dict()`` has (each module's version, from the
    entry's recorded ``"versions"``, ``names.module_versions``), so that ``load_state_dict`` of
    the ``torch.load``ed file takes the values in the format they were saved in. ``tensors`` as
    they are for an entry that recorded none (not a module, or an older checkpoint)."""
    saved = obj.get("versions") if isinstance(obj, dict) else None
    if type(saved) is not dict or not all(type(k) is str and type(v) is int for k, v in saved.items()):
        return tensors
    prefixes = {""} | set(saved)
    for name in tensors:
        parts = name.split(".")[:-1]
        prefixes.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
    out = collections.OrderedDict(tensors)
    out._metadata = {p: {"version": saved.get(p, 1)} for p in sorted(prefixes)}  # type: ignore[attr-defined]
    return out


def no_tensors(manifest: Manifest, directory: str, entry: str) -> str:
    """The refusal of an export of an entry without tensors to write (``export``, ``convert``)."""
    if "ranks" in manifest.objects.get(entry, {}):  # rank-local: each rank's own (RNG, a per-rank iterator)
        return (f"entry {entry!r} of {directory} is rank-local (each rank saved its own, e.g. RNG state): its tensors "
                "are not exported; export a model's entry (--entry NAME)")
    return f"entry {entry!r} of {directory} holds no tensors to export"


@contextlib.contextmanager
def replacing(out: str) -> Iterator[str]:
    """A temporary file beside ``out`` to write into (``export``, ``convert`` to one file): once
    written it is fsynced and renamed over ``out``, so a reader finds the old file or the new one
    and a failed or interrupted write (a full disk, an unsupported dtype) leaves an earlier file
    at ``out`` as it was; on failure the temporary file is removed. One killed (SIGKILL) cannot remove it: the
    next ``replacing`` of ``out`` does, once its writer is dead (``outtemp``: the temporary file's owner file)."""
    from .outtemp import owned, sweep

    head, name = os.path.split(absolute(out))
    tmp = os.path.join(head, f".{name}.tmp-{uuid.uuid4().hex[:12]}")
    sweep(out)  # earlier writers of ``out`` killed mid-write (SIGKILL, OOM): their temporary files go
    with owned(tmp):  # until the temporary file is gone: a later writer can tell this one is alive
        try:
            yield tmp
            os.chmod(tmp, 0o666 & ~_umask())  # as any file the user creates: safetensors' save_file makes it 0600
            fd = os.open(tmp, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, out)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
    fd = os.open(head, os.O_RDONLY)
    try:
        os.fsync(fd)  # the rename itself durable
    finally:
        os.close(fd)


def _is_trainguard(manifest: str) -> bool:
    """Whether ``manifest`` is a trainguard manifest (its envelope's first bytes), not another tool's file."""
    with contextlib.suppress(OSError), open(manifest, "rb") as f:
        return f.read(13) == b'{"checksum":"'
    return False


def _umask() -> int:
    """The process's umask, read without setting it (``os.umask`` sets it: a race with other threads)."""
    with contextlib.suppress(OSError, ValueError, StopIteration), open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith("Umask:")).split()[1], 8)
    mask = os.umask(0o22)  # no /proc (not Linux, or before 4.7): set and restore at once
    os.umask(mask)
    return mask


def local_file(path: str | os.PathLike[str]) -> str:
    """``path``, or the local path of a ``file:`` URL (``file:///x/model.pt``), which ``inspect`` and
    ``consolidate`` take: ``export``/``convert`` refused it as an object store's URL (output) or
    found no such file (input). Another URL is left as it is (``check_destination`` refuses it)."""
    p = os.fsdecode(path)
    return file_url_path(p) if is_file_url(p) else p


def check_destination(out: str) -> None:
    """A file or directory is about to be written at ``out``: its parent must exist and be writable by
    this user (``export``, ``convert``; the libraries' own errors for it are tracebacks, or torch.save's
    "[enforce fail at inline_container.cc:747] ... Permission denied"), and not be a trainguard
    checkpoint (``data-00000.bin`` there was overwritten, exit 0). An object store's URL is
    refused as such: safetensors and torch.save write local files (its "s3:" was taken for a local
    directory, "the directory /cwd/s3:/bucket does not exist")."""
    if "://" in out:
        raise CheckpointError(f"{out}: a .safetensors/.pt/DCP output is written to a local path only; write it "
                              "there, then copy it to the object store (e.g. `aws s3 cp`)")
    parent = os.path.dirname(absolute(out))
    if not os.path.isdir(parent):
        raise CheckpointError(f"{out}: the directory {parent} does not exist; create it first")
    if not os.access(parent, os.W_OK | os.X_OK):  # torch.save's own words were "[enforce fail at inline_container.cc]"
        with contextlib.suppress(OSError):
            if os.statvfs(parent).f_flag & os.ST_RDONLY:  # not the user's rights: a read-only mount (root too)
                raise CheckpointError(f"{out}: {parent} is on a read-only file system; write the output to a "
                                      "directory on a writable one (or remount it read-write)")
        raise CheckpointError(f"{out}: this user may not write in {parent}; write the output to a directory you may "
                              "write to (or give this user write access to it)")
    if _is_trainguard(os.path.join(parent, "manifest.json")):  # its data-*.bin or manifest.json: overwritten
        raise CheckpointError(f"{out}: {parent} is a trainguard checkpoint; writing a file into it could replace "
                              "one of its own and destroy it. Write the output outside the checkpoint's directory")


@contextlib.contextmanager
def foreign_errors(what: str) -> Iterator[None]:
    """torch.save/torch.load/safetensors/DCP errors on a foreign file, as one CheckpointError
    (``export``, ``convert``: the CLI prints it as one ``error:`` line)."""
    try:
        yield
    except CheckpointError:
        raise
    except BaseException as e:
        if (ki := _interrupt(e)) is not None:  # a Ctrl-C/SIGTERM inside DCP or torch.save: the writer's own
            raise ki from None  # error on the way out ("unexpected pos 704 vs 598") is not the cause
        if isinstance(bad := _interrupt(e, kind=CorruptCheckpointError), CorruptCheckpointError):
            raise bad from None  # the source failed its checksum inside DCP's write: not "cannot write DST as dcp"
        if not isinstance(e, Exception) and type(e).__name__ != "CheckpointException":
            raise  # SystemExit, GeneratorExit
        raise _foreign_error(what, e) from e


def _interrupt(e: BaseException | None, depth: int = 0, kind: type[BaseException] = KeyboardInterrupt) -> Any:
    """The KeyboardInterrupt (Ctrl-C, or the commands' SIGTERM), or the exception of type ``kind``, that ``e``
    is or was raised while handling: in its ``__cause__``/``__context__`` chain, or in those of a DCP
    ``CheckpointException``'s failures (DCP turns every rank's exception, an interrupt too, into one). Before, a
    SIGTERM during ``convert --to dcp`` was "error: cannot write DST as dcp: RuntimeError: ... unexpected pos", exit 2."""
    while e is not None and depth < 50:
        if isinstance(e, kind):
            return e
        for f in (getattr(e, "failures", None) or {}).values() if type(e).__name__ == "CheckpointException" else ():
            if (ki := _interrupt(f[0] if isinstance(f, tuple) and f else f, depth + 1, kind)) is not None:
                return ki
        e, depth = e.__cause__ or e.__context__, depth + 1
    return None


def _foreign_error(what: str, e: BaseException) -> CheckpointError:
    """``foreign_errors``: ``e`` (an Exception, or DCP's CheckpointException) as one CheckpointError."""
    if isinstance(e, KeyError) and e.args and isinstance(e.args[0], torch.dtype):  # safetensors' dtype table
        return CheckpointError(f"{what}: safetensors has no type for {e.args[0]}; write a .pt file instead")
    if isinstance(e, Exception):
        return CheckpointError(f"{what}: {type(e).__name__}: {e}")
    return CheckpointError(f"{what}: {_dcp_cause(e)}")  # DCP's CheckpointException is a BaseException


def _dcp_cause(e: BaseException) -> str:
    """The first failing rank's own exception inside DCP's ``CheckpointException`` (whose text
    is tracebacks), as ``Type: message``."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        cause = next(iter(failures.values()))
        cause = cause[0] if isinstance(cause, tuple) and cause else cause  # (exception, stack summary)
        return f"{type(cause).__name__}: {cause}"
    return f"{type(e).__name__}: {e}"
