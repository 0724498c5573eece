"""fp8 training: the recipes and their configuration (``amp_fx.compile(..., fp8=...)``).

With ``fp8`` set, every matmul of a captured graph that has a parameter (or a view of one) as its
right operand runs as an fp8 matmul in the forward and in both backward GEMMs (any size: what
``torch._scaled_mm`` needs in multiples of 16 is zero-padded) (:mod:`amp_fx.passes.fp8_matmuls`), with torchao 0.18's
float8 training numerics (:mod:`amp_fx.kernels.fp8_matmul`). Everything else runs in ``dtype``
as before.

    >>> Fp8Config.of("rowwise")
    Fp8Config(recipe=<Fp8Recipe.ROWWISE: 'rowwise'>)
    >>> Fp8Config.of(None) is None
    True
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Union

__all__ = ["Fp8Recipe", "Fp8Config", "Fp8Like", "Nvfp4Options"]


class Fp8Recipe(enum.Enum):
    """torchao's float8 training recipes (``torchao.float8.Float8LinearRecipeName``).

    The three GEMMs of a matmul ``out = x @ w``: ``out`` (forward), ``grad_x = grad_out @ w.T`` and
    ``grad_w = x.T @ grad_out``. Scales are ``fp8_max / amax``, computed in float64 and stored as
    float32, from the amax of the whole tensor (tensorwise) or of each row along the GEMM's inner
    dimension (rowwise, rounded down to a power of two); MXFP8's are powers of two per block of
    32 elements along the inner dimension.
    """

    TENSORWISE = "tensorwise"
    """One scale per tensor; ``x`` and ``w`` in e4m3, ``grad_out`` in e5m2. torchao's default
    and fastest recipe."""
    ROWWISE = "rowwise"
    """One scale per row along the inner dimension of each GEMM, rounded down to a power of
    two; every operand in e4m3."""
    ROWWISE_WITH_GW_HP = "rowwise_with_gw_hp"
    """Rowwise for ``out`` and ``grad_x`` (``w`` tensorwise in ``grad_x``), and ``grad_w`` in the
    high-precision dtype: torchao's most accurate recipe."""
    MXFP8 = "mxfp8"
    """MXFP8 (Blackwell's format, torchao's ``MXFP8TrainingRecipe.MXFP8_RCEIL``): every operand of
    all three GEMMs in e4m3 with one power-of-two (e8m0) scale per 32 elements along the GEMM's
    inner dimension, scales rounded up (RCEIL); the bf16 operands are scaled (the weight's bf16
    cast, not the fp32 master weight). Needs ``dtype=bf16``. Real kernels on a Blackwell GPU
    (compute capability 10.0+); elsewhere emulated, with a warning
    (:mod:`amp_fx.kernels.mxfp8_matmul`)."""
    BLOCKWISE = "blockwise"
    """Blockwise fp8 (DeepSeek-V3's recipe, torchao's ``prototype.blockwise_fp8_training``): every
    operand of all three GEMMs in e4m3 with one fp32 scale per block along the GEMM's inner
    dimension, 1 x 128 for activations and output gradients, 128 x 128 tiles for the (fp32 master)
    weight. A Hopper GPU's blockwise GEMM where one is installed; elsewhere emulated in fp32, with
    a notice (:mod:`amp_fx.kernels.blockwise_fp8`)."""
    NVFP4 = "nvfp4"
    """NVFP4 (TransformerEngine's ``NVFP4BlockScaling``): every operand of all three GEMMs in e2m1
    with an e4m3 scale per 16 elements along the GEMM's inner dimension (the weight per 16x16
    tile) and an fp32 scale per tensor; stochastic rounding on the output gradient, the random
    Hadamard transform on the weight-gradient GEMM's operands (switches:
    ``Fp8Config(recipe="nvfp4", nvfp4=Nvfp4Options(...))``). Needs ``dtype=bf16``. Emulated,
    with a notice, wherever there are no fp4 tensor cores (:mod:`amp_fx.kernels.nvfp4`)."""


