"""The fp8 matmul of fp8 training: torchao 0.18's float8 training numerics, without its tensor subclass.

:func:`fp8_matmul` computes ``x @ w`` (``x``: ``[..., K]`` in the high-precision dtype, ``w``:
``[K, N]``, usually a transposed fp32 weight) with the three GEMMs of a linear layer in fp8:

    out    = x      @ w        (forward;   operands "input" and "weight")
    grad_x = grad   @ w.T      (backward;  "grad_output" and "weight")
    grad_w = x.T    @ grad     (backward;  "input" and "grad_output"; the result is w's gradient)

each operand scaled and cast as its recipe says (:data:`RECIPES`), and ``torch._scaled_mm`` run
on exactly the layouts, scales and output dtype torchao's ``Float8TrainingTensor`` gives it. The
op sequence is torchao's, function for function (the name of the torchao function each helper
reproduces is in its docstring), so the results are bitwise with ``convert_to_float8_training``
on the same inputs; ``tests/test_fp8.py`` checks it against torchao itself.

Every shape: ``torch._scaled_mm`` on a GPU needs ``mat1``'s columns and both of ``mat2``'s
dimensions to be multiples of :data:`ALIGNMENT`. Each GEMM whose sizes are not pads its fp8
operands with zeros (:func:`_pad_for_scaled_mm`, torchao's ``pad_inner_dim`` extended to
``mat2``'s columns) and slices the result, on every device (the CPU kernel takes any size, but
runs the same padded code, so what is tested here is what a GPU runs). Scales are computed
before, on the unpadded tensors: a zero never raises an amax, so a padded tensor would give the
same scales anyway, tensorwise and per row; the padded columns of a rowwise ``mat2`` get the scale
1 (their data is zero and their output columns are sliced off). ``tests/test_fp8_padding.py``
checks it bitwise with torchao's ``Float8LinearConfig(pad_inner_dim=True)``.

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

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from amp_fx._common.matmul_output import matmul_output
from amp_fx.fp8 import Fp8Recipe
from amp_fx.kernels import mxfp8_matmul as _mx
from amp_fx.kernels.fp8_weight import fp8_parts

__all__ = ["fp8_matmul", "fp8_matmul_cached_weight", "weight_casts", "RECIPES", "RecipeCasts", "Cast", "E4M3",
           "E5M2", "EPS", "ALIGNMENT", "scale_from_amax", "Fp8Padding", "padding", "rowwise_scales_missing",
           "fp8_tensor_cores_missing"]

ALIGNMENT = 16
"""``torch._scaled_mm`` on CUDA needs ``mat1``'s columns and both of ``mat2``'s dimensions to be
multiples of 16 (``mat1``'s rows may be anything). The CPU kernel takes any size; the fp8 matmul
pads to this rule on every device, so the CPU runs the GPU's code path."""

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
EPS = 1e-12
"""torchao's floor on amax (``torchao.float8.float8_utils.EPS``): a zero tensor gets a finite scale."""


@dataclass(frozen=True)
class Cast:
    """How one operand enters one GEMM: its fp8 dtype and scale granularity; ``dtype=None``
    keeps it in the high-precision dtype (torchao's ``ScalingType.DISABLED``)."""

    dtype: torch.dtype | None
    rowwise: bool = False
    block: int = 0
    """MX: one e8m0 scale per ``block`` elements along the GEMM's inner dimension (0: not MX)."""

    @property
    def label(self) -> str:
        if self.dtype is None:
            return "high precision"
        if self.block:
            return f"e4m3, e8m0 scale per {self.block}"
        return f"{'e4m3' if self.dtype is E4M3 else 'e5m2'} {'rowwise' if self.rowwise else 'tensorwise'}"


@dataclass(frozen=True)
class RecipeCasts:
    """A recipe as torchao's ``Float8LinearConfig.from_recipe_name`` builds it: the cast of each
    operand in each GEMM (the ``cast_config_*`` fields), whether scales are rounded down to a
    power of two, and ``use_fast_accum`` per GEMM (``gemm_config_*``; the default
    ``Float8LinearConfig`` asks for it on the output GEMM only)."""

    input: Cast
    weight: Cast
    grad_output: Cast
    input_for_grad_weight: Cast
    weight_for_grad_input: Cast
    grad_output_for_grad_weight: Cast
    round_scales_to_power_of_2: bool
    fast_accum_output: bool = True
    fast_accum_grad_input: bool = False
    fast_accum_grad_weight: bool = False

    @property
    def granularity(self) -> str:
        """The scale granularity of the forward GEMM, for inspection (``tensorwise``/``rowwise``/``mx``)."""
        if self.input.block:
            return f"mx (blocks of {self.input.block})"
        return "rowwise" if self.input.rowwise else "tensorwise"

    @property
    def rowwise(self) -> bool:
        """Whether some GEMM takes rowwise scales (``_scaled_mm``'s rowwise kernel)."""
        return any(c.rowwise for c in (self.input, self.weight, self.grad_output,
                                       self.input_for_grad_weight, self.weight_for_grad_input,
                                       self.grad_output_for_grad_weight))


_HP = Cast(None)
_MX = Cast(E4M3, block=_mx.BLOCK)
RECIPES: Mapping[Fp8Recipe, RecipeCasts] = MappingProxyType({
    # torchao/float8/config.py, Float8LinearConfig.from_recipe_name (0.18.0)
    Fp8Recipe.TENSORWISE: RecipeCasts(
        input=Cast(E4M3), weight=Cast(E4M3), grad_output=Cast(E5M2),
        input_for_grad_weight=Cast(E4M3), weight_for_grad_input=Cast(E4M3),
        grad_output_for_grad_weight=Cast(E5M2), round_scales_to_power_of_2=False),
    Fp8Recipe.ROWWISE: RecipeCasts(
        input=Cast(E4M3, True), weight=Cast(E4M3, True), grad_output=Cast(E4M3, True),
        input_for_grad_weight=Cast(E4M3, True), weight_for_grad_input=Cast(E4M3, True),
        grad_output_for_grad_weight=Cast(E4M3, True), round_scales_to_power_of_2=True),
    Fp8Recipe.ROWWISE_WITH_GW_HP: RecipeCasts(
        input=Cast(E4M3, True), weight=Cast(E4M3, True), grad_output=Cast(E4M3, True),
        input_for_grad_weight=_HP, weight_for_grad_input=Cast(E4M3),
        grad_output_for_grad_weight=_HP, round_scales_to_power_of_2=True),
    # torchao/prototype/moe_training/mxfp8_linear.py, _to_mxfp8_then_scaled_mm (0.18.0): all e4m3,
    # block 32, RCEIL; computed by amp_fx.kernels.mxfp8_matmul, not by _Fp8Matmul.
    Fp8Recipe.MXFP8: RecipeCasts(
        input=_MX, weight=_MX, grad_output=_MX, input_for_grad_weight=_MX, weight_for_grad_input=_MX,
        grad_output_for_grad_weight=_MX, round_scales_to_power_of_2=True),
})
"""Each recipe's casts, as torchao 0.18 defines them."""


@functools.cache
def rowwise_scales_missing(device_type: str) -> str | None:
    """None if ``torch._scaled_mm`` takes rowwise scales on ``device_type``, else why not.

    A feature test on a 16 x 16 GEMM, run once: torch 2.11's CPU kernel takes per-tensor scales
    only ("Now _scaled_mm only supports per-tensor scaling for CPU backend"), 2.13's takes both.
    CUDA's rowwise kernel needs an sm_89+ GPU and is not probed here (no device is touched)."""
    if device_type != "cpu":
        return None
    a = torch.zeros(16, 16).to(E4M3)
    try:
        torch._scaled_mm(a, a.t().contiguous().t(), scale_a=torch.ones(16, 1), scale_b=torch.ones(1, 16),
                         out_dtype=torch.bfloat16)
    except RuntimeError as e:
        first = str(e).strip().splitlines()[0][:120]
        return f"torch {torch.__version__}'s CPU torch._scaled_mm takes per-tensor scales only ({first})"
    return None


_MIN_CAPABILITY = (8, 9)
"""fp8 tensor cores (per-tensor and rowwise ``torch._scaled_mm``): Ada (sm_89), Hopper (sm_90) and later."""


@functools.cache
def fp8_tensor_cores_missing(device_type: str) -> str | None:
    """None where ``torch._scaled_mm`` runs tensorwise and rowwise fp8 on tensor cores, else why not.

    Asks the CUDA device's compute capability once; touches no tensor."""
    if device_type != "cuda" or not torch.cuda.is_available():
        return (f"{device_type} has no fp8 tensor cores, so torch._scaled_mm runs its reference kernel (it "
                f"converts the fp8 operands and multiplies them with a float matmul)")
    if torch.version.hip is not None:
        return None
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) < _MIN_CAPABILITY:
        return (f"{torch.cuda.get_device_name()} (compute capability {major}.{minor}) has no fp8 tensor cores: "
                f"torch._scaled_mm needs compute capability 8.9+")
    return None


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


