"""``fp8="nvfp4"``: TransformerEngine's NVFP4BlockScaling, against TE's reference chain.

The oracle is ``tests/fp8/_te_nvfp4_reference.py``, a transcription of TE's
``custom_recipes/reference_nvfp4.py`` (TE cannot be installed without CUDA). The ladder: the
quantizer alone, bitwise with TE's (data, e4m3 scales, amax; the 1x16 activation path, the 16x16
weight tiles, the Hadamard-transformed column-wise copies) on awkward tensors; stochastic
rounding (TE's reference has none: its scales, its rounding neighbours, unbiasedness within a
derived bound, reproducibility); each of the matmul's three GEMMs against float64 on the operands
it quantized; the grouped GEMM against per-expert matmuls; the pass (bitwise with eager calls of
the kernel); then a tiny Llama and a Qwen3-MoE trained with every GEMM in NVFP4 (explain's fp8
share), their losses within a bound of the bf16 run. This CPU has no fp4 tensor cores: amp_fx
emulates NVFP4 and says so (tested); the ``torch._scaled_mm`` fp4 path of a Blackwell GPU is not
run by these tests.
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import amp_fx
from amp_fx.fp8 import Fp8Config, Fp8Recipe, Nvfp4Options
from amp_fx.kernels import nvfp4 as nv
from amp_fx.testing import assert_bitwise
from tests.fp8 import _te_nvfp4_reference as te

EMULATED = "ignore:amp_fx. fp8='nvfp4' runs emulated here"
U_BF16 = 2.0**-8  # bf16's unit roundoff (8 significant bits)
U_FP32 = 2.0**-24


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# --- tensors that reach every corner of the chain ------------------------------------------------


def _tensor(case: str, rows: int, cols: int) -> Tensor:
    g = _gen(hash(case) % 1000)
    x = torch.randn(rows, cols, generator=g)
    if case == "random":  # rows spread over 2^+-12: block scales from e4m3's subnormals to its max
        x = x * torch.exp(torch.randn(rows, 1, generator=g) * 3)
    elif case == "zero_blocks":
        x[: min(rows, 16), :16] = 0  # an all-zero 1x16 block on every row, and a zero 16x16 tile
        x[-1] = 0  # an all-zero row
    elif case == "subnormal_scales":  # one huge value: the other blocks' scales are e4m3 subnormals or 0
        x = x * 1e-3
        x[0, 0] = 3e3
    elif case == "amax_huge":  # near bf16's max: S_enc ~ 1e-35
        x = x * 1e37
    elif case == "amax_tiny":  # 448 * 6 / amax overflows fp32: S_enc clamped to FLT_MAX
        x = x * 1e-39
    elif case == "all_zero":
        x = torch.zeros(rows, cols)
    elif case == "grid":  # scaled values on the e2m1 grid and on each midpoint (RTNE's ties)
        grid = torch.tensor([0, 0.25, 0.5, 0.75, 1, 1.25, 1.5, 1.75, 2, 2.5, 3, 3.5, 4, 5, 6, -1.75])
        x = grid.repeat(rows, cols // 16)
    return x.to(torch.bfloat16)


CASES = ["random", "zero_blocks", "subnormal_scales", "amax_huge", "amax_tiny", "all_zero", "grid"]


def _same(ours: nv.Nvfp4Tensor, data: Tensor, scale: Tensor, amax: Tensor, what: str) -> None:
    rows, nbytes = data.shape
    assert_bitwise(ours.data[:, :nbytes], data, f"{what}: e2m1 data")
    assert_bitwise(ours.scale.view(torch.uint8), scale[:rows].view(torch.uint8), f"{what}: e4m3 scales")
    assert_bitwise(ours.amax.reshape(1), amax, f"{what}: amax")


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("rows, cols", [(48, 64), (37, 40)], ids=["aligned", "odd"])
def test_quantize_bitwise_with_te_reference(case: str, rows: int, cols: int) -> None:
    """Activations (1x16 along the row, RTNE) and weights (16x16 tiles), each with its transposed
    copy, bitwise with TE's ``NVFP4QuantizerRef``: the packed codes, the e4m3 scales, the amax."""
    x = _tensor(case, rows, cols)
    for tile in ((1, 16), (16, 16)):
        qx, sx, qx_t, sx_t, amax_row, amax_col = te.quantize(x, tile)
        _same(nv.quantize(x, tile_rows=tile[0]), qx, sx, amax_row, f"{case} {tile} rowwise")
        _same(nv.quantize(x.t(), tile_rows=tile[0]), qx_t, sx_t, amax_col, f"{case} {tile} columnwise")


