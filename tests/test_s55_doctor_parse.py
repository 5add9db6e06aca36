"""The doctor parses a script once for all its static checks, and a source Python cannot parse
(nesting too deep for its parser) is reported as not checked instead of raising RecursionError
out of ``tg.doctor``/``doctor.check``."""

from __future__ import annotations

import ast

import torch

import trainguard as tg
from trainguard import doctor_parse
from trainguard.doctor import Settings, check

SCRIPT = """
import torch
import trainguard as tg

model = torch.nn.Linear(4, 4)
opt = torch.optim.AdamW(model.parameters())
mgr = tg.CheckpointManager("ck", save=tg.every_n_steps(10))

def trainguard_state():
    return {"model": model, "optim": opt}, mgr

if __name__ == "__main__":
    mgr.restore({"model": model, "optim": opt})
    for step in range(100):
        opt.step()
        mgr.save(step, {"model": model, "optim": opt})
"""


def test_the_checks_share_one_parse_of_the_script(monkeypatch):
    parses: list[int] = []
    real = ast.parse

    def counting(source, *a, **k):
        parses.append(len(source))
        return real(source, *a, **k)

    monkeypatch.setattr(ast, "parse", counting)
    doctor_parse._parse.cache_clear()
    model = torch.nn.Linear(4, 4)
    findings = check({"model": model, "optim": torch.optim.AdamW(model.parameters())}, Settings(source=SCRIPT))
    assert findings  # the checks ran on the state and the source
    assert parses.count(len(SCRIPT)) == 1, f"the script was parsed {parses.count(len(SCRIPT))} times"


def test_a_source_too_deep_to_parse_is_reported_not_raised():
    deep = "x = " + "+".join(["1"] * 200_000) + "\n"  # Python's parser gives up with RecursionError
    try:
        ast.parse(deep)
    except RecursionError:
        pass
    else:  # pragma: no cover - a Python whose parser takes it: nothing to test
        import pytest

        pytest.skip("this Python parses the expression")
    model = torch.nn.Linear(4, 4)
    findings = tg.doctor({"model": model, "optim": torch.optim.SGD(model.parameters(), lr=0.1)}, source=deep)
    source = [f for f in findings if f.check == "script source"]
    assert len(source) == 1 and source[0].severity == "info", findings
    assert "too deeply nested" in source[0].message


def test_a_script_with_a_syntax_error_is_said_not_checked():
    model = torch.nn.Linear(4, 4)
    findings = check({"model": model}, Settings(source="def broken(:\n    pass\n"))
    (f,) = [f for f in findings if f.check == "script source"]
    assert "line 1" in f.message and "does not parse" in f.message


def test_a_script_that_parses_gets_no_source_finding():
    model = torch.nn.Linear(4, 4)
    assert not [f for f in check({"model": model}, Settings(source=SCRIPT)) if f.check == "script source"]


PASSED = """
import torch
import trainguard as tg

noise = torch.Generator().manual_seed(11)

def add_noise(x, gen, scale=0.1):
    return x + scale * torch.randn(x.shape, generator=gen)

class Aug:
    def jitter(self, x, *, g):
        return x + torch.rand(x.shape, generator=g)

aug = Aug()
state = {"model": model, "optim": opt, "rng": tg.RNGState(%s)}
with tg.CheckpointManager("ckpts", save=tg.EveryNSteps(4)) as mgr:
    start = mgr.restore(state)
    for step in range(0 if start is None else start + 1, 100):
        x = %s
        model(x).sum().backward()
        opt.step()
        mgr.save(step, state)
"""


def _own(src: str) -> list:
    from trainguard.doctor_source import check_source

    return [f for f in check_source(Settings(source=src)) if f.check == "own generators"]


def test_doctor_sees_a_generator_the_loop_passes_to_a_function_that_draws():
    for call in ("add_noise(torch.zeros(4, 8), noise)", "add_noise(torch.zeros(4, 8), gen=noise)",
                 "aug.jitter(torch.zeros(4, 8), g=noise)"):
        (f,) = _own(PASSED % ("", call))
        assert f.severity == "warning" and "`noise`" in f.message and "generator=g" in f.message, (call, f)
        (f,) = _own(PASSED % ('generators={"noise": noise}', call))
        assert f.severity == "ok", (call, f)


def test_doctor_leaves_a_passed_generator_that_the_function_reseeds():
    src = PASSED.replace("    return x + scale", "    gen.manual_seed(0)\n    return x + scale")
    assert _own(src % ("", "add_noise(torch.zeros(4, 8), noise)")) == []
