"""The CPU path (torch's CPU kernels, cache-blocked) and the public API's contract.

The CPU path is what ``unscale_check_``/``unscale_check_norm_`` run on CPU tensors unless the
Triton interpreter is on; these tests call it directly so they test it whatever the
environment, and test the public functions' validation and grouping.
"""

from __future__ import annotations

import pytest
import torch

from amp_fx.kernels import cpu_unscale, triton_unscale, unscale, unscale_check_, unscale_check_norm_
from amp_fx.testing import assert_bitwise
from amp_fx.testing.unscale_reference import reference_sum_of_squares_fp64
from tests.kernels._unscale_cases import Case, all_cases
from tests.kernels._unscale_checks import U32, assert_same_as_torch, assert_sum_sq_close, reference_flags

_CASES = all_cases()


def _cpu_rtol(n_elements: int) -> float:
    """Bound on the CPU path's relative error in the sum of squares (all terms >= 0).

    Each partial is one ``torch.dot`` or a ``_foreach_norm`` squared, summing at most
    ``n_elements`` fp32 terms in an order MKL/ATen choose: at most (n - 1) * u for any order of
    non-negative terms, plus 1 u for each square, 2 u for the norm's sqrt squared back, and
    1 u for rounding the fp64 total to fp32: (n + 3) * u, 2.4e-4 for 4000 elements.
    """
    return (n_elements + 3) * U32


def _run_cpu(case: Case, with_norm: bool) -> None:
    grads = case.grads()
    inputs = [g.clone() for g in grads]
    found_inf = torch.full((), case.found_inf_start)
    inv_scale = torch.tensor(case.inv_scale)
    if with_norm:
        sum_sq = cpu_unscale.cpu_unscale_check_norm_(grads, found_inf, inv_scale)
    else:
        cpu_unscale.cpu_unscale_check_(grads, found_inf, inv_scale)
    expected = assert_same_as_torch(inputs, grads, found_inf, case.found_inf_start, case.inv_scale)
    if with_norm:
        assert_sum_sq_close(sum_sq, expected, rtol=_cpu_rtol(sum(g.numel() for g in grads)))


@pytest.mark.parametrize("with_norm", [False, True], ids=["check", "norm"])
@pytest.mark.parametrize("case", _CASES, ids=lambda c: c.name)
def test_cpu_path_matches_torch(case: Case, with_norm: bool) -> None:
    _run_cpu(case, with_norm)


@pytest.mark.parametrize("with_norm", [False, True], ids=["check", "norm"])
@pytest.mark.parametrize("case", _CASES, ids=lambda c: c.name)
def test_cpu_path_per_tensor_flags(monkeypatch: pytest.MonkeyPatch, case: Case, with_norm: bool) -> None:
    """flags[i] is torch's check of grads[i] alone; values, found_inf and the norm stay torch's
    (the norm path with a 300-element cache chunk, so large tensors are split into pieces)."""
    monkeypatch.setattr(cpu_unscale, "_CACHE_CHUNK", 300)
    grads = case.grads()
    inputs = [g.clone() for g in grads]
    found_inf, flags = torch.full((), case.found_inf_start), torch.zeros(len(grads))
    inv_scale = torch.tensor(case.inv_scale)
    if with_norm:
        sum_sq = cpu_unscale.cpu_unscale_check_norm_(grads, found_inf, inv_scale, flags)
    else:
        cpu_unscale.cpu_unscale_check_(grads, found_inf, inv_scale, flags)
    expected = assert_same_as_torch(inputs, grads, found_inf, case.found_inf_start, case.inv_scale)
    torch.testing.assert_close(flags, reference_flags(inputs), rtol=0, atol=0)
    if with_norm:
        assert_sum_sq_close(sum_sq, expected, rtol=_cpu_rtol(sum(g.numel() for g in grads)))


