"""``fp8="blockwise"`` (DeepSeek-V3's recipe) against torchao 0.18's blockwise fp8 training.

torchao's Triton quantization kernels do not run on this CPU ("0 active drivers", DESIGN.md), so
the reference for each quantized operand is torchao's own torch transcription of them
(``torch_blockwise_scale_act_quant_lhs``/``_rhs``, ``torch_blockwise_scale_weight_quant`` in
``torchao/prototype/blockwise_fp8_training/kernels.py``), bit for bit; the GPU stage
(``.ci/gpu``) holds amp_fx's quantizers to the Triton kernels themselves. torchao's GEMMs
(cuBLAS blockwise ``scaled_mm``, Triton, DeepGEMM) do not run here either: amp_fx emulates them in
fp32, and the three GEMMs are checked against float64 on the same dequantized operands, with a
bound derived below. Then the pass on a transformers Llama and Mixtral (experts included).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import amp_fx
from amp_fx.fp8 import Fp8Recipe
from amp_fx.inspect.explanation import Explanation
from amp_fx.kernels import blockwise_fp8 as bw
from amp_fx.kernels.fp8_matmul import fp8_matmul, fp8_matmul_cached_weight, weight_casts
from amp_fx.kernels.fp8_padding import padding
from amp_fx.testing import assert_bitwise
from amp_fx.testing.fp8_reference import torchao_missing
from amp_fx.testing.real_models import REAL_MODELS

pytestmark = pytest.mark.filterwarnings("ignore:amp_fx. fp8='blockwise' runs emulated here")

_needs_torchao = pytest.mark.skipif(torchao_missing() is not None, reason=str(torchao_missing()))

U_E4M3 = 2.0**-4  # e4m3's unit roundoff (4 significant bits)
U_BF16 = 2.0**-8  # bf16's (8 significant bits)
U_FP32 = 2.0**-24


def _torchao() -> tuple[Callable[..., tuple[Tensor, Tensor]], ...]:
    from torchao.prototype.blockwise_fp8_training import kernels

    return (
        kernels.torch_blockwise_scale_act_quant_lhs,
        kernels.torch_blockwise_scale_act_quant_rhs,
        kernels.torch_blockwise_scale_weight_quant,
    )


def _operand(kind: str, rows: int, cols: int, dtype: torch.dtype, seed: int) -> Tensor:
    """A test tensor: ``random`` normal; ``zero blocks`` with an all-zero 1x128 block, an all-zero
    128x128 tile and an all-zero 128x1 column block; ``limits`` with values at e4m3's edges in
    each block (one at 448 x 2^10, whose scale is below 1; one below the smallest subnormal
    after scaling, 2^-20 of the amax; fp32 ``1e-30`` blocks, amax under EPS)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=gen)
    if kind == "zero blocks":
        x[3, :128] = 0
        x[128:256, 128:256] = 0
        x[:128, 5] = 0
    elif kind == "limits":
        x[:, ::7] *= 448 * 2.0**10
        x[:, 3::11] *= 2.0**-20
        x[rows // 2, :128] = 1e-30 if dtype == torch.float32 else 0.0
    return x.to(dtype)


def _assert_same(actual: tuple[Tensor, Tensor], expected: tuple[Tensor, Tensor], what: str) -> None:
    """Same e4m3 bits and the same fp32 scales (layouts aside: torchao's are column major)."""
    assert_bitwise(actual[0].view(torch.uint8).contiguous(), expected[0].view(torch.uint8).contiguous(), f"{what} data")
    assert_bitwise(actual[1].contiguous(), expected[1].contiguous(), f"{what} scales")


# --- the quantizers, bitwise with torchao's -----------------------------------------------------


@_needs_torchao
@pytest.mark.parametrize("kind", ["random", "zero blocks", "limits"])
def test_every_quantized_operand_bitwise_with_torchao(kind: str) -> None:
    """Each operand of the three GEMMs of ``out = x @ w`` (x ``[M, K]`` bf16, w ``[N, K]`` fp32,
    g ``[M, N]`` bf16), as amp_fx quantizes it, against torchao's torch reference of the kernel that
    quantizes it in ``fp8_blockwise_mm``."""
    lhs, rhs, weight = _torchao()
    m, k, n = 256, 256, 256
    x = _operand(kind, m, k, torch.bfloat16, 0)
    w = _operand(kind, n, k, torch.float32, 1)
    g = _operand(kind, m, n, torch.bfloat16, 2)
    tiles = bw.weight_tiles(w.t())
    # out: x 1x128 along K (triton_fp8_blockwise_act_quant_lhs); w.T in tiles
    # (..._weight_quant_transposed_rhs: the tiles of w.T)
    _assert_same(bw.quantize_1x128(x), lhs(x), "x (out)")
    _assert_same((tiles.data.t(), tiles.inv_scale.t()), weight(w.t().contiguous()), "w.T (out)")
    # grad_x: g 1x128 along N (..._act_quant_lhs); w in tiles (..._weight_quant_rhs)
    _assert_same(bw.quantize_1x128(g), lhs(g), "grad (grad_x)")
    _assert_same(tiles, weight(w), "w (grad_x)")
    # grad_w: g.T 1x128 along M (..._act_quant_transposed_lhs); x 128x1 along M (..._act_quant_rhs).
    # torchao's torch reference of the rhs kernel floors a bf16 amax at EPS in bf16, its Triton
    # kernel (and amp_fx) in fp32: given the same values in fp32, it floors as the kernel does.
    _assert_same(bw.quantize_1x128(g.t()), lhs(g.t().contiguous()), "grad.T (grad_w)")
    x_rhs = rhs(x.float())
    _assert_same(bw.quantize_1x128(x.t()), (x_rhs[0].t(), x_rhs[1].t()), "x (grad_w)")
    assert_bitwise(bw.quantize_1x128(x.t()).data.view(torch.uint8), rhs(x)[0].t().view(torch.uint8), "x data, bf16")


@_needs_torchao
@pytest.mark.parametrize("rows, cols", [(33, 200), (130, 7), (1, 129)])
def test_odd_sizes_quantize_as_torchao_on_the_zero_padded_tensor(rows: int, cols: int) -> None:
    """torchao asserts multiples of 128; amp_fx zero-pads: its blocks are torchao's on the padded
    tensor (a zero never raises an amax; a block of padding gets zero data)."""
    lhs, _, weight = _torchao()
    x = _operand("limits", rows, cols, torch.bfloat16, 3)
    pr, pc = -rows % 128, -cols % 128
    ref = lhs(F.pad(x, (0, pc)))
    _assert_same(bw.quantize_1x128(x), ref, "1x128")
    w = x.float()
    _assert_same(bw.quantize_128x128(w), weight(F.pad(w, (0, pc, 0, pr))), "128x128")


@_needs_torchao
def test_grouped_weight_gradient_operands_are_blocked_per_group() -> None:
    """The grouped weight gradient's operands: per column and 128 rows of each group, as torchao
    quantizes each group padded to 128 rows (``pad_token_groups``, then ``..._act_quant_rhs``);
    groups of 200, 0 and 90 rows, then 10 rows past the last offset (their own block)."""
    _, rhs, _ = _torchao()
    x = _operand("limits", 300, 128, torch.float32, 4)
    offs = torch.tensor([200, 200, 290], dtype=torch.int32)
    block, count = bw.token_blocks(offs, x.shape[0])
    data, inv_scale = bw.quantize_token_blocks(x, block, count)
    start = 0
    for end in offs.tolist():
        if end == start:
            continue
        rows = end - start
        ref_data, ref_scale = rhs(F.pad(x[start:end], (0, 0, 0, -rows % 128)))
        assert_bitwise(data[start:end].view(torch.uint8), ref_data[:rows].contiguous().view(torch.uint8), "data")
        assert_bitwise(inv_scale[block[start:end:128]], ref_scale, f"scales of rows {start}:{end}")
        start = end


# --- the GEMMs, against float64 -----------------------------------------------------------------


def _bound(ref: Tensor, a: Tensor, b: Tensor) -> Tensor:
    """Per element, for ``bf16(fp32 mm(A, B))`` against ``A @ B`` in float64 on the same dequantized
    operands (``a @ b``, float64): dequantizing rounds each element to fp32 (``data * inv_scale``,
    a 4-bit by 24-bit product: relative error <= 2^-24); the fp32 GEMM adds at most
    ``inner * 2^-24 * (|a| @ |b|)`` (worst case, any summation order); rounding to bf16 adds
    ``u_bf16`` of the fp32 result: ``u_bf16 |ref| + (1 + u_bf16) (inner + 2) 2^-24 (|a| @ |b|)``."""
    inner = a.shape[1]
    return U_BF16 * ref.abs() + (1 + U_BF16) * (inner + 2) * U_FP32 * (a.abs() @ b.abs())


def _check(actual: Tensor, a: Tensor, b: Tensor, what: str) -> None:
    ref = a @ b
    err = (actual.double() - ref).abs()
    bound = _bound(ref, a, b)
    assert bool((err <= bound).all()), (what, (err - bound).max().item())


@pytest.mark.parametrize("shape", [(2, 64, 256), (3, 11, 200), (1, 130, 129)], ids=["aligned", "odd", "odd2"])
@pytest.mark.parametrize("n", [128, 72])
def test_three_gemms_against_float64_on_the_dequantized_operands(shape: tuple[int, int, int], n: int) -> None:
    """out, grad_x and grad_w of ``blockwise_fp8_matmul`` (3-D input), each within :func:`_bound` of
    float64 on the operands dequantized from amp_fx's quantizers. A GEMM that read another
    quantization (tensorwise, or bf16 operands) misses by about ``u_e4m3 = 2^-4``, 16 x the bound."""
    torch.manual_seed(0)
    k = shape[-1]
    x = torch.randn(*shape).bfloat16().requires_grad_()
    w = torch.randn(n, k, requires_grad=True)
    g = torch.randn(*shape[:-1], n).bfloat16()
    out = bw.blockwise_fp8_matmul(x, w.t(), emulate=True)
    out.backward(g)
    x2, g2 = x.detach().reshape(-1, k), g.reshape(-1, n)
    m = x2.shape[0]

    def dq(b: bw.Blocks, rows: int, cols: int) -> Tensor:
        return bw.dequantize(b, rows, cols).double()

    tiles = bw.weight_tiles(w.detach().t())  # [N', K']
    _check(out.reshape(m, n), dq(bw.quantize_1x128(x2), m, k), dq(tiles, n, k).t(), "out")
    _check(x.grad.reshape(m, k), dq(bw.quantize_1x128(g2), m, n), dq(tiles, n, k), "grad_x")
    grad_w = dq(bw.quantize_1x128(g2.t()), n, m) @ dq(bw.quantize_1x128(x2.t()), k, m).t()
    assert w.grad is not None and w.grad.dtype == torch.float32
    _check(w.grad, dq(bw.quantize_1x128(g2.t()), n, m), dq(bw.quantize_1x128(x2.t()), k, m).t(), "grad_w")
    assert grad_w.shape == w.shape


def test_grouped_gemms_against_float64_per_group() -> None:
    """``blockwise_fp8_grouped_mm``: each group's three GEMMs within :func:`_bound` of float64 on its
    dequantized operands; rows past the last offset give zeros (``torch._grouped_mm`` leaves them
    unwritten); an empty group's expert gets a zero gradient."""
    torch.manual_seed(0)
    mm, k, n = 300, 200, 72
    x = torch.randn(mm, k).bfloat16().requires_grad_()
    w = torch.randn(3, k, n, requires_grad=True)
    offs = torch.tensor([150, 150, 290], dtype=torch.int32)
    g = torch.randn(mm, n).bfloat16()
    out = bw.blockwise_fp8_grouped_mm(x, w, offs)
    out.backward(g)
    xq = bw.dequantize(bw.quantize_1x128(x.detach()), mm, k).double()
    gq = bw.dequantize(bw.quantize_1x128(g), mm, n).double()
    block, count = bw.token_blocks(offs, mm)
    xt, xs = bw.quantize_token_blocks(x.detach(), block, count)
    gt, gs = bw.quantize_token_blocks(g, block, count)
    xt, gt = xt.double() * xs[block].double(), gt.double() * gs[block].double()
    start = 0
    for e, end in enumerate(offs.tolist()):
        tiles = bw.quantize_128x128(w.detach()[e].t())  # [N', K'], blocked along K
        we = bw.dequantize(tiles, n, k).double()
        if end > start:
            _check(out[start:end], xq[start:end], we.t(), f"out of expert {e}")
            _check(x.grad[start:end], gq[start:end], we, f"grad_x of expert {e}")
            _check(w.grad[e].t(), gt[start:end].t(), xt[start:end], f"grad_w of expert {e}")
        else:
            assert bool((w.grad[e] == 0).all()), f"expert {e} has no rows"
        start = end
    assert bool((out[290:] == 0).all()) and bool((x.grad[290:] == 0).all())


def test_fp8_matmul_routes_blockwise_and_its_weight_casts_are_the_uncached_ones() -> None:
    """``fp8_matmul(..., BLOCKWISE)`` is the blockwise matmul; ``weight_casts`` and
    ``fp8_matmul_cached_weight`` (the weight cache's path) give the same bits."""
    torch.manual_seed(0)
    x, w, g = torch.randn(4, 5, 200).bfloat16(), torch.randn(72, 200), torch.randn(4, 5, 72).bfloat16()
    runs = []
    for how in ("direct", "routed", "cached"):
        xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
        if how == "direct":
            out = bw.blockwise_fp8_matmul(xr, wr.t(), emulate=True)
        elif how == "routed":
            out = fp8_matmul(xr, wr.t(), Fp8Recipe.BLOCKWISE)
        else:
            casts = weight_casts(wr.detach().t(), Fp8Recipe.BLOCKWISE)
            out = fp8_matmul_cached_weight(xr, wr.t(), *casts, Fp8Recipe.BLOCKWISE)
        out.backward(g)
        runs.append((out, xr.grad, wr.grad))
    assert_bitwise(runs[1], runs[0], "routed")
    assert_bitwise(runs[2], runs[0], "cached")


def test_odd_sizes_are_padded_to_the_block() -> None:
    pad = padding(33, 40, 72, Fp8Recipe.BLOCKWISE)
    assert pad is not None and pad.dims == {"K": (40, 128), "M": (33, 128), "N": (72, 128)}
    assert padding(128, 256, 128, Fp8Recipe.BLOCKWISE) is None
    assert padding(64, 64, 64, Fp8Recipe.TENSORWISE) is None  # the negative twin: 16 is enough there


# --- the pass: the backend ladder, the weight cache --------------------------------------------


class MLP(nn.Module):
    """Linears with and without bias, a 3-D input, sizes that need padding (72, 200)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(200, 72)
        self.fc2 = nn.Linear(72, 128, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(F.gelu(self.fc1(x)))

    def eager_blockwise(self, x: Tensor) -> Tensor:
        """The reference: what the pass computes, written out (autocast's bf16 input, the fp32
        weight as ``[K, N]``, the bias added in bf16 after the GEMM)."""
        h = bw.blockwise_fp8_matmul(x.bfloat16(), self.fc1.weight.t(), emulate=True) + self.fc1.bias.bfloat16()
        return bw.blockwise_fp8_matmul(F.gelu(h), self.fc2.weight.t(), emulate=True)


@pytest.mark.slow  # two compiles: ~15 s here
@pytest.mark.filterwarnings("error:amp_fx. weight_cache=True")  # the cache fell back: a failure
def test_compiled_and_weight_cached_bitwise_with_the_eager_kernel() -> None:
    """The ladder: ``amp_fx.compile(fp8="blockwise")`` under aot_eager, with and without
    ``weight_cache=True``, against the kernel called eagerly: losses and parameters over 3 SGD
    steps, bit for bit; every linear converted, with its padding in the decision."""
    torch.manual_seed(0)
    model, x = MLP(), torch.randn(2, 5, 200)
    runs = []
    for how in ("eager", "compiled", "cached"):
        ours = copy.deepcopy(model)
        step: Callable[[Tensor], Tensor] = ours.eager_blockwise
        if how != "eager":
            cached = how == "cached"
            step = amp_fx.compile(ours, dtype="bf16", fp8="blockwise", backend="aot_eager", weight_cache=cached)
        opt = torch.optim.SGD(ours.parameters(), lr=0.5)
        losses = []
        for i in range(3):
            loss = step(x * (1 + i)).float().pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
        runs.append((losses, dict(ours.named_parameters())))
        if how == "compiled":
            decisions = [d for r in amp_fx.records(step) for d in r.fp8.decisions]
            assert [(d.weight, d.converted) for d in decisions] == [("fc1.weight", True), ("fc2.weight", True)]
            assert "padded to multiples of 128" in decisions[0].reason, decisions[0].reason
    assert_bitwise(runs[1], runs[0], "compiled against eager")
    assert_bitwise(runs[2], runs[0], "weight cache against eager")


# --- the pass on real models --------------------------------------------------------------------


def _fp8_share(compiled: object) -> float:
    """The share of the captured matmuls' FLOPs converted to fp8 (the decisions explain reads)."""
    decisions = [d for r in amp_fx.records(compiled) if r.fp8 is not None for d in r.fp8.decisions]
    assert decisions and all(d.flops for d in decisions), decisions
    return sum(d.flops for d in decisions if d.converted) / sum(d.flops for d in decisions)


def _step(
    model: nn.Module, inputs: dict[str, Tensor], moe: bool, **fp8: object
) -> tuple[Tensor, dict[str, Tensor], object]:
    # the bf16 run's experts in bf16 too (what fp8= asks for them when the policy leaves it unset)
    policy = amp_fx.Policy(autocast_experts=True if moe else None)
    compiled = amp_fx.compile(model, dtype="bf16", backend="aot_eager", policy=policy, **fp8)
    loss = compiled(**inputs).loss
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}, compiled


