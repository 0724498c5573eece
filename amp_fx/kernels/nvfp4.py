"""The NVFP4 matmul of ``fp8="nvfp4"``: TransformerEngine's ``NVFP4BlockScaling`` training recipe in plain torch.

NVFP4: e2m1 elements (magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6), one e4m3 scale per block of
:data:`BLOCK` = 16 consecutive elements along the GEMM's inner dimension, and one fp32 scale per
tensor. The chain is TransformerEngine's (``transformer_engine/common/cast/nvfp4/core_nvfp4.cuh``
and its Python reference ``transformer_engine/pytorch/custom_recipes/reference_nvfp4.py``):

    S_enc  = min(448 * 6 / amax, FLT_MAX), 1 where amax or S_enc is 0     (fp32, per tensor)
    s_blk  = e4m3(min(block_amax * (S_enc * (1/6)), 448))                 (one rounding, no floor)
    encode = min(1 / (f32(s_blk) * (1 / S_enc)), FLT_MAX)
    q      = e2m1(clamp(x * encode, -6, 6))                               (RTNE, or stochastic)

A value decodes as ``e2m1(q) * s_blk * amax / 2688``; a GEMM of two NVFP4 operands multiplies
the exact products ``e2m1 * s_blk`` and applies ``alpha = amax_a * amax_b / 2688**2`` to the
fp32 result, as TE's GEMM does. The three GEMMs of ``out = x @ w`` (``w`` as ``[K, N]``):

    out    = x   @ w      x 1x16 along K, RTNE;  w 16x16 tiles (``weight_2d``), RTNE
    grad_x = g   @ w.T    g 1x16 along N, stochastic rounding;  w 16x16 tiles (the same tiles)
    grad_w = x.T @ g      x and g 1x16 along M (the tokens) after the random Hadamard transform
                          (``rht``); g with stochastic rounding

which is TE's ``NVFP4BlockScaling`` (``fp4_quant_fwd_inp``, ``fp4_quant_fwd_weight``,
``fp4_quant_bwd_grad``): the Hadamard transform on the column-wise (wgrad) copies only, stochastic
rounding on the gradient only. Each switch is a field of :class:`~amp_fx.fp8.Nvfp4Options`, as TE's
``disable_rht``, ``disable_stochastic_rounding`` and ``disable_2d_quantization`` are.

The random Hadamard transform (TE's ``_apply_rht``): each block of 16 along the transformed
dimension times ``diag(s) @ H16 / 4`` (Sylvester's H16, TE's fixed signs :data:`RHT_SIGNS`), the
result rounded to the operand's dtype; orthogonal, so ``(x H)(g H).T = x g.T`` before rounding.

Stochastic rounding: a magnitude between two neighbours ``lo < a < hi`` of the e2m1 grid rounds
up with probability ``(a - lo) / (hi - lo)``, from ``torch.rand`` on the operand's device (no host
sync), with the ``generator`` given, else the default one (``torch.manual_seed`` reproduces it).
Unbiased; not TE's Philox stream, so not bitwise with TE's kernels (nothing is: the hardware
instruction rounds with its own random bits).

Where the GEMM runs: emulated on every device without fp4 tensor cores (every machine amp_fx is
tested on): the operands dequantized to fp32 (``e2m1 * s_blk``, exact), ``torch.mm`` in fp32,
times ``alpha``, cast to the output dtype: NVFP4's numerics at fp32 matmul speed. On a Blackwell
GPU (compute capability 10.0+), ``torch._scaled_mm``'s fp4 path (``float4_e2m1fn_x2`` data, e4m3
block scales in cuBLAS's blocked layout): **untested here** (no such GPU).

Every shape: each operand is zero-padded along its blocked dimension to a multiple of 16 (and
the weight's rows to 16 for its tiles); zeros never raise a block's amax, and an all-zero block
gets scale 0 and zero data.

Example (a [32, 64] x [64, 48] matmul in NVFP4, emulated):
    >>> import torch
    >>> x = torch.randn(32, 64, dtype=torch.bfloat16, requires_grad=True)
    >>> w = torch.randn(64, 48, dtype=torch.bfloat16, requires_grad=True)
    >>> out = nvfp4_matmul(x, w, options=Nvfp4Options())
    >>> out.dtype, out.shape
    (torch.bfloat16, torch.Size([32, 48]))
    >>> out.float().sum().backward()
    >>> x.grad.shape, w.grad.shape
    (torch.Size([32, 64]), torch.Size([64, 48]))
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import torch

from amp_fx._common.matmul_output import matmul_output
from amp_fx._common.pad import pad_to_multiples
from amp_fx.fp8 import Nvfp4Options
from amp_fx.kernels.fp8_support import KernelNeed, kernels_missing
from amp_fx.kernels.mxfp8_matmul import to_blocked

__all__ = [
    "BLOCK",
    "RHT_SIGNS",
    "Nvfp4Tensor",
    "quantize",
    "dequantize",
    "rht",
    "nvfp4_matmul",
    "nvfp4_grouped_mm",
    "nvfp4_linear_cached_weight",
    "weight_casts",
    "fp4_kernels_missing",
]

BLOCK = 16
"""Elements per e4m3 block scale (NVFP4's block; the weight's tiles are BLOCK x BLOCK)."""

RHT_SIGNS = (1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1)
"""TransformerEngine's fixed random signs of the 16x16 Hadamard transform (``get_wgrad_sign_vector``)."""

