"""The ``torch.autocast`` amp_fx opens itself around a compiled model's call, told apart from the
user's own (amp_fx/backend/call.py says when a compiling call runs inside the user's autocast)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch

__all__ = ["in_own_autocast", "own_autocast"]

_OWN_AUTOCAST = threading.local()
"""``.on``: amp_fx's own code opened the autocast a compiled model is called in (compile_step's
forward under DDP/FSDP2, :func:`own_autocast`): not the user's leftover."""


@contextlib.contextmanager
def own_autocast(device_type: str, dtype: torch.dtype, *, cache_enabled: bool | None = None) -> Iterator[None]:
    """``torch.autocast(device_type, dtype, cache_enabled)`` opened by amp_fx (or its Lightning
    plugin) around a compiled model's call."""
    before = getattr(_OWN_AUTOCAST, "on", False)
    _OWN_AUTOCAST.on = True
    try:
        with torch.autocast(device_type, dtype=dtype, cache_enabled=cache_enabled):
            yield
    finally:
        _OWN_AUTOCAST.on = before


def in_own_autocast() -> bool:
    """Whether the innermost autocast was opened by :func:`own_autocast` (on this thread)."""
    return bool(getattr(_OWN_AUTOCAST, "on", False))