@dataclass(frozen=True)
class Nvfp4Options:
    """The switches of TransformerEngine's ``NVFP4BlockScaling``, each on by default as in TE.

    Args:
        rht: the random Hadamard transform on the weight-gradient GEMM's operands (TE's
            ``disable_rht=False``).
        stochastic_rounding: stochastic rounding of the output gradient in both backward GEMMs
            (TE's ``disable_stochastic_rounding=False``); forward operands always round to
            nearest even.
        weight_2d: the weight scaled per 16x16 tile, so that its forward and input-gradient copies
            are the same values (TE's ``disable_2d_quantization=False``); off: 1x16 along each
            GEMM's inner dimension.
    """

    rht: bool = True
    stochastic_rounding: bool = True
    weight_2d: bool = True

    def __post_init__(self) -> None:
        for name in ("rht", "stochastic_rounding", "weight_2d"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise TypeError(f"amp_fx: Nvfp4Options.{name} must be True or False, got {value!r}")


@dataclass(frozen=True)
class Fp8Config:
    """fp8 training, as given to ``amp_fx.compile(..., fp8=...)``.

    Args:
        recipe: an :class:`Fp8Recipe` or its name (``"tensorwise"``, ``"rowwise"``,
            ``"rowwise_with_gw_hp"``, ``"mxfp8"``, ``"blockwise"``, ``"nvfp4"``).
        nvfp4: the NVFP4 recipe's switches (:class:`Nvfp4Options`: random
            Hadamard transform, stochastic rounding, 16x16 weight tiles; all on by default, as
            TransformerEngine's); only with ``recipe="nvfp4"``.

    Which matmuls stay out of fp8 is the policy's business (``Policy(keep_out_of_fp8=...)``);
    sizes that are not multiples of 16 run in fp8 padded, and ``amp_fx.explain`` shows the
    padding, its cost, and why any other matmul stays in ``dtype``.
    """

    recipe: Fp8Recipe = Fp8Recipe.TENSORWISE
    nvfp4: Nvfp4Options | None = field(default=None, repr=False)  # the repr of the other recipes unchanged

    if TYPE_CHECKING:  # the constructor also takes a recipe's name; __post_init__ stores the Fp8Recipe

        def __init__(
            self, recipe: Fp8Recipe | str = Fp8Recipe.TENSORWISE, nvfp4: Nvfp4Options | None = None
        ) -> None: ...

    @property
    def nvfp4_switches(self) -> Nvfp4Options:
        """The switches this config's NVFP4 matmuls run with: its own, else TransformerEngine's
        defaults (a per-module map whose default recipe is another one)."""
        return self.nvfp4 if self.nvfp4 is not None else Nvfp4Options()

    def __post_init__(self) -> None:
        recipe = self.recipe
        if isinstance(recipe, str):
            try:
                recipe = Fp8Recipe(recipe)
            except ValueError:
                raise ValueError(
                    f"amp_fx: unknown low-precision recipe {self.recipe!r}; expected one of "
                    f"{[r.value for r in Fp8Recipe]}"
                ) from None
        if not isinstance(recipe, Fp8Recipe):
            raise TypeError(
                f"amp_fx: Fp8Config.recipe must be an amp_fx.Fp8Recipe or its name, "
                f"got {self.recipe!r} ({type(self.recipe).__name__})"
            )
        object.__setattr__(self, "recipe", recipe)
        if self.nvfp4 is not None and not isinstance(self.nvfp4, Nvfp4Options):
            raise TypeError(f"amp_fx: Fp8Config.nvfp4 must be an amp_fx.Nvfp4Options, got {type(self.nvfp4).__name__}")
        if self.nvfp4 is not None and recipe is not Fp8Recipe.NVFP4:
            raise ValueError(
                f"amp_fx: Fp8Config(nvfp4=...) sets NVFP4's switches; the recipe is {recipe.value!r}, not 'nvfp4'"
            )
        if recipe is Fp8Recipe.NVFP4 and self.nvfp4 is None:
            object.__setattr__(self, "nvfp4", Nvfp4Options())

    @staticmethod
    def of(value: Fp8Like) -> Fp8Config | None:
        """The config for an ``fp8=`` argument: None (fp8 off), a recipe, its name, or a config."""
        if value is None or isinstance(value, Fp8Config):
            return value
        if isinstance(value, (str, Fp8Recipe)):
            return Fp8Config(recipe=value)
        raise TypeError(
            f"amp_fx: fp8 must be None, a low-precision recipe {[r.value for r in Fp8Recipe]}, an "
            f"amp_fx.Fp8Recipe or an amp_fx.Fp8Config, got {value!r} "
            f"({type(value).__name__})"
        )


Fp8Like = Union[None, str, Fp8Recipe, Fp8Config]
