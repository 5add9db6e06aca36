"""Data-file bytes of a ``split_state=True`` save whose ranks share a block (expert parallelism
on plain tensors): 4 ranks, each its own group, every rank holding a 512x512 ``shared`` Linear
and one small expert of its own, AdamW after one step. Prints the bytes of the data files and
the bytes the manifest references (docs/distributed.md, "Cost with many groups").

    PYTHONPATH=src python -m bench.split_dedup_sizes [world]
"""

from __future__ import annotations

import os
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))


def _rank(rank: int, world: int, root: str) -> None:
    import torch
    from torch import nn

    import trainguard as tg

    torch.manual_seed(0)
    m = nn.Module()
    m.shared = nn.Linear(512, 512)
    m.experts = nn.ModuleDict({str(rank): nn.Linear(16, 16)})
    opt = torch.optim.AdamW(m.parameters(), lr=0.01)
    for p in m.parameters():
        p.grad = torch.full_like(p, 0.5)
    opt.step()
    tg.save(f"{root}/step-1", {"model": m, "optim": opt}, split_state=True)


def main() -> None:
    from trainguard.manifest import Manifest

    from dist_helper import run_ranks

    world = int(sys.argv[1]) if len(sys.argv) > 1 else 4
    root = tempfile.mkdtemp(prefix="split-dedup-", dir=os.environ.get("TMPDIR"))
    run_ranks(_rank, world, root, timeout=120)
    ck = os.path.join(root, "step-1")
    files = sum(os.path.getsize(os.path.join(ck, f)) for f in os.listdir(ck) if f.startswith("data"))
    with open(os.path.join(ck, "manifest.json"), "rb") as f:
        ref = sum(c.length for e in Manifest.from_bytes(f.read()).tensors.values() for c in e.chunks)
    print(f"world {world}: data files {files} bytes ({files / 1e6:.2f} MB); the manifest references {ref} ({ref / 1e6:.2f} MB)")


if __name__ == "__main__":
    main()
