"""Grouped expert GEMMs in fp8 (issue 36): with ``fp8=``, a mixture-of-experts layer's grouped GEMMs
(``aten._grouped_mm``, transformers' ``grouped_mm_fallback``) run in fp8 as every other matmul with
a parameter operand does, forward and both backward GEMMs, with torchao's per-group numerics.

The reference is torchao converting the ``nn.Linear``-per-expert twin (each expert's layer an
``nn.Linear`` called on its group's rows): bitwise on the CPU (loss, every gradient, the GEMM
FLOPs in fp8), where amp_fx runs one ``_scaled_mm`` per group with the same scales. On transformers'
Qwen3-MoE and OLMoE, ``fp8='tensorwise'`` alone puts every GEMM in fp8 and stays within a derived
tolerance of float64; ``Policy(autocast_experts=False)`` keeps the experts out, and says so.

Tiny shapes (hidden 32, 4 experts, 2 per token, 2 x 16 tokens), aot_eager.
"""

from __future__ import annotations

import copy
import importlib

import pytest
import torch
from torch import Tensor, nn

import amp_fx
from amp_fx.kernels.fp8_matmul import RECIPES as KERNEL_RECIPES
from amp_fx.kernels.fp8_matmul import rowwise_scales_missing
from amp_fx.testing import assert_bitwise
from amp_fx.testing.fp8_reference import count_gemm_flops, cpu_autocast_torchao, torchao_float8, torchao_missing

pytestmark = pytest.mark.skipif(torchao_missing() is not None, reason=str(torchao_missing()))
transformers = pytest.importorskip("transformers", reason="the MoE models come from transformers")
importlib.import_module("transformers.integrations.moe")  # registers transformers::grouped_mm_fallback

_NO_ROWWISE = rowwise_scales_missing("cpu")


def _recipe(r: str) -> object:
    skip = KERNEL_RECIPES[amp_fx.Fp8Recipe(r)].rowwise and _NO_ROWWISE is not None
    return pytest.param(r, id=r, marks=pytest.mark.skipif(skip, reason=str(_NO_ROWWISE)))


def loss_fn(out: Tensor) -> Tensor:
    return out.float().pow(2).mean()


