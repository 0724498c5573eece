"""amp_fx.compile: torch.compile with the autocast policy applied as a graph pass."""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch._dynamo
import torch._inductor
from torch.utils._pytree import tree_flatten

from amp_fx._dist.capture import distributed_units, unit_call
from amp_fx.backend import AmpBackend, Backend, GraphRecord, summarize
from amp_fx.capture import is_cacheable_leaf
from amp_fx.errors import AmpFxError
from amp_fx.policy import Policy, resolve_dtype

__all__ = ["compile", "AmpCompiledModule", "records"]

F = TypeVar("F", bound=Callable[..., Any])


def _module_device_type(module: torch.nn.Module) -> str:
    """The device type of the module's first parameter (or buffer); cpu if it has none.

    Only the first: walking every submodule on each call costs more than the call itself for
    small models, and a module split across cpu and cuda is not something autocast handles.
    """
    first = next(itertools.chain(module.parameters(), module.buffers()), None)
    return "cuda" if first is not None and first.is_cuda else "cpu"


def _amp_call(target: Callable[..., Any], backend: AmpBackend,
              compile_kwargs: dict[str, Any]) -> Callable[..., Any]:
    """Compile ``target`` with ``backend`` and call it inside ``torch.autocast``.

    The captured graphs run with autocast off and their casts explicit (AmpBackend). The ambient
    autocast serves two other purposes: code that Dynamo leaves to eager (graph breaks, skipped
    modules such as nn.LSTM) runs under eager autocast, exactly as without amp_fx; and Dynamo's
    own fake propagation sees autocast's dtypes, so Python code that reads ``x.dtype`` (e.g.
    ``h.to(x.dtype)`` in an RMSNorm) is specialised to the dtype the tensor has at run time.

    Whether a tensor argument is a leaf that requires grad decides whether its cast is shared
    (eager autocast's cast cache), and Dynamo does not guard on leafness: each pattern of leaf
    arguments gets its own compiled callable, with a backend that shares the records.
    amp_fx's own errors are re-raised unwrapped from Dynamo's BackendCompilerFailed.
    """
    compiled_by_leaves: dict[tuple[bool, ...], Callable[..., Any]] = {}

    def call(*args: Any, **kwargs: Any) -> Any:
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        leaves = tuple(is_cacheable_leaf(t) for t in tensors)
        if any(t.is_cuda for t in tensors):
            device_type = "cuda"
        elif isinstance(target, torch.nn.Module):
            device_type = _module_device_type(target)
        else:
            device_type = "cpu"
        compiled = compiled_by_leaves.get(leaves)
        if compiled is None:
            sibling = backend if not compiled_by_leaves else backend.sibling()
            compiled = compiled_by_leaves[leaves] = torch.compile(target, backend=sibling,
                                                                  **compile_kwargs)
        try:
            with torch.autocast(device_type, dtype=backend.dtype):
                return compiled(*args, **kwargs)
        except torch._dynamo.exc.BackendCompilerFailed as e:
            inner = getattr(e, "inner_exception", None)
            if isinstance(inner, (AmpFxError, ValueError)):
                raise inner from None
            raise

    if not isinstance(target, torch.nn.Module):
        call = functools.wraps(target)(call)
    return call


class AmpCompiledModule(torch.nn.Module):
    """The module :func:`compile` returns: the original's parameters, buffers and submodules.

    It shares the original module's ``_parameters``, ``_buffers`` and ``_modules`` dicts, so
    ``state_dict()`` keys, parameter objects and buffers are the original's: a state_dict of
    either loads into the other, and an optimizer built on either trains both. Attributes it does
    not define are read from the original module.
    """

    def __init__(self, module: torch.nn.Module, backend: AmpBackend, compile_kwargs: dict[str, Any]) -> None:
        super().__init__()
        for name in ("_parameters", "_buffers", "_modules", "_non_persistent_buffers_set"):
            self.__dict__[name] = module.__dict__[name]
        self.__dict__["_amp_fx_original"] = module
        self.__dict__["_amp_fx_backend"] = backend
        units = distributed_units(module)  # DDP / FSDP2: hooks eager, wrapped forwards compiled
        self.__dict__["_amp_fx_forward"] = (
            _amp_call(module, backend, compile_kwargs) if units is None
            else unit_call(module, units, lambda fn: _amp_call(fn, backend, compile_kwargs), backend.dtype,
                           backend.policy))
        self.training = module.training

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._amp_fx_forward(*args, **kwargs)

    def train(self, mode: bool = True) -> AmpCompiledModule:
        self._amp_fx_original.train(mode)
        return super().train(mode)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.__dict__["_amp_fx_original"], name)

    @property
    def original_module(self) -> torch.nn.Module:
        """The module that was compiled (shares all state with this one)."""
        return self._amp_fx_original

    @property
    def amp_fx_records(self) -> list[GraphRecord]:
        """One record per graph captured so far (filled in when the module first runs)."""
        return self._amp_fx_backend.records

    def amp_fx_summary(self) -> str:
        """A table of what the passes did to each captured graph."""
        return summarize(self._amp_fx_backend.records)


