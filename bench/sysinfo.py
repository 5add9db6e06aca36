"""A description of the machine a run was measured on (no torch import: read from metadata)."""

from __future__ import annotations

import os
import platform
import shutil
import sys
from importlib import metadata
from pathlib import Path

import psutil


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _fs_of(path: Path) -> str:
    best, fstype = "", "unknown"
    try:
        real = str(path.resolve())
        for line in Path("/proc/mounts").read_text().splitlines():
            dev, mnt, typ = line.split()[:3]
            if real.startswith(mnt) and len(mnt) > len(best):
                best, fstype = mnt, f"{typ} on {dev} ({mnt})"
    except OSError:
        pass
    return fstype


def _version(pkg: str) -> str:
    try:
        return metadata.version(pkg)
    except metadata.PackageNotFoundError:
        return "not installed"


def describe(tmp: Path) -> dict[str, object]:
    tmp.mkdir(parents=True, exist_ok=True)
    vm = psutil.virtual_memory()
    return {
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "cores_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "ram_gib": round(vm.total / 2**30, 1),
        "ram_available_gib": round(vm.available / 2**30, 1),
        "disk_free_gib": round(shutil.disk_usage(tmp).free / 2**30, 1),
        "filesystem": _fs_of(tmp),
        "kernel": platform.release(),
        "os": platform.platform(terse=True),
        "python": sys.version.split()[0],
        "torch": _version("torch"),
        "safetensors": _version("safetensors"),
        "numpy": _version("numpy"),
        "trainguard": _version("trainguard"),
        "loadavg_start": [round(x, 2) for x in os.getloadavg()],
    }
