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



def _by_entry(missing: list[str], unexpected: list[str]) -> dict[str, tuple[set[str], set[str]]]:
    """entry -> (the state's names the checkpoint lacks, the checkpoint's the state lacks), without the entry."""
    out: dict[str, tuple[set[str], set[str]]] = {}
    for names, side in ((missing, 0), (unexpected, 1)):
        for p in names:
            if "/" in p:
                key, rest = p.split("/", 1)
                out.setdefault(key, (set(), set()))[side].add(rest)
    return out


def _under(names: set[str]) -> dict[str, list[str]]:
    """Each leading dotted part of ``names`` (``0``, ``0.base`` of ``0.base.weight``) -> the names below it:
    one walk of the names, where a scan of all names per part was quadratic (review58e)."""
    out: dict[str, list[str]] = {}
    for n in names:
        d = n.split(".")
        for j in range(1, len(d)):
            out.setdefault(".".join(d[:j]), []).append(n)
    return out


def inserted(missing: list[str], unexpected: list[str], by_entry: dict[str, tuple[set[str], set[str]]] | None = None
             ) -> dict[str, list[tuple[str, str, int]]]:
    """Per module entry, the submodules wrapped since the save: ``(old, new, n)`` where the
    checkpoint's ``n`` tensors under ``old`` (``0``: ``0.weight``, ``0.bias``) are all the state's under
    ``new``, ``old`` with one component added (``0.base``; PEFT's ``q.base_layer``): a LoRA-style adapter
    (or any container) put around a layer; per tensor the innermost place (a whole model wrapped is
    :func:`prefix_hint`'s). Linear in the names (times their depth): a model of 10,000 tensors, every
    layer wrapped, is told in well under a second (before review58e: a scan of all names per layer)."""
    out: dict[str, list[tuple[str, str, int]]] = {}
    for key, (state, saved) in (by_entry or _by_entry(missing, unexpected)).items():
        without: dict[tuple[str, ...], set[tuple[int, str]]] = {}  # a state name less one component -> (where, which)
        for c in state:
            d = c.split(".")
            for j in range(1, len(d) - 1):
                without.setdefault((*d[:j], *d[j + 1 :]), set()).add((j, d[j]))
        found: dict[tuple[str, str], set[str]] = {}  # (old, new) -> the checkpoint's names it explains
        for n in saved:
            cut = tuple(n.split("."))
            for j, x in without.get(cut, ()):
                old = ".".join(cut[:j])
                found.setdefault((old, f"{old}.{x}"), set()).add(n)
        below = _under(saved)
        whole = [(old, new, len(names)) for (old, new), names in found.items()
                 if len(names) == len(below.get(old, ()))]  # all the checkpoint holds under `old`
        olds = Counter(old for old, _, _ in whole)  # two places fit (an adapter's lora_A.weight beside base.weight)
        above = {".".join(o.split(".")[:j]) for o in olds for j in range(1, o.count(".") + 1)}  # an old within another
        pairs = [w for w in whole if olds[w[0]] == 1 and w[0] not in above]
        if pairs:
            out[key] = sorted(pairs)
    return out


def insert_hint(missing: list[str], unexpected: list[str]) -> tuple[str, set[str]]:
    """(" <hint>." per module entry with submodules wrapped since the save (:func:`inserted`), naming
    them and the state's tensors that are new beside them (the adapters), or ""; the paths it explains).
    Called by :func:`wrap_hints`, and by ``rankload.refuse_or_report`` for a ``strict=False`` load's warning."""
    out, explained = "", set()
    by_entry = _by_entry(missing, unexpected)
    for key, pairs in inserted(missing, unexpected, by_entry).items():
        state, saved = by_entry[key]
        s_below, c_below = _under(state), _under(saved)
        said = [f"'{o}' -> '{n}' ({k} tensor{'s' * (k > 1)})" for o, n, k in pairs]
        moved = {c for _, n, _ in pairs for c in s_below.get(n, ())}
        new = sorted(c for o, _, _ in pairs for c in s_below.get(o, ()) if c not in moved)
        explained |= {f"{key}/{c}" for c in [*moved, *new]} | {f"{key}/{c}" for o, _, _ in pairs for c in c_below.get(o, ())}
        added = f"; beside them the state has tensors the checkpoint lacks ({', '.join(new[:6])}{', ...' * (len(new) > 6)}: the adapters?)" if new else ""
        out += (f" Entry {key!r}: the checkpoint's tensors of submodules wrapped since the save (an adapter such as LoRA "
                f"around a layer?) are in the state one level down: {', '.join(said[:4])}{', ...' * (len(said) > 4)}{added}. "
                "strict=False would leave the wrapped layers as built, not loaded: load the checkpoint into the model before "
                f"adding the adapters (tg.load(path, {{{key!r}: model}}, only=[{key!r}]), then wrap), or load it into nothing "
                "and rename its keys for model.load_state_dict (docs/checkpoints.md, \"Fine-tuning from a checkpoint\").")
    return out, explained


def wrap_hints(missing: list[str], unexpected: list[str]) -> str:
    """``errors.StateMismatchError``: :func:`insert_hint`, then :func:`rename_hint` of the paths it does not
    explain. Before review58b a LoRA layer (``0.weight`` become ``0.base.weight``, ``0.A`` and ``0.B`` added)
    was told as ``'0.bias', '0.weight' -> '0.A', '0.B' (in some order)``, a rename that is not one."""
    hint, explained = insert_hint(missing, unexpected)
    return hint + rename_hint([p for p in missing if p not in explained], [p for p in unexpected if p not in explained])
