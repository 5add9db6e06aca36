"""The doctor's "save mid-accumulation" check (``doctor.check`` and ``doctor_source.check_source``
call it, through ``doctor_source.accum``, on the script's source): with gradient
accumulation, a checkpoint saved between two optimizer steps holds the weights of the last step
and a data position past the micro-batches whose gradients sit in ``.grad``, which no checkpoint
holds: a resume drops their contribution to the next step.

Four shapes are read: a loop whose optimizer step is inside an accumulation test
(``if (i + 1) % accum == 0:``, ``if accelerator.sync_gradients:``), or inside accelerate's
``with accelerator.accumulate(model):`` (which skips the step but at a window's end), and whose save is not inside
any ``if``, so it runs on every micro-batch (unless it follows that ``if`` and saves a step counted
there, in optimizer steps: the manager saves each step once); a loop that skips to its next micro-batch
before the step (``if (i + 1) % accum != 0: continue``) and saves before that ``continue``; and a save inside an inner micro-batch loop that calls
``backward()`` but not the optimizer's step, which the enclosing loop makes (nanoGPT's layout,
with the save moved one loop in). A save under any ``if`` of its loop is not reported.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from .doctor_parse import walk

if TYPE_CHECKING:
    from .doctor import Finding, Settings

_LOOPS = (ast.For, ast.AsyncFor, ast.While)
_SAVES = {"save", "save_checkpoint", "save_state", "async_save"}


def _direct(loop: ast.AST) -> Iterator[ast.AST]:
    """The nodes of a loop's body and else, not those of nested loops, functions or classes."""
    for stmt in [*loop.body, *loop.orelse]:  # type: ignore[attr-defined]
        yield stmt
        if not isinstance(stmt, (*_LOOPS, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            yield from _below(stmt)


def _below(node: ast.AST) -> Iterator[ast.AST]:
    for child in ast.iter_child_nodes(node):
        yield child
        if not isinstance(child, (*_LOOPS, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            yield from _below(child)


def _is_step(c: ast.AST) -> bool:
    """``optimizer.step()``, ``self.opt.step()``, ``scaler.step(opt)``: not a scheduler's step."""
    from .doctor_source import _callee, _receiver

    if not isinstance(c, ast.Call):
        return False
    who = (_receiver(c) or "").lower()
    return _callee(c) == "optimizer_step" or _callee(c) == "step" and ("opt" in who or "scaler" in who)


def _is_save(c: ast.AST) -> bool:
    from .doctor_rank import _EXPORTS, _FOREIGN_SAVES
    from .doctor_source import _callee, _receiver

    return isinstance(c, ast.Call) and _callee(c) in _SAVES and _receiver(c) not in _FOREIGN_SAVES | _EXPORTS


def _accum_test(t: ast.expr) -> bool:
    """``(i + 1) % accum == 0``, ``step % args.gradient_accumulation_steps``, ``accelerator.sync_gradients``."""
    for x in ast.walk(t):
        if isinstance(x, ast.BinOp) and isinstance(x.op, ast.Mod):
            return True
        name = x.id if isinstance(x, ast.Name) else x.attr if isinstance(x, ast.Attribute) else ""
        if "accum" in name.lower() or "sync_grad" in name.lower():
            return True
    return False


def _skip_until_step(loop: ast.AST) -> ast.If | None:
    """The guard clause of a loop that steps the optimizer after it: ``if (i + 1) % accum != 0:
    continue`` among the loop's own statements, after one that calls ``backward()`` and followed by one
    that calls the optimizer's step. A save before it runs on every micro-batch; one after it, at
    optimizer steps only. A guard before the backward skips a whole batch, not an optimizer step (``if i
    % world_size != rank: continue``, ``if i < start % len(loader): continue``): reported as
    accumulation until session 57's review57k, a warning on a script that steps on every batch it trains."""
    body = loop.body  # type: ignore[attr-defined]
    for k, stmt in enumerate(body):
        if isinstance(stmt, ast.If) and _accum_test(stmt.test) and not stmt.orelse and \
                all(isinstance(b, (ast.Continue, ast.Pass, ast.Expr)) for b in stmt.body) and \
                any(isinstance(b, ast.Continue) for b in stmt.body) and \
                any(_has_backward(earlier) for earlier in body[:k]) and \
                any(_is_step(x) for later in body[k + 1:] for x in ast.walk(later)):
            return stmt
    return None


def _has_backward(node: ast.AST) -> bool:
    from .doctor_source import _callee

    return any(isinstance(c, ast.Call) and _callee(c) == "backward" for c in ast.walk(node))


def _name(x: ast.AST | None) -> str | None:
    return x.id if isinstance(x, ast.Name) else x.attr if isinstance(x, ast.Attribute) else None


def _after_counted(save: ast.Call, step_if: ast.If) -> bool:
    """A save after the optimizer's ``if`` whose step argument counts optimizer steps (``completed_steps
    += 1`` in that ``if``): its step changes only at an optimizer step, and the manager saves a step
    once (``mgr.save(completed_steps, state)`` after the ``if``, in every micro-batch, is fine)."""
    arg = save.args[0] if save.args else next((k.value for k in save.keywords if k.arg == "step"), None)
    counted = {_name(t) for n in ast.walk(step_if) if isinstance(n, (ast.AugAssign, ast.Assign))
               for t in (n.targets if isinstance(n, ast.Assign) else [n.target])}
    return save.lineno > (step_if.end_lineno or step_if.lineno) and _name(arg) in counted - {None}


def _accumulate_block(nodes: list[ast.AST], tree: ast.Module) -> ast.With | None:
    """accelerate's ``with accelerator.accumulate(model):`` among a loop's nodes, unless every
    ``Accelerator(...)`` of the script visibly accumulates over one micro-batch (no
    ``gradient_accumulation_steps=``/``gradient_accumulation_plugin=``/``**kw``, or a literal 1):
    then ``optimizer.step()`` inside it steps on every micro-batch."""
    from .doctor_source import _callee

    block = next((n for n in nodes if isinstance(n, (ast.With, ast.AsyncWith)) and any(
        isinstance(i.context_expr, ast.Call) and _callee(i.context_expr) == "accumulate" for i in n.items)), None)
    makers = [c for c in walk(tree) if isinstance(c, ast.Call) and _callee(c) == "Accelerator"]

    def one(c: ast.Call) -> bool:
        kw = {k.arg: k.value for k in c.keywords}
        n = kw.get("gradient_accumulation_steps")
        return not c.args and None not in kw and "gradient_accumulation_plugin" not in kw and (
            n is None or isinstance(n, ast.Constant) and n.value == 1)
    return None if block is None or makers and all(one(c) for c in makers) else block  # type: ignore[return-value]


def mid_accumulation(leaves: list[tuple[str, Any]], s: Settings) -> Finding | None:
    """A warning for a save that runs between the micro-batches of one optimizer step (module doc);
    ``None`` without source, or without a loop that both saves and accumulates."""
    from .doctor import Finding
    from .doctor_source import _tree

    if (tree := _tree(s)) is None:
        return None
    hits: list[tuple[ast.Call, str]] = []
    checked = False
    loops = [n for n in walk(tree) if isinstance(n, _LOOPS)]
    for loop in loops:
        nodes = list(_direct(loop))
        gated = {id(x) for n in nodes if isinstance(n, ast.If) for x in ast.walk(n) if x is not n}
        saves = [c for c in nodes if _is_save(c)]
        if not saves or not _has_backward(loop):
            continue
        checked, saves = True, [c for c in saves if id(c) not in gated]
        if not saves:
            continue
        steps = [n for n in nodes if isinstance(n, ast.If) and _accum_test(n.test)
                 and any(_is_step(x) for x in ast.walk(n))]
        if (window := _accumulate_block(nodes, tree)) is not None and not steps:
            tests = [n for n in nodes if isinstance(n, ast.If) and _accum_test(n.test)]
            hits += [(c, f"`with {ast.unparse(window.items[0].context_expr)}:` (line {window.lineno}) steps "
                         "the optimizer only at the end of each accumulation window (accelerator.sync_gradients)")
                     for c in saves if not any(_after_counted(c, n) for n in tests)]
            continue
        if steps:
            hits += [(c, f"the optimizer steps only under `if {ast.unparse(steps[0].test)}:` (line "
                         f"{steps[0].lineno})") for c in saves if not _after_counted(c, steps[0])]
            continue
        if (skip := _skip_until_step(loop)) is not None:  # `if (i + 1) % accum != 0: continue`, then the step
            hits += [(c, f"the optimizer steps only past `if {ast.unparse(skip.test)}: continue` (line "
                         f"{skip.lineno})") for c in saves if c.lineno < skip.lineno]
            continue
        if any(_is_step(x) for x in ast.walk(loop)):
            continue
        outer = [o for o in loops if o is not loop and any(x is loop for x in ast.walk(o))
                 and any(_is_step(x) for x in _direct(o))]
        if outer:
            step = next(x for x in _direct(outer[-1]) if _is_step(x))
            hits += [(c, f"the loop it is in (line {loop.lineno}) calls backward() on micro-batches and the "
                         f"optimizer steps after it (line {step.lineno})") for c in saves]
    if not hits:
        return Finding("save mid-accumulation", "ok", "no save between the micro-batches of one optimizer step") \
            if checked else None
    c, why = min(hits, key=lambda h: h[0].lineno)
    return Finding("save mid-accumulation", "warning", f"line {c.lineno}: {ast.unparse(c)} runs on every "
                   f"micro-batch, but {why}: a checkpoint taken between two optimizer steps holds no accumulated "
                   "gradients (.grad is not saved) yet counts their micro-batches as consumed, so a resume "
                   "drops them from the next step", "save right after the optimizer step: move the save into "
                   "the block that calls optimizer.step(), and count steps in optimizer steps")
