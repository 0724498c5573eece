"""Mixture-of-experts layers: grouped expert GEMMs and ``Policy(autocast_experts=...)`` (issue 36).

transformers (5.x) keeps each expert layer of Qwen3-MoE, OLMoE and Mixtral as one 3-D parameter
and multiplies it with ``torch._grouped_mm`` (``F.grouped_mm``), or, compiled with fp32 weights,
with its custom op ``transformers::grouped_mm_fallback`` (a ``torch.mm`` per expert after
``offs.tolist()``, a host sync). No autocast table lists either op, so eager autocast, torch.compile
and amp_fx run the experts in fp32, silently before this change.

* default: amp_fx stays bitwise with eager autocast and warns once naming the experts (strict
  mode: an error); ``explain`` notes the same; a dense model (the negative twin) gets no warning;
* ``Policy(autocast_experts=True)``: every grouped GEMM runs as one ``aten._grouped_mm`` on bf16
  operands, forward and backward (every aten op the compiled graphs run is logged with its
  operands' dtypes), no fallback loop left; bitwise with eager autocast whose grouped GEMMs get
  their operands cast to bf16 by hand; within a derived tolerance of float64; the weight cache
  holds the 3-D expert weights and changes no bit.

Random init, tiny configs (hidden 32, 4 experts, 2 per token, 1 layer, 2 x 8 tokens), aot_eager.
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import math
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from functorch.compile import make_boxed_func
from torch import Tensor, nn
from torch._dynamo.backends.common import aot_autograd
from torch.overrides import TorchFunctionMode

import amp_fx
from amp_fx.errors import AmpFxError
from amp_fx.testing import assert_bitwise

transformers = pytest.importorskip(
    "transformers", reason="the MoE models come from transformers (pip install transformers)"
)
importlib.import_module("transformers.integrations.moe")  # registers transformers::grouped_mm_fallback

VOCAB, HIDDEN, EXPERTS = 64, 32, 4
GROUPED = torch.ops.aten._grouped_mm.default
U_BF16 = 2.0**-8  # bf16's unit roundoff (8 significant bits)


# --- models ---------------------------------------------------------------------------------------


def _qwen3_moe() -> nn.Module:
    return transformers.Qwen3MoeForCausalLM(
        transformers.Qwen3MoeConfig(
            vocab_size=VOCAB,
            hidden_size=HIDDEN,
            intermediate_size=64,
            moe_intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_key_value_heads=4,
            head_dim=8,
            num_experts=EXPERTS,
            num_experts_per_tok=2,
            decoder_sparse_step=1,
            max_position_embeddings=32,
        )
    )


def _olmoe() -> nn.Module:
    return transformers.OlmoeForCausalLM(
        transformers.OlmoeConfig(
            vocab_size=VOCAB,
            hidden_size=HIDDEN,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_key_value_heads=4,
            num_experts=EXPERTS,
            num_experts_per_tok=2,
            max_position_embeddings=32,
        )
    )


def _qwen3_dense() -> nn.Module:
    return transformers.Qwen3ForCausalLM(
        transformers.Qwen3Config(
            vocab_size=VOCAB,
            hidden_size=HIDDEN,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_key_value_heads=4,
            head_dim=8,
            max_position_embeddings=32,
        )
    )


MOE: dict[str, Callable[[], nn.Module]] = {"qwen3_moe": _qwen3_moe, "olmoe": _olmoe}
EXPERT_MODULES = ["model.layers.0.mlp.experts"]


def _build(factory: Callable[[], nn.Module]) -> tuple[nn.Module, dict[str, Tensor]]:
    torch.manual_seed(0)
    model = factory().train()
    ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(1))
    return model, {"input_ids": ids, "labels": ids}


class _GroupedInBf16(TorchFunctionMode):
    """The reference for the switch: eager autocast, plus every ``torch._grouped_mm`` call (what
    ``F.grouped_mm`` calls) given its floating operands in bf16, cast by hand above autograd."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is torch._grouped_mm:
            args = tuple(a.to(torch.bfloat16) if isinstance(a, Tensor) and a.is_floating_point() else a for a in args)
        return func(*args, **kwargs)


