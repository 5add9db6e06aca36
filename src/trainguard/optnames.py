"""The names an optimizer's per-parameter state is keyed by (``stateful.OptimizerAdapter``).

A parameter is named after the module entry of the state that holds it (prefixed by the entry's
key when the state holds several modules), by its module's name for it. A tie gives a
parameter several candidate names, settled so that the name does not depend on
anything a script may change between a save and a resume:

- a tie (``lm_head.weight`` IS ``wte.weight``): the FIRST name in the module's order, under
  which ``capture`` writes the tensor itself (``ModuleAdapter.param_names``). Before, the last
  name won (a ``dict`` built over every name), so the key moved when a model added a later alias.

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
    An FSDP2 model a forward left unsharded is resharded first (the optimizer holds its DTensors)."""
    from .dtensor import reshard_fsdp2
    from .stateful import ModuleAdapter

    reshard_fsdp2((modules := _modules(state)).values())
    prefixed = (len(modules) > 1) != other
    named = {key: ModuleAdapter(mod).param_names() for key, mod in modules.items()}
    out: dict[int, str] = {}
    for key in named:
        for pid, name in named[key].items():
            out.setdefault(pid, f"{key}.{name}" if prefixed else name)
    return out


def param_name_choices(state: Mapping[str, Any]) -> dict[int, list[str]]:
    """``id(param) -> every name it has`` over the state's module entries, prefixed by the entry's
    key or not, each name of a tie included, without repeats: ``loader._load`` gives it to each
    ``OptimizerAdapter`` for a checkpoint keyed otherwise than :func:`param_name_map` keys it now
    (a tie by its last name; an entry listed in another order)."""
    from .stateful import ModuleAdapter

    out: dict[int, list[str]] = {}
    for key, mod in _modules(state).items():
        for pid, names in ModuleAdapter(mod).param_all_names().items():
            have = out.setdefault(pid, [])
            have.extend(n for name in names for n in (f"{key}.{name}", name) if n not in have)
    return out
