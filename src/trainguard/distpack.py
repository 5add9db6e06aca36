"""How rank 0 publishes an ``all_gather``'s list in the c10d store (``dist.StoreDistContext.all_gather``).

Every rank reads the published list, so its size is paid once per rank: as a plain JSON list of the
ranks' values it grows with the world size, and the store server sent world_size x that in every
round, i.e. quadratic in the world size (a save's "begin" round, a load's "load" and "loaded": ~230
bytes per rank, so at 1,024 ranks each rank read ~235 kB per round and the server sent ~240 MB).
The ranks' values are mostly the same (the same step, name, entry signature, shared values' digests),
so rank 0 packs them column by column: each field's distinct values once, and which rank has which as
runs of ranks (``pack``); each rank unpacks the same list (``unpack``). A round where every rank sends
the same fields costs every rank a size independent of the world size; one where each rank sends its
own (a byte count per rank) is no larger than the plain list, plus a run per change.

Called by rank 0 (``pack``, into the round's ``/all`` record ``{"packed": ...}``) and by every other
rank on reading that record (``published``); ``{"value": ...}`` records (broadcasts, failure verdicts) pass through.
"""

from __future__ import annotations

import json
from typing import Any

_MISSING = object()


def _column(cells: list[Any]) -> list[Any]:
    """``[distinct values as JSON text, [[index, run length], ...]]``; index -1: the field is absent there."""
    table: list[str] = []
    seen: dict[Any, int] = {}
    runs: list[list[int]] = []
    for cell in cells:
        if cell is _MISSING:
            i = -1
        else:  # by type and value or by JSON text, not ==: True == 1 == 1.0 and 0.0 == -0.0 would merge values that differ
            key = (type(cell), cell) if type(cell) in (str, int, bool) or cell is None else json.dumps(cell)  # a float: its text
            i = seen.setdefault(key, len(table))
            if i == len(table):
                table.append(json.dumps(cell))
        if runs and runs[-1][0] == i:
            runs[-1][1] += 1
        else:
            runs.append([i, 1])
    return [table, runs]


def _cells(col: list[Any]) -> list[Any]:
    table, runs = col
    parsed = [json.loads(t) for t in table]
    out: list[Any] = []
    for i, n in runs:  # a list or dict decoded once per rank (in one call): each rank's its own object
        if i < 0 or not isinstance(parsed[i], (list, dict)):
            out += [_MISSING if i < 0 else parsed[i]] * n
        else:
            out += json.loads("[" + ",".join([table[i]] * n) + "]")
    return out


def pack(values: list[Any]) -> dict[str, Any]:
    """Rank 0: the ranks' JSON values, packed (dicts field by field, anything else as one column).

    Dicts are packed as JSON reads them back (keys as strings: ``{1: x}`` from one rank and
    ``{"1": y}`` from another are one field, not two that the JSON text would merge into the last),
    and each rank's key order is kept (column ``"order"``, only where one differs from the fields' order)."""
    if values and all(isinstance(v, dict) for v in values):
        if any(type(k) is not str for v in values for k in v):  # as JSON keys: strings (the last of equal ones)
            values = json.loads(json.dumps(values))
        fields = list(dict.fromkeys(k for v in values for k in v))
        out = {"n": len(values), "fields": {k: _column([v.get(k, _MISSING) for v in values]) for k in fields}}
        if any(list(v) != [k for k in fields if k in v] for v in values):  # not the fields' order: no bytes when it is
            out["order"] = _column([list(v) for v in values])
        return out
    return {"n": len(values), "col": _column(values)}


def unpack(packed: dict[str, Any]) -> list[Any]:
    """Every rank: the list :func:`pack` was given (equal by JSON, each element a new object)."""
    if "col" in packed:
        return _cells(packed["col"])
    out: list[dict[str, Any]] = [{} for _ in range(packed["n"])]
    for k, col in packed["fields"].items():
        for d, cell in zip(out, _cells(col), strict=True):
            if cell is not _MISSING:
                d[k] = cell
    if "order" in packed:  # each rank's own key order (a dict's order shows in its JSON text, its repr)
        out = [{k: d[k] for k in keys} for d, keys in zip(out, _cells(packed["order"]), strict=True)]
    return out


def published(record: dict[str, Any]) -> Any:
    """The value of a round's published record, a ``{"packed": ...}`` or ``{"value": ...}`` (not a failure)."""
    return unpack(record["packed"]) if "packed" in record else record["value"]
