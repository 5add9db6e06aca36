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
