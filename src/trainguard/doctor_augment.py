"""The doctor's "worker randomness" check (``doctor.check`` and ``doctor_source.check_source`` call
it, through ``doctor_source.augment``, on the script's source): a dataset of the script that draws
from a global generator (``random.random()``, ``np.random.rand()``, ``torch.rand(...)`` without
``generator=``) in its methods, read by a ``DataLoader`` that may start worker processes. torch seeds
each worker's generators from the loader's base seed and the worker id, so what a sample draws
depends on which samples that worker read since its iterator started: after a resume mid-epoch
the same sample is augmented differently (docs/data.md, "Draws in worker processes").
``tg.SeededDataset`` draws from ``(seed, epoch, index)`` instead (and seeds the batch's
``collate_fn``); a script that mentions it is ok. Draws in a ``worker_init_fn`` and in a
``ResumableIterable``'s ``transform`` without ``seed=`` are reported too.
"""

from __future__ import annotations

import ast
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .doctor import Finding, Settings

_PY = {"random", "uniform", "randint", "randrange", "choice", "choices", "shuffle", "sample", "gauss",
       "normalvariate", "lognormvariate", "betavariate", "gammavariate", "triangular", "expovariate", "vonmisesvariate",
       "paretovariate", "weibullvariate", "getrandbits", "randbytes", "binomialvariate"}
_NP_NOT = {"default_rng", "RandomState", "Generator", "SeedSequence", "PCG64", "MT19937", "Philox", "SFC64",
           "BitGenerator", "get_state", "set_state"}  # their own generators, or no draw
_TORCH = {"rand", "randn", "randint", "randperm", "rand_like", "randn_like", "randint_like", "bernoulli",
          "multinomial", "normal", "poisson"}
_SKIP = {"__init__", "__len__", "__repr__", "__str__"}  # run in the main process, or draw nothing


def _global_draw(c: ast.Call) -> bool:
    """``random.uniform(...)``, ``np.random.rand(...)``, ``torch.randn(...)`` without ``generator=``."""
    f = c.func
    if not isinstance(f, ast.Attribute):
        return False
    v = f.value
    if isinstance(v, ast.Name) and v.id == "random":
        return f.attr in _PY
    if isinstance(v, ast.Attribute) and v.attr == "random" and isinstance(v.value, ast.Name) \
            and v.value.id in ("np", "numpy"):
        return f.attr not in _NP_NOT
    if isinstance(v, ast.Name) and v.id == "torch" and f.attr in _TORCH:
        return not any(k.arg == "generator" for k in c.keywords)
    return False


def _draws(fn: ast.AST) -> list[ast.Call]:
    return [c for c in ast.walk(fn) if isinstance(c, ast.Call) and _global_draw(c)]


_GEN_MAKERS = ("default_rng", "RandomState", "Random", "Generator")  # np.random's, random's, torch's
_NO_DRAW = {"seed", "manual_seed", "initial_seed", "get_state", "set_state", "getstate", "setstate", "spawn",
            "bit_generator", "jumped", "device"}


def _makes_generator(v: ast.AST) -> bool:
    """``np.random.default_rng(0)``, ``random.Random(1)``, ``torch.Generator().manual_seed(1)``."""
    while isinstance(v, ast.Call):
        if ast.unparse(v.func).rsplit(".", 1)[-1] in _GEN_MAKERS:
            return True
        v = v.func.value if isinstance(v.func, ast.Attribute) else v.func
    return False


def _own_draws(cls: ast.ClassDef) -> list[ast.Call]:
    """Draws from a generator the dataset keeps as an attribute (``self.rng = np.random.default_rng(0)``, then
    ``self.rng.random()`` or ``torch.rand(2, generator=self.g)``): each worker draws on from its copy, and
    ``RNGState`` does not save it (with no workers either)."""
    gens = {t.attr for n in ast.walk(cls) if isinstance(n, ast.Assign) and _makes_generator(n.value)
            for t in n.targets if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"}
    gens |= {t.id for n in cls.body if isinstance(n, ast.Assign) and _makes_generator(n.value)  # a class attribute
             for t in n.targets if isinstance(t, ast.Name)}

    def own(v: ast.AST) -> bool:
        return isinstance(v, ast.Attribute) and v.attr in gens and isinstance(v.value, ast.Name) and v.value.id == "self"

    return [c for m in cls.body if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef)) and m.name not in _SKIP
            for c in ast.walk(m) if isinstance(c, ast.Call) and (
                (isinstance(c.func, ast.Attribute) and own(c.func.value) and c.func.attr not in _NO_DRAW)
                or any(k.arg == "generator" and own(k.value) for k in c.keywords))]


