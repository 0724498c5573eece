"""``amp_fx.kernels.quant_stats``: each figure against a count made in float64 from the same operand.

The references quantize independently of amp_fx: tensorwise and rowwise from first principles
(torchao's scale formula in numpy float64/float32, e4m3/e5m2's rounding by torch's cast), MXFP8
with torchao's ``to_mx`` (RCEIL), blockwise with torchao's torch references
(``torch_blockwise_scale_act_quant_lhs``, ``torch_blockwise_scale_weight_quant``), NVFP4 with
TransformerEngine's reference chain (``tests/fp8/_te_nvfp4_reference.py``). Counts, amax and
scales must be equal; the two sums of squares equal up to float64 summation order.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from amp_fx.fp8 import Fp8Recipe, Nvfp4Options
from amp_fx.kernels.fp8_recipes import RECIPES, Cast
from amp_fx.kernels.quant_stats import FIGURES, quant_stats, stats_dict, te_stats
from amp_fx.testing.fp8_reference import torchao_missing
from tests.fp8 import _te_nvfp4_reference as te

# (operand, gemm, shape): awkward sizes (200 and 40 are multiples of none of 16, 32, 128 except 40 of 8)
CASES = [
    ("input", "output", (2, 20, 200)),
    ("input", "grad_weight", (2, 20, 200)),
    ("weight", "output", (200, 72)),
    ("weight", "grad_input", (200, 72)),
    ("grad_output", "grad_input", (40, 200)),
    ("grad_output", "grad_weight", (40, 200)),
]
_SLACK = 1.0 + 2.0**-22  # the module's allowance for the scale's fp32 rounding (its _SCALE_ROUNDING)


class Reference(NamedTuple):
    hp: np.ndarray
    """float64 [R, C]: the values quantized (the module's ``hp``; transformed under NVFP4's RHT)."""
    seen: np.ndarray
    """float64 [R, C]: what the quantizer received (bf16 cast for MXFP8 and NVFP4)."""
    dq: np.ndarray
    """float64 [R, C]: each code's value."""
    decode: np.ndarray
    """float64 [R, C]: each element's decode scale."""
    block_decode: np.ndarray
    """float64 [blocks]: each block's decode scale."""
    block_amax: np.ndarray
    """float64 [blocks]: each block's amax (of ``seen``)."""
    max: float


def _layout(t: torch.Tensor, operand: str, gemm: str) -> torch.Tensor:
    if operand == "weight":
        return t.t() if gemm == "output" else t
    rows = t.reshape(-1, t.shape[-1])
    return rows.t() if gemm == "grad_weight" else rows


