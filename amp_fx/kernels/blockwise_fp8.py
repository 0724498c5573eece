"""The blockwise fp8 matmul of ``fp8="blockwise"``: DeepSeek-V3's recipe, with torchao 0.18's numerics.

Every operand of the three GEMMs of ``out = x @ w`` is e4m3 with one fp32 scale per block along
that GEMM's inner (contraction) dimension: activations and output gradients per 1 x 128 block,
the weight per 128 x 128 tile (torchao ``prototype/blockwise_fp8_training/linear.py``,
``fp8_blockwise_mm``):

    out    = x   @ w      x: 1x128 along K             w: 128x128 tiles
    grad_x = g   @ w.T    g: 1x128 along N             w: the same tiles, transposed
    grad_w = x.T @ g      x: 128x1 along M (tokens)    g: 128x1 along M

A tile's amax does not change under a transpose, so the weight is quantized once and its
transposed copy (torchao's ``triton_fp8_blockwise_weight_quant_transposed_rhs``) is the same
data and scales transposed (:func:`weight_tiles`). ``grad_w``'s operands are the 1x128
quantization of ``x.T`` and ``g.T`` (torchao's ``..._act_quant_rhs`` and
``..._act_quant_transposed_lhs``).

Per block, as torchao's Triton kernels compute it (``kernels.py``): ``amax`` of the block's
absolute values, in fp32, floored at ``EPS`` = 1e-12 (so an all-zero block gets the finite scale
``448 / 1e-12`` and zero data); ``scale = (448 / float64(amax)).to(float32)``; ``data =
e4m3(clamp(x * scale, -448, 448))`` (the product in fp32); the stored scale is the reciprocal,
``1 / scale`` in fp32, which the GEMM multiplies by. :func:`quantize_1x128` and
:func:`quantize_128x128` are these quantizers in plain torch, bitwise with torchao's torch
references (``torch_blockwise_scale_act_quant_lhs``/``_rhs``, ``torch_blockwise_scale_weight_quant``;
``tests/fp8/test_blockwise.py``), which are what the GPU stage holds torchao's Triton kernels to
(``.ci/gpu``). One exception, torchao's own: its ``torch_blockwise_scale_act_quant_rhs`` floors
a bf16 amax at ``EPS`` in bf16, its Triton kernel in fp32; amp_fx follows the kernel (only an
all-zero block's scale differs; its data is zero either way).

Every shape: each operand is zero-padded along its blocked dimensions to a multiple of 128 before
it is scaled (torchao asserts every dimension is a multiple of 128 instead). A zero never raises
a block's amax, so the real blocks keep their scales; a block of padding only gets zero data.

Where the GEMM runs:

* CPU, and any device without Hopper's blockwise GEMM: emulated. Each operand is dequantized to
  fp32 (``data * inverse scale``, one rounding per element) and multiplied with ``torch.mm`` (one
  per group for the grouped expert GEMMs) in fp32; the result is rounded once to the output dtype (bf16, as
  torchao's ``out_dtype``). The recipe's quantization exactly, its GEMM to fp32 rounding (the
  hardware sums each 128-block's products before scaling them), the speed of neither: the
  compile says so once (:func:`blockwise_kernels_missing`, ``amp_fx.backend.audit``).
* CUDA, compute capability 9.x (H100/H200): ``torch.nn.functional.scaled_mm`` with
  ``ScalingType.BlockWise1x128``/``BlockWise128x128`` where the installed torch has it, else
  torchao's Triton GEMMs (``triton_fp8_gemm_1x128_128x128``/``_128x1``) where torchao imports,
  else emulated. **Not run by amp_fx's tests** (no GPU here): the layouts follow torchao's
  ``linear.py`` call for call.

Example (a [4, 200] x [200, 72] matmul in blockwise fp8, emulated):
    >>> import torch
    >>> x = torch.randn(4, 200, dtype=torch.bfloat16, requires_grad=True)
    >>> w = torch.randn(72, 200, requires_grad=True)
    >>> out = blockwise_fp8_matmul(x, w.t(), emulate=True)
    >>> out.dtype, out.shape
    (torch.bfloat16, torch.Size([4, 72]))
    >>> out.float().sum().backward()
    >>> x.grad.dtype, w.grad.dtype
    (torch.bfloat16, torch.float32)
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from amp_fx._common.matmul_output import matmul_output
from amp_fx._common.pad import pad_to_multiples
from amp_fx.kernels.fp8_support import KernelNeed, kernels_missing

__all__ = [
    "BLOCK",
    "Blocks",
    "quantize_1x128",
    "quantize_128x128",
    "dequantize",
    "token_blocks",
    "quantize_token_blocks",
    "weight_tiles",
    "blockwise_kernels_missing",
    "blockwise_fp8_matmul",
    "blockwise_fp8_matmul_cached_weight",
    "blockwise_fp8_grouped_mm",
]

BLOCK = 128
"""Elements per scale along a GEMM's inner dimension (DeepSeek-V3's and torchao's only block size)."""

