"""Hunt 54 (review54c): a hostile review of session 53's DCP import of unflattened checkpoints,
doctor's own-generator report and RankFailureError's readable text."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

import trainguard as tg
from trainguard import CheckpointError
from trainguard.convert import convert


def _save_unflat(state: dict, path: Path, **kw) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=str(path), planner=DefaultSavePlanner(flatten_state_dict=False), **kw)


def _convert(src: Path, dst: Path) -> dict:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return convert(src, dst)


def test_unflattened_dcp_of_parameters_imports_them(tmp_path: Path) -> None:
    """``model.state_dict(keep_vars=True)`` (or ``dict(model.named_parameters())``) saved unflattened:
    its pickle holds ``nn.Parameter``s. The whole entry was skipped (the checkpoint refused as
    "holds no tensors that trainguard can read"), as if a Parameter were no tensor."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    _save_unflat({"model": model.state_dict(keep_vars=True), "step": 3}, tmp_path / "dcp", no_dist=True)
    res = _convert(tmp_path / "dcp", tmp_path / "ck" / "step-000000003")
    assert res["skipped"] == []
    fresh = torch.nn.Linear(4, 3)
    state = {"model": fresh, "step": 0}
    tg.load(tmp_path / "ck" / "step-000000003", state)
    assert torch.equal(fresh.weight, model.weight) and torch.equal(fresh.bias, model.bias)
    assert state["step"] == 3