class _AotGraphs:
    """aot_eager that keeps the forward and backward graphs it runs (the ops that run, with their
    operands' dtypes in ``meta["val"]``): a torch.compile backend for ``amp_fx.compile``."""

    def __init__(self) -> None:
        self.graphs: list[torch.fx.GraphModule] = []

        def keep(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
            self.graphs.append(gm)
            return make_boxed_func(gm.forward)

        self.backend = aot_autograd(fw_compiler=keep, bw_compiler=keep)

    def grouped(self) -> list[tuple[str, list[torch.dtype]]]:
        """(op, dtypes of its tensor operands) of every grouped GEMM the graphs run, forward then backward."""
        return [
            (str(n.target), [a.meta["val"].dtype for a in n.all_input_nodes])
            for gm in self.graphs
            for n in gm.graph.nodes
            if n.op == "call_function" and "grouped_mm" in str(n.target)
        ]

    def host_syncs(self) -> list[str]:
        return [
            n.format_node()
            for gm in self.graphs
            for n in gm.graph.nodes
            if n.op == "call_function" and n.target in (torch.ops.aten._local_scalar_dense.default,)
        ]


def _step(
    model: nn.Module, inputs: dict[str, Tensor], *, ref: bool = False, grouped_bf16: bool = False
) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    """(loss, logits, grads) of one forward and backward; ``ref``: under eager autocast."""
    if ref:
        grouped = _GroupedInBf16() if grouped_bf16 else contextlib.nullcontext()
        with torch.autocast("cpu", dtype=torch.bfloat16), grouped:
            out = model(**inputs)
    else:
        out = model(**inputs)
    out.loss.backward()
    return out.loss.detach(), out.logits.detach(), {n: p.grad for n, p in model.named_parameters()}


def _compile(model: nn.Module, **kwargs: Any) -> nn.Module:
    kwargs.setdefault("backend", "aot_eager")
    return amp_fx.compile(model, dtype="bf16", **kwargs)


# --- default: bitwise with eager autocast, said once ------------------------------------------------


@pytest.mark.slow_cases
@pytest.mark.parametrize("name", MOE)
def test_default_warns_naming_the_experts_and_stays_bitwise(name: str) -> None:
    model, inputs = _build(MOE[name])
    expected = _step(copy.deepcopy(model), inputs, ref=True)
    compiled = _compile(model, strict=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", amp_fx.AmpFxWarning)
        actual = _step(compiled, inputs)
    assert_bitwise(actual, expected, "default (experts in fp32, as eager autocast)")
    messages = [str(w.message) for w in caught if issubclass(w.category, amp_fx.AmpFxWarning)]
    experts = [m for m in messages if "grouped expert GEMMs" in m]
    assert len(experts) == 1, messages
    for module in EXPERT_MODULES:
        assert module in experts[0]
    assert "float32" in experts[0] and "Policy(autocast_experts=True)" in experts[0]
    assert "transformers.grouped_mm_fallback" in experts[0]
    # explain says the same, as a note (the inspection tools never raise it)
    note = amp_fx.explain(compiled).summary()
    assert "Policy(autocast_experts=True)" in note and EXPERT_MODULES[0] in note


@pytest.mark.slow
def test_default_is_an_error_in_strict_mode_and_false_silences_it() -> None:
    """Strict mode raises the warning; ``autocast_experts=False`` keeps the experts in fp32 (bitwise
    eager autocast, as the default: transformers' fallback loop runs, on fp32 operands) and says
    nothing, in strict mode too."""
    model, inputs = _build(_qwen3_moe)
    with pytest.raises(AmpFxError, match=r"model\.layers\.0\.mlp\.experts.*autocast_experts=True"):
        _compile(copy.deepcopy(model), strict=True)(**inputs)
    expected = _step(copy.deepcopy(model), inputs, ref=True)
    graphs = _AotGraphs()
    silent = _compile(model, strict=True, policy=amp_fx.Policy(autocast_experts=False), backend=graphs.backend)
    assert_bitwise(_step(silent, inputs), expected, "autocast_experts=False")
    # negative twin of the switch's graphs: the fallback loop, forward and backward, on fp32 operands
    ran = graphs.grouped()
    assert {op for op, _ in ran} == {
        "transformers.grouped_mm_fallback.default",
        "transformers.grouped_mm_fallback_backward.default",
    }, ran
    assert all(dts[:2] == [torch.float32] * 2 for _, dts in ran), ran


def test_dense_model_is_not_warned_and_the_unused_switch_is() -> None:
    """Negative twin: a dense Qwen3 has no grouped GEMM, so no expert is reported in fp32; the
    switch on it matched nothing, which is said (the only warning) as any unused policy entry is."""
    model, inputs = _build(_qwen3_dense)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", amp_fx.AmpFxWarning)
        _compile(model, strict=False, policy=amp_fx.Policy(autocast_experts=True))(**inputs)
    messages = [str(w.message) for w in caught if issubclass(w.category, amp_fx.AmpFxWarning)]
    assert len(messages) == 1 and "autocast_experts=True) matched no grouped expert GEMM" in messages[0], messages


# --- the switch: bf16 experts, one aten._grouped_mm, no host sync ------------------------------------


@pytest.mark.slow_cases
@pytest.mark.parametrize("name", MOE)
def test_autocast_experts_run_in_bf16_forward_and_backward_bitwise(name: str) -> None:
    """The switch: bitwise eager autocast with the grouped GEMMs' operands cast to bf16 by hand (loss,
    logits, every gradient); the rewritten graph's and the run's grouped GEMMs (forward and
    backward) on bf16 operands, no fallback loop; and the loss against float64 (transformers'
    per-expert loop: F.grouped_mm takes no float64), beside the default's (eager autocast, fp32
    experts).

    Tolerance: |loss - loss64| <= 4u |loss64| (u = 2^-8, bf16's unit roundoff), for both runs.
    Rounding a GEMM's operands to bf16 changes each product by at most 2u relative; summed over K
    terms, a GEMM's output error is at most 2u times the sum of |products| (fp32 accumulation adds
    K x 2^-24, negligible), which at random init (no cancellation to speak of in these shallow
    models) is about 2u of the output's scale. The loss is a mean cross entropy, whose change is at
    most twice the largest change of a logit, and the logits here are O(1) like the loss: 4u |loss64|.
    The switch must also change some bit (the experts did run in bf16).
    """
    model, inputs = _build(MOE[name])
    ref64 = copy.deepcopy(model).double()
    ref64.config._experts_implementation = "eager"
    with torch.no_grad():
        loss64 = ref64(**inputs).loss.item()
    default = _step(copy.deepcopy(model), inputs, ref=True)
    expected = _step(copy.deepcopy(model), inputs, ref=True, grouped_bf16=True)
    graphs = _AotGraphs()
    compiled = _compile(model, strict=True, policy=amp_fx.Policy(autocast_experts=True), backend=graphs.backend)
    actual = _step(compiled, inputs)
    assert_bitwise(actual, expected, "bf16 experts vs eager autocast + bf16 grouped GEMMs")
    # the graph: every grouped GEMM one aten._grouped_mm on bf16 operands, none left as the fallback
    (record,) = amp_fx.records(compiled)
    gemms = [n for n in record.rewritten.graph.nodes if n.op == "call_function" and "grouped" in str(n.target)]
    assert len(gemms) == 2 and all(n.target is GROUPED for n in gemms), [n.format_node() for n in gemms]
    for n in gemms:
        assert [a.meta["val"].dtype for a in n.args[:2]] == [torch.bfloat16] * 2, n.format_node()
    assert [(e.module, e.lowered) for e in record.inserted.experts] == [(EXPERT_MODULES[0], True)] * 2
    # what ran, forward and backward: bf16 grouped GEMMs only, no per-expert loop behind a host sync
    assert len(graphs.graphs) == 2, "a forward and a backward graph"
    ran = graphs.grouped()
    assert all(op == "aten._grouped_mm.default" for op, _ in ran), ran
    assert all(dts[:2] == [torch.bfloat16] * 2 for _, dts in ran), ran
    assert not graphs.host_syncs()
    # forward 2; backward: input and weight gradients of each (the first one's input gradient
    # flows to the router's token gather: 3 or 4 depending on what needs a gradient)
    assert len(ran) >= 2 + 3, ran
    bound = 4 * U_BF16 * abs(loss64)
    for what, loss in (("bf16 experts", actual[0]), ("fp32 experts", default[0])):
        assert abs(loss.item() - loss64) <= bound, (what, loss.item(), loss64, bound)
    # the experts' gradients (the loss alone can round to the same fp32 bits: the experts' share of
    # the residual stream is small at random init)
    experts = [n for n, p in model.named_parameters() if p.dim() == 3]
    assert experts and all(not torch.equal(actual[2][n], default[2][n]) for n in experts), (
        "the switch changed no bit: the experts ran in fp32"
    )


@pytest.mark.slow
def test_weight_cache_holds_the_3d_expert_weights() -> None:
    """weight_cache=True with the switch: the cache holds the 3-D expert weights' bf16 copies, and
    one step (forward, backward) is bitwise the uncached reference's (Qwen3-MoE; OLMoE's experts
    are the same transformers code)."""
    model, inputs = _build(_qwen3_moe)
    expected = _step(copy.deepcopy(model), inputs, ref=True, grouped_bf16=True)
    compiled = _compile(model, strict=True, weight_cache=True, policy=amp_fx.Policy(autocast_experts=True))
    assert_bitwise(_step(compiled, inputs), expected, "weight cache, bf16 experts")
    names = {id(p): n for n, p in model.named_parameters()}
    cached = {names[id(w)]: lowp.dtype for w, lowp in compiled.amp_fx_weight_cache.pairs(list(model.parameters()))}
    experts = {n for n, p in model.named_parameters() if p.dim() == 3}
    assert len(experts) == 2 and experts <= set(cached), (experts, cached)
    assert {cached[n] for n in experts} == {torch.bfloat16}


# --- the ops themselves: F.grouped_mm, and the fallback with int64 offsets ----------------------------


class _Experts(nn.Module):
    """One grouped GEMM over a (E, K, N) parameter, called as ``F.grouped_mm`` or as transformers'
    fallback op (int64 offsets, which the fallback takes and aten._grouped_mm does not)."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.w = nn.Parameter(torch.randn(EXPERTS, 16, 24) / 4)

    def forward(self, x: Tensor, offs: Tensor) -> Tensor:
        if self.how == "F.grouped_mm":
            y = torch.nn.functional.grouped_mm(x, self.w, offs=offs)
        else:
            y = torch.ops.transformers.grouped_mm_fallback(x, self.w, offs.long())
        # not y.float(): traced where y is fp32, it would leave no op in the graph (docs/concepts.md)
        return y.pow(2).mean()


def test_fallback_with_int64_offsets_in_bf16_bitwise() -> None:
    """transformers' fallback op on a 3-D parameter (no transpose: the cast is the parameter's own)
    with int64 offsets (aten._grouped_mm takes int32): bitwise eager autocast with the GEMM's
    operands in bf16, gradients included; the default: bitwise eager autocast (fp32).
    (``F.grouped_mm`` on fp32 operands does not compile at all: torch's meta kernel takes bf16 only,
    which is why transformers calls its fallback when compiled.)"""
    how = "fallback"
    torch.manual_seed(0)
    model = _Experts(how)
    x = torch.randn(12, 16, requires_grad=True)
    offs = torch.tensor([3, 3, 8, 12], dtype=torch.int32)

    def run(m: nn.Module, *, ref: bool = False, bf16: bool = False) -> tuple[Tensor, Tensor, Tensor]:
        xi = x.detach().clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=ref):
            xr = xi.to(torch.bfloat16) if bf16 else xi
            loss = (
                torch.nn.functional.grouped_mm(xr, m.w.to(torch.bfloat16), offs=offs).pow(2).mean()
                if bf16
                else m(xi, offs)
            )
        loss.backward()
        return loss.detach(), xi.grad, m.w.grad

    expected_bf16 = run(copy.deepcopy(model), ref=True, bf16=True)
    compiled = _compile(copy.deepcopy(model), strict=True, policy=amp_fx.Policy(autocast_experts=True))
    assert_bitwise(run(compiled), expected_bf16, f"{how}, bf16")
    (record,) = amp_fx.records(compiled)
    (gemm,) = [n for n in record.rewritten.graph.nodes if n.op == "call_function" and "grouped" in str(n.target)]
    assert gemm.target is GROUPED and gemm.args[2].meta["val"].dtype == torch.int32

    expected_fp32 = run(copy.deepcopy(model), ref=True)
    assert_bitwise(
        run(_compile(copy.deepcopy(model), strict=True, policy=amp_fx.Policy(autocast_experts=False))),
        expected_fp32,
        f"{how}, fp32",
    )


def test_policy_field_is_validated_and_kept() -> None:
    import pickle

    with pytest.raises(TypeError, match="autocast_experts must be True, False or None"):
        amp_fx.Policy(autocast_experts=1)
    p = amp_fx.Policy(autocast_experts=True)
    assert pickle.loads(pickle.dumps(p)) == p and hash(p) != hash(amp_fx.Policy())
    assert p.lowers_experts("aten::_grouped_mm") and not amp_fx.Policy().lowers_experts("aten::_grouped_mm")
    # an explicit op_classes entry wins over the switch
    moved = amp_fx.Policy(op_classes={"aten._grouped_mm": amp_fx.CastClass.FP32}, autocast_experts=True)
    assert not moved.lowers_experts("aten::_grouped_mm")


# --- advise: the float64 reference of a model with grouped GEMMs ---------------------------------------


@pytest.mark.slow
def test_advise_measures_a_moe_model_against_float64() -> None:
    """``advise``'s float64 reference runs transformers' grouped GEMMs one group at a time
    (``torch._grouped_mm`` has no float64 kernel: before, advise failed on Qwen3-MoE and Mixtral
    with "Expected mat_a to be Float32, BFloat16 or Float16 matrix, got Double"). Its loss error is
    the compiled default's against transformers' own float64 per-expert loop, up to float64's
    rounding (the two references differ by ~1e-16 relative; the error is ~1e-6: rel_tol 1e-6)."""
    model, inputs = _build(_qwen3_moe)
    ref64 = copy.deepcopy(model).double()
    ref64.config._experts_implementation = "eager"
    with torch.no_grad():
        loss64 = ref64(**inputs).loss.item()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", amp_fx.AmpFxWarning)  # the experts in fp32: said elsewhere
        advice = amp_fx.advise(copy.deepcopy(model), dtype="bf16", loss_fn=lambda out: out.loss, **inputs)
        loss = _compile(model, strict=False)(**inputs).loss.item()
    expected = abs(loss - loss64) / abs(loss64)
    assert expected > 0 and math.isclose(dict(advice.baseline_parts)["loss"], expected, rel_tol=1e-6), (
        advice.baseline_parts,
        expected,
    )
