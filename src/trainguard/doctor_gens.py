"""The doctor's "own generators" check (``doctor.check`` and ``doctor_source.check_source`` call it,
through ``doctor_source.own_generators``, on the script's source): a generator object of the script
(``torch.Generator()``, ``np.random.default_rng(...)``, ``np.random.RandomState(...)``,
``random.Random(...)``) that the training draws from, and that ``tg.RNGState(generators=...)`` does
not name. ``tg.RNGState()`` saves the global generators only; such an object is built again from its
seed by a restarted process, so a resumed run draws what the uninterrupted run drew at its start, and
every later draw differs, silently (seen: a noise term drawn with ``generator=`` in the loop, resumed
after a SIGKILL at step 6 from step 4: losses differed from step 5 on).

Draws that count: ``generator=<it>`` in a call, or a draw method of it (``rng.integers(...)``),
inside a training loop (one that calls ``backward()``, an optimizer's ``step()`` or a save), inside a
function of the script called by name in such a loop, or in a ``forward`` method (not a dataset's
``__getitem__``: with DataLoader workers each worker draws from a copy, never advanced in the training
process). Saved: named in ``RNGState(generators=...)``, or its state put into a dict or ``state[...] = ``
by hand (``g.get_state()``, ``rng.bit_generator.state``). Not counted: a ``DataLoader(generator=...)`` (the "data randomness" check's), a generator made
or re-seeded (``manual_seed``/``seed``) inside a loop or in the function that draws (the same numbers
on every pass or call), or re-seeded in the step loop before a function or ``forward`` that draws."""

from __future__ import annotations

import ast
from typing import TYPE_CHECKING, Any

from .doctor_parse import walk

if TYPE_CHECKING:
    from .doctor import Finding, Settings

_DRAWS = {  # methods of numpy's Generator/RandomState and Python's Random that draw
    "random", "integers", "normal", "uniform", "choice", "choices", "permutation", "permuted", "shuffle",
    "standard_normal", "binomial", "poisson", "exponential", "beta", "gamma", "rand", "randn", "randint",
    "random_sample", "random_integers", "sample", "randrange", "gauss", "normalvariate", "getrandbits", "bytes",
    "randbytes", "multinomial", "dirichlet", "geometric", "laplace", "logistic", "lognormal", "bernoulli",
}
_METHODS = {"forward"}  # runs at every step (a dataset's __getitem__ may run in workers: "worker randomness")
_RESEED = {"manual_seed", "seed"}
_NOT_DRAWS = {"DataLoader", "RandomSampler", "SubsetRandomSampler", "WeightedRandomSampler", "random_split"}


def _maker(c: ast.AST) -> str | None:
    """``torch.Generator`` for ``torch.Generator()`` (also ``torch.Generator().manual_seed(0)``), etc."""
    if isinstance(c, ast.Call) and isinstance(c.func, ast.Attribute) and c.func.attr in _RESEED:
        return _maker(c.func.value)
    if not (isinstance(c, ast.Call) and isinstance(c.func, (ast.Attribute, ast.Name))):
        return None
    name = ast.unparse(c.func)
    last = name.rsplit(".", 1)[-1]
    if name in ("torch.Generator", "random.Random") or last in ("default_rng", "RandomState") \
            or name.endswith("random.Generator"):
        return name
    return None


def _ref(x: ast.AST) -> str | None:
    """The name a generator is bound to: ``g`` for ``g``, ``gen`` for ``self.gen``."""
    return x.id if isinstance(x, ast.Name) else x.attr if isinstance(x, ast.Attribute) else None


def _draws(scope: ast.AST, names: set[str]) -> list[tuple[str, ast.Call]]:
    from .doctor_source import _callee

    out = []
    for c in ast.walk(scope):
        if not isinstance(c, ast.Call) or _callee(c) in _NOT_DRAWS:
            continue
        for k in c.keywords:
            if k.arg == "generator" and (n := _ref(k.value)) in names:
                out.append((n, c))
        if isinstance(c.func, ast.Attribute) and c.func.attr in _DRAWS and (n := _ref(c.func.value)) in names:
            out.append((n, c))
    return out


def _reseeded(scope: ast.AST, name: str) -> bool:
    """``name`` made or re-seeded in ``scope``: the same draws on each pass."""
    for n in ast.walk(scope):
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in _RESEED \
                and _ref(n.func.value) == name:
            return True
        if isinstance(n, ast.Assign) and _maker(n.value) and any(_ref(t) == name for t in n.targets):
            return True
    return False


def _passed_draws(loops: list[ast.AST], defs: dict[str, ast.AST], names: set[str]) -> list[tuple[str, ast.Call]]:
    """Draws from a generator the training loop hands to a function of the script as an argument
    (``add_noise(x, g)`` with ``def add_noise(x, gen): ... generator=gen``; missed before session 55):
    (the generator's name, the draw) for each parameter bound to one of ``names`` that the function
    draws from without making or re-seeding it."""
    from .doctor_source import _callee

    out = []
    for c in (c for lp in loops for c in ast.walk(lp) if isinstance(c, ast.Call)):
        f = defs.get(_callee(c) or "")
        if not isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        params = [a.arg for a in (*f.args.posonlyargs, *f.args.args)]
        if isinstance(c.func, ast.Attribute) and params[:1] in (["self"], ["cls"]):
            params = params[1:]  # obj.method(x, g): the first parameter is the object
        bound = [*zip(params, c.args), *((k.arg, k.value) for k in c.keywords if k.arg)]
        for param, arg in bound:
            if (name := _ref(arg)) in names and not isinstance(arg, ast.Starred) and not _reseeded(f, param):
                out += [(name, draw) for _, draw in _draws(f, {param})]
    return out


