"""DDP under torchrun: a step-based loop over a resumable sampler, warmup+cosine LR."""
import argparse
import math
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset

import trainguard as tg

G = torch.Generator().manual_seed(0)  # the data: the same in every process
DATA = TensorDataset(torch.randn(256, 8, generator=G), torch.randn(256, 1, generator=G))


def trainguard_state(root="ckpts/ddp_steps", ddp=False):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 32), nn.Dropout(0.1), nn.ReLU(), nn.Linear(32, 1))
    model = DDP(net) if ddp else net
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    warmup, total = 5, 40
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, total) / total)))
    sampler = tg.ResumableSampler(DATA, seed=0)
    state = {"model": model, "optim": opt, "sched": sched, "data": sampler,
             "rng": tg.RNGState(), "progress": tg.StateDict(step=0)}
    return state, {"root": root, "save": tg.EveryNSteps(10), "keep": tg.KeepLatest(2)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=40)
    args = ap.parse_args()
    dist.init_process_group("gloo")
    state, settings = trainguard_state(ddp=True)
    model, opt, sched, sampler = state["model"], state["optim"], state["sched"], state["data"]
    loader = DataLoader(DATA, batch_size=8, sampler=sampler, generator=torch.Generator())
    with tg.CheckpointManager(**settings) as mgr:
        start = mgr.restore(state)
        step = 0 if start is None else start + 1
        while step < args.steps:
            for x, y in loader:
                loss = nn.functional.mse_loss(model(x), y)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                sched.step()
                sampler.advance(len(x))
                state["progress"]["step"] = step
                mgr.save(step, state)
                step += 1
                if step >= args.steps or mgr.should_stop:
                    break
            else:
                sampler.next_epoch()
            if mgr.should_stop:
                break
    dist.destroy_process_group()
    raise SystemExit(mgr.exit_code if os.environ.get("RANK", "0") == "0" else 0)


if __name__ == "__main__":
    main()