class _Routed(nn.Module):
    """Top-2 routing as transformers' ``grouped_mm_experts_forward`` does it: tokens sorted by
    expert, group ends from ``histc`` and ``cumsum`` (int32); the experts' outputs weighted, put
    back in token order and summed per token. Subclasses give the experts."""

    experts_count, top_k, d = 4, 2, 32

    def experts(self, xs: Tensor, offs: Tensor) -> Tensor:
        raise NotImplementedError

    def forward(self, x: Tensor) -> Tensor:
        flat = x.reshape(-1, self.d)
        weights, idx = torch.topk(torch.softmax(self.router(flat), dim=-1), self.top_k)
        ids, perm = torch.sort(idx.reshape(-1))
        counts = torch.histc(ids.float(), bins=self.experts_count, min=0, max=self.experts_count - 1)
        offs = torch.cumsum(counts, 0, dtype=torch.int32)
        y = self.experts(flat[perm // self.top_k], offs) * weights.reshape(-1)[perm][:, None]
        # back to token order and summed over the token's experts, as transformers does (no
        # index_add into a tensor of flat's dtype: the experts' dtype is not eager autocast's here)
        return y[torch.argsort(perm)].reshape(*x.shape[:-1], self.top_k, self.d).sum(-2)


class _GroupedMixture(_Routed):
    """Experts as one 3-D parameter per projection in ``nn.Linear`` layout (``[E, out, in]``, as
    transformers keeps them), multiplied by transformers' grouped op on the transposed view (what
    transformers calls when compiled with fp32 weights). The router's ``N=4`` runs padded."""

    def __init__(self, hidden: int = 48) -> None:
        super().__init__()
        e, d = self.experts_count, self.d
        self.router = nn.Linear(d, e)
        self.w_in = nn.Parameter(torch.randn(e, hidden, d) / d ** 0.5)
        self.w_out = nn.Parameter(torch.randn(e, d, hidden) / hidden ** 0.5)

    def experts(self, xs: Tensor, offs: Tensor) -> Tensor:
        grouped = torch.ops.transformers.grouped_mm_fallback
        h = torch.relu(grouped(xs, self.w_in.transpose(-2, -1), offs))
        return grouped(h, self.w_out.transpose(-2, -1), offs)


class _LinearTwin(_Routed):
    """The same mixture with each expert's projections as ``nn.Linear`` (weights ``w[e]``), each
    called on its group's rows: what torchao can convert."""

    def __init__(self, m: _GroupedMixture) -> None:
        super().__init__()
        self.router = copy.deepcopy(m.router)
        e, hidden, d = m.w_in.shape
        self.inp = nn.ModuleList(nn.Linear(d, hidden, bias=False) for _ in range(e))
        self.out = nn.ModuleList(nn.Linear(hidden, d, bias=False) for _ in range(e))
        with torch.no_grad():
            for i in range(e):
                self.inp[i].weight.copy_(m.w_in[i])
                self.out[i].weight.copy_(m.w_out[i])

    @staticmethod
    def _per_group(linears: nn.ModuleList, xs: Tensor, ends: list[int]) -> Tensor:
        starts = [0, *ends[:-1]]
        return torch.cat([linears[e](xs[s:t]) for e, (s, t) in enumerate(zip(starts, ends)) if t > s])

    def experts(self, xs: Tensor, offs: Tensor) -> Tensor:
        ends = offs.tolist()
        return self._per_group(self.out, torch.relu(self._per_group(self.inp, xs, ends)), ends)


@pytest.mark.slow_cases
@pytest.mark.parametrize("recipe", [_recipe("tensorwise"), _recipe("rowwise")])
def test_grouped_experts_run_in_fp8_bitwise_with_torchao_per_expert_linears(recipe: str) -> None:
    """``fp8=recipe`` alone (no experts switch): the two grouped GEMMs run in fp8, forward and both
    backward GEMMs, bitwise with torchao converting the ``nn.Linear``-per-expert twin (loss, every
    gradient); every GEMM FLOP in fp8 in both, the same FLOPs. Before, the grouped GEMMs ran in
    fp32 (eager autocast's rule), out of fp8."""
    torch.manual_seed(0)
    model, x = _GroupedMixture(), torch.randn(2, 16, 32)
    twin = _LinearTwin(model)
    compiled = amp_fx.compile(copy.deepcopy(model), dtype="bf16", fp8=recipe, backend="aot_eager", strict=True)
    loss_fn(compiled(x)).backward()  # compile forward and backward
    for p in compiled.parameters():
        p.grad = None
    with count_gemm_flops() as flops:
        loss = loss_fn(compiled(x))
        loss.backward()
    decisions = [d for r in amp_fx.records(compiled) if r.fp8 is not None for d in r.fp8.decisions]
    grouped = [d for d in decisions if d.op == "aten._grouped_mm"]
    assert len(grouped) == 2 and all(d.converted for d in decisions), decisions
    assert [d.shape for d in grouped] == [(64, 32, 48), (64, 48, 32)], grouped
    ref = torchao_float8(twin, recipe, pad_inner_dim=True)
    with count_gemm_flops() as ref_flops:
        with cpu_autocast_torchao(), torch.autocast("cpu", torch.bfloat16):
            ref_loss = loss_fn(ref(x))
        ref_loss.backward()
    assert_bitwise(loss.detach(), ref_loss.detach(), f"{recipe}: loss")
    expected = {"router.weight": ref.router.weight.grad, "router.bias": ref.router.bias.grad,
                "w_in": torch.stack([m.weight.grad for m in ref.inp]),
                "w_out": torch.stack([m.weight.grad for m in ref.out])}
    assert_bitwise({n: p.grad for n, p in compiled.named_parameters()}, expected, f"{recipe}: gradients")
    # every group non-empty (else the twin's unused experts would have no gradient at all)
    assert all(m.weight.grad is not None for m in [*ref.inp, *ref.out])
    assert flops.other == ref_flops.other == 0 and flops.fp8_share == 1.0, (flops, ref_flops)
    # the same fp8 GEMM FLOPs (the twin also computes the input gradient of the router's GEMM
    # and of the first experts' GEMM on x, which AOTAutograd drops: x needs none)
    assert flops.fp8 < ref_flops.fp8 and flops.fp8 + 2 * (32 * 32 * 4 + 64 * 32 * 48) == ref_flops.fp8, \
        (flops, ref_flops)
