"""Claims of docs/elastic.md, docs/distributed.md and examples/ checked against what the code does
(session 41's documentation audit)."""

from __future__ import annotations

import pytest
import torch

import trainguard as tg


@pytest.mark.parametrize("bad", [[1], None, "abc"], ids=["list", "None", "str"])
@pytest.mark.parametrize("policy", ["steps", "seconds"])
def test_manager_save_of_a_state_that_is_no_mapping_is_a_permanent_bad_argument(tmp_path, bad, policy):
    """docs/elastic.md, "Errors a restart will not fix": a bad argument such as "a state that is no
    mapping" exits 78. tg.save/tg.load/restore refused it so (UnsupportedValueError); the manager's
    save, on a step that saves and on one that does not, failed in gradwatch with
    ``AttributeError: 'list' object has no attribute 'values'`` (exit 1: restarted, requeued)."""
    save = tg.EveryNSteps(10) if policy == "steps" else tg.EverySeconds(3600)
    with tg.CheckpointManager(tmp_path / "run", save=save) as mgr:
        for step, force in ((1, False), (2, True)):
            with pytest.raises(tg.UnsupportedValueError, match="state must be a dict of named entries") as err:
                mgr.save(step, bad, force=force)
            assert tg.exit_code_for(err.value) == 78
        mgr.save(3, {"w": torch.ones(2)}, force=True)  # the manager goes on with a good state
        assert mgr.last_saved_step == 3
