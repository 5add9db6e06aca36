"""trainguard: checkpointing and fault tolerance for PyTorch training.

The public surface is what ``__all__`` lists; nothing else is imported from deep paths.
"""

from __future__ import annotations

__version__ = "0.1.0"

from . import forks as _forks  # noqa: E402, F401  (registers the at-fork reset)
from .api import load, save  # noqa: E402
from .daly import DalyInterval  # noqa: E402
from .doctor import Finding  # noqa: E402
from .doctor import doctor as doctor  # noqa: E402
from .entrydrop import DroppedEntryWarning  # noqa: E402
from .errors import (  # noqa: E402
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
from .gradwatch import PendingGradientsWarning  # noqa: E402
from .handle import SaveHandle  # noqa: E402
from .inspect import verify  # noqa: E402
from .iostall import StuckWriteError  # noqa: E402
from .manager import CheckpointManager  # noqa: E402
from .optim_hparams import OptimizerSettingsWarning  # noqa: E402
from .permanent import PERMANENT_EXIT, exit_code_for, install_excepthook  # noqa: E402
from .policies import (  # noqa: E402
    EveryNSteps,
    EverySeconds,
    KeepAll,
    KeepBest,
    KeepEvery,
    KeepLatest,
    RetentionPolicy,
    SavePolicy,
)
from .replicas import ReplicasDifferWarning  # noqa: E402
from .sampler import ResumableIterable, ResumableSampler  # noqa: E402
from .seeded import SeededDataset, ignore_stop_signals  # noqa: E402
from .stateful import RNGState, StateDict, Stateful  # noqa: E402

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

# At exit: the save in flight and a RAM tier's copy are waited for (exitdrain); torch's defaults let go of a
# destroyed process group (staledefaults).
from . import exitdrain, staledefaults  # noqa: E402, F401

install_excepthook()  # a worker of `trainguard run`: an error no restart fixes exits 78 (permanent.py)