@pytest.mark.slow  # two compiles of a 2-layer model: ~30 s here
@pytest.mark.parametrize("name", ["hf_llama", "hf_mixtral"])
def test_real_models_train_in_blockwise_within_the_quantization_bound(name: str) -> None:
    """A transformers Llama and Mixtral (4 experts, 2 per token: its grouped expert GEMMs
    included), 2 layers, random init: every matmul with a parameter converted to blockwise fp8
    (the fp8 share of their FLOPs >= 0.95, as ``explain`` reports it; here 1.0), the emulation said
    once; loss and every weight gradient against the bf16 run.

    Bound. Against float64, the bf16 run's loss is within ``4 u_bf16`` relative and the blockwise
    run's within ``4 u_e4m3`` (tests/fp8/test_moe_experts.py's argument: rounding a GEMM's operands
    to a format of unit roundoff u moves each product by <= 2u, the cross-entropy by <= 2x the
    largest logit change; a block scale maps each block's amax to 448, so every element but those
    under 2^-15 of their block's amax, in e4m3's subnormals, keeps e4m3's relative precision):
    ``|loss - loss_bf16| <= 4 (u_e4m3 + u_bf16) |loss_bf16|``. Each weight gradient: its GEMM
    rounds both operands to e4m3 (2 u_e4m3) after the output gradient came through the layers above
    in e4m3 (2 u_e4m3 more), and the bf16 run's own error (4 u_bf16): a relative norm error of at
    most ``4 u_e4m3 + 4 u_bf16`` (0.27), against 1.0 for a gradient lost or zero. Some bit must
    differ from the bf16 run (fp8 did run)."""
    entry = REAL_MODELS[name]
    if entry.missing() is not None:
        pytest.skip(entry.missing())
    model, inputs, _ = entry.build()
    ref = copy.deepcopy(model)
    loss_ref, grads_ref, _ = _step(ref, inputs, name == "hf_mixtral")
    with pytest.warns(UserWarning, match="fp8='blockwise' runs emulated here: cpu has no blockwise fp8 GEMM"):
        loss, grads, compiled = _step(model, inputs, name == "hf_mixtral", fp8="blockwise", strict=True)
    decisions = [d for r in amp_fx.records(compiled) if r.fp8 is not None for d in r.fp8.decisions]
    assert all(d.converted and d.recipe is Fp8Recipe.BLOCKWISE for d in decisions), decisions
    assert "1x128 along K" in decisions[0].reason, decisions[0].reason
    if name == "hf_mixtral":
        assert any(d.op == "aten._grouped_mm" for d in decisions), decisions
    assert _fp8_share(compiled) >= 0.95
    shown = str(Explanation.from_records(amp_fx.records(compiled)))
    assert "(blockwise)" in shown and "of their FLOPs" in shown and "runs emulated here" in shown, shown
    assert abs(loss.item() - loss_ref.item()) <= 4 * (U_E4M3 + U_BF16) * abs(loss_ref.item()), (loss, loss_ref)
    assert grads.keys() == grads_ref.keys()
    for n, g in grads.items():
        err = ((g.double() - grads_ref[n].double()).norm() / grads_ref[n].double().norm()).item()
        assert err <= 4 * (U_E4M3 + U_BF16), (n, err)
    assert not all(torch.equal(g, grads_ref[n]) for n, g in grads.items()), "no bit differs from bf16"
    assert math.isfinite(loss.item())


