"""The error hierarchy. Every error a user can cause derives from :class:`CheckpointError`.

Messages say what to change. Where a builtin fits, the error derives from it too, so
``except FileNotFoundError`` keeps working for callers that do not know trainguard.
"""

from __future__ import annotations

import errno as _errno
import operator
import re
from typing import Any

from .errlines import described, rank_lines, with_traceback


class CheckpointError(Exception):
    """Base of every trainguard error. ``permanent``: no restart fixes it (``permanent.py``;
    such a worker exits 78 under ``trainguard run``)."""

    permanent: bool = False


class SettingError(ValueError):
    """An environment setting trainguard reads is malformed (``TRAINGUARD_STORE_TIMEOUT=abc``): a
    ``ValueError`` in Python; the CLI (``cli._Group.invoke``) prints it as one ``error:`` line, exit 2."""


class NotACheckpointError(CheckpointError, FileNotFoundError):
    """The path holds no committed checkpoint (no ``manifest.json``)."""


class FormatVersionError(CheckpointError):
    """The manifest was written by a format this version cannot read."""

    permanent = True


class CorruptCheckpointError(CheckpointError):
    """Bytes on disk do not match what the manifest promises (checksum, size, structure)."""

    def __init__(self, message: str, *, file: str | None = None, entry: str | None = None) -> None:
        super().__init__(message)
        self.file = file
        self.entry = entry


class StateMismatchError(CheckpointError, KeyError):
    """A strict load found missing, unexpected or shape/dtype-mismatched entries."""

    permanent = True

    def __init__(
        self,
        *,
        missing: list[str],
        unexpected: list[str],
        mismatched: list[str],
        split: str | None = None,  # rankload.split_hint's, in place of the pipeline-stages sentence
    ) -> None:
        self.missing = missing
        self.unexpected = unexpected
        self.mismatched = mismatched
        parts = []
        if missing:
            parts.append(f"missing from the checkpoint ({len(missing)}): {_short(missing)}")
        if unexpected:
            parts.append(f"in the checkpoint but not in the state ({len(unexpected)}): {_short(unexpected)}")
        if mismatched:
            parts.append(f"shape/dtype differ ({len(mismatched)}): {_short(mismatched)}")
        msg = "state does not match the checkpoint: " + "; ".join(parts)
        msg += ". Pass strict=False to load what matches, or tg.load(..., only=[...]) to load a subset."
        if unexpected and not missing and not mismatched:
            msg += " Ranks that each hold part of the model (pipeline stages) load with split_state=True." if split is None else split
        from .prefixhint import entry_hint, prefix_hint, wrap_hints  # wrapped or renamed since the save

        super().__init__(msg + _changed_config_hint(missing, unexpected, mismatched) + _wrapped_weight_hint(missing, unexpected)
                         + prefix_hint(missing, unexpected) + wrap_hints(missing, unexpected) + entry_hint(missing, unexpected))

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0])


_DTYPE_ONLY = re.compile(r"\(checkpoint (\w+)(\[[\d, ]*\]), state (\w+)(\[[\d, ]*\])\)$")


def _changed_config_hint(missing: list[str], unexpected: list[str], mismatched: list[str]) -> str:
    """``StateMismatchError``: what ``strict=False`` does with the differences a configuration
    changed between runs leaves (docs/checkpoints.md, "Changing the configuration between runs"):
    tensors of another dtype only (a model built in bf16, saved in fp32) are cast, not left as
    they are, as "load what matches" reads; whole entries (no ``/`` in the name: an LR scheduler
    or a GradScaler added or removed since the save) start fresh or are not read. "" otherwise."""
    out = ""
    cast = [m for m in mismatched if (d := _DTYPE_ONLY.search(m)) and d[1] != d[3] and d[2] == d[4]]
    if cast:
        out += (f" {len(cast)} of the tensors differ in dtype only (the model built in another dtype than at save "
                "time?): strict=False reads them and casts them into the state's dtype.")
    if added := [k for k in missing if "/" not in k]:
        out += (f" Entries the checkpoint lacks ({_short(added)}: added since the save?) keep their fresh state with "
                "strict=False.")
    if gone := [k for k in unexpected if "/" not in k]:
        out += f" Entries the state no longer holds ({_short(gone)}) are not read with strict=False."
    return out


