"""torch.save / torch.load and safetensors. With several ranks, rank 0 writes everything and
every rank reads the whole file (the usual DDP recipe for these formats)."""

from __future__ import annotations

import inspect
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from .base import Ctx, LoadVariant, SyncMethod
from .states import State


def _copy_into(state: State, loaded: State) -> None:
    with torch.no_grad():
        for k, t in state.items():
            t.copy_(loaded[k])


def _torch_save(ctx: Ctx, d: Path, state: State) -> None:
    if ctx.rank == 0:
        torch.save(state, d / "state.pt")


def _torch_load(ctx: Ctx, d: Path, state: State) -> State:
    return torch.load(d / "state.pt", weights_only=True)


def _torch_load_mmap_copy(ctx: Ctx, d: Path, state: State) -> None:
    loaded = torch.load(d / "state.pt", weights_only=True, mmap=True)
    _copy_into(state, loaded)


def _st_save(ctx: Ctx, d: Path, state: State) -> None:
    if ctx.rank == 0:
        save_file(state, str(d / "state.safetensors"))


# safetensors >= 0.8: load_file's default backend="mmap" returns tensors over a lazy memory map
# (nothing is read until touched); backend="pread" reads eagerly into new memory, which is what
# "load into new tensors" means here. The +copy_ variant keeps the default backend.
_PREAD = "backend" in inspect.signature(load_file).parameters
_ST_NEW = "load_file(backend=pread)" if _PREAD else "load_file"


def _st_load(ctx: Ctx, d: Path, state: State) -> State:
    if _PREAD:
        return load_file(str(d / "state.safetensors"), backend="pread")
    return load_file(str(d / "state.safetensors"))


def _st_load_copy(ctx: Ctx, d: Path, state: State) -> None:
    _copy_into(state, load_file(str(d / "state.safetensors")))


TORCH_SAVE = SyncMethod(
    name="torch_save",
    label="torch.save",
    save=_torch_save,
    loads=(
        LoadVariant("torch.load", _torch_load, False,
                    "torch.load(weights_only=True): returns new tensors (not copied into the model)"),
        LoadVariant("torch.load(mmap)+copy_", _torch_load_mmap_copy, True,
                    "torch.load(weights_only=True, mmap=True), then copy_ into the existing tensors "
                    "(the copy is what actually reads the file)"),
    ),
    how="torch.save(dict, file) (zip + pickle), no fsync of its own",
    multi_rank="rank 0 writes the whole state; every rank reads the whole file",
)

SAFETENSORS = SyncMethod(
    name="safetensors",
    label="safetensors",
    save=_st_save,
    loads=(
        LoadVariant(_ST_NEW, _st_load, False,
                    f"safetensors.torch.{_ST_NEW}: reads into new tensors (the default mmap backend "
                    "would read nothing until the tensors are touched)"),
        LoadVariant("load_file+copy_", _st_load_copy, True,
                    "load_file (default backend), then copy_ into the existing tensors"),
    ),
    how="safetensors.torch.save_file(dict, file), no fsync of its own",
    multi_rank="rank 0 writes the whole state; every rank reads the whole file",
)
