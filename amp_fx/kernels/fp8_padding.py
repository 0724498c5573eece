"""The padding rules of the fp8 matmul: what ``torch._scaled_mm`` needs in multiples of 16 (MXFP8: of
its 32-element blocks), how the operands are padded to it, and what the padding costs.

:func:`pad_for_scaled_mm` is the rule :func:`amp_fx.kernels.fp8_matmul.scaled_matmul` runs on
every GEMM (torchao's ``pad_inner_dim``, extended to ``mat2``'s columns); :func:`padding` is its
cost model, which the fp8 pass records on each decision and ``explain`` shows.

    >>> padding(32, 1001, 48, Fp8Recipe.TENSORWISE).dims
    {'K': (1001, 1008)}
    >>> padding(32, 64, 48, Fp8Recipe.TENSORWISE) is None
    True
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from amp_fx.fp8 import Fp8Recipe
from amp_fx.kernels import blockwise_fp8 as _bw
from amp_fx.kernels import mxfp8_matmul as _mx
from amp_fx.kernels.fp8_recipes import ALIGNMENT, RECIPES

__all__ = ["Fp8Padding", "padding", "pad_for_scaled_mm"]


def _aligned(size: int) -> int:
    """``size`` rounded up to a multiple of :data:`ALIGNMENT` (torchao ``_get_min_alignment``)."""
    return -(-size // ALIGNMENT) * ALIGNMENT


def pad_for_scaled_mm(
    a_data: torch.Tensor, b_data: torch.Tensor, b_scale: torch.Tensor, b_rowwise: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(a_data, b_data, b_scale)`` zero-padded to the sizes ``_scaled_mm`` takes on a GPU: the
    inner dimension of both (torchao ``preprocess_addmm`` with ``pad_inner_dim``:
    ``pad_tensor_for_matmul(a, dims=1)``, ``(b, dims=0)``) and ``b``'s columns, which torchao does
    not pad (a GPU refuses its result there). A rowwise ``b_scale`` (``[1, N]``) gets 1 for each
    padded column. The operands themselves where their sizes are already multiples of 16: no op
    is added (sizes known while tracing; a symbolic size is guarded on its remainder)."""
    k, n = b_data.shape
    pad_k, pad_n = _aligned(k) - k, _aligned(n) - n
    if pad_k:
        a_data = F.pad(a_data, (0, pad_k))
    if pad_k or pad_n:
        b_data = F.pad(b_data, (0, pad_n, 0, pad_k))
    if pad_n and b_rowwise:
        b_scale = F.pad(b_scale, (0, pad_n), value=1.0)
    return a_data, b_data, b_scale


@dataclass(frozen=True)
class Fp8Padding:
    """What the fp8 matmul ``[M, K] @ [K, N]`` pads, over the GEMMs its recipe runs in fp8 (the
    others run as ``torch.mm``, unpadded), and what that costs."""

    gemms: tuple[tuple[str, str, tuple[int, int, int], tuple[int, int, int]], ...]
    """Per fp8 GEMM: its name (``out``, ``grad_x``, ``grad_w``), the names of ``(rows, inner,
    cols)`` of ``mat1 @ mat2`` as ``_scaled_mm`` takes it (``"MKN"`` for ``out``), and those sizes
    unpadded and padded."""
    extra_flops: float
    """FLOPs the padding adds to these GEMMs, as a fraction of their unpadded FLOPs."""
    extra_bytes: float
    """Bytes the padding adds to these GEMMs' traffic (fp8 operands read, 2-byte result written),
    as a fraction of it unpadded. Not counted: the pads themselves, which in eager and
    ``aot_eager`` copy each padded operand and under inductor are pointwise ops it may fuse into
    the cast that makes the operand; the slice of the result is a view."""

    @property
    def dims(self) -> dict[str, tuple[int, int]]:
        """Each padded dimension (``"M"``, ``"K"``, ``"N"``): (size, padded size)."""
        out: dict[str, tuple[int, int]] = {}
        for _, names, sizes, padded in self.gemms:
            for name, size, p in zip(names, sizes, padded):
                if p != size:
                    out[name] = (size, p)
        return dict(sorted(out.items()))

    @property
    def text(self) -> str:
        """``"K 1001->1008, N 37->48: +2.1% FLOPs, +3.4% bytes"``."""
        dims = ", ".join(f"{d} {s}->{p}" for d, (s, p) in self.dims.items())
        return f"{dims}: +{100 * self.extra_flops:.1f}% FLOPs, +{100 * self.extra_bytes:.1f}% bytes"


def _mx_aligned(size: int) -> int:
    """``size`` rounded up to a multiple of MXFP8's block (32)."""
    return -(-size // _mx.BLOCK) * _mx.BLOCK


def _block_aligned(size: int) -> int:
    """``size`` rounded up to a multiple of the blockwise recipe's block (128)."""
    return -(-size // _bw.BLOCK) * _bw.BLOCK


def _same(size: int) -> int:
    return size


def padding(m: int, k: int, n: int, recipe: Fp8Recipe) -> Fp8Padding | None:
    """What :func:`fp8_matmul` pads for an ``[M, K] @ [K, N]`` with ``recipe`` (the rule of
    :func:`pad_for_scaled_mm`: each GEMM's inner dimension and columns), None where every fp8
    GEMM's sizes are already multiples of 16. MXFP8 pads each GEMM's inner dimension to a
    multiple of 32 (its blocks); its columns only on a Blackwell GPU (to 16), not counted here.
    Blockwise pads each GEMM's inner dimension and the weight's other one to multiples of 128
    (its blocks and tiles); counted here for every GEMM's columns, an overestimate for the weight
    gradient's (a Hopper GPU pads those to 16)."""
    c = RECIPES[recipe]
    inner, cols = (_mx_aligned, _same) if recipe is Fp8Recipe.MXFP8 else (_aligned, _aligned)
    if recipe is Fp8Recipe.BLOCKWISE:
        inner = cols = _block_aligned
    elif recipe is Fp8Recipe.NVFP4:  # emulated: each GEMM's inner dimension to NVFP4's blocks of 16
        inner, cols = _aligned, _same
    gemms = [
        (name, names, shape)
        for name, names, shape, cast in (
            ("out", "MKN", (m, k, n), c.input),
            ("grad_x", "MNK", (m, n, k), c.grad_output),
            ("grad_w", "NMK", (n, m, k), c.input_for_grad_weight),
        )
        if cast.dtype is not None
    ]
    padded = [(name, names, (r, i, cc), (r, inner(i), cols(cc))) for name, names, (r, i, cc) in gemms]
    if all(s == p for _, _, s, p in padded):
        return None

    def traffic(r: int, i: int, cc: int) -> int:
        return r * i + i * cc + 2 * r * cc

    flops = sum(r * i * cc for _, _, (r, i, cc), _ in padded)
    extra_flops = sum(r * pi * pc for _, _, _, (r, pi, pc) in padded) - flops
    base = sum(traffic(*s) for _, _, s, _ in padded)
    extra_bytes = sum(traffic(*p) for _, _, _, p in padded) - base
    return Fp8Padding(tuple(padded), extra_flops / flops, extra_bytes / base)