# --- what amp_fx says ---------------------------------------------------------------------------


@pytest.mark.filterwarnings("error")
def test_the_emulation_is_said_once_and_strict_mode_allows_it() -> None:
    """The first call warns that blockwise runs emulated (a notice: strict mode does not refuse
    it, as for mxfp8); the second call says nothing."""
    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64)), torch.randn(8, 64)
    compiled = amp_fx.compile(model, dtype="bf16", fp8="blockwise", backend="aot_eager", strict=True)
    with pytest.warns(UserWarning, match="fp8='blockwise' runs emulated here") as said:
        compiled(x).float().sum().backward()
    assert len([w for w in said if "blockwise" in str(w.message)]) == 1
    compiled(x).float().sum().backward()  # filterwarnings("error"): any warning fails


@pytest.mark.parametrize(
    "capability, missing", [((8, 9), "Hopper's"), ((10, 0), "Hopper's"), ((9, 0), None)], ids=["l4", "b200", "h100"]
)
def test_only_hopper_has_the_blockwise_gemm(
    monkeypatch: pytest.MonkeyPatch, capability: tuple[int, int], missing: str | None
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA GPU")
    monkeypatch.setattr(torch.version, "hip", None)
    text = bw.blockwise_kernels_missing.__wrapped__("cuda")
    assert (text is None) if missing is None else (missing in text), text