def _wrapped_weight_hint(missing: list[str], unexpected: list[str]) -> str:
    """``StateMismatchError``: what to do when a tensor is missing under its plain name and present
    under the names that ``torch.nn.utils.prune`` (``weight_orig``, ``weight_mask``) or
    ``torch.nn.utils.parametrize`` (``parametrizations.weight.original``) give it, on one side only."""
    word = "parametrizations."

    def kinds(plain: list[str], other: list[str]) -> list[str]:
        names = set(other)  # a set: both lists may hold thousands of paths
        par = {o[:i] + o[i + len(word) :].split(".")[0] for o in other if (i := o.find(word)) >= 0}
        out = []
        for p in plain:
            if f"{p}_orig" in names and f"{p}_mask" in names:
                out.append(f"prune:{p}")
            elif p in par:
                out.append(f"parametrize:{p}")
        return out

    saved, held = kinds(missing, unexpected), kinds(unexpected, missing)
    hints = []
    if any(k.startswith("prune:") for k in saved):
        hints.append(
            "the checkpoint's module was pruned (torch.nn.utils.prune: <name>_orig and <name>_mask) and the state's is "
            "not: prune it the same way before the load (prune.identity(module, 'weight') makes the two tensors the "
            "load fills, mask included), or call prune.remove() before saving"
        )
    if any(k.startswith("prune:") for k in held):
        hints.append("the state's module is pruned (torch.nn.utils.prune) and the checkpoint's was not: load, then prune")
    if any(k.startswith("parametrize:") for k in saved):
        hints.append(
            "the checkpoint's module has a parametrization (torch.nn.utils.parametrize: parametrizations.<name>.original) "
            "and the state's has not: register the same one (orthogonal, weight_norm, spectral_norm...) before the load"
        )
    if any(k.startswith("parametrize:") for k in held):
        hints.append("the state's module has a parametrization that the checkpoint's had not: load, then register it")
    return (" " + "; ".join(hints) + " (" + ", ".join(k.split(":", 1)[1] for k in [*saved, *held][:4]) + ").") if hints else ""


class UnsupportedValueError(CheckpointError, TypeError):
    """A leaf is neither a tensor nor a JSON value (raised at save time, naming its path)."""

    permanent = True


class StepExistsError(CheckpointError, FileExistsError):
    """A checkpoint for this step is already committed."""


class LockedError(CheckpointError):
    """Another live job holds the run directory's lock."""


class RankFailureError(CheckpointError):
    """Ranks failed in a collective save/load: its text gives each failing rank's error, without the traceback that
    ``failures`` keeps (an object store's put asyncio and aiobotocore frames before the readable cause)."""

    def __init__(self, message: str, failures: dict[int, str]) -> None:
        self.failures = dict(failures)
        detail = rank_lines(self.failures)  # bounded: ranks that failed alike once, a long error cut in its middle
        super().__init__(f"{message}\n{detail}" if detail else message)


def failure(message: str, failures: dict[int, str]) -> RankFailureError:
    """A ``RankFailureError`` that remembers its one-line ``message`` (see :func:`summary`), so it
    can be sent to the other ranks and raised there identically."""
    e = RankFailureError(message, failures)
    e.summary = message  # type: ignore[attr-defined]
    return e


def summary(e: BaseException) -> str:
    """The message of a ``RankFailureError`` without the per-rank tracebacks appended to it."""
    return str(getattr(e, "summary", e))


def failure_record(e: RankFailureError) -> dict[str, Any]:
    """``e`` as the JSON-able record ranks exchange through the store (:func:`from_record` raises it again)."""
    return {"error": summary(e), "failures": e.failures, **({"permanent": True} if e.permanent else {})}


def from_record(record: dict[str, Any]) -> RankFailureError:
    """The ``RankFailureError`` of a :func:`failure_record` received from another rank (JSON keys are strings)."""
    e = failure(record["error"], {int(r): tb for r, tb in record["failures"].items()})
    e.permanent = bool(record.get("permanent"))  # a rank's error no restart fixes (distwait._check_left): every rank's
    return e


