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

__all__ = ["Backend", "resolve_backend", "backend_name"]

Backend = Callable[[torch.fx.GraphModule, list[Any]], Callable[..., Any]]


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
