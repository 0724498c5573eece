"""Gradient penalty (double backward, ``create_graph=True``), the AMP recipe's example.

AOTAutograd cannot differentiate its own backward; amp_fx says so in its own words and names
``backend="eager"``, which keeps the casts explicit, runs through eager autograd, and is bitwise
with eager autocast through the whole recipe, scaler included.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import Tensor, nn

import amp_fx
from amp_fx import AmpFxError


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def _recipe_step(
    model: Callable[[Tensor], Tensor],
    params: list[nn.Parameter],
    opt: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler,
    x: Tensor,
    y: Tensor,
    dtype: torch.dtype,
    forward_autocast: bool,
) -> Tensor:
    """The gradient-penalty step of PyTorch's AMP recipe ("Gradient penalty" section)."""
    with torch.autocast("cpu", dtype=dtype, enabled=forward_autocast):
        loss = nn.functional.mse_loss(model(x).float(), y)
    scaled_grads = torch.autograd.grad(scaler.scale(loss), params, create_graph=True)
    inv_scale = 1.0 / scaler.get_scale()
    grads = [g * inv_scale for g in scaled_grads]
    with torch.autocast("cpu", dtype=dtype):
        penalty = torch.stack([g.pow(2).sum() for g in grads]).sum().sqrt()
        loss = loss + penalty
    opt.zero_grad()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    return loss.detach()


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_double_backward_through_aot_autograd_names_the_eager_backend(backend: str) -> None:
    compiled = amp_fx.compile(_model(), backend=backend)
    loss = compiled(torch.randn(2, 8)).float().square().sum()
    with pytest.raises(AmpFxError, match="backend='eager'"):
        torch.autograd.grad(loss, list(compiled.parameters()), create_graph=True)
    # A plain backward (no create_graph) is unaffected.
    loss2 = compiled(torch.randn(2, 8)).float().square().sum()
    loss2.backward()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_gradient_penalty_with_eager_backend_is_bitwise(dtype: torch.dtype) -> None:
    reference, ours = _model(), _model()
    compiled = amp_fx.compile(ours, dtype=dtype, backend="eager")
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    opt = torch.optim.SGD(ours.parameters(), lr=0.1)
    # A small growth interval so that the scale changes during the run.
    ref_scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=2)
    scaler = amp_fx.GradScaler("cpu", init_scale=2.0**8, growth_interval=2)
    torch.manual_seed(1)
    batches = [(torch.randn(4, 8), torch.randn(4, 4)) for _ in range(4)]
    for x, y in batches:
        expected = _recipe_step(
            reference, list(reference.parameters()), ref_opt, ref_scaler, x, y, dtype, forward_autocast=True
        )
        actual = _recipe_step(compiled, list(ours.parameters()), opt, scaler, x, y, dtype, forward_autocast=False)
        torch.testing.assert_close(actual, expected, atol=0, rtol=0)
        assert scaler.get_scale() == ref_scaler.get_scale()
    for (name, p), q in zip(ours.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, atol=0, rtol=0, msg=name)
    assert compiled.amp_fx_records, "the eager backend must still capture and rewrite the graph"
