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
from amp_fx.kernels.fp8_recipes import RECIPES as KERNEL_RECIPES
from amp_fx.kernels.fp8_support import rowwise_scales_missing
from amp_fx.testing import assert_bitwise
from amp_fx.testing.fp8_reference import (
    count_gemm_flops,
    cpu_autocast_torchao,
    expert_linears,
    torchao_float8,
    torchao_missing,
)
from tests.fp8._fp8_cases import sgd_uncached_and_cached

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
        self.w_in = nn.Parameter(torch.randn(e, hidden, d) / d**0.5)
        self.w_out = nn.Parameter(torch.randn(e, d, hidden) / hidden**0.5)

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
        self.inp = expert_linears(m.w_in)
        self.out = expert_linears(m.w_out)

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
    expected = {
        "router.weight": ref.router.weight.grad,
        "router.bias": ref.router.bias.grad,
        "w_in": torch.stack([m.weight.grad for m in ref.inp]),
        "w_out": torch.stack([m.weight.grad for m in ref.out]),
    }
    assert_bitwise({n: p.grad for n, p in compiled.named_parameters()}, expected, f"{recipe}: gradients")
    # every group non-empty (else the twin's unused experts would have no gradient at all)
    assert all(m.weight.grad is not None for m in [*ref.inp, *ref.out])
    assert flops.other == ref_flops.other == 0 and flops.fp8_share == 1.0, (flops, ref_flops)
    # the same fp8 GEMM FLOPs (the twin also computes the input gradient of the router's GEMM
    # and of the first experts' GEMM on x, which AOTAutograd drops: x needs none)
    assert flops.fp8 < ref_flops.fp8 and flops.fp8 + 2 * (32 * 32 * 4 + 64 * 32 * 48) == ref_flops.fp8, (
        flops,
        ref_flops,
    )


@pytest.mark.slow  # 8 to 13 s on a loaded 2-core CPU: one compile
@pytest.mark.filterwarnings("ignore:amp_fx. fp8='mxfp8' runs emulated here")
def test_compare_with_fp8_runs_the_grouped_gemms_in_fp8_on_both_sides() -> None:
    """``amp_fx.compare(..., fp8="mxfp8")`` on the grouped mixture: the eager side runs the grouped
    GEMMs the pass converted in fp8 as the pass does, so every op (the two grouped GEMMs compared
    as fp8), the output and every gradient agree bit for bit, and the float64 columns show fp8's
    cost. The eager side itself (``Fp8Eager`` with the root's grouped GEMMs; the same code for
    every recipe, the kernel the pass's), with tensorwise: bitwise with torchao converting the
    ``nn.Linear``-per-expert twin. Before, re-running the graph failed at the grouped op (no op
    compared) and eager ran the experts in fp32 (every gradient differed)."""
    from amp_fx.fp8 import Fp8Config
    from amp_fx.inspect._fp8_eager import Fp8Eager, module_stack

    torch.manual_seed(0)
    model, x = _GroupedMixture(hidden=64), torch.randn(2, 16, 32)
    report = amp_fx.compare(model, x, dtype="bf16", fp8="mxfp8", loss_fn=loss_fn)
    assert report.ok and report.ops and all(o.agree for o in report.ops), str(report)
    grouped = [o for o in report.ops if "grouped_mm" in o.op]
    assert len(grouped) == 2 and all(o.rule.startswith("fp8 mxfp8") for o in grouped), str(report)
    assert all(o.error_vs_reference.rel > 2**-6 for o in grouped)  # fp8's error, not bf16's (2**-8)
    assert sorted(g.name for g in report.grads if g.agree) == ["router.bias", "router.weight", "w_in", "w_out"]

    eager, stack = copy.deepcopy(model), []
    with (
        module_stack(eager, stack),
        torch.autocast("cpu", torch.bfloat16),
        Fp8Eager(Fp8Config("tensorwise"), torch.bfloat16, "cpu", stack, measure=False, grouped=frozenset({""})),
    ):
        loss = loss_fn(eager(x))
    loss.backward()
    ref = torchao_float8(_LinearTwin(model), "tensorwise", pad_inner_dim=True)
    with cpu_autocast_torchao(), torch.autocast("cpu", torch.bfloat16):
        ref_loss = loss_fn(ref(x))
    ref_loss.backward()
    expected = {
        "router.weight": ref.router.weight.grad,
        "router.bias": ref.router.bias.grad,
        "w_in": torch.stack([m.weight.grad for m in ref.inp]),
        "w_out": torch.stack([m.weight.grad for m in ref.out]),
    }
    assert_bitwise(
        (loss.detach(), {n: p.grad for n, p in eager.named_parameters()}),
        (ref_loss.detach(), expected),
        "eager fp8 with grouped GEMMs vs torchao's twin",
    )


