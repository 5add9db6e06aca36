"""Shapes of the benchmark states (numpy only, so the parent process need not import torch).

- ``100mb``: a GPT-like model, parameters only (~111 MB at scale 1, 40 tensors).
- ``gpt``: a GPT-like model of ~1.03 GB fp32 plus AdamW ``exp_avg`` and ``exp_avg_sq``
  (~3.1 GB, 408 tensors).
- ``small10k``: 10,000 tensors of 4 KB-1 MB, log-uniform sizes (~1.9 GB at scale 1).

``scale`` multiplies byte sizes and keeps tensor counts (dimensions shrink by sqrt(scale)).
Names use dots only, no slashes, so every library accepts them unchanged. All fp32.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

Shapes = list[tuple[str, tuple[int, ...]]]


@dataclass(frozen=True)
class GptShape:
    d: int
    layers: int
    vocab: int
    ctx: int
    adam: bool


_GPT_100MB = GptShape(d=768, layers=3, vocab=8000, ctx=512, adam=False)
_GPT_1GB = GptShape(d=1280, layers=11, vocab=32000, ctx=1024, adam=True)


def _scaled(shape: GptShape, scale: float) -> GptShape:
    f = math.sqrt(scale)
    return GptShape(
        d=max(8, round(shape.d * f / 8) * 8),
        layers=shape.layers,
        vocab=max(8, round(shape.vocab * f)),
        ctx=max(8, round(shape.ctx * f)),
        adam=shape.adam,
    )


def gpt_param_shapes(s: GptShape) -> Shapes:
    d = s.d
    out: Shapes = [("wte.weight", (s.vocab, d)), ("wpe.weight", (s.ctx, d))]
    for i in range(s.layers):
        p = f"h.{i}."
        out += [
            (p + "ln_1.weight", (d,)), (p + "ln_1.bias", (d,)),
            (p + "attn.c_attn.weight", (3 * d, d)), (p + "attn.c_attn.bias", (3 * d,)),
            (p + "attn.c_proj.weight", (d, d)), (p + "attn.c_proj.bias", (d,)),
            (p + "ln_2.weight", (d,)), (p + "ln_2.bias", (d,)),
            (p + "mlp.c_fc.weight", (4 * d, d)), (p + "mlp.c_fc.bias", (4 * d,)),
            (p + "mlp.c_proj.weight", (d, 4 * d)), (p + "mlp.c_proj.bias", (d,)),
        ]
    out += [("ln_f.weight", (d,)), ("ln_f.bias", (d,))]
    return out


def _gpt_shapes(shape: GptShape) -> Shapes:
    params = gpt_param_shapes(shape)
    out = [("model." + n, sh) for n, sh in params]
    if shape.adam:
        out += [("optim.exp_avg." + n, sh) for n, sh in params]
        out += [("optim.exp_avg_sq." + n, sh) for n, sh in params]
    return out


def _small_shapes(n: int, scale: float, seed: int) -> Shapes:
    rng = np.random.default_rng(seed)
    nbytes = np.exp(rng.uniform(math.log(4096), math.log(1 << 20), size=n)) * scale
    return [(f"t{i:05d}", (max(1, int(b) // 4),)) for i, b in enumerate(nbytes)]


def state_shapes(name: str, scale: float, n_small: int, seed: int) -> Shapes:
    if name == "100mb":
        return _gpt_shapes(_scaled(_GPT_100MB, scale))
    if name == "gpt":
        return _gpt_shapes(_scaled(_GPT_1GB, scale))
    if name == "small10k":
        return _small_shapes(n_small, scale, seed)
    raise ValueError(f"unknown state {name!r}")


def shapes_bytes(shapes: Shapes) -> int:
    return sum(4 * math.prod(sh) for _n, sh in shapes)
