"""The benchmark's settings: one small record, passed from ``run`` to every worker as JSON."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

ALL_STATES = ("100mb", "gpt", "small10k", "ddp")
QUICK_STATES = ("100mb",)
# Every method, in run order (bench.methods holds them and checks this list against itself).
METHOD_NAMES = ("torch_save", "safetensors", "dcp_t1", "dcp_t2", "trainguard", "raw_1", "raw_2", "raw_d2",
                "memcpy",
                "dcp_async", "dcp_async_reuse", "dcp_async_bgstage", "trainguard_async", "trainguard_async_bg")


def wanted(filters: tuple[str, ...]) -> list[str]:
    """The methods a ``--methods`` filter selects: exact names or prefixes (``dcp``, ``trainguard``)."""
    if not filters:
        return list(METHOD_NAMES)
    unknown = [f for f in filters if not any(n.startswith(f) for n in METHOD_NAMES)]
    if unknown:
        raise ValueError(f"unknown method(s) {unknown}; choose from {list(METHOD_NAMES)}")
    return [n for n in METHOD_NAMES if any(n.startswith(f) for f in filters)]


@dataclass(frozen=True)
class Config:
    scale: float = 1.0            # multiplies every state's byte size; tensor counts are kept
    reps: int = 3                 # steady-state repetitions; one extra first repetition precedes them
    states: tuple[str, ...] = ALL_STATES
    methods: tuple[str, ...] = ()  # empty: all; else names or prefixes (see methods.ALL_NAMES)
    step_seconds: float = 0.5     # compute time of one training step in the async-stall loop
    cold: str = "auto"            # auto | drop_caches | fadvise | none
    n_small: int = 10_000         # tensor count of the "small10k" state
    ddp_base: str = "gpt"         # the state each of the 2 DDP ranks holds (a full replica)
    tmp: str = "bench/.tmp"
    async_timeout_s: float = 900.0  # bound on one async save's completion
    seed: int = 0
    notes: tuple[str, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if not 0 < self.scale <= 4:
            raise ValueError(f"scale must be in (0, 4], got {self.scale}")
        if self.reps < 1:
            raise ValueError("reps must be at least 1 (one first repetition runs before them)")
        bad = [s for s in self.states if s not in ALL_STATES]
        if bad:
            raise ValueError(f"unknown state(s) {bad}; choose from {list(ALL_STATES)}")
        if self.cold not in ("auto", "drop_caches", "fadvise", "none"):
            raise ValueError("cold must be auto, drop_caches, fadvise or none")
        if self.ddp_base not in ("100mb", "gpt", "small10k"):
            raise ValueError("ddp_base must be 100mb, gpt or small10k")
        if self.step_seconds <= 0:
            raise ValueError("step_seconds must be positive")

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_file(cls, path: Path) -> Config:
        raw = json.loads(path.read_text())
        for k in ("states", "methods", "notes"):
            raw[k] = tuple(raw[k])
        return cls(**raw)