# --- transformers' mixture-of-experts models ---------------------------------------------------------

U_E4M3, U_E5M2 = 2.0**-4, 2.0**-3  # unit roundoffs: 3 and 2 mantissa bits


def _moe(name: str) -> tuple[nn.Module, dict[str, Tensor]]:
    torch.manual_seed(0)
    if name == "qwen3_moe":
        model = transformers.Qwen3MoeForCausalLM(
            transformers.Qwen3MoeConfig(
                vocab_size=64,
                hidden_size=32,
                intermediate_size=64,
                moe_intermediate_size=32,
                num_hidden_layers=1,
                num_attention_heads=4,
                num_key_value_heads=4,
                head_dim=8,
                num_experts=4,
                num_experts_per_tok=2,
                decoder_sparse_step=1,
                max_position_embeddings=32,
            )
        )
    else:
        model = transformers.OlmoeForCausalLM(
            transformers.OlmoeConfig(
                vocab_size=64,
                hidden_size=32,
                intermediate_size=32,
                num_hidden_layers=1,
                num_attention_heads=4,
                num_key_value_heads=4,
                num_experts=4,
                num_experts_per_tok=2,
                max_position_embeddings=32,
            )
        )
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    return model.train(), {"input_ids": ids, "labels": ids}


@pytest.mark.slow_cases
@pytest.mark.parametrize("name", ["qwen3_moe", "olmoe"])
def test_moe_models_run_every_gemm_in_fp8_with_fp8_alone(name: str) -> None:
    """Qwen3-MoE and OLMoE with ``fp8='tensorwise'`` and nothing else (strict: no warning): every
    matmul with a parameter operand converted, the grouped expert GEMMs included, and every GEMM
    FLOP of a training step in fp8 (before: 0.62 and 0.33 at the issue's sizes, the experts in
    fp32); the loss and the experts' gradients against float64 (transformers' per-expert loop:
    ``F.grouped_mm`` takes no float64).

    Tolerances. Loss: ``|loss - loss64| <= 4 u |loss64|`` with ``u = 2^-4``, e4m3's unit roundoff
    (the argument of tests/fp8/test_moe_experts.py's bf16 bound, with the forward GEMMs' operands in
    e4m3 instead of bf16). Expert gradients: each weight-gradient GEMM rounds its operands to e4m3
    (the input, ``u4``) and e5m2 (the gradient, ``u5 = 2^-3``), after the output gradient itself
    came through the layers above it in fp8 (one more ``u4 + u5``): a relative norm error of at
    most ``2 (u4 + u5) = 0.375``, against 1.0 for a zero or lost gradient.
    """
    model, inputs = _moe(name)
    ref64 = copy.deepcopy(model).double()
    ref64.config._experts_implementation = "eager"
    out64 = ref64(**inputs)
    out64.loss.backward()
    compiled = amp_fx.compile(model, dtype="bf16", fp8="tensorwise", backend="aot_eager", strict=True)
    compiled(**inputs).loss.backward()
    for p in model.parameters():
        p.grad = None
    with count_gemm_flops() as flops:
        loss = compiled(**inputs).loss
        loss.backward()
    decisions = [d for r in amp_fx.records(compiled) if r.fp8 is not None for d in r.fp8.decisions]
    assert all(d.converted for d in decisions), [d for d in decisions if not d.converted]
    assert sum(d.op == "aten._grouped_mm" for d in decisions) == 2, decisions
    assert flops.fp8_share >= 0.95 and flops.other == 0, flops
    loss64 = out64.loss.item()
    assert abs(loss.item() - loss64) <= 4 * U_E4M3 * abs(loss64), (loss.item(), loss64)
    grads64 = dict(ref64.named_parameters())
    for n, p in model.named_parameters():
        if p.dim() == 3:
            g64 = grads64[n].grad
            err = ((p.grad.double() - g64).norm() / g64.norm()).item()
            assert err <= 2 * (U_E4M3 + U_E5M2), (n, err)