@pytest.mark.parametrize("case", [c for c in CASES if c != "amax_tiny"])
def test_hadamard_path_bitwise_with_te_reference(case: str) -> None:
    """The weight-gradient GEMM's copies: TE's ``with_rht`` quantizer transforms the transposed
    copy (blocks of 16 along the tokens; TE needs their count a multiple of 16), takes its amax
    after the transform and quantizes it 1x16: bitwise. (``amax_tiny``: below.)"""
    x = _tensor(case, 48, 40)
    _, _, qx_t, sx_t, _, amax_col = te.quantize(x, (1, 16), with_rht=True)
    _same(nv.quantize(x.t(), hadamard=True), qx_t, sx_t, amax_col, f"{case} rht")


def test_hadamard_of_bf16_subnormals_is_the_exact_sum_rounded_once() -> None:
    """bf16 subnormals (``amax_tiny``): TE's reference multiplies in bf16, and this CPU's bf16
    matmul flushes subnormal results to zero (all 1848 nonzero outputs here); amp_fx sums the
    exact products in fp32 and rounds once, which is the float64 transform rounded to bf16, bit
    for bit. The quantized copy then follows the chain as for any tensor."""
    x = _tensor("amax_tiny", 48, 40).t().contiguous()
    h64 = te.build_hadamard_matrix(16, torch.device("cpu"), torch.float64) * 0.25
    exact = (x.double().reshape(-1, 16) @ h64).reshape(x.shape).to(torch.bfloat16)
    assert_bitwise(nv.rht(x), exact, "rht of subnormals")
    assert not te.apply_rht(x).any()  # the reference's flush (negative twin: what bitwise would have meant)


def test_hadamard_matrix_and_signs_are_te_s() -> None:
    h = te.build_hadamard_matrix(16, torch.device("cpu"), torch.float32) * 0.25
    x = torch.randn(3, 32, dtype=torch.float64)
    assert_bitwise(nv.rht(x.float()), te.apply_rht(x.float()), "rht")
    assert_bitwise(torch.tensor(nv.RHT_SIGNS, dtype=torch.float32), te.get_wgrad_sign_vector(), "signs")
    torch.testing.assert_close(h @ h.t(), torch.eye(16), rtol=0, atol=0)  # orthogonal: (xH)(gH)^T = x g^T


def test_packing_and_dequantize_are_te_s() -> None:
    """Two codes per byte, the even element in the low nibble; decoding is TE's ``cast_from_fp4x2``
    times the block scale and ``amax / 2688``."""
    x = _tensor("random", 32, 48)
    q = nv.quantize(x)
    values = te.cast_from_fp4x2(q.data, torch.float32)
    expected = (values.reshape(32, 3, 16) * q.scale.float().unsqueeze(-1)).reshape(32, 48) * (q.amax / 2688.0)
    assert_bitwise(nv.dequantize(q), expected, "dequantized")


# --- stochastic rounding -------------------------------------------------------------------------


def _scaled(x: Tensor) -> Tensor:
    """``clamp(x * encode, -6, 6)`` of TE's chain for 1x16 blocks (fp32): the value the e2m1
    rounding sees, from the reference's scales."""
    qx, sx, *_ = te.quantize(x, (1, 16))
    amax = x.abs().amax().float()
    s_enc = torch.clamp(torch.full_like(amax, 2688.0) / amax, max=torch.finfo(torch.float32).max)
    encode = 1.0 / (sx.float() * (1.0 / s_enc))
    blocks = x.float().reshape(x.shape[0], -1, 16) * encode.unsqueeze(-1)
    return torch.clamp(blocks, -6, 6).reshape(x.shape)


def _e2m1(q: nv.Nvfp4Tensor) -> Tensor:
    return te.cast_from_fp4x2(q.data, torch.float32)


