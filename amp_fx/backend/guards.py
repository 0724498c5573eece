"""Guards the backend installs around compiled graphs: Dynamo's module-hook guards for the
compile under way, amp_fx's error for a double backward through an AOTAutograd graph, and the
run counter a compiled model's graphs bump.
"""

from __future__ import annotations

from typing import Any

import torch
from torch._guards import CompileContext

from amp_fx.errors import AmpFxError

__all__ = ["RunCount", "guard_module_hooks", "refuse_double_backward"]


_DOUBLE_BACKWARD = (
    "amp_fx: a backward with create_graph=True (double backward, as in a gradient "
    "penalty) reached a graph compiled through AOTAutograd (backend='aot_eager' or "
    "'inductor'), which cannot differentiate its own backward. Compile this model "
    "with amp_fx.compile(..., backend='eager'): its casts stay explicit, it supports "
    "double backward and is bitwise with eager autocast (GradScaler included)."
)


def refuse_double_backward(out: Any, guarded: set[type]) -> None:
    """Make a create_graph backward through the AOTAutograd graph that returned ``out`` raise
    amp_fx's error at once, instead of torch's at the second backward.

    AOTAutograd makes one ``torch.autograd.Function`` class per compiled graph; its backward is
    wrapped once (:func:`_guard_backward`) and recorded in ``guarded``; the caller skips this once
    ``guarded`` is not empty (a graph's outputs always come from its one class). A hook on each
    call's node cost about 4 to 8 us per forward+backward of a small model
    (bench/bench_call_overhead.py); it remains the fallback where the class is not what this
    expects."""
    for t in out if isinstance(out, (list, tuple)) else (out,):
        node = t.grad_fn if isinstance(t, torch.Tensor) else None
        if node is None:
            continue
        if type(node) in guarded:
            return
        if "CompiledFunction" not in type(node).__name__:  # an output view: the graph is its parent
            node = next(
                (f for f, _ in node.next_functions if f is not None and "CompiledFunction" in type(f).__name__), None
            )
            if node is None:
                continue
            if type(node) in guarded:
                return
        if _guard_backward(getattr(type(node), "_forward_cls", None)):
            guarded.add(type(node))
            return
        node.register_prehook(_raise_if_creating_graph)
        return


def _guard_backward(function: object) -> bool:
    """Wrap the ``backward`` of AOTAutograd's Function class for one graph so that it raises
    amp_fx's error when run with grad mode on (create_graph=True): the autograd engine reads
    ``backward`` from the class at each backward. False where the class has no such static
    method (another torch version), and nothing is changed."""
    original = getattr(function, "__dict__", {}).get("backward")
    if not isinstance(original, staticmethod):
        return False
    backward = original.__func__

    def refuse_create_graph(ctx: Any, *grads: Any) -> Any:
        if torch.is_grad_enabled():
            raise AmpFxError(_DOUBLE_BACKWARD)
        return backward(ctx, *grads)

    function.backward = staticmethod(refuse_create_graph)  # type: ignore[attr-defined]  # replaced on this Function
    return True


def _raise_if_creating_graph(grad_outputs: tuple[torch.Tensor | None, ...]) -> None:
    if torch.is_grad_enabled():
        raise AmpFxError(_DOUBLE_BACKWARD)


def guard_module_hooks() -> None:
    """Make the compile under way guard on module hooks, so that a hook added or removed later
    recompiles (and runs, as in eager) instead of being silently ignored.

    Dynamo skips the guards on empty hook dicts by default (``skip_nnmodule_hook_guards``). It
    builds a frame's guards after its backend returned, so amp_fx turns the setting off here, for
    this compile only, and an end-of-compile callback of Dynamo's turns it back on (a per-call
    toggle would cost about 2.6 us per call). A user who set it to False keeps that.
    """
    config = torch._dynamo.config
    if not config.skip_nnmodule_hook_guards or CompileContext.try_get() is None:
        return  # already guarding (the user's setting, or ours), or not called by Dynamo (no guards)
    handler = torch._dynamo.callback_handler
    if _restore_hook_guard_skip not in handler.end_callbacks:  # reset() clears the callbacks
        handler.register_end_callback(_restore_hook_guard_skip)
    config.skip_nnmodule_hook_guards = False
    _HOOK_GUARDS_ON[0] = True


_HOOK_GUARDS_ON = [False]
"""Whether amp_fx turned Dynamo's hook guards on for the compile under way."""


def _restore_hook_guard_skip(args: object) -> None:
    if _HOOK_GUARDS_ON[0]:
        _HOOK_GUARDS_ON[0] = False
        torch._dynamo.config.skip_nnmodule_hook_guards = True


class RunCount:
    """A counter shared by a backend and its siblings (a copy shares the object)."""

    def __init__(self) -> None:
        self.count = 0