_E2M1_MAX = 6.0
_E4M3_MAX = 448.0
_FLT_MAX = torch.finfo(torch.float32).max
_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


class Nvfp4Tensor(NamedTuple):
    """A 2-D operand in NVFP4, blocked along its last dimension."""

    data: torch.Tensor
    """uint8 ``[rows, cols' // 2]``: two e2m1 codes per byte, the even element in the low nibble
    (``cols'``: the columns padded to a multiple of 16)."""
    scale: torch.Tensor
    """e4m3 ``[rows, cols' // 16]``: each block's decode scale (a 16x16 tile's, on each of its rows)."""
    amax: torch.Tensor
    """fp32 scalar: the tensor's amax (after the Hadamard transform where applied)."""


_KERNELS = KernelNeed(
    lacks="fp4 tensor cores",
    elsewhere=" (NVFP4 torch._scaled_mm needs a Blackwell GPU, sm_100+)",
    needs="NVFP4 torch._scaled_mm needs a Blackwell GPU (compute capability 10.0+, B200/GB200)",
    minimum=(10, 0),
    rocm="amp_fx runs NVFP4 on NVIDIA Blackwell GPUs only (this is a ROCm build)",
)


@functools.cache
def fp4_kernels_missing(device_type: str) -> str | None:
    """None where ``torch._scaled_mm`` runs NVFP4 on ``device_type``'s current device, else why not
    (then :func:`nvfp4_matmul` emulates it). Asked once per device type."""
    return kernels_missing(device_type, _KERNELS)


def _sylvester(size: int) -> list[list[float]]:
    """Sylvester's Hadamard matrix of ``size`` (a power of two), entries +-1."""
    h = [[1.0]]
    while len(h) < size:
        h = [row + row for row in h] + [row + [-v for v in row] for row in h]
    return h


_RHT = tuple(tuple(s * v * 0.25 for v in row) for s, row in zip(RHT_SIGNS, _sylvester(BLOCK)))
"""``diag(RHT_SIGNS) @ H16 / 4`` as numbers (entries +-1/4: exact in any float dtype). Made a tensor
per call: a tensor cached across calls would keep the first trace's fake or functional tensor."""


