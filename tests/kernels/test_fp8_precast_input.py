"""``fp8_matmul(..., x_fp8=...)``: an input cast before the matmul (what sequence parallelism
all-gathers in e4m3, ``amp_fx/kernels/fp8_activation_gather.py``) gives the matmul's own numerics.

Reference: the same matmul casting its input itself. The gathered path's distributed half (the
cast per shard, the byte gather, the reduce-scatter of the gradient) is tested on 2 ranks in
``tests/distributed/test_distributed_tp.py``."""

from __future__ import annotations

import pytest
import torch

from amp_fx.fp8 import Fp8Recipe
from amp_fx.kernels.fp8_matmul import fp8_matmul, fp8_matmul_cached_weight, input_cast, weight_casts
from amp_fx.testing import assert_bitwise


@pytest.mark.parametrize("cached", [False, True], ids=["weight", "cached_weight"])
@pytest.mark.parametrize("shape", [(24, 32), (2, 12, 32)], ids=["2d", "3d"])
def test_a_precast_input_gives_the_matmuls_own_output_and_gradients(shape: tuple[int, ...], cached: bool) -> None:
    """Tensorwise: the output and the weight gradient bit for bit with ``fp8_matmul(x_bf16, w)``
    (the weight-gradient GEMM takes the same e4m3 cast of the same values); the fp32 carrier
    receives the input gradient in its own dtype, the bf16 one converted exactly."""
    torch.manual_seed(0)
    recipe = Fp8Recipe.TENSORWISE
    x = (torch.randn(*shape) * 3).to(torch.bfloat16).requires_grad_()
    w0 = torch.randn(48, 32)
    grad = torch.randn(*shape[:-1], 48, dtype=torch.bfloat16)

    def run(x_in: torch.Tensor, **kw: object) -> tuple[torch.Tensor, torch.Tensor]:
        w = w0.clone().requires_grad_()
        if cached:
            out = fp8_matmul_cached_weight(x_in, w.t(), *weight_casts(w.detach().t(), recipe), recipe, **kw)
        else:
            out = fp8_matmul(x_in, w.t(), recipe, **kw)
        out.backward(grad)
        return out, w.grad

    want_out, want_wgrad = run(x)
    carrier = torch.zeros((), dtype=torch.float32).expand(shape).requires_grad_()
    data, scale = input_cast(x.detach(), recipe)
    got_out, got_wgrad = run(carrier, x_fp8=(data, scale, torch.bfloat16))
    assert got_out.dtype == torch.bfloat16
    assert_bitwise(got_out, want_out, "output")
    assert_bitwise(got_wgrad, want_wgrad, "weight gradient")
    assert carrier.grad.dtype == torch.float32
    assert_bitwise(carrier.grad, x.grad.float(), "input gradient")


def test_a_precast_input_is_refused_for_a_rowwise_recipe() -> None:
    """A rowwise recipe's weight-gradient GEMM scales the input per column, which a cast made
    for the forward GEMM cannot serve: refused, naming why."""
    x, w = torch.randn(16, 32, dtype=torch.bfloat16), torch.randn(32, 16)
    data, scale = input_cast(x, Fp8Recipe.TENSORWISE)
    with pytest.raises(ValueError, match="tensorwise recipe only"):
        fp8_matmul(x, w, Fp8Recipe.ROWWISE, x_fp8=(data, scale, torch.bfloat16))
