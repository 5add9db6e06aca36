"""The names an optimizer's per-parameter state is keyed by (``stateful.OptimizerAdapter``).

A parameter is named after the module entry of the state that holds it (prefixed by the entry's
key when the state holds several modules), by its module's name for it. Two cases give a
parameter several candidate names, and each is settled so that the name does not depend on
anything a script may change between a save and a resume:

- a tie (``lm_head.weight`` IS ``wte.weight``): the FIRST name in the module's order, under
  which ``capture`` writes the tensor itself (``ModuleAdapter.param_names``). Before, the last
  name won (a ``dict`` built over every name), so the key moved when a model added a later alias;
- a parameter that several module entries hold (``{"model": m, "head": m.head}``): the entry
  with the most parameters, ties between entries broken by the smaller key
  (:func:`param_name_map`). Before, the first entry in the state's order won, so the same state
  listed in another order on load gave other names.

Checkpoints keyed the older ways still load: :func:`param_name_choices` gives every name a
parameter has (each name of a tie, under each entry that holds it, prefixed or not), and
``OptimizerAdapter._saved_names`` takes, for each parameter, the one the checkpoint holds.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn


def _modules(state: Mapping[str, Any]) -> dict[str, nn.Module]:
    return {k: v for k, v in state.items() if isinstance(v, nn.Module)}


def param_name_map(state: Mapping[str, Any], *, other: bool = False) -> dict[int, str]:
    """``id(param) -> name`` over every module in the state (names prefixed by the entry key
    when the state holds more than one module). ``other``: the other spelling, prefixed when the
    state holds one module and not when it holds several; ``loader._load`` gives it to each
    ``OptimizerAdapter`` for a checkpoint saved with another number of modules (an EMA added).
    A parameter several entries hold is named by the largest of them (see the module's docstring).
    An FSDP2 model a forward left unsharded is resharded first (the optimizer holds its DTensors)."""
    from .dtensor import reshard_fsdp2
    from .stateful import ModuleAdapter

    reshard_fsdp2((modules := _modules(state)).values())
    prefixed = (len(modules) > 1) != other
    named = {key: ModuleAdapter(mod).param_names() for key, mod in modules.items()}
    out: dict[int, str] = {}
    for key in sorted(named, key=lambda k: (-len(named[k]), k)):  # the largest entry first: its names win
        for pid, name in named[key].items():
            out.setdefault(pid, f"{key}.{name}" if prefixed else name)
    return out


def largest_owner(modules: Mapping[str, nn.Module], ids: set[int]) -> str | None:
    """``fsdp1``: the key of the module entry holding every parameter of ``ids`` that
    :func:`param_name_map` would name them by (the one with the most parameters, then the
    smaller key), or None when no entry holds them all."""
    sizes = {k: {id(p) for p in m.parameters()} for k, m in modules.items()}
    owners = [k for k, held in sizes.items() if ids <= held]
    return min(owners, key=lambda k: (-len(sizes[k]), k)) if owners else None


def param_name_choices(state: Mapping[str, Any]) -> dict[int, list[str]]:
    """``id(param) -> every name it has`` over the state's module entries, prefixed by the entry's
    key or not, each name of a tie included, without repeats: ``loader._load`` gives it to each
    ``OptimizerAdapter`` for a checkpoint keyed otherwise than :func:`param_name_map` keys it now
    (an entry listed first rather than the largest; a tie by its last name)."""
    from .stateful import ModuleAdapter

    out: dict[int, list[str]] = {}
    for key, mod in _modules(state).items():
        for pid, names in ModuleAdapter(mod).param_all_names().items():
            have = out.setdefault(pid, [])
            have.extend(n for name in names for n in (f"{key}.{name}", name) if n not in have)
    return out