def test_stochastic_rounding_keeps_te_s_scales_and_rounds_to_a_neighbour() -> None:
    x = _tensor("random", 64, 64)
    qx, sx, *_ = te.quantize(x, (1, 16))
    q = nv.quantize(x, stochastic=True, generator=_gen(0))
    assert_bitwise(q.scale.view(torch.uint8), sx.view(torch.uint8), "scales")
    scaled, got = _scaled(x), _e2m1(q)
    grid = torch.tensor([-6, -4, -3, -2, -1.5, -1, -0.5, 0, 0.5, 1, 1.5, 2, 3, 4, 6])
    idx = torch.searchsorted(grid, scaled.contiguous()).clamp(1, len(grid) - 1)
    lo, hi = grid[idx - 1], grid[idx]
    on_grid = torch.isin(scaled, grid)
    ok = torch.where(on_grid, got == scaled, (got == lo) | (got == hi))
    assert ok.all(), (scaled[~ok], got[~ok])
    assert (got != _e2m1(nv.Nvfp4Tensor(qx, sx, q.amax))).any()  # not round-to-nearest


def test_stochastic_rounding_is_unbiased_within_a_derived_bound() -> None:
    """One row of 16 values repeated N = 4096 times (same block scale each time). Each rounded
    value is ``lo`` or ``hi = lo + step`` with P(hi) = p = (v - lo) / step: its mean over N draws has
    standard deviation ``step * sqrt(p (1 - p) / N)``; the mean must be within 5 of those of the
    scaled value ``v`` (a false failure about once in 10^6 per element; the draws are seeded).
    The negative twin: round-to-nearest-even on the same data misses by far more."""
    n = 4096
    row = torch.tensor([0.1, 0.3, 0.6, 0.8, 1.1, 1.3, 1.6, 1.9, 2.2, 2.7, 3.3, 3.9, 4.4, 5.1, 5.8, -2.6])
    x = (row * 7.0).repeat(n, 1).to(torch.bfloat16)
    v = _scaled(x)[0]
    grid = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6])
    a = v.abs()
    lo = grid[torch.searchsorted(grid, a, right=True) - 1]
    step = torch.where(a < 2, 0.5, torch.where(a < 4, 1.0, 2.0))
    p = (a - lo) / step
    sigma = step * torch.sqrt(p * (1 - p) / n)
    mean = _e2m1(nv.quantize(x, stochastic=True, generator=_gen(1))).mean(0)
    assert ((mean - v).abs() <= 5 * sigma + 1e-6).all(), (mean, v, sigma)
    rtne = _e2m1(nv.quantize(x)).mean(0)
    assert ((rtne - v).abs() > 5 * sigma + 1e-6).sum() >= 12, (rtne, v)


def test_stochastic_rounding_is_reproducible_under_a_seed() -> None:
    x = _tensor("random", 32, 64)
    a = nv.quantize(x, stochastic=True, generator=_gen(7))
    assert_bitwise(nv.quantize(x, stochastic=True, generator=_gen(7)).data, a.data, "same generator seed")
    assert not torch.equal(nv.quantize(x, stochastic=True, generator=_gen(8)).data, a.data)
    torch.manual_seed(3)
    b = nv.quantize(x, stochastic=True)
    torch.manual_seed(3)
    assert_bitwise(nv.quantize(x, stochastic=True).data, b.data, "torch.manual_seed")


# --- the three GEMMs -----------------------------------------------------------------------------


def _gemm64(a: nv.Nvfp4Tensor, b: nv.Nvfp4Tensor) -> tuple[Tensor, Tensor]:
    """``a @ b.T`` in float64 on the quantized operands, and the bound of the fp32 GEMM against it:
    the bf16 rounding of the result (``u_bf16 |ref|``) plus fp32 accumulation over I products and
    the two roundings of alpha (``(I + 3) u_fp32 (|A| |B|^T) alpha``)."""
    am, bm = nv._unpack(a).double(), nv._unpack(b).double()
    alpha = a.amax.double() * b.amax.double() / 2688.0**2
    ref = am @ bm.t() * alpha
    bound = U_BF16 * ref.abs() + (am.shape[1] + 3) * U_FP32 * (am.abs() @ bm.abs().t()) * alpha
    return ref, bound


