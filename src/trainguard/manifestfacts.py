"""``read_facts``: the ``created`` and ``metadata`` of a committed checkpoint, from its manifest's leading fields.

Called by ``retention._facts`` (rank 0, retention of a policy that reads metadata) and ``commit._carries`` (rank 0, a
manager's open). Moved out of ``retention`` (review54d: that module was at its 400 lines); ``retention.read_facts``
is this function.
"""

from __future__ import annotations

import json
from typing import Any

from .commit import manifest_bytes
from .flatten import decode_json, unique_keys
from .manifest import SUPPORTED_VERSIONS, parse, verified_body
from .storage import Storage


def read_facts(storage: Storage, directory: str) -> tuple[float, dict[str, Any]]:
    """``created`` and ``metadata`` of the checkpoint in ``directory``, for retention policies
    (``_facts``, rank 0, for each kept checkpoint at the first retention after a
    restart): the checksum is verified and the fields are checked as ``manifest.validate`` does,
    but only the leading fields are decoded (``Manifest.to_bytes`` writes them before the files,
    objects and tensors), not every tensor validated: a 100,000-tensor manifest took 1.5-3.7 s
    to parse whole for these two values. A manifest laid out otherwise is parsed whole."""
    data, where = manifest_bytes(storage, directory)
    body = verified_body(data, where)
    try:
        head = _leading_fields(body.decode())
    except (ValueError, IndexError, RecursionError):
        head = {}
    version, created, metadata = head.get("format_version"), head.get("created"), head.get("metadata")
    if type(version) is not int or version not in SUPPORTED_VERSIONS or type(created) not in (int, float) or not (
        0 <= created < 1e11 and type(metadata) is dict
    ):
        m = parse(data, where)  # says what is wrong, or reads a valid manifest laid out otherwise
        return m.created, m.metadata
    return float(created), decode_json(metadata, f"{where}: metadata")


def _leading_fields(text: str) -> dict[str, Any]:
    """``read_facts``: the fields of a manifest body up to ``metadata``, decoded one by one;
    ValueError when it is laid out otherwise (a field repeated, or ``files`` first)."""
    dec = json.JSONDecoder(parse_constant=_no_constant, object_pairs_hook=unique_keys)  # as manifest.parse
    head: dict[str, Any] = {}
    if not text.startswith("{"):
        raise ValueError("not an object")
    pos = 1
    while "metadata" not in head:
        key, pos = dec.raw_decode(text, pos)
        if type(key) is not str or key in head or key in ("files", "objects", "tensors") or text[pos] != ":":
            raise ValueError("not a leading field")
        head[key], pos = dec.raw_decode(text, pos + 1)
        if text[pos] != ",":
            raise ValueError("metadata is not followed by other fields")
        pos += 1
    return head


def read_sizes(storage: Storage, directory: str) -> dict[str, int]:
    """The sizes of the data and index files that the manifest of the checkpoint in ``directory`` records, for
    ``keptseen.kept_damaged`` (rank 0, retention, a kept step this process did not save): the checksum verified,
    the body decoded up to ``files`` and ``indexes``, not every tensor validated (a whole parse validated each
    tensor entry of each such step: 600 for two 300-tensor checkpoints, review56e). Laid out otherwise (or a name
    that is not a plain file name): parsed whole, which says what is wrong."""
    data, where = manifest_bytes(storage, directory)
    body = verified_body(data, where)
    try:
        head = _fields_before(body.decode(), "objects")
        if head.get("format_version") not in SUPPORTED_VERSIONS:
            raise ValueError("another format")
        sizes = {**head["files"], **{k: v[0] for k, v in head.get("indexes", {}).items()}}
        if all(type(n) is str and "/" not in n and n not in ("", ".", "..") and type(v) is int and v >= 0
               for n, v in sizes.items()):
            return sizes
    except (ValueError, IndexError, KeyError, TypeError, AttributeError, RecursionError):
        pass
    m = parse(data, where)
    return {**m.files, **{k: v[0] for k, v in m.indexes.items()}}


def _fields_before(text: str, stop: str) -> dict[str, Any]:
    """``read_sizes``: the fields of a manifest body before the field ``stop``, decoded one by one; ValueError when
    it is laid out otherwise (a field repeated, ``stop`` absent)."""
    dec = json.JSONDecoder(parse_constant=_no_constant, object_pairs_hook=unique_keys)  # as manifest.parse
    head: dict[str, Any] = {}
    if not text.startswith("{"):
        raise ValueError("not an object")
    pos = 1
    while True:
        key, pos = dec.raw_decode(text, pos)
        if type(key) is not str or key in head or text[pos] != ":":
            raise ValueError("not a field")
        if key == stop:
            return head
        head[key], pos = dec.raw_decode(text, pos + 1)
        if text[pos] != ",":
            raise ValueError(f"{stop} is not among the fields")
        pos += 1


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")  # as manifest.parse: NaN and Infinity are never written