def _to_fp8(x: torch.Tensor, cast: Cast, axiswise_dim: int, pow2: bool) -> Fp8Operand | torch.Tensor:
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


def _aligned(size: int) -> int:
    """``size`` rounded up to a multiple of :data:`ALIGNMENT` (torchao ``_get_min_alignment``)."""
    return -(-size // ALIGNMENT) * ALIGNMENT


def _pad_for_scaled_mm(a_data: torch.Tensor, b_data: torch.Tensor, b_scale: torch.Tensor, b_rowwise: bool
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


def _same(size: int) -> int:
    return size


def padding(m: int, k: int, n: int, recipe: Fp8Recipe) -> Fp8Padding | None:
    """What :func:`fp8_matmul` pads for an ``[M, K] @ [K, N]`` with ``recipe`` (the rule of
    :func:`_pad_for_scaled_mm`: each GEMM's inner dimension and columns), None where every fp8
    GEMM's sizes are already multiples of 16. MXFP8 pads each GEMM's inner dimension to a
    multiple of 32 (its blocks); its columns only on a Blackwell GPU (to 16), not counted here."""
    c = RECIPES[recipe]
    inner, cols = (_mx_aligned, _same) if recipe is Fp8Recipe.MXFP8 else (_aligned, _aligned)
    gemms = [(name, names, shape) for name, names, shape, cast in (
        ("out", "MKN", (m, k, n), c.input), ("grad_x", "MNK", (m, n, k), c.grad_output),
        ("grad_w", "NMK", (n, m, k), c.input_for_grad_weight)) if cast.dtype is not None]
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


def scaled_matmul(a: Fp8Operand | torch.Tensor, b: Fp8Operand | torch.Tensor, fast_accum: bool) -> torch.Tensor:
    """torchao ``float8_mm`` (``preprocess_addmm`` + ``addmm_float8_unwrapped``); a plain
    ``torch.mm`` where both operands stay in high precision."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        assert isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor), \
            "a GEMM's operands are both fp8 or both high precision"
        return torch.mm(a, b)
    a_data, a_scale, b_data, b_scale = a.data, a.scale, b.data, b.scale
    n = b_data.shape[1]
    a_data, b_data, b_scale = _pad_for_scaled_mm(a_data, b_data, b_scale, b.axiswise_dim is not None)
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
    output = torch._scaled_mm(a_data, b_data, scale_a=a_inverse_scale, scale_b=b_inverse_scale,
                              bias=None, scale_result=None, out_dtype=output_dtype,
                              use_fast_accum=fast_accum)
    if post_inverse_scale is not None:
        output *= post_inverse_scale
    if output.shape[1] != n:
        output = output[:, :n]  # b's padded columns: zeros, never part of the result
    if orig_dtype in (torch.float16, torch.float32) and rowwise:
        output = output.to(orig_dtype)
    return output


class _Fp8Matmul(torch.autograd.Function):
    """torchao ``matmul_with_hp_or_float8_args``: the hp inputs are saved, every cast is done
    where its GEMM needs it (the weight's forward cast is recomputed in the backward)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, recipe: Fp8Recipe) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        ctx.recipe = recipe
        c = RECIPES[recipe]
        pow2 = c.round_scales_to_power_of_2
        x_fp8 = _to_fp8(x, c.input, -1, pow2)
        w_fp8 = _to_fp8(w, c.weight, 0, pow2)
        out = scaled_matmul(_rows(x_fp8), w_fp8, c.fast_accum_output)
        return matmul_output(out, (*x.shape[:-1], out.shape[-1]))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, w = ctx.saved_tensors
        c = RECIPES[ctx.recipe]
        w_dim0 = _to_fp8(w, c.weight_for_grad_input, -1, c.round_scales_to_power_of_2)
        return (*_backward_gemms(c, grad, x, w_dim0), None)


def _backward_gemms(c: RecipeCasts, grad: torch.Tensor, x: torch.Tensor, w_dim0: Fp8Operand | torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """The two backward GEMMs (torchao ``matmul_with_hp_or_float8_args.backward``), given the
    weight's input-gradient cast ``w_dim0``: ``(grad_x, grad_w as [K, N])``."""
    pow2 = c.round_scales_to_power_of_2
    grad_2d = grad.reshape(-1, grad.shape[-1])

    grad_dim0 = _to_fp8(grad_2d, c.grad_output, -1, pow2)
    grad_x = scaled_matmul(grad_dim0, _t(w_dim0), c.fast_accum_grad_input)
    grad_x = grad_x.reshape(*grad.shape[:-1], grad_x.shape[-1])

    x_2d = x.reshape(-1, x.shape[-1])
    grad_dim1 = _to_fp8(grad_2d, c.grad_output_for_grad_weight, 0, pow2)
    x_dim1 = _to_fp8(x_2d, c.input_for_grad_weight, 0, pow2)
    grad_w = scaled_matmul(_t(grad_dim1), x_dim1, c.fast_accum_grad_weight)
    return grad_x, grad_w.t()


def weight_casts(w: torch.Tensor, recipe: Fp8Recipe) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The weight's two casts of ``recipe``, as :class:`_Fp8Matmul` computes them from ``w``
    (``[K, N]``): ``(data, scale)`` for the forward GEMM, then for the input-gradient GEMM. What
    the weight cache (``weight_cache=True``) computes once per optimizer step and hands to
    :func:`fp8_matmul_cached_weight`. Same ops on the same values as the uncached path: bitwise.
    A cast that keeps the weight in high precision gives ``(w, empty scale)``."""
    if recipe is Fp8Recipe.MXFP8:
        return _mx.mx_weight_casts(w)
    c = RECIPES[recipe]
    pow2 = c.round_scales_to_power_of_2
    out: list[torch.Tensor] = []
    with torch.no_grad():
        for cast, dim in ((c.weight, 0), (c.weight_for_grad_input, -1)):
            if out and cast == c.weight and not cast.rowwise:  # tensorwise twice: the same cast
                out += out[:2]
                continue
            a = _to_fp8(w, cast, dim, pow2)
            out += [a.data, a.scale] if isinstance(a, Fp8Operand) else [a, a.new_empty(0, dtype=torch.float32)]
    return out[0], out[1], out[2], out[3]


def _cached(data: torch.Tensor, scale: torch.Tensor, cast: Cast, dim: int) -> Fp8Operand | torch.Tensor:
    """A cast :func:`weight_casts` made, as the uncached path's ``_to_fp8`` returns it (the
    weight is always the right operand, whose ``orig_dtype`` no GEMM reads)."""
    if cast.dtype is None:
        return data
    return Fp8Operand(data, scale, torch.float32, dim if cast.rowwise else None)


class _Fp8MatmulCachedWeight(torch.autograd.Function):
    """:class:`_Fp8Matmul` with the weight's casts given (:func:`weight_casts`): the same GEMMs on
    the same operands; ``w`` carries the weight's gradient and is not read. Saves ``x`` and the
    input-gradient cast of the weight (one byte per element) instead of the fp32 weight."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, w_data: torch.Tensor, w_scale: torch.Tensor,
                wg_data: torch.Tensor, wg_scale: torch.Tensor, recipe: Fp8Recipe) -> torch.Tensor:
        ctx.save_for_backward(x, wg_data, wg_scale)
        ctx.recipe = recipe
        c = RECIPES[recipe]
        x_fp8 = _to_fp8(x, c.input, -1, c.round_scales_to_power_of_2)
        w_fp8 = _cached(w_data, w_scale, c.weight, 0)
        out = scaled_matmul(_rows(x_fp8), w_fp8, c.fast_accum_output)
        return matmul_output(out, (*x.shape[:-1], out.shape[-1]))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, wg_data, wg_scale = ctx.saved_tensors
        c = RECIPES[ctx.recipe]
        w_dim0 = _cached(wg_data, wg_scale, c.weight_for_grad_input, -1)
        return (*_backward_gemms(c, grad, x, w_dim0), None, None, None, None, None)


def fp8_matmul_cached_weight(x: torch.Tensor, w: torch.Tensor, w_data: torch.Tensor, w_scale: torch.Tensor,
                             wg_data: torch.Tensor, wg_scale: torch.Tensor, recipe: Fp8Recipe) -> torch.Tensor:
    """:func:`fp8_matmul` with the weight's casts computed beforehand by :func:`weight_casts`
    (``weight_cache=True``: once per optimizer step); bitwise with ``fp8_matmul(x, w, recipe)``.
    ``w`` (the weight as ``[K, N]``) receives the gradient; its values are not read."""
    if recipe is Fp8Recipe.MXFP8:
        return _mx.mxfp8_matmul_cached_weight(x, w, w_data, w_scale, wg_data, wg_scale,
                                              emulate=_mx.mx_kernels_missing(x.device.type) is not None)
    return _Fp8MatmulCachedWeight.apply(x, w, w_data, w_scale, wg_data, wg_scale, recipe)


def fp8_matmul(x: torch.Tensor, w: torch.Tensor, recipe: Fp8Recipe) -> torch.Tensor:
    """``x @ w`` in fp8 with ``recipe``'s numerics; the result has ``x``'s dtype.

    ``x``: ``[..., K]``, bf16/fp16 (fp32 runs too); ``w``: ``[K, N]`` in any float dtype (fp32
    for a master weight; torchao scales it from fp32, without a bf16 round trip). The
    gradients have the dtype of ``grad`` (the result's); autograd casts ``w``'s to ``w``'s dtype.
    ``Fp8Recipe.MXFP8`` runs :func:`amp_fx.kernels.mxfp8_matmul.mxfp8_matmul` (``w`` cast to
    ``x``'s dtype first; emulated where the device has no MX kernel).
    """
    if recipe is Fp8Recipe.MXFP8:
        return _mx.mxfp8_matmul(x, w, emulate=_mx.mx_kernels_missing(x.device.type) is not None)
    return _Fp8Matmul.apply(x, w, recipe)
