"""Quantization statistics of one GEMM operand under any recipe amp_fx has (issue 64).

:func:`quant_stats` quantizes the operand with the recipe's own quantizer (the function the
GEMM's kernel calls: :mod:`~amp_fx.kernels.fp8_matmul`'s ``to_fp8``,
:func:`~amp_fx.kernels.blockwise_fp8.quantize_1x128`/``quantize_128x128``,
:mod:`~amp_fx.kernels.mxfp8_matmul`'s ``_to_mx``, :func:`~amp_fx.kernels.nvfp4.quantize`), takes
the exact value each code stands for (``code * decode scale``, in float64), and returns raw sums
as a 1-D float64 tensor, one entry per name of :data:`FIGURES`:

    numel             elements of the operand (padding excluded, except under NVFP4's Hadamard
                      transform: there the transformed, padded operand is what the GEMM reads)
    nonzero           elements != 0
    underflow         nonzero elements whose code is zero (flushed to zero)
    saturated         elements beyond the largest magnitude their block represents
                      (``|x| > max * decode``), so clipped to it (see below)
    amax              max |x|
    blocks            scale blocks holding an element of the operand (a padding-only block is
                      not counted); 1 for a tensorwise scale, one per row for rowwise
    zero_blocks       those blocks whose elements are all zero
    scale_inv_min     min, over the blocks with a nonzero element, of the decode scale (what the
    scale_inv_max     GEMM multiplies a code by: TransformerEngine's ``scale_inv``); max;
    scale_inv_median  lower median (``torch.nanmedian``). NaN where no block has a nonzero element
                      (an all-zero block's scale is a floor artifact: 1e-12 / 448, or e8m0's least)
    err_sq_sum        sum of (dequantized - hp)**2
    hp_sq_sum         sum of hp**2: relative MSE = err_sq_sum / hp_sq_sum

``x`` is what the quantizer receives (the operand; its bf16 cast for MXFP8 and NVFP4, which
quantize bf16 operands): the counts, amax and blocks are of ``x``, the error is against ``hp``, the
operand given (so an fp32 master weight's bf16 rounding is part of MXFP8's and NVFP4's error).

Sums, not fractions, so that a fraction computed on read (in float64) is exact and figures of
several steps or ranks add up. All in ATen ops on the operand's device, no host read: the function
traces under ``torch.compile(fullgraph=True)`` and AOTAutograd.

**Saturation.** A value is counted when it exceeds ``max * decode`` by more than the fp32
rounding of the scale (a factor ``1 + 2**-22``: the scale's chain rounds at most four times,
each by at most ``2**-24``). Where the scale is computed from the amax exactly, no value can:
tensorwise, rowwise and blockwise scale to ``max / amax`` (rowwise rounded down to a power of
two), and MXFP8's RCEIL rounds its exponent *up*; their count is 0 by construction (the amax
element may land one fp32 ulp above the max, a clip of ``2**-23`` relative, not counted). Only
NVFP4 rounds its block scale to the nearest e4m3 value, so a block's amax can scale up to
``6 * (1 + 1/16)`` and be clipped to 6.

**Which GEMM.** An operand is read by two GEMMs, quantized along each one's inner dimension
(rowwise along different axes, MXFP8 along K or along the tokens, NVFP4 with the Hadamard
transform on the weight-gradient GEMM). ``gemm`` names the one: ``"output"`` (``x @ w``),
``"grad_input"`` (``g @ w.T``) or ``"grad_weight"`` (``x.T @ g``); by default the first GEMM that
reads the operand (``"output"`` for input and weight, ``"grad_input"`` for grad_output). Where the
recipe keeps the operand in high precision in that GEMM (``rowwise_with_gw_hp``'s weight
gradient), nothing is quantized: underflow, saturation and error are 0 and the scale figures NaN.

**Operands, in the layouts the fp8 matmul receives them** (``fp8_matmul(x, w)``): ``input``
``[..., K]``, ``weight`` ``[K, N]`` (the transposed module weight), ``grad_output`` ``[..., N]``.
Grouped experts' 3-D weights: one expert's weight at a time.

**NVFP4's stochastic rounding** (the gradient's, ``Nvfp4Options.stochastic_rounding``) is
replaced by round-to-nearest-even here: a draw would consume the training's random stream, and
its figures are one sample. The scales, amax and saturation are the GEMM's (rounding comes
after them); underflow and error are those of round to nearest.

Example (a planted underflow: one value 1e6 times smaller than the amax, tensorwise e4m3):
    >>> import torch
    >>> from amp_fx.fp8 import Fp8Recipe
    >>> x = torch.tensor([[1.0, -0.5, 1e-6, 0.0]])
    >>> s = stats_dict(quant_stats(x, Fp8Recipe.TENSORWISE, "input"))
    >>> s["numel"], s["nonzero"], s["underflow"], s["saturated"]
    (4.0, 3.0, 1.0, 0.0)
    >>> te_stats(quant_stats(x, Fp8Recipe.TENSORWISE, "input"))["underflows%"]
    25.0
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from amp_fx._common.pad import pad_to_multiples
from amp_fx.fp8 import Fp8Recipe, Nvfp4Options
from amp_fx.kernels import blockwise_fp8 as _bw
from amp_fx.kernels import mxfp8_matmul as _mx
from amp_fx.kernels import nvfp4 as _nv
from amp_fx.kernels.fp8_matmul import Fp8Operand, to_fp8
from amp_fx.kernels.fp8_recipes import RECIPES, Cast

__all__ = ["FIGURES", "OPERANDS", "GEMMS", "quant_stats", "stats_dict", "te_stats"]

FIGURES: tuple[str, ...] = (
    "numel",
    "nonzero",
    "underflow",
    "saturated",
    "amax",
    "blocks",
    "zero_blocks",
    "scale_inv_min",
    "scale_inv_max",
    "scale_inv_median",
    "err_sq_sum",
    "hp_sq_sum",
)
"""The entries of :func:`quant_stats`'s vector, in order (module doc)."""