def _check_keep_fp32(policy: Policy, model: object) -> None:
    names = [s for s in policy.keep_fp32 if isinstance(s, str)]
    if not names:
        return
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"amp_fx: Policy.keep_fp32 names submodules {names}, but {model!r} is a "
                         "function, not an nn.Module")
    known = {n for n, _ in model.named_modules() if n}
    for name in names:
        if name not in known:
            close = sorted(k for k in known if k.split(".")[-1] == name.split(".")[-1])[:5]
            hint = f" (did you mean {close}?)" if close else ""
            raise ValueError(f"amp_fx: Policy.keep_fp32 names submodule {name!r}, which "
                             f"{type(model).__name__} does not have{hint}")


def compile(
    model_or_fn: F,
    *,
    dtype: str | torch.dtype = "bf16",
    policy: Policy | None = None,
    backend: str | Backend = "inductor",
    fold: bool = True,
    **torch_compile_kwargs: Any,
) -> F:
    """Compile a module or function with mixed precision inserted into its graphs.

    Args:
        model_or_fn: an ``nn.Module`` or a callable.
        dtype: the lower-precision dtype: "bf16"/"bfloat16"/torch.bfloat16 or
            "fp16"/"float16"/torch.float16.
        policy: overrides of eager autocast's op tables and fp32-kept submodules.
        backend: any torch.compile backend ("inductor", "aot_eager", "eager", or a callable);
            amp_fx rewrites each captured graph, then hands it on.
        fold: run the value-preserving cast-folding pass.
        **torch_compile_kwargs: passed to ``torch.compile`` (``fullgraph``, ``dynamic``, ...).

    Returns:
        For a module, an :class:`AmpCompiledModule` sharing the module's parameters, buffers and
        state_dict keys; for a function, the compiled function.

    Example:
        >>> model = amp_fx.compile(torch.nn.Linear(4, 4), dtype="bf16", backend="aot_eager")
        >>> model(torch.randn(2, 4)).dtype
        torch.bfloat16
    """
    lower = resolve_dtype(dtype)
    policy = Policy() if policy is None else policy
    if not isinstance(policy, Policy):
        raise TypeError(f"amp_fx: policy must be an amp_fx.Policy, got {type(policy).__name__}")
    inductor_config = _inductor_config(backend, torch_compile_kwargs)
    if not callable(model_or_fn):
        raise TypeError(f"amp_fx.compile expects an nn.Module or a callable, got "
                        f"{type(model_or_fn).__name__}")
    _check_keep_fp32(policy, model_or_fn)
    amp_backend = AmpBackend(dtype=lower, policy=policy, backend=backend, fold=fold,
                             inductor_config=inductor_config)
    if isinstance(model_or_fn, torch.nn.Module):
        _check_devices(model_or_fn)
        return AmpCompiledModule(model_or_fn, amp_backend, torch_compile_kwargs)  # type: ignore[return-value]
    compiled = _amp_call(model_or_fn, amp_backend, torch_compile_kwargs)
    compiled.amp_fx_records = amp_backend.records  # type: ignore[attr-defined]
    return compiled  # type: ignore[return-value]


def _inductor_config(backend: object, kwargs: dict[str, Any]) -> dict[str, Any]:
    """torch.compile's ``mode``/``options`` become inductor config patches (popped from kwargs)."""
    mode, options = kwargs.pop("mode", None), kwargs.pop("options", None)
    if (mode is not None or options) and backend != "inductor":
        raise ValueError(f"amp_fx: mode= and options= configure inductor, but backend={backend!r}")
    config = dict(torch._inductor.list_mode_options(mode)) if mode else {}
    config.update(options or {})
    return config


def _check_devices(module: torch.nn.Module) -> None:
    for name, t in (*module.named_parameters(), *module.named_buffers()):
        if t.device.type not in ("cpu", "cuda"):
            raise ValueError(f"amp_fx: {name} is on device {t.device}, which amp_fx has no autocast "
                             "policy for; supported device types are 'cpu' and 'cuda'")


def records(compiled: object) -> list[GraphRecord]:
    """The per-graph records of a module or function returned by :func:`compile`."""
    found = getattr(compiled, "amp_fx_records", None)
    if found is None:
        raise TypeError(f"amp_fx: {compiled!r} was not returned by amp_fx.compile")
    return found
