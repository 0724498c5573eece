"""The fp8 recipes as data: each operand's cast in each GEMM, and the constants of the fp8 matmul.

What torchao 0.18 keeps in ``torchao/float8/config.py`` (``Float8LinearConfig.from_recipe_name``),
apart from the kernels that run it: :data:`RECIPES` maps each :class:`~amp_fx.fp8.Fp8Recipe` to
its :class:`RecipeCasts`, read by the fp8 matmul (:mod:`amp_fx.kernels.fp8_matmul`), the grouped
GEMM (:mod:`amp_fx.kernels.fp8_grouped_mm`), the padding rules (:mod:`amp_fx.kernels.fp8_padding`)
and the fp8 pass.

    >>> RECIPES[Fp8Recipe.TENSORWISE].grad_output.label
    'e5m2 tensorwise'
    >>> RECIPES[Fp8Recipe.ROWWISE].rowwise, RECIPES[Fp8Recipe.TENSORWISE].rowwise
    (True, False)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

import torch

from amp_fx.errors import AmpFxError
from amp_fx.fp8 import Fp8Recipe
from amp_fx.kernels import blockwise_fp8 as _bw
from amp_fx.kernels import fp8_support
from amp_fx.kernels import mxfp8_matmul as _mx
from amp_fx.kernels import nvfp4 as _nv

__all__ = ["RECIPES", "RecipeCasts", "Cast", "E4M3", "E5M2", "EPS", "ALIGNMENT", "check_rowwise_support"]

ALIGNMENT = 16
"""``torch._scaled_mm`` on CUDA needs ``mat1``'s columns and both of ``mat2``'s dimensions to be
multiples of 16 (``mat1``'s rows may be anything). The CPU kernel takes any size; the fp8 matmul
pads to this rule on every device, so the CPU runs the GPU's code path."""

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
E2M1 = torch.float4_e2m1fn_x2
"""NVFP4's element (two per byte)."""
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
    tile: int = 0
    """Blockwise: one fp32 scale per ``1 x tile`` block along the GEMM's inner dimension, or per
    ``tile x tile`` tile where ``square`` (0: not blockwise)."""
    square: bool = False

    @property
    def label(self) -> str:
        if self.dtype is None:
            return "high precision"
        if self.tile:
            return (
                f"e4m3, fp32 scale per {self.tile}x{self.tile} tile"
                if self.square
                else f"e4m3, fp32 scale per 1x{self.tile}"
            )
        if self.dtype is E2M1:
            return f"e2m1, e4m3 scale per {self.block} and an fp32 scale per tensor"
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

    def cast_in(self, operand: str, gemm: str) -> Cast:
        """The cast of ``operand`` (``"input"``, ``"weight"``, ``"grad_output"``) in ``gemm``
        (``"output"``: ``x @ w``; ``"grad_input"``: ``g @ w.T``; ``"grad_weight"``: ``x.T @ g``);
        KeyError for an operand the GEMM does not read."""
        return {
            ("input", "output"): self.input,
            ("weight", "output"): self.weight,
            ("grad_output", "grad_input"): self.grad_output,
            ("weight", "grad_input"): self.weight_for_grad_input,
            ("input", "grad_weight"): self.input_for_grad_weight,
            ("grad_output", "grad_weight"): self.grad_output_for_grad_weight,
        }[(operand, gemm)]

    @property
    def granularity(self) -> str:
        """The scale granularity of the forward GEMM, for inspection (``tensorwise``/``rowwise``/``mx``)."""
        if self.input.tile:
            return f"blockwise (1x{self.input.tile}, weights {self.input.tile}x{self.input.tile})"
        if self.input.dtype is E2M1:
            return f"nvfp4 (blocks of {self.input.block})"
        if self.input.block:
            return f"mx (blocks of {self.input.block})"
        return "rowwise" if self.input.rowwise else "tensorwise"

    @property
    def rowwise(self) -> bool:
        """Whether some GEMM takes rowwise scales (``_scaled_mm``'s rowwise kernel)."""
        return any(
            c.rowwise
            for c in (
                self.input,
                self.weight,
                self.grad_output,
                self.input_for_grad_weight,
                self.weight_for_grad_input,
                self.grad_output_for_grad_weight,
            )
        )


_HP = Cast(None)
_MX = Cast(E4M3, block=_mx.BLOCK)
_BW = Cast(E4M3, tile=_bw.BLOCK)
_BW_TILE = Cast(E4M3, tile=_bw.BLOCK, square=True)
_NV = Cast(E2M1, block=_nv.BLOCK)
RECIPES: Mapping[Fp8Recipe, RecipeCasts] = MappingProxyType(
    {
        # torchao/float8/config.py, Float8LinearConfig.from_recipe_name (0.18.0)
        Fp8Recipe.TENSORWISE: RecipeCasts(
            input=Cast(E4M3),
            weight=Cast(E4M3),
            grad_output=Cast(E5M2),
            input_for_grad_weight=Cast(E4M3),
            weight_for_grad_input=Cast(E4M3),
            grad_output_for_grad_weight=Cast(E5M2),
            round_scales_to_power_of_2=False,
        ),
        Fp8Recipe.ROWWISE: RecipeCasts(
            input=Cast(E4M3, True),
            weight=Cast(E4M3, True),
            grad_output=Cast(E4M3, True),
            input_for_grad_weight=Cast(E4M3, True),
            weight_for_grad_input=Cast(E4M3, True),
            grad_output_for_grad_weight=Cast(E4M3, True),
            round_scales_to_power_of_2=True,
        ),
        Fp8Recipe.ROWWISE_WITH_GW_HP: RecipeCasts(
            input=Cast(E4M3, True),
            weight=Cast(E4M3, True),
            grad_output=Cast(E4M3, True),
            input_for_grad_weight=_HP,
            weight_for_grad_input=Cast(E4M3),
            grad_output_for_grad_weight=_HP,
            round_scales_to_power_of_2=True,
        ),
        # torchao/prototype/moe_training/mxfp8_linear.py, _to_mxfp8_then_scaled_mm (0.18.0): all e4m3,
        # block 32, RCEIL; computed by amp_fx.kernels.mxfp8_matmul, not by _Fp8Matmul.
        Fp8Recipe.MXFP8: RecipeCasts(
            input=_MX,
            weight=_MX,
            grad_output=_MX,
            input_for_grad_weight=_MX,
            weight_for_grad_input=_MX,
            grad_output_for_grad_weight=_MX,
            round_scales_to_power_of_2=True,
        ),
        # torchao/prototype/blockwise_fp8_training/linear.py, fp8_blockwise_mm (0.18.0): all e4m3,
        # fp32 scales; computed by amp_fx.kernels.blockwise_fp8, not by _Fp8Matmul.
        Fp8Recipe.BLOCKWISE: RecipeCasts(
            input=_BW,
            weight=_BW_TILE,
            grad_output=_BW,
            input_for_grad_weight=_BW,
            weight_for_grad_input=_BW_TILE,
            grad_output_for_grad_weight=_BW,
            round_scales_to_power_of_2=False,
        ),
        # TransformerEngine's NVFP4BlockScaling: all e2m1 with e4m3 scales per 16; computed by
        # amp_fx.kernels.nvfp4 (its Nvfp4Options hold the rounding and transform switches).
        Fp8Recipe.NVFP4: RecipeCasts(
            input=_NV,
            weight=_NV,
            grad_output=_NV,
            input_for_grad_weight=_NV,
            weight_for_grad_input=_NV,
            grad_output_for_grad_weight=_NV,
            round_scales_to_power_of_2=False,
        ),
    }
)
"""Each recipe's casts, as torchao 0.18 defines them."""


def check_rowwise_support(recipe: Fp8Recipe, device_type: str, caller: str) -> None:
    """Raise :class:`~amp_fx.errors.AmpFxError` (its message starting with ``caller``) where
    ``recipe`` takes rowwise scales and ``torch._scaled_mm`` on ``device_type`` takes none
    (torch 2.11's CPU kernel): refused before anything runs, with the reason and the fix."""
    missing = fp8_support.rowwise_scales_missing(device_type) if RECIPES[recipe].rowwise else None
    if missing is not None:
        raise AmpFxError(
            f"{caller}: fp8={recipe.value!r} needs rowwise scales in "
            f"torch._scaled_mm, but {missing}. Use fp8='tensorwise' here, or torch 2.13 or "
            f"newer (or a GPU) for the rowwise recipes."
        )
