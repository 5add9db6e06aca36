"""What a strict load's ``StateMismatchError`` says when a module entry's names all differ from the
checkpoint's by one leading part: the module wrapped in a new container since the save
(``nn.Sequential(model)``: ``0.fc.weight`` for ``fc.weight``; ``self.backbone = model``), or the
reverse. Its lists name every tensor twice, and "Pass strict=False to load what matches" would load
none of them: ``strict=False`` leaves a module whose names all changed fresh, silently.
:func:`prefix_hint` is called by ``errors.StateMismatchError`` (every rank that raises one)."""

from __future__ import annotations


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