def _within(got: Tensor, ref_bound: tuple[Tensor, Tensor], what: str) -> None:
    ref, bound = ref_bound
    err = (got.double() - ref).abs()
    assert (err <= bound).all(), (what, (err - bound).max())


@pytest.mark.parametrize("rht", [True, False], ids=["rht", "no_rht"])
@pytest.mark.parametrize("weight_2d", [True, False], ids=["tiles", "rows"])
@pytest.mark.parametrize("m, k, n", [(32, 64, 48), (20, 40, 24)], ids=["aligned", "odd"])
def test_matmul_gemms_against_float64(rht: bool, weight_2d: bool, m: int, k: int, n: int) -> None:
    """out, grad_x and grad_w of :func:`nvfp4_matmul` against float64 on the operands each GEMM
    quantized (re-made here with the kernel's quantizer and the same generator: the gradient's
    two stochastic roundings draw in that order), within :func:`_gemm64`'s bound."""
    opts = Nvfp4Options(rht=rht, stochastic_rounding=True, weight_2d=weight_2d)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, m // 2, k, generator=g).to(torch.bfloat16).requires_grad_()
    w = torch.randn(k, n, generator=g).to(torch.bfloat16).requires_grad_()
    grad = torch.randn(2, m // 2, n, generator=g).to(torch.bfloat16)
    out = nv.nvfp4_matmul(x, w, options=opts, generator=_gen(5))
    out.backward(grad)

    tile = 16 if weight_2d else 1
    x2, g2 = x.detach().reshape(m, k), grad.reshape(m, n)
    _within(out.reshape(m, n), _gemm64(nv.quantize(x2), nv.quantize(w.detach().t(), tile_rows=tile)), "out")
    gen = _gen(5)
    gq = nv.quantize(g2, stochastic=True, generator=gen)
    g_t = nv.quantize(g2.t(), hadamard=rht, stochastic=True, generator=gen)
    ref_x, bound_x = _gemm64(gq, nv.quantize(w.detach(), tile_rows=tile))
    _within(x.grad.reshape(m, k), (ref_x[:, :k], bound_x[:, :k]), "grad_x")
    _within(w.grad.t(), _gemm64(g_t, nv.quantize(x2.t(), hadamard=rht)), "grad_w")
    assert out.dtype == x.grad.dtype == w.grad.dtype == torch.bfloat16


def test_weight_tiles_make_the_two_weight_copies_the_same_values() -> None:
    """With 16x16 tiles the forward and input-gradient copies of a weight decode to the same
    values (TE's reason for them); with 1x16 blocks they do not."""
    w = _tensor("random", 48, 64)
    for tile, same in ((16, True), (1, False)):
        a = nv.dequantize(nv.quantize(w, tile_rows=tile))
        b = nv.dequantize(nv.quantize(w.t(), tile_rows=tile)).t()
        assert torch.equal(a, b) is same, tile


def test_grouped_mm_is_each_expert_s_matmul() -> None:
    """:func:`nvfp4_grouped_mm` with groups of 16 and 32 rows (and an empty one) against
    :func:`nvfp4_matmul` on each group's rows (round-to-nearest: the same quantization): forward
    and both gradients within one bf16 rounding (``2 u_bf16``: the fp32 sums of the masked and the
    sliced GEMMs may run in another order) of each other."""
    torch.manual_seed(0)
    x = torch.randn(48, 32).to(torch.bfloat16).requires_grad_()
    w = torch.randn(3, 32, 24).requires_grad_()
    offs = torch.tensor([16, 16, 48], dtype=torch.int32)
    grad = torch.randn(48, 24).to(torch.bfloat16)
    out = nv.nvfp4_grouped_mm(x, w, offs, True, False, True)
    out.backward(grad)
    opts = Nvfp4Options(stochastic_rounding=False)
    xs, ws = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    ref = torch.cat(
        [nv.nvfp4_matmul(xs[s:t], ws[e].bfloat16(), options=opts) for e, (s, t) in ((0, (0, 16)), (2, (16, 48)))]
    )
    ref.backward(torch.cat([grad[0:16], grad[16:48]]))
    for got, want, what in ((out, ref, "out"), (x.grad, xs.grad, "grad_x"), (w.grad, ws.grad, "grad_w")):
        torch.testing.assert_close(got.float(), want.float(), rtol=2 * U_BF16, atol=0, msg=what)
    assert torch.equal(w.grad[1], torch.zeros_like(w.grad[1]))  # the empty group


# --- the pass ------------------------------------------------------------------------------------


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(32, 64)
        self.fc2 = nn.Linear(64, 40, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class _EagerNvfp4(nn.Module):
    """The reference for the pass: ``MLP`` whose linears call the kernel on the bf16 input and the
    fp32 weight transposed, bias added after, under ``torch.autocast("cpu", bf16)``."""

    def __init__(self, m: MLP, options: Nvfp4Options) -> None:
        super().__init__()
        self.m, self.options = m, options

    def _linear(self, lin: nn.Linear, x: Tensor) -> Tensor:
        out = nv.nvfp4_matmul(x.to(torch.bfloat16), lin.weight.t(), options=self.options)
        return out if lin.bias is None else out + lin.bias.to(out.dtype)

    def forward(self, x: Tensor) -> Tensor:
        return self._linear(self.m.fc2, F.gelu(self._linear(self.m.fc1, x)))


@pytest.mark.slow  # 25 to 35 s on a loaded 2-core CPU: two compiles
@pytest.mark.filterwarnings(EMULATED)
def test_pass_is_bitwise_with_eager_kernel_calls_and_carries_the_switches() -> None:
    """Under aot_eager, with stochastic rounding off (the compiled backward may draw in another
    order than eager autograd): loss and gradients bitwise with the eager kernel calls; every
    linear converted, the reason naming the switches. With it on, the switch reaches the graph:
    two seeds give two gradients, one seed the same twice."""
    torch.manual_seed(0)
    model, x = MLP(), torch.randn(4, 8, 32)
    opts = Nvfp4Options(stochastic_rounding=False)
    ours = copy.deepcopy(model)
    compiled = amp_fx.compile(ours, dtype="bf16", fp8=Fp8Config("nvfp4", nvfp4=opts), backend="aot_eager")
    loss = compiled(x).float().pow(2).mean()
    loss.backward()
    ref = _EagerNvfp4(model, opts)
    with torch.autocast("cpu", torch.bfloat16):
        ref_loss = ref(x).float().pow(2).mean()
    ref_loss.backward()
    assert_bitwise(loss.detach(), ref_loss.detach(), "loss")
    assert_bitwise(
        {n: p.grad for n, p in ours.named_parameters()}, {n: p.grad for n, p in model.named_parameters()}, "gradients"
    )
    decisions = [d for r in amp_fx.records(compiled) for d in r.fp8.decisions]
    assert [(d.weight, d.converted, d.recipe) for d in decisions] == [
        (f"{m}.weight", True, Fp8Recipe.NVFP4) for m in ("fc1", "fc2")
    ]
    assert "rounded to nearest even" in decisions[0].reason and "through the random Hadamard" in decisions[0].reason

    sr = copy.deepcopy(model)
    compiled = amp_fx.compile(sr, dtype="bf16", fp8="nvfp4", backend="aot_eager")
    grads = []
    for seed in (1, 1, 2):
        torch.manual_seed(seed)
        compiled(x).float().pow(2).mean().backward()
        grads.append(sr.fc1.weight.grad.clone())
        sr.zero_grad()
    assert torch.equal(grads[0], grads[1]) and not torch.equal(grads[0], grads[2])


def test_emulation_is_said_once_and_strict_mode_does_not_refuse_it() -> None:
    model, x = nn.Linear(32, 16), torch.randn(4, 32)
    compiled = amp_fx.compile(model, dtype="bf16", fp8="nvfp4", backend="aot_eager", strict=True)
    with pytest.warns(UserWarning, match="fp8='nvfp4' runs emulated here: cpu has no fp4 tensor cores") as seen:
        compiled(x)
        compiled(x)
    assert sum("nvfp4" in str(w.message) for w in seen) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        compiled(x * 2)  # said once: not again


@pytest.mark.parametrize(
    "capability, missing", [((9, 0), "no fp4 tensor cores"), ((10, 0), None)], ids=["h100", "b200"]
)
def test_hopper_is_told_blackwell_is_needed(
    monkeypatch: pytest.MonkeyPatch, capability: tuple[int, int], missing: str | None
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H200")
    monkeypatch.setattr(torch.version, "hip", None)
    text = nv.fp4_kernels_missing.__wrapped__("cuda")
    assert (text is None) if missing is None else (missing in text and "9.0" in text)


@pytest.mark.filterwarnings(EMULATED)
@pytest.mark.slow_cases  # two compiles each: about 20 s here
@pytest.mark.filterwarnings(EMULATED)
@pytest.mark.parametrize("weight_2d", [True, False], ids=["tiles", "rows"])
def test_weight_cache_quantizes_once_per_step_bitwise_with_uncached(
    weight_2d: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``weight_cache=True`` with NVFP4 (TE's defaults: stochastic rounding and the Hadamard
    transform on, which touch the gradients only; ``rows``: the weight's two casts differ), 3 SGD
    steps of 2 micro-batches, each seeded: losses and parameters bitwise with the uncached run
    (weights are rounded to nearest even, so a cast made once per step is the cast each forward
    made); after the first step (the compile) each of the 2 weights is quantized once per step,
    not once per micro-batch. Before, amp_fx warned that NVFP4 weights were not cached."""
    torch.manual_seed(0)
    model, x = MLP(), torch.randn(2, 8, 32)
    config = Fp8Config("nvfp4", nvfp4=Nvfp4Options(weight_2d=weight_2d))
    calls: list[int] = []
    casts = nv.weight_casts
    monkeypatch.setattr(nv, "weight_casts", lambda w, o: [calls.append(1), casts(w, o)][1])
    runs = []
    for cached in (False, True):
        ours = copy.deepcopy(model)
        compiled = amp_fx.compile(ours, dtype="bf16", fp8=config, backend="aot_eager", weight_cache=cached)
        opt = torch.optim.SGD(ours.parameters(), lr=0.5)
        losses, per_step = [], []
        for step in range(3):
            calls.clear()
            for micro in range(2):
                torch.manual_seed(10 * step + micro)
                loss = compiled(x * (1 + step + micro)).float().pow(2).mean()
                loss.backward()
                losses.append(loss.detach())
            opt.step()
            opt.zero_grad()
            per_step.append(len(calls))
        runs.append((losses, dict(ours.named_parameters())))
        assert per_step[1:] == ([2, 2] if cached else [0, 0]), per_step
    assert_bitwise(runs[1], runs[0], "cached against uncached")


def test_bad_configurations_are_refused() -> None:
    with pytest.raises(ValueError, match="fp8='nvfp4' needs dtype=torch.bfloat16"):
        amp_fx.compile(MLP(), dtype="fp16", fp8="nvfp4", backend="aot_eager")
    with pytest.raises(ValueError, match="sets NVFP4's switches; the recipe is 'mxfp8'"):
        Fp8Config("mxfp8", nvfp4=Nvfp4Options())
    with pytest.raises(TypeError, match="Nvfp4Options.rht must be True or False"):
        Nvfp4Options(rht=1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="Fp8Config.nvfp4 must be an amp_fx.Nvfp4Options"):
        Fp8Config("nvfp4", nvfp4={"rht": False})  # type: ignore[arg-type]
    assert Fp8Config("nvfp4").nvfp4 == Nvfp4Options() and Fp8Config("rowwise").nvfp4 is None
    with pytest.raises(ValueError, match="NVFP4 tiles are 1x16 or 16x16"):
        nv.quantize(torch.zeros(16, 16), tile_rows=4)


# --- models train with every GEMM in NVFP4 -------------------------------------------------------

U_E2M1 = 2.0**-2  # e2m1's unit roundoff (2 significant bits)
STEPS = 4


def _llama() -> tuple[nn.Module, dict[str, Tensor], object]:
    from amp_fx.testing.real_models import REAL_MODELS, library_missing

    if library_missing("transformers") is not None:
        pytest.skip(str(library_missing("transformers")))
    return REAL_MODELS["hf_llama"].build()


def _qwen3_moe() -> tuple[nn.Module, dict[str, Tensor], object]:
    pytest.importorskip("transformers", reason="the MoE model comes from transformers")
    from tests.fp8.test_moe_experts import _build
    from tests.fp8.test_moe_experts import _qwen3_moe as factory

    model, inputs = _build(factory)
    return model, inputs, lambda out: out.loss


def _train(
    model: nn.Module, inputs: dict[str, Tensor], loss_fn: object, **kwargs: object
) -> tuple[list[float], list[Any]]:
    """The losses of STEPS AdamW steps, and the compiled model's records."""
    compiled = amp_fx.compile(model, dtype="bf16", backend="aot_eager", **kwargs)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    torch.manual_seed(0)  # the stochastic rounding's draws
    for _ in range(STEPS):
        loss = loss_fn(compiled(**inputs))  # type: ignore[operator]
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, amp_fx.records(compiled)


@pytest.mark.slow  # 50 to 65 s each on a quiet 2-core CPU, up to 350 s loaded (two cold compiles, 8 steps)
@pytest.mark.filterwarnings(EMULATED)
@pytest.mark.parametrize("build", [_llama, _qwen3_moe], ids=["llama", "qwen3_moe"])
def test_models_train_with_every_gemm_in_nvfp4(build: object) -> None:
    """A 2-layer Llama and a 1-layer Qwen3-MoE (4 experts, grouped GEMMs) with ``fp8="nvfp4"``:
    every matmul with a parameter converted, the grouped expert GEMMs included (explain's fp8
    share of the matmul FLOPs >= 0.95: 1.00 here), and 4 AdamW steps that track the bf16 run.

    Bound. First step (one forward from the same weights): the logits of a random-init model are
    near zero, so the losses agree to ``2^-6`` relative (measured: 2e-4 Llama, 2e-3 MoE). After T
    steps: each step's progress comes from gradients whose elements are e2m1 values at their
    blocks' scales, a relative error of at most e2m1's unit roundoff ``u = 2^-2`` where they sit
    in e2m1's normal range; to first order the NVFP4 run's progress ``loss(0) - loss(T)`` is the
    bf16 run's within ``u`` of it: ``|loss_nv(T) - loss_bf16(T)| <= |loss_nv(0) - loss_bf16(0)| +
    u (loss_bf16(0) - loss_bf16(T))``. A run that does not learn (a wrong or lost gradient) misses
    it by ``(1 - u)`` of the progress."""
    model, inputs, loss_fn = build()  # type: ignore[operator]
    policy = amp_fx.Policy(autocast_experts=True) if build is _qwen3_moe else None
    bf16, _ = _train(copy.deepcopy(model), inputs, loss_fn, policy=policy)
    nvfp4, records = _train(model, inputs, loss_fn, policy=policy, fp8="nvfp4")
    decisions = [d for r in records for d in r.fp8.decisions]
    kept = [d for d in decisions if not d.converted]
    assert not kept and all(d.recipe is Fp8Recipe.NVFP4 for d in decisions), kept
    share = sum(d.flops for d in decisions if d.converted) / sum(d.flops for d in decisions)
    assert share >= 0.95, share
    if build is _qwen3_moe:
        assert sum(d.op == "aten._grouped_mm" for d in decisions) == 2, decisions
    assert abs(nvfp4[0] - bf16[0]) <= 2**-6 * abs(bf16[0]), (nvfp4, bf16)
    progress = bf16[0] - bf16[-1]
    assert progress > 0.5, bf16  # the bf16 run learns (the bound needs progress to mean anything)
    assert abs(nvfp4[-1] - bf16[-1]) <= abs(nvfp4[0] - bf16[0]) + U_E2M1 * progress, (nvfp4, bf16)


@pytest.mark.filterwarnings(EMULATED)
def test_compare_runs_the_eager_side_in_nvfp4_with_the_switches() -> None:
    """``compare(fp8=...)``: its eager side (``Fp8Eager``) runs the converted matmuls through the
    same kernel with the config's switches, so with stochastic rounding off both sides agree bit
    for bit; the report names TE's numerics."""
    torch.manual_seed(0)
    config = Fp8Config("nvfp4", nvfp4=Nvfp4Options(stochastic_rounding=False))
    report = amp_fx.compare(MLP(), torch.randn(4, 8, 32), dtype="bf16", fp8=config, backend="aot_eager")
    assert report.ok and "fp8 nvfp4 with TransformerEngine's numerics" in str(report), str(report)
