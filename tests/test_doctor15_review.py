"""``trainguard doctor`` on real training scripts, second pass (review): excerpts of popular
scripts as fixtures, each with where it came from."""

from __future__ import annotations

from trainguard.doctor import Finding, Settings
from trainguard.doctor_rng import reseed
from trainguard.doctor_source import single_rank


def _rank(src: str) -> Finding:
    f = single_rank([], Settings(source=src))
    assert f is not None
    return f


# https://github.com/pytorch/examples/blob/main/imagenet/main.py (excerpt): with one process per
# GPU, the first rank of each node (args.rank % ngpus_per_node == 0) saves; on one node, rank 0 alone.
IMAGENET = """\
import torch
def main_worker(gpu, ngpus_per_node, args):
    for epoch in range(args.start_epoch, args.epochs):
        if not args.multiprocessing_distributed or (args.multiprocessing_distributed
                and args.rank % ngpus_per_node == 0):
            save_checkpoint({
                'epoch': epoch + 1,
                'state_dict': model.state_dict(),
                'optimizer' : optimizer.state_dict(),
            }, is_best)
def save_checkpoint(state, is_best, filename='checkpoint.pth.tar'):
    torch.save(state, filename)
"""


def test_the_first_rank_of_each_node_saving_is_a_rank0_save() -> None:
    f = _rank(IMAGENET)
    assert f.severity == "warning" and "line 6" in f.message and "torch.save" in f.message, f  # was "ok"
    collective = IMAGENET.replace("torch.save(state, filename)", "mgr.save(state['epoch'], state)")
    assert _rank(collective).severity == "error"
    assert _rank(IMAGENET.replace("ngpus_per_node == 0", "2 == 0")).severity == "ok"  # every other rank: no rank 0 test