class DiskFullError(CheckpointError, OSError):
    """The storage ran out of space while saving."""


def _short(items: list[str], n: int = 8) -> str:
    head = ", ".join(items[:n])
    return head + (f", ... (+{len(items) - n} more)" if len(items) > n else "")


def is_data_error(e: BaseException) -> bool:
    """Whether ``e`` (raised by a load) says the checkpoint's bytes are unusable, so that
    ``CheckpointManager.restore`` tries an older one, rather than that the state does not fit
    it (an older one would not fit either: raised). A distributed load sets ``retry_older``
    on every rank from every rank's verdict, so that all ranks decide alike."""
    flag = getattr(e, "retry_older", None)
    if flag is not None:
        return bool(flag)
    return isinstance(e, (CorruptCheckpointError, NotACheckpointError, FormatVersionError))


# The errno of a failing medium or a file system that found corruption (EIO; EUCLEAN, ext4's and
# XFS's EFSCORRUPTED; EBADMSG, their EFSBADCRC): the checkpoint's bytes are not to be had.
MEDIA_ERRNOS = frozenset({_errno.EIO, _errno.EUCLEAN, _errno.EBADMSG})


def is_media_error(e: BaseException) -> bool:
    """Whether ``e`` is a medium's read error (:data:`MEDIA_ERRNOS`): what is wrong with the
    checkpoint (``unreadable``, verify, ls). Not an object store's: its client gives EIO to every
    HTTP error it has no errno for (s3fs: a proxy's 502/504, a 429, MinIO's SlowDownRead), mostly
    passing; ``FsspecStorage`` marks its errors ``remote`` (a fallback on them rolled the run back)."""
    return isinstance(e, OSError) and e.errno in MEDIA_ERRNOS and not getattr(e, "remote", False)


# Packages whose exceptions (not OSErrors) say an object store could not be used: botocore's
# EndpointConnectionError, NoCredentialsError, ...; their tracebacks say nothing more to an operator.
STORE_CLIENTS = frozenset({"botocore", "aiobotocore", "s3fs", "gcsfs", "google", "aiohttp", "azure", "adlfs"})


def is_store_client_error(e: BaseException) -> bool:
    """Whether ``e`` comes from an object store's client library (:data:`STORE_CLIENTS`): the CLI's one
    ``error:`` line (``cli._Group``), and ``permanent.open_error`` (a manager's ``open`` on rank 0)."""
    return type(e).__module__.split(".")[0] in STORE_CLIENTS


def store_unusable(e: BaseException) -> str:
    """What an object store client's error ``e`` (:func:`is_store_client_error`) tells an
    operator: ``permanent.open_error``, :func:`unreadable` (loads) and ``api.save``'s failure."""
    return (f"the object store cannot be used ({type(e).__name__}: {e}): check its endpoint (e.g. AWS_ENDPOINT_URL) "
            "and credentials, then start again (docs/storage.md)")


def store_refused(e: BaseException) -> str:
    """What an object store's 403 (a ``PermissionError`` marked ``remote`` by ``FsspecStorage``) tells an operator."""
    return (f"the object store refused access ({e}): check the credentials (AWS_ACCESS_KEY_ID and "
            "AWS_SECRET_ACCESS_KEY, AWS_PROFILE, an expired session token) and that they may list, read, write and "
            "delete objects under this prefix, then start again (docs/storage.md)")


def error_text(e: BaseException) -> str:
    """``e`` for a message: :func:`store_unusable` for an object store client's error, :func:`store_refused`
    for its 403, else its type and text."""
    if isinstance(e, PermissionError) and getattr(e, "remote", False):
        return store_refused(e)
    if is_store_client_error(e):
        return store_unusable(e)
    if (answer := http_answer(e)) is not None:  # s3fs's OSError for a 500: "[Errno 121] We encountered an internal error"
        # strerror: an OSError's text without its errno; another error (raised from the store's) has none
        return f"{type(e).__name__}: the object store answered {answer}: {getattr(e, 'strerror', None) or e}"
    return f"{type(e).__name__}: {e}"


