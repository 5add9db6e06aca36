"""``trainguard doctor``'s import of the training script and call of its ``trainguard_state()`` hook.

:func:`trainguard.commands.plan.doctor_cmd` calls :func:`load_hook` once, in the doctor's one process,
for a script whose source defines the hook (:func:`trainguard.doctor_source.defines_hook`); a script
without it is never imported. Every failure is a :class:`CommandError` (exit code 2) that says what to
change; the doctor's own stdout holds the findings only.
"""

from __future__ import annotations

import ast
import contextlib
import importlib.util
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from . import CommandError

_LAUNCHER_ENV = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                 "ROLE_RANK", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "SLURM_PROCID", "SLURM_LOCALID",
                 "SLURM_NTASKS", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "PMI_RANK", "PMI_SIZE"}


@contextlib.contextmanager
def _os_exit_raises() -> Any:
    """While ``_load_hook`` imports the script and calls its hook, ``os._exit(n)`` in this process
    raises ``SystemExit("os._exit(n)")`` (reported as an exit, exit code 2) instead of ending the
    doctor with ``n`` and no word; in a child forked meanwhile it still exits at once."""
    real, pid = os._exit, os.getpid()

    def _exit(code: int) -> None:
        if os.getpid() != pid:
            real(code)
        raise SystemExit(f"os._exit({code})")

    os._exit = _exit  # type: ignore[assignment]
    try:
        yield
    finally:
        os._exit = real


def _package_of(path: Path) -> tuple[str, str]:
    """The dotted package a script lies in (its folders with an ``__init__.py``, innermost last) and
    the folder above the outermost; ``("", "")`` for a script outside any package."""
    parts, d = [], path.resolve().parent
    while (d / "__init__.py").is_file() and d.name.isidentifier() and d != d.parent:
        parts.insert(0, d.name)
        d = d.parent
    return ".".join(parts), str(d) if parts else ""


# The top-level packages load_hook imported (a script with relative imports): a later call in the same
# process (tests, a notebook) for another folder's package of that name drops them instead of reusing them.
# Only those the doctor imported itself: a package the calling program had imported (tg.doctor run from a
# training script inside it) is never dropped (its modules were, by a later call for another folder's
# package of that name, session 57's review57l).
_LOADED: set[str] = set()


def _relative(path: Path) -> bool:
    """Whether the script has a relative import (``from .config import LR``): only then does it need its
    package (``python -m proj.train``); run as ``python proj/train.py`` its ``__init__.py`` never runs."""
    try:
        tree = ast.parse(path.read_text(encoding="utf-8", errors="replace"))
    except (SyntaxError, ValueError, RecursionError, OSError):
        return False
    return any(isinstance(n, ast.ImportFrom) and n.level for n in ast.walk(tree))


def _free_package(path: Path, package: str, top: str) -> None:
    """Make ``package`` importable from ``top``: a module of its top-level name already imported from
    elsewhere was reused (the other folder's ``proj.cfg`` read instead of this one's) or shadowed it
    (a package named ``json``: ``No module named 'json.cfg'``)."""
    root = package.split(".")[0]
    have = sys.modules.get(root)
    if have is None or os.path.realpath(os.path.join(top, root)) in {
            os.path.realpath(p) for p in getattr(have, "__path__", None) or []}:
        return
    if root in _LOADED:  # this doctor imported it for an earlier script: stale for this one
        for k in [k for k in sys.modules if k == root or k.startswith(root + ".")]:
            del sys.modules[k]
        return
    where = getattr(have, "__file__", None) or list(getattr(have, "__path__", None) or []) or "built in"
    raise CommandError(f"{path} uses relative imports, so the doctor imports it as {package}.{path.stem}, but a "
                       f"module named {root} is already imported in this process ({where}): rename the "
                       f"package folder {os.path.join(top, root)}")