_E4M3 = torch.float8_e4m3fn
_E4M3_MAX = 448.0
_EPS = 1e-12
"""torchao's floor on a block's amax (``blockwise_fp8_training/kernels.py``'s ``EPS``, the float8 one's value)."""
_KERNELS = KernelNeed(
    lacks="blockwise fp8 GEMM",
    elsewhere=" (it needs a Hopper GPU, compute capability 9.x)",
    needs="cuBLAS's 1x128/128x128 scaling and torchao's Triton GEMMs are Hopper's (H100/H200)",
    minimum=(9, 0),
    below=(10, 0),  # Hopper's only: Blackwell's tensor cores take MX block scales, not these
    rocm="amp_fx runs blockwise fp8 GEMMs on NVIDIA Hopper GPUs only (this is a ROCm build)",
)


class Blocks(NamedTuple):
    """A 2-D operand in blockwise fp8, blocked along its last dimension (row major)."""

    data: torch.Tensor
    """e4m3, ``[R', C']``: both padded to multiples of 128 for tiles, ``C`` only for 1x128 blocks."""
    inv_scale: torch.Tensor
    """fp32 reciprocal scales (``hp ~ data * inv_scale``): ``[R, C' / 128]`` for 1x128 blocks,
    ``[R' / 128, C' / 128]`` for tiles."""


def _scale(amax: torch.Tensor) -> torch.Tensor:
    """torchao's Triton kernels: ``amax`` (fp32) floored at EPS, ``448 / amax`` in float64, stored as fp32."""
    return (_E4M3_MAX / torch.clamp(amax.to(torch.float32), min=_EPS).to(torch.float64)).to(torch.float32)


def _cast(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``e4m3(clamp(x * scale, -448, 448))``, the product in fp32 (``scale`` broadcast)."""
    return torch.clamp(x * scale, min=-_E4M3_MAX, max=_E4M3_MAX).to(_E4M3)


@torch.no_grad()
def quantize_1x128(x: torch.Tensor) -> Blocks:
    """``x`` (2-D, any float dtype) in e4m3 with one fp32 scale per 1 x 128 block along its last
    dimension, zero-padded to a multiple of 128 first: torchao ``triton_fp8_blockwise_act_quant_lhs``
    (bitwise with ``torch_blockwise_scale_act_quant_lhs``; the transposed copies are this function
    of the transposed tensor)."""
    x = pad_to_multiples(x.contiguous(), cols=BLOCK)
    rows, cols = x.shape
    blocks = x.reshape(rows, cols // BLOCK, BLOCK)
    scale = _scale(torch.amax(torch.abs(blocks), -1, keepdim=True))
    data = _cast(blocks, scale).reshape(rows, cols)
    return Blocks(data, torch.reciprocal(scale).squeeze(-1))


@torch.no_grad()
def quantize_128x128(w: torch.Tensor) -> Blocks:
    """``w`` (2-D, any float dtype; amp_fx passes the fp32 master weight) in e4m3 with one fp32
    scale per 128 x 128 tile, both dimensions zero-padded to multiples of 128 first: torchao
    ``triton_fp8_blockwise_weight_quant_rhs`` (bitwise with ``torch_blockwise_scale_weight_quant``)."""
    w = pad_to_multiples(w.contiguous(), rows=BLOCK, cols=BLOCK)
    rows, cols = w.shape
    tiles = w.reshape(rows // BLOCK, BLOCK, cols // BLOCK, BLOCK)
    scale = _scale(torch.amax(torch.abs(tiles), dim=(1, 3), keepdim=True))
    data = _cast(tiles, scale).reshape(rows, cols)
    return Blocks(data, torch.reciprocal(scale).reshape(rows // BLOCK, cols // BLOCK))


def dequantize(b: Blocks, rows: int, cols: int) -> torch.Tensor:
    """``b`` as fp32 ``[rows, cols]`` (its padding sliced off): ``data * inv_scale`` per element."""
    data = b.data.to(torch.float32)
    inv = b.inv_scale.repeat_interleave(BLOCK, dim=-1)
    if b.inv_scale.shape[0] != data.shape[0]:  # tiles: one scale per 128 rows too
        inv = inv.repeat_interleave(BLOCK, dim=0)
    return (data * inv)[:rows, :cols]


def weight_tiles(w: torch.Tensor) -> Blocks:
    """The weight ``w`` (``[K, N]``) as the GEMMs read it: its 128 x 128 tiles of ``w.T``
    (``[N', K']``, blocked along K for the forward GEMM); ``.t()`` of both fields is the
    input-gradient GEMM's copy, blocked along N (the same tiles: a tile's amax is the same
    transposed). What the weight cache computes once per step."""
    return quantize_128x128(w.t())


# --- where the GEMM runs -------------------------------------------------------------------------


def _scaled_mm_blockwise() -> Any:
    """torch's ``ScalingType`` where ``F.scaled_mm`` takes blockwise scales, else None (looked up as
    torchao's ``kernels.py`` does: ``F.ScalingType``, else ``torch._C._ScalingType``)."""
    kinds = getattr(F, "ScalingType", None) or getattr(torch._C, "_ScalingType", None)
    return kinds if hasattr(F, "scaled_mm") and hasattr(kinds, "BlockWise128x128") else None


