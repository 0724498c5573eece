"""What torch's fp8 GEMM (``torch._scaled_mm``) can do on a device, for the float8 recipes.

:func:`rowwise_scales_missing` (does ``_scaled_mm`` take rowwise scales here?) and
:func:`fp8_tensor_cores_missing` (does it run on fp8 tensor cores, or on its reference kernel?),
each asked once per device type; :func:`check_rowwise_support` is the one check, shared by the
fp8 pass and ``advise``, that refuses a rowwise recipe where the first answer is no. MXFP8's
kernels are asked by :func:`amp_fx.kernels.mxfp8_matmul.mx_kernels_missing`, beside them.
"""

from __future__ import annotations

import functools

import torch

from amp_fx.errors import AmpFxError
from amp_fx.fp8 import Fp8Recipe
from amp_fx.kernels.fp8_recipes import E4M3, RECIPES

__all__ = ["rowwise_scales_missing", "fp8_tensor_cores_missing", "check_rowwise_support"]


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
        torch._scaled_mm(
            a, a.t().contiguous().t(), scale_a=torch.ones(16, 1), scale_b=torch.ones(1, 16), out_dtype=torch.bfloat16
        )
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
        return (
            f"{device_type} has no fp8 tensor cores, so torch._scaled_mm runs its reference kernel (it "
            f"converts the fp8 operands and multiplies them with a float matmul)"
        )
    if torch.version.hip is not None:
        return None
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) < _MIN_CAPABILITY:
        return (
            f"{torch.cuda.get_device_name()} (compute capability {major}.{minor}) has no fp8 tensor cores: "
            f"torch._scaled_mm needs compute capability 8.9+"
        )
    return None


def check_rowwise_support(recipe: Fp8Recipe, device_type: str, caller: str) -> None:
    """Raise :class:`~amp_fx.errors.AmpFxError` (its message starting with ``caller``) where
    ``recipe`` takes rowwise scales and ``torch._scaled_mm`` on ``device_type`` takes none
    (torch 2.11's CPU kernel): refused before anything runs, with the reason and the fix."""
    missing = rowwise_scales_missing(device_type) if RECIPES[recipe].rowwise else None
    if missing is not None:
        raise AmpFxError(
            f"{caller}: fp8={recipe.value!r} needs rowwise scales in "
            f"torch._scaled_mm, but {missing}. Use fp8='tensorwise' here, or torch 2.13 or "
            f"newer (or a GPU) for the rowwise recipes."
        )
