"""amp_fx.testing's own contracts: assert_bitwise fails where bits differ, percentile interpolates."""

from __future__ import annotations

import statistics
from dataclasses import dataclass

import pytest
import torch

from amp_fx.testing import assert_bitwise
from amp_fx.testing.bench import percentile


@dataclass
class _Result:
    out: torch.Tensor
    grads: dict[str, torch.Tensor | None]


def _result(grad: torch.Tensor | None) -> _Result:
    return _Result(torch.ones(2, dtype=torch.bfloat16), {"w": grad})


def test_assert_bitwise_passes_on_the_same_bits() -> None:
    nan = torch.tensor([float("nan"), -0.0, 1.5])
    assert_bitwise(_result(nan), _result(nan.clone()), "r")
    assert_bitwise(_result(None), _result(None), "r")
    assert_bitwise([1, (2.0, "a")], [1, (2.0, "a")], "nested")


@pytest.mark.parametrize(
    "actual, expected, where",
    [
        # torch.equal and assert_close(atol=0, rtol=0) both pass this one: only the bits tell.
        (torch.tensor([-0.0]), torch.tensor([0.0]), "r.grads['w']: 1 of 1 elements differ"),
        # Same value, another NaN payload (0x7FC00001 vs the default 0x7FC00000).
        (
            torch.tensor([0x7FC00001], dtype=torch.int32).view(torch.float32),
            torch.tensor([float("nan")]),
            "r.grads['w']: 1 of 1 elements differ",
        ),
        (torch.tensor([1.0], dtype=torch.float64), torch.tensor([1.0]), "r.grads['w']: (dtype, shape, device)"),
        (torch.tensor([[1.0]]), torch.tensor([1.0]), "r.grads['w']: (dtype, shape, device)"),
        (None, torch.tensor([1.0]), "r.grads['w']: NoneType is not a Tensor"),
        (torch.tensor([1.0]), None, "r.grads['w']: tensor([1.]) != None"),
    ],
)
def test_assert_bitwise_names_the_first_difference(actual, expected, where) -> None:
    with pytest.raises(AssertionError) as info:
        assert_bitwise(_result(actual), _result(expected), "r")
    assert str(info.value).startswith(where), str(info.value)


def test_assert_bitwise_compares_structure() -> None:
    with pytest.raises(AssertionError, match=r"r: keys"):
        assert_bitwise({"a": 1}, {"b": 1}, "r")
    with pytest.raises(AssertionError, match=r"r: list of 1 != tuple of 1"):
        assert_bitwise([1], (1,), "r")
    with pytest.raises(AssertionError, match=r"r\[0\]: 1 != 1.0"):
        assert_bitwise([1], [1.0], "r")


@pytest.mark.parametrize("n", [1, 2, 4, 5, 6, 11])
def test_percentile_is_linear_interpolation(n: int) -> None:
    """Against numpy's default method; p50 is statistics.median (the tables print both)."""
    np = pytest.importorskip("numpy")
    values = [float(v) for v in torch.randperm(n, generator=torch.Generator().manual_seed(n)) * 1.5]
    for q in (0.0, 0.1, 0.5, 0.9, 1.0):
        assert percentile(values, q) == pytest.approx(float(np.quantile(values, q)), rel=1e-12, abs=0)
    assert percentile(values, 0.5) == statistics.median(values)