def _torchao_gemms() -> tuple[Any, Any] | None:
    """torchao's Triton GEMMs ``(1x128 @ 128x128, 1x128 @ 128x1)`` where torchao imports, else None."""
    try:
        from torchao.prototype.blockwise_fp8_training.kernels import (
            triton_fp8_gemm_1x128_128x1,
            triton_fp8_gemm_1x128_128x128,
        )
    except ImportError:
        return None
    return triton_fp8_gemm_1x128_128x128, triton_fp8_gemm_1x128_128x1


@functools.cache
def blockwise_kernels_missing(device_type: str) -> str | None:
    """None where a blockwise fp8 GEMM runs on ``device_type``'s current device, else why not
    (then the matmul is emulated). Asks the CUDA device's compute capability once."""
    if (missing := kernels_missing(device_type, _KERNELS)) is not None:
        return missing
    if _scaled_mm_blockwise() is None and _torchao_gemms() is None:
        return (
            f"torch {torch.__version__}'s F.scaled_mm takes no blockwise scales and torchao is not "
            f"installed (pip install torchao for its Triton GEMMs)"
        )
    return None


def _col_major(t: torch.Tensor) -> torch.Tensor:
    return t.t().contiguous().t()


def _k_major_tile_scale(scale: torch.Tensor) -> torch.Tensor:
    """A ``[K/128, N/128]`` tile scale in cuBLAS's K-major layout, its K blocks padded with ones
    to a multiple of 4 (16-byte columns): torchao's ``_pad_blockwise_128x128_scale_k_major``."""
    pad = -scale.shape[0] % 4
    return F.pad(scale.t(), (0, pad), value=1.0).t() if pad else scale


