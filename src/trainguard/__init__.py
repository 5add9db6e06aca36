"""trainguard: checkpointing and fault tolerance for PyTorch training.

The public surface is what ``__all__`` lists; nothing else is imported from deep paths.

``import trainguard`` itself imports neither torch nor the library's modules: the first use of
a name of ``__all__`` (``tg.save``, ``from trainguard import CheckpointManager``, ``dir()`` does
not count) imports them all, in the order and with the process-wide hooks an eager import made
(:func:`_boot`). So the ``trainguard`` command, a submodule of this package, runs its commands
that need no tensor (``--help``, ``report``, ``plan``) without torch's ~2 s and ~200 MB.
Hooks: at import, the excepthook of a ``trainguard run`` worker, the exit's wait for a save
in flight (:mod:`.exitdrain`'s threading hook), :mod:`.staledefaults` and a fork hook that resets a
child when only deep modules were imported (:func:`_fork_child`), all torch-free; before the first
save, the at-fork reset (:mod:`.forks`) and the exit's second wait (after torch's and ``dist``'s atexit
hooks), in :func:`_boot` and, for code that imports deep paths only, every ``CheckpointManager`` and async save.
"""

from __future__ import annotations

__version__ = "0.1.0"

import importlib as _importlib  # noqa: E402
import importlib.util as _importlib_util  # noqa: E402
import os as _os  # noqa: E402
import sys as _sys  # noqa: E402
import types as _types  # noqa: E402
from typing import TYPE_CHECKING, Any  # noqa: E402

from .errors import (  # noqa: E402  (torch-free; the commands import them too)
    CheckpointError,
    CorruptCheckpointError,
    DiskFullError,
    FormatVersionError,
    LockedError,
    NotACheckpointError,
    RankFailureError,
    StateMismatchError,
    StepExistsError,
    UnsupportedValueError,
)
from .permanent import PERMANENT_EXIT, exit_code_for, install_excepthook  # noqa: E402  (torch-free)

if TYPE_CHECKING:  # what mypy and pyright see: the names _boot binds
    from .api import load, save
    from .daly import DalyInterval
    from .doctor import Finding, doctor
    from .entrydrop import DroppedEntryWarning
    from .gradwatch import PendingGradientsWarning
    from .handle import SaveHandle
    from .inspect import verify
    from .iostall import StuckWriteError
    from .manager import CheckpointManager
    from .optim_hparams import OptimizerSettingsWarning
    from .policies import (
        EveryNSteps,
        EverySeconds,
        KeepAll,
        KeepBest,
        KeepEvery,
        KeepLatest,
        RetentionPolicy,
        SavePolicy,
    )
    from .replicas import ReplicasDifferWarning
    from .sampler import ResumableIterable, ResumableSampler
    from .seeded import SeededDataset, ignore_stop_signals
    from .stateful import RNGState, StateDict, Stateful

__all__ = [
    "__version__",
    "save",
    "load",
    "verify",
    "CheckpointManager",
    "SaveHandle",
    "Stateful",
    "StateDict",
    "RNGState",
    "ResumableSampler",
    "ResumableIterable",
    "SeededDataset",
    "ignore_stop_signals",
    "SavePolicy",
    "RetentionPolicy",
    "EveryNSteps",
    "DalyInterval",
    "doctor",
    "Finding",
    "EverySeconds",
    "KeepAll",
    "KeepLatest",
    "KeepEvery",
    "KeepBest",
    "exit_code_for",
    "PERMANENT_EXIT",
    "CheckpointError",
    "CorruptCheckpointError",
    "DiskFullError",
    "FormatVersionError",
    "LockedError",
    "NotACheckpointError",
    "RankFailureError",
    "StateMismatchError",
    "StepExistsError",
    "StuckWriteError",
    "UnsupportedValueError",
    "ReplicasDifferWarning",
    "PendingGradientsWarning",
    "OptimizerSettingsWarning",
    "DroppedEntryWarning",
]

# Each lazy name of __all__ -> its module, in the order the eager __init__ imported them (_boot keeps it).
_WHERE = {
    "save": "api", "load": "api", "DalyInterval": "daly", "Finding": "doctor", "doctor": "doctor",
    "DroppedEntryWarning": "entrydrop", "PendingGradientsWarning": "gradwatch", "SaveHandle": "handle",
    "verify": "inspect", "StuckWriteError": "iostall", "CheckpointManager": "manager",
    "OptimizerSettingsWarning": "optim_hparams", **dict.fromkeys(
        ("EveryNSteps", "EverySeconds", "KeepAll", "KeepBest", "KeepEvery", "KeepLatest", "RetentionPolicy",
         "SavePolicy"), "policies"),
    "ReplicasDifferWarning": "replicas", "ResumableIterable": "sampler", "ResumableSampler": "sampler",
    "SeededDataset": "seeded", "ignore_stop_signals": "seeded", "RNGState": "stateful", "StateDict": "stateful",
    "Stateful": "stateful",
}
_BOOTED = False


