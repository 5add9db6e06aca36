"""The doctor: common checkpointing mistakes in a training script's state and settings, with fixes.

Two ways in: :func:`doctor` at run time (``tg.doctor(state, manager)``, any rank, prints
nothing, returns findings), and ``trainguard doctor train.py`` (:mod:`trainguard.commands.plan`),
which imports the script, calls its ``trainguard_state()`` hook and prints a table. Both end in
the pure :func:`check`, which takes the state and a :class:`Settings` record, so every check is
testable without a manager, a process group or a real filesystem.

Nothing here imports the manager: it is read by duck typing (``.root``, ``.save_policy``,
``.keep``, ``.async_save``). A check that lacks what it needs (no manager, no plan, no script
source) is left out of the result rather than reported as passed. The static checks on the
script's source that need more than a glance live in :mod:`trainguard.doctor_source`.
"""

from __future__ import annotations

import ast
import os
import re
import sys
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import losthours
from .doctor_parse import notebook, walk
from .doctor_storage import storage_check as _storage
from .doctor_torchfree import class_names
from .reliability import Plan, format_duration  # Plan: in the globals, for typing.get_type_hints(tg.doctor)

FAR = 3.0  # an interval more than FAR times off the optimum is reported
@dataclass(frozen=True)
class Finding:
    """One check's verdict. ``severity`` is ``"error"``, ``"warning"``, ``"ok"``, or ``"info"``: the check
    applies but lacks an input to decide (the message says which)."""

    check: str
    severity: str
    message: str
    fix: str = ""


@dataclass
class Settings:
    """What the checks know besides the state. ``None`` means unknown (the check detects or skips)."""

    root: str | None = None  # the checkpoint directory
    save_policy: Any = None
    keep: Any = None  # the retention policy
    async_save: bool = False
    stage_in_background: bool = False  # async saves copy tensors after save() returns (docs/async.md)
    plan: Plan | None = None  # from reliability.make_plan: stall, step time, failure rate
    amp: str | bool | None = None  # "float16" / True, "bfloat16", False; None: detect
    backend: str | None = None  # accepted for compatibility; no check needs it (saves coordinate through the store)
    source: str | None = None  # the training script's text, for the static checks
    path: str | None = None  # the script's file: its imports of the project's own modules are read too
    mountinfo: str | None = None  # /proc/self/mountinfo text; None: read it


def doctor(state: Mapping[str, Any], manager: Any = None, *, plan: Plan | None = None,
           source: str | os.PathLike[str] | None = "auto", amp: str | bool | None = None) -> list[Finding]:
    """Check ``state`` and ``manager`` (a CheckpointManager or a mapping of its settings).

    ``source="auto"`` reads the ``__main__`` script, if there is one, for the static checks (``source``: the
    script's text, the path of a ``.py`` file, or a ``pathlib.Path`` of the script, any name);
    ``plan`` enables the interval check. Returns one :class:`Finding` per check that could run.
    Any process or rank, once the state (and manager) exist; no collective, no I/O but reads.
    """
    if plan is not None and not isinstance(plan, Plan):
        raise TypeError(f"plan={plan!r}: pass trainguard.reliability.make_plan(...), or None")
    if amp not in (None, True, False, "float16", "bfloat16"):
        raise ValueError(f"amp={amp!r}: use 'float16' (or True), 'bfloat16', False, or None to detect")
    # A pathlib.Path (Path(__file__)): the script's path, whatever its name; it was refused ("pass ... its path").
    path_given = isinstance(source, os.PathLike) and isinstance(os.fspath(source), str)
    source = os.fspath(source) if isinstance(source, os.PathLike) and path_given else source
    if source is not None and not isinstance(source, str):
        raise TypeError(f"source={source!r}: pass the training script's text or its path, 'auto' (the __main__ script) or None")
    main_file = (getattr(sys.modules.get("__main__"), "__file__", None) or "") if source == "auto" and not path_given else ""
    if source is not None and str(source).strip().endswith(".ipynb") and "\n" not in str(source):  # JSON: parsed as a dict
        raise ValueError(f"source={source!r} is a Jupyter notebook: export it (jupyter nbconvert --to script) and pass the .py")
    if source is not None and (path_given or source != "auto" and "\n" not in source and source.strip().endswith(".py")):
        # A path ("train.py"), not the script's text: parsed as Python, it was a one-line program, and the
        # static checks found nothing in it (an optimizer missing from the state, own generators: not reported).
        if not os.path.isfile(main_file := source if path_given else source.strip()):
            raise FileNotFoundError(f"source={source!r}: no such file; pass the training script's text or its path")
        source = Path(main_file).read_text(encoding="utf-8", errors="replace")
    if source == "auto":  # its imports of the project's own modules are read too (path=)
        source = Path(main_file).read_text(encoding="utf-8", errors="replace") if main_file.endswith(".py") \
            and os.path.isfile(main_file) else None
    if source is not None and notebook(source):  # its JSON, as text or in a .py (the CLI refused that one; this said ok)
        raise ValueError("source= holds a Jupyter notebook's JSON, not Python: export it (jupyter nbconvert --to script)")
    return check(state, settings_from(manager, plan=plan, source=source, amp=amp, path=(main_file or None) if source else None))


