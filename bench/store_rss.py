"""Memory of saves to an object store: RSS after each of N manager saves, and the peak (VmHWM).

``python -m bench.store_rss [--saves 20] [--mib 384]``: a ``CheckpointManager`` on ``s3://tgtest/rss-<id>``
(``KeepLatest(2)``) saves a state of ``--mib`` MiB (4 MiB tensors) ``--saves`` times; printed: RSS before the
first save, after each save, after ``malloc_trim(0)``, and the process's peak. The store is the one the boto
environment names (``AWS_ENDPOINT_URL``, ...: a SeaweedFS server as ``tests/test_storage_s3.py`` starts it).
"""

from __future__ import annotations

import argparse
import ctypes
import uuid


def _vm(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) // 1024
    return -1


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--saves", type=int, default=20)
    p.add_argument("--mib", type=int, default=384)
    a = p.parse_args()
    import torch

    import trainguard as tg

    torch.manual_seed(0)
    state = {"model": {f"w{i}": torch.randn(1 << 20) for i in range(a.mib // 4)}}
    url = f"s3://tgtest/rss-{uuid.uuid4().hex[:8]}"
    print(f"state {a.mib} MiB; RSS before the saves {_vm('VmRSS')} MiB")
    after = []
    with tg.CheckpointManager(url, save=tg.EveryNSteps(1), keep=tg.KeepLatest(2), handle_signals=False) as mgr:
        for step in range(1, a.saves + 1):
            mgr.save(step, state)
            after.append(_vm("VmRSS"))
    print(f"RSS after each save (MiB): {after}")
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    print(f"RSS after malloc_trim {_vm('VmRSS')} MiB; peak (VmHWM) {_vm('VmHWM')} MiB")


if __name__ == "__main__":
    main()
