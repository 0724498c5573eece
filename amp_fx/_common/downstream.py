"""The one place a ``backend=`` argument (a name or a callable) becomes a torch.compile backend.

Used by :class:`~amp_fx.backend.AmpBackend` for its downstream backend and by the inspection
tools' recorder; a backend name given to amp_fx means what it means to ``torch.compile``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any, cast

import torch
import torch.fx

__all__ = [
    "Backend",
    "BackwardCompile",
    "BACKWARD_BACKENDS",
    "InductorCompile",
    "resolve_backend",
    "backend_name",
    "with_backward_compile",
]

Backend = Callable[[torch.fx.GraphModule, list[Any]], Callable[..., Any]]
BackwardCompile = Callable[[torch.fx.GraphModule, Any, Backend], Callable[..., Any]]
"""``around(gm, example_inputs, compile_graph)``: what compiles AOTAutograd's backward graph ``gm``
(calling ``compile_graph`` on it, or on a graph made from it)."""
InductorCompile = Callable[..., Callable[..., Any]]
"""A compile with ``compile_fx``'s calling convention: ``(gm, example_inputs, *, inner_compile=...)``
(``inner_compile`` compiles each graph AOTAutograd makes: forward, backward or inference)."""
BACKWARD_BACKENDS = ("aot_eager", "inductor")
"""The backends whose backward compile amp_fx reaches (:func:`with_backward_compile`)."""


def resolve_backend(backend: str | Backend, *, inductor_config: Mapping[str, Any] | None = None) -> Backend:
    """The compiler function for ``backend``: a callable is used as given; ``"inductor"`` is
    ``compile_fx`` (with ``inductor_config`` as its config patches); any other name is looked up
    in Dynamo's registry, as ``torch.compile(backend=name)`` does."""
    if callable(backend):
        return backend
    if backend == "inductor":
        from torch._inductor.compile_fx import compile_fx

        # compile_fx is typed with the union of what its export modes return; a compile returns
        # the compiled callable.
        if inductor_config:
            return cast(Backend, functools.partial(compile_fx, config_patches=dict(inductor_config)))
        return cast(Backend, compile_fx)
    return torch._dynamo.lookup_backend(backend)


def backend_name(backend: str | Backend) -> str:
    """How amp_fx names a backend in messages and records: the string, or the callable's name."""
    return backend if isinstance(backend, str) else getattr(backend, "__name__", repr(backend))


def with_backward_compile(
    backend: str,
    *,
    inductor_config: Mapping[str, Any] | None,
    around: BackwardCompile,
    autograd_cache: bool = True,
    inductor: InductorCompile | None = None,
) -> Backend | None:
    """The downstream compile of ``backend`` with its backward graph compiled through ``around``, or
    None where the backend has no backward graph amp_fx can reach (``eager``, another name).

    ``aot_eager``: torch's ``aot_eager`` with a backward compiler that calls ``around`` on its nop
    compiler. ``inductor``: ``inductor`` (by default ``compile_fx`` with ``inductor_config`` as its
    config patches; ``numerics="eager"`` passes its own, amp_fx/backend/eager_numerics.py) with an
    ``inner_compile`` that calls ``around`` on ``compile_fx_inner`` for the backward graph
    (``is_backward=True``). ``autograd_cache=False`` turns AOTAutograd's cache off for the compile:
    its entries would hold a backward that ``around`` changed without what ``around`` added around
    it."""
    if backend == "aot_eager":
        from torch._dynamo.backends.debugging import aot_eager, boxed_nop

        return functools.partial(aot_eager, bw_compiler=lambda gm, ex: around(gm, ex, boxed_nop))
    if backend == "inductor":
        from torch._inductor.compile_fx import compile_fx_inner

        def inner(gm: torch.fx.GraphModule, example_inputs: Any, **kwargs: Any) -> Any:
            if not kwargs.get("is_backward"):
                return compile_fx_inner(gm, example_inputs, **kwargs)
            return around(gm, example_inputs, lambda g, ex: compile_fx_inner(g, ex, **kwargs))

        compile_graph = inductor if inductor is not None else _compile_fx(inductor_config)

        def compile_inductor(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
            with torch._functorch.config.patch(enable_autograd_cache=autograd_cache):
                return compile_graph(gm, example_inputs, inner_compile=inner)

        return compile_inductor
    return None


def _compile_fx(inductor_config: Mapping[str, Any] | None) -> InductorCompile:
    from torch._inductor.compile_fx import compile_fx

    def compile_graph(gm: torch.fx.GraphModule, example_inputs: list[Any], **kwargs: Any) -> Callable[..., Any]:
        # compile_fx's declared return is a union; given a graph module it returns the callable
        return cast(
            Callable[..., Any], compile_fx(gm, example_inputs, config_patches=dict(inductor_config or {}), **kwargs)
        )

    return compile_graph
