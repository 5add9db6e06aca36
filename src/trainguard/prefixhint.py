"""What a strict load's ``StateMismatchError`` says when a module entry's names all differ from the
checkpoint's by one leading part: the module wrapped in a new container since the save
(``nn.Sequential(model)``: ``0.fc.weight`` for ``fc.weight``; ``self.backbone = model``), or the
reverse (:func:`prefix_hint`); or when a submodule's tensors differ by that submodule's name only
(``out.weight`` for ``2.weight``: renamed since the save, :func:`rename_hint`). Its lists name every
tensor twice, and "Pass strict=False to load what matches" would load none of them: ``strict=False``
leaves a module whose names changed fresh, silently. Both are called by ``errors.StateMismatchError``
(every rank that raises one)."""

from __future__ import annotations

import re
from collections import Counter


def _prefix(longer: set[str], shorter: set[str]) -> str | None:
    """The one leading part (ending with a dot) that makes ``shorter``'s names ``longer``'s, or None."""
    if not longer or len(longer) != len(shorter):
        return None
    first = next(iter(longer))
    for i, c in enumerate(first):
        if c == "." and first[i + 1 :] in shorter:
            head = first[: i + 1]
            if all(n.startswith(head) and n[i + 1 :] in shorter for n in longer):
                return head
    return None


def prefix_hint(missing: list[str], unexpected: list[str]) -> str:
    """" <hint>." per module entry whose missing names (the state's) are the unexpected ones (the
    checkpoint's) with one leading part added, or the reverse; "" when there is none."""
    by_entry: dict[str, tuple[set[str], set[str]]] = {}
    for names, side in ((missing, 0), (unexpected, 1)):
        for p in names:
            if "/" in p:
                key, rest = p.split("/", 1)
                by_entry.setdefault(key, (set(), set()))[side].add(rest)
    out = ""
    for key, (state, saved) in by_entry.items():
        if (head := _prefix(state, saved)) is not None:
            out += (f" Entry {key!r}: the state's module holds each of the checkpoint's {len(saved)} tensors under "
                    f"'{head}' + its name (wrapped in a new container since the save?); strict=False would load none "
                    f"of them: put the inner module in the state for the load ({key!r}: the module at '{head[:-1]}').")
        elif (head := _prefix(saved, state)) is not None:
            out += (f" Entry {key!r}: the checkpoint holds each of the state's {len(state)} tensors under '{head}' + "
                    f"its name (saved from a container of this module?); strict=False would load none of them: "
                    f"load into a module built as at save time, or save the inner module ('{head[:-1]}') as its own entry.")
    return out


def _parts(name: str) -> list[str]:
    """``name`` cut at its dots and slashes, the separators kept: even indices are the components."""
    return re.split(r"([./])", name)


def _below(names: list[list[str]]) -> dict[str, set[str]]:
    """For each path of components that starts some of ``names`` (cut by :func:`_parts`), what follows it in each."""
    out: dict[str, set[str]] = {}
    for cut in names:
        for i in range(0, len(cut), 2):
            out.setdefault("".join(cut[: i + 1]), set()).add("".join(cut[i + 1 :]))
    return out


def rename_hint(missing: list[str], unexpected: list[str]) -> str:
    """" <hint>." per module entry where the checkpoint's tensors under one component (a submodule's
    or parameter's name: ``2`` in ``2.weight``) are the state's under another (``out.weight``), the
    same names below it on both sides: a submodule renamed since the save (``self.head`` for the
    ``nn.Sequential`` index ``2``). Submodules alike below (two ``Linear``) renamed together are named
    as a group, which became which unknown; "" when there is none. Called by ``errors.StateMismatchError`` after :func:`prefix_hint`."""
    by_entry: dict[str, tuple[list[str], list[str]]] = {}
    for names, side in ((missing, 0), (unexpected, 1)):
        for p in names:
            if "/" in p:
                key, rest = p.split("/", 1)
                by_entry.setdefault(key, ([], []))[side].append(rest)
    out = ""
    for key, (state, saved) in by_entry.items():
        if not state or not saved:
            continue
        # the state's names by all but one component: a checkpoint name that differs from one in that component only
        cut_state, cut_saved = [_parts(x) for x in state], [_parts(x) for x in saved]
        blanked: dict[tuple[int, str, str], set[str]] = {}
        for sp in cut_state:
            for i in range(0, len(sp), 2):
                blanked.setdefault((i, "".join(sp[:i]), "".join(sp[i + 1:])), set()).add(sp[i])
        # (parent, old, new) -> the names below old in the checkpoint, below new in the state
        below: dict[tuple[str, str, str], set[str]] = {}
        for cp in cut_saved:
            for i in range(0, len(cp), 2):
                parent, rest = "".join(cp[:i]), "".join(cp[i + 1:])
                for new in blanked.get((i, parent, rest), ()):
                    below.setdefault((parent, cp[i], new), set()).add(rest)
        whole = []
        under_saved, under_state = _below(cut_saved), _below(cut_state)
        for (parent, old, new), paired in below.items():
            if paired == under_saved[parent + old] == under_state[parent + new]:
                whole.append((parent, old, new, len(paired)))
        olds, news = Counter((p, o) for p, o, _, _ in whole), Counter((p, n) for p, _, n, _ in whole)
        pairs = [w for w in whole if olds[w[0], w[1]] == 1 and news[w[0], w[2]] == 1]
        said = [f"'{p}{o}' -> '{p}{n}' ({k} tensor{'s' if k > 1 else ''})" for p, o, n, k in pairs]
        alike: dict[str, tuple[set[str], set[str]]] = {}  # several submodules of one parent alike below: renamed, which to which unknown
        for p, o, n, _ in whole:
            if olds[p, o] > 1 or news[p, n] > 1:
                alike.setdefault(p, (set(), set()))[0].add(o)
                alike[p][1].add(n)
        said += [f"{', '.join(repr(p + o) for o in sorted(a))} -> {', '.join(repr(p + n) for n in sorted(b))} (in some order)"
                 for p, (a, b) in alike.items() if len(a) == len(b)]
        if said:
            more = f", ... ({len(said)} in all)" if len(said) > 4 else ""
            out += (f" Entry {key!r}: the checkpoint's tensors look renamed in the state (checkpoint -> state, the same "
                    f"names below each): {', '.join(said[:4])}{more}; strict=False would leave them as built, not loaded: "
                    "give the modules (or parameters) their names of save time.")
    return out


def entry_hint(missing: list[str], unexpected: list[str]) -> str:
    """" <hint>." when the state lacks exactly one of the checkpoint's entries and holds exactly one
    the checkpoint lacks (``{"modle": model}``, an entry renamed since the save): strict=False would
    leave the one fresh and not read the other; "" otherwise. Called by ``errors.StateMismatchError``."""
    fresh, gone = [k for k in missing if "/" not in k], [k for k in unexpected if "/" not in k]
    if len(fresh) != 1 or len(gone) != 1:
        return ""
    return (f" Entry {fresh[0]!r} is not in the checkpoint and its {gone[0]!r} is not in the state: if it was renamed since "
            f"the save, give it its name of save time (state[{gone[0]!r}] = state.pop({fresh[0]!r})); strict=False would "
            f"leave {fresh[0]!r} as built, not loaded.")
