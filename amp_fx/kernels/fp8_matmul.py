"""The fp8 matmul of fp8 training: torchao 0.18's float8 training numerics, without its tensor subclass.

:func:`fp8_matmul` computes ``x @ w`` (``x``: ``[..., K]`` in the high-precision dtype, ``w``:
``[K, N]``, usually a transposed fp32 weight) with the three GEMMs of a linear layer in fp8:

    out    = x      @ w        (forward;   operands "input" and "weight")
    grad_x = grad   @ w.T      (backward;  "grad_output" and "weight")
    grad_w = x.T    @ grad     (backward;  "input" and "grad_output"; the result is w's gradient)

each operand scaled and cast as its recipe says (:data:`amp_fx.kernels.fp8_recipes.RECIPES`), and
``torch._scaled_mm`` run on exactly the layouts, scales and output dtype torchao's
``Float8TrainingTensor`` gives it. The op sequence is torchao's, function for function (the name
of the torchao function each helper reproduces is in its docstring), so the results are bitwise
with ``convert_to_float8_training`` on the same inputs; ``tests/fp8/`` checks it against
torchao itself.

Every shape: ``torch._scaled_mm`` on a GPU needs ``mat1``'s columns and both of ``mat2``'s
dimensions to be multiples of :data:`~amp_fx.kernels.fp8_recipes.ALIGNMENT`. Each GEMM whose
sizes are not pads its fp8 operands with zeros (:func:`amp_fx.kernels.fp8_padding.pad_for_scaled_mm`,
torchao's ``pad_inner_dim`` extended to ``mat2``'s columns) and slices the result, on every
device (the CPU kernel takes any size, but runs the same padded code, so what is tested here is
what a GPU runs). Scales are computed before, on the unpadded tensors: a zero never raises an
amax, so a padded tensor would give the same scales anyway, tensorwise and per row; the padded
columns of a rowwise ``mat2`` get the scale 1 (their data is zero and their output columns are
sliced off). ``tests/fp8/test_fp8_padding.py`` checks it bitwise with torchao's
``Float8LinearConfig(pad_inner_dim=True)``.

Why an ``autograd.Function`` of ATen ops and not a custom op: the fp8 pass puts a call of
:func:`fp8_matmul` in the captured graph, and AOTAutograd traces through the Function into the
forward graph and its backward into the backward graph, as ATen ops (``abs``, ``amax``, ``mul``,
``clamp``, the cast to fp8, ``_scaled_mm``). Inductor then fuses each amax and each
scale-and-cast into a few kernels around the ``_scaled_mm`` extern call, as it does for
torchao's own Function. A ``torch.library`` custom op would be opaque to inductor: its casts
would run as separate eager kernels.

Example (a [32, 16] x [16, 48] matmul in fp8, tensorwise):
    >>> import torch
    >>> from amp_fx.fp8 import Fp8Recipe
    >>> x = torch.randn(32, 16, dtype=torch.bfloat16, requires_grad=True)
    >>> w = torch.randn(48, 16, requires_grad=True)
    >>> out = fp8_matmul(x, w.t(), Fp8Recipe.TENSORWISE)
    >>> out.dtype, out.shape
    (torch.bfloat16, torch.Size([32, 48]))
    >>> out.float().sum().backward()
    >>> x.grad.dtype, w.grad.dtype
    (torch.bfloat16, torch.float32)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from amp_fx._common.matmul_output import matmul_output
from amp_fx.fp8 import Fp8Recipe, Nvfp4Options
from amp_fx.kernels import blockwise_fp8 as _bw
from amp_fx.kernels import mxfp8_matmul as _mx
from amp_fx.kernels import nvfp4 as _nv
from amp_fx.kernels.fp8_padding import pad_for_scaled_mm
from amp_fx.kernels.fp8_recipes import E4M3, EPS, RECIPES, Cast, RecipeCasts
from amp_fx.kernels.fp8_weight import fp8_parts

__all__ = [
    "fp8_matmul",
    "fp8_matmul_cached_weight",
    "weight_casts",
    "scale_from_amax",
    "input_cast",
    "to_fp8",
    "Fp8Input",
]


class Fp8Operand(NamedTuple):
    """An operand cast to fp8 (the fields of torchao's ``Float8TrainingTensor``)."""

    data: torch.Tensor
    scale: torch.Tensor
    """fp32: ``data = saturate(hp * scale)``; 0-dim (tensorwise) or keepdim-reduced (rowwise)."""
    orig_dtype: torch.dtype
    axiswise_dim: int | None
    """The dimension the scale was reduced over (0 or -1), None for tensorwise."""


def scale_from_amax(amax: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """torchao ``amax_to_scale``: ``fp8_max / max(amax, EPS)`` in float64, stored as float32 (also
    the scale FSDP2's fp8 all-gather casts each weight shard with: amp_fx._dist.fp8_gather)."""
    # torchao: "torch.compile and eager show different numerics for 1.0 / float32"; so float64.
    return (torch.finfo(dtype).max / torch.clamp(amax.to(torch.float64), min=EPS)).to(torch.float32)


@torch.no_grad()
def _scale(x: torch.Tensor, dtype: torch.dtype, axiswise_dim: int | None, pow2: bool) -> torch.Tensor:
    """torchao ``tensor_to_scale``: ``fp8_max / max(amax, EPS)`` in float64, stored as float32,
    optionally rounded down to a power of two (``_round_scale_down_to_power_of_2``)."""
    if axiswise_dim is None:
        amax = torch.max(torch.abs(x))
    else:
        amax = torch.amax(torch.abs(x), dim=axiswise_dim, keepdim=True)
    res = scale_from_amax(amax, dtype)
    if pow2:
        res = torch.exp2(torch.floor(torch.log2(res)))
    return res


def to_fp8(x: torch.Tensor, cast: Cast, axiswise_dim: int, pow2: bool) -> Fp8Operand | torch.Tensor:
    """torchao ``hp_tensor_to_float8_dynamic``: scale, multiply in fp32, saturate, cast
    (``_ToFloat8ConstrFunc.forward`` and ``to_fp8_saturated``). ``x`` itself when the cast keeps
    it in high precision."""
    if cast.dtype is None:
        return x
    if cast.dtype == E4M3 and not cast.rowwise and (parts := fp8_parts(x)) is not None:
        # cast before FSDP2's all-gather, with this rule's scale (amp_fx._dist.fp8_gather)
        return Fp8Operand(*parts, x.dtype, None)
    dim = axiswise_dim if cast.rowwise else None
    scale = _scale(x, cast.dtype, dim, pow2)
    scaled = x.to(torch.float32) * scale
    fp8_max = torch.finfo(cast.dtype).max
    data = scaled.clamp(min=-fp8_max, max=fp8_max).to(cast.dtype)
    return Fp8Operand(data, scale, x.dtype, dim)


def _t(a: Fp8Operand | torch.Tensor) -> Fp8Operand | torch.Tensor:
    """torchao ``float8_transpose`` for ``aten.t``."""
    if isinstance(a, torch.Tensor):
        return a.t()
    scale = a.scale.t() if a.scale.ndim > 1 else a.scale
    dim = None if a.axiswise_dim is None else (-1 if a.axiswise_dim == 0 else 0)
    return Fp8Operand(a.data.t(), scale, a.orig_dtype, dim)


def _rows(a: Fp8Operand | torch.Tensor) -> Fp8Operand | torch.Tensor:
    """``a.reshape(-1, K)`` (torchao ``float8_view``/``float8_desugar_op``: a rowwise scale over
    the last dimension becomes one per row of the result)."""
    if isinstance(a, torch.Tensor):
        return a.reshape(-1, a.shape[-1])
    data = a.data.reshape(-1, a.data.shape[-1])
    if a.scale.ndim < 2 or list(data.shape) == list(a.data.shape):
        return Fp8Operand(data, a.scale, a.orig_dtype, a.axiswise_dim)
    assert a.axiswise_dim == -1, "a rowwise input is scaled over its last dimension"
    return Fp8Operand(data, a.scale.reshape(data.shape[0], 1), a.orig_dtype, -1)


def _row_major(stride: tuple[int, ...]) -> bool:
    """torchao ``is_row_major``."""
    return stride[0] > stride[1] and stride[1] == 1


def scaled_matmul(a: Fp8Operand | torch.Tensor, b: Fp8Operand | torch.Tensor, fast_accum: bool) -> torch.Tensor:
    """torchao ``float8_mm`` (``preprocess_addmm`` + ``addmm_float8_unwrapped``); a plain
    ``torch.mm`` where both operands stay in high precision."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        assert isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor), (
            "a GEMM's operands are both fp8 or both high precision"
        )
        return torch.mm(a, b)
    a_data, a_scale, b_data, b_scale = a.data, a.scale, b.data, b.scale
    n = b_data.shape[1]
    a_data, b_data, b_scale = pad_for_scaled_mm(a_data, b_data, b_scale, b.axiswise_dim is not None)
    if not _row_major(a_data.stride()):
        a_data = a_data.contiguous()
    if _row_major(b_data.stride()):
        b_data = b_data.t().contiguous().t()
    # _scaled_mm takes one granularity for both operands: a tensorwise scale is repeated.
    if a.axiswise_dim is None and b.axiswise_dim is not None:
        a_scale = a_scale.repeat(a_data.shape[0]).reshape(-1, 1)
    elif a.axiswise_dim is not None and b.axiswise_dim is None:
        b_scale = b_scale.repeat(b_data.shape[1]).reshape(1, -1)
    output_dtype = a.orig_dtype

    a_inverse_scale = a_scale.reciprocal()
    b_inverse_scale = b_scale.reciprocal()
    post_inverse_scale = None
    rowwise = a_scale.shape == (a_data.shape[0], 1) and b_scale.shape == (1, b_data.shape[1])
    if rowwise and not fast_accum:
        # torchao: the rowwise kernel is slow without fast accumulation, so the tensorwise kernel
        # runs with unit scales and the scales are applied to its (rounded) output.
        post_inverse_scale = a_inverse_scale * b_inverse_scale
        a_inverse_scale = a_inverse_scale.new_ones(())
        b_inverse_scale = a_inverse_scale.new_ones(())
    orig_dtype = output_dtype
    if orig_dtype in (torch.float16, torch.float32) and rowwise:
        output_dtype = torch.bfloat16  # rowwise _scaled_mm has no fp16/fp32 output
    output = torch._scaled_mm(
        a_data,
        b_data,
        scale_a=a_inverse_scale,
        scale_b=b_inverse_scale,
        bias=None,
        scale_result=None,
        out_dtype=output_dtype,
        use_fast_accum=fast_accum,
    )
    if post_inverse_scale is not None:
        output *= post_inverse_scale
    if output.shape[1] != n:
        output = output[:, :n]  # b's padded columns: zeros, never part of the result
    if orig_dtype in (torch.float16, torch.float32) and rowwise:
        output = output.to(orig_dtype)
    return output


class _Fp8Matmul(torch.autograd.Function):
    """torchao ``matmul_with_hp_or_float8_args``: the hp inputs are saved, every cast is done
    where its GEMM needs it (the weight's forward cast is recomputed in the backward). With
    ``x_data`` given, ``x`` only receives the input's gradient (see :func:`fp8_matmul`)."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        w: torch.Tensor,
        recipe: Fp8Recipe,
        x_data: torch.Tensor | None = None,
        x_scale: torch.Tensor | None = None,
        x_dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        ctx.recipe = recipe
        c = RECIPES[recipe]
        pow2 = c.round_scales_to_power_of_2
        x_fp8 = _input_operand(x, x_data, x_scale, x_dtype, c)
        ctx.save_for_backward(*_input_to_save(ctx, x, x_data, x_scale, x_dtype), w)
        w_fp8 = to_fp8(w, c.weight, 0, pow2)
        out = scaled_matmul(_rows(x_fp8), w_fp8, c.fast_accum_output)
        return matmul_output(out, (*x.shape[:-1], out.shape[-1]))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        *xs, w = ctx.saved_tensors
        c = RECIPES[ctx.recipe]
        x = _saved_input(ctx, xs)
        w_dim0 = to_fp8(w, c.weight_for_grad_input, -1, c.round_scales_to_power_of_2)
        grad_x, grad_w = _backward_gemms(c, grad, x, w_dim0)
        return grad_x.to(ctx.x_dtype), grad_w, None, None, None, None


def _input_operand(
    x: torch.Tensor,
    x_data: torch.Tensor | None,
    x_scale: torch.Tensor | None,
    x_dtype: torch.dtype | None,
    c: RecipeCasts,
) -> Fp8Operand | torch.Tensor:
    """The forward GEMM's input operand: ``x`` cast by the recipe, or the cast made before
    (``x_data``, ``x_scale``: :func:`input_cast` of ``x_dtype`` values, for a recipe whose
    weight-gradient GEMM takes the same cast of the input, as the tensorwise one)."""
    if x_data is None:
        return to_fp8(x, c.input, -1, c.round_scales_to_power_of_2)
    assert x_scale is not None and x_dtype is not None
    if not (c.input == c.input_for_grad_weight and not c.input.rowwise and c.input.dtype is not None):
        raise ValueError(
            "amp_fx: fp8_matmul(x_fp8=...): an input cast before the matmul serves both GEMMs that read "
            "it (the output's and the weight gradient's): a tensorwise recipe only"
        )
    return Fp8Operand(x_data, x_scale, x_dtype, None)


def _input_to_save(
    ctx: Any, x: torch.Tensor, x_data: torch.Tensor | None, x_scale: torch.Tensor | None, x_dtype: torch.dtype | None
) -> tuple[torch.Tensor, ...]:
    """What the weight-gradient GEMM needs of the input: ``x`` (cast there, as torchao saves its hp
    input), or the cast given before (``x_data``, ``x_scale``). ``ctx`` keeps the dtypes that
    :func:`_saved_input` and the input gradient need."""
    ctx.x_dtype, ctx.operand_dtype = x.dtype, x_dtype
    if x_data is None:
        return (x,)
    assert x_scale is not None
    return (x_data, x_scale)


def _saved_input(ctx: Any, saved: Sequence[torch.Tensor]) -> torch.Tensor | Fp8Operand:
    """The input as :func:`_input_to_save` saved it: ``x``, or its cast as an :class:`Fp8Operand`."""
    if ctx.operand_dtype is None:
        return saved[0]
    return Fp8Operand(saved[0], saved[1], ctx.operand_dtype, None)


def input_cast(x: torch.Tensor, recipe: Fp8Recipe) -> tuple[torch.Tensor, torch.Tensor]:
    """``(data, scale)``: the fp8 cast of ``x`` that :func:`fp8_matmul` makes of its input (and,
    tensorwise, of the input of the weight-gradient GEMM). On a sharded DTensor the amax, and so
    the scale, is the whole tensor's (DTensor reduces it across ranks): each rank's part of the
    data is then the part of the whole tensor's cast (what gathering fp8 bytes relies on,
    :mod:`amp_fx.kernels.fp8_activation_gather`)."""
    c = RECIPES[recipe]
    a = to_fp8(x, c.input, -1, c.round_scales_to_power_of_2)
    assert isinstance(a, Fp8Operand), f"{recipe.value} keeps its input in high precision"
    return a.data, a.scale


def _backward_gemms(
    c: RecipeCasts, grad: torch.Tensor, x: torch.Tensor | Fp8Operand, w_dim0: Fp8Operand | torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The two backward GEMMs (torchao ``matmul_with_hp_or_float8_args.backward``), given the
    weight's input-gradient cast ``w_dim0``: ``(grad_x, grad_w as [K, N])``. ``x`` the input, or
    its tensorwise cast (which a tensorwise recipe's weight-gradient GEMM takes as it is, the
    same cast of the same values)."""
    pow2 = c.round_scales_to_power_of_2
    grad_2d = grad.reshape(-1, grad.shape[-1])

    grad_dim0 = to_fp8(grad_2d, c.grad_output, -1, pow2)
    grad_x = scaled_matmul(grad_dim0, _t(w_dim0), c.fast_accum_grad_input)
    grad_x = grad_x.reshape(*grad.shape[:-1], grad_x.shape[-1])

    grad_dim1 = to_fp8(grad_2d, c.grad_output_for_grad_weight, 0, pow2)
    if isinstance(x, Fp8Operand):
        x_dim1: Fp8Operand | torch.Tensor = _rows(x)
    else:
        x_dim1 = to_fp8(x.reshape(-1, x.shape[-1]), c.input_for_grad_weight, 0, pow2)
    grad_w = scaled_matmul(_t(grad_dim1), x_dim1, c.fast_accum_grad_weight)
    return grad_x, grad_w.t()


def weight_casts(w: torch.Tensor, recipe: Fp8Recipe, nvfp4: Nvfp4Options | None = None) -> tuple[torch.Tensor, ...]:
    """The weight's two casts of ``recipe``, as :class:`_Fp8Matmul` computes them from ``w``
    (``[K, N]``): ``(data, scale)`` for the forward GEMM, then for the input-gradient GEMM. What
    the weight cache (``weight_cache=True``) computes once per optimizer step and hands to
    :func:`fp8_matmul_cached_weight`. Same ops on the same values as the uncached path: bitwise.
    A cast that keeps the weight in high precision gives ``(w, empty scale)``. ``Fp8Recipe.NVFP4``
    (its switches ``nvfp4``): :func:`amp_fx.kernels.nvfp4.weight_casts`, five tensors (the amax last)."""
    if recipe is Fp8Recipe.NVFP4:
        return _nv.weight_casts(w, nvfp4 if nvfp4 is not None else Nvfp4Options())
    if recipe is Fp8Recipe.MXFP8:
        return _mx.mx_weight_casts(w)
    if recipe is Fp8Recipe.BLOCKWISE:  # one set of tiles serves both GEMMs (transposed for grad_x)
        tiles = _bw.weight_tiles(w)
        return tiles.data, tiles.inv_scale, tiles.data, tiles.inv_scale
    c = RECIPES[recipe]
    pow2 = c.round_scales_to_power_of_2
    out: list[torch.Tensor] = []
    with torch.no_grad():
        for cast, dim in ((c.weight, 0), (c.weight_for_grad_input, -1)):
            if out and cast == c.weight and not cast.rowwise:  # tensorwise twice: the same cast
                out += out[:2]
                continue
            a = to_fp8(w, cast, dim, pow2)
            out += [a.data, a.scale] if isinstance(a, Fp8Operand) else [a, a.new_empty(0, dtype=torch.float32)]
    return out[0], out[1], out[2], out[3]


def _cached(data: torch.Tensor, scale: torch.Tensor, cast: Cast, dim: int) -> Fp8Operand | torch.Tensor:
    """A cast :func:`weight_casts` made, as the uncached path's ``to_fp8`` returns it (the
    weight is always the right operand, whose ``orig_dtype`` no GEMM reads)."""
    if cast.dtype is None:
        return data
    return Fp8Operand(data, scale, torch.float32, dim if cast.rowwise else None)


class _Fp8MatmulCachedWeight(torch.autograd.Function):
    """:class:`_Fp8Matmul` with the weight's casts given (:func:`weight_casts`): the same GEMMs on
    the same operands; ``w`` carries the weight's gradient and is not read. Saves ``x`` and the
    input-gradient cast of the weight (one byte per element) instead of the fp32 weight."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        w: torch.Tensor,
        w_data: torch.Tensor,
        w_scale: torch.Tensor,
        wg_data: torch.Tensor,
        wg_scale: torch.Tensor,
        recipe: Fp8Recipe,
        x_data: torch.Tensor | None = None,
        x_scale: torch.Tensor | None = None,
        x_dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        ctx.recipe = recipe
        c = RECIPES[recipe]
        x_fp8 = _input_operand(x, x_data, x_scale, x_dtype, c)
        ctx.save_for_backward(*_input_to_save(ctx, x, x_data, x_scale, x_dtype), wg_data, wg_scale)
        w_fp8 = _cached(w_data, w_scale, c.weight, 0)
        out = scaled_matmul(_rows(x_fp8), w_fp8, c.fast_accum_output)
        return matmul_output(out, (*x.shape[:-1], out.shape[-1]))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        *xs, wg_data, wg_scale = ctx.saved_tensors
        c = RECIPES[ctx.recipe]
        x = _saved_input(ctx, xs)
        w_dim0 = _cached(wg_data, wg_scale, c.weight_for_grad_input, -1)
        grad_x, grad_w = _backward_gemms(c, grad, x, w_dim0)
        return grad_x.to(ctx.x_dtype), grad_w, None, None, None, None, None, None, None, None


Fp8Input = tuple[torch.Tensor, torch.Tensor, torch.dtype]
"""An fp8 matmul's input cast before it: ``(data, scale, dtype)``, :func:`input_cast` of the
input in ``dtype`` (the autocast dtype), for the tensorwise recipe. What sequence parallelism
all-gathers in fp8 (:func:`amp_fx.kernels.fp8_activation_gather.fp8_gather_input`)."""


def fp8_matmul_cached_weight(
    x: torch.Tensor,
    w: torch.Tensor,
    w_data: torch.Tensor,
    w_scale: torch.Tensor,
    wg_data: torch.Tensor,
    wg_scale: torch.Tensor,
    recipe: Fp8Recipe,
    x_fp8: Fp8Input | None = None,
) -> torch.Tensor:
    """:func:`fp8_matmul` with the weight's casts computed beforehand by :func:`weight_casts`
    (``weight_cache=True``: once per optimizer step); bitwise with ``fp8_matmul(x, w, recipe)``.
    ``w`` (the weight as ``[K, N]``) receives the gradient; its values are not read. ``x_fp8``:
    as :func:`fp8_matmul`'s."""
    if recipe is Fp8Recipe.MXFP8:
        assert x_fp8 is None, "mxfp8 casts its input in the matmul"
        return _mx.mxfp8_matmul_cached_weight(
            x, w, w_data, w_scale, wg_data, wg_scale, emulate=_mx.mx_kernels_missing(x.device.type) is not None
        )
    if recipe is Fp8Recipe.BLOCKWISE:
        assert x_fp8 is None, "blockwise casts its input in the matmul"
        return _bw.blockwise_fp8_matmul_cached_weight(
            x, w, w_data, w_scale, emulate=_bw.blockwise_kernels_missing(x.device.type) is not None
        )
    return _Fp8MatmulCachedWeight.apply(x, w, w_data, w_scale, wg_data, wg_scale, recipe, *(x_fp8 or (None,) * 3))


def fp8_matmul(x: torch.Tensor, w: torch.Tensor, recipe: Fp8Recipe, x_fp8: Fp8Input | None = None) -> torch.Tensor:
    """``x @ w`` in fp8 with ``recipe``'s numerics; the result has ``x``'s dtype.

    ``x``: ``[..., K]``, bf16/fp16 (fp32 runs too); ``w``: ``[K, N]`` in any float dtype (fp32
    for a master weight; torchao scales it from fp32, without a bf16 round trip). The
    gradients have the dtype of ``grad`` (the result's); autograd casts ``w``'s to ``w``'s dtype.
    ``Fp8Recipe.MXFP8`` runs :func:`amp_fx.kernels.mxfp8_matmul.mxfp8_matmul` (``w`` cast to
    ``x``'s dtype first; emulated where the device has no MX kernel); ``Fp8Recipe.BLOCKWISE``
    :func:`amp_fx.kernels.blockwise_fp8.blockwise_fp8_matmul` (emulated off Hopper).

    ``x_fp8``: the input's tensorwise cast, made before (:data:`Fp8Input`; the result then has
    its ``dtype``). ``x``'s values are not read: ``x`` (``x_fp8``'s shape, any float dtype)
    receives the input's gradient, in its own dtype.
    """
    if recipe is Fp8Recipe.MXFP8:
        assert x_fp8 is None, "mxfp8 casts its input in the matmul"
        return _mx.mxfp8_matmul(x, w, emulate=_mx.mx_kernels_missing(x.device.type) is not None)
    if recipe is Fp8Recipe.BLOCKWISE:
        assert x_fp8 is None, "blockwise casts its input in the matmul"
        return _bw.blockwise_fp8_matmul(x, w, emulate=_bw.blockwise_kernels_missing(x.device.type) is not None)
    return _Fp8Matmul.apply(x, w, recipe, *(x_fp8 or (None,) * 3))
