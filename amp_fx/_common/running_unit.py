"""Which compiled unit (a repeated block's region, a DDP/FSDP2 unit) is running now, by its name
under the compiled root.

The units of one class share one compiled graph (``amp_fx/_dist/capture.py``,
``amp_fx/backend/regions.py``), so the module names recorded when that graph was compiled are those
of the unit that first ran it (``model.layers.0``). What reads names at run time (the overflow
watch) asks this module which unit runs the graph now (``model.layers.4``) and renames by prefix.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["running_unit", "unit_running", "renamed"]

_RUNNING: list[str] = []  # a stack: a unit may call another (FSDP2's root around its blocks)


def running_unit() -> str | None:
    """The name under the root of the innermost compiled unit running now, else None."""
    return _RUNNING[-1] if _RUNNING else None


@contextmanager
def unit_running(name: str) -> Iterator[None]:
    """Mark ``name`` as the running unit for the duration of its call."""
    _RUNNING.append(name)
    try:
        yield
    finally:
        _RUNNING.pop()


def renamed(module: str, compiled_in: str, running: str) -> str:
    """``module`` (a name recorded in unit ``compiled_in``'s call) as named in unit ``running``'s:
    ``model.layers.0.mlp`` becomes ``model.layers.4.mlp``; a name outside ``compiled_in`` stays."""
    if module == compiled_in:
        return running
    if compiled_in == "":
        return f"{running}.{module}" if module else running
    if module.startswith(compiled_in + "."):
        return running + module[len(compiled_in) :]
    return module
