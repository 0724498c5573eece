"""What torch's fp8 GEMM (``torch._scaled_mm``) can do on a device, for the float8 recipes.

:func:`rowwise_scales_missing` (does ``_scaled_mm`` take rowwise scales here?) and
:func:`fp8_tensor_cores_missing` (does it run on fp8 tensor cores, or on its reference kernel?),
each asked once per device type; :func:`check_rowwise_support` is the one check, shared by the
fp8 pass and ``advise``, that refuses a rowwise recipe where the first answer is no.

:func:`kernels_missing` is the one device check of every recipe's GEMM: a :class:`KernelNeed`
(which GPUs have the kernel, what to say elsewhere) per kernel, kept beside it
(:func:`fp8_tensor_cores_missing` here, :func:`amp_fx.kernels.mxfp8_matmul.mx_kernels_missing`,
:func:`amp_fx.kernels.blockwise_fp8.blockwise_kernels_missing`,
:func:`amp_fx.kernels.nvfp4.fp4_kernels_missing`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

__all__ = [
    "KernelNeed",
    "kernels_missing",
    "rowwise_scales_missing",
    "fp8_tensor_cores_missing",
]

_E4M3 = torch.float8_e4m3fn


@dataclass(frozen=True)
class KernelNeed:
    """Which GPUs run a GEMM kernel, and what to say where it is missing.

    ``kernels_missing`` says ``"{device} has no {lacks}{elsewhere}"`` off CUDA, ``rocm`` on a ROCm
    build (None: ROCm runs it), and ``"{GPU} (compute capability M.m) has no {lacks}: {needs}"``
    on a CUDA GPU whose capability is below ``minimum`` or, where ``below`` is given, not below it.
    """

    lacks: str
    elsewhere: str
    needs: str
    minimum: tuple[int, int]
    below: tuple[int, int] | None = None
    rocm: str | None = None


def kernels_missing(device_type: str, need: KernelNeed) -> str | None:
    """None where ``device_type``'s current device has the kernel ``need`` describes, else why
    not. Asks the CUDA device's compute capability; touches no tensor. Not cached: each kernel's
    ``*_missing`` function caches its answer per device type."""
    if device_type != "cuda" or not torch.cuda.is_available():
        return f"{device_type} has no {need.lacks}{need.elsewhere}"
    if torch.version.hip is not None:
        return need.rocm
    capability = torch.cuda.get_device_capability()
    if capability < need.minimum or (need.below is not None and capability >= need.below):
        major, minor = capability
        return f"{torch.cuda.get_device_name()} (compute capability {major}.{minor}) has no {need.lacks}: {need.needs}"
    return None


@functools.cache
def rowwise_scales_missing(device_type: str) -> str | None:
    """None if ``torch._scaled_mm`` takes rowwise scales on ``device_type``, else why not.

    A feature test on a 16 x 16 GEMM, run once: torch 2.11's CPU kernel takes per-tensor scales
    only ("Now _scaled_mm only supports per-tensor scaling for CPU backend"), 2.13's takes both.
    CUDA's rowwise kernel needs an sm_89+ GPU and is not probed here (no device is touched)."""
    if device_type != "cpu":
        return None
    a = torch.zeros(16, 16).to(_E4M3)
    try:
        torch._scaled_mm(
            a, a.t().contiguous().t(), scale_a=torch.ones(16, 1), scale_b=torch.ones(1, 16), out_dtype=torch.bfloat16
        )
    except RuntimeError as e:
        first = str(e).strip().splitlines()[0][:120]
        return f"torch {torch.__version__}'s CPU torch._scaled_mm takes per-tensor scales only ({first})"
    return None


_FP8_TENSOR_CORES = KernelNeed(
    lacks="fp8 tensor cores",
    elsewhere=(
        ", so torch._scaled_mm runs its reference kernel (it converts the fp8 operands and multiplies "
        "them with a float matmul)"
    ),
    needs="torch._scaled_mm needs compute capability 8.9+",
    minimum=(8, 9),  # per-tensor and rowwise torch._scaled_mm: Ada (sm_89), Hopper (sm_90) and later
)


@functools.cache
def fp8_tensor_cores_missing(device_type: str) -> str | None:
    """None where ``torch._scaled_mm`` runs tensorwise and rowwise fp8 on tensor cores, else why not
    (asked once per device type)."""
    return kernels_missing(device_type, _FP8_TENSOR_CORES)
