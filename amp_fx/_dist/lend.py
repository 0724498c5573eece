"""Lending an FSDP2 model to the inspection tools, and taking it back as it was.

The inspection tools (:func:`amp_fx.explain`, :func:`amp_fx.compare`) run on a deep copy of the
model, so that your buffers (BatchNorm running stats) and gradients stay yours. FSDP2 refuses deep
copies ("FSDP does not support deepcopy"), and an unsharded copy would need the whole model on
every rank, which is what FSDP2 is there to avoid. So a model sharded with ``fully_shard`` is
lent instead: the tools run on the model itself, and :class:`Loan` keeps what their runs change:

* buffers: each module's buffer objects and their values, put back before every run and at the end;
* gradients: every parameter's ``.grad`` (the sharded parameters', and the unsharded ones' where
  FSDP2 holds them) is set aside, None during the runs (a backward then writes new gradient
  tensors instead of adding into yours), and put back at the end, the same objects;
* FSDP2's sharding: each parameter group sharded or unsharded as it was (a forward without
  backward leaves the root unsharded; the end reshards it, or all-gathers again what was unsharded).

Parameters are not written by the runs (no optimizer steps). What cannot be put back is refused at
the start, with what to do: a model in the middle of accumulating without gradient sync
(``set_requires_gradient_sync(False)``: FSDP2 keeps the unsharded gradients, which a backward
adds to), and parameter groups between forward and backward (``reshard_after_forward`` as an int).
FSDP2's lazy initialisation at the model's first call, if the tools make it, is the one the model's
own first call would make.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from amp_fx._common.compat import fsdp_param_groups
from amp_fx._dist.step import is_fsdp2

__all__ = ["Loan", "is_fsdp2"]


def _param_groups(model: torch.nn.Module) -> Iterator[tuple[torch.nn.Module, Any]]:
    """(FSDP2 module, one of its parameter groups) for each module ``fully_shard`` was applied to
    (several groups where its parameters lie on several meshes: ``fsdp_param_groups``)."""
    for m in model.modules():
        for group in fsdp_param_groups(m):
            yield m, group


class Loan:
    """The state of an FSDP2 model that the inspection tools' runs change, taken at the start.

    :meth:`reset` before each run: buffers as they were, every gradient None. :meth:`close` at the
    end: that, FSDP2's sharding as it was, and the gradients put back.
    """

    def __init__(self, model: torch.nn.Module, *, tool: str) -> None:
        self.model = model
        self._groups = list(_param_groups(model))
        for module, group in self._groups:
            _check_lendable(module, group, tool)
        self._unsharded = [module for module, group in self._groups if group.is_unsharded]
        self._buffers = [
            (m, name, b, b.detach().clone()) for m in model.modules() for name, b in m._buffers.items() if b is not None
        ]
        params: dict[int, torch.nn.Parameter] = {id(p): p for p in model.parameters()}
        for _, group in self._groups:
            for fp in group.fsdp_params:
                params.setdefault(id(fp.sharded_param), fp.sharded_param)
        self._grads = [(p, p.grad) for p in params.values()]

    def reset(self) -> None:
        """Buffers as at the start; every parameter's gradient None."""
        with torch.no_grad():
            for module, name, buffer, value in self._buffers:
                module._buffers[name] = buffer
                buffer.copy_(value)
        for p, _ in self._grads:
            p.grad = None
        for p in self.model.parameters():  # unsharded ones FSDP2 registered during a run
            p.grad = None

    def close(self) -> None:
        """Everything as at the start: buffers, FSDP2's sharding, gradients."""
        self.reset()
        for module, group in self._groups:
            if module in self._unsharded:
                module.unshard()  # type: ignore[operator]
            elif not group.is_sharded:
                module.reshard()  # type: ignore[operator]
        for p, grad in self._grads:
            p.grad = grad


def _check_lendable(module: torch.nn.Module, group: Any, tool: str) -> None:
    name = type(module).__name__
    if not group.reduce_grads or any(
        fp.unsharded_accumulated_grad is not None
        or getattr(fp, "_unsharded_param", None) is not None
        and fp._unsharded_param.grad is not None
        for fp in group.fsdp_params
    ):
        raise TypeError(
            f"amp_fx.{tool}: {name} is accumulating gradients without sync "
            "(set_requires_gradient_sync(False)): FSDP2 holds its unsharded gradients, which the "
            f"tool's backward would add to. Call amp_fx.{tool} before the accumulation starts or "
            "after the optimizer step"
        )
    if not (group.is_sharded or group.is_unsharded):
        raise TypeError(
            f"amp_fx.{tool}: {name}'s parameters are resharded after forward to a smaller group "
            "(reshard_after_forward as an int) and wait for their backward; call "
            f"amp_fx.{tool} before the forward or after the backward"
        )
