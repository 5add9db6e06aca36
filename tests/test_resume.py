"""Resume equivalence: 2N steps straight == N steps, save, restore in a new process, N more."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import TESTS, run_py


def _run(tmp, name, *, root, stop, total=24, every=12):
    out = str(tmp / name)
    r = run_py([str(TESTS / "trainlib.py"), "--root", str(root), "--total", str(total), "--stop", str(stop),
                "--every", str(every), "--out", out])
    assert r.returncode == 0, r.stderr
    return torch.load(out + ".pt", weights_only=True), json.load(open(out + ".json"))


@pytest.mark.slow  # suite time (~15 s): test_examples (plain loop) and test_demo resume in a new process bit-identically in make test
def test_resume_in_new_process_is_bit_identical(tmp_path):
    straight, s_log = _run(tmp_path, "straight", root=tmp_path / "a", stop=24)
    first, f_log = _run(tmp_path, "first", root=tmp_path / "b", stop=12)
    assert f_log["start"] == 0
    # The state after the first half differs from the final one: the comparison below means something.
    assert not torch.equal(first["model.fc1.weight"], straight["model.fc1.weight"])
    second, r_log = _run(tmp_path, "second", root=tmp_path / "b", stop=24)
    assert r_log["start"] == 12
    assert f_log["losses"] + r_log["losses"] == s_log["losses"]
    assert straight.keys() == second.keys()
    for k in straight:
        assert torch.equal(straight[k], second[k]), k
