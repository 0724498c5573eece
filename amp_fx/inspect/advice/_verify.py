"""advise, verifying: a policy's end-to-end error against the float64 reference and the verdict.
Outputs, loss and every parameter's gradient (at GradScaler's initial loss scale, halved while the
gradients overflow, as GradScaler backs off) are compared with float64; a policy is verified when
its run has no inf/NaN and the largest of those errors is within the target. Every policy the
search tries is verified this way, the default policy's run first."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from amp_fx.inspect.advice._errors import Part, all_finite, combine, rel_error
from amp_fx.inspect.advice._reference import Reference

__all__: list[str] = []

MAX_BACKOFFS = 24
"""Halvings of the loss scale tried when the scaled gradients overflow (GradScaler backs off the
same way, one halving per skipped step): from 2**16 down to 2**-8."""


def initial_scale(dtype: torch.dtype) -> float:
    # GradScaler's init_scale; bf16 has fp32's exponent range and is trained without scaling
    return 2.0**16 if dtype == torch.float16 else 1.0


@dataclass(frozen=True)
class EndToEnd:
    """One run's end-to-end error against float64, by part and in all (the largest part; inf
    when anything is not finite)."""

    finite: bool
    error: float
    output_error: float
    loss_error: float | None
    grad_error: float | None
    scale: float
    """The loss scale the gradients were measured at."""
    grads: dict[str, torch.Tensor]
    """Parameter name -> its gradient, unscaled."""


def meets(finite: bool, error: float, target: float) -> bool:
    """The verdict: no inf/NaN, and the end-to-end error within ``target``."""
    return finite and error <= target


def end_to_end(
    model: torch.nn.Module,
    outs: Sequence[torch.Tensor],
    out_parts: Sequence[Part] | None,
    loss: torch.Tensor | None,
    ref: Reference,
    dtype: torch.dtype,
) -> EndToEnd:
    """The run's outputs ``outs`` (their error parts against ``ref.out``: ``out_parts``) and its
    ``loss``, whose backward gives the gradients of ``model``'s parameters."""
    tiny = torch.finfo(dtype).tiny
    scale = initial_scale(dtype)
    output_error = math.nan if out_parts is None else combine(out_parts, tiny)
    finite = all_finite(outs)
    grads: dict[str, torch.Tensor] = {}
    loss_error = grad_error = None
    if loss is not None:
        assert ref.loss is not None  # both from the same loss_fn (loss_of)
        loss_error = rel_error([loss.detach()], [ref.loss], tiny)
        finite = finite and all_finite([loss.detach()])
        if loss.requires_grad and finite:  # with a non-finite forward no scale helps
            wanted = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
            grads, scale = _scaled_grads(loss, wanted, scale)
            common = [n for n in grads if n in ref.grads]
            grad_error = rel_error([grads[n] for n in common], [ref.grads[n] for n in common], tiny) if common else None
            finite = finite and all_finite(list(grads.values()))
    errors = [e for e in (output_error, loss_error, grad_error) if e is not None and not math.isnan(e)]
    error = max(errors) if errors else 0.0
    if not finite:
        error = math.inf
    return EndToEnd(finite, error, output_error, loss_error, grad_error, scale, grads)


def _scaled_grads(
    loss: torch.Tensor, wanted: Sequence[tuple[str, torch.nn.Parameter]], scale: float
) -> tuple[dict[str, torch.Tensor], float]:
    """The gradients of ``loss * scale``, unscaled; the scale halved while they overflow."""
    grads: dict[str, torch.Tensor] = {}
    for _ in range(MAX_BACKOFFS + 1):
        gs = torch.autograd.grad(loss * scale, [p for _, p in wanted], retain_graph=True, allow_unused=True)
        grads = {n: g.detach() / scale for (n, _), g in zip(wanted, gs) if g is not None}
        if all_finite(list(grads.values())):
            break
        scale /= 2  # GradScaler skips the step and backs off
    return grads, scale
