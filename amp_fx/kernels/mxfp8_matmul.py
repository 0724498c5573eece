"""The MXFP8 matmul of ``fp8="mxfp8"``: torchao 0.18's MXFP8 training numerics, without its tensor subclass.

MXFP8 (OCP Microscaling): e4m3 elements, and one power-of-two scale (an e8m0 exponent, stored
here as its biased ``uint8``) per block of :data:`BLOCK` = 32 consecutive elements along the
inner (contraction) dimension of the GEMM that reads the operand. All three GEMMs of a matmul
``out = x @ w`` run in MXFP8, each operand blocked along that GEMM's inner dimension:

    out    = x   @ w      x blocked along K, w along K
    grad_x = g   @ w.T    g blocked along N, w along N
    grad_w = x.T @ g      x blocked along M, g along M (the tokens)

The scales follow torchao's ``ScaleCalculationMode.RCEIL`` (cuBLAS's rule for e8m0 scales): per
block, ``exponent = ceil(log2(amax / 448))``, clamped to e8m0's range, and the block is
multiplied by ``2**-exponent``, clamped to +-448 and cast to e4m3 (:func:`_to_mx`, torchao
``to_mx`` / ``_to_mx_rceil``). The operands are the autocast dtype's (bf16): torchao's MXFP8
linear takes bf16 operands (in torchtitan, FSDP2's bf16 parameters), so the weight is scaled
from its bf16 cast, not from the fp32 master weight as the float8 recipes do.

Where the GEMM runs:

* a GPU with MX kernels (compute capability 10.0+, Blackwell): ``torch._scaled_mm`` on the e4m3
  data with the e8m0 scales in cuBLAS's blocked layout (:func:`to_blocked`), bf16 result
  (torchao's ``KernelPreference.AUTO`` GEMM). Not run in this repository's tests (no such GPU).
* elsewhere (CPU, H100/H200): emulated, as torchao's ``KernelPreference.EMULATED``: each operand
  dequantized to bf16 (``e4m3 -> bf16`` times its block's power of two, exact) and multiplied with
  ``torch.mm`` in bf16. The numerics of MXFP8 (bitwise with torchao's emulated mode;
  ``tests/fp8/test_mxfp8.py``), the speed of neither: the compile warns (:func:`mx_kernels_missing`).

Every shape: each operand is zero-padded along its blocked dimension to a multiple of 32 before
it is scaled (torchao asserts that every dimension is a multiple of 32 instead). A zero never
raises a block's amax, so the real blocks keep their scales; an all-zero block gets exponent 0
and zero data, and adds exact zeros to the GEMM. On the GPU path, ``mat2``'s columns are padded
to 16 as well (``torch._scaled_mm``'s rule) and sliced off the result.

Example (a [32, 64] x [64, 48] matmul in MXFP8, emulated):
    >>> import torch
    >>> x = torch.randn(32, 64, dtype=torch.bfloat16, requires_grad=True)
    >>> w = torch.randn(48, 64, dtype=torch.bfloat16, requires_grad=True)
    >>> out = mxfp8_matmul(x, w.t(), emulate=True)
    >>> out.dtype, out.shape
    (torch.bfloat16, torch.Size([32, 48]))
    >>> out.float().sum().backward()
    >>> x.grad.shape, w.grad.shape
    (torch.Size([32, 64]), torch.Size([48, 64]))
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import torch

from amp_fx._common.matmul_output import matmul_output
from amp_fx._common.pad import pad_to_multiples
from amp_fx.kernels.fp8_support import KernelNeed, kernels_missing

__all__ = [
    "BLOCK",
    "mxfp8_matmul",
    "mxfp8_matmul_cached_weight",
    "mx_weight_casts",
    "mx_kernels_missing",
    "mxfp8_grouped_mm",
    "to_blocked",
]

BLOCK = 32
"""Elements per e8m0 scale (the OCP MX block size; torchao's only MXFP8 block size)."""

_E4M3 = torch.float8_e4m3fn
_E4M3_MAX = 448.0
_E8M0_BIAS = 127
_E8M0_NAN = 255
_KERNELS = KernelNeed(
    lacks="MXFP8 matmul kernel",
    elsewhere=" (MX torch._scaled_mm needs a Blackwell GPU, sm_100+)",
    needs="MX torch._scaled_mm needs a Blackwell GPU (compute capability 10.0+, B200/GB200)",
    minimum=(10, 0),  # torchao's MXFP8 kernels are sm_100 only too
    rocm="amp_fx runs MXFP8 on NVIDIA Blackwell GPUs only (this is a ROCm build)",
)


@functools.cache
def mx_kernels_missing(device_type: str) -> str | None:
    """None where ``torch._scaled_mm`` runs MXFP8 on ``device_type``'s current device, else why not
    (then :func:`mxfp8_matmul` emulates it). Asked once per device type."""
    return kernels_missing(device_type, _KERNELS)


class _Mx(NamedTuple):
    """An operand in MXFP8, blocked along its last dimension (row major)."""

    data: torch.Tensor
    """e4m3, ``[rows, cols]`` with ``cols`` padded to a multiple of :data:`BLOCK`."""
    scale: torch.Tensor
    """uint8, ``[rows, cols // BLOCK]``: the biased e8m0 exponent of each block."""


def _to_mx(x: torch.Tensor) -> _Mx:
    """torchao ``to_mx(x, e4m3, 32, ScaleCalculationMode.RCEIL)`` (with ``_to_mx_rceil``'s
    fallback, the one that runs off Blackwell and in eager) of a 2-D bf16/fp32 tensor, its last
    dimension zero-padded to a multiple of 32 first. Op for op torchao's, for bitwise results."""
    x = pad_to_multiples(x.contiguous(), cols=BLOCK)
    rows, cols = x.shape
    blocks = x.reshape(rows, cols // BLOCK, BLOCK)
    max_abs = torch.amax(torch.abs(blocks), -1).unsqueeze(-1)
    blocks = blocks.to(torch.float32)
    max_abs = max_abs.to(torch.float32)
    descale = max_abs / _E4M3_MAX
    # torchao's torch.where(cond, scalar, t), with the scalars as full tensors (same values): a
    # scalar would become a real tensor among fake ones where the weight cache traces this.
    exponent = (torch.clamp(torch.ceil(torch.log2(descale)), min=-_E8M0_BIAS, max=_E8M0_BIAS) + _E8M0_BIAS).to(
        torch.uint8
    )
    exponent = torch.where(
        torch.isnan(descale),
        torch.full_like(exponent, _E8M0_NAN),
        torch.where(torch.isinf(descale), torch.full_like(exponent, 254), exponent),
    )
    # 2**-exponent; torchao's special cases: NaN stays NaN, inf -> 2**-127, exponent 0 (an
    # all-zero block, or amax below 2**-118) -> 1.
    rcp = torch.where(
        exponent == _E8M0_NAN,
        descale,
        torch.where(
            exponent == 254,
            torch.full_like(descale, 2**-127),
            torch.where(
                exponent == 0, torch.full_like(descale, 1.0), torch.exp2(_E8M0_BIAS - exponent.to(torch.float32))
            ),
        ),
    )
    data = torch.clamp(blocks * rcp, min=-_E4M3_MAX, max=_E4M3_MAX)
    data = data.to(_E4M3).reshape(rows, cols)
    return _Mx(data, exponent.squeeze(-1))


def _dequantize(a: _Mx, dtype: torch.dtype) -> torch.Tensor:
    """torchao ``to_dtype`` / ``get_fp_scale`` of a row-major MX tensor: ``data * 2**(e - 127)``
    in ``dtype`` (exact: a power of two times an e4m3 value)."""
    rows, cols = a.data.shape
    data = a.data.to(dtype).reshape(-1, BLOCK)
    offset = a.scale.to(torch.int16) - _E8M0_BIAS
    two = torch.full_like(offset, 2.0, dtype=torch.float32)
    scale = torch.pow(two, offset)
    scale = torch.where(a.scale != _E8M0_NAN, scale, torch.full_like(scale, float("nan")))
    return (data * scale.reshape(-1, 1).to(dtype)).reshape(rows, cols)


def to_blocked(scale: torch.Tensor) -> torch.Tensor:
    """torchao ``to_blocked``: ``[rows, cols]`` byte scales (e8m0 here; NVFP4's e4m3, viewed as
    bytes, in :mod:`amp_fx.kernels.nvfp4`) in cuBLAS's block-scaling layout (128 x 4 tiles,
    zero-padded; https://docs.nvidia.com/cuda/cublas/#d-block-scaling-factors-layout)."""
    rows, cols = scale.shape
    row_blocks, col_blocks = -(-rows // 128), -(-cols // 4)
    padded = scale
    if (rows, cols) != (row_blocks * 128, col_blocks * 4):
        padded = scale.new_zeros(row_blocks * 128, col_blocks * 4)
        padded[:rows, :cols] = scale
    blocks = padded.view(row_blocks, 128, col_blocks, 4).permute(0, 2, 1, 3)
    return blocks.reshape(-1, 4, 32, 4).transpose(1, 2).reshape(-1, 32, 16).flatten()


def _gemm(a: _Mx, b: _Mx, out_dtype: torch.dtype, emulate: bool) -> torch.Tensor:
    """``a @ b.T``: ``a`` ``[R, I]`` and ``b`` ``[C, I]``, both blocked along ``I`` (the GEMM's
    inner dimension). Emulated: torchao's ``_addmm_mx_dispatch`` with ``KernelPreference.EMULATED``
    (both dequantized to ``out_dtype``, ``mm(a_hp, b_hp.t())`` on those layouts). Otherwise
    ``torch._scaled_mm`` with blocked e8m0 scales (its ``AUTO`` GEMM), ``b``'s rows padded to 16."""
    if emulate:
        return torch.mm(_dequantize(a, out_dtype), _dequantize(b, out_dtype).t())
    c = b.data.shape[0]
    b_data = pad_to_multiples(b.data.view(torch.uint8), rows=16).view(_E4M3)
    b_scale = pad_to_multiples(b.scale, rows=16)
    e8m0 = torch.float8_e8m0fnu
    out = torch._scaled_mm(
        a.data, b_data.t(), to_blocked(a.scale).view(e8m0), to_blocked(b_scale).view(e8m0), out_dtype=torch.bfloat16
    )
    out = out[:, :c] if out.shape[1] != c else out
    return out.to(out_dtype)


def _backward(grad: torch.Tensor, x: torch.Tensor, w_dim1: _Mx, emulate: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """torchao ``mx_mm.backward``: ``(grad_x, grad_w as [K, N])``, given the weight blocked along N
    (``w_dim1``: ``w`` as ``[K, N]``, row major)."""
    grad = grad.contiguous()  # torchao: its casts want a contiguous grad_output
    grad_2d = grad.reshape(-1, grad.shape[-1])
    x_2d = x.reshape(-1, x.shape[-1])
    grad_x = _gemm(_to_mx(grad_2d), w_dim1, grad.dtype, emulate)  # [M, K]
    grad_x = grad_x.reshape(*grad.shape[:-1], x.shape[-1])
    grad_w = _gemm(_to_mx(grad_2d.t()), _to_mx(x_2d.t()), grad.dtype, emulate)  # [N, K]
    return grad_x, grad_w.t()


def _forward(x: torch.Tensor, w_dim0: _Mx, n: int, emulate: bool) -> torch.Tensor:
    x_2d = x.reshape(-1, x.shape[-1])
    out = _gemm(_to_mx(x_2d), w_dim0, x.dtype, emulate)
    return matmul_output(out, (*x.shape[:-1], n))


class _MxMatmul(torch.autograd.Function):
    """torchao ``mx_mm``: the hp operands are saved and each is cast where its GEMM needs it."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, emulate: bool) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        ctx.emulate = emulate
        return _forward(x, _to_mx(w.t()), w.shape[1], emulate)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, w = ctx.saved_tensors
        return (*_backward(grad, x, _to_mx(w), ctx.emulate), None)


class _MxMatmulCachedWeight(torch.autograd.Function):
    """:class:`_MxMatmul` with the weight's two MX casts given (:func:`mx_weight_casts`); ``w``
    carries the gradient and is not read."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        w: torch.Tensor,
        w_data: torch.Tensor,
        w_scale: torch.Tensor,
        wg_data: torch.Tensor,
        wg_scale: torch.Tensor,
        emulate: bool,
    ) -> torch.Tensor:
        ctx.save_for_backward(x, wg_data, wg_scale)
        ctx.emulate = emulate
        return _forward(x, _Mx(w_data, w_scale), w.shape[1], emulate)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, wg_data, wg_scale = ctx.saved_tensors
        return (*_backward(grad, x, _Mx(wg_data, wg_scale), ctx.emulate), None, None, None, None, None)


def mx_weight_casts(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The weight's two MX casts, as :func:`mxfp8_matmul` makes them from ``w`` (``[K, N]``, any
    float dtype: cast to bf16 first): ``(data, scale)`` blocked along K for the forward GEMM,
    then along N for the input-gradient GEMM. What the weight cache computes once per step."""
    with torch.no_grad():
        w = w.to(torch.bfloat16)
        fwd, bwd = _to_mx(w.t()), _to_mx(w)
    return fwd.data, fwd.scale, bwd.data, bwd.scale


def mxfp8_matmul(x: torch.Tensor, w: torch.Tensor, *, emulate: bool) -> torch.Tensor:
    """``x @ w`` in MXFP8 (module doc); ``x``: ``[..., K]`` bf16 (fp32 runs too), ``w``: ``[K, N]``,
    cast to ``x``'s dtype first (autograd casts its gradient back). The result has ``x``'s dtype.
    ``emulate``: dequantize and ``torch.mm`` (any device) instead of MX ``torch._scaled_mm``."""
    return _MxMatmul.apply(x, w.to(x.dtype), emulate)


def mxfp8_matmul_cached_weight(
    x: torch.Tensor,
    w: torch.Tensor,
    w_data: torch.Tensor,
    w_scale: torch.Tensor,
    wg_data: torch.Tensor,
    wg_scale: torch.Tensor,
    *,
    emulate: bool,
) -> torch.Tensor:
    """:func:`mxfp8_matmul` with the weight's casts from :func:`mx_weight_casts`; bitwise with it.
    ``w`` (``[K, N]``) receives the gradient (in ``x``'s dtype, cast by autograd to ``w``'s)."""
    return _MxMatmulCachedWeight.apply(x, w, w_data, w_scale, wg_data, wg_scale, emulate)


# --- grouped expert GEMMs (emulated only; not yet used by the fp8 pass) --------------------------


def _to_mx_3d(w: torch.Tensor) -> _Mx:
    """:func:`_to_mx` of each expert of ``w`` (``[E, R, C]``), blocked along ``C``: ``data``
    ``[E, R, C']``, ``scale`` ``[E, R, C' // 32]``."""
    e, r, _ = w.shape
    mx = _to_mx(w.reshape(e * r, -1))
    return _Mx(mx.data.reshape(e, r, -1), mx.scale.reshape(e, r, -1))


def _dequantize_grouped(a: _Mx) -> torch.Tensor:
    """torchao's grouped emulation (``_emulated_mxfp8_scaled_grouped_mm_2d_*``): ``data * scale``
    in bf16, the e8m0 scale converted to bf16 directly (the same powers of two as
    :func:`_dequantize`)."""
    shape = a.data.shape
    data = a.data.reshape(*shape[:-1], shape[-1] // BLOCK, BLOCK)
    scale = a.scale.view(torch.float8_e8m0fnu).unsqueeze(-1)
    return (data.to(torch.bfloat16) * scale.to(torch.bfloat16)).reshape(shape)


def _pad_tokens(x: torch.Tensor) -> torch.Tensor:
    """``x`` (``[M, D]``) zero-padded along M to a multiple of 32: rows past the last offset,
    which no group reads."""
    return pad_to_multiples(x, rows=BLOCK)


class _MxGroupedMm(torch.autograd.Function):
    """torchao ``_MXFP8GroupedMM`` with ``KernelPreference.EMULATED`` (no token-group padding):
    ``out[offs[g-1]:offs[g]] = x[offs[g-1]:offs[g]] @ w[g]``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, w, offs)
        n = w.shape[-1]
        a = _dequantize_grouped(_to_mx(x))
        b = _dequantize_grouped(_to_mx_3d(w.transpose(-2, -1)))  # [E, N, K'] blocked along K
        out = torch._grouped_mm(a, b.transpose(-2, -1), offs=offs, out_dtype=torch.bfloat16)
        return matmul_output(out[:, :n], (out.shape[0], n))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, w, offs = ctx.saved_tensors
        k = w.shape[1]
        grad = grad.contiguous()
        g = _dequantize_grouped(_to_mx(grad))  # [M, N'] blocked along N
        wt = _dequantize_grouped(_to_mx_3d(w))  # [E, K, N'] blocked along N
        grad_x = torch._grouped_mm(g, wt.transpose(-2, -1), offs=offs, out_dtype=torch.bfloat16)
        # the weight gradient, blocked along the tokens (torchao: across group boundaries)
        gt = _dequantize_grouped(_to_mx(_pad_tokens(grad).t()))  # [N, M']
        xt = _dequantize_grouped(_to_mx(_pad_tokens(x).t()))  # [K, M']
        grad_w = torch._grouped_mm(gt, xt.t(), offs=offs, out_dtype=torch.bfloat16)  # [E, N, K]
        return grad_x[:, :k], grad_w.transpose(-2, -1), None


def mxfp8_grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """The grouped expert GEMM ``torch._grouped_mm(x, w, offs=offs)`` in MXFP8, emulated
    (bitwise with torchao's ``_to_mxfp8_then_scaled_grouped_mm(x, w, offs,
    kernel_preference=KernelPreference.EMULATED)``, ``tests/fp8/test_mxfp8.py``): ``x`` ``[M, K]`` and
    ``w`` ``[E, K, N]``, cast to bf16 first; ``offs`` int32 ``[E]``, each group's end row. The
    three GEMMs are blocked as :func:`mxfp8_matmul`'s, the weight gradient's along the tokens
    over the whole ``x`` (as torchao: a block may straddle two groups unless each group's size
    is a multiple of 32). K, N and M are zero-padded to multiples of 32. Emulated on every
    device (no Blackwell grouped kernel here); the fp8 pass calls it for grouped expert GEMMs
    with ``fp8="mxfp8"``."""
    return _MxGroupedMm.apply(x.to(torch.bfloat16), w.to(torch.bfloat16), offs)
