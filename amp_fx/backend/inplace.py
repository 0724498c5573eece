"""``amp_fx.compile(module, inplace=True)``: the module itself, its call (nn.Module's
``_compiled_call_impl``, as ``nn.Module.compile()`` sets it) amp_fx's compiled forward, kept
across copies and pickles; and its lazy form for models built on the meta device."""

from __future__ import annotations

from typing import Any

import torch
import torch._dynamo

from amp_fx._common.targets import check_target
from amp_fx.backend.wrapper import AmpCompiledModule, wrap
from amp_fx.options import Options

__all__ = ["compile_inplace", "compile_inplace_at_first_call", "inplace_call"]


class _InplaceCall:
    """The compiled call ``compile(module, inplace=True)`` sets on the module (``_compiled_call_impl``).

    nn.Module drops ``_compiled_call_impl`` when it is copied or pickled (its ``__getstate__``), so
    a copy of ``module.compile()`` runs eagerly, silently. amp_fx keeps this object under a second
    name (``_amp_fx_inplace``) that is copied, and reviving it sets the copy's compiled call: a
    copy (deepcopy, pickle, torch.save) is compiled again with the same options, lazily at its
    first call (while it is being copied its parameters are not there yet), with its own records
    and Dynamo cache entries.
    """

    def __init__(self, module: torch.nn.Module, options: Options) -> None:
        self.module = module
        self.options = options
        self.compiled: AmpCompiledModule | None = None

    def install(self) -> None:
        self.module.__dict__["_compiled_call_impl"] = self
        self.module.__dict__["_amp_fx_inplace"] = self

    def uninstall(self) -> None:
        """:func:`amp_fx.uncompile`: ``module(...)`` runs its eager forward again."""
        self.module._compiled_call_impl = None
        del self.module.__dict__["_amp_fx_inplace"]

    def build(self) -> AmpCompiledModule:
        if self.compiled is None:
            compiled = wrap(self.module, self.options)
            assert isinstance(compiled, AmpCompiledModule)  # wrap wraps every module in one
            self.compiled = compiled
            self.forward = compiled._amp_fx_forward  # type: ignore[method-assign]  # built: its forward from now on
        return compiled if self.compiled is None else self.compiled

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Until built (a copy's first call): build, then the compiled forward (set on the instance)."""
        return self.build()._amp_fx_forward(*args, **kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward(*args, **kwargs)

    def __reduce_ex__(self, protocol: object) -> tuple[object, tuple[object, ...]]:
        return (_revive_inplace, (self.module, self.options))


def _revive_inplace(module: torch.nn.Module, options: Options) -> _InplaceCall:
    # Called while ``module`` (the copy) is being rebuilt, before its __setstate__, whose state
    # has no _compiled_call_impl: what is set here stays.
    call = _InplaceCall(module, options)
    call.install()
    return call


def inplace_call(model: object) -> _InplaceCall | None:
    """The in-place compiled call of ``model`` (``compile(model, inplace=True)``), else None."""
    found = getattr(model, "__dict__", {}).get("_compiled_call_impl")
    return found if isinstance(found, _InplaceCall) else None


def compile_inplace(model: object, options: Options) -> Any:
    """``compile(model, inplace=True)``: the module, its call set to amp_fx's compiled forward."""
    check_target(model, "amp_fx.compile(inplace=True)")
    if not isinstance(model, torch.nn.Module):
        raise TypeError(
            f"amp_fx.compile(inplace=True) compiles an nn.Module in place, got "
            f"{type(model).__name__}; drop inplace=True to compile a function"
        )
    if isinstance(model, (AmpCompiledModule, torch._dynamo.eval_frame.OptimizedModule)):
        raise TypeError(
            f"amp_fx.compile(inplace=True): {type(model).__name__} is a compiled wrapper; "
            "compile the module under it in place (its original_module / _orig_mod)"
        )
    call = _InplaceCall(model, options)
    call.build()  # the checks of compile() run now, not at the first call
    call.install()
    return model


def compile_inplace_at_first_call(model: torch.nn.Module, options: Options) -> torch.nn.Module:
    """``compile(model, inplace=True)`` whose build, and so its checks, waits for the first call:
    for a model whose parameters are not materialised yet (torchtitan builds it on the meta
    device, then ``to_empty`` and ``init_weights``)."""
    _InplaceCall(model, options).install()
    return model