def load_hook(path: Path) -> tuple[Mapping[str, Any], Any]:
    """Import ``path`` as a module (not as __main__, with no command-line arguments) and call its
    ``trainguard_state()``."""
    package, top = _package_of(path)
    # In a package (`torchrun -m proj.train`) with relative imports: imported as proj.train, so `from .config
    # import LR` works; it failed with "ImportError: attempted relative import with no known parent package"
    # (exit 2). Without relative imports, as before: the package's __init__.py is not run (`python
    # proj/train.py` does not run it; one that raised or exited failed the doctor, session 57's review57k).
    package, top = (package, top) if package and _relative(path) else ("", "")
    name = f"{package}.{path.stem}" if package else f"_trainguard_doctor_{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise CommandError(f"{path}: cannot import this file as Python")
    mod = importlib.util.module_from_spec(spec)
    # The calling program's own import of this module (tg.doctor from a program that imported proj.train) is put
    # back after the hook: left replaced, pickling its objects failed ("not the same object", review57l).
    prior = sys.modules.get(name)
    folder = str(path.resolve().parent)
    sys.path.insert(0, folder)  # so the script's own sibling imports work
    if package:
        sys.path.insert(0, top)  # and its package's, as python -m from the folder above the package
    argv, sys.argv = sys.argv, [str(path)]  # argparse at module level sees the script's defaults, not ours
    # One process, whatever launched the doctor: a hook that creates its process group from a
    # launcher's RANK/WORLD_SIZE/MASTER_* (doctor run inside torchrun or an salloc) waited for
    # ranks that never come; without them it fails at once, saying so.
    env = {k: os.environ.pop(k) for k in list(os.environ) if k in _LAUNCHER_ENV or k.startswith("TORCHELASTIC_")}
    try:
        with contextlib.redirect_stdout(sys.stderr), _os_exit_raises():  # stdout: the findings only (--json)
            # Registered as an import would be: a module-level @dataclass (with `from __future__ import
            # annotations`) looks its module up in sys.modules, and without it the import failed with
            # "AttributeError: 'NoneType' object has no attribute '__dict__'" (exit 2).
            if package:
                _free_package(path, package, top)
                if package.split(".")[0] not in sys.modules:  # the doctor imports it: not the caller's own
                    _LOADED.add(package.split(".")[0])
                try:
                    importlib.import_module(package)
                except SystemExit as e:  # sys.exit(3) there ended the doctor with 3 and no word
                    raise CommandError(f"{path}: its package {package} exited while being imported (SystemExit: "
                                       f"{e.code}): the doctor imports it, as `python -m {package}.{path.stem}` "
                                       "does, for the script's relative imports; keep exits out of __init__.py") from None
                except Exception as e:
                    raise CommandError(f"{path}: importing its package {package} (as `python -m {package}."
                                       f"{path.stem}` does, for the script's relative imports) raised "
                                       f"{type(e).__name__}: {e}") from e
            sys.modules[spec.name] = mod
            try:
                spec.loader.exec_module(mod)
            except SystemExit as e:
                raise CommandError(f"{path} exited while being imported (SystemExit: {e.code}): the doctor imports it, "
                                   "so keep argument parsing and training under `if __name__ == \"__main__\":`") from None
            hook = getattr(mod, "trainguard_state", None)
            if not callable(hook):
                raise CommandError(f"{path} defines no trainguard_state(): add one that returns the state dict, or "
                                   "(state, manager)")
            try:
                out = hook()
            except SystemExit as e:  # sys.exit(0) there ended the doctor with 0 and no word: a CI step passed
                raise CommandError(f"{path}: trainguard_state() exited (SystemExit: {e.code}) instead of returning "
                                   "the state: keep argument parsing and exits out of it") from None
    except BaseException as e:
        if sys.modules.get(spec.name) is mod:  # a failed import leaves no module behind, as importlib's
            del sys.modules[spec.name]
        if isinstance(e, CommandError) or not isinstance(e, Exception):
            raise
        hint = (" (the doctor calls trainguard_state() in one process, without the launcher's "
                f"{', '.join(sorted(env))}: create the process group in main(), not in the hook)") if env else ""
        raise CommandError(f"{path}: {type(e).__name__}: {e}{hint}") from e
    finally:
        if prior is not None:
            sys.modules[name] = prior
        os.environ.update(env)
        sys.argv = argv
        for added in (folder, top) if package else (folder,):
            if added in sys.path:
                sys.path.remove(added)
    state, manager = out if isinstance(out, tuple) and len(out) == 2 else (out, None)
    if not isinstance(state, Mapping):
        raise CommandError(f"{path}: trainguard_state() returned {type(state).__name__}, not a dict of state")
    if manager is not None and not isinstance(manager, Mapping) and not any(
            hasattr(manager, a) for a in ("root", "save_policy", "keep")):  # what doctor.settings_from reads
        raise CommandError(f"{path}: trainguard_state() returned (state, {type(manager).__name__}): the second item "
                           "must be a CheckpointManager or a dict of its settings (root, save, keep, async_save)")
    if isinstance(manager, Mapping):  # what CheckpointManager(**settings) would refuse: not checked as if fine
        from ..permanent import check_manager_args

        m = manager.get
        try:
            check_manager_args(m("save", m("save_policy")), m("keep"), m("layout", "sharded"), m("on_error", "raise"),
                               m("timeout"), m("max_staging_bytes"), m("async_save", False),
                               m("stage_in_background", False), m("split_state", False), m("root"),
                               m("handle_signals", True), m("ram_tier", False))
        except (TypeError, ValueError) as e:
            raise CommandError(f"{path}: the manager settings trainguard_state() returned: {e}") from None
    return state, manager
