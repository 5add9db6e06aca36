"""A GAN: two models, two optimizers, two schedulers, one state."""
import argparse

import torch
from torch import nn

import trainguard as tg

Z = 8


def trainguard_state(root="ckpts/gan"):
    torch.manual_seed(0)
    netG = nn.Sequential(nn.Linear(Z, 32), nn.LeakyReLU(0.2), nn.Linear(32, 2))
    netD = nn.Sequential(nn.Linear(2, 32), nn.LeakyReLU(0.2), nn.Linear(32, 1))
    optG = torch.optim.Adam(netG.parameters(), lr=2e-4, betas=(0.5, 0.999))
    optD = torch.optim.Adam(netD.parameters(), lr=2e-4, betas=(0.5, 0.999))
    schedG = torch.optim.lr_scheduler.LambdaLR(optG, lambda it: 1.0 - it / 200)
    schedD = torch.optim.lr_scheduler.LambdaLR(optD, lambda it: 1.0 - it / 200)
    state = {"G": netG, "D": netD, "optG": optG, "optD": optD, "schedG": schedG, "schedD": schedD,
             "rng": tg.RNGState(), "iteration": tg.StateDict(it=0)}
    return state, {"root": root, "save": tg.EveryNSteps(20), "keep": tg.KeepLatest(2)}


def real_batch(n):
    theta = torch.rand(n) * 6.2832
    return torch.stack([theta.cos(), theta.sin()], 1) + 0.05 * torch.randn(n, 2)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--niter", type=int, default=100)
    args = ap.parse_args()
    state, settings = trainguard_state()
    netG, netD, optG, optD = state["G"], state["D"], state["optG"], state["optD"]
    schedG, schedD = state["schedG"], state["schedD"]
    bce = nn.BCEWithLogitsLoss()
    with tg.CheckpointManager(**settings) as mgr:
        it = mgr.restore(state)
        it = 0 if it is None else it + 1
        while it < args.niter:
            real = real_batch(64)
            fake = netG(torch.randn(64, Z))
            lossD = bce(netD(real), torch.ones(64, 1)) + bce(netD(fake.detach()), torch.zeros(64, 1))
            optD.zero_grad()
            lossD.backward()
            optD.step()
            lossG = bce(netD(fake), torch.ones(64, 1))
            optG.zero_grad()
            lossG.backward()
            optG.step()
            schedD.step()
            schedG.step()
            state["iteration"]["it"] = it
            mgr.save(it, state)
            it += 1


if __name__ == "__main__":
    main()
