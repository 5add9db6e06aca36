"""A small GPT over bytes and the corpus it reads: the standard library's ``.py`` files.

Pure single-process code; the worker script (:mod:`.train`) wraps it for data parallelism.
"""

from __future__ import annotations

import math
import os
import sysconfig
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

SIZES = {
    # name: (layers, heads, width, context, batch per rank)
    "tiny": (1, 2, 32, 32, 4),
    "demo": (4, 4, 256, 64, 4),
}


@dataclass(frozen=True)
class GPTConfig:
    n_layer: int = 4
    n_head: int = 4
    d_model: int = 128
    context: int = 64
    vocab: int = 256  # bytes
    dropout: float = 0.1

    @classmethod
    def named(cls, size: str) -> GPTConfig:
        if size not in SIZES:
            raise ValueError(f"size {size!r}: choose one of {', '.join(SIZES)}")
        n_layer, n_head, d, ctx, _ = SIZES[size]
        return cls(n_layer=n_layer, n_head=n_head, d_model=d, context=ctx)


class Block(nn.Module):
    def __init__(self, c: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(c.d_model)
        self.attn = nn.Linear(c.d_model, 3 * c.d_model)
        self.proj = nn.Linear(c.d_model, c.d_model)
        self.ln2 = nn.LayerNorm(c.d_model)
        self.mlp = nn.Sequential(nn.Linear(c.d_model, 4 * c.d_model), nn.GELU(), nn.Linear(4 * c.d_model, c.d_model))
        self.drop = nn.Dropout(c.dropout)
        self.n_head = c.n_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.attn(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.n_head, d // self.n_head).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(d // self.n_head)
        mask = torch.ones(t, t, dtype=torch.bool).tril()
        att = self.drop(att.masked_fill(~mask, float("-inf")).softmax(-1))
        y = (att @ v).transpose(1, 2).reshape(b, t, d)
        x = x + self.drop(self.proj(y))
        return x + self.drop(self.mlp(self.ln2(x)))


class TinyGPT(nn.Module):
    """Decoder-only transformer over bytes (dropout everywhere, so the RNG matters on resume)."""

    def __init__(self, c: GPTConfig) -> None:
        super().__init__()
        self.config = c
        self.tok = nn.Embedding(c.vocab, c.d_model)
        self.pos = nn.Embedding(c.context, c.d_model)
        self.drop = nn.Dropout(c.dropout)
        self.blocks = nn.ModuleList(Block(c) for _ in range(c.n_layer))
        self.ln = nn.LayerNorm(c.d_model)
        self.head = nn.Linear(c.d_model, c.vocab, bias=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.drop(self.tok(idx) + self.pos(torch.arange(idx.shape[1])))
        for blk in self.blocks:
            x = blk(x)
        logits = self.head(self.ln(x))
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1))


def stdlib_corpus(max_bytes: int = 2_000_000) -> torch.Tensor:
    """The first ``max_bytes`` of the standard library's ``.py`` files, in sorted path order."""
    root = sysconfig.get_paths()["stdlib"]
    out, total = [], 0
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "test", "tests", "__pycache__"))
        for name in sorted(filenames):
            if not name.endswith(".py"):
                continue
            try:
                with open(os.path.join(dirpath, name), "rb") as f:
                    data = f.read(max_bytes - total)
            except OSError:
                continue
            out.append(data)
            total += len(data)
            if total >= max_bytes:
                return torch.frombuffer(bytearray(b"".join(out)), dtype=torch.uint8).long()
    if total < 10_000:
        raise RuntimeError(f"found only {total} bytes of Python sources under {root}")
    return torch.frombuffer(bytearray(b"".join(out)), dtype=torch.uint8).long()


class Windows:
    """Non-overlapping windows of ``context + 1`` bytes: sample ``i`` is ``(x, y)`` at ``i * context``."""

    def __init__(self, data: torch.Tensor, context: int) -> None:
        self.data, self.context = data, context

    def __len__(self) -> int:
        return (len(self.data) - 1) // self.context

    def batch(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        rows = torch.stack([self.data[i * self.context : i * self.context + self.context + 1] for i in indices])
        return rows[:, :-1], rows[:, 1:]
