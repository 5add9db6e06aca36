"""The doctor's "worker randomness" check (``doctor.check`` and ``doctor_source.check_source`` call
it, through ``doctor_source.augment``, on the script's source): a dataset of the script that draws
from a global generator (``random.random()``, ``np.random.rand()``, ``torch.rand(...)`` without
``generator=``) in its methods, read by a ``DataLoader`` that may start worker processes. torch seeds
each worker's generators from the loader's base seed and the worker id, so what a sample draws
depends on which samples that worker read since its iterator started: after a resume mid-epoch
the same sample is augmented differently (docs/data.md, "Draws in worker processes").
``tg.SeededDataset`` draws from ``(seed, epoch, index)`` instead; a script that mentions it is ok.
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


def worker_draws(leaves: list[tuple[str, Any]], s: Settings) -> Finding | None:
    """A warning for global-generator draws in a dataset class's methods when a ``DataLoader`` of the
    script may start workers and ``SeededDataset`` appears nowhere (module doc); ``ok`` with it;
    ``None`` without source, such a loader or such a draw."""
    from .doctor import Finding
    from .doctor_signals import _workers
    from .doctor_source import _calls, _tree

    if (tree := _tree(s)) is None or not any(_workers(c, tree) for c in _calls(None, {"DataLoader"}, tree)):
        return None
    hits: list[tuple[ast.Call, str]] = []
    for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
        methods = [m for m in cls.body if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef))]
        bases = " ".join(ast.unparse(b) for b in cls.bases)
        if not ("Dataset" in bases or any(m.name == "__getitem__" for m in methods)):
            continue
        hits += [(c, f"{cls.name}.{m.name}") for m in methods if m.name not in _SKIP
                 for c in ast.walk(m) if isinstance(c, ast.Call) and _global_draw(c)]
    if not hits:
        return None
    c, where = min(hits, key=lambda h: h[0].lineno)
    if "SeededDataset" in (s.source or ""):
        return Finding("worker randomness", "ok", f"{where} draws from a global generator (line {c.lineno}) and "
                       "the script uses tg.SeededDataset")
    return Finding("worker randomness", "warning", f"line {c.lineno}: {ast.unparse(c)} in {where} draws from "
                   "the global generator of a DataLoader worker, which torch seeds from the loader's base seed and "
                   "the worker id: what a sample draws depends on the samples its worker read before, so after a "
                   "resume mid-epoch the same samples are augmented differently", "wrap the dataset: "
                   "DataLoader(tg.SeededDataset(dataset, seed=0), sampler=tg.ResumableSampler(..., "
                   "with_epoch=True), ...) (docs/data.md)")
