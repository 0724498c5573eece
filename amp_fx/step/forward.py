"""The forward and the loss of a compiled step, and how they are compiled.

:class:`ForwardLoss` is the step's arithmetic before the backward: ``loss_fn(model(*inputs),
*targets)``, checked to be a floating-point scalar, divided over the accumulation window (torch's
recipe: the gradients are the window's mean) and multiplied by the loss scale
(``ScalerMode.DYNAMIC``). It is the one home of that rule: :func:`compile_forward` compiles it with
``amp_fx.compile`` (the loss computed under the model's autocast policy, as in torch's AMP recipe)
on one device, and hands it, as a callable, to ``amp_fx._dist.step.distributed_forward`` for DDP and
FSDP2, which calls it on the model compiled unit by unit. AOTAutograd compiles its backward.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from amp_fx._dist.step import distributed_forward
from amp_fx.api import compile_with
from amp_fx.options import Options

__all__ = ["ForwardLoss", "LossFn", "compile_forward", "module_prefixes"]

LossFn = Callable[..., torch.Tensor]


@dataclass(frozen=True)
class ForwardLoss:
    """``forward_loss(model, scale, *batch, **model_kwargs) -> (loss, scaled loss)``.

    The first ``n_inputs`` of ``batch`` go to the model with ``model_kwargs``, the rest to
    ``loss_fn`` after the output. ``loss`` is returned detached and undivided; the scaled loss, the
    one to call ``backward()`` on, is divided by ``accumulate`` (when > 1) and multiplied by
    ``scale`` when ``multiply_scale`` (``ScalerMode.DYNAMIC``).
    """

    loss_fn: LossFn
    n_inputs: int
    accumulate: int
    multiply_scale: bool

    def __call__(
        self, model: Callable[..., Any], scale: torch.Tensor, *batch: Any, **model_kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        n = self.n_inputs
        loss = self.loss_fn(model(*batch[:n], **model_kwargs), *batch[n:])
        _check_loss(loss)  # before the loss is used: a None loss must not reach the tracer's ops
        scaled = loss
        if self.accumulate > 1:
            scaled = scaled / self.accumulate  # torch's recipe: gradients are the window mean
        if self.multiply_scale:
            scaled = scaled * scale
        return loss.detach(), scaled


class _OnOneDevice:
    """The frame ``amp_fx.compile`` compiles for a step on one device. Dynamo reaches the model as
    ``self.model``; the model is the compile's ``root``, so module paths are names under it, as
    ``amp_fx.compile(model)`` names them (a frame Dynamo resumes inside a submodule after a graph
    break included)."""

    def __init__(self, model: torch.nn.Module, forward_loss: ForwardLoss) -> None:
        self.model = model
        self.forward_loss = forward_loss

    def run(self, scale: torch.Tensor, *batch: Any, **model_kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        return self.forward_loss(self.model, scale, *batch, **model_kwargs)


def compile_forward(
    model: torch.nn.Module, forward_loss: ForwardLoss, options: Options, *, micro_step: Callable[[], int]
) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """``forward(scale, *batch, **model_kwargs) -> (loss, scaled loss)``, compiled, with the compiled
    model's ``amp_fx_records``, ``amp_fx_weight_cache`` and ``amp_fx_watch``.

    Not fullgraph: a graph break in the model (e.g. a logger call in a Hugging Face model) splits
    the forward into graphs, each rewritten, with no host sync between them. DDP/FSDP2: per-unit
    capture, no gradient sync within a window (``micro_step()``: the micro-batches of this window
    that came before). The caller has turned the weight cache off for FSDP2
    (``amp_fx.backend.weight_cache.weight_cache_off_for_fsdp2``).
    """
    label = f"compile_step({type(model).__name__})"
    forward = distributed_forward(
        model,
        forward_loss,
        dtype=options.dtype,
        accumulate=forward_loss.accumulate,
        micro_step=micro_step,
        compile_model=lambda m: compile_with(m, options, label=label),
    )
    return (
        forward
        if forward is not None
        else compile_with(_OnOneDevice(model, forward_loss).run, options, label=label, root=model)
    )


def module_prefixes(model: torch.nn.Module) -> tuple[str, ...]:
    """What the compiled forward's module paths start with, before the names under the user's root
    module: ``module.`` under DDP (the DDP module is the root), nothing on one device (the model is
    the root of its frame's compile) or under FSDP2 (the model compiled itself)."""
    if torch.distributed.is_available() and isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return ("module.",)
    return ()


def _check_loss(loss: object) -> None:
    """loss_fn's result must be a floating-point 0-dim tensor (checked while tracing: the check
    reads metadata only; a failing one breaks the graph and raises in eager)."""
    if isinstance(loss, torch.Tensor) and loss.dim() == 0 and loss.is_floating_point():
        return
    what = (
        f"a {type(loss).__name__}"
        if not isinstance(loss, torch.Tensor)
        else f"a {loss.dtype} tensor of shape {tuple(loss.shape)}"
    )
    hint = (
        " (a Hugging Face model returns loss=None when no labels are passed)"
        if loss is None
        else "; reduce it (e.g. .mean()) in loss_fn"
    )
    raise ValueError(f"amp_fx: loss_fn must return a floating-point scalar (0-dim) tensor, got {what}{hint}")
