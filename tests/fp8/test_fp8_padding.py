"""Every shape in fp8: the fp8 matmul zero-pads what ``torch._scaled_mm`` needs on a GPU.

``_scaled_mm`` on CUDA needs ``mat1``'s columns and both of ``mat2``'s dimensions to be multiples
of 16; the CPU kernel takes any size. The fp8 matmul pads on every device (the CPU runs the GPU's
code path), so the tests here assert, from the ops that ran (``count_gemm_flops``: every
``_scaled_mm``'s shapes, the pads before it), that each GEMM reached ``_scaled_mm`` padded to the
GPU's rule, and that the results are bitwise torchao's with ``Float8LinearConfig(pad_inner_dim=True)``
on the same layer. A negative twin (sizes already multiples of 16) pads nothing.

Where torchao differs: ``pad_inner_dim`` pads each GEMM's inner dimension only, so where ``K`` or
``N`` is not a multiple of 16 its GEMMs still have a ``mat2`` dimension CUDA's ``_scaled_mm``
refuses (``mat2 shape (... x N) must be divisible by 16``, ``ScaledBlas.cpp``; counted here as
``unaligned``); the CPU runs them, and the values equal amp_fx's, which also pads that dimension.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import Tensor, nn

import amp_fx
from amp_fx.fp8 import Fp8Recipe
from amp_fx.kernels.fp8_matmul import fp8_matmul
from amp_fx.kernels.fp8_padding import padding
from amp_fx.kernels.fp8_recipes import RECIPES as KERNEL_RECIPES
from amp_fx.kernels.fp8_support import rowwise_scales_missing
from amp_fx.testing import assert_bitwise
from amp_fx.testing.fp8_reference import (
    count_gemm_flops,
    cpu_autocast_torchao,
    linear_twin,
    torchao_float8,
    torchao_missing,
)
from amp_fx.testing.real_models import library_missing

pytestmark = pytest.mark.skipif(torchao_missing() is not None, reason=str(torchao_missing()))

_NO_ROWWISE = rowwise_scales_missing("cpu")


def _recipe(r: str) -> object:
    rowwise = KERNEL_RECIPES[Fp8Recipe(r)].rowwise
    return pytest.param(
        Fp8Recipe(r), id=r, marks=pytest.mark.skipif(rowwise and _NO_ROWWISE is not None, reason=str(_NO_ROWWISE))
    )


# (M, K, N); how many of the GEMMs (out, grad_x, grad_w) amp_fx pads: out and grad_x where K or N
# is odd (inner dimension or mat2's columns), grad_w where M or K is; and how many of torchao's
# pad_inner_dim GEMMs keep a mat2 dimension a GPU refuses (out: N; grad_x, grad_w: K).
SHAPES = {
    "M": ((33, 32, 48), 1, 0),
    "K": ((32, 33, 48), 3, 2),
    "N": ((32, 32, 49), 2, 1),
    "MKN": ((33, 35, 37), 3, 3),
    "aligned": ((32, 32, 48), 0, 0),  # the negative twin
}


@pytest.mark.parametrize("odd", list(SHAPES))
@pytest.mark.parametrize("recipe", [_recipe("tensorwise"), _recipe("rowwise")])
def test_odd_linear_is_padded_and_bitwise_with_torchao_pad_inner_dim(recipe: Fp8Recipe, odd: str) -> None:
    """``fp8_matmul(x.bf16, w.t()) + bias.bf16`` on an ``nn.Linear`` whose M, K, N are odd (each,
    then all): output, input gradient, weight and bias gradients bitwise torchao's ``Float8Linear``
    with ``pad_inner_dim=True``; every ``_scaled_mm`` took sizes a GPU takes, the padded ones as
    many as the rule says, with the padding FLOPs ``padding()`` (what explain shows) predicts. The
    twin with aligned sizes pads nothing (no pad op runs)."""
    (m, k, n), padded_gemms, torchao_unaligned = SHAPES[odd]
    torch.manual_seed(0)
    linear = nn.Linear(k, n)
    x0 = torch.randn(m, k) * 3
    grad = torch.randn(m, n, dtype=torch.bfloat16)

    ref = torchao_float8(linear, recipe.value, pad_inner_dim=True)
    x_ref = x0.clone().requires_grad_()
    with count_gemm_flops() as ref_flops:
        with cpu_autocast_torchao(), torch.autocast("cpu", torch.bfloat16):
            out_ref = ref(x_ref)
        out_ref.backward(grad)

    ours = copy.deepcopy(linear)
    x = x0.clone().requires_grad_()
    with count_gemm_flops() as flops:
        out = fp8_matmul(x.to(torch.bfloat16), ours.weight.t(), recipe) + ours.bias.to(torch.bfloat16)
        out.backward(grad)

    assert_bitwise(out, out_ref, "output")
    assert_bitwise(x.grad, x_ref.grad, "grad of x")
    assert_bitwise(ours.weight.grad, ref.weight.grad, "grad of weight")
    assert_bitwise(ours.bias.grad, ref.bias.grad, "grad of bias")

    assert flops.calls == {"fp8": 3} and flops.unaligned == 0, flops  # every GEMM as a GPU takes it
    assert flops.padded == padded_gemms, flops
    assert flops.fp8 == ref_flops.fp8 == 3 * 2 * m * k * n, (flops, ref_flops)  # unpadded FLOPs
    pad = padding(m, k, n, recipe)
    if padded_gemms:
        assert flops.padding == pytest.approx(pad.extra_flops * flops.fp8, rel=1e-12), (flops, pad)
        assert pad.dims == {d: (s, -(-s // 16) * 16) for d, s in zip("MKN", (m, k, n)) if d in odd}
    else:
        assert pad is None and flops.padding == 0
        assert flops.pads == 0 and ref_flops.padded == 0
    # torchao pads the inner dimension only: K or N odd leaves a mat2 dimension a GPU refuses
    assert ref_flops.unaligned == torchao_unaligned, ref_flops


# --- GPT-2 with a 1001-token vocabulary, 2 x 33 tokens ---------------------------------------------

_VOCAB, _BATCH, _TOKENS = 1001, 2, 33


def _odd_gpt2() -> tuple[nn.Module, dict[str, Tensor]]:
    import transformers as tf

    torch.manual_seed(0)
    config = tf.GPT2Config(
        vocab_size=_VOCAB,
        n_embd=64,
        n_layer=2,
        n_head=4,
        n_positions=64,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        use_cache=False,
    )
    model = tf.GPT2LMHeadModel(config).train()
    ids = torch.randint(0, _VOCAB, (_BATCH, _TOKENS), generator=torch.Generator().manual_seed(1))
    return model, {"input_ids": ids, "labels": ids}


@pytest.mark.slow
def test_gpt2_with_odd_vocabulary_and_tokens_runs_in_fp8() -> None:
    """A GPT-2 (2 layers x 64, tied LM head) with a 1001-token vocabulary and 2 x 33 tokens: every
    GEMM dimension but K=64 is odd somewhere (M=66, the head's N=1001). Before, 0.000 of its GEMM
    FLOPs ran in fp8; now every matmul converts, at least 0.99 of the GEMM FLOPs (unpadded, forward
    and backward, counted from the ops that ran) run in fp8, each ``_scaled_mm`` as a GPU takes it,
    loss and every gradient bitwise torchao's ``pad_inner_dim=True`` on the ``nn.Linear`` twin, and
    the loss within 2e-2 of float64's.

    The tolerance, from a model of independent roundings: the loss is a mean over 66 tokens of
    cross-entropy, whose gradient in a token's logits is ``p - onehot``; with 1001 classes and
    small random-init logits ``p`` is near uniform, so a token's loss moves by about minus its
    target logit's error. A logit is ``h . e`` over K=64 terms, ``h`` layer-normed (rms 1), ``e``
    the N(0, 0.02) embedding: terms of rms 0.02; e4m3 rounds each operand with a relative error
    of rms 2^-4 / sqrt(3), a product sqrt(2) of that (0.051), so a logit errs by about
    sqrt(64) x 0.02 x 0.051 = 0.008 rms, and the mean over 66 tokens by 0.008 / sqrt(66) = 1e-3.
    The trunk's GEMMs add errors of the same relative size (layer norm keeps every scale near 1):
    about 2e-3 in all. 2e-2 is ten of those standard deviations (measured: 8e-4; bf16 alone 6e-5).
    The count runs on the first call: ``count_gemm_flops`` leaves out the GEMMs of tracing."""
    if library_missing("transformers"):
        pytest.skip(library_missing("transformers"))
    model, inputs = _odd_gpt2()
    ours = copy.deepcopy(model)
    compiled = amp_fx.compile(ours, dtype="bf16", fp8="tensorwise", backend="aot_eager", strict=True)
    with count_gemm_flops() as flops:
        loss = compiled(**inputs).loss
        loss.backward()

    decisions = [d for r in amp_fx.records(compiled) if r.fp8 is not None for d in r.fp8.decisions]
    assert decisions and all(d.converted for d in decisions), [d.reason for d in decisions if not d.converted]
    head = [d for d in decisions if d.module == "lm_head"]
    assert head and head[0].padding is not None and head[0].padding.dims["N"] == (_VOCAB, 1008)
    assert flops.fp8_share >= 0.99 and flops.unaligned == 0 and flops.padded > 0, flops

    twin = linear_twin(model)
    ref = torchao_float8(twin, "tensorwise", pad_inner_dim=True)
    with cpu_autocast_torchao(), torch.autocast("cpu", torch.bfloat16):
        loss_ref = ref(**inputs).loss
    loss_ref.backward()
    assert_bitwise(loss.detach(), loss_ref.detach(), "loss")
    conv1d = {n for n, m in model.named_modules() if type(m).__name__ == "Conv1D"}
    ref_grads = {
        n: p.grad.t() if n.rpartition(".")[0] in conv1d and n.endswith("weight") else p.grad
        for n, p in ref.named_parameters()
    }
    assert_bitwise({n: p.grad for n, p in ours.named_parameters()}, ref_grads, "gradients")

    exact = float(copy.deepcopy(model).double()(**inputs).loss)
    assert abs(float(loss) - exact) <= 2e-2, (float(loss), exact)


def test_explain_shows_the_padding_and_its_cost() -> None:
    """explain names each padded dimension with its padded size, and the FLOPs and bytes the
    padding adds, as ``padding()`` computes them; an aligned matmul shows no padding."""
    model = nn.Sequential(nn.Linear(32, 48), nn.ReLU(), nn.Linear(48, 10))
    ex = amp_fx.explain(model, torch.randn(33, 32), dtype="bf16", fp8="tensorwise")
    first, head = ex.fp8_decisions()
    assert first.converted and head.converted
    assert first.padding == padding(33, 32, 48, Fp8Recipe.TENSORWISE)  # M=33: the weight gradient's
    assert head.padding == padding(33, 48, 10, Fp8Recipe.TENSORWISE)
    assert head.padding.dims == {"M": (33, 48), "N": (10, 16)}
    text = ex.fp8_text(0)
    assert f"M 33->48, N 10->16: +{100 * head.padding.extra_flops:.1f}% FLOPs" in text, text
    assert f"+{100 * head.padding.extra_bytes:.1f}% bytes" in text, text
    assert "2 of 2 (tensorwise), 2 padded" in ex.summary()
    torch._dynamo.reset()  # else the second batch size makes M symbolic (then padded at run time)
    aligned = amp_fx.explain(model[:1], torch.randn(32, 32), dtype="bf16", fp8="tensorwise")
    (d,) = aligned.fp8_decisions()
    assert d.converted and d.padding is None and "padded" not in aligned.fp8_text(0)
