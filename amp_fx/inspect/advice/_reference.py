"""advise, measuring (step 1): the float64 reference. The model and its floating inputs in float64,
no autocast, on a private copy; each module call's inputs and outputs and each parameter's gradient
are kept for the policy runs to be measured against."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from amp_fx.inspect._probe import module_hooks
from amp_fx.inspect._runner import SEED, Call, float64_grouped_mm, private_copy
from amp_fx.inspect.advice._errors import floats

__all__: list[str] = []


@dataclass
class Reference:
    inputs: dict[tuple[str, int], list[torch.Tensor]]
    outputs: dict[tuple[str, int], list[torch.Tensor]]
    out: list[torch.Tensor]
    loss: torch.Tensor | None
    grads: dict[str, torch.Tensor]


def loss_of(out: Any, loss_fn: Callable[[Any], torch.Tensor] | None) -> torch.Tensor | None:
    if loss_fn is None:
        return None
    loss = loss_fn(out)
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise ValueError(
            f"amp_fx.advise: loss_fn must return a scalar tensor, got "
            f"{type(loss).__name__}{'' if not isinstance(loss, torch.Tensor) else list(loss.shape)}"
        )
    return loss


def reference(model: Any, call: Call, loss_fn: Callable[[Any], torch.Tensor] | None) -> Reference:
    m = private_copy(model, float64=True)
    inputs: dict[tuple[str, int], list[torch.Tensor]] = {}
    outputs: dict[tuple[str, int], list[torch.Tensor]] = {}
    starts: dict[str, int] = {}  # inputs are keyed by the call's start, outputs by its end
    calls: dict[str, int] = {}

    def pre(name: str, args: Any, kwargs: Any) -> None:
        i = starts.get(name, 0)
        starts[name] = i + 1
        # copies: a later in-place op (ReLU(inplace=True) after a BatchNorm) must not change them
        inputs[(name, i)] = [t.clone() for t in floats((args, kwargs))]

    def post(name: str, out: Any) -> None:
        i = calls.get(name, 0)
        calls[name] = i + 1
        outputs[(name, i)] = [t.clone() for t in floats(out)]

    # float64_grouped_mm: a mixture-of-experts layer's grouped GEMMs, which have no float64 kernel
    with torch.random.fork_rng(devices=[]), module_hooks(m, pre, post), float64_grouped_mm():
        torch.manual_seed(SEED)
        out = call.copy(to=torch.float64)(m)
        loss = loss_of(out, loss_fn)
    grads: dict[str, torch.Tensor] = {}
    if loss is not None and loss.requires_grad:
        loss.backward()
        grads = {n: p.grad.detach() for n, p in m.named_parameters() if p.grad is not None}
    return Reference(inputs, outputs, floats(out), None if loss is None else loss.detach(), grads)