def _fsdp_unflat_save(rank: int, world: int, path: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from dist_helper import small_model

    m = small_model("fsdp", 0)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    msd, osd = get_state_dict(m, opt)
    # a plain tensor beside the DTensors: the import had something to write, and dropped the model
    dcp.save({"model": msd, "scale": torch.tensor(2.0)}, checkpoint_id=path,
             planner=DefaultSavePlanner(flatten_state_dict=False))


def test_unflattened_dcp_of_dtensors_is_refused_saying_what_to_do(tmp_path: Path) -> None:
    """2 gloo ranks save an FSDP2 model's DTensors with ``flatten_state_dict=False``: DCP pickles the
    entry whole, one rank's copy (its shards only). The import wrote a checkpoint of ``scale``
    alone, exit 0, the model listed among "entries that are neither tensors nor JSON values".
    Now it is refused, naming the key and the planner to save with."""
    from dist_helper import run_ranks

    run_ranks(_fsdp_unflat_save, 2, str(tmp_path / "dcp"), timeout=120)
    with pytest.raises(CheckpointError) as ei:
        _convert(tmp_path / "dcp", tmp_path / "ck" / "step-000000001")
    msg = str(ei.value)
    assert "'model'" in msg and "DTensor" in msg and "flatten_state_dict" in msg, msg
    assert not (tmp_path / "ck" / "step-000000001").exists()


class _NoStr(Exception):
    """An exception whose ``str()`` raises (a C extension's error with a broken ``__str__``)."""

    def __str__(self) -> str:
        raise RuntimeError("__str__ of _NoStr failed")


class _Broken:
    def __init__(self, exc: BaseException | None) -> None:
        self.exc = exc

    def state_dict(self) -> dict:
        if self.exc is not None:
            raise self.exc
        return {"n": 1}

    def load_state_dict(self, sd: dict) -> None:
        pass


def _load_failing_on_rank1(rank: int, world: int, path: str) -> tuple[str, str]:
    tg.save(path, {"w": torch.ones(3), "obj": _Broken(None)}, timeout=60)
    state = {"w": torch.zeros(3), "obj": _Broken(None)}
    if rank == 1:
        state["obj"].load_state_dict = lambda sd: (_ for _ in ()).throw(_NoStr())  # type: ignore[method-assign]
    try:
        tg.load(path, state, timeout=60)
    except Exception as e:
        try:
            return type(e).__name__, str(e)
        except Exception:
            return type(e).__name__, "<str() failed>"
    return "", ""


def test_a_rank_error_whose_str_raises_reaches_every_rank(tmp_path: Path) -> None:
    """Rank 1's load_state_dict() raises an exception whose ``str()`` raises. ``describe_error``
    (the text a rank sends the others) called ``str(e)`` unguarded: rank 1 raised the RuntimeError
    of ``__str__`` from inside trainguard, and rank 0 said rank 1 "left this trainguard call before
    'load' ... (an exception or a Ctrl-C caught on that rank)". Now rank 1 raises its own error and
    rank 0 a RankFailureError naming rank 1's exception type."""
    from dist_helper import run_ranks

    res = run_ranks(_load_failing_on_rank1, 2, str(tmp_path / "ck"), timeout=120)
    kind, text = res[1].value
    assert kind != "RuntimeError", text
    kind, text = res[0].value
    assert kind == "RankFailureError" and "--- rank 1 ---" in text and "_NoStr" in text, text[:2000]
    assert "left this trainguard call" not in text, text[:2000]


def _traceback_of(e: BaseException) -> str:
    from trainguard.errors import describe_error

    try:
        raise e
    except BaseException as caught:
        return describe_error(caught)


def test_rank_failure_text_is_bounded_and_names_every_rank() -> None:
    """64 ranks each failing with a 100 KB message (a different one each): the RankFailureError's text
    held every one whole, 6.4 MB. Now each is cut in its middle (start and end kept, the whole in
    ``failures``) and the text stays within tens of KB, every rank named."""
    from trainguard.errors import failure

    fails = {r: _traceback_of(ValueError(f"rank {r} could not write\n" + "x" * 100_000 + f"\nfix {r}: free disk")) for r in range(64)}
    err = failure(f"save failed on rank(s) {list(range(64))}", fails)
    text = str(err)
    assert len(text) < 64_000, len(text)
    for r in range(64):
        assert f"--- rank {r} ---\nValueError: rank {r} could not write" in text
        assert f"fix {r}: free disk" in text  # the end, where a message says what to change
        assert err.failures[r] == fails[r]  # whole
    assert "RankFailureError.failures[5]" in text


def test_ranks_that_failed_alike_are_one_block() -> None:
    """64 ranks with the same error (a full disk) repeated it 64 times; now once, under every rank number."""
    from trainguard.errors import failure

    same = _traceback_of(OSError(28, "No space left on device"))
    fails = {r: same for r in range(64) if r != 40}
    fails[40] = _traceback_of(ValueError("something else"))
    text = str(failure("save failed", fails))
    assert text.count("No space left on device") == 1, text
    assert "--- ranks 0-39, 41-63 ---\nOSError: [Errno 28] No space left on device" in text, text
    assert "--- rank 40 ---\nValueError: something else" in text, text


def test_a_multiline_and_non_utf8_rank_error_reads_whole() -> None:
    """Checked, sound before too (kept as a guard of the cut above): a short error of several lines,
    with a lone surrogate (a non-UTF-8 file name), is shown whole."""
    from trainguard.errors import failure

    msg = "bad name b'\\xff' \udcff here\nsecond line: do this"
    text = str(failure("load failed", {3: _traceback_of(ValueError(msg))}))
    assert text == f"load failed\n--- rank 3 ---\nValueError: {msg}", text


# --- trainguard doctor, "worker randomness" (doctor_augment) -------------------------------------------------

DOC_HEAD = """
import random
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset
"""


def _worker(body: str, loader: str = "loader = DataLoader(DS(64), batch_size=4, num_workers=2)\n") -> list:
    import textwrap

    from trainguard.doctor import Settings, check

    src = DOC_HEAD + textwrap.dedent(body) + "\n" + loader
    return [f for f in check({}, Settings(source=src)) if f.check == "worker randomness"]


def test_a_generator_used_by_a_method_only_init_calls_is_not_reported() -> None:
    """``__init__`` calls ``self._shuffle()``, which shuffles an index list once with the dataset's
    generator, in the main process: it was reported as a per-sample draw in the workers."""
    got = _worker("""
    class DS(Dataset):
        def __init__(self, n):
            self.rng = np.random.default_rng(0)
            self.idx = list(range(n))
            self._shuffle()

        def _shuffle(self):
            self.rng.shuffle(self.idx)

        def __len__(self):
            return len(self.idx)

        def __getitem__(self, i):
            return self.idx[i]
    """)
    assert got == [], got


def test_a_transform_objects_draws_are_reported() -> None:
    """A transform class (``__call__``) the dataset is given draws from the global generator, or from
    its own: the check looked at dataset classes only and said nothing."""
    body = """
    class Jitter:
        def __init__(self):
            self.rng = np.random.default_rng(0)

        def __call__(self, x):
            return x * self.rng.uniform(0.9, 1.1)

    class Flip:
        def __call__(self, x):
            return -x if random.random() < 0.5 else x

    class DS(Dataset):
        def __init__(self, n, transform=None):
            self.transform = transform

        def __len__(self):
            return 8

        def __getitem__(self, i):
            return self.transform(float(i))
    """
    (f,) = _worker(body, "loader = DataLoader(DS(64, transform=Jitter()), batch_size=4, num_workers=2)\n")
    assert f.severity == "warning" and "self.rng.uniform(0.9, 1.1) in Jitter.__call__" in f.message, f
    assert "SeededDataset" in f.fix, f
    (f,) = _worker(body, "flip = Flip()\nloader = DataLoader(DS(64, transform=flip), batch_size=4, num_workers=2)\n")
    assert f.severity == "warning" and "random.random() in Flip.__call__" in f.message, f


def test_a_helper_function_or_imported_draw_is_reported() -> None:
    """A module-level helper the dataset calls draws from the global generator; and draws spelt
    through imports (``from random import randint``, ``import numpy.random as npr``): none seen."""
    (f,) = _worker("""
    def jitter(x):
        return x * np.random.uniform(0.9, 1.1)

    class DS(Dataset):
        def __len__(self):
            return 8

        def __getitem__(self, i):
            return jitter(float(i))
    """)
    assert f.severity == "warning" and "np.random.uniform(0.9, 1.1) in jitter" in f.message, f
    (f,) = _worker("""
    from random import randint
    import numpy.random as npr

    class DS(Dataset):
        def __len__(self):
            return 8

        def __getitem__(self, i):
            return i + randint(0, 3) + npr.rand()
    """)
    assert f.severity == "warning" and "randint(0, 3) in DS.__getitem__" in f.message, f


def test_an_unseeded_generator_made_per_sample_is_reported_even_with_seeded_dataset() -> None:
    """``np.random.default_rng()`` made in ``__getitem__`` without a seed takes fresh OS entropy for
    every sample: no resume (and no SeededDataset) draws the same again. It was not reported."""
    body = """
    import trainguard as tg

    class DS(Dataset):
        def __len__(self):
            return 8

        def __getitem__(self, i):
            rng = np.random.default_rng()
            return i * rng.uniform(0.9, 1.1)
    """
    (f,) = _worker(body)
    assert f.severity == "warning" and "np.random.default_rng() in DS.__getitem__" in f.message and "seed" in f.fix, f
    (f,) = _worker(body, "loader = DataLoader(tg.SeededDataset(DS(64), seed=0), batch_size=4, num_workers=2)\n")
    assert f.severity == "warning" and "np.random.default_rng()" in f.message, f


def test_seeded_dataset_in_a_comment_is_not_its_use_and_annotated_generators_count() -> None:
    (f,) = _worker("""
    # TODO: wrap in SeededDataset
    class DS(Dataset):
        def __init__(self, n):
            self.rng: np.random.Generator = np.random.default_rng(0)

        def __len__(self):
            return 8

        def __getitem__(self, i):
            return i * self.rng.uniform()
    """)
    assert f.severity == "warning" and "self.rng.uniform() in DS.__getitem__" in f.message, f


def test_doctor_cli_on_a_script_python_cannot_compile_says_so(tmp_path: Path) -> None:
    """A 50,000-term expression: Python's parser gives up with a RecursionError (the script cannot run
    either); ``trainguard doctor`` ended in that traceback, not in an error line."""
    from click.testing import CliRunner

    from trainguard.cli import main

    script = tmp_path / "train.py"
    script.write_text("x = " + "+".join(["1"] * 50_000) + "\n")
    r = CliRunner().invoke(main, ["doctor", str(script)])
    assert r.exit_code != 0 and not isinstance(r.exception, RecursionError), r.output
    assert "too deeply nested" in r.output and str(script) in r.output, r.output


def test_a_function_called_to_build_the_datasets_input_is_not_worker_code() -> None:
    """Guard of the above (sound before too): ``DS(load(64))`` runs ``load`` in the main process."""
    got = _worker("""
    def load(n):
        return np.random.rand(n, 3)

    class DS(Dataset):
        def __init__(self, x):
            self.x = x

        def __len__(self):
            return len(self.x)

        def __getitem__(self, i):
            return self.x[i]
    """, "loader = DataLoader(DS(load(64)), batch_size=4, num_workers=2)\n")
    assert got == [], got