def _on_gpu(a: Blocks, b: Blocks, out_dtype: torch.dtype) -> torch.Tensor:
    """``a @ b.T`` on Hopper (untested here), laid out as torchao's ``fp8_blockwise_mm`` lays out
    its operands: ``a`` row major with column-major scales, ``b.T`` column major; ``b``'s scales
    per 128 x 128 tile (``[I/128, C/128]``) or per 1 x 128 block (``[C, I/128]``)."""
    tiles = b.inv_scale.shape[0] != b.data.shape[0]
    if not tiles:  # _scaled_mm wants mat2's columns in multiples of 16 (a tile's are 128 already)
        data = pad_to_multiples(b.data.view(torch.uint8), rows=16).view(_E4M3)
        b = Blocks(data, pad_to_multiples(b.inv_scale, rows=16))
    a_data, a_scale, b_data = a.data, _col_major(a.inv_scale), _col_major(b.data.t())
    kinds = _scaled_mm_blockwise()
    if kinds is not None:
        b_kind = kinds.BlockWise128x128 if tiles else kinds.BlockWise1x128
        b_scale = _col_major(b.inv_scale.t()) if tiles else _col_major(b.inv_scale)
        return F.scaled_mm(
            a_data,
            b_data,
            scale_a=a_scale,
            scale_recipe_a=kinds.BlockWise1x128,
            scale_b=_k_major_tile_scale(b_scale) if tiles else b_scale,
            scale_recipe_b=b_kind,
            output_dtype=out_dtype,
        )
    gemms = _torchao_gemms()
    assert gemms is not None, "blockwise_kernels_missing said a GEMM runs here"
    tile_gemm, row_gemm = gemms
    if tiles:
        return tile_gemm(a_data, b_data, a_scale, _col_major(b.inv_scale.t()), out_dtype=out_dtype)
    return row_gemm(a_data, b_data, a_scale, b.inv_scale.t().contiguous(), out_dtype=out_dtype)


def _gemm(a: Blocks, b: Blocks, rows: int, cols: int, out_dtype: torch.dtype, emulate: bool) -> torch.Tensor:
    """``a @ b.T`` in ``out_dtype``, ``[rows, cols]``: ``a`` ``[R, I']`` in 1x128 blocks, ``b``
    ``[C', I']`` in 1x128 blocks or 128x128 tiles, both blocked along ``I'`` (the inner dimension)."""
    if emulate:
        inner = a.data.shape[1]
        out = torch.mm(dequantize(a, rows, inner), dequantize(b, cols, inner).t())
        return out.to(out_dtype)
    out = _on_gpu(a, b, out_dtype)
    return out[:rows, :cols]


# --- the dense matmul ------------------------------------------------------------------------------


def _forward(x: torch.Tensor, w_tiles: Blocks, n: int, emulate: bool) -> torch.Tensor:
    x_2d = x.reshape(-1, x.shape[-1])
    out = _gemm(quantize_1x128(x_2d), w_tiles, x_2d.shape[0], n, x.dtype, emulate)
    return matmul_output(out, (*x.shape[:-1], n))


