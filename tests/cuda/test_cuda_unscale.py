"""The Triton unscale kernel compiled for the GPU (not interpreted) against torch, bit for bit.

The same awkward cases as the interpreter tests (tests/kernels/_unscale_cases.py: sizes around
the block and chunk, empty and one-element tensors, 60 small tensors, strided layouts, inf/-inf/NaN
at the first, last and boundary elements, scales 0, 1 and > 1), through the custom ops and through
the launcher with small blocks and chunks; then lists with more than 2^31 elements in all, where
offsets need int64. Reference: ``torch._amp_foreach_non_finite_check_and_unscale_`` on the same
CUDA tensors where torch has a CUDA kernel for the dtype (fp32, fp16; not bf16), and torch's CPU
kernel on every case, through the interpreter tests' own checks.
"""

from __future__ import annotations

import math

import pytest
import torch

from amp_fx.kernels import triton_unscale, unscale
from tests.cuda._gpu import GPU_TIER
from tests.kernels._unscale_cases import SMALL_BLOCK, SMALL_CHUNK, Case, all_cases, launch_sizes
from tests.kernels._unscale_checks import assert_same_as_torch, assert_sum_sq_close, sum_sq_rtol

pytestmark = GPU_TIER

_VARIANTS = ("op_check", "op_norm", "small_check", "small_norm")
# The dtypes torch's CUDA kernel takes (FLOATING_TYPES_AND_HALF); bf16 is compared with its CPU one.
_TORCH_CUDA_DTYPES = (torch.float32, torch.float16)
_INT_VIEW = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}


def _to_cuda(t: torch.Tensor) -> torch.Tensor:
    """A CUDA copy with ``t``'s strides, gaps included (``Tensor.cuda()`` would compact a slice)."""
    out = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cuda")
    out.copy_(t)
    return out


def _run(
    variant: str, grads: list[torch.Tensor], found_inf: torch.Tensor, inv_scale: torch.Tensor
) -> torch.Tensor | None:
    if variant == "op_check":
        unscale.unscale_check_(grads, found_inf, inv_scale)
        return None
    if variant == "op_norm":
        return unscale.unscale_check_norm_(grads, found_inf, inv_scale)
    return triton_unscale.launch_unscale_check(
        grads, found_inf, inv_scale, compute_norm=variant == "small_norm", block=SMALL_BLOCK, chunk=SMALL_CHUNK
    )


def _assert_bitwise_torch_cuda(outputs: list[torch.Tensor], expected: list[torch.Tensor]) -> None:
    for i, (out, exp) in enumerate(zip(outputs, expected, strict=True)):
        assert out.stride() == exp.stride(), f"grads[{i}]: strides changed"
        torch.testing.assert_close(out, exp, atol=0, rtol=0, equal_nan=True, msg=f"grads[{i}]")
        keep = ~exp.isnan()
        assert torch.equal(
            out.contiguous().view(_INT_VIEW[out.dtype])[keep], exp.contiguous().view(_INT_VIEW[exp.dtype])[keep]
        ), f"grads[{i}]: -0.0"


def test_kernel_is_compiled_not_interpreted() -> None:
    assert not triton_unscale.is_interpreted(), "TRITON_INTERPRET=1 is set: unset it for the GPU tier"
    assert unscale._use_triton(torch.device("cuda"))


@pytest.mark.parametrize("variant", _VARIANTS)
@pytest.mark.parametrize("case", all_cases(), ids=lambda c: c.name)
def test_cuda_kernel_matches_torch(case: Case, variant: str) -> None:
    cpu_inputs = case.grads()
    grads = [_to_cuda(g) for g in cpu_inputs]
    expected = [_to_cuda(g) for g in cpu_inputs]
    found_inf = torch.full((), case.found_inf_start, device="cuda")
    expected_found = torch.full((), case.found_inf_start, device="cuda")
    inv_scale = torch.tensor(case.inv_scale, device="cuda")
    sum_sq = _run(variant, grads, found_inf, inv_scale)
    if all(g.dtype in _TORCH_CUDA_DTYPES for g in cpu_inputs):
        torch._amp_foreach_non_finite_check_and_unscale_(expected, expected_found, inv_scale)
        _assert_bitwise_torch_cuda(grads, expected)
        assert torch.equal(found_inf, expected_found), (found_inf, expected_found)
    # else: torch's CUDA op has no bf16 kernel ("not implemented for 'BFloat16'", seen on the
    # H200, torch 2.11); its CPU kernel, which has one, is the reference below.
    torch_outputs = assert_same_as_torch(
        cpu_inputs, [g.cpu() for g in grads], found_inf.cpu(), case.found_inf_start, case.inv_scale
    )
    if variant.endswith("norm"):
        assert sum_sq is not None and sum_sq.is_cuda
        assert_sum_sq_close(sum_sq.cpu(), torch_outputs, rtol=sum_sq_rtol(*launch_sizes(variant)))
    else:
        assert sum_sq is None


# Over 2^31 elements in all: fp16 keeps it at 4 GiB per copy (8 GiB with the reference).
_BIG = {
    "one_tensor_over_2^31": [2**31 + 1000],
    "list_over_2^31": [2**30, 2**30 - 3, 5, 2**20 + 7],
}


@pytest.mark.parametrize("norm", [False, True], ids=["check_with_inf_nan", "check_norm"])
@pytest.mark.parametrize("sizes", _BIG.values(), ids=_BIG.keys())
def test_cuda_kernel_over_2_pow_31_elements(sizes: list[int], norm: bool) -> None:
    """check: inf/NaN planted past element 2^31 only are flagged; check_norm: all finite, the
    sum of squares within the op's bound (tests/kernels/_unscale_checks.sum_sq_rtol) of an fp64 sum."""
    free, _ = torch.cuda.mem_get_info()
    need = 2 * 2 * sum(sizes) + (2 << 30)
    if free < need:
        pytest.skip(f"needs {need / 2**30:.1f} GiB of free GPU memory, {free / 2**30:.1f} GiB free")
    gen = torch.Generator(device="cuda").manual_seed(0)
    grads = [torch.randn(n, generator=gen, device="cuda", dtype=torch.float16) for n in sizes]
    if not norm:
        grads[-1][-1] = math.inf
        if sizes[0] > 2**31:
            grads[0][2**31 + 17] = math.nan
    expected = [g.clone() for g in grads]
    found_inf, expected_found = torch.zeros((), device="cuda"), torch.zeros((), device="cuda")
    inv_scale = torch.tensor(1.0 / 3.0, device="cuda")
    if norm:
        sum_sq = unscale.unscale_check_norm_(grads, found_inf, inv_scale)
    else:
        unscale.unscale_check_(grads, found_inf, inv_scale)
    torch._amp_foreach_non_finite_check_and_unscale_(expected, expected_found, inv_scale)
    for i, (g, e) in enumerate(zip(grads, expected, strict=True)):
        nan = e.isnan()
        assert torch.equal(g.isnan(), nan), f"grads[{i}]: NaN positions differ"
        assert torch.equal(torch.where(nan, 0, g).view(torch.int16), torch.where(nan, 0, e).view(torch.int16)), (
            f"grads[{i}]"
        )
    assert torch.equal(found_inf, expected_found)
    assert found_inf.item() == (0.0 if norm else 1.0)
    if norm:
        reference = sum(c.float().pow(2).sum(dtype=torch.float64) for e in expected for c in e.split(2**28))
        torch.testing.assert_close(sum_sq.double(), reference, atol=0, rtol=sum_sq_rtol(*launch_sizes("op_norm")))
    del grads, expected
    torch.cuda.empty_cache()