OPERANDS = ("input", "weight", "grad_output")
GEMMS = ("output", "grad_input", "grad_weight")
_READS = {
    "output": ("input", "weight"),
    "grad_input": ("grad_output", "weight"),
    "grad_weight": ("input", "grad_output"),
}
_DEFAULT_GEMM = {"input": "output", "weight": "output", "grad_output": "grad_input"}

_SCALE_ROUNDING = 2.0**-22
"""Slack on ``max * decode`` before a value counts as saturated: the scale's fp32 chain (NVFP4's
``S_enc``, ``1 / S_enc``, the product with the block scale, its reciprocal) rounds at most four
times, each by at most ``2**-24`` relative, so ``(1 + 2**-24)**4 < 1 + 2**-22``."""


class _Quantized(NamedTuple):
    """An operand as its GEMM reads it, blocked along its last dimension."""

    hp: torch.Tensor
    """The operand, 2-D ``[R, C]`` (maybe transposed, or Hadamard-transformed), in its own dtype:
    the values the error is measured against (MXFP8 and NVFP4 quantize its bf16 cast)."""
    seen: torch.Tensor
    """What the quantizer received, ``[R, C]``: ``hp``, or its bf16 cast (MXFP8, NVFP4). The
    counts, amax and blocks are of these values; the error is against ``hp``."""
    dq: torch.Tensor
    """float64 ``[R, C]``: the value of each element's code (``code * decode``, exact)."""
    decode: torch.Tensor
    """float64 ``[ceil(R / tile_rows), ceil(C / tile_cols)]``: each block's decode scale."""
    tile_rows: int
    tile_cols: int
    max: float
    """The element format's largest magnitude."""


def _check(recipe: Fp8Recipe, operand: str, gemm: str | None) -> str:
    if not isinstance(recipe, Fp8Recipe):
        raise TypeError(f"amp_fx: quant_stats: recipe must be an amp_fx.Fp8Recipe, got {recipe!r}")
    if operand not in OPERANDS:
        raise ValueError(f"amp_fx: quant_stats: operand must be one of {list(OPERANDS)}, got {operand!r}")
    gemm = _DEFAULT_GEMM[operand] if gemm is None else gemm
    if gemm not in GEMMS:
        raise ValueError(f"amp_fx: quant_stats: gemm must be one of {list(GEMMS)}, got {gemm!r}")
    if operand not in _READS[gemm]:
        raise ValueError(
            f"amp_fx: quant_stats: the {gemm} GEMM does not read the {operand} (it reads {' and '.join(_READS[gemm])})"
        )
    return gemm


def _layout(hp: torch.Tensor, operand: str, gemm: str) -> torch.Tensor:
    """The operand 2-D, blocked along the GEMM's inner dimension (its last): ``x``/``g`` as
    ``[tokens, features]`` or its transpose for the weight gradient; ``w`` (``[K, N]``) as ``[N, K]``
    in the output GEMM, as it is in the input-gradient one."""
    if operand == "weight":
        if hp.dim() != 2:
            raise ValueError(
                f"amp_fx: quant_stats: a weight is 2-D [K, N], got shape {tuple(hp.shape)} "
                f"(grouped experts' 3-D weights: pass one expert's weight)"
            )
        return hp.t() if gemm == "output" else hp
    rows = hp.reshape(-1, hp.shape[-1])
    return rows.t() if gemm == "grad_weight" else rows


