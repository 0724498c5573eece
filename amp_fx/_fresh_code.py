"""A code object of one's own: how each compiled model keeps its own Dynamo cache entries.

Dynamo keeps its compiled entries on the code object it runs (at most
``torch._dynamo.config.recompile_limit``, 8, per code object), and each amp_fx backend object is
a distinct backend to it. Models compiled through one shared function (``nn.Module.__call__``,
a shared forward-and-loss helper) therefore share those 8 slots: the 9th model compiled in a
process captured nothing and ran uncompiled. Compiling a copy of the code per model (same
bytecode, a new code object) gives each its own slots, as plain ``torch.compile`` has per model.

    >>> def f(x): return x + 1
    >>> g = fresh_function(f)
    >>> g.__code__ is f.__code__, g(1) == f(1)
    (False, True)
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["fresh_function", "fresh_callable"]


def fresh_function(fn: types.FunctionType) -> types.FunctionType:
    """A copy of ``fn`` (same globals, defaults, closure, attributes) with its own code object."""
    copy = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__,
                              fn.__defaults__, fn.__closure__)
    copy.__kwdefaults__ = fn.__kwdefaults__
    copy.__qualname__ = fn.__qualname__
    copy.__module__ = fn.__module__
    copy.__doc__ = fn.__doc__
    copy.__dict__.update(fn.__dict__)
    return copy


def _call_module(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    return self(*args, **kwargs)


def fresh_callable(target: Callable[..., Any]) -> Callable[..., Any]:
    """A callable that behaves as ``target`` and whose outermost frame runs a code object of its own.

    A module is called through a per-model copy of ``self(*args, **kwargs)`` bound to it (so
    Dynamo's sources still start at ``L['self']``); a function is copied; a bound method gets a
    copy of its function; anything else callable is called through a per-target copy of a
    one-line forwarding function.
    """
    if isinstance(target, torch.nn.Module):
        return types.MethodType(fresh_function(_call_module), target)
    if isinstance(target, types.FunctionType):
        return fresh_function(target)
    if isinstance(target, types.MethodType) and isinstance(target.__func__, types.FunctionType):
        return types.MethodType(fresh_function(target.__func__), target.__self__)

    def forward(*args: Any, **kwargs: Any) -> Any:
        return target(*args, **kwargs)

    return fresh_function(forward)
