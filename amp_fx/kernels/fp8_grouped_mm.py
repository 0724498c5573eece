"""The fp8 grouped GEMM of mixture-of-experts layers: :func:`fp8_grouped_mm`, the grouped twin of
:func:`amp_fx.kernels.fp8_matmul.fp8_matmul`.

``fp8_grouped_mm(x, w, offs, recipe)`` computes what ``aten._grouped_mm(x, w, offs)`` does (``x``:
``[M, K]``, rows sorted by expert; ``w``: ``[E, K, N]``; ``offs``: ``[E]`` int32, the end row of
each expert's group) with the three GEMMs of each expert in fp8, with the numerics of an
``nn.Linear`` per expert converted by torchao (``convert_to_float8_training``) and called on its
group's rows, which is also what torchao's MoE training computes per group
(``torchao.prototype.moe_training.fp8_grouped_mm``: rowwise scales per row of ``x``, per expert
and output column of ``w``, per group and column for the weight gradient):

    out[g]    = x[g]      @ w[e]      (forward)
    grad_x[g] = grad[g]   @ w[e].T    (backward)
    grad_w[e] = x[g].T    @ grad[g]   (backward; ``g`` the rows of expert ``e``)

Each operand is scaled as the recipe says (:data:`amp_fx.kernels.fp8_recipes.RECIPES`), over the
group where the twin's ``nn.Linear`` would: a tensorwise scale of ``x`` is one per group, of
``w`` one per expert; a rowwise scale of ``x`` one per row; the weight gradient's operands are
scaled per group and column. The scales are computed in the graph, without reading ``offs`` on
the host (each row's group comes from ``searchsorted``; a group's amax from ``scatter_reduce``,
exact as every amax is), so inductor fuses them with the casts. The GEMMs run in one op,
``amp_fx::scaled_grouped_mm``: on a GPU, ``torch._scaled_grouped_mm`` with rowwise scales (a
tensorwise scale repeated per row) for the forward and input-gradient GEMMs where its rules hold
(sm_90+, K and N multiples of 16; not run on a GPU by amp_fx's tests, which have none); elsewhere
(the CPU, where ``_scaled_grouped_mm`` has no kernel, and the weight gradient, which groups the
inner dimension) one ``torch._scaled_mm`` per group with the same scales,
through the same code as :func:`~amp_fx.kernels.fp8_matmul.fp8_matmul` (padding included), so the
CPU results are bitwise with torchao converting the ``nn.Linear``-per-expert twin
(``tests/fp8/test_fp8_experts.py``).

Rows past ``offs[-1]`` (transformers' expert-parallel sentinels) give zeros. An empty group gives
no rows and a zero weight gradient.

Example:
    >>> import torch
    >>> from amp_fx.fp8 import Fp8Recipe
    >>> x = torch.randn(12, 16, dtype=torch.bfloat16, requires_grad=True)
    >>> w = torch.randn(3, 16, 32, requires_grad=True)
    >>> offs = torch.tensor([4, 4, 12], dtype=torch.int32)
    >>> out = fp8_grouped_mm(x, w, offs, Fp8Recipe.TENSORWISE)
    >>> out.dtype, out.shape
    (torch.bfloat16, torch.Size([12, 32]))
    >>> out.float().sum().backward()
    >>> x.grad.dtype, w.grad.dtype, bool(w.grad[1].eq(0).all())
    (torch.bfloat16, torch.float32, True)
"""

from __future__ import annotations

from typing import Any

import torch

from amp_fx.fp8 import Fp8Recipe
from amp_fx.kernels.blockwise_fp8 import blockwise_fp8_grouped_mm
from amp_fx.kernels.fp8_matmul import Fp8Operand, scaled_matmul
from amp_fx.kernels.fp8_recipes import ALIGNMENT, EPS, RECIPES, Cast

__all__ = ["fp8_grouped_mm", "grouped_mm_flops", "grouped_mm_operands"]

_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def grouped_mm_operands(args: Any, kwargs: dict[str, Any]) -> tuple[Any, Any, Any] | None:
    """``(x, w, offs)`` of a call ``grouped_mm(x, w, offs)`` (its values, or its FX nodes): offsets
    given, no bias or out_dtype; None for any other call (what the fp8 kernels do not take)."""
    if len(args) < 2:
        return None
    offs = args[2] if len(args) > 2 else kwargs.get("offs")
    extra = [a for a in (*args[3:], *(v for k, v in kwargs.items() if k != "offs")) if a is not None]
    if offs is None or extra:
        return None
    return args[0], args[1], offs


