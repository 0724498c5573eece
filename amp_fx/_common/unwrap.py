"""The one walk through the wrappers around a user's model.

``amp_fx.compile``'s module (its original under ``_amp_fx_original``), ``torch.compile``'s
``OptimizedModule`` (``_orig_mod``) and, where asked, DDP's ``module``: names, watches and process
groups are found on the module under them.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

__all__ = ["layers", "unwrap_compiled"]

_MAX_DEPTH = 8  # wrappers of wrappers; a cycle or a pathological chain stops here


def layers(model: object, *, ddp: bool = False, any_module_attr: bool = False) -> Iterator[object]:
    """``model``, then each object it wraps, outermost first.

    Always through ``amp_fx.compile`` and ``torch.compile`` wrappers; with ``ddp``, through
    ``DistributedDataParallel``; with ``any_module_attr``, through any object's ``module`` attribute
    (DDP, and the wrappers frameworks put around a compiled model)."""
    seen: set[int] = set()
    while model is not None and id(model) not in seen and len(seen) < _MAX_DEPTH:
        yield model
        seen.add(id(model))
        own = getattr(model, "__dict__", {})
        if isinstance(model, torch._dynamo.eval_frame.OptimizedModule):
            model = model._orig_mod
        elif "_amp_fx_original" in own:
            model = own["_amp_fx_original"]
        elif ddp and isinstance(model, torch.nn.parallel.DistributedDataParallel):
            model = model.module
        elif any_module_attr:
            model = getattr(model, "module", None)
        else:
            return


def unwrap_compiled(model: object, *, ddp: bool = False) -> object:
    """The innermost object of :func:`layers` (the module whose names the user knows)."""
    last = model
    for last in layers(model, ddp=ddp):
        pass
    return last