@pytest.mark.slow
def test_autocast_experts_false_keeps_the_experts_out_of_fp8() -> None:
    """``Policy(autocast_experts=False)`` with ``fp8=``: the grouped GEMMs stay transformers' fallback
    on fp32 operands, each with its reason; the other matmuls in fp8; nothing said (strict: the
    policy asked for it)."""
    model, inputs = _moe("qwen3_moe")
    compiled = amp_fx.compile(
        model,
        dtype="bf16",
        fp8="tensorwise",
        backend="aot_eager",
        strict=True,
        policy=amp_fx.Policy(autocast_experts=False),
    )
    compiled(**inputs)
    (record,) = amp_fx.records(compiled)
    kept = [d for d in record.fp8.decisions if not d.converted]
    assert [d.op for d in kept] == ["transformers.grouped_mm_fallback"] * 2, record.fp8.decisions
    assert all("was not moved to the autocast dtype" in d.reason for d in kept), kept
    assert len(record.fp8.decisions) > 2 and all(d.converted for d in record.fp8.decisions if d not in kept)
    grouped = [n for n in record.rewritten.graph.nodes if n.op == "call_function" and "grouped" in str(n.target)]
    assert len(grouped) == 2 and all(a.meta["val"].dtype == torch.float32 for n in grouped for a in n.args[:2])


@pytest.mark.slow_cases
@pytest.mark.parametrize("recipe", [_recipe("tensorwise"), _recipe("blockwise")])
def test_weight_cache_says_grouped_expert_weights_are_not_cached(recipe: str) -> None:
    """``weight_cache=True`` caches every weight but the grouped experts' low-precision casts: said
    once, naming both expert weights and the fix (strict mode raises); training stays bitwise with
    the uncached run (2 SGD steps of 2 micro-batches: the router's weight is cached, the experts'
    quantized in every forward as without the cache). Its twin, the experts kept out of fp8, says
    nothing and caches their bf16 casts."""
    torch.manual_seed(0)
    model = _GroupedMixture(hidden=64)
    steps = [[torch.randn(2, 16, 32) for _ in range(2)] for _ in range(2)]
    kwargs = {"fp8": recipe, "backend": "aot_eager"}
    with pytest.warns(amp_fx.AmpFxWarning, match="weight_cache=True does not cache") as said:
        (uncached, cached) = sgd_uncached_and_cached(model, steps, lr=0.5, strict=False, **kwargs)
    messages = [str(w.message) for w in said if "does not cache" in str(w.message)]
    assert len(messages) == 1 and "w_in" in messages[0] and "w_out" in messages[0], messages
    assert "keep_out_of_fp8" in messages[0]
    assert_bitwise(cached, uncached, f"{recipe}: weight cache with grouped experts against none")
    with pytest.raises(amp_fx.AmpFxError, match="weight_cache=True does not cache"):
        c = amp_fx.compile(copy.deepcopy(model), dtype="bf16", weight_cache=True, strict=True, **kwargs)
        c(steps[0][0])
    # the twin: the experts kept out of fp8 (by name: Policy selects no op of the compiled root's
    # own code, and says so), their bf16 casts cached
    import warnings

    kept = nn.Sequential(copy.deepcopy(model))
    with warnings.catch_warnings():  # not strict: it would refuse fp8 with no matmul left in it
        warnings.filterwarnings("ignore", message=".*can run in fp8.*")
        warnings.filterwarnings("error", message=".*does not cache.*")
        c = amp_fx.compile(
            kept, dtype="bf16", weight_cache=True, strict=False, policy=amp_fx.Policy(keep_out_of_fp8=("0",)), **kwargs
        )
        loss_fn(c(steps[0][0])).backward()
    decisions = [d for r in amp_fx.records(c) if r.fp8 is not None for d in r.fp8.decisions]
    assert decisions and not any(d.converted for d in decisions), decisions
    cached = {id(w) for w, _ in c.amp_fx_weight_cache.pairs(list(kept.parameters()))}
    assert {id(kept[0].w_in), id(kept[0].w_out)} <= cached
