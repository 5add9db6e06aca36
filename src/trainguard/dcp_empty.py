"""Empty dicts through DCP. DCP flattens a state into one item per leaf (``traverse_state_dict``
visits no leaf of an empty ``Mapping``), so ``{"extra": {"seen": {}}}`` or a ``tg.StateDict(hist={})``
written to DCP lost that key, and the checkpoint imported back from it was refused by a strict load
of the state it came from (``missing from the checkpoint: extra/seen``); before session 56
``trainguard convert`` lost them without a word (empty lists survive: DCP pickles a list of plain
values whole).

``dcp_export.write_dcp`` saves with :class:`KeepEmptyPlanner` (``dcp_lazy.LazyPlanner`` derives from
it), which adds each empty dict's path to DCP's own record of the nesting (``planner_data``: flat key ->
path) without an item of its own; ``dcp_import.read_dcp`` puts ``{}`` at the paths :func:`empty_dicts`
finds there. ``dcp.load`` and torch's other readers look up ``planner_data`` only for the keys that
hold items, so they ignore these."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch.distributed.checkpoint.default_planner import DefaultSavePlanner


def empty_paths(value: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """The paths (DCP's: a dict's keys as ``str``, a list's indices as ``int``) of the empty dicts in
    ``value`` that DCP's traversal reaches: inside dicts and lists, not inside tuples (DCP pickles a
    tuple whole, an empty dict in it included)."""
    if isinstance(value, Mapping):
        if not value and path:
            return [path]
        return [p for k, v in value.items() for p in empty_paths(v, (*path, str(k)))]
    if isinstance(value, list):
        return [p for i, v in enumerate(value) for p in empty_paths(v, (*path, i))]
    return []


class KeepEmptyPlanner(DefaultSavePlanner):
    """DCP's default save planner, with the empty dicts of the state in its ``planner_data``
    (called by ``dcp.save``, through ``dcp_export.write_dcp``)."""

    def set_up_planner(self, state_dict: Any, storage_meta: Any = None, is_coordinator: bool = False) -> None:
        # DCP's own signature: with another (``*args``), dcp.save warns that it "has been updated to include storage_meta"
        super().set_up_planner(state_dict, storage_meta, is_coordinator)
        if self.flatten_state_dict:
            for p in empty_paths(state_dict):
                key = ".".join(map(str, p))
                while key in self.mappings:  # a leaf's key too (dots in names: {"x": {"y": {}}, "x.y": 5}): another
                    key += "."  # key, holding no item either (before session 56, review56k: that empty dict was lost)
                self.mappings[key] = p


def empty_dicts(meta: Any, paths: Any) -> list[tuple[str, tuple[Any, ...]]]:
    """``dcp_import.read_dcp``: ``(flat key, path)`` of each entry of ``paths`` (the metadata's
    ``planner_data``) that holds no item in ``meta``: an empty dict that :class:`KeepEmptyPlanner` recorded."""
    if not isinstance(paths, dict):
        return []
    return [(k, p) for k, p in paths.items() if k not in meta.state_dict_metadata and isinstance(p, tuple) and p
            and type(p[0]) is str and all(type(x) in (str, int) for x in p)]