@pytest.mark.parametrize("fn", [unscale_check_, unscale_check_norm_], ids=["check", "norm"])
def test_flags_follow_gradient_order_across_dtype_groups(fn: object) -> None:
    """Mixed dtypes run one kernel per dtype; each flag still lands at its gradient's index, and
    flags already raised stay raised."""
    grads = [
        torch.ones(3),
        torch.ones(5, dtype=torch.float16),
        torch.ones(4),
        torch.ones(0),
        torch.ones(2, dtype=torch.bfloat16),
        torch.ones(7, dtype=torch.float16),
    ]
    grads[1][2] = float("inf")
    grads[2][0] = float("nan")
    grads[4][1] = float("-inf")
    inputs = [g.clone() for g in grads]
    flags = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 1.0])
    found_inf = torch.zeros(())
    fn(grads, found_inf, torch.tensor(0.5), flags=flags)  # type: ignore[operator]
    expected = torch.maximum(reference_flags(inputs), torch.tensor([0.0, 0, 0, 0, 0, 1]))
    torch.testing.assert_close(flags, expected, rtol=0, atol=0)
    assert found_inf.item() == 1.0


def test_segments_sum_each_subset_and_keep_flags_in_place() -> None:
    """``segments``: one sum of squares per segment (mixed dtypes within one), each the sum the
    call without segments gives on that subset alone, bit for bit (same groups, same kernels);
    flags at their gradients' indices; a segment no gradient names is 0.0."""
    grads = [torch.full((3,), 2.0), torch.full((5,), 4.0, dtype=torch.float16), torch.full((4,), 6.0)]
    grads += [torch.full((2,), 8.0, dtype=torch.bfloat16), torch.full((7,), 10.0)]
    grads[3][1] = float("inf")
    segments = [0, 2, 0, 2, 0]
    subsets = [[g.clone() for g, s in zip(grads, segments) if s == k] for k in (0, 2)]
    found_inf, flags = torch.zeros(()), torch.zeros(len(grads))
    sums = unscale_check_norm_(grads, found_inf, torch.tensor(0.5), flags=flags, segments=segments)
    want = [unscale_check_norm_(sub, torch.zeros(()), torch.tensor(0.5)) for sub in subsets]
    assert sums.shape == (3,) and sums[1].item() == 0.0
    assert_bitwise(sums[0], want[0], "segment 0")
    assert_bitwise(sums[2], want[1], "segment 2")
    torch.testing.assert_close(flags, torch.tensor([0.0, 0, 0, 1, 0]), rtol=0, atol=0)
    assert found_inf.item() == 1.0
    assert unscale_check_norm_([], torch.zeros(()), torch.tensor(1.0), segments=[]).shape == (0,)
    with pytest.raises(ValueError, match="one non-negative int per gradient"):
        unscale_check_norm_(grads, torch.zeros(()), torch.tensor(1.0), segments=[0, 1])


def test_flags_of_wrong_shape_are_refused() -> None:
    with pytest.raises(ValueError, match=r"flags must be a float32 tensor of shape \(2,\)"):
        unscale_check_([torch.ones(3), torch.ones(2)], torch.zeros(()), torch.tensor(1.0), flags=torch.zeros(3))


@pytest.mark.parametrize("cache_chunk", [100, 1000])
@pytest.mark.parametrize(
    "case",
    [c for c in _CASES if c.inject == "all" or c.layout != "awkward"],
    ids=lambda c: c.name,
)
def test_cpu_path_cache_blocking(monkeypatch: pytest.MonkeyPatch, case: Case, cache_chunk: int) -> None:
    """Small cache chunks split the 2049-element tensor and group the small ones into batches."""
    monkeypatch.setattr(cpu_unscale, "_CACHE_CHUNK", cache_chunk)
    _run_cpu(case, with_norm=True)


def test_cpu_path_splits_large_tensor_into_views(monkeypatch: pytest.MonkeyPatch) -> None:
    """The split pieces are views: the caller's tensor is what gets unscaled."""
    monkeypatch.setattr(cpu_unscale, "_CACHE_CHUNK", 100)
    batches = cpu_unscale._cache_sized_batches([torch.ones(250), torch.ones(3), torch.ones(0)])
    assert [[p.numel() for p in b] for b in batches] == [[100], [100], [50, 3]]
    g = torch.full((250,), 4.0)
    sum_sq = cpu_unscale.cpu_unscale_check_norm_([g], torch.zeros(()), torch.tensor(0.5))
    assert torch.equal(g, torch.full((250,), 2.0))
    assert sum_sq.item() == 250 * 4.0  # small integers: exact in any summation order


