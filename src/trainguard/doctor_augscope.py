"""What the doctor's "worker randomness" check (``doctor_augment.worker_draws``, on the script's tree) reads as
code that runs in a ``DataLoader`` worker, and which calls in it draw.

Worker code: the methods of the script's dataset classes (a base naming ``Dataset``, or a ``__getitem__``),
but not ``__init__``, ``__len__``, ``__repr__``, ``__str__`` nor a method only those call (``self._shuffle()``
from ``__init__``: it runs once, in the main process); the methods of a transform class of the script (one with
``__call__``) made inside a dataset class or in the arguments of a call of a dataset class or of the
``DataLoader`` (``DS(transform=Jitter())``, or ``DS(transform=flip)`` after ``flip = Flip()``); and the
script's functions those call by name, or pass to such a call (``DS(transform=jitter)``), three calls deep.

Draws: a global generator's (``random.random()``, ``np.random.rand()``, ``torch.rand(...)`` without
``generator=``), spelt through the script's imports too (``from random import randint``, ``import numpy.random
as npr``); a generator the object keeps (``self.rng.uniform()``, ``generator=self.g``: :func:`own_draws`); and a
generator made without a seed (``np.random.default_rng()``, ``random.Random()``) in worker code: fresh OS entropy
for each sample, which no seeding repeats.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator

from .doctor_parse import walk

_PY = {"random", "uniform", "randint", "randrange", "choice", "choices", "shuffle", "sample", "gauss",
       "normalvariate", "lognormvariate", "betavariate", "gammavariate", "triangular", "expovariate", "vonmisesvariate",
       "paretovariate", "weibullvariate", "getrandbits", "randbytes", "binomialvariate"}
_NP_NOT = {"default_rng", "RandomState", "Generator", "SeedSequence", "PCG64", "MT19937", "Philox", "SFC64",
           "BitGenerator", "get_state", "set_state"}  # their own generators, or no draw
_TORCH = {"rand", "randn", "randint", "randperm", "rand_like", "randn_like", "randint_like", "bernoulli",
          "multinomial", "normal", "poisson"}
SKIP = {"__init__", "__len__", "__repr__", "__str__"}  # run in the main process, or draw nothing
_UNSEEDED = {("numpy.random", "default_rng"), ("numpy.random", "RandomState"), ("random", "Random")}
_GEN_MAKERS = ("default_rng", "RandomState", "Random", "Generator")  # np.random's, random's, torch's
_NO_DRAW = {"seed", "manual_seed", "initial_seed", "get_state", "set_state", "getstate", "setstate", "spawn",
            "bit_generator", "jumped", "device"}

Names = tuple[dict[str, str], dict[str, tuple[str, str]]]  # module aliases, functions imported by name


def names(tree: ast.Module) -> Names:
    """The script's spellings of ``random``, ``numpy`` (``numpy.random``) and ``torch``: ``np`` and the plain
    names without an import too (as the check read them before), ``import numpy.random as npr``,
    ``from numpy import random as npr``; and ``from random import randint`` (a function by its name)."""
    mods = {"random": "random", "np": "numpy", "numpy": "numpy", "torch": "torch"}
    funcs: dict[str, tuple[str, str]] = {}
    for n in walk(tree):
        if isinstance(n, ast.Import):
            for a in n.names:
                if a.asname:
                    mods[a.asname] = a.name
        elif isinstance(n, ast.ImportFrom) and n.module in ("random", "numpy", "numpy.random", "torch") and not n.level:
            for a in n.names:
                if n.module == "numpy" and a.name == "random":
                    mods[a.asname or a.name] = "numpy.random"
                else:
                    funcs[a.asname or a.name] = (n.module, a.name)
    return mods, funcs


def _target(f: ast.AST, nm: Names) -> tuple[str, str] | None:
    """``(module, function)`` that the called expression ``f`` names, or None."""
    mods, funcs = nm
    if isinstance(f, ast.Name):
        return funcs.get(f.id)
    if not isinstance(f, ast.Attribute):
        return None
    v, parts = f.value, []
    while isinstance(v, ast.Attribute):
        parts.append(v.attr)
        v = v.value
    if not isinstance(v, ast.Name) or v.id not in mods:
        return None
    return ".".join([mods[v.id], *reversed(parts)]), f.attr


def global_draw(c: ast.Call, nm: Names) -> bool:
    """``random.uniform(...)``, ``np.random.rand(...)``, ``torch.randn(...)`` without ``generator=``."""
    t = _target(c.func, nm)
    if t is None:
        return False
    mod, fn = t
    if mod == "random":
        return fn in _PY
    if mod == "numpy.random":
        return fn not in _NP_NOT
    return mod == "torch" and fn in _TORCH and not any(k.arg == "generator" for k in c.keywords)


def unseeded(c: ast.Call, nm: Names) -> bool:
    """``np.random.default_rng()``, ``RandomState()``, ``random.Random()`` (or of ``None``): OS entropy."""
    return _target(c.func, nm) in _UNSEEDED and not c.keywords and (
        not c.args or (len(c.args) == 1 and isinstance(c.args[0], ast.Constant) and c.args[0].value is None))


def makes_generator(v: ast.AST | None) -> bool:
    """``np.random.default_rng(0)``, ``random.Random(1)``, ``torch.Generator().manual_seed(1)``."""
    while isinstance(v, ast.Call):
        if ast.unparse(v.func).rsplit(".", 1)[-1] in _GEN_MAKERS:
            return True
        v = v.func.value if isinstance(v.func, ast.Attribute) else v.func
    return False


def _assigns(n: ast.AST) -> list[ast.expr]:
    """The targets of an assignment that gives them a value (``x: T = v`` too)."""
    if isinstance(n, ast.Assign):
        return n.targets
    return [n.target] if isinstance(n, ast.AnnAssign) and n.value is not None else []


def own_draws(cls: ast.ClassDef, methods: list[ast.AST]) -> list[ast.Call]:
    """Draws in ``methods`` from a generator the class keeps as an attribute (``self.rng = np.random.default_rng(0)``,
    or in the class body, then ``self.rng.random()`` or ``torch.rand(2, generator=self.g)``): each worker draws on
    from its copy, and ``RNGState`` does not save it (with no workers either)."""
    gens = {t.attr for n in ast.walk(cls) for t in _assigns(n) if makes_generator(getattr(n, "value", None))
            and isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"}
    gens |= {t.id for n in cls.body for t in _assigns(n) if makes_generator(getattr(n, "value", None)) and isinstance(t, ast.Name)}

    def own(v: ast.AST) -> bool:
        return isinstance(v, ast.Attribute) and v.attr in gens and isinstance(v.value, ast.Name) and v.value.id == "self"

    return [c for m in methods for c in ast.walk(m) if isinstance(c, ast.Call) and (
        (isinstance(c.func, ast.Attribute) and own(c.func.value) and c.func.attr not in _NO_DRAW)
        or any(k.arg == "generator" and own(k.value) for k in c.keywords))]


def _methods(cls: ast.ClassDef) -> list[ast.FunctionDef | ast.AsyncFunctionDef]:
    return [m for m in cls.body if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef))]


def worker_methods(cls: ast.ClassDef) -> list[ast.FunctionDef | ast.AsyncFunctionDef]:
    """``cls``'s methods that run per sample: not ``SKIP``'s, nor one that only they (or such methods) name."""
    methods = _methods(cls)
    users: dict[str, set[str]] = {m.name: set() for m in methods}
    for m in methods:
        for n in ast.walk(m):
            if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "self" and n.attr in users:
                users[n.attr].add(m.name)
    main = set(SKIP)
    while more := {name for name, by in users.items() if by and name not in main and by <= main}:
        main |= more
    return [m for m in methods if m.name not in main]


def dataset_classes(tree: ast.Module) -> list[ast.ClassDef]:
    out = []
    for cls in (n for n in walk(tree) if isinstance(n, ast.ClassDef)):
        bases = " ".join(ast.unparse(b) for b in cls.bases)
        if "Dataset" in bases or any(m.name == "__getitem__" for m in _methods(cls)):
            out.append(cls)
    return out


def worker_code(tree: ast.Module, loaders: list[ast.Call]) -> Iterator[tuple[str, ast.ClassDef | None, ast.AST]]:
    """``(where, its class or None, a function)`` of the script's worker code (module doc): each worker method of
    its datasets, then of its transform classes, then the functions those call or the datasets are given."""
    datasets = dataset_classes(tree)
    classes = {n.name: n for n in walk(tree) if isinstance(n, ast.ClassDef)}
    funcs = {n.name: n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    named = {d.name for d in datasets}
    calls = [c for c in walk(tree) if isinstance(c, ast.Call) and isinstance(c.func, ast.Name) and c.func.id in named]
    made: dict[str, set[str]] = {}  # a variable of the script: the classes made in its value (flip = Flip())
    for n in walk(tree):
        for t in _assigns(n):
            if isinstance(t, ast.Name):
                made.setdefault(t.id, set()).update(_made(getattr(n, "value", None), classes))
    given: set[str] = set()  # names in the datasets' calls and the loaders' dataset arguments (and what made them)
    passed: set[str] = set()  # those not called there: a function called there (DS(load(path))) runs in this process
    for place in [*calls, *(a for ld in loaders for a in [*ld.args[:1], *(k.value for k in ld.keywords if k.arg == "dataset")])]:
        nodes = list(_walk_data(place))
        called = {id(n.func) for n in nodes if isinstance(n, ast.Call)}
        given |= {x for n in nodes if isinstance(n, ast.Name) for x in (n.id, *made.get(n.id, ()))}
        passed |= {n.id for n in nodes if isinstance(n, ast.Name) and id(n) not in called}
    inside = {x for d in datasets for n in ast.walk(d) if isinstance(n, ast.Name) for x in (n.id, *made.get(n.id, ()))}
    transforms = [classes[k] for k in sorted(given | inside) if k in classes and classes[k] not in datasets
                  and any(m.name == "__call__" for m in _methods(classes[k]))]
    seen: set[str] = set()
    todo: list[tuple[str, ast.AST, int]] = []
    for cls in [*datasets, *transforms]:
        for m in worker_methods(cls):
            yield f"{cls.name}.{m.name}", cls, m
            todo.append((f"{cls.name}.{m.name}", m, 0))
    for k in sorted(passed):
        if k in funcs and k not in seen:
            seen.add(k)
            yield f"{k} (given to a dataset)", None, funcs[k]
            todo.append((k, funcs[k], 1))
    while todo:
        caller, f, depth = todo.pop(0)
        for c in ast.walk(f):
            if isinstance(c, ast.Call) and isinstance(c.func, ast.Name) and c.func.id in funcs and c.func.id not in seen:
                seen.add(c.func.id)
                yield f"{c.func.id} (called by {caller})", None, funcs[c.func.id]
                if depth < 2:
                    todo.append((c.func.id, funcs[c.func.id], depth + 1))


def _made(v: ast.AST | None, classes: dict[str, ast.ClassDef]) -> set[str]:
    return {c.func.id for c in ast.walk(v) if isinstance(c, ast.Call) and isinstance(c.func, ast.Name)
            and c.func.id in classes} if v is not None else set()


def _walk_data(node: ast.AST) -> Iterator[ast.AST]:
    """``ast.walk`` of a loader's dataset argument, not into a ``ResumableIterable(...)``: its ``transform=``
    runs seeded with ``seed=``, and is reported without (``doctor_augment.worker_draws``)."""
    todo = [node]
    while todo:
        n = todo.pop()
        if isinstance(n, ast.Call) and ast.unparse(n.func).rsplit(".", 1)[-1] == "ResumableIterable":
            continue
        yield n
        todo.extend(ast.iter_child_nodes(n))
