"""The doctor's "draw before seed" check (``doctor_source.source_checks``, on the script's source): data
made at module level from a global generator before any seed, e.g. ``perm = torch.randperm(N)`` or
``X = torch.randn(1000, 8)`` at import, above ``torch.manual_seed(0)``.

Each process draws those numbers anew from an unseeded generator (torch seeds its default generator
from the clock, ``random`` and NumPy from the OS): the resumed run's permutation or synthetic data is
not the saved run's, and no checkpoint holds it (``mgr.restore`` puts the RNG state back after it was
drawn). The resume then trains on other data, or other samples at the same positions, silently.

Read: the module's top-level statements in order (the bodies of top-level ``if``/``with``/``try``
blocks too, ``if __name__ == "__main__":`` among them), up to the first statement that seeds
(``torch.manual_seed``, ``random.seed``, ``np.random.seed``, ``set_seed``/``seed_everything``, or a
function of the script that calls one) or restores (``mgr.restore``, ``tg.load``): a call in those
statements of ``torch.rand*``/``randn*``/``randperm``/``normal``/``bernoulli``/``multinomial`` without
``generator=``, or of ``random.*``/``np.random.*`` draws, is reported (a warning, the first one). Not
read: draws inside functions and classes (they run when called, maybe after the seed), inside
module-level loops (a training loop's draws come after its restore: the saved RNG state covers them),
and draws from a generator object of the script's (``g = torch.Generator(); torch.randn(..., generator=g)``,
``rng.permutation``); weights a model initializes at import are restored from the checkpoint.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .doctor import Finding, Settings

_TORCH_DRAWS = {"rand", "randn", "randint", "randperm", "rand_like", "randn_like", "randint_like", "normal",
                "bernoulli", "multinomial", "poisson"}
_RANDOM_DRAWS = {"random", "randint", "randrange", "choice", "choices", "sample", "shuffle", "uniform", "gauss",
                 "permutation", "rand", "randn", "normal", "random_sample", "binomial", "integers"}


def _top(body: list[ast.stmt]) -> Iterator[ast.stmt]:
    """The module's top-level statements in order, those inside top-level ``if``/``with``/``try`` (and ``try``
    with ``except*``) too."""
    for st in body:
        if isinstance(st, ast.If):
            yield from _top(st.body)
            yield from _top(st.orelse)
        elif isinstance(st, (ast.With, ast.AsyncWith)):
            yield from _top(st.body)
        elif isinstance(st, (ast.Try, ast.TryStar)):  # try: and try/except* (3.11): not the handlers
            yield from _top([*st.body, *st.orelse, *st.finalbody])
        else:
            yield st


def _draw(c: ast.Call) -> bool:
    from .doctor_source import _callee, _receiver

    name, recv = _callee(c), _receiver(c)
    if recv == "torch":
        return name in _TORCH_DRAWS and not any(k.arg == "generator" for k in c.keywords)
    return recv == "random" and name in _RANDOM_DRAWS  # random.shuffle, np.random.permutation


def draw_before_seed(leaves: list[tuple[str, Any]], s: Settings) -> Finding | None:
    """A warning for the first module-level global-generator draw above every seed and restore, else None."""
    from .doctor import Finding
    from .doctor_rng import _helpers, _is_restore, _is_seed
    from .doctor_source import _callee, _own_nodes, _receiver, _tree

    if (tree := _tree(s)) is None:
        return None
    seeders, restorers = _helpers(tree)
    for st in _top(tree.body):
        if isinstance(st, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.For, ast.AsyncFor, ast.While)):
            continue
        calls = [c for c in (st, *_own_nodes(st)) if isinstance(c, ast.Call)]
        if any(_is_seed(c) or _is_restore(c) or _callee(c) in seeders | restorers and _receiver(c) is None for c in calls):
            return None  # seeded (or restored) from here on
        if draws := [c for c in calls if _draw(c)]:
            c = min(draws, key=lambda c: (c.lineno, c.col_offset))
            return Finding("draw before seed", "warning", f"line {c.lineno}: {ast.unparse(c)} draws from the global "
                           "generator at import, before any seed: each process draws other numbers, so a resumed run "
                           "gets other data (a permutation, a synthetic dataset) than the saved run, and no "
                           "checkpoint holds it", "seed first (torch.manual_seed(seed) above it), or draw from a "
                           "seeded generator: torch.randperm(n, generator=torch.Generator().manual_seed(seed))")
    return None
