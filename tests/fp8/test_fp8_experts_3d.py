"""Experts held as one 3-D parameter, in fp8, with and without the weight cache."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import Tensor, nn

import amp_fx
from amp_fx.testing import assert_bitwise
from amp_fx.testing.fp8_reference import (
    count_gemm_flops,
    cpu_autocast_torchao,
    expert_linears,
    torchao_float8,
    torchao_missing,
)
from tests.fp8._fp8_cases import (
    _recipe,
    compile_fp8,
    loss_fn,
    sgd_uncached_and_cached,
)

pytestmark = pytest.mark.skipif(torchao_missing() is not None, reason=str(torchao_missing()))


class _DenseMixture(nn.Module):
    """A mixture whose experts are one 3-D parameter per projection (``[E, in, out]``), every expert
    on every token, weighted by a softmax router (no data-dependent routing: the matmuls stay in the
    graph). The router's ``N=4`` is not a multiple of 16: it runs in fp8 padded to 16."""

    def __init__(self, experts: int = 4, d: int = 32, hidden: int = 64) -> None:
        super().__init__()
        self.router = nn.Linear(d, experts)
        self.w_in = nn.Parameter(torch.randn(experts, d, hidden) / d**0.5)
        self.w_out = nn.Parameter(torch.randn(experts, hidden, d) / hidden**0.5)

    def forward(self, x: Tensor) -> Tensor:
        gate = torch.softmax(self.router(x), dim=-1)
        out = torch.zeros_like(x)
        for e in range(self.w_in.shape[0]):
            out = out + gate[..., e : e + 1] * (torch.relu(x @ self.w_in[e]) @ self.w_out[e])
        return out


class _MixtureTwin(nn.Module):
    """The same mixture with each expert's projections as ``nn.Linear`` (weights ``w[e].T``): what
    torchao can convert."""

    def __init__(self, m: _DenseMixture) -> None:
        super().__init__()
        self.router = copy.deepcopy(m.router)
        self.inp = expert_linears(m.w_in.transpose(1, 2))
        self.out = expert_linears(m.w_out.transpose(1, 2))

    def forward(self, x: Tensor) -> Tensor:
        gate = torch.softmax(self.router(x), dim=-1)
        out = torch.zeros_like(x)
        for e in range(len(self.inp)):
            out = out + gate[..., e : e + 1] * self.out[e](torch.relu(self.inp[e](x)))
        return out


@pytest.mark.slow_cases
@pytest.mark.parametrize("recipe", [_recipe("tensorwise"), _recipe("rowwise")])
def test_experts_in_one_3d_parameter_run_in_fp8(recipe: str) -> None:
    """Experts held as one 3-D parameter and read per expert (``x @ self.w_in[e]``, an
    ``aten.select`` view): each expert's matmuls run in fp8, bitwise with torchao converting the
    ``nn.Linear`` twin's experts (loss, every gradient, the fp8 share of GEMM FLOPs); the router
    (``N=4``) too, padded (torchao with ``pad_inner_dim``). torchao cannot convert the 3-D
    parameter itself. Before, a ``select`` of a parameter was not a weight operand: the experts
    ran in bf16."""
    torch.manual_seed(0)
    model, x = _DenseMixture(), torch.randn(2, 16, 32)
    twin = _MixtureTwin(model)
    compiled = compile_fp8(copy.deepcopy(model), recipe, strict=True)
    loss_fn(compiled(x)).backward()  # compile forward and backward
    for p in compiled.parameters():
        p.grad = None
    with count_gemm_flops() as flops:
        loss = loss_fn(compiled(x))
        loss.backward()
    decisions = [d for r in amp_fx.records(compiled) if r.fp8 is not None for d in r.fp8.decisions]
    assert len(decisions) == 9 and all(d.converted for d in decisions)
    ref = torchao_float8(twin, recipe, pad_inner_dim=True)
    with count_gemm_flops() as ref_flops:
        with cpu_autocast_torchao(), torch.autocast("cpu", torch.bfloat16):
            ref_loss = loss_fn(ref(x))
        ref_loss.backward()
    assert_bitwise(loss.detach(), ref_loss.detach(), f"{recipe}: loss")
    grads = dict(compiled.named_parameters())
    expected = {
        "router.weight": ref.router.weight.grad,
        "router.bias": ref.router.bias.grad,
        "w_in": torch.stack([ref.inp[e].weight.grad.t() for e in range(4)]),
        "w_out": torch.stack([ref.out[e].weight.grad.t() for e in range(4)]),
    }
    assert_bitwise({n: p.grad for n, p in grads.items()}, expected, f"{recipe}: gradients")
    # every GEMM in fp8: torchao's 27 (9 matmuls x 3) less the 5 input gradients of the matmuls
    # whose input is the model's (x needs none: the router's, the experts' first): AOTAutograd drops
    # them, torchao's Function computes them
    assert flops.other == ref_flops.other == 0 and ref_flops.calls["fp8"] == 27, (flops, ref_flops)
    assert flops.calls["fp8"] == 22 and flops.fp8_share == 1.0 and flops.unaligned == 0, (flops, ref_flops)


def test_experts_in_one_3d_parameter_with_the_weight_cache() -> None:
    """The weight cache lifts an expert's fp8 casts through the ``select`` view: 2 SGD steps of 2
    micro-batches, losses and parameters bitwise with the uncached fp8 run (strict: nothing
    compiled uncached)."""
    torch.manual_seed(0)
    model, x = _DenseMixture(), torch.randn(2, 16, 32)
    runs = sgd_uncached_and_cached(model, [[x, x], [x, x]], lr=0.1, fp8="tensorwise", backend="aot_eager", strict=True)
    assert_bitwise(runs[1], runs[0], "3-D experts: fp8 weight cache vs uncached")