def rht(x: torch.Tensor) -> torch.Tensor:
    """The random Hadamard transform of ``x`` (2-D) along its last dimension, in blocks of 16 (zero-
    padded to a multiple of 16): products exact (entries +-1/4), summed in fp32, rounded to ``x``'s
    dtype (TE's reference multiplies in ``x``'s dtype: on this CPU a bf16 matmul flushes subnormal
    results to zero, this does not; ``tests/fp8/test_nvfp4.py``)."""
    x = pad_to_multiples(x, cols=BLOCK)
    rows, cols = x.shape
    out = x.float().reshape(-1, BLOCK) @ torch.tensor(_RHT, dtype=torch.float32, device=x.device)
    return out.reshape(rows, cols).to(x.dtype)


def _round_e2m1(a: torch.Tensor, generator: torch.Generator | None, stochastic: bool) -> torch.Tensor:
    """Magnitudes ``a`` in [0, 6] (fp32) rounded onto the e2m1 grid: to nearest, ties to the even
    code (``torch.round`` on the grid's spacing: 0.5 below 2, 1 below 4, 2 above, where an even
    multiple is an even code), or stochastically between the two neighbours."""
    # 0.5, 1, 2 from tensors only: a where of two Python scalars makes real tensors, which the
    # weight cache's fake-tensor pass (lift_weight_casts) refuses
    wide = (a >= 4).to(a.dtype) + 1.0
    step = torch.where(a < 2, wide * 0.5, wide)
    if not stochastic:
        return torch.round(a / step) * step
    lo = torch.floor(a / step) * step
    # torch.rand's own draw: uniform_ on an empty tensor, as torch.rand runs it; torch.rand with
    # a generator refuses a symbolic shape under AOTAutograd (the token count of experts under
    # expert parallelism, recompiled dynamic)
    draw = torch.empty_like(a, dtype=torch.float32, memory_format=torch.contiguous_format)
    up = draw.uniform_(0.0, 1.0, generator=generator) < (a - lo) / step
    return lo + step * up


def quantize(
    x: torch.Tensor,
    *,
    tile_rows: int = 1,
    hadamard: bool = False,
    stochastic: bool = False,
    generator: torch.Generator | None = None,
) -> Nvfp4Tensor:
    """``x`` (2-D, bf16/fp16/fp32) in NVFP4, blocked along its last dimension (module doc's chain).

    ``tile_rows``: 1 (1x16 blocks) or 16 (16x16 tiles, the weight's); ``hadamard``: transform
    along the last dimension first (:func:`rht`); ``stochastic``: stochastic rounding (with
    ``generator`` where given), else round to nearest even."""
    if x.dim() != 2:
        raise ValueError(f"amp_fx: NVFP4 quantizes 2-D tensors, got shape {tuple(x.shape)}")
    if tile_rows not in (1, BLOCK):
        raise ValueError(f"amp_fx: NVFP4 tiles are 1x16 or 16x16, got tile_rows={tile_rows}")
    with torch.autocast(x.device.type, enabled=False):  # its fp32 steps stay fp32 under autocast
        return _quantize(x, tile_rows, hadamard, stochastic, generator)


