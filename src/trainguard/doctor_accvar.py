"""The doctor's "loop accumulator" check (``doctor.check`` and ``doctor_source.check_source`` call it,
on the script's source): a ``ReduceLROnPlateau`` stepped with a value the loop sums in a variable of
its own (``epoch_loss += loss.item()`` ... ``plateau.step(epoch_loss)``), or gathers in a list of its own
(``losses.append(loss.item())`` ... ``plateau.step(sum(losses) / len(losses))``).

A checkpoint holds the state, not the loop's variables: a resume in the middle of an epoch starts
the sum again, so the plateau is fed the rest of the epoch alone and may set another learning rate
than the uninterrupted run did (seen: a critic's lr 0.0125 against 0.00625 from the step after a
resume at step 20 on, every tensor of the checkpoint restored exactly). Kept in the state
(``progress = tg.StateDict(step=0, epoch_loss=0.0)``, ``progress["epoch_loss"] += ...``) it
resumes (docs/checkpoints.md, "What is saved").
"""

from __future__ import annotations

import ast
from typing import TYPE_CHECKING, Any

from .doctor_parse import walk

if TYPE_CHECKING:
    from .doctor import Finding, Settings


def _plateaus(tree: ast.Module) -> set[str]:
    """The names (``plateau``, ``self.plateau`` as ``plateau``) bound to a ``ReduceLROnPlateau(...)``."""
    out = set()
    for n in walk(tree):
        if isinstance(n, (ast.Assign, ast.AnnAssign)) and isinstance(n.value, ast.Call) \
                and "ReduceLROnPlateau" in ast.unparse(n.value.func):
            for t in n.targets if isinstance(n, ast.Assign) else [n.target]:
                if isinstance(t, ast.Name):
                    out.add(t.id)
                elif isinstance(t, ast.Attribute):
                    out.add(t.attr)
    return out


def _calls(node: ast.AST, attr: str) -> bool:
    """Whether ``node`` holds a call of a method named ``attr`` (``mgr.save(...)``, ``loss.backward()``)."""
    return any(isinstance(c, ast.Call) and isinstance(c.func, ast.Attribute) and c.func.attr == attr
               for c in ast.walk(node))


def _trained(tree: ast.Module) -> set[int]:
    """The ids of the nodes whose innermost loop saves (a ``save()`` call in it, at any depth): a sum there
    spans steps a checkpoint may fall between. Where the script shows no ``save()`` call (a helper of its
    own saves), a loop that trains (``backward()``) counts. A validation pass's ``val_loss += ...``, and an
    epoch's training sum in a script that saves after the epoch (``mgr.save(epoch, state)`` in the epoch
    loop, around the batch loop), complete between two saves: the plateau reading them resumes as it ran
    (both were warned; the second from 3f74471 on)."""
    innermost: dict[int, ast.AST] = {}
    for loop in walk(tree):  # breadth first: an inner loop comes after the loops around it, and wins
        if isinstance(loop, (ast.For, ast.While)):
            for n in (n for stmt in loop.body for n in ast.walk(stmt)):
                innermost[id(n)] = loop
    saves = _calls(tree, "save")
    training = {id(loop) for loop in set(innermost.values())
                if _calls(loop, "save") or not saves and _calls(loop, "backward")}
    return {n for n, loop in innermost.items() if id(loop) in training}


def _one_name(n: ast.AST) -> bool:
    """An assignment to one plain name (``x = ...``)."""
    return isinstance(n, ast.Assign) and len(n.targets) == 1 and isinstance(n.targets[0], ast.Name)


def _reads(node: ast.AST) -> set[str]:
    """The plain names ``node`` reads."""
    return {x.id for x in ast.walk(node) if isinstance(x, ast.Name) and isinstance(x.ctx, ast.Load)}


def _target(n: ast.AST) -> str | None:
    """The plain name an assignment binds (``x += ...``, ``x = ...``); None otherwise."""
    if isinstance(n, ast.AugAssign) and isinstance(n.target, ast.Name):
        return n.target.id
    return n.targets[0].id if _one_name(n) else None  # type: ignore[attr-defined]


def _gathered(n: ast.AST) -> str | None:
    """The plain name a statement gathers values in (``losses.append(loss.item())``, ``.extend(...)``,
    ``.insert(...)``); None otherwise."""
    if isinstance(n, ast.Expr) and isinstance(n.value, ast.Call) and isinstance(f := n.value.func, ast.Attribute) \
            and f.attr in ("append", "extend", "insert") and isinstance(f.value, ast.Name):
        return f.value.id
    return None


def _loop_targets(tree: ast.Module) -> set[tuple[int, str]]:
    """(node id, name) for each node in a ``for`` loop's body and each name that loop binds: there
    ``x = x + noise`` changes this iteration's batch (``for x, y in loader``), it sums nothing."""
    return {(id(n), t.id) for loop in walk(tree) if isinstance(loop, (ast.For, ast.AsyncFor))
            for t in ast.walk(loop.target) if isinstance(t, ast.Name) for stmt in loop.body for n in ast.walk(stmt)}


