"""Awkward inputs for the unscale kernels, shared by the in-process tests and the interpreter worker.

Every case is deterministic (seeded) so the worker subprocess and the test process build the
same tensors. Sizes are chosen around the block and chunk sizes the interpreter tests use
(``SMALL_BLOCK`` = 128, ``SMALL_CHUNK`` = 512) and the kernel's defaults (BLOCK = 1024), and
kept to a few thousand elements because the interpreter runs a kernel through numpy.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

import torch

# Block and chunk sizes for the interpreter tests: a few thousand elements then span many
# programs and tiles, so chunk and tile boundaries fall inside tensors.
SMALL_BLOCK = 128
SMALL_CHUNK = 512


def launch_sizes(variant: str) -> tuple[int, int]:
    """(block, chunk) a test variant launches the kernel with: ``SMALL_*`` for the ``small_``
    variants, the kernel's own defaults for the others."""
    # imported here: the interpreter worker imports this module before it may import triton
    from amp_fx.kernels import triton_unscale

    if variant.startswith("small"):
        return SMALL_BLOCK, SMALL_CHUNK
    return triton_unscale.BLOCK, triton_unscale.CHUNK


DTYPES = (torch.float32, torch.float16, torch.bfloat16)

# Sizes: empty, one element, one either side of a 128-element tile, across a 512 chunk and the
# default 1024 block, and not a multiple of anything.
AWKWARD_SIZES = (0, 1, 127, 128, 129, 513, 1025, 2049)

# inv_scale values: the default scale 2^16; 1/3 (not a power of two: the product must round,
# in fp16/bf16 twice); exactly 1 (torch's early-out); 2^10 (scale < 1: finite values may
# overflow to inf and must *not* be flagged); inf (scale 0: 0 * inf = NaN, not flagged).
INV_SCALES = {
    "inv_2^-16": 2.0**-16,
    "inv_1/3": 1.0 / 3.0,
    "inv_1": 1.0,
    "inv_2^10": 2.0**10,
    "inv_inf": math.inf,
}

# Magnitude of the scaled gradients: inside each dtype's range before unscaling, and large
# enough that inv 2^10 overflows some fp16 values (65504 / 1024 = 64 < 200).
_MAGNITUDE = {torch.float32: 1e4, torch.float16: 200.0, torch.bfloat16: 1e4}


@dataclass(frozen=True)
class Case:
    """One call: grads (all one dtype), the inverse scale and found_inf's starting value."""

    name: str
    dtype: torch.dtype
    layout: str
    inject: str
    inv_scale: float
    found_inf_start: float = 0.0

    def grads(self) -> list[torch.Tensor]:
        """The case's gradients, freshly built (the kernels modify them in place)."""
        # crc32, not hash(): str hashes differ between processes (PYTHONHASHSEED).
        gen = torch.Generator().manual_seed(zlib.crc32(self.name.encode()))
        grads = [_values(shape, self.dtype, gen) for shape in _shapes(self.layout)]
        grads = [_restride(g, self.layout) for g in grads]
        _inject(grads, self.inject)
        return grads


def _shapes(layout: str) -> list[tuple[int, ...]]:
    if layout == "awkward":
        return [(n,) for n in AWKWARD_SIZES]
    if layout == "many_small":
        return [(n,) for n in range(1, 61)]
    if layout == "strided":
        return [(33, 40), (40, 26), (3, 5, 7, 11)]
    raise ValueError(f"unknown layout {layout!r}")


def _values(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    values = torch.randn(shape, generator=gen) * _MAGNITUDE[dtype]
    flat = values.view(-1)
    # Exact zeros (0 * inf = NaN at scale 0) and tiny values (fp16 subnormal results).
    flat[::17] = 0.0
    flat[5::23] *= 1e-3
    return values.to(dtype)


def _restride(g: torch.Tensor, layout: str) -> torch.Tensor:
    """For the strided layout: a transpose, a slice with gaps and a channels_last tensor."""
    if layout != "strided":
        return g
    if g.dim() == 4:
        return g.contiguous(memory_format=torch.channels_last)
    if g.shape == (33, 40):
        return g.t()
    return g[:, ::2]


def _set(g: torch.Tensor, flat_index: int, value: float) -> None:
    """Set the element at a logical (row-major) flat index, whatever ``g``'s strides."""
    g[tuple(int(i) for i in torch.unravel_index(torch.tensor(flat_index), g.shape))] = value


def _inject(grads: list[torch.Tensor], inject: str) -> None:
    """Plant inf/-inf/NaN at the first element, the last one and tile/chunk boundaries."""
    if inject == "none":
        return
    if inject == "inf_first":
        _set(next(g for g in grads if g.numel() > 0), 0, math.inf)
    elif inject == "neg_inf_last":
        _set(grads[-1], grads[-1].numel() - 1, -math.inf)
    elif inject == "nan_boundary":
        big = max(grads, key=lambda g: g.numel())
        # The first element of the second small tile (128), of the second small chunk (512)
        # and of the second default tile (1024).
        for index in (SMALL_BLOCK, SMALL_CHUNK, 1024):
            _set(big, index, math.nan)
    elif inject == "all":
        _inject(grads, "inf_first")
        _inject(grads, "neg_inf_last")
        _inject(grads, "nan_boundary")
    else:
        raise ValueError(f"unknown injection {inject!r}")


def all_cases() -> list[Case]:
    """The test matrix: every dtype against every inv_scale, injection and layout, not crossed.

    Crossing all of them would be 3 x 5 x 5 x 3 = 225 interpreted launches; each axis is varied
    against the others' most telling value instead (inv 2^-16, the awkward layout).
    """
    cases: list[Case] = []
    for dtype in DTYPES:
        d = str(dtype).removeprefix("torch.")
        for inv_name, inv in INV_SCALES.items():
            cases.append(Case(f"{d}-awkward-none-{inv_name}", dtype, "awkward", "none", inv))
        for inject in ("inf_first", "neg_inf_last", "nan_boundary", "all"):
            cases.append(Case(f"{d}-awkward-{inject}", dtype, "awkward", inject, 2.0**-16))
        # Non-finite values at scale 0: flagged, and the NaN from 0 * inf is not an error.
        cases.append(Case(f"{d}-awkward-all-inv_inf", dtype, "awkward", "all", math.inf))
        for layout in ("many_small", "strided"):
            cases.append(Case(f"{d}-{layout}-none", dtype, layout, "none", 1.0 / 3.0))
        cases.append(Case(f"{d}-strided-inf_first", dtype, "strided", "inf_first", 2.0**-16))
    # A flag already raised stays exactly 1.0 when nothing new is found.
    cases.append(
        Case("float32-awkward-none-found_inf_1", torch.float32, "awkward", "none", 2.0**-16, found_inf_start=1.0)
    )
    return cases
