"""``trainguard run``'s own argument types and parser error (:func:`.launcher.build_parser`)."""

from __future__ import annotations

import argparse
import copy
import math
import sys
from typing import Any, NoReturn


def seconds(minimum: float, strict: bool) -> Any:
    """An argparse ``type`` for a finite number of seconds above ``minimum`` (``strict``) or at
    least it: a bad value fails in the parser, not in every worker at its first heartbeat
    (``--hang-timeout 0``) or as a hang declared at once (``--hang-floor 0``, auto timeout 0 s)."""
    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            v = math.nan
        if not math.isfinite(v) or v < minimum or (strict and v == minimum):
            raise argparse.ArgumentTypeError(f"{text!r}: give seconds {'>' if strict else '>='} {minimum:g}")
        return v
    return parse


def usage_error(message: str) -> NoReturn:
    """The parser's error: one ``error:`` line, exit 2, as every ``trainguard`` command's (argparse
    printed its usage, 15 lines of torchrun's options, before ``trainguard run: error: ...``)."""
    print(f"error: {message} (see `trainguard run --help`)", file=sys.stderr)
    sys.exit(2)


class _Abbreviated(Exception):
    pass


def parse(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """``launcher.main``: ``argv`` parsed by ``parser`` (torchrun's plus trainguard's options), the
    training script's own arguments left alone. argparse matches abbreviations of every argument,
    those after the script included: ``trainguard run --standalone train.py --log x`` failed with
    "ambiguous option: --log could match --log-dir, --log_dir, ..." (torchrun does the same).
    Parsed first with abbreviations off; only when that leaves something unparsed (an abbreviated
    launcher option before the script, ``--nproc 2``) is it parsed as before, with them on."""
    strict = copy.copy(parser)
    strict.allow_abbrev = False

    def refuse(message: str) -> NoReturn:
        raise _Abbreviated(message)

    strict.error = refuse  # type: ignore[method-assign]
    try:
        args, extra = strict.parse_known_args(argv)
    except _Abbreviated:
        extra = ["?"]
    return args if not extra else parser.parse_args(argv)


def check(args: argparse.Namespace) -> None:
    """``launcher.main``, before the run directory is made and anything is logged: refuse, with
    :func:`usage_error`, the values torchrun refuses only later (a traceback from its
    ``config_from_args``, after ``agent_start`` was logged: ``--nnodes 2:1``, ``--max-restarts -1``,
    ``--nproc-per-node foo``), and an ``--rdzv-conf`` item torchrun refuses (no ``=value``, an empty
    key: ``join_timeout:900``), which :func:`.launcher.prepare`'s merge of trainguard's c10d defaults
    dropped without a word (the job ran with torch's default instead)."""
    from torch.distributed.run import determine_local_world_size

    n = str(args.nproc_per_node)
    if n.lstrip("-").isdigit() and int(n) < 1:
        usage_error(f"--nproc-per-node {n}: give at least 1 worker per node (or auto, cpu, gpu)")
    try:
        determine_local_world_size(n)
    except ValueError as e:
        usage_error(f"--nproc-per-node {n}: {e} (give a number of workers per node, or auto, cpu, gpu)")
    parts = str(args.nnodes).split(":")
    try:
        if len(parts) > 2:
            raise ValueError(args.nnodes)
        lo, hi = int(parts[0]), int(parts[-1])  # "N" is N:N
    except ValueError:
        usage_error(f"--nnodes {args.nnodes}: give a number of nodes, or MIN:MAX (e.g. 1:4)")
    if not 0 < lo <= hi:
        usage_error(f"--nnodes {args.nnodes}: need 0 < MIN <= MAX nodes")
    args.nnodes = f"{lo}:{hi}" if len(parts) == 2 else str(lo)  # as numbers: launcher.prepare reads "1:01" as 1 node max too
    if args.max_restarts < 0:
        usage_error(f"--max-restarts {args.max_restarts}: give a number of restarts >= 0")
    for item in args.rdzv_conf.strip().split(",") if args.rdzv_conf.strip() else ():
        key, _, value = item.partition("=")
        if not key.strip() or not value.strip():
            usage_error(f"--rdzv-conf {args.rdzv_conf}: cannot read {item!r}; write KEY=VALUE,KEY=VALUE")
