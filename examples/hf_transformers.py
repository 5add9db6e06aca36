"""A Hugging Face ``transformers`` model trained with trainguard checkpoints, then exported to a
safetensors file that ``transformers`` loads. A tiny randomly initialised GPT-2 (no download).
A resume (run it again with more ``--steps``) is bit-identical to a run that never stopped: the
RNG (token draws, dropout) is saved with the model and optimizer.

    python examples/hf_transformers.py --dir ckpts/hf --out hf_export
    python examples/hf_transformers.py --dir ckpts/hf --out hf_export --steps 8   # resumes
    trainguard doctor examples/hf_transformers.py   # checks what trainguard_state() returns

The token batches are drawn from torch's RNG, which ``tg.RNGState()`` saves: that is this loop's
data position (the doctor's "data position" warning asks for a sampler; a real loop adds one). The
learning rate is constant: the doctor's warning of an optimizer saved without a scheduler does not
apply.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import torch
from transformers import GPT2Config, GPT2LMHeadModel

import trainguard as tg
from trainguard.convert import convert


def trainguard_state(root: str = "ckpts/hf") -> tuple[dict[str, Any], dict[str, Any]]:
    """The training state and the manager's settings: main() trains with them, and
    ``trainguard doctor`` calls this to check them."""
    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=64, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    state = {"model": model, "optim": opt, "rng": tg.RNGState(), "progress": tg.StateDict(step=-1)}
    return state, {"root": root, "save": tg.EveryNSteps(2), "keep": tg.KeepLatest(3)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default="ckpts/hf")
    ap.add_argument("--out", default="hf_export")
    ap.add_argument("--steps", type=int, default=4)
    args = ap.parse_args()

    state, settings = trainguard_state(args.dir)
    model, opt = state["model"], state["optim"]
    config = model.config
    with tg.CheckpointManager(**settings) as mgr:
        start = mgr.restore(state)
        for step in range(0 if start is None else start + 1, args.steps):
            ids = torch.randint(0, 100, (4, 16))
            loss = model(input_ids=ids, labels=ids).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
            state["progress"]["step"] = step
            mgr.save(step, state, force=step == args.steps - 1)
            if mgr.should_stop:  # SIGTERM/SIGINT (a preemption): this step was just saved; exit now
                break
        mgr.wait()
        ckpt = os.path.join(args.dir, f"step-{mgr.last_saved_step:09d}")
    if mgr.should_stop:
        print(f"stopped at step {state['progress']['step']}, saved step {mgr.last_saved_step}")
        return

    # Export: config.json + model.safetensors is a directory transformers loads.
    os.makedirs(args.out, exist_ok=True)
    config.save_pretrained(args.out)
    convert(ckpt, os.path.join(args.out, "model.safetensors"), entry="model")
    loaded = GPT2LMHeadModel.from_pretrained(args.out)
    ids = torch.randint(0, 100, (2, 10))
    model.eval()
    with torch.no_grad():
        same = torch.equal(model(input_ids=ids).logits, loaded(input_ids=ids).logits)
    print(f"exported {ckpt} to {args.out}; transformers reloaded it, logits equal = {same}")


if __name__ == "__main__":
    main()
