"""What ``trainguard doctor`` reads of torch without importing it, for a script whose source only is
checked (no ``trainguard_state()``): the names of torch's optimizer and LR scheduler classes, which the
source checks look for in calls (``doctor._optimizer_names``, ``doctor_restore._schedulers``). torch's
import cost that command ~2 s and ~200 MB; where torch is imported already, its classes are read instead."""

from __future__ import annotations

import ast
import functools
import importlib.util
import os


@functools.cache
def class_names(path: str, base: str) -> frozenset[str] | None:
    """The capitalized names of the ``__all__`` of torch's module at ``path`` (under torch's package
    directory: ``optim/__init__.py``) but ``base`` (the base class: ``Optimizer``): its classes of that
    kind, read from its source without importing torch. None where the file or its ``__all__`` (a list
    of strings) is not found: the caller imports torch then."""
    spec = importlib.util.find_spec("torch")  # a top-level package: found, not imported
    if spec is None or not spec.submodule_search_locations:
        return None
    try:
        with open(os.path.join(spec.submodule_search_locations[0], *path.split("/")), "rb") as f:
            tree = ast.parse(f.read())
    except (OSError, SyntaxError, ValueError):
        return None
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            try:
                names = ast.literal_eval(node.value)
            except ValueError:
                return None
            if not isinstance(names, (list, tuple)) or not all(isinstance(n, str) for n in names):
                return None
            return frozenset(n for n in names if n[:1].isupper() and n != base)
    return None