def _boot() -> None:
    """The package's eager import (the first use of a lazy name calls it): the at-fork reset first
    (:mod:`.forks`, which registers the exit's second drain, :mod:`.exitdrain`, after torch's and
    ``dist``'s atexit hooks: it runs before them), then every public module in the order the
    package's ``__init__`` imported them before it was lazy. No lock: two threads that get here
    at once import through the import system's locks and bind the same objects (a lock of ours,
    held across imports, could deadlock with a thread importing a submodule)."""
    global _BOOTED
    if _BOOTED:
        return
    from . import forks  # noqa: F401  (the at-fork reset, and at its end exitdrain's atexit call)

    g = globals()
    for name, mod in _WHERE.items():
        value = getattr(_importlib.import_module(f".{mod}", __name__), name)
        g["_doctor" if name == "doctor" else name] = value  # doctor: _Package.doctor (a submodule's name too)
    _BOOTED = True


_LAZY = frozenset(_WHERE) - {"doctor"}
assert _LAZY | {"doctor"} == set(__all__) - set(globals()), "a name of __all__ that neither _WHERE nor __init__ binds"


def __getattr__(name: str) -> Any:
    """PEP 562: a public name not bound yet (``tg.save``): :func:`_boot`, then the name. A submodule
    not imported yet (``tg.inspect.describe``, which the eager import had bound): imported, no boot
    (``from . import losthours`` in a command asks for it here first)."""
    if name in _LAZY:
        _boot()
        return globals()[name]
    if not name.startswith("__") and _importlib_util.find_spec(f"{__name__}.{name}") is not None:
        return _importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


class _Package(_types.ModuleType):
    """This package's module class: ``trainguard.doctor`` is the function ``doctor``, as it was, even
    after the submodule of that name was imported (``trainguard doctor``, a RAM tier's mount check),
    which binds the submodule to the package's attribute: that now lands in the setter, ignored."""

    @property
    def doctor(self) -> Any:
        _boot()
        return vars(self)["_doctor"]

    @doctor.setter
    def doctor(self, value: Any) -> None:
        if value is not _sys.modules.get(f"{__name__}.doctor"):  # a test's monkeypatch.setattr(tg, "doctor", ...)
            _boot()
            vars(self)["_doctor"] = value


_sys.modules[__name__].__class__ = _Package

# At exit (both torch-free at import): the save in flight and a RAM tier's copy are waited for (exitdrain,
# threading's hook); torch's defaults let go of a destroyed process group (staledefaults).
from . import exitdrain, staledefaults  # noqa: E402, F401

# The modules whose locks and pools forks._after_fork_in_child resets in a forked child.
_FORK_RESET = ("async_save", "stage", "gcpause", "io", "storage._direct", "storage.local", "replicas", "dist", "iostall")


def _fork_child() -> None:
    """``os.register_at_fork(after_in_child=...)``, registered at import: a child forked after code imported
    only deep modules (``from trainguard import io``: no public name used, so no :func:`_boot`, no
    :mod:`.forks`) still gets the fork reset: its first save hung on a buffer pool lock a thread of the parent
    held at the fork (``test_audit33``). When :mod:`.forks` was imported its own hook resets (this does nothing).
    Without torch imported (a process that only read checkpoints: ``trainguard.inspect``), only the torch-free
    modules' reset (:mod:`.forkreset`): :mod:`.forks` would import torch in the child."""
    if f"{__name__}.forks" not in _sys.modules and any(f"{__name__}.{m}" in _sys.modules for m in _FORK_RESET):
        if _imported("torch"):
            _importlib.import_module(".forks", __name__)._after_fork_in_child()
        else:  # no module of _FORK_RESET that imports torch is loaded
            _importlib.import_module(".forkreset", __name__).after_fork_in_child()


def _imported(name: str) -> bool:
    """Whether module ``name`` is imported whole (:func:`_fork_child`). A module another thread of the parent was
    importing at the fork (a torch-free read's first float8/uint16 tensor imports torch in a reader thread) is in
    ``sys.modules`` half-run, its import lock held for good in the child: importing :mod:`.forks` there (which
    imports torch) hung the child in its fork hook, before it ran a line of its own."""
    mod = _sys.modules.get(name)
    return mod is not None and not getattr(getattr(mod, "__spec__", None), "_initializing", False)


_os.register_at_fork(after_in_child=_fork_child)

install_excepthook()  # a worker of `trainguard run`: an error no restart fixes exits 78 (permanent.py)
