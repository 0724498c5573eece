"""Comparisons with torch shared by the Triton (interpreter) and CPU-path tests."""

from __future__ import annotations

import torch

from amp_fx.testing.unscale_reference import reference_sum_of_squares_fp64, reference_unscale_check_

_INT_VIEW = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}

# Unit roundoff of fp32: every rounded fp32 operation has relative error at most U32.
U32 = 2.0**-24


def assert_same_as_torch(
    inputs: list[torch.Tensor],
    outputs: list[torch.Tensor],
    found_inf: torch.Tensor,
    found_inf_start: float,
    inv_scale: float,
) -> list[torch.Tensor]:
    """Outputs and flag must be torch's fused unscale bit for bit; returns torch's outputs.

    NaN payloads are the one thing not compared: torch itself gives 0x7FC0 from its scalar
    bf16 cast and 0xFFFF from its AVX-512 one, so only NaN *positions* are defined.
    """
    expected = [t.clone() for t in inputs]
    expected_found = torch.full((), found_inf_start, dtype=torch.float32)
    reference_unscale_check_(expected, expected_found, torch.tensor(inv_scale))
    assert len(outputs) == len(expected)
    for i, (out, exp) in enumerate(zip(outputs, expected)):
        assert out.dtype == exp.dtype and out.shape == exp.shape, f"grads[{i}]"
        torch.testing.assert_close(out, exp, atol=0, rtol=0, equal_nan=True, msg=f"grads[{i}]")
        # assert_close treats -0.0 == 0.0; the bits must match too wherever torch has no NaN.
        keep = ~exp.isnan()
        out_bits = out.contiguous().view(_INT_VIEW[out.dtype])[keep]
        exp_bits = exp.contiguous().view(_INT_VIEW[exp.dtype])[keep]
        assert torch.equal(out_bits, exp_bits), f"grads[{i}]: sign of zero differs from torch"
    assert found_inf.item() in (0.0, 1.0), f"found_inf = {found_inf.item()}, not exactly 0 or 1"
    assert torch.equal(found_inf, expected_found), f"found_inf {found_inf.item()} != torch's {expected_found.item()}"
    return expected


def assert_sum_sq_close(sum_sq: torch.Tensor, expected_outputs: list[torch.Tensor], rtol: float) -> None:
    """``sum_sq`` against the fp64 sum of squares of torch's unscaled grads, as stored.

    Non-finite results must be non-finite in the same way: NaN if any unscaled value is NaN,
    else inf if any is inf (inf**2 = inf, and NaN absorbs everything).
    """
    assert sum_sq.dtype == torch.float32 and sum_sq.shape == (), f"{sum_sq.dtype} {sum_sq.shape}"
    has_nan = any(bool(t.isnan().any()) for t in expected_outputs)
    has_inf = any(bool(t.isinf().any()) for t in expected_outputs)
    if has_nan:
        assert sum_sq.isnan(), f"sum of squares {sum_sq.item()} should be NaN"
        return
    if has_inf:
        assert sum_sq.isinf() and sum_sq > 0, f"sum of squares {sum_sq.item()} should be inf"
        return
    expected = reference_sum_of_squares_fp64(expected_outputs)
    torch.testing.assert_close(sum_sq.to(torch.float64), expected, atol=0, rtol=rtol)


def sum_sq_rtol(block: int, chunk: int) -> float:
    """Relative error bound of the kernel's fp32 sum of squares (all terms are >= 0), launched
    with ``block`` and ``chunk`` (``_unscale_cases.launch_sizes``).

    One program sums its chunk in BLOCK lane accumulators (chunk/block sequential adds each)
    and then across the BLOCK lanes with tl.sum. For non-negative terms any summation order of
    m terms errs by at most (m - 1) * u relative; the lane reduction's order is the
    implementation's (a tree on GPU, numpy's pairwise sum in the interpreter), so it is bounded
    by BLOCK - 1 adds. Add 1 u for the squaring, and 1 u for rounding the fp64 sum of the
    per-program partials to fp32: (chunk/block + block + 1) * u, 8e-6 with 128/512.
    """
    return (chunk // block + block + 1) * U32


def reference_flags(inputs: list[torch.Tensor]) -> torch.Tensor:
    """Per-tensor flags: torch's check on each gradient alone (1.0 if it held an inf/NaN)."""
    flags = torch.zeros(len(inputs), dtype=torch.float32)
    for i, g in enumerate(inputs):
        found = torch.zeros((), dtype=torch.float32)
        reference_unscale_check_([g.clone()], found, torch.tensor(1.0))
        flags[i] = found
    return flags