def _save_steps(tree: ast.Module) -> set[str]:
    """The names a ``save()`` call reads for its step (``mgr.save(global_step, state)``): the step
    counter (``global_step += 1``), which the checkpoint holds (``restore()`` returns it), not a sum
    (``torch.save(obj, path)``: no step)."""
    return {x for c in walk(tree) if isinstance(c, ast.Call) and isinstance(c.func, ast.Attribute)
            and c.func.attr == "save" and ast.unparse(c.func.value) != "torch" for a in [*c.args[:1], *(k.value for k in c.keywords if k.arg == "step")]
            for x in _reads(a)}


def loop_accumulator(leaves: list[tuple[str, Any]], s: Settings) -> Finding | None:
    """A warning when a ``ReduceLROnPlateau``'s ``step()`` reads a plain variable that the script sums
    (``+=``, ``-=``) inside a loop, in a script that opens a ``CheckpointManager`` (module doc);
    ``None`` otherwise."""
    from .doctor import Finding
    from .doctor_source import _tree

    if (tree := _tree(s)) is None or "CheckpointManager" not in (s.source or "") or not (names := _plateaus(tree)):
        return None
    sums: dict[str, ast.AST] = {}  # a summed name -> its sum (``x += ...``, ``x = x + ...``)
    trained, rebound, steps = _trained(tree), _loop_targets(tree), _save_steps(tree)
    for n in walk(tree):
        name = _target(n) or _gathered(n)
        if id(n) not in trained or name in steps or (id(n), name) in rebound:
            continue
        if (listed := _gathered(n)) is not None:  # a list of the epoch's losses, averaged for the plateau: a sum too
            sums.setdefault(listed, n)
        elif isinstance(n, ast.AugAssign) and isinstance(n.target, ast.Name):
            sums.setdefault(n.target.id, n)
        elif _one_name(n) and isinstance(n.value, ast.BinOp) and n.targets[0].id in _reads(n.value):
            sums.setdefault(n.targets[0].id, n)
    for _ in range(3):  # names computed from a sum (``avg = running / len(loader)``), three assignments deep
        for n in walk(tree):
            if _one_name(n) and n.targets[0].id not in sums and (got := _reads(n.value) & sums.keys()):
                sums[n.targets[0].id] = sums[min(got)]
    for c in walk(tree):
        if not (isinstance(c, ast.Call) and isinstance(c.func, ast.Attribute) and c.func.attr == "step"):
            continue
        owner = c.func.value
        if not (isinstance(owner, ast.Name) and owner.id in names or isinstance(owner, ast.Attribute) and owner.attr in names):
            continue
        read = [x.id for a in [*c.args, *(k.value for k in c.keywords)] for x in ast.walk(a)
                if isinstance(x, ast.Name) and x.id in sums]
        if read:
            acc = sums[read[0]]
            if (var := _gathered(acc)) is not None:
                return _gathered_finding(acc, c, var)
            var = ast.unparse(acc.target if isinstance(acc, ast.AugAssign) else acc.targets[0])  # type: ignore[attr-defined]
            return Finding("loop accumulator", "warning", f"line {acc.lineno}: {ast.unparse(acc)} sums in a variable "
                           f"of the loop, and line {c.lineno}: {ast.unparse(c)} reads it: a checkpoint does not hold "
                           f"it, so a resume in the middle of an epoch starts `{var}` again and the plateau "
                           "decides on part of the epoch, setting another lr than the uninterrupted run",
                           f"keep it in the state: progress = tg.StateDict(step=0, {var}=0.0) in the state, "
                           f"progress[\"{var}\"] += ..., reset there at the epoch's end (docs/checkpoints.md)")
    return None


def _gathered_finding(acc: ast.AST, c: ast.Call, var: str) -> Finding:
    """:func:`loop_accumulator`'s warning for a list the loop gathers (``losses.append(...)``)."""
    from .doctor import Finding

    return Finding("loop accumulator", "warning", f"line {acc.lineno}: {ast.unparse(acc)} gathers values in a list "
                   f"of the loop, and line {c.lineno}: {ast.unparse(c)} reads it: a checkpoint does not hold it, so a "
                   f"resume in the middle of an epoch starts `{var}` empty and the plateau decides on part of the "
                   "epoch, setting another lr than the uninterrupted run",
                   f"keep a sum and a count in the state instead: progress = tg.StateDict(step=0, {var}_sum=0.0, "
                   f"{var}_n=0) in the state, progress[\"{var}_sum\"] += ...; progress[\"{var}_n\"] += 1, "
                   f"step the plateau with their ratio and reset both at the epoch's end (docs/checkpoints.md)")