def http_answer(e: BaseException) -> str | None:
    """``"HTTP 500 (InternalError)"`` for an error an object store's answer caused (s3fs turns a
    botocore ``ClientError`` into an ``OSError`` whose errno tells little: 121 ``EREMOTEIO`` for a
    500, ``EBUSY`` for a 503), found on ``e`` or its causes; None for any other error."""
    for _ in range(5):
        response = getattr(e, "response", None)
        if isinstance(response, dict) and (status := response.get("ResponseMetadata", {}).get("HTTPStatusCode")):
            code = response.get("Error", {}).get("Code")
            return f"HTTP {status}" + (f" ({code})" if code and str(code) != str(status) else "")
        if e.__cause__ is None:
            return None
        e = e.__cause__
    return None


def unreadable(e: Exception, target: str) -> Exception:
    """``loader.load``'s error ``e`` on every rank: an ``OSError`` reading the checkpoint at ``target``.

    A medium's error (:data:`MEDIA_ERRNOS`) becomes a ``CorruptCheckpointError``: ``restore``
    tries an older checkpoint, as for bad bytes (before, it raised the bare OSError at every
    restart). Any other (EACCES, EMFILE, ESTALE, ENOMEM: the process or its setup, likely gone
    at the next try) a ``CheckpointError`` naming the checkpoint that ``restore`` raises: falling
    back would make this run's first save remove the newer, good checkpoints. An object store
    client's error (not an OSError) a ``CheckpointError`` saying what to check. Anything else as it is."""
    if is_store_client_error(e):  # botocore's EndpointConnectionError, NoCredentialsError: not OSErrors
        err = CheckpointError(f"cannot read the checkpoint {target}: {store_unusable(e)}; an older checkpoint is not "
                              "tried for this error")
        err.__cause__ = e
        return err
    if not isinstance(e, OSError) or isinstance(e, CheckpointError):
        return e
    media = is_media_error(e)
    err = (CorruptCheckpointError if media else CheckpointError)(
        f"cannot read the checkpoint {target}: {error_text(e)}. "
        + ("The storage failed reading it; `trainguard verify` says whether it can be read now" if media
           else "The memory read into cannot be written: a tensor of the state on read-only memory (torch.from_numpy "
           "of np.memmap(mode='r'), a read-only mmap); give it a writable tensor" if e.errno == _errno.EFAULT
           else "Fix the cause and start again; an older checkpoint is not tried for this error")
    )
    err.__cause__ = e
    return err


def whole(value: Any) -> Any:
    """A policy's count (``EveryNSteps(n)``, ``KeepLatest(n)``, ``DalyInterval(min_steps=...)``, policies.py,
    daly.py) as a plain ``int`` when it is an integer of any kind (numpy, a 0-d tensor, as a step may be:
    :func:`nonneg_int`), else ``value`` as given (a bool too), for the caller to refuse, saying why."""
    if isinstance(value, bool):
        return value
    try:
        return operator.index(value)
    except TypeError:
        return value


def nonneg_int(value: object, hint: str) -> int:
    """``value`` as an int >= 0 (Python, numpy and 0-d tensor ints; not bools): a TypeError for
    anything else, a ValueError for a negative one, each followed by ``hint``."""
    try:
        n = None if isinstance(value, bool) else operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        n = None
    if n is None or n < 0:
        raise (TypeError if n is None else ValueError)(hint)
    return n


def describe_error(e: BaseException) -> str:
    """One rank's error as text for the others: the message for our errors, else its ``error_text`` then traceback;
    one whose ``str()`` raises by its type (that raise left the exchange: "rank(s) [1] left this trainguard call")."""
    return described(e, lambda: f"{type(e).__name__}: {e}" if isinstance(e, CheckpointError) else with_traceback(error_text(e), e))