def _blocks(a: np.ndarray, tr: int, tc: int) -> np.ndarray:
    """``a`` [R, C] cut into tr x tc blocks (zero-padded): [blocks, tr * tc]."""
    r, c = a.shape
    p = np.pad(a, ((0, -r % tr), (0, -c % tc)))
    return p.reshape(p.shape[0] // tr, tr, p.shape[1] // tc, tc).transpose(0, 2, 1, 3).reshape(-1, tr * tc)


def _per_block(values: np.ndarray, tr: int, tc: int, shape: tuple[int, int]) -> np.ndarray:
    """One value per block, as [R, C] (each element its block's)."""
    r, c = shape
    nr, nc = -(-r // tr), -(-c // tc)
    return np.repeat(np.repeat(values.reshape(nr, nc), tr, 0), tc, 1)[:r, :c]


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().to(torch.float64).cpu().numpy()


def _cast(recipe: Fp8Recipe, operand: str, gemm: str) -> Cast:
    return RECIPES[recipe].cast_in(operand, gemm)


def _ref_float8(t: torch.Tensor, recipe: Fp8Recipe, operand: str, gemm: str) -> Reference | None:
    """torchao's float8 cast from first principles: ``scale = f32(max / max(amax, 1e-12))`` in
    float64 (rowwise: per row, rounded down to a power of two), ``f32(hp) * scale`` in float32,
    clamped, rounded to the format by torch's cast; decoded by ``f32(1 / scale)``."""
    c = RECIPES[recipe]
    cast = _cast(recipe, operand, gemm)
    if cast.dtype is None:
        return None
    hp = _np(t)
    fmax = float(torch.finfo(cast.dtype).max)
    amax = np.abs(hp).max(axis=1, keepdims=True) if cast.rowwise else np.abs(hp).max(keepdims=True)
    scale = (fmax / np.maximum(amax, 1e-12)).astype(np.float32)
    if c.round_scales_to_power_of_2:
        scale = np.exp2(np.floor(np.log2(scale))).astype(np.float32)
    scaled = np.clip(hp.astype(np.float32) * scale, -fmax, fmax)
    codes = torch.from_numpy(scaled).to(cast.dtype).to(torch.float64).numpy()
    inverse = (np.float32(1.0) / scale).astype(np.float64)
    return Reference(hp, hp, codes * inverse, np.broadcast_to(inverse, hp.shape), inverse.ravel(), amax.ravel(), fmax)


def _ref_mxfp8(t: torch.Tensor) -> Reference:
    """torchao ``to_mx(bf16, e4m3, 32, RCEIL)`` of the operand padded to 32 columns."""
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.prototype.mx_formats.mx_tensor import to_mx

    seen = t.to(torch.bfloat16)
    r, c = seen.shape
    scale, data = to_mx(F.pad(seen, (0, -c % 32)).contiguous(), torch.float8_e4m3fn, 32, ScaleCalculationMode.RCEIL)
    decode = np.exp2(scale.view(torch.uint8).numpy().astype(np.float64) - 127)  # e8m0: 2**(e - 127)
    dq = (_np(data).reshape(r, -1, 32) * decode[..., None]).reshape(r, -1)[:, :c]
    s = _np(seen)
    return Reference(
        _np(t), s, dq, _per_block(decode, 1, 32, (r, c)), decode.ravel(), np.abs(_blocks(s, 1, 32)).max(1), 448.0
    )


def _ref_blockwise(t: torch.Tensor, tiles: bool) -> Reference:
    """torchao's torch references of the 1x128 and 128x128 quantizers, on the operand zero-padded to 128."""
    from torchao.prototype.blockwise_fp8_training import kernels as k

    r, c = t.shape
    padded = F.pad(t, (0, -c % 128, 0, -r % 128 if tiles else 0)).contiguous()
    if tiles:
        data, inv = k.torch_blockwise_scale_weight_quant(padded, 128)
        decode = _np(inv)
        per_element = np.repeat(np.repeat(decode, 128, 0), 128, 1)
    else:
        data, inv = k.torch_blockwise_scale_act_quant_lhs(padded, 128)
        decode = _np(inv)
        per_element = np.repeat(decode, 128, 1)
    dq = (_np(data) * per_element)[:r, :c]
    hp = _np(t)
    tr = 128 if tiles else 1
    return Reference(hp, hp, dq, per_element[:r, :c], decode.ravel(), np.abs(_blocks(hp, tr, 128)).max(1), 448.0)


def _ref_nvfp4(t: torch.Tensor, operand: str, gemm: str, options: Nvfp4Options) -> Reference:
    """TransformerEngine's reference quantizer (round to nearest even); the tensor's decode is
    ``amax / (448 * 6)``, as TE's GEMM applies ``alpha = amax_a * amax_b / (448 * 6)**2``."""
    seen = t.to(torch.bfloat16)
    tile = (16, 16) if operand == "weight" and options.weight_2d else (1, 16)
    if gemm == "grad_weight" and options.rht:
        # TE transforms the column-wise copy: quantize the transpose, take that copy
        # TE asks for a multiple of 16 along the transformed dimension: pad it with zeros first
        padded = F.pad(seen, (0, -seen.shape[1] % 16)).contiguous()
        _, _, qx, sx, _, amax = te.quantize(padded.t().contiguous(), tile, with_rht=True)
        seen = te.apply_rht(padded, tile)
        hp = _np(seen)
    else:
        qx, sx, _, _, amax, _ = te.quantize(seen, tile)
        hp = _np(t)
    r, c = seen.shape
    tensor_decode = float(amax.to(torch.float64)) / 2688.0
    codes = _np(te.cast_from_fp4x2(qx, torch.float32))
    block = _np(sx.to(torch.float32))  # [R', C'/16], a tile's scale on each of its rows
    per_element = np.repeat(block, 16, 1)[:r, :c] * tensor_decode
    dq = codes[:, :c] * per_element
    block_decode = block[:: tile[0]][: -(-r // tile[0])].ravel() * tensor_decode
    s = _np(seen)
    return Reference(hp, s, dq, per_element, block_decode, np.abs(_blocks(s, *tile)).max(1), 6.0)


def _reference(t: torch.Tensor, recipe: Fp8Recipe, operand: str, gemm: str, options: Nvfp4Options) -> Reference | None:
    if recipe is Fp8Recipe.MXFP8:
        return _ref_mxfp8(t)
    if recipe is Fp8Recipe.BLOCKWISE:
        return _ref_blockwise(t, tiles=operand == "weight")
    if recipe is Fp8Recipe.NVFP4:
        return _ref_nvfp4(t, operand, gemm, options)
    return _ref_float8(t, recipe, operand, gemm)


def _expected(ref: Reference) -> dict[str, float]:
    live = ref.block_amax > 0
    scales = np.sort(ref.block_decode[live])
    nonzero = ref.seen != 0
    return {
        "numel": float(ref.hp.size),
        "nonzero": float(np.count_nonzero(nonzero)),
        "underflow": float(np.count_nonzero(nonzero & (ref.dq == 0))),
        "saturated": float(np.count_nonzero(np.abs(ref.seen) > ref.max * ref.decode * _SLACK)),
        "amax": float(np.abs(ref.seen).max()),
        "blocks": float(ref.block_decode.size),
        "zero_blocks": float(np.count_nonzero(~live)),
        "scale_inv_min": float(scales[0]) if scales.size else math.nan,
        "scale_inv_max": float(scales[-1]) if scales.size else math.nan,
        "scale_inv_median": float(scales[(scales.size - 1) // 2]) if scales.size else math.nan,
        "err_sq_sum": float(np.square(ref.dq - ref.hp).sum()),
        "hp_sq_sum": float(np.square(ref.hp).sum()),
    }


def _check(
    hp: torch.Tensor, recipe: Fp8Recipe, operand: str, gemm: str, options: Nvfp4Options | None = None
) -> dict[str, float]:
    options = options or Nvfp4Options()
    got = stats_dict(quant_stats(hp, recipe, operand, gemm=gemm, nvfp4=options))
    assert list(got) == list(FIGURES)
    ref = _reference(_layout(hp, operand, gemm), recipe, operand, gemm, options)
    if ref is None:  # kept in high precision by the recipe: nothing quantized
        hp64 = _np(hp)
        assert got["numel"] == hp64.size and got["nonzero"] == np.count_nonzero(hp64)
        assert got["underflow"] == got["saturated"] == got["err_sq_sum"] == got["blocks"] == 0
        assert math.isnan(got["scale_inv_min"]) and math.isnan(got["scale_inv_median"])
        return got
    want = _expected(ref)
    for name in ("numel", "nonzero", "underflow", "saturated", "amax", "blocks", "zero_blocks"):
        assert got[name] == want[name], (name, got[name], want[name])
    for name in ("scale_inv_min", "scale_inv_max", "scale_inv_median"):
        assert got[name] == want[name] or (math.isnan(got[name]) and math.isnan(want[name])), (name, got, want)
    # float64 sums of the same terms in another order: a few ulps of the sum
    for name in ("err_sq_sum", "hp_sq_sum"):
        torch.testing.assert_close(got[name], want[name], rtol=1e-12, atol=0.0)
    return got


def _operand(shape: tuple[int, ...], operand: str, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(shape, generator=g)
    return t if operand == "weight" else t.to(torch.bfloat16)


def _needs_torchao(recipe: Fp8Recipe) -> None:
    if recipe in (Fp8Recipe.MXFP8, Fp8Recipe.BLOCKWISE) and (why := torchao_missing()) is not None:
        pytest.skip(f"the {recipe.value} reference is torchao's: {why}")


@pytest.mark.parametrize("recipe", list(Fp8Recipe), ids=lambda r: r.value)
@pytest.mark.parametrize(("operand", "gemm", "shape"), CASES, ids=[f"{o}-{g}" for o, g, _ in CASES])
def test_figures_match_reference(recipe: Fp8Recipe, operand: str, gemm: str, shape: tuple[int, ...]) -> None:
    _needs_torchao(recipe)
    _check(_operand(shape, operand), recipe, operand, gemm)


@pytest.mark.parametrize("recipe", list(Fp8Recipe), ids=lambda r: r.value)
@pytest.mark.parametrize(("operand", "gemm", "shape"), CASES, ids=[f"{o}-{g}" for o, g, _ in CASES])
def test_planted_underflow_and_zero_blocks(recipe: Fp8Recipe, operand: str, gemm: str, shape: tuple[int, ...]) -> None:
    """A few values 1e-7 of their block's amax flush to zero in every format (e2m1's least
    step is 1/12 of the block amax, e4m3's 2**-9 / 448, e5m2's 2**-16 / 57344); an all-zero
    region (a whole 128 x 128 tile of the weight, so every recipe's blocks there are zero)."""
    _needs_torchao(recipe)
    hp = _operand(shape, operand).clone()
    flat = hp.view(-1, hp.shape[-1])
    # the same 2x2 corner in either layout (the operand or its transpose): 4 with three values
    # 1e-12 of it, in the block of 4 whichever way the blocks run
    flat[:2, :2] = 4e-12
    flat[0, 0] = 4.0
    flat[5] = 0.0  # a zero row and column: a zero row in either layout, so zero blocks
    flat[:, 7] = 0.0
    if operand == "weight":
        flat[128:] = 0.0  # a 128 x 128 tile of w.t() (and of w) for blockwise's weight tiles
    got = _check(hp, recipe, operand, gemm)
    cast = _cast(recipe, operand, gemm)
    if cast.dtype is not None:
        assert got["underflow"] > 0, "the planted underflow is not seen"
        if cast.rowwise or cast.block or cast.tile:  # one block per tensor has no zero block here
            assert got["zero_blocks"] > 0, "the planted all-zero blocks are not seen"


def test_all_zero_tensor() -> None:
    for recipe in Fp8Recipe:
        got = stats_dict(quant_stats(torch.zeros(4, 40, dtype=torch.bfloat16), recipe, "input"))
        assert got["nonzero"] == got["underflow"] == got["err_sq_sum"] == 0, recipe
        assert got["zero_blocks"] == got["blocks"] > 0, recipe
        assert math.isnan(got["scale_inv_min"]) and math.isnan(got["scale_inv_max"]), recipe


def test_nvfp4_planted_saturation() -> None:
    """NVFP4 rounds a block's scale to the nearest e4m3: a block whose amax times ``448 / amax``
    (the tensor's amax 1 elsewhere) is 247 gets the scale 240 (e4m3's neighbours 240 and 256),
    so its amax scales to 6 * 247 / 240 > 6 and is clipped. The other recipes scale from the amax
    exactly: the same tensor saturates nothing."""
    x = torch.full((4, 32), 0.01)
    x[0, 0] = 1.0
    x[1, 16] = 247.0 / 448.0
    x = x.to(torch.bfloat16)
    assert float(x[1, 16]) * 448 > 240  # bf16 keeps it above the scale's neighbour
    got = _check(x, Fp8Recipe.NVFP4, "input", "output")
    assert got["saturated"] >= 1
    for recipe in (Fp8Recipe.TENSORWISE, Fp8Recipe.ROWWISE, Fp8Recipe.BLOCKWISE, Fp8Recipe.MXFP8):
        _needs_torchao(recipe)
        assert _check(x, recipe, "input", "output")["saturated"] == 0


@pytest.mark.parametrize("options", [Nvfp4Options(), Nvfp4Options(rht=False, weight_2d=False)], ids=["te", "no-rht-1d"])
def test_nvfp4_switches(options: Nvfp4Options) -> None:
    for operand, gemm, shape in CASES:
        _check(_operand(shape, operand, seed=1), Fp8Recipe.NVFP4, operand, gemm, options)


@pytest.mark.parametrize("recipe", list(Fp8Recipe), ids=lambda r: r.value)
def test_traces_without_graph_break(recipe: Fp8Recipe) -> None:
    """Under torch.compile (AOTAutograd, fullgraph: a graph break raises) the same figures as eager."""
    x = _operand((2, 20, 200), "input")
    w = _operand((200, 72), "weight")

    def stats(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.stack(
            [
                quant_stats(x, recipe, "input"),
                quant_stats(w, recipe, "weight"),
                quant_stats(x, recipe, "grad_output", gemm="grad_weight"),
            ]
        )

    compiled = torch.compile(stats, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(x, w), stats(x, w), rtol=0, atol=0, equal_nan=True)


def test_te_stats_names() -> None:
    x = _operand((8, 64), "input").clone()
    x[0, :4] = 1e-30
    stats = quant_stats(x, Fp8Recipe.TENSORWISE, "input")
    s, t = stats_dict(stats), te_stats(stats)
    assert set(t) == {"underflows%", "overflows%", "scale_inv_min", "scale_inv_max", "mse", "amax"}
    assert t["underflows%"] == 100.0 * s["underflow"] / s["numel"] > 0
    assert t["mse"] == s["err_sq_sum"] / s["numel"]


@pytest.mark.parametrize(
    ("operand", "gemm", "match"),
    [("bias", None, "operand must be"), ("input", "grad_input", "does not read"), ("weight", "sideways", "gemm must")],
)
def test_bad_arguments(operand: str, gemm: str | None, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        quant_stats(torch.ones(4, 4), Fp8Recipe.TENSORWISE, operand, gemm=gemm)