_STATES = {"get_state", "getstate"}  # torch.Generator's and RandomState's, random.Random's


def _states_saved(tree: ast.AST, names: set[str]) -> set[str]:
    """The generators whose state is put into a dict or ``state[...] = `` by hand: ``g.get_state()``,
    ``rng.bit_generator.state``, ``r.getstate()`` (restored with ``set_state``/``setstate``: reported as
    not saved before)."""
    def gen(v: ast.AST) -> str | None:
        if isinstance(v, ast.Call) and isinstance(v.func, ast.Attribute) and v.func.attr in _STATES:
            return _ref(v.func.value)
        if isinstance(v, ast.Attribute) and v.attr == "state" and isinstance(v.value, ast.Attribute) \
                and v.value.attr == "bit_generator":
            return _ref(v.value.value)
        return None

    values = [v for n in walk(tree) if isinstance(n, ast.Dict) for v in n.values if v is not None]
    values += [n.value for n in walk(tree) if isinstance(n, ast.Assign) and any(isinstance(t, ast.Subscript) for t in n.targets)]
    return {r for v in values if (r := gen(v)) in names}


def own_generators(leaves: list[tuple[str, Any]], s: Settings) -> Finding | None:
    """A warning for a generator of the script drawn from at every step and not saved (module doc);
    ``ok`` when every such generator is named in ``RNGState(generators=...)``; ``None`` without source
    or without such a draw. Static: any rank, no I/O."""
    from .doctor import Finding
    from .doctor_restore import _savers, _trains
    from .doctor_source import _callee, _tree

    if (tree := _tree(s)) is None:
        return None
    made: dict[str, tuple[str, int]] = {}
    for n in walk(tree):
        if isinstance(n, (ast.Assign, ast.AnnAssign)) and n.value is not None and (kind := _maker(n.value)):
            for t in n.targets if isinstance(n, ast.Assign) else [n.target]:
                if (name := _ref(t)) is not None:
                    made.setdefault(name, (kind, n.lineno))
    if not made:
        return None
    saved: set[str] = set()
    for c in walk(tree):
        if isinstance(c, ast.Call) and _callee(c) == "RNGState":
            for k in c.keywords:
                if k.arg == "generators":
                    if not isinstance(k.value, ast.Dict):  # built out of sight: may name any of them
                        return None
                    saved |= {r for v in k.value.values for x in ast.walk(v) if (r := _ref(x)) is not None}
    saved |= _states_saved(tree, set(made))
    savers = _savers(tree)
    loops = [n for n in walk(tree) if isinstance(n, (ast.For, ast.AsyncFor, ast.While)) and _trains(n, savers)]
    defs = {f.name: f for f in walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))}
    called = {_callee(c) for lp in loops for c in ast.walk(lp) if isinstance(c, ast.Call)}
    scopes = loops + [f for name, f in defs.items() if name in called or name in _METHODS]
    # re-seeded at every step (in a training loop that holds no other: not an epoch loop), before the
    # function or forward that draws: g.manual_seed(seed + step); train_step(x) (warned before)
    inner = [lp for lp in loops if not any(o is not lp and o in loops for o in ast.walk(lp))]
    stepped = {name for name in made if any(_reseeded(lp, name) for lp in inner)}
    hits: dict[str, ast.Call] = {}
    for scope in scopes:
        for name, call in _draws(scope, set(made)):
            if name not in stepped and not _reseeded(scope, name):
                hits.setdefault(name, call)
    for name, call in _passed_draws(loops, defs, set(made) - stepped):
        hits.setdefault(name, call)
    if not hits:
        return None
    unsaved = {n: c for n, c in hits.items() if n not in saved}
    if not unsaved:
        return Finding("own generators", "ok", f"the generators drawn from at each step are saved "
                       f"(RNGState(generators=...), or their state by hand): {', '.join(sorted(hits))}")
    name, call = next(iter(unsaved.items()))
    kind, line = made[name]
    more = f" (and {', '.join(sorted(unsaved)[1:])})" if len(unsaved) > 1 else ""
    return Finding("own generators", "warning", f"{kind}() `{name}` (line {line}) is drawn from at each step "
                   f"(line {call.lineno}: {ast.unparse(call)[:80]}){more} but is not saved: tg.RNGState() saves the "
                   "global generators only, so a restarted process builds it again from its seed and a resumed run "
                   "draws what the uninterrupted run drew at its start", f"tg.RNGState(generators={{'{name}': "
                   f"{name}}}) in the state (docs/checkpoints.md)")