def raise_failures(what: str, outcomes: list[Any], ctx: Any) -> None:
    """Raise on every rank when any outcome carries an error (called after an exchange; ``ctx``
    the ``DistContext`` it went through); permanent when an outcome says ``permanent``."""
    failures = {r: o["error"] for r, o in enumerate(outcomes) if o.get("error")}
    if not failures:
        return
    if not ctx.is_distributed and len(failures) == 1:
        err: CheckpointError = CheckpointError(f"{what} failed:\n{failures[0]}")
    else:
        err = failure(f"{what} failed on rank(s) {sorted(failures)}", failures)
    err.permanent = any(o.get("permanent") for o in outcomes)  # a rank's error no restart fixes: every rank's
    raise err


def agree_load(ctx: Any, tag: str, target: str, e: Exception | None, timeout: float | None,
               split: bool | None = None, which: list[Any] | None = None, only: Any = False,
               touched: list[str] | None = None) -> None:
    """A round of ``loader.load`` (every rank, same order; ``e``: this rank's failure, if any):
    raise on every rank when any failed, its own error on a failing rank. ``retry_older``: every
    failing rank found bad bytes (``restore`` then tries an older checkpoint, not after a state
    that does not fit). ``split``: this rank's ``split_state`` (the "load" round): ranks that
    passed different ones all raise the same error naming it (``split.load_flags_differ``).
    ``which`` (the "load" round): ``[step, created]`` of the manifest this rank read: ranks that
    read different checkpoints (another path, or ``restore(step=)``, on one rank) all raise.
    ``only`` (the "load" round): this rank's ``only=``, sorted (None: every entry of its state, also
    when it lists them all): ranks that
    passed different ones all raise (with FSDP2, one rank's optimizer left unloaded trained on
    silently with the others' loaded). ``touched`` (the "loaded" round): the entries this rank wrote
    into; their union over the ranks goes on the error raised, ``gathered_touched`` (partread.py)."""
    from .permanent import from_medium, is_permanent, keeps_own
    from .split import load_flags_differ

    outcome = {"error": None if e is None else describe_error(e), "data": e is None or is_data_error(e),
               "permanent": is_permanent(e), "medium": from_medium(e), "split": split, "which": which,
               **({} if only is False else {"only": only}), **({} if touched is None else {"touched": touched})}
    with keeps_own(e):  # the exchange failed (rank 0 exited 78 first, its store with it): e stays its error
        outcomes = ctx.all_gather(tag, outcome, timeout=timeout)
    if split is not None and (differ := load_flags_differ([bool(o.get("split")) for o in outcomes])):
        raise differ from e  # before any rank's own error: a stage loaded without the flag fails for want of it
    if len(read := {r: o["which"] for r, o in enumerate(outcomes) if o.get("which") is not None}) > 1 and len(
            {tuple(w) for w in read.values()}) > 1:
        raise CheckpointError(
            f"load of {target}: the ranks read different checkpoints ("
            + ", ".join(f"rank {r}: step {w[0]} saved at {w[1]}" for r, w in sorted(read.items())[:8])
            + "); nothing was read into the state. Every rank must load the same one: pass the same path to "
            "tg.load, and the same step= (or none) to CheckpointManager.restore") from e
    if only is not False and not split and len({repr(o.get("only", only)) for o in outcomes}) > 1:
        raise CheckpointError(
            f"load of {target}: the ranks passed different only= ("
            + ", ".join(f"rank {r}: {'every entry' if o.get('only') is None else o['only']}"
                        for r, o in enumerate(outcomes[:8]))
            + "); nothing was read into the state. Pass the same only= (or none) on every rank") from e
    try:
        if e is not None:
            raise e from e.__cause__
        raise_failures(f"load of {target}", outcomes, ctx)
    except CheckpointError as x:
        x.retry_older = all(o.get("data") for o in outcomes if o.get("error"))  # type: ignore[attr-defined]
        # Every rank alike: a peer's state that does not fit is this rank's too (exit 78 everywhere);
        # a peer's medium error makes a restore that finds nothing usable no permanent failure.
        x.permanent = x.permanent or any(o.get("permanent") for o in outcomes)
        x.medium = any(o.get("medium") for o in outcomes)  # type: ignore[attr-defined]
        x.gathered_touched = None if touched is None else {k for o in outcomes for k in o.get("touched") or ()}  # type: ignore[attr-defined]
        raise