def settings_from(manager: Any = None, **overrides: Any) -> Settings:
    """Read a manager (attributes) or a mapping (keys: root, save/save_policy, keep, async_save, ...)."""
    def get(name: str) -> Any:
        return manager.get(name) if isinstance(manager, Mapping) else getattr(manager, name, None)

    if manager is not None and not isinstance(manager, Mapping) and not any(
            hasattr(manager, a) for a in ("root", "save_policy", "keep")):
        raise TypeError(f"manager={manager!r}: pass a CheckpointManager or a dict of its settings (root, save, keep, ...)")
    s = Settings()
    if manager is not None:
        root = get("root")
        s.root = None if root is None else os.fspath(root)
        s.save_policy = get("save_policy") if get("save_policy") is not None else get("save")
        s.keep, s.async_save = get("keep"), bool(get("async_save"))
        s.stage_in_background = bool(get("stage_in_background"))
        if isinstance(manager, Mapping):  # a dict of settings: what it leaves out is CheckpointManager's default
            from .policies import EveryNSteps, KeepLatest

            s.save_policy = EveryNSteps(1000) if s.save_policy is None else s.save_policy
            s.keep = KeepLatest(3) if s.keep is None else s.keep
        for name in ("plan", "amp", "backend"):
            if get(name) is not None:
                setattr(s, name, get(name))
    for k, v in overrides.items():
        if v is not None:
            setattr(s, k, v)
    return s


def check(state: Mapping[str, Any], settings: Settings) -> list[Finding]:
    """Run every check that applies; pure except for reading mountinfo/torch.distributed when unset."""
    if not isinstance(state, Mapping):
        raise TypeError(f"the state must be a dict of named objects, got {type(state).__name__}")
    leaves = list(_walk(state))
    from .doctor_datapos import data_position as _data
    from .doctor_source import source_checks

    checks: list[Callable[[list[tuple[str, Any]], Settings], Finding | None]] = [
        _model, _optim_sched, _rng, _data, _amp, _retention, _interval, _storage, _async_pg, *source_checks()]
    found = [f for c in checks if (f := c(leaves, settings)) is not None]
    from .doctor_parse import unparsable

    if why := unparsable(settings.source):  # the source checks skipped it: say so rather than pass it silently
        found.append(Finding("script source", "info", f"the script's source was not checked: it does not parse ({why})",
                             "pass the training script's text, as Python 3 parses it"))
    return found


def _walk(obj: Any, path: str = "", depth: int = 0) -> Iterator[tuple[str, Any]]:
    """(path, value) for every value in nested dicts/lists/tuples of the state (objects not entered)."""
    if isinstance(obj, Mapping) and depth < 5:
        for k, v in obj.items():
            p = f"{path}/{k}" if path else str(k)
            yield p, v
            yield from _walk(v, p, depth + 1)
    elif isinstance(obj, (list, tuple)) and depth < 5:
        for i, v in enumerate(obj):
            yield f"{path}/{i}", v
            yield from _walk(v, f"{path}/{i}", depth + 1)


def _name(x: Any) -> str:
    return type(x).__name__


def _is_optimizer(x: Any) -> bool:
    return hasattr(x, "param_groups") and callable(getattr(x, "state_dict", None)) and not hasattr(x, "optimizer")


def _is_scheduler(x: Any) -> bool:
    return hasattr(x, "optimizer") and callable(getattr(x, "state_dict", None)) and (
        hasattr(x, "last_epoch") or hasattr(x, "get_last_lr") or "Scheduler" in _name(x))


