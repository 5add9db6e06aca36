"""One walk of each module per save call, shared by the checks that need it.

A save's call (``capture.capture``, then ``stage.protected_tensors`` in an async save) looked at
every submodule of each module entry up to six times: FSDP2's reshard (``dtensor.reshard_fsdp2``),
FSDP1's checks (``fsdp1._handles``, once for the optimizer and once for the module), the
embeddings with ``max_norm`` (``protected_tensors``), and the parameter names
(``ModuleAdapter.param_all_names``) and frozen parameters (``names.frozen_names``). Inside
:func:`shared` each module's ``modules()`` and ``named_parameters(remove_duplicate=False)`` is
taken once and handed to every later asker in the same thread; outside it, every call walks
afresh, as before.

Always through the module's own methods (FSDP1 and other wrappers override ``named_parameters``);
the lists hold the module and parameter objects, and whatever is read off them (``requires_grad``,
``max_norm``, an FSDP1 handle) is read when asked, not cached. What a save call's own
``state_dict()`` calls could change in between (a hook registering or replacing a submodule or a
parameter in the middle of a save) is not taken into account: no torch wrapper does that (FSDP1's
and FSDP2's hooks swap parameter *views* during ``state_dict()`` and put the registered ones back).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

_LOCAL = threading.local()  # .memo: key -> (module, its walk) while a shared() block of this thread runs


@contextmanager
def shared() -> Iterator[None]:
    """One save call (``capture.capture``; ``async_save.start_async_save`` around its capture and
    ``protected_tensors``): each module's walk is taken once inside. Nested blocks share the outer one's."""
    if getattr(_LOCAL, "memo", None) is not None:
        yield
        return
    _LOCAL.memo = {}
    try:
        yield
    finally:
        _LOCAL.memo = None  # the modules and parameters are not kept past the call


def _walk(kind: str, module: Any, take: Any) -> list[Any]:
    memo = getattr(_LOCAL, "memo", None)
    if memo is None:
        return take()
    key = (kind, id(module))
    hit = memo.get(key)
    if hit is None or hit[0] is not module:  # the module is kept referenced: its id cannot be reused meanwhile
        hit = memo[key] = (module, take())
    return hit[1]  # type: ignore[no-any-return]


def modules(module: Any) -> list[Any]:
    """``list(module.modules())``, taken once per :func:`shared` block."""
    return _walk("modules", module, lambda: list(module.modules()))


def named_parameters(module: Any) -> list[tuple[str, Any]]:
    """``list(module.named_parameters(remove_duplicate=False))`` (a tie under each of its names),
    taken once per :func:`shared` block."""
    return _walk("params", module, lambda: list(module.named_parameters(remove_duplicate=False)))
