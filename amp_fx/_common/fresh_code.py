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
from torch.nn.modules import module as _module_globals  # the global hook dicts

__all__ = ["fresh_function", "fresh_callable", "fresh_forward", "calls_forward_only"]


def fresh_function(fn: types.FunctionType) -> types.FunctionType:
    """A copy of ``fn`` (same globals, defaults, closure, attributes) with its own code object."""
    copy = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    copy.__kwdefaults__ = fn.__kwdefaults__
    copy.__qualname__ = fn.__qualname__
    copy.__module__ = fn.__module__
    copy.__doc__ = fn.__doc__
    copy.__dict__.update(fn.__dict__)
    return copy


def _call_module(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    # _call_impl, not self(...): the module's compiled call (amp_fx's own when compiled in place)
    # is what calls this, and self(...) would call it again.
    return self._call_impl(*args, **kwargs)


def fresh_forward(module: torch.nn.Module) -> Callable[..., Any] | None:
    """A per-model copy of ``module``'s own forward, bound to it; None where there is none to copy.

    Calling it is calling the module when the module has no hooks (see :func:`calls_forward_only`).
    Dynamo then compiles the forward as the outermost frame, as ``torch.compile(module)`` does:
    its arguments keep their names (``L['x']``) and the module is ``L['self']``. Forwards defined
    in torch itself (``nn.Sequential``, ``nn.Linear``) are not copied: Dynamo does not compile
    frames of torch's own files, it inlines them from a caller (:func:`fresh_callable`).
    """
    forward = module.forward
    if not (
        isinstance(forward, types.MethodType)
        and forward.__self__ is module
        and isinstance(forward.__func__, types.FunctionType)
    ):
        return None
    if forward.__func__.__module__.split(".")[0] == "torch":
        return None
    return types.MethodType(fresh_function(forward.__func__), module)


def calls_forward_only(module: torch.nn.Module) -> bool:
    """Whether ``module._call_impl(...)`` is exactly ``module.forward(...)`` now: the condition
    under which ``nn.Module._call_impl`` skips every hook."""
    m = _module_globals
    return not (
        module._backward_hooks
        or module._backward_pre_hooks
        or module._forward_hooks
        or module._forward_pre_hooks
        or m._global_backward_pre_hooks
        or m._global_backward_hooks
        or m._global_forward_hooks
        or m._global_forward_pre_hooks
    )


def fresh_callable(target: Callable[..., Any]) -> Callable[..., Any]:
    """A callable that behaves as ``target`` and whose outermost frame runs a code object of its own.

    A module is called through a per-model copy of ``self._call_impl(*args, **kwargs)`` (its
    hooks and forward, not its compiled call) bound to it (so
    Dynamo's sources still start at ``L['self']``); a function is copied; a bound method gets a
    copy of its function; anything else callable is called through a per-target copy of a
    one-line forwarding function.
    """
    if isinstance(target, torch.nn.Module):
        return types.MethodType(fresh_function(_call_module), target)  # type: ignore[arg-type]  # a def is a types.FunctionType; mypy types it as a callable
    if isinstance(target, types.FunctionType):
        return fresh_function(target)
    if isinstance(target, types.MethodType) and isinstance(target.__func__, types.FunctionType):
        return types.MethodType(fresh_function(target.__func__), target.__self__)

    def forward(*args: Any, **kwargs: Any) -> Any:
        return target(*args, **kwargs)

    return fresh_function(forward)  # type: ignore[arg-type]  # a def is a types.FunctionType; mypy types it as a callable
