"""How a ``StoreDistContext`` rank waits for the keys of a round (``dist.py``), and what it
concludes about ranks that do not come.

Every rank waits by polling the store; once a second it looks at the ranks still missing:
rank 0 (the coordinator) judges them, the others judge only rank 0, whose verdict they wait for.

- a rank whose heartbeat stopped for ``dead_after`` seconds: dead;
- rank 0 only: a rank waiting in a *different* collective of the same round (``load`` while the
  others ``save``): a mismatch, at once;
- a rank that *left this operation* (its "at" key says it is in a later operation, or it
  raised out of this one: ``LEFT``) without writing the key awaited: it never will, at once.
  Operations are the public calls (``dist.StoreDistContext.operation``); a rank leaves one midway
  when the caller catches a Ctrl-C raised inside it (``except KeyboardInterrupt:``) and goes on;
- past ``timeout``: a rank that never arrived, or one still busy midway (``MIDWAY``).
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from typing import Any

from . import ddpjoin
from .errors import failure, failure_record
from .permanent import mark

LEFT = "(left)"  # the tag in a rank's "at" key once it raised out of an operation it had entered
STARTED = "(started)"  # an async save's, set by the call that starts it (its thread's rounds come later)
BUSY = "(busy)"  # the tag's start while a rank runs user code inside a call (note_busy): then what it does

# Collectives that every rank reaches only after an earlier one of the same operation (all ranks
# passed "begin", "load"): a rank missing there is busy with the work in between, not absent.
MIDWAY = {"written": "writing its data",
          "loaded": "reading its data and loading it into its state (load_state_dict() and hooks)"}


def _env_seconds(name: str, default: float) -> float:
    """Environment variable ``name``: seconds, a finite number > 0 (unset or empty: ``default``); a ValueError
    naming it otherwise (before: float()'s "could not convert string to float: '10m'", or for a value <= 0 a
    store "that did not answer within -1 s", blaming rank 0)."""
    raw = os.environ.get(name, "").strip()
    try:
        value = float(raw) if raw else default
    except ValueError:
        value = float("nan")
    if not 0 < value < float("inf"):
        raise ValueError(f"{name}={raw!r}: set it to a number of seconds > 0 (default {default:g}), or unset it")
    return value


def default_timeout() -> float:
    """``TRAINGUARD_TIMEOUT`` (seconds, default 600): how long a collective waits for a rank."""
    return _env_seconds("TRAINGUARD_TIMEOUT", 600.0)


def check_timeout(timeout: Any) -> None:
    """``timeout=`` of ``save``/``load``/``CheckpointManager``: seconds > 0, or None for the default."""
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0):
        raise ValueError(f"timeout={timeout!r}: pass how long a collective may wait, seconds > 0, or None (default)")


def dead_after() -> float:
    """``TRAINGUARD_DEAD_AFTER`` (seconds, default 10): a rank whose heartbeat has not moved for
    this long is declared dead."""
    return _env_seconds("TRAINGUARD_DEAD_AFTER", 10.0)


POLL_SHARE, POLL_MAX = 0.02, 0.5  # a wait's poll pause: 0.1 s, or this share of the time waited when more, at most POLL_MAX s


def _absent(store: Any, pending: list[tuple[int, str]], some: bool = False, exact: bool = True,
            budget: list[int] | None = None) -> list[tuple[int, str]]:
    """The ``(rank, key)`` of ``pending`` whose key is not set, found by halving: one ``check`` when all are
    set, about 2 x log2(n) for one missing of n (before: a ``check`` per key, n calls a second at rank 0).
    ``some``: a ``check`` of them all just said that one is missing. Halving stops after 2 x log2(n) + 1
    calls (most missing: it would take up to 2n): the groups left are then checked key by key (``exact``),
    or returned whole (a superset: the keys a poll names)."""
    budget = [2 * len(pending).bit_length() + 1] if budget is None else budget
    if budget[0] <= 0:
        return [p for p in pending if not store.check([p[1]])] if exact else pending
    if not some:
        budget[0] -= 1
        if store.check([k for _r, k in pending]):
            return []
    if len(pending) == 1:
        return pending
    half = len(pending) // 2
    return _absent(store, pending[:half], exact=exact, budget=budget) + _absent(store, pending[half:], exact=exact, budget=budget)


def _beats(ctx: Any, ranks: list[int]) -> dict[int, int]:
    """Each rank's heartbeat count (0: it never created its context): for more than 2 ranks one ``check`` and
    one ``multi_get`` when every one has beaten (before: an ``add`` per rank), else an ``add`` each."""
    keys = [f"{ctx.prefix}/hb/{r}" for r in ranks]
    if len(ranks) > 2 and ctx.store.check(keys):
        return {r: int(v) for r, v in zip(ranks, ctx.store.multi_get(keys), strict=True)}
    return {r: int(ctx.store.add(k, 0)) for r, k in zip(ranks, keys, strict=True)}


def wait_for(ctx: Any, keys: list[str], ranks: list[int], tag: str, timeout: float) -> None:
    """Wait until every key exists; ``ranks[i]`` is the rank that sets ``keys[i]`` (``ctx``: a
    ``StoreDistContext``, in the round ``ctx._op``/``ctx._round`` it entered for ``tag``).

    Polls name only the keys still missing as of ~0.1 s into the wait and of the last once-a-second look,
    which find them by halving (``_absent``): a key, once set, stays until rank 0 deletes its round, two
    rounds later, when every waiter has seen it (a failure record takes the place of an answer only where
    there was none: ``compare_set``). The back-off starts at 2 ms, doubles to 0.1 s and, past 5 s of waiting, to a
    fiftieth of the time waited (``POLL_SHARE``, at most ``POLL_MAX``: 0.5 s): a wait ends at most 2% and 0.5 s
    late (a sync save's stall waits here), and a long one costs a waiting rank ~6 store calls a second, not ~17.
    The looks come once a second and at the ``timeout``, which raises there (before: at the first look past it,
    up to 1 s late: ``timeout=2.5`` raised after 3 s, ``timeout=0.5`` after 1 s)."""
    start = time.monotonic()
    deadline = start + timeout
    look_at = min(start + 1.0, deadline)  # a look at the deadline too: a timeout of 2.5 s raised at 3 s
    seen: dict[int, tuple[int, float]] = {}
    pending = list(zip(ranks, keys, strict=True))
    pause = 0.002  # doubled up to 0.1 s, not reset each second; then grows with the time waited (POLL_SHARE)
    while True:
        # Poll with check() rather than a timed store.wait(), which logs a warning per timeout.
        if ctx.store.check([k for _r, k in pending]):
            return
        now = time.monotonic()
        if now < look_at:
            time.sleep(min(pause, look_at - now))
            if pause < 0.1 <= 2 * pause and len(pending) > 1:  # ~0.1 s in: poll the keys still missing from now on
                pending = _absent(ctx.store, pending, exact=False) or pending[-1:]  # none: the next poll says so
            pause = min(2 * pause, max(0.1, min(POLL_MAX, (now - start) * POLL_SHARE)))
            continue
        look_at = min(now + 1.0, deadline)  # past the deadline: this look raises
        pending = _absent(ctx.store, pending, some=True)  # the poll just now said some are missing
        if not pending:
            return
        missing = dict(pending)
        where = _check_left(ctx, missing, tag)
        if ctx.rank == 0:  # the coordinator judges; the others wait for its verdict
            _check_elsewhere(ctx, list(missing), tag, ranks, where)
        dead = []
        for r, beat in _beats(ctx, list(missing)).items():
            last = seen.get(r)
            if last is None or last[0] != beat:
                seen[r] = (beat, now)
            elif beat > 0 and now - last[1] > ctx.dead_after:
                # beat == 0: the rank never created its context (not arrived yet, maybe never)
                dead.append(r)
        if dead:
            raise failure(
                f"{tag}: rank(s) {dead} stopped responding (no heartbeat for {ctx.dead_after:.0f} s): "
                "the process died or hangs",
                {r: "process died or hung (no heartbeat)" for r in dead},
            )
        late = list(missing)
        if now >= deadline and tag in MIDWAY:  # every rank came to this save: these are stuck in it
            raise failure(
                f"{tag}: rank(s) {late} did not finish {MIDWAY[tag]} within {timeout:g} s: still at it, "
                "or stuck (a stalled filesystem, or a hung process whose heartbeat still beats)",
                {r: f"still {MIDWAY[tag]} after {timeout:g} s" for r in late},
            )
        if now >= deadline:
            _check_busy(ctx, late, tag, timeout)
            raise failure(
                f"{tag}: rank(s) {late} did not arrive within {timeout:g} s. Every rank must call "
                "save/load with the same step and state (e.g. not under `if rank == 0:`), through the same "
                "channel: a CheckpointManager whose run directory has the same last name on every rank (not "
                "reached through a link of another name), or a direct tg.save/tg.load on every rank (not "
                "restore() on some and tg.load on others)." + ddpjoin.hint(),
                {r: f"did not call {tag} within {timeout:g} s" for r in late},
            )


def note_busy(ctx: Any, what: str) -> None:
    """Every rank, inside a numbered trainguard call, before a step of its own that runs user code (``capture``:
    ``state_dict()`` and hooks, before a save's "begin"): say so in its "at" key (one store call), so that a rank
    still waiting for it at the timeout names it as stuck there (``_check_busy``), not as one that never called."""
    if getattr(ctx, "_depth", 0) and not ctx._new_op:  # a StoreDistContext in a numbered operation
        with contextlib.suppress(Exception), ctx.store.hasty():  # a store that stopped answering: the next round says so
            ctx.store.set(f"{ctx.chan}/at/{ctx.rank}", json.dumps([ctx._op, ctx._round, f"{BUSY} {what}"]))


def _check_busy(ctx: Any, late: list[int], tag: str, timeout: float) -> None:
    """At the timeout: raise naming the late ranks that are inside this call, busy in their own step (note_busy)."""
    busy = {r: other[len(BUSY) + 1:] for r, (op, _rnd, other, *_w) in _where(ctx, late).items()
            if op == ctx._op and str(other).startswith(BUSY)}
    if not busy:
        return
    absent = [r for r in late if r not in busy]
    raise failure(
        f"{tag}: rank(s) {sorted(busy)} called this trainguard operation but did not reach {tag!r} within {timeout:g} s: "
        + "; ".join(f"rank {r} still {w}" for r, w in sorted(busy.items()))
        + ". Its process is alive (its heartbeat beats): a state_dict()/load_state_dict() or hook that blocks (a lock, "
        "a queue, a collective that only some ranks call) or takes longer than the timeout (`timeout=`, TRAINGUARD_TIMEOUT)"
        + (f"; rank(s) {absent} did not arrive at all" if absent else ""),
        {**{r: f"still {w} after {timeout:g} s" for r, w in busy.items()},
         **{r: f"did not call {tag} within {timeout:g} s" for r in absent}},
    )


def _where(ctx: Any, ranks: list[int]) -> dict[int, tuple[Any, ...]]:
    """The ``(operation, round, tag)`` each of ``ranks`` last entered (those that entered any), and the
    error of a rank that left it (``[op, round, LEFT, why]``)."""
    keys = [f"{ctx.chan}/at/{r}" for r in ranks]
    if not ctx.store.check(keys):  # some never entered a round of this channel: the others, by halving
        absent = {r for r, _k in _absent(ctx.store, list(zip(ranks, keys, strict=True)), some=True)}
        ranks = [r for r in ranks if r not in absent]
        keys = [f"{ctx.chan}/at/{r}" for r in ranks]
    if not keys:
        return {}
    return {r: tuple(json.loads(v)) for r, v in zip(ranks, ctx.store.multi_get(keys), strict=True)}


def _check_left(ctx: Any, missing: dict[int, str], tag: str) -> dict[int, tuple[Any, ...]]:
    """Raise at once when a rank whose key is awaited left this operation without writing it; else return
    where the missing ranks are (``_where``, for ``_check_elsewhere``)."""
    gone: dict[int, str] = {}
    why: dict[int, list[Any]] = {}
    where = _where(ctx, list(missing))
    for r, (op, _rnd, other, *perm) in where.items():
        if op > ctx._op or (op == ctx._op and other == LEFT):
            gone[r], why[r] = other, perm
    parent = getattr(ctx, "_parent", None)  # an async save's channel: a rank that never started this save
    if parent is not None:  # (a Ctrl-C before it) and whose training thread is past the call that starts it
        behind = [r for r in missing if r not in gone and where.get(r, (-1,))[0] < ctx._op]
        for r, (op, _rnd, other, *perm) in _where(parent, behind).items():
            if op > ctx._op or (op == ctx._op and other == LEFT):
                gone[r], why[r] = f"never started this save; now in {other!r}", perm
    # Read again: a rank may have written its key and then moved on since the first look.
    gone = {r: w for r, w in gone.items() if not ctx.store.check([missing[r]])}
    fatal = {r: why[r][0] for r in gone if why[r]}  # it raised an error no restart fixes (dist.operation): so is this
    if fatal:
        raise mark(failure(
            f"{tag}: rank(s) {sorted(fatal)} failed with an error that no restart fixes: "
            + "; ".join(f"rank {r}: {m}" for r, m in sorted(fatal.items())),
            {r: f"left the call before {tag!r}: {m}" for r, m in fatal.items()},
        ))
    if gone:
        raise failure(
            f"{tag}: rank(s) {sorted(gone)} left this trainguard call before {tag!r} and went on (an exception "
            "or a Ctrl-C caught on that rank, e.g. `except KeyboardInterrupt:`): the call fails on every rank; "
            "the ranks' next calls are paired again",
            {r: f"left the call before {tag!r}" + ("" if w == LEFT else f" ({w})" if w.startswith("never") else f" (now in {w!r})")
             for r, w in gone.items()},
        )
    return where


# The public call each collective's tag belongs to, for the message of a mismatch (_check_elsewhere).
CALLS = {"decide": "CheckpointManager.save", "open": "CheckpointManager.open", "close": "CheckpointManager.close",
         "candidates": "CheckpointManager.restore", "begin": "save", "written": "save", "commit": "save",
         "load": "load", "loaded": "load"}


def _check_elsewhere(ctx: Any, missing: list[int], tag: str, awaited: list[int], where: dict | None = None) -> None:
    """Rank 0: raise at once when a missing rank waits in another collective of the same round.
    The message goes to the ranks of both collectives (those in the other read it as their
    verdict): it says which ranks called which, not who is "instead" where."""
    wrong, where = {}, _where(ctx, missing) if where is None else where  # wait_for: _check_left's, read just before
    for r, (op, rnd, other, *_why) in where.items():
        if (op, rnd) == (ctx._op, ctx._round) and other != tag and not str(other).startswith("("):  # LEFT, BUSY: no collective
            wrong[r] = other
    if tag != "close":  # a rank past its close(): its "at" key deleted (closing_round), its "close" key still here,
        parent = getattr(ctx, "_parent", None)  # in an earlier round of this call (a broadcast rank 0 did not wait in),
        chans = [ctx.chan] + ([parent.chan] if parent is not None else [])  # or in the manager's (this: its async save's)
        for r in [r for r in missing if r not in where][:16]:
            if any(ctx.store.check([f"{c}/r{ctx._op}.{n}/close/{r}"]) for c in chans for n in range(1, max(ctx._round, 2) + 1)):
                wrong[r] = "close"
    if wrong:
        here = sorted({ctx.rank, *(r for r in awaited if r not in missing)})
        by: dict[str, list[int]] = {tag: here}
        for r, w in sorted(wrong.items()):
            by.setdefault(w, []).append(r)
        said = "; ".join(
            f"{_ranks(rs)} called {t!r}" + (f" ({CALLS[t]})" if t in CALLS else "") for t, rs in by.items()
        )
        e = failure(
            f"{tag}: the ranks called different trainguard operations in the same round: {said}. Every rank must make "
            "the same trainguard calls in the same order (e.g. not save on some ranks and load on others, nor close() "
            "on a rank whose loop ended while the others still save: run the same number of steps on every rank)",
            {r: f"called {w!r} while rank {ctx.rank} called {tag!r}" for r, w in wrong.items()},
        )
        # The ranks waiting in the other collective get the same verdict instead of a timeout; its keys
        # (the verdict, theirs) are deleted with this round's (dist.forget), not left for good.
        record, at = json.dumps(failure_record(e)), (ctx._op, ctx._round)
        for other in set(wrong.values()):
            base = f"{ctx.chan}/r{ctx._op}.{ctx._round}/{other}"
            ctx.store.set(f"{base}/all", record)
            ctx._fences += [(at, f"{base}/{k}") for k in ["all", *(r for r, w in wrong.items() if w == other)]]
        raise e


def _ranks(rs: list[int]) -> str:
    return f"rank {rs[0]}" if len(rs) == 1 else f"ranks {rs[:16]}" + (f" and {len(rs) - 16} more" if len(rs) > 16 else "")


CLOSE_WAIT = 60.0  # seconds: the most rank 0's close() waits for the other ranks to arrive (closing_round)


def closing_round(ctx: Any, timeout: float | None) -> None:
    """``CheckpointManager.close()`` on every rank, last, when it ends without an exception: rank 0
    leaves only when every rank is here, i.e. has read every outcome rank 0 published (the last
    save's "commit"). Rank 0's process hosts the job's c10d store (env:// under torchrun and
    ``trainguard run``): leaving at once, its exit took the store with it, and a peer still to
    read the commit failed ("the c10d store stopped answering"; across nodes: the other node's
    agent restarted into a closed rendezvous and exited 1 where this one exited 143). Bounded by
    ``min(timeout, CLOSE_WAIT)``; a rank that does not come (it died, it trains on) is logged.
    The round's keys are deleted in the store's thread; ``dist``'s exit hook joins it (a delete
    still running at exit aborted rank 0 in 5 of 6 runs of test_examples' torchrun case).
    Once every rank is here, rank 0 also deletes the keys of this round and of the rounds before it,
    the manager's async-save channel's (its last save, whose commit every rank waited for) included:
    a channel's last rounds are otherwise deleted only by a later round of that channel, which a
    closed manager never runs, and a process that made one manager after another (a loop of trials,
    each in its own directory) left 4 keys per manager in the job's store (13 with async saves). Each rank
    deletes its own ``at`` key of these channels too."""
    import contextlib
    import logging

    from .dist import default_timeout
    from .errors import CheckpointError

    if not ctx.is_distributed:
        return
    bound = min(default_timeout() if timeout is None else timeout, CLOSE_WAIT)
    try:
        with ctx.store.hasty():  # behind a call the store never answered: at once, not after the bound (storecall)
            ctx.gather("close", None, timeout=bound)
        for ch in (ctx, *getattr(ctx, "_channels", {}).values()):
            ch.forget(ch.mark())  # rank 0 alone has rounds to forget
            # Where this rank was: a rank without one reads as "not there yet", as in a new channel. Deleted by
            # its own rank (in order with that rank's later calls: a manager of the same name made next).
            with contextlib.suppress(Exception):  # rank 0, the store's host, may have left already
                ch.store.delete_key(f"{ch.chan}/at/{ch.rank}")
    except CheckpointError as e:
        logging.getLogger("trainguard").info("trainguard: close() did not meet every rank: %s", e)


def drop_channel(ctx: Any) -> None:
    """``CheckpointManager.close()``, every rank, first (an unopened manager's, a failing one's too): drop
    the manager's channel from its context's (``StoreDistContext.channel``), where it stayed for the process's life: a
    process that made one manager per trial (a hyperparameter sweep, each in its own directory) kept a
    channel, with its async-save channel, per directory (200 trials: 301 contexts). What stays is the
    count of drops of that name: a manager of the same name made next gets a new channel, whose store
    keys are named apart (``#n``) from any the closed one left (a close that did not meet every rank),
    and every rank counts alike (each closes and makes its managers in the same order). The closed
    manager goes on with its own reference (its closing round); a manager of the same name still open keeps
    the channel it shares."""
    home = getattr(ctx, "_base", None)
    chans = getattr(home, "_channels", None)
    if home is None or home is ctx or getattr(ctx, "_parent", None) is not None or not isinstance(chans, dict):
        return  # one process (no channels), or not a manager's channel
    for name, ch in list(chans.items()):
        if ch is ctx:
            chans[name] = ctx._dropped + 1


TRIM_EVERY = 256  # operations between rank 0's looks at where the other ranks are (forget_passed)


def forget_passed(ctx: Any) -> None:
    """Rank 0, in ``policies.decide`` (each ``CheckpointManager.save`` of a multi-rank run, after its
    "decide" broadcast): every ``TRIM_EVERY`` operations, delete the keys of the operations every other
    rank is past, as their ``at`` keys say (one ``multi_get``). A broadcast's key was deleted only by a
    later gather (the next save's commit): a run that saved rarely kept one key per training step in the
    job's store until then (507 after 499 steps of ``EveryNSteps(500)``), and one that never saved
    (``EveryNSteps`` of a huge n, saving on preemption only) or whose saves all failed, for the whole run."""
    if ctx.rank != 0 or not ctx.is_distributed or ctx._op % TRIM_EVERY:
        return
    where = _where(ctx, list(range(1, ctx.world_size)))
    if len(where) == ctx.world_size - 1:  # a rank that never entered a round of ctx: nothing is known
        ctx.forget((min(op for op, *_ in where.values()) - 1, 1 << 62))
