"""fp8 training, the kernel alone: amp_fx's fp8 matmul against torchao 0.18's ``Float8Linear``
(eager), bit for bit, per recipe and shape. The reference and its CPU patch: ``_fp8_cases.py``.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from amp_fx.fp8 import Fp8Recipe
from amp_fx.kernels.fp8_matmul import fp8_matmul
from amp_fx.testing import assert_bitwise
from amp_fx.testing.fp8_reference import (
    cpu_autocast_torchao,
    torchao_float8,
    torchao_missing,
)
from tests.fp8._fp8_cases import (
    FLOAT8,
    _recipe,
)

pytestmark = pytest.mark.skipif(torchao_missing() is not None, reason=str(torchao_missing()))


@pytest.mark.parametrize("shape", [(32, 32), (2, 16, 32)], ids=["2d", "3d"])
@pytest.mark.parametrize("recipe", [_recipe(r, r) for r in FLOAT8])
def test_kernel_bitwise_with_torchao_float8_linear(recipe: Fp8Recipe, shape: tuple[int, ...]) -> None:
    """fp8_matmul(x.bf16, w.t()) + bias.bf16 is torchao's Float8Linear under bf16 autocast: output,
    input gradient and weight and bias gradients, bit for bit."""
    torch.manual_seed(0)
    linear = nn.Linear(32, 48)
    x0 = torch.randn(*shape) * 3
    grad = torch.randn(*shape[:-1], 48, dtype=torch.bfloat16)

    ref = torchao_float8(linear, recipe.value)
    x_ref = x0.clone().requires_grad_()
    with cpu_autocast_torchao(), torch.autocast("cpu", torch.bfloat16):
        out_ref = ref(x_ref)
    out_ref.backward(grad)

    ours = copy.deepcopy(linear)
    x = x0.clone().requires_grad_()
    out = fp8_matmul(x.to(torch.bfloat16), ours.weight.t(), recipe) + ours.bias.to(torch.bfloat16)
    out.backward(grad)

    assert_bitwise(out, out_ref, "output")
    assert_bitwise(x.grad, x_ref.grad, "grad of x")
    assert_bitwise(ours.weight.grad, ref.weight.grad, "grad of weight")
    assert_bitwise(ours.bias.grad, ref.bias.grad, "grad of bias")


def test_kernel_is_not_a_bf16_matmul() -> None:
    """The negative twin: fp8 differs from the bf16 matmul eager autocast runs (else the bitwise
    tests above could pass with no fp8 at all)."""
    torch.manual_seed(0)
    x, w = torch.randn(32, 32, dtype=torch.bfloat16), torch.randn(48, 32)
    assert not torch.equal(fp8_matmul(x, w.t(), Fp8Recipe.TENSORWISE), x @ w.t().to(torch.bfloat16))