def _backward(grad: torch.Tensor, x: torch.Tensor, w_tiles: Blocks, emulate: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """torchao ``fp8_blockwise_mm.backward``: ``(grad_x, grad_w as [K, N])``."""
    grad_2d = grad.reshape(-1, grad.shape[-1])
    x_2d = x.reshape(-1, x.shape[-1])
    (m, k), n = x_2d.shape, grad_2d.shape[1]
    w_t = Blocks(w_tiles.data.t(), w_tiles.inv_scale.t())  # [K', N'], tiles blocked along N
    grad_x = _gemm(quantize_1x128(grad_2d), w_t, m, k, grad.dtype, emulate)
    grad_w = _gemm(quantize_1x128(grad_2d.t()), quantize_1x128(x_2d.t()), n, k, grad.dtype, emulate)  # [N, K]
    return grad_x.reshape(*grad.shape[:-1], k), grad_w.t()


class _BlockwiseMatmul(torch.autograd.Function):
    """``x @ w`` given the weight's tiles (:func:`weight_tiles`, quantized once: the backward's
    transposed copy is bitwise the one torchao quantizes again); ``w`` carries the gradient and is
    not read. Saves ``x`` and the tiles (one byte per weight element)."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, w: torch.Tensor, data: torch.Tensor, inv_scale: torch.Tensor, emulate: bool
    ) -> torch.Tensor:
        ctx.save_for_backward(x, data, inv_scale)
        ctx.emulate = emulate
        return _forward(x, Blocks(data, inv_scale), w.shape[1], emulate)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, data, inv_scale = ctx.saved_tensors
        return (*_backward(grad, x, Blocks(data, inv_scale), ctx.emulate), None, None, None)


def blockwise_fp8_matmul(x: torch.Tensor, w: torch.Tensor, *, emulate: bool) -> torch.Tensor:
    """``x @ w`` in blockwise fp8 (module doc); ``x``: ``[..., K]`` bf16/fp16 (fp32 runs too),
    ``w``: ``[K, N]`` in any float dtype (the fp32 master weight is scaled as it is, as torchao's
    ``Float8BlockwiseLinear`` scales its weight). The result and ``x``'s gradient have ``x``'s
    dtype; ``w``'s gradient is rounded to it too (torchao's ``out_dtype``), then cast to ``w``'s
    by autograd. ``emulate``: dequantize and ``torch.mm`` in fp32 (any device)."""
    return _BlockwiseMatmul.apply(x, w, *weight_tiles(w), emulate)


def blockwise_fp8_matmul_cached_weight(
    x: torch.Tensor, w: torch.Tensor, data: torch.Tensor, inv_scale: torch.Tensor, *, emulate: bool
) -> torch.Tensor:
    """:func:`blockwise_fp8_matmul` with the weight's tiles from :func:`weight_tiles`; bitwise with it.
    ``w`` (``[K, N]``) receives the gradient."""
    return _BlockwiseMatmul.apply(x, w, data, inv_scale, emulate)


# --- grouped expert GEMMs ---------------------------------------------------------------------------


def token_blocks(offs: torch.Tensor, m: int) -> tuple[torch.Tensor, int]:
    """``(block of each row, number of blocks)``: rows grouped by ``offs`` (each group's end row),
    each group cut into blocks of 128 rows from its start, as torchao's ``pad_token_groups`` pads
    each group to a multiple of 128 before the weight-gradient GEMM. Rows past ``offs[-1]`` get a
    block of their own (no GEMM reads them). Computed on the device, without reading ``offs``."""
    groups = offs.numel()
    rows = torch.arange(m, device=offs.device, dtype=torch.int64)
    ends = offs.to(torch.int64)
    starts = torch.cat([ends.new_zeros(1), ends[:-1]])
    sizes = (ends - starts).clamp(min=0)
    per_group = (sizes + BLOCK - 1) // BLOCK
    first = torch.cumsum(per_group, 0) - per_group
    group = torch.searchsorted(ends, rows, right=True)
    inside = group < groups
    g = group.clamp(max=groups - 1)
    count = m // BLOCK + groups + 1  # sum of ceil(size / 128) <= m / 128 + groups, plus the rows past the end
    block = torch.where(inside, first[g] + (rows - starts[g]) // BLOCK, torch.full_like(rows, count - 1))
    return block, count


@torch.no_grad()
def quantize_token_blocks(t: torch.Tensor, block: torch.Tensor, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``t`` (``[M, C]``) in e4m3 with one fp32 scale per column and block of rows (:func:`token_blocks`):
    ``(data [M, C], inv_scale [count, C])``. torchao ``triton_fp8_blockwise_act_quant_rhs`` of each
    group padded to 128 rows (and, of ``g``, its ``..._transposed_lhs``, the same values transposed)."""
    index = block[:, None].expand(t.shape)
    amax = torch.zeros(count, t.shape[1], dtype=torch.float32, device=t.device)
    amax = amax.scatter_reduce(0, index, torch.abs(t).to(torch.float32), "amax")
    scale = _scale(amax)
    return _cast(t, scale[block]), torch.reciprocal(scale)


def _dequantize_token_blocks(t: torch.Tensor, block: torch.Tensor, count: int) -> torch.Tensor:
    data, inv_scale = quantize_token_blocks(t, block, count)
    return data.to(torch.float32) * inv_scale[block]


def _tiles_3d(w: torch.Tensor) -> Blocks:
    """:func:`quantize_128x128` of each expert of ``w`` (``[E, R, C]``): ``data`` ``[E, R', C']``,
    ``inv_scale`` ``[E, R'/128, C'/128]``."""
    e = w.shape[0]
    w = pad_to_multiples(w, rows=BLOCK, cols=BLOCK)
    _, rows, cols = w.shape
    with torch.no_grad():
        tiles = w.reshape(e, rows // BLOCK, BLOCK, cols // BLOCK, BLOCK)
        scale = _scale(torch.amax(torch.abs(tiles), dim=(2, 4), keepdim=True))
        data = _cast(tiles, scale).reshape(e, rows, cols)
    return Blocks(data, torch.reciprocal(scale).reshape(e, rows // BLOCK, cols // BLOCK))


def _dequantize_3d(b: Blocks, rows: int, cols: int) -> torch.Tensor:
    inv = b.inv_scale.repeat_interleave(BLOCK, dim=1).repeat_interleave(BLOCK, dim=2)
    return (b.data.to(torch.float32) * inv)[:, :rows, :cols]


@torch.library.custom_op("amp_fx::grouped_mm_fp32", mutates_args=())
def _grouped_fp32(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """The emulation's fp32 grouped GEMM, in ``torch._grouped_mm``'s two forms: ``a`` ``[M, K]``
    times ``b`` ``[E, K, N]`` (rows of group ``e`` times ``b[e]``; rows past ``offs[-1]`` zero), or
    ``a`` ``[N, M]`` times ``b`` ``[M, K]`` grouped along M (``[E, N, K]``; an empty group zero).
    One ``torch.mm`` per group after reading ``offs`` on the host (free on the CPU):
    ``aten._grouped_mm``'s meta kernel takes bf16 operands only, so fp32 ones cannot be traced."""
    ends = offs.tolist()
    rows_grouped = b.dim() == 3
    shape = (a.shape[0], b.shape[-1]) if rows_grouped else (len(ends), a.shape[0], b.shape[1])
    out = a.new_zeros(shape)
    start = 0
    for e, end in enumerate(ends):
        end = max(start, min(end, a.shape[0] if rows_grouped else b.shape[0]))
        if rows_grouped:
            out[start:end] = a[start:end] @ b[e]
        else:
            out[e] = a[:, start:end] @ b[start:end]
        start = end
    return out


@_grouped_fp32.register_fake
def _(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    if b.dim() == 3:
        return a.new_empty(a.shape[0], b.shape[-1])
    return a.new_empty(offs.shape[0], a.shape[0], b.shape[1])


class _BlockwiseGroupedMm(torch.autograd.Function):
    """torchao ``_Float8BlockwiseGroupedMM`` (``pad_token_groups_for_grouped_mm=True``), emulated
    in fp32: ``out[offs[g-1]:offs[g]] = x[offs[g-1]:offs[g]] @ w[g]``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        tiles = _tiles_3d(w.transpose(-2, -1))  # [E, N', K'], blocked along K
        ctx.save_for_backward(x, tiles.data, tiles.inv_scale, offs)
        (m, k), n = x.shape, w.shape[-1]
        a = dequantize(quantize_1x128(x), m, k)
        b = _dequantize_3d(tiles, n, k)
        return _grouped_fp32(a, b.transpose(-2, -1), offs).to(x.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, data, inv_scale, offs = ctx.saved_tensors
        (m, k), n = x.shape, grad.shape[1]
        g = dequantize(quantize_1x128(grad), m, n)  # [M, N], 1x128 along N
        wt = _dequantize_3d(Blocks(data, inv_scale), n, k)  # [E, N, K], tiles blocked along N
        grad_x = _grouped_fp32(g, wt, offs).to(grad.dtype)
        block, count = token_blocks(offs, m)
        gt = _dequantize_token_blocks(grad, block, count)  # [M, N], 128x1 along M per group
        xt = _dequantize_token_blocks(x, block, count)  # [M, K]
        grad_w = _grouped_fp32(gt.t(), xt, offs).to(grad.dtype)  # [E, N, K]
        return grad_x, grad_w.transpose(-2, -1), None


def blockwise_fp8_grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """The grouped expert GEMM ``torch._grouped_mm(x, w, offs=offs)`` in blockwise fp8, emulated on
    every device (torchao's grouped blockwise GEMM is DeepGEMM's, an optional CUDA dependency not
    called here): ``x`` ``[M, K]`` bf16/fp16, ``w`` ``[E, K, N]`` (the fp32 master weight, scaled
    per 128 x 128 tile of each expert), ``offs`` ``[E]``, each group's end row. The forward and
    input-gradient GEMMs are blocked as :func:`blockwise_fp8_matmul`'s; the weight gradient's
    operands per 128 rows of each group (torchao pads each group to 128 rows, so no block straddles
    two groups). The result has ``x``'s dtype; rows past ``offs[-1]`` are zero."""
    return _BlockwiseGroupedMm.apply(x, w, offs)