def _quantize(
    x: torch.Tensor, tile_rows: int, hadamard: bool, stochastic: bool, generator: torch.Generator | None
) -> Nvfp4Tensor:
    rows = x.shape[0]
    if hadamard:
        x = rht(x)
    amax = x.abs().amax().float() if x.numel() else x.new_zeros((), dtype=torch.float32)
    # 448 * 6 / amax, a correctly rounded division (``2688.0 / amax`` is torch's reciprocal times
    # 2688: two roundings, a different S_enc on some tensors); inf (amax 0) -> FLT_MAX
    s_enc = torch.clamp(torch.full_like(amax, 2688.0) / amax, max=_FLT_MAX)
    s_enc = torch.where((amax == 0) | (s_enc == 0), torch.ones_like(s_enc), s_enc)
    xp = pad_to_multiples(x, rows=tile_rows, cols=BLOCK).float()
    r, c = xp.shape
    blocks = xp.reshape(r // tile_rows, tile_rows, c // BLOCK, BLOCK)
    block_amax = blocks.abs().amax(dim=(1, 3), keepdim=True)
    s_blk = torch.clamp(block_amax * (s_enc * (1.0 / _E2M1_MAX)), max=_E4M3_MAX).to(torch.float8_e4m3fn)
    encode = torch.clamp(1.0 / (s_blk.float() * (1.0 / s_enc)), max=_FLT_MAX)
    scaled = torch.clamp(blocks * encode, -_E2M1_MAX, _E2M1_MAX).reshape(r, c)
    magnitude = _round_e2m1(scaled.abs(), generator, stochastic)
    # the grid's value to its code: 0..2 by 0.5 -> 0..4, 3 -> 5, 4 -> 6, 6 -> 7
    code = torch.where(magnitude <= 2, magnitude * 2, torch.where(magnitude <= 3, magnitude + 2, magnitude / 2 + 4))
    code = code.to(torch.uint8) | ((scaled < 0).to(torch.uint8) << 3)
    data = code[:rows, 0::2] | (code[:rows, 1::2] << 4)
    scale = s_blk.expand(-1, tile_rows, -1, -1).reshape(r, c // BLOCK)[:rows]
    return Nvfp4Tensor(data, scale, amax)


def _unpack(q: Nvfp4Tensor) -> torch.Tensor:
    """``e2m1 * s_blk`` of every element (fp32, exact), ``[rows, cols']``."""
    lut = torch.tensor(_E2M1_VALUES + tuple(-v for v in _E2M1_VALUES), dtype=torch.float32, device=q.data.device)
    codes = torch.stack([q.data & 0xF, q.data >> 4], dim=-1).reshape(q.data.shape[0], -1)
    values = lut[codes.long()]
    rows, cols = values.shape
    return (values.reshape(rows, cols // BLOCK, BLOCK) * q.scale.float().unsqueeze(-1)).reshape(rows, cols)


def dequantize(q: Nvfp4Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The values ``q`` stands for, ``e2m1 * s_blk * (amax / 2688)`` (computed in fp32), in
    ``dtype``, ``[rows, cols']`` (the padded columns are zeros)."""
    return (_unpack(q) * (q.amax / 2688.0)).to(dtype)


def _gemm(a: Nvfp4Tensor, b: Nvfp4Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """``a @ b.T``: ``a`` ``[R, I]`` and ``b`` ``[C, I]``, both blocked along ``I``; fp32 products
    of the block-scaled values times ``alpha = amax_a * amax_b / 2688**2``, in ``out_dtype``."""
    with torch.autocast(a.data.device.type, enabled=False):  # the fp32 GEMM stays fp32 under autocast
        return _gemm_fp32(a, b, out_dtype)


def _gemm_fp32(a: Nvfp4Tensor, b: Nvfp4Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    alpha = a.amax * b.amax / (2688.0 * 2688.0)
    if fp4_kernels_missing(a.data.device.type) is None:  # Blackwell: untested here (no such GPU)
        fp4 = torch.float4_e2m1fn_x2
        out = torch._scaled_mm(
            a.data.view(fp4),
            b.data.view(fp4).t(),
            to_blocked(a.scale.view(torch.uint8)).view(torch.float8_e4m3fn),
            to_blocked(b.scale.view(torch.uint8)).view(torch.float8_e4m3fn),
            out_dtype=torch.float32,
        )
    else:
        out = torch.mm(_unpack(a), _unpack(b).t())
    return (out * alpha).to(out_dtype)


def _weight(w_nk: torch.Tensor, options: Nvfp4Options) -> Nvfp4Tensor:
    return quantize(w_nk, tile_rows=BLOCK if options.weight_2d else 1)


def _backward(
    grad: torch.Tensor, x: torch.Tensor, w_kn: Nvfp4Tensor, options: Nvfp4Options, generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(grad_x, grad_w as [K, N])`` of ``x @ w`` (module doc's grad_x and grad_w GEMMs), given
    ``w_kn``, the weight as ``[K, N]`` quantized along N."""
    grad_2d = grad.contiguous().reshape(-1, grad.shape[-1])
    x_2d = x.reshape(-1, x.shape[-1])
    sr = options.stochastic_rounding
    g = quantize(grad_2d, stochastic=sr, generator=generator)  # along N
    grad_x = _gemm(g, w_kn, grad.dtype)[:, : x.shape[-1]]
    grad_x = grad_x.reshape(*grad.shape[:-1], x.shape[-1])
    g_t = quantize(grad_2d.t(), hadamard=options.rht, stochastic=sr, generator=generator)  # [N, M] along M
    x_t = quantize(x_2d.t(), hadamard=options.rht)  # [K, M] along M
    grad_w = _gemm(g_t, x_t, grad.dtype)  # [N, K]
    return grad_x, grad_w.t()


class _Nvfp4Matmul(torch.autograd.Function):
    """``x @ w`` in NVFP4: the high-precision operands saved, each quantized where its GEMM needs it
    (as TE's reference quantizes the tensor and its transpose from the high-precision values)."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, w: torch.Tensor, options: Nvfp4Options, generator: torch.Generator | None
    ) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        ctx.options, ctx.generator = options, generator
        n = w.shape[1]
        out = _gemm(quantize(x.reshape(-1, x.shape[-1])), _weight(w.t(), options), x.dtype)
        return matmul_output(out, (*x.shape[:-1], n))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, w = ctx.saved_tensors
        return (*_backward(grad, x, _weight(w, ctx.options), ctx.options, ctx.generator), None, None)


def weight_casts(w: torch.Tensor, options: Nvfp4Options) -> tuple[torch.Tensor, ...]:
    """The weight's two NVFP4 casts as :func:`nvfp4_matmul` computes them from ``w`` (``[K, N]``,
    cast to bf16 first, as the matmul casts it to its bf16 input's dtype): ``(data, scale)`` of
    ``w.T`` blocked along K (the forward GEMM's), of ``w`` blocked along N (the input-gradient
    GEMM's), then the amax (one per tensor: a transpose keeps it). Deterministic (round to nearest
    even; stochastic rounding is the gradient's), so ``weight_cache=True`` computes them once per
    optimizer step and :func:`nvfp4_linear_cached_weight` reads them: bitwise the uncached path."""
    with torch.no_grad():
        wb = w.to(torch.bfloat16)
        fwd, bwd = _weight(wb.t(), options), _weight(wb, options)
    return fwd.data, fwd.scale, bwd.data, bwd.scale, fwd.amax


class _Nvfp4MatmulCachedWeight(torch.autograd.Function):
    """:class:`_Nvfp4Matmul` with the weight's casts given (:func:`weight_casts`): the same GEMMs on
    the same operands; ``w`` carries the weight's gradient (in its own dtype, as the uncached
    path's cast back) and is not read."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        w: torch.Tensor,
        fwd_data: torch.Tensor,
        fwd_scale: torch.Tensor,
        bwd_data: torch.Tensor,
        bwd_scale: torch.Tensor,
        amax: torch.Tensor,
        options: Nvfp4Options,
    ) -> torch.Tensor:
        ctx.save_for_backward(x, bwd_data, bwd_scale, amax)
        ctx.options, ctx.w_dtype = options, w.dtype
        out = _gemm(quantize(x.reshape(-1, x.shape[-1])), Nvfp4Tensor(fwd_data, fwd_scale, amax), x.dtype)
        return matmul_output(out, (*x.shape[:-1], w.shape[1]))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, bwd_data, bwd_scale, amax = ctx.saved_tensors
        grad_x, grad_w = _backward(grad, x, Nvfp4Tensor(bwd_data, bwd_scale, amax), ctx.options, None)
        return grad_x, grad_w.to(ctx.w_dtype), None, None, None, None, None, None


def nvfp4_linear_cached_weight(
    x: torch.Tensor,
    w: torch.Tensor,
    fwd_data: torch.Tensor,
    fwd_scale: torch.Tensor,
    bwd_data: torch.Tensor,
    bwd_scale: torch.Tensor,
    amax: torch.Tensor,
    rht: bool,
    stochastic_rounding: bool,
    weight_2d: bool,
) -> torch.Tensor:
    """:func:`nvfp4_linear_flags` with the weight's casts computed beforehand by
    :func:`weight_casts` (``weight_cache=True``: once per optimizer step); bitwise with it. ``w``
    (the weight as ``[K, N]``) receives the gradient; its values are not read."""
    options = Nvfp4Options(rht, stochastic_rounding, weight_2d)
    return _Nvfp4MatmulCachedWeight.apply(x, w, fwd_data, fwd_scale, bwd_data, bwd_scale, amax, options)


def nvfp4_matmul(
    x: torch.Tensor, w: torch.Tensor, *, options: Nvfp4Options, generator: torch.Generator | None = None
) -> torch.Tensor:
    """``x @ w`` in NVFP4 (module doc); ``x``: ``[..., K]`` bf16 (fp32 runs too), ``w``: ``[K, N]``,
    cast to ``x``'s dtype first (autograd casts its gradient back). The result has ``x``'s dtype.
    ``generator``: the stochastic rounding's random numbers (default: torch's default generator)."""
    if not isinstance(options, Nvfp4Options):
        raise TypeError(f"amp_fx: options must be an amp_fx Nvfp4Options, got {type(options).__name__}")
    return _Nvfp4Matmul.apply(x, w.to(x.dtype), options, generator)


def nvfp4_linear_flags(
    x: torch.Tensor, w: torch.Tensor, rht: bool, stochastic_rounding: bool, weight_2d: bool
) -> torch.Tensor:
    """:func:`nvfp4_matmul` with the options as three booleans: the call the fp8 pass puts in a
    graph (FX writes constants of these types back as code)."""
    return nvfp4_matmul(x, w, options=Nvfp4Options(rht, stochastic_rounding, weight_2d))


def nvfp4_grouped_mm(
    x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, rht: bool, stochastic_rounding: bool, weight_2d: bool
) -> torch.Tensor:
    """The grouped expert GEMM ``torch._grouped_mm(x, w, offs=offs)`` in NVFP4: ``x`` ``[M, K]``,
    ``w`` ``[E, K, N]`` (cast to bf16), ``offs`` int32 ``[E]``, each group's end row.

    Each expert's GEMMs as :func:`nvfp4_matmul` on its own rows (the others masked to zero, which
    no block's amax sees), so each group's operands get their own tensor scales, as TE's
    ``GroupedLinear`` quantizes each split. The weight-gradient GEMM's blocks along the tokens
    start at multiples of 16 of the whole ``x``: the same blocks as TE's where each group's size
    is a multiple of 16 (TE asks for that). Emulated on every device, at E times a grouped
    GEMM's FLOPs (one masked GEMM per expert), with no host sync."""
    options = Nvfp4Options(rht, stochastic_rounding, weight_2d)
    x, w = x.to(torch.bfloat16), w.to(torch.bfloat16)
    rows = torch.arange(x.shape[0], device=x.device)
    group = torch.searchsorted(offs.to(torch.int64), rows, right=True)  # a row's expert; E past the last end
    out = x.new_zeros(x.shape[0], w.shape[-1])
    for e in range(w.shape[0]):
        mask = (group == e).unsqueeze(-1).to(x.dtype)
        # masked on both sides: the expert's output gradient is its rows' only (its own scales)
        out = out + nvfp4_matmul(x * mask, w[e], options=options) * mask
    return out