def grouped_mm_flops(m: int, k: int, n: int) -> int:
    """FLOPs of a grouped GEMM ``[M, K] x [E, K, N]``: each row meets one expert, ``2 M K N``."""
    return 2 * m * k * n


# --- the GEMMs: amp_fx::scaled_grouped_mm ----------------------------------------------------------


def _gpu_ready(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype) -> bool:
    """Whether ``torch._scaled_grouped_mm`` takes these operands: an sm_90+ GPU, fp8, bf16 output,
    the row-grouped form (``[M, K] x [E, K, N]``; a group's row count may be anything) with K and N
    multiples of 16. The weight-gradient form groups the inner dimension, whose group sizes the
    kernel wants aligned and which are known only on the device: it runs per group."""
    if a.device.type != "cuda" or a.dtype not in _FP8 or out_dtype is not torch.bfloat16 or b.dim() != 3:
        return False
    if torch.cuda.get_device_capability(a.device) < (9, 0):
        return False
    return a.shape[-1] % ALIGNMENT == 0 and b.shape[-1] % ALIGNMENT == 0


def _on_gpu(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    offs: torch.Tensor,
    a_rowwise: bool,
    b_rowwise: bool,
    out_dtype: torch.dtype,
    fast_accum: bool,
) -> torch.Tensor:
    """One ``torch._scaled_grouped_mm``, row-grouped (rowwise scales; a tensorwise one repeated per
    row of its group, or per column of its expert)."""
    groups = offs.numel()
    m, n = a.shape[0], b.shape[-1]  # [M, K] x [E, K, N]
    if a_rowwise:
        sa = scale_a.reshape(m)
    else:
        rows = torch.searchsorted(offs, torch.arange(m, device=a.device, dtype=offs.dtype), right=True)
        sa = scale_a[rows.clamp(max=groups - 1)]
    sb = scale_b.reshape(groups, n) if b_rowwise else scale_b[:, None].expand(groups, n).contiguous()
    b = b.transpose(-2, -1).contiguous().transpose(-2, -1)  # column-major per expert
    return torch._scaled_grouped_mm(
        a.contiguous(),
        b,
        sa.reciprocal(),
        sb.reciprocal(),
        offs=offs.to(torch.int32),
        out_dtype=out_dtype,
        use_fast_accum=fast_accum,
    )


@torch.library.custom_op("amp_fx::scaled_grouped_mm", mutates_args=())
def _scaled_grouped_mm(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    offs: torch.Tensor,
    a_rowwise: bool,
    b_rowwise: bool,
    out_dtype: torch.dtype,
    fast_accum: bool,
) -> torch.Tensor:
    """The GEMMs of one grouped fp8 matmul, ``a`` and ``b`` already cast (or both in high precision,
    scales empty). Two forms, as ``torch._scaled_grouped_mm``'s:

    * ``a`` ``[M, K]``, ``b`` ``[E, K, N]`` -> ``[M, N]``: rows of group ``e`` times ``b[e]``;
      ``scale_a`` ``[M, 1]`` (rowwise) or ``[E]``, ``scale_b`` ``[E, 1, N]`` or ``[E]``;
    * ``a`` ``[N, M]``, ``b`` ``[M, K]`` -> ``[E, N, K]``: columns of group ``e`` of ``a`` times its
      rows of ``b``; ``scale_a`` ``[E, N, 1]`` or ``[E]``, ``scale_b`` ``[E, 1, K]`` or ``[E]``.

    Scales multiply (``data = hp * scale``), as :class:`~amp_fx.kernels.fp8_matmul.Fp8Operand`'s."""
    if _gpu_ready(a, b, out_dtype):
        return _on_gpu(a, b, scale_a, scale_b, offs, a_rowwise, b_rowwise, out_dtype, fast_accum)
    fp8 = a.dtype in _FP8
    ends = offs.tolist()  # a host read: free on the CPU; on a GPU where _scaled_grouped_mm does not run
    grouped_rows = b.dim() == 3
    if grouped_rows:
        out = torch.zeros(a.shape[0], b.shape[-1], dtype=out_dtype, device=a.device)
    else:
        out = torch.zeros(len(ends), a.shape[0], b.shape[1], dtype=out_dtype, device=a.device)
    start = 0
    for e, end in enumerate(ends):
        end = min(end, a.shape[0] if grouped_rows else b.shape[0])
        if end <= start:
            start = max(start, end)
            continue
        if grouped_rows:
            ae, be = a[start:end], b[e]
            sa = scale_a[start:end] if a_rowwise else (scale_a[e] if fp8 else None)
        else:
            ae, be = a[:, start:end], b[start:end]
            sa = scale_a[e] if fp8 else None
        if fp8:
            assert sa is not None  # set above whenever fp8
            res = scaled_matmul(
                Fp8Operand(ae, sa, out_dtype, -1 if a_rowwise else None),
                Fp8Operand(be, scale_b[e], torch.float32, 0 if b_rowwise else None),
                fast_accum,
            )
        else:
            res = torch.mm(ae, be)
        if grouped_rows:
            out[start:end] = res
        else:
            out[e] = res
        start = end
    return out


