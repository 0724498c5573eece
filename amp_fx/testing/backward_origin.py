"""Where eager autograd's backward first made an inf/NaN: the reference for the backward watch
(``amp_fx.passes.watch_backward``).

:func:`first_backward_origin` runs ``loss.backward()`` under a dispatch mode that sees every ATen
op the eager backward runs, and module backward hooks that say whose backward is running:

* ``op``/``module``: the first op (in execution order) whose low-precision output holds an
  inf/NaN while none of its floating inputs does, and the innermost module whose backward was
  running then ("" when none was: code outside the model, such as the loss);
* ``entered``: the first module whose output gradient was already non-finite when its backward
  started (``register_full_backward_pre_hook``).

The rule is the watch's, without its per-element refinement for pointwise ops (any inf/NaN in an
input explains the output): the planted models make their first inf from finite inputs.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["BackwardOrigin", "first_backward_origin"]


@dataclass(frozen=True)
class BackwardOrigin:
    op: str | None
    """``aten.mm`` (an ATen overload packet's name), or None if the backward made no inf/NaN."""
    module: str | None
    """The innermost module whose backward ran the op ("" for none), or None with ``op``."""
    entered: str | None
    """The first module whose output gradient was non-finite when its backward started, or None."""


def _plain(t: torch.Tensor) -> list[torch.Tensor]:
    """``t``, or the plain tensors a traceable wrapper subclass holds."""
    flatten = getattr(t, "__tensor_flatten__", None)
    if type(t) in (torch.Tensor, torch.nn.Parameter) or flatten is None:
        return [t]
    return [inner for name in flatten()[0] for inner in _plain(getattr(t, name))]


def _nonfinite(t: torch.Tensor) -> bool:
    if t.is_floating_point() and t.element_size() == 1:  # fp8 has no isfinite kernel; exact in fp32
        t = t.float()
    return (t.is_floating_point() or t.is_complex()) and not bool(torch.isfinite(t).all())


class _FirstOrigin(TorchDispatchMode):
    def __init__(self, dtype: torch.dtype, running: list[str]) -> None:
        super().__init__()
        self.dtype = dtype
        self.running = running
        self.found: tuple[str, str] | None = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.found is None:
            outs = [
                inner
                for t in tree_leaves(out)
                if isinstance(t, torch.Tensor) and t.dtype == self.dtype
                for inner in _plain(t)
            ]
            # A tensor subclass's op (torchao's Float8TrainingTensor: its ``aten.mm`` runs
            # ``_scaled_mm`` out of this mode's sight) is checked through the plain tensors it holds.
            ins = [inner for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) for inner in _plain(t)]
            if any(_nonfinite(t) for t in outs) and not any(_nonfinite(t) for t in ins):
                name = f"{func.namespace}.{func.__name__.split('.')[0]}"
                self.found = (name, self.running[-1] if self.running else "")
        return out


def first_backward_origin(
    model: torch.nn.Module, loss: Callable[[], torch.Tensor], dtype: torch.dtype
) -> BackwardOrigin:
    """Run ``loss()`` (the eager autocast forward of ``model`` and the loss, scaled as the step
    scales it) with backward hooks on ``model``'s submodules, then its backward under the dispatch
    mode, and return where the backward first made an inf/NaN. The hooks are removed after; they
    change no value (a full backward hook wraps the module's inputs and outputs in identities)."""
    running: list[str] = []
    finishing: set[str] = set()
    entered: list[str] = []
    handles = []
    for name, module in model.named_modules():
        if not name:
            continue

        def pre(mod: torch.nn.Module, grad_output: tuple[torch.Tensor | None, ...], name: str = name) -> None:
            while running and running[-1] in finishing:
                finishing.discard(running.pop())
            running.append(name)
            if not entered and any(g is not None and _nonfinite(g) for g in grad_output):
                entered.append(name)

        def post(
            mod: torch.nn.Module, grad_input: tuple[torch.Tensor | None, ...], grad_output: object, name: str = name
        ) -> None:
            if name not in running:
                return
            if all(g is None for g in grad_input):
                # No input requires grad (the first layer): the hook fires with the output
                # gradient, before the module's weight gradients are computed; those ops are still
                # its own, until the next module's backward starts.
                finishing.add(name)
                return
            del running[len(running) - 1 - running[::-1].index(name)]

        handles.append(module.register_full_backward_pre_hook(pre))
        handles.append(module.register_full_backward_hook(post))
    try:
        value = loss()
        mode = _FirstOrigin(dtype, running)
        with mode, warnings.catch_warnings():
            # a module whose inputs do not require grad (the first layer): its hook fires on the
            # output gradient only, which is all ``entered`` reads
            warnings.filterwarnings("ignore", message="Full backward hook is firing")
            value.backward()
    finally:
        for handle in handles:
            handle.remove()
    op, module = mode.found if mode.found is not None else (None, None)
    return BackwardOrigin(op=op, module=module, entered=entered[0] if entered else None)
