"""The demo's worker script: ``trainguard run ... -m trainguard.demo.train --steps 1000``.

Every rank runs :func:`main`. Data parallel over gloo (DDP) when launched with several
workers. Everything a step depends on is in the checkpointed state, so a resumed run
reproduces the uninterrupted one bit for bit: model, optimizer, the sampler's global position
(:class:`trainguard.sampler.ResumableSampler`) and each rank's dropout RNG
(:class:`trainguard.RNGState`).

Drill options: ``--record FILE`` appends each step's sample indices (coverage tests);
``--hold-at STEP --hold-world W`` commits the checkpoint of STEP and waits (bounded by
``--hold-s``) when running at world size W, so a test can start a new agent at a known point
(scale-up); ``--no-signals`` turns off the manager's save-on-SIGTERM.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Iterator

import torch
import torch.distributed as dist

import trainguard as tg
from trainguard.demo.model import SIZES, GPTConfig, TinyGPT, Windows, stdlib_corpus
from trainguard.sampler import ResumableSampler


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--save-every", type=int, default=100)
    p.add_argument("--size", default="demo", choices=sorted(SIZES))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--corpus-bytes", type=int, default=2_000_000)
    p.add_argument("--record", default=None, help="append each step's sample indices (JSON lines) here")
    p.add_argument("--run-dir", default=os.environ.get("TRAINGUARD_RUN_DIR", "trainguard-run"))
    p.add_argument("--hold-at", type=int, default=None, metavar="STEP",
                   help="drills: at this step, at world size --hold-world, commit the checkpoint, log a "
                        "'hold' event and wait (at most --hold-s) for the agent to restart the group, "
                        "e.g. because a new agent joined (scale-up)")
    p.add_argument("--hold-world", type=int, default=1)
    p.add_argument("--hold-s", type=float, default=45.0, help="bound of the hold (below the hang floor)")
    p.add_argument("--no-signals", action="store_true",
                   help="CheckpointManager(handle_signals=False): no save-on-SIGTERM")
    return p.parse_args(argv)


def _batches(sampler: ResumableSampler, size: int) -> Iterator[list[int]]:
    """Per-rank batches from the sampler's current position, across epochs."""
    while True:
        it = iter(sampler)
        while True:
            batch = [i for _, i in zip(range(size), it)]
            if len(batch) < size:
                break
            yield batch
        sampler.next_epoch()


def _record(path: str, step: int, rank: int, world: int, idx: list[int]) -> None:
    line = json.dumps({"step": step, "rank": rank, "world": world, "idx": idx}) + "\n"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


def _hold(mgr: tg.CheckpointManager, args: argparse.Namespace, step: int, world: int) -> None:
    """The scale-up drill's barrier: the checkpoint of ``step`` is committed, then this worker
    waits until the agent stops it (a membership change) or ``--hold-s`` passes, so a test can
    start a new agent at a known point without racing the training loop."""
    mgr.wait()
    mgr.events.emit("hold", step=step, world_size=world, max_s=args.hold_s)
    deadline = time.monotonic() + args.hold_s
    while time.monotonic() < deadline and not mgr._preempt.is_set():  # SIGTERM seen (handle_signals)
        time.sleep(0.05)


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    torch.set_num_threads(1)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if world > 1 else 0
    cfg = GPTConfig.named(args.size)
    batch = SIZES[args.size][4]
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    model = TinyGPT(cfg)
    net = torch.nn.parallel.DistributedDataParallel(model) if world > 1 else model
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    data = Windows(stdlib_corpus(args.corpus_bytes), cfg.context)
    sampler = ResumableSampler(len(data), seed=args.seed)
    torch.manual_seed(args.seed * 1000 + 1 + rank)  # each rank's own dropout stream
    progress = tg.StateDict(step=0)  # values equal on every rank: a shared entry (each rank's loss was not)
    state = {"model": model, "optim": opt, "data": sampler, "rng": tg.RNGState(reseed=args.seed),
             "progress": progress}
    policy = tg.EveryNSteps(args.save_every)
    with tg.CheckpointManager(args.run_dir, save=policy, keep=tg.KeepLatest(3), async_save=True,
                              handle_signals=not args.no_signals) as mgr:
        start = mgr.restore(state)
        step = saved = 0 if start is None else start
        batches = _batches(sampler, batch)
        while step < args.steps and not mgr.should_stop:
            idx = next(batches)
            x, y = data.batch(idx)
            loss = net(x, y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sampler.advance(len(x))
            step += 1
            progress.update(step=step)
            if args.record:
                _record(args.record, step, rank, world, idx)
            if mgr.save(step, state) is not None:
                saved = step
            if step == args.hold_at and world == args.hold_world:
                _hold(mgr, args, step, world)
            if rank == 0 and step % 100 == 0:
                print(f"step {step} loss {loss.item():.3f}", flush=True)
        if saved != step:
            mgr.save(step, state, force=True)  # the final weights are always in a checkpoint
        mgr.wait()
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