def _functions(tree: ast.Module, call: ast.Call, args: tuple[str, ...]) -> list[tuple[str, ast.AST]]:
    """The functions of the script passed by name (or as a lambda) as keyword ``args`` of ``call``."""
    defs = {n.name: n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    out: list[tuple[str, ast.AST]] = []
    for k in call.keywords:
        if k.arg in args and isinstance(k.value, ast.Lambda):
            out.append((k.arg, k.value))
        elif k.arg in args and isinstance(k.value, ast.Name) and k.value.id in defs:
            out.append((f"{k.arg} {k.value.id}", defs[k.value.id]))
    return out


def worker_draws(leaves: list[tuple[str, Any]], s: Settings) -> Finding | None:
    """A warning for global-generator draws in a dataset class's methods, or a worker loader's
    ``collate_fn``, when a ``DataLoader`` of the script may start workers and ``SeededDataset``
    appears nowhere (module doc); ``ok`` with it. Always one for draws in a worker loader's
    ``worker_init_fn`` (SeededDataset does not cover it) and in the ``transform=`` of a
    ``ResumableIterable`` without ``seed=``. ``None`` without source, such a loader or such a draw."""
    from .doctor import Finding
    from .doctor_signals import _workers
    from .doctor_source import _calls, _tree

    if (tree := _tree(s)) is None:
        return None
    loaders = [c for c in _calls(None, {"DataLoader"}, tree) if _workers(c, tree)]
    if not loaders:  # no worker process: the draws are the training process's (RNGState)
        return None
    for call in _calls(None, {"ResumableIterable"}, tree):  # its transform runs in the workers: seed= seeds it
        if not any(k.arg == "seed" for k in call.keywords):
            for where, fn in _functions(tree, call, ("transform",)):
                if draws := _draws(fn):
                    return Finding("worker randomness", "warning", f"line {draws[0].lineno}: {ast.unparse(draws[0])} in "
                                   f"{where} of a ResumableIterable without seed= draws from the global generator of "
                                   "a DataLoader worker: after a resume the same items are transformed differently",
                                   "pass ResumableIterable(..., seed=0): each item's transform is then seeded from "
                                   "(seed, epoch, item index) (docs/data.md)")
    for where, fn in (f for c in loaders for f in _functions(tree, c, ("worker_init_fn",))):
        draws = [c for c in _draws(fn) if not (isinstance(c.func, ast.Attribute) and "seed" in c.func.attr)]
        if draws:
            return Finding("worker randomness", "warning", f"line {draws[0].lineno}: {ast.unparse(draws[0])} in {where} "
                           "draws from a worker's generators, seeded from the loader's base seed, which a resumed "
                           "process draws at another point: it draws differently after a resume",
                           "derive what worker_init_fn draws from its worker_id alone, or draw it in the dataset")
    hits: list[tuple[ast.Call, str]] = []
    own: list[ast.Call] = []
    for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
        methods = [m for m in cls.body if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef))]
        bases = " ".join(ast.unparse(b) for b in cls.bases)
        if not ("Dataset" in bases or any(m.name == "__getitem__" for m in methods)):
            continue
        hits += [(c, f"{cls.name}.{m.name}") for m in methods if m.name not in _SKIP for c in _draws(m)]
        own += _own_draws(cls)
        hits += [(c, f"{cls.name}.{m.name}") for m in methods for c in ast.walk(m) if c in own]
    hits += [(c, where) for ld in loaders for where, fn in _functions(tree, ld, ("collate_fn",)) for c in _draws(fn)]
    if not hits:
        return None
    c, where = min(hits, key=lambda h: h[0].lineno)
    if "SeededDataset" in (s.source or ""):
        return Finding("worker randomness", "ok", f"{where} draws from a {'generator it keeps' if c in own else 'global generator'} (line {c.lineno}) and "
                       "the script uses tg.SeededDataset")
    if c in own:
        return Finding("worker randomness", "warning", f"line {c.lineno}: {ast.unparse(c)} in {where} draws from "
                       "a generator the dataset keeps: each DataLoader worker draws on from its own copy of it, and "
                       "no checkpoint holds it, so after a resume mid-epoch the same samples are augmented "
                       "differently", "wrap the dataset: DataLoader(tg.SeededDataset(dataset, seed=0), "
                       "sampler=tg.ResumableSampler(..., with_epoch=True), ...): it seeds the dataset's own "
                       "generators per sample too (docs/data.md)")
    return Finding("worker randomness", "warning", f"line {c.lineno}: {ast.unparse(c)} in {where} draws from "
                   "the global generator of a DataLoader worker, which torch seeds from the loader's base seed and "
                   "the worker id: what a sample draws depends on the samples its worker read before, so after a "
                   "resume mid-epoch the same samples are augmented differently", "wrap the dataset: "
                   "DataLoader(tg.SeededDataset(dataset, seed=0), sampler=tg.ResumableSampler(..., "
                   "with_epoch=True), ...) (docs/data.md)")