def _own_stateful(leaves: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
    """Objects with load_state_dict that are no module, optimizer, scheduler, RNG state or scaler."""
    return [(p, x) for p, x in leaves if callable(getattr(x, "load_state_dict", None)) and not (
        _is_optimizer(x) or _is_scheduler(x) or hasattr(x, "parameters") or _name(x) in ("RNGState", "GradScaler"))]


def _model(leaves: list[tuple[str, Any]], s: Settings) -> Finding:
    import torch

    found = [(p, x) for p, x in leaves if isinstance(x, torch.nn.Module)] or [
        (p, x) for p, x in leaves if isinstance(x, torch.Tensor) and "rng" not in p.lower()]
    if found:
        return Finding("model", "ok", f"model weights saved ({found[0][0]}: {_name(found[0][1])})")
    own = [(p, x) for p, x in _own_stateful(leaves) if "Sampler" not in _name(x) and "DataLoader" not in _name(x)]
    why = "no nn.Module and no tensor in the state"
    fix = 'add the model: state["model"] = model'
    if own:
        return Finding("model", "warning", f"{why}, unless {own[0][0]} ({_name(own[0][1])}) holds the weights", fix)
    return Finding("model", "error", f"{why}: a resume starts from the initial weights", fix)


def _optim_sched(leaves: list[tuple[str, Any]], s: Settings) -> Finding:
    opts = [(p, x) for p, x in leaves if _is_optimizer(x)]
    scheds = [(p, x) for p, x in leaves if _is_scheduler(x)]
    name = "optimizer+scheduler"
    snaps = [p for p, x in leaves if isinstance(x, Mapping) and ({"param_groups", "state"} <= x.keys()
                                                                 or {"last_epoch", "base_lrs"} <= x.keys())]
    if snaps:  # a dict is saved and loaded as data: nothing ever puts it back into the optimizer/scheduler
        return Finding(name, "error", f"{snaps[0]} is a copy of an optimizer's or scheduler's state_dict(), "
                       "not the object: it is frozen when taken and a resume never loads it back",
                       'put the object itself in the state: state["optim"] = optimizer')
    if scheds and not opts:
        return Finding(name, "error", f"the LR scheduler ({scheds[0][0]}) is saved but its optimizer is not: "
                       "a resume restarts Adam moments/momentum from zero", 'add the optimizer: state["optim"] = optimizer')
    lost = [p for p, sc in scheds if not any(sc.optimizer is o for _, o in opts)]
    if lost:
        return Finding(name, "error", f"the scheduler at {lost[0]} drives an optimizer that is not in the state",
                       "save the optimizer the scheduler was built with")
    from .doctor_optcover import uncovered, unsaved_scheduler

    if opts and (miss := uncovered(leaves, s) or unsaved_scheduler(leaves, s)) is not None:
        return miss
    if opts and not scheds:
        return Finding(name, "warning", f"the optimizer ({opts[0][0]}) is saved without an LR scheduler: "
                       "a resume restarts warmup/decay from the beginning",
                       'add it: state["sched"] = lr_scheduler (ignore if the learning rate is constant)')
    if opts:
        return Finding(name, "ok", "optimizer and scheduler saved together")
    built = next(_calls(s.source, _optimizer_names()), None)
    if built is not None:
        return Finding(name, "error", f"the script builds an optimizer (line {built.lineno}: "
                       f"{ast.unparse(built.func)}) but the state has none: a resume restarts its "
                       "moments/momentum from zero", 'add it: state["optim"] = optimizer')
    return Finding(name, "ok", "no optimizer in the state")


def _optimizer_names() -> set[str]:
    """The names of torch.optim's optimizer classes (``AdamW``, ``SGD``...), whose calls the source checks
    look for. Where torch is not imported (``trainguard doctor`` on a script without ``trainguard_state()``
    reads its source only), the capitalized names of ``torch.optim.__all__`` but ``Optimizer``, read from
    its source (the same set: tests/test_hunt51_cli51.py), which saves the command torch's ~2 s."""
    if "torch" not in sys.modules and (names := class_names("optim/__init__.py", "Optimizer")) is not None:
        return set(names)
    import torch

    return {n for n, c in vars(torch.optim).items()
            if isinstance(c, type) and issubclass(c, torch.optim.Optimizer) and c is not torch.optim.Optimizer}


def _rng(leaves: list[tuple[str, Any]], s: Settings) -> Finding:
    hits = [p for p, x in leaves if _name(x) == "RNGState" or ("rng" in p.rsplit("/", 1)[-1].lower()
                                                               and not isinstance(x, (int, float, str, type(None))))]
    if hits:
        return Finding("rng", "ok", f"RNG state saved ({hits[0]})")
    return Finding("rng", "warning", "no RNG state: after a resume dropout masks, augmentations and sampling "
                   "differ from an uninterrupted run", 'add state["rng"] = tg.RNGState() (python, numpy, torch, CUDA)')


def _amp(leaves: list[tuple[str, Any]], s: Settings) -> Finding:
    scaler = [p for p, x in leaves if "GradScaler" in _name(x)]
    mode, why = s.amp, "as configured"
    if mode is None:
        mode, why = _amp_detect(leaves, s.source)
    if scaler:
        return Finding("amp", "ok", f"GradScaler saved ({scaler[0]})")
    if mode in (True, "float16", "unknown"):
        return Finding("amp", "error" if mode != "unknown" else "warning",
                       f"{'float16' if mode != 'unknown' else 'maybe float16 (a dtype chosen at run time)'} AMP in use "
                       f"({why}) but no GradScaler in the state: a resume restarts the loss scale at 65536, skipping "
                       "steps until it settles", 'add state["scaler"] = scaler (torch.amp.GradScaler)')
    return Finding("amp", "ok", "bfloat16 autocast needs no GradScaler" if mode == "bfloat16" else "no float16 AMP detected")


def _amp_detect(leaves: list[tuple[str, Any]], source: str | None) -> tuple[str | bool, str]:
    import torch

    for p, x in leaves:
        if isinstance(x, torch.nn.Module) and any(t.dtype == torch.float16 for t in x.parameters()):
            return "float16", f"{p} has float16 parameters"
    for call in _calls(source, {"autocast"}):
        kw = {k.arg: k.value for k in call.keywords if k.arg}
        if isinstance(kw.get("enabled"), ast.Constant) and kw["enabled"].value is False:
            continue  # autocast(..., enabled=False): no AMP
        text = ast.unparse(call)
        if "bfloat16" in text or "bf16" in text:
            return "bfloat16", f"line {call.lineno}: {text}"
        if "float16" in text or "half" in text:
            return "float16", f"line {call.lineno}: {text}"
        if "dtype" in kw or len(call.args) > 1:  # autocast(device_type=..., dtype=ptdtype): nanoGPT's style
            return "unknown", f"line {call.lineno}: {text}"
        if "cpu" not in text:  # CUDA's autocast defaults to float16
            return "float16", f"line {call.lineno}: {text}"
        return "bfloat16", f"line {call.lineno}: {text}"  # CPU's autocast defaults to bfloat16
    return False, "not detected"


def _calls(source: str | None, names: set[str], tree: ast.AST | None = None) -> Iterator[ast.Call]:
    if tree is None:
        from .doctor_parse import parse

        if (tree := parse(source)) is None:
            return
    for n in walk(tree):
        if isinstance(n, ast.Call):
            f = n.func
            if (isinstance(f, ast.Attribute) and f.attr in names) or (isinstance(f, ast.Name) and f.id in names):
                yield n


def _retention(leaves: list[tuple[str, Any]], s: Settings) -> Finding | None:
    keep = s.keep
    if keep is None:
        return None
    parts = [keep, *getattr(keep, "policies", ())]
    ones = [p for p in parts if getattr(p, "n", None) == 1 and not hasattr(p, "metric")]
    n = getattr(s.save_policy, "n", None)
    n = n if isinstance(n, int) and n > 0 else None
    steps = [n * k if n else 1009 * k + 7 for k in range(1, 21)]  # what the save policy produces, or any
    kept, of = None, 0
    if callable(getattr(keep, "select", None)):
        from .policies import CheckpointInfo

        infos = [CheckpointInfo(step=st, created=float(k)) for k, st in enumerate(steps)]
        try:  # after each save the manager keeps the selection and the newest: the fewest, from two saves on
            kept, of = min((len(set(keep.select(infos[:i])) | {steps[i - 1]}), i) for i in range(2, 21))
        except Exception:  # a custom policy that needs metrics: judge by its attributes only
            kept = None
    if ones or (kept is not None and kept < 2):
        saved = f" saved every {n} steps" if n else ""
        what = f"{ones[0]!r} keeps one checkpoint" if ones else f"{keep!r} keeps {kept} of {of} checkpoints{saved}"
        return Finding("retention", "error", f"{what}: when the newest is incomplete or corrupt, "
                       "there is nothing to fall back to", "keep at least two recent ones: keep=tg.KeepLatest(2) "
                       "(combine with | KeepEvery/KeepBest for long-term copies)")
    return Finding("retention", "ok", f"{keep!r} keeps at least two recent checkpoints")


def _interval(leaves: list[tuple[str, Any]], s: Settings) -> Finding | None:
    pol, plan = s.save_policy, s.plan
    if pol is None:
        return None
    if _name(pol) == "DalyInterval":
        return Finding("interval", "ok", "DalyInterval adapts the interval to the measured stall and step time")
    if plan is None:
        return None
    if isinstance(getattr(pol, "n", None), int) and not plan.step_time_s:
        return Finding("interval", "info", f"not checked: {pol!r} counts steps and the plan has no step time "
                       f"(for a {format_duration(plan.stall_s)} stall and a job MTBF of "
                       f"{format_duration(plan.job_mtbf_s)} the optimum is {format_duration(plan.optimal_interval_s)} "
                       "of compute)", "give the step time to compare: trainguard doctor --step-time 2s, "
                       "or make_plan(step_time_s=...)")
    if isinstance(getattr(pol, "n", None), int):
        cur, what = pol.n * plan.step_time_s, f"every {pol.n} steps ({format_duration(pol.n * plan.step_time_s)})"
    elif isinstance(getattr(pol, "seconds", None), (int, float)):  # wall time from save to save: stall included
        cur = max(float(pol.seconds) - plan.stall_s, plan.step_time_s or 0.0)
        what = f"every {format_duration(pol.seconds)} of wall time ({format_duration(cur)} of compute)"
    else:
        return None
    opt, ratio = plan.optimal_interval_s, cur / plan.optimal_interval_s
    steps = plan.steps(opt)
    best = f"{format_duration(opt)}" + (f" = {steps} steps" if steps else "")
    e_cur, e_opt = plan.efficiency(cur), plan.efficiency(opt)
    gpus, unit = losthours.per_day(plan)  # node-hours for nodes without GPUs
    detail = (f"saving {what}; for a {format_duration(plan.stall_s)} stall, a job MTBF of "
              f"{format_duration(plan.job_mtbf_s)} and a {format_duration(plan.restart_s)} restart the optimum "
              f"is {best}: efficiency {100 * e_cur:.2f}% vs "
              f"{100 * e_opt:.2f}%, {(e_opt - e_cur) * gpus:,.0f} {unit}/day more lost")
    fix = (f"save every {best}" + (f": tg.EveryNSteps({steps})" if steps else "")
           + ", or use tg.DalyInterval(node_failures_per_day=..., nodes=...)")
    if ratio > FAR:
        return Finding("interval", "warning", f"too rare: {detail}", fix)
    if ratio < 1 / FAR:
        return Finding("interval", "warning", f"too frequent for the stall: {detail}", fix)
    return Finding("interval", "ok", f"within {FAR:g}x of the optimum: {detail}")


_OCTAL = re.compile(r"\\([0-7]{3})")  # parse_mountinfo: an escaped character of a mount point


def parse_mountinfo(text: str) -> list[tuple[str, str]]:
    """(mount point, filesystem type) per line of ``/proc/self/mountinfo``, in mount order."""
    out = []
    for line in text.splitlines():
        left, sep, right = line.partition(" - ")
        fields, rfields = left.split(), right.split()
        if sep and len(fields) >= 5 and rfields:
            # The kernel writes space, tab, newline and backslash as \ooo (octal); the rest of the path
            # as it is (UTF-8): "unicode_escape" read its bytes as Latin-1, so a mount point named
            # "/mnt/données x" was "/mnt/donnÃ©es x" and the path under it took its parent's filesystem.
            out.append((_OCTAL.sub(lambda m: chr(int(m[1], 8)), fields[4]), rfields[0]))
    return out


def filesystem_of(path: str, mounts: list[tuple[str, str]]) -> str | None:
    """The filesystem type of the deepest mount containing ``path`` (the last one mounted wins)."""
    best: tuple[int, str] | None = None
    for mp, fs in mounts:
        if path == mp or path.startswith(mp.rstrip("/") + "/"):
            if best is None or len(mp) >= best[0]:
                best = (len(mp), fs)
    return None if best is None else best[1]


def _async_pg(leaves: list[tuple[str, Any]], s: Settings) -> Finding:
    # Saves (the background commit included) coordinate through the c10d store, never through the
    # training process group (docs/async.md): an NCCL-only group is fine.
    return Finding("async", "ok", "async saves (coordinated through the c10d store: any process group backend)"
                   if s.async_save else "synchronous saves")