_CASTS = {(r, o, g): c.cast_in(o, g) for r, c in RECIPES.items() for g, operands in _READS.items() for o in operands}
"""Each (recipe, operand, gemm)'s cast, read from :data:`RECIPES` once: a plain dict, which Dynamo
reads where it cannot read the ``MappingProxyType`` (its keys are enum members)."""
_POW2 = {recipe: c.round_scales_to_power_of_2 for recipe, c in RECIPES.items()}


def _float8(t: torch.Tensor, recipe: Fp8Recipe, cast: Cast) -> _Quantized | None:
    """Tensorwise and rowwise: ``fp8_matmul``'s ``to_fp8`` of ``t`` scaled along its last
    dimension (rowwise), decoded with the fp32 reciprocal the GEMM passes ``_scaled_mm``."""
    if cast.dtype is None:
        return None
    a = to_fp8(t, cast, -1, _POW2[recipe])
    assert isinstance(a, Fp8Operand)
    inverse = a.scale.reciprocal().to(torch.float64)
    decode = inverse.reshape(-1, 1) if cast.rowwise else inverse.reshape(1, 1)
    tile_rows = 1 if cast.rowwise else max(t.shape[0], 1)
    dq = a.data.to(torch.float64) * (inverse if cast.rowwise else decode)
    return _Quantized(t, t, dq, decode, tile_rows, max(t.shape[1], 1), torch.finfo(cast.dtype).max)


def _mxfp8(t: torch.Tensor) -> _Quantized:
    """``mxfp8_matmul``'s ``_to_mx`` of ``t`` (bf16), one e8m0 scale per 32 along the last dimension."""
    seen = t.to(torch.bfloat16)
    a = _mx._to_mx(seen)
    rows, cols = t.shape
    decode = torch.exp2(a.scale.to(torch.float64) - _mx._E8M0_BIAS)
    decode = torch.where(a.scale == _mx._E8M0_NAN, torch.full_like(decode, float("nan")), decode)
    dq = (a.data.to(torch.float64).reshape(rows, -1, _mx.BLOCK) * decode.unsqueeze(-1)).reshape(rows, -1)
    return _Quantized(t, seen, dq[:, :cols], decode, 1, _mx.BLOCK, _mx._E4M3_MAX)


def _blockwise(t: torch.Tensor, tiles: bool) -> _Quantized:
    """``quantize_128x128`` (the weight's tiles) or ``quantize_1x128`` of ``t``."""
    b = _bw.quantize_128x128(t) if tiles else _bw.quantize_1x128(t)
    rows, cols = t.shape
    decode = b.inv_scale.to(torch.float64)
    inv = decode.repeat_interleave(_bw.BLOCK, dim=-1)
    if tiles:
        inv = inv.repeat_interleave(_bw.BLOCK, dim=0)
    dq = (b.data.to(torch.float64) * inv)[:rows, :cols]
    return _Quantized(t, t, dq, decode, _bw.BLOCK if tiles else 1, _bw.BLOCK, _bw._E4M3_MAX)


def _nvfp4(t: torch.Tensor, operand: str, gemm: str, options: Nvfp4Options) -> _Quantized:
    """``nvfp4.quantize`` of ``t`` (bf16) as the GEMM quantizes it (16x16 weight tiles where
    ``weight_2d``, the Hadamard transform on the weight gradient's operands where ``rht``), rounded
    to nearest even (module doc)."""
    tile_rows = _nv.BLOCK if operand == "weight" and options.weight_2d else 1
    seen = t.to(torch.bfloat16)
    if gemm == "grad_weight" and options.rht:
        t = seen = _nv.rht(seen)  # the operand the GEMM quantizes (quantize(hadamard=True)'s first step)
    q = _nv.quantize(seen, tile_rows=tile_rows)
    rows, cols = t.shape
    tensor_decode = q.amax.to(torch.float64) / 2688.0  # 448 * 6: the decode of S_enc
    dq = _nv._unpack(q).to(torch.float64)[:, :cols] * tensor_decode
    decode = q.scale[::tile_rows].to(torch.float64) * tensor_decode
    return _Quantized(t, seen, dq, decode, tile_rows, _nv.BLOCK, _nv._E2M1_MAX)


def _quantized(
    t: torch.Tensor, recipe: Fp8Recipe, operand: str, gemm: str, nvfp4: Nvfp4Options | None
) -> _Quantized | None:
    if recipe is Fp8Recipe.MXFP8:
        return _mxfp8(t)
    if recipe is Fp8Recipe.BLOCKWISE:
        return _blockwise(t, tiles=operand == "weight")
    if recipe is Fp8Recipe.NVFP4:
        return _nvfp4(t, operand, gemm, nvfp4 if nvfp4 is not None else Nvfp4Options())
    return _float8(t, recipe, _CASTS[recipe, operand, gemm])


