"""``save(metrics=...)`` values: a meta tensor is refused as a metric with trainguard's message (before:
torch's bare RuntimeError from ``.item()`` out of ``mgr.save``), and any real number is taken
(``np.longdouble``, whose ``.item()`` is itself, was refused as "not a number")."""

from __future__ import annotations

import fractions
from pathlib import Path

import numpy as np
import pytest
import torch

import trainguard as tg
from trainguard.policies import metric_values


def test_real_numbers_of_every_kind_are_stored_as_python_numbers() -> None:
    got = metric_values({"a": np.longdouble(1.5), "b": torch.tensor(2.0), "c": np.int64(3), "d": fractions.Fraction(1, 4)})
    assert got == {"a": 1.5, "b": 2.0, "c": 3, "d": 0.25}
    assert [type(v) for v in got.values()] == [float, float, int, float]


def test_a_meta_tensor_metric_fails_the_save_with_trainguards_message_and_keeps_the_previous(tmp_path: Path) -> None:
    model = torch.nn.Linear(2, 2)
    with tg.CheckpointManager(tmp_path / "run", save=tg.EveryNSteps(1), handle_signals=False) as mgr:
        mgr.save(1, {"model": model}, metrics={"loss": 0.5})
        with pytest.raises(tg.UnsupportedValueError, match=r"metrics\['loss'\].*device='meta'"):
            mgr.save(2, {"model": model}, metrics={"loss": torch.empty((), device="meta")})
        assert mgr.latest_step() == 1