@_scaled_grouped_mm.register_fake
def _(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    offs: torch.Tensor,
    a_rowwise: bool,
    b_rowwise: bool,
    out_dtype: torch.dtype,
    fast_accum: bool,
) -> torch.Tensor:
    if b.dim() == 3:
        return a.new_empty(a.shape[0], b.shape[-1], dtype=out_dtype)
    return a.new_empty(offs.shape[0], a.shape[0], b.shape[1], dtype=out_dtype)


# --- the casts, per group, in the graph --------------------------------------------------------------


def _scale(amax: torch.Tensor, dtype: torch.dtype, pow2: bool) -> torch.Tensor:
    """torchao ``amax_to_scale`` (as :func:`amp_fx.kernels.fp8_matmul._scale` after its amax)."""
    amax = amax.to(torch.float64)
    res = torch.finfo(dtype).max / torch.clamp(amax, min=EPS)
    res = res.to(torch.float32)
    if pow2:
        res = torch.exp2(torch.floor(torch.log2(res)))
    return res


def _saturate(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """torchao ``to_fp8_saturated(x.to(float32) * scale)``."""
    fp8_max = torch.finfo(dtype).max
    return (x.to(torch.float32) * scale).clamp(min=-fp8_max, max=fp8_max).to(dtype)


def _groups(offs: torch.Tensor, m: int, device: torch.device) -> torch.Tensor:
    """Each row's group (``E`` for rows past ``offs[-1]``), without a host read."""
    rows = torch.arange(m, device=device, dtype=offs.dtype)
    return torch.searchsorted(offs, rows, right=True)


def _group_amax(a: torch.Tensor, rows: torch.Tensor, groups: int, per_column: bool) -> torch.Tensor:
    """amax of ``|a|`` over each group's rows: ``[E + 1, cols]`` (per column) or ``[E + 1]`` (the last
    slot: rows past the last group). Exact (a max), in ``a``'s dtype, as torchao's ``torch.max``."""
    mag = torch.abs(a)
    if per_column:
        init = mag.new_zeros(groups + 1, a.shape[1])
        return init.scatter_reduce(0, rows[:, None].expand_as(mag), mag, "amax", include_self=True)
    init = mag.new_zeros(groups + 1)
    return init.scatter_reduce(0, rows, torch.amax(mag, dim=-1), "amax", include_self=True)


@torch.no_grad()
def _cast_rows(
    a: torch.Tensor, cast: Cast, rows: torch.Tensor, groups: int, pow2: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """``a`` (``[M, K]``) as the left operand of the row-grouped form: data and scale (``[M, 1]`` per
    row, or ``[E]`` per group), or ``(a, empty)`` in high precision."""
    if cast.dtype is None:
        return a, a.new_empty(0, dtype=torch.float32)
    if cast.rowwise:
        scale = _scale(torch.amax(torch.abs(a), dim=-1, keepdim=True), cast.dtype, pow2)
        return _saturate(a, scale, cast.dtype), scale
    scale = _scale(_group_amax(a, rows, groups, False), cast.dtype, pow2)
    return _saturate(a, scale[rows][:, None], cast.dtype), scale[:groups]


@torch.no_grad()
def _cast_columns(
    a: torch.Tensor, cast: Cast, rows: torch.Tensor, groups: int, pow2: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """``a`` (``[M, C]``) for the weight-gradient GEMM, scaled per group (and per column where
    rowwise: torchao's axiswise dim 0 over the group's rows): data ``[M, C]`` and scale ``[E, C]``
    or ``[E]``."""
    if cast.dtype is None:
        return a, a.new_empty(0, dtype=torch.float32)
    scale = _scale(_group_amax(a, rows, groups, cast.rowwise), cast.dtype, pow2)
    per_row = scale[rows] if cast.rowwise else scale[rows][:, None]
    return _saturate(a, per_row, cast.dtype), scale[:groups]


@torch.no_grad()
def _cast_experts(w: torch.Tensor, cast: Cast, over: int, pow2: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``w`` (``[E, K, N]``) per expert: rowwise over dimension ``over`` (1: one scale per output
    column, the forward's; 2: one per input row, the input gradient's), else one per expert."""
    if cast.dtype is None:
        return w, w.new_empty(0, dtype=torch.float32)
    mag = torch.abs(w)
    amax = torch.amax(mag, dim=over, keepdim=True) if cast.rowwise else torch.amax(mag, dim=(1, 2))
    scale = _scale(amax, cast.dtype, pow2)
    return _saturate(w, scale if cast.rowwise else scale[:, None, None], cast.dtype), scale


def _high_precision(x: torch.Tensor, w: torch.Tensor, cast: Cast) -> torch.Tensor:
    return w.to(x.dtype) if cast.dtype is None else w


class _Fp8GroupedMm(torch.autograd.Function):
    """torchao's ``matmul_with_hp_or_float8_args`` per group: the hp inputs are saved, every cast
    made where its GEMM needs it."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, recipe: Fp8Recipe) -> torch.Tensor:
        ctx.save_for_backward(x, w, offs)
        ctx.recipe = recipe
        c = RECIPES[recipe]
        pow2, groups = c.round_scales_to_power_of_2, w.shape[0]
        rows = _groups(offs, x.shape[0], x.device)
        xa, xs = _cast_rows(x, c.input, rows, groups, pow2)
        wb, ws = _cast_experts(w, c.weight, 1, pow2)
        return _scaled_grouped_mm(
            xa,
            _high_precision(x, wb, c.weight),
            xs,
            ws,
            offs,
            c.input.rowwise,
            c.weight.rowwise,
            x.dtype,
            c.fast_accum_output,
        )

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, w, offs = ctx.saved_tensors
        c = RECIPES[ctx.recipe]
        pow2, groups = c.round_scales_to_power_of_2, w.shape[0]
        rows = _groups(offs, x.shape[0], x.device)
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            ga, gs = _cast_rows(grad, c.grad_output, rows, groups, pow2)
            wb, ws = _cast_experts(w, c.weight_for_grad_input, 2, pow2)  # scale [E, K, 1]
            wb = _high_precision(grad, wb, c.weight_for_grad_input).transpose(-2, -1)
            grad_x = _scaled_grouped_mm(
                ga,
                wb,
                gs,
                ws.transpose(-2, -1) if ws.dim() == 3 else ws,
                offs,
                c.grad_output.rowwise,
                c.weight_for_grad_input.rowwise,
                grad.dtype,
                c.fast_accum_grad_input,
            )
        if ctx.needs_input_grad[1]:
            ga, gs = _cast_columns(grad, c.grad_output_for_grad_weight, rows, groups, pow2)
            xb, xs = _cast_columns(x, c.input_for_grad_weight, rows, groups, pow2)
            rowwise_a, rowwise_b = c.grad_output_for_grad_weight.rowwise, c.input_for_grad_weight.rowwise
            grad_w = _scaled_grouped_mm(
                ga.t(),
                xb,
                gs[:, :, None] if rowwise_a else gs,
                xs[:, None, :] if rowwise_b else xs,
                offs,
                rowwise_a,
                rowwise_b,
                grad.dtype,
                c.fast_accum_grad_weight,
            ).transpose(-2, -1)
        return grad_x, grad_w, None, None


def fp8_grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, recipe: Fp8Recipe) -> torch.Tensor:
    """``aten._grouped_mm(x, w, offs)`` in fp8 with ``recipe``'s numerics per group (module doc);
    the result has ``x``'s dtype. ``x``: ``[M, K]`` bf16/fp16; ``w``: ``[E, K, N]`` (the fp32
    master weight, usually a transposed view of the parameter); ``offs``: ``[E]`` int32 or int64.
    ``Fp8Recipe.BLOCKWISE`` runs :func:`amp_fx.kernels.blockwise_fp8.blockwise_fp8_grouped_mm`."""
    if recipe is Fp8Recipe.BLOCKWISE:
        return blockwise_fp8_grouped_mm(x, w, offs)
    return _Fp8GroupedMm.apply(x, w, offs, recipe)