def _figures(q: _Quantized) -> torch.Tensor:
    hp, seen = q.hp.to(torch.float64), q.seen.to(torch.float64)
    rows, cols = hp.shape
    magnitude = seen.abs()
    nonzero = seen != 0
    decode = q.decode.repeat_interleave(q.tile_rows, dim=0)[:rows].repeat_interleave(q.tile_cols, dim=1)[:, :cols]
    saturated = magnitude > decode * (q.max * (1.0 + _SCALE_ROUNDING))
    block_amax = pad_to_multiples(magnitude, rows=q.tile_rows, cols=q.tile_cols)
    block_amax = block_amax.reshape(q.decode.shape[0], q.tile_rows, q.decode.shape[1], q.tile_cols).amax(dim=(1, 3))
    live = block_amax > 0
    inf = torch.full_like(q.decode, float("inf"))
    scale_min = torch.where(live, q.decode, inf).amin()
    scale_max = torch.where(live, q.decode, -inf).amax()
    none = torch.full_like(scale_min, float("nan"))
    any_live = live.any()
    return torch.stack(
        [
            hp.new_full((), float(hp.numel())),
            nonzero.sum().to(torch.float64),
            (nonzero & (q.dq == 0)).sum().to(torch.float64),
            saturated.sum().to(torch.float64),
            block_amax.amax(),
            hp.new_full((), float(q.decode.numel())),
            (~live).sum().to(torch.float64),
            torch.where(any_live, scale_min, none),
            torch.where(any_live, scale_max, none),
            torch.nanmedian(torch.where(live, q.decode, torch.full_like(q.decode, float("nan"))).flatten()),
            (q.dq - hp).square().sum(),
            hp.square().sum(),
        ]
    )


def _unquantized(t: torch.Tensor) -> torch.Tensor:
    """Figures of an operand its GEMM reads in high precision: no error, no scale."""
    hp = t.to(torch.float64)
    zero = hp.new_zeros(())
    nan = hp.new_full((), float("nan"))
    amax = hp.abs().amax() if hp.numel() else zero
    nonzero = (hp != 0).sum().to(torch.float64)
    return torch.stack(
        [
            hp.new_full((), float(hp.numel())),
            nonzero,
            zero,
            zero,
            amax,
            zero,
            zero,
            nan,
            nan,
            nan,
            zero,
            hp.square().sum(),
        ]
    )


def quant_stats(
    hp: torch.Tensor,
    recipe: Fp8Recipe,
    operand: str,
    *,
    gemm: str | None = None,
    nvfp4: Nvfp4Options | None = None,
) -> torch.Tensor:
    """The quantization statistics of one GEMM operand (module doc): 1-D float64 on ``hp``'s
    device, ``len(FIGURES)`` entries, in :data:`FIGURES`' order.

    Args:
        hp: the high-precision operand as the fp8 matmul receives it: ``input`` ``[..., K]``,
            ``weight`` ``[K, N]``, ``grad_output`` ``[..., N]``.
        recipe: the recipe whose quantization is measured (one in use, or another: "what if").
        operand: ``"input"``, ``"weight"`` or ``"grad_output"``.
        gemm: ``"output"``, ``"grad_input"`` or ``"grad_weight"``: the GEMM whose quantization of
            the operand is measured; default: the first GEMM that reads it (module doc).
        nvfp4: NVFP4's switches (default ``Nvfp4Options()``); read only by ``Fp8Recipe.NVFP4``.
    """
    gemm = _check(recipe, operand, gemm)
    with torch.no_grad(), torch.autocast(hp.device.type, enabled=False):
        t = _layout(hp.detach(), operand, gemm)
        q = _quantized(t, recipe, operand, gemm, nvfp4)
        return _unquantized(t) if q is None else _figures(q)


def stats_dict(stats: torch.Tensor) -> dict[str, float]:
    """:func:`quant_stats`'s vector as ``{figure: value}`` (one host read)."""
    return dict(zip(FIGURES, stats.detach().to("cpu", torch.float64).tolist(), strict=True))


def te_stats(stats: torch.Tensor) -> dict[str, float]:
    """The figures TransformerEngine's debug features (``LogFp8TensorStats``) also log, under its
    names, so that dashboards carry over: ``underflows%`` (nonzero values flushed to zero, per
    cent of all elements), ``overflows%`` (saturated values, per cent of all elements),
    ``scale_inv_min``, ``scale_inv_max``, ``mse`` (mean squared quantization error) and ``amax``.
    One host read; computed in float64."""
    s = stats_dict(stats)
    numel = s["numel"]
    share = 100.0 / numel if numel else float("nan")
    return {
        "underflows%": s["underflow"] * share,
        "overflows%": s["saturated"] * share,
        "scale_inv_min": s["scale_inv_min"],
        "scale_inv_max": s["scale_inv_max"],
        "mse": s["err_sq_sum"] / numel if numel else float("nan"),
        "amax": s["amax"],
    }