def test_dispatch_is_explicit() -> None:
    """CUDA goes to Triton when compiled; CPU only under the interpreter; never both."""
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    if triton_unscale.is_interpreted():
        assert unscale._use_triton(cpu) and not unscale._use_triton(cuda)
    else:
        assert unscale._use_triton(cuda) and not unscale._use_triton(cpu)


def test_public_api_mixed_dtypes_one_call() -> None:
    """Grouping by dtype: one flag and one norm over fp32, fp16 and bf16 grads together."""
    grads = _CASES[0].grads()
    grads += [g.to(torch.float16) for g in grads] + [g.to(torch.bfloat16) for g in grads]
    inputs = [g.clone() for g in grads]
    found_inf = torch.zeros(())
    sum_sq = unscale_check_norm_(grads, found_inf, torch.tensor(2.0**-16))
    expected = assert_same_as_torch(inputs, grads, found_inf, 0.0, 2.0**-16)
    n = sum(g.numel() for g in grads)
    torch.testing.assert_close(
        sum_sq.to(torch.float64),
        reference_sum_of_squares_fp64(expected),
        atol=0,
        rtol=_cpu_rtol(n),
    )


def test_public_api_empty_is_noop() -> None:
    found_inf = torch.zeros(())
    unscale_check_([], found_inf, torch.tensor(0.5))
    sum_sq = unscale_check_norm_([], found_inf, torch.tensor(0.5))
    assert sum_sq.dtype == torch.float32 and sum_sq.shape == () and sum_sq.item() == 0.0
    assert found_inf.item() == 0.0
    empty = torch.empty(0)
    assert unscale_check_norm_([empty], found_inf, torch.tensor(0.5)).item() == 0.0


def test_public_api_rejects_sparse_grad() -> None:
    sparse = torch.eye(3).to_sparse()
    with pytest.raises(ValueError, match=r"grads\[1\] has layout torch.sparse_coo.*_values\(\)"):
        unscale_check_([torch.ones(2), sparse], torch.zeros(()), torch.tensor(0.5))


def test_public_api_rejects_other_device() -> None:
    with pytest.raises(ValueError, match=r"grads\[0\] is on meta but found_inf is on cpu"):
        unscale_check_norm_([torch.ones(2, device="meta")], torch.zeros(()), torch.tensor(0.5))


@pytest.mark.parametrize(
    "found_inf, inv_scale, match",
    [
        (torch.zeros((), dtype=torch.float64), torch.tensor(0.5), "found_inf must be"),
        (torch.zeros(()), torch.tensor([0.5, 0.5]), "inv_scale must be"),
        (torch.zeros(()), torch.tensor(0.5, device="meta"), "inv_scale is on meta"),
    ],
)
def test_op_rejects_bad_scalars(found_inf: torch.Tensor, inv_scale: torch.Tensor, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        torch.ops.amp_fx.unscale_check_([torch.ones(2)], found_inf, inv_scale, None)


def test_op_rejects_mixed_dtypes_and_overlap() -> None:
    found_inf, inv = torch.zeros(()), torch.tensor(0.5)
    with pytest.raises(ValueError, match=r"grads\[1\] is torch.float16 but grads\[0\]"):
        torch.ops.amp_fx.unscale_check_([torch.ones(2), torch.ones(2).half()], found_inf, inv, None)
    expanded = torch.ones(1).expand(4)
    with pytest.raises(ValueError, match=r"grads\[0\] has elements that share memory"):
        torch.ops.amp_fx.unscale_check_([expanded], found_inf, inv, None)
    with pytest.raises(ValueError, match=r"grads\[0\] is torch.float64"):
        torch.ops.amp_fx.unscale_check_([torch.ones(2, dtype=torch.float64)], found_inf, inv, None)
