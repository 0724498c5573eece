"""``assert_bitwise``: the one bit-for-bit comparison that tests use against a reference."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

__all__ = ["assert_bitwise"]

# Floats are compared as the integers that hold their bits, so -0.0 != 0.0 and a NaN matches only
# the same NaN (payload and sign included): torch.equal would pass the first and fail the second.
_INT_VIEW = {
    torch.float64: torch.int64,
    torch.float32: torch.int32,
    torch.float16: torch.int16,
    torch.bfloat16: torch.int16,
}


def assert_bitwise(actual: Any, expected: Any, what: str = "") -> None:
    """Assert that ``actual`` is ``expected`` bit for bit; ``what`` names it in the message.

    Tensors: same dtype, shape, device and bits. Dataclasses (compared field by field), dicts,
    lists and tuples: same structure, compared element by element. Anything else (numbers,
    ``None``, strings): same type and ``==``. Raises ``AssertionError`` naming the first
    difference, e.g. ``what.grads['fc.weight']``; it raises explicitly, so ``python -O`` keeps it.
    """
    if isinstance(expected, torch.Tensor):
        _assert_tensor(actual, expected, what)
    elif dataclasses.is_dataclass(expected) and not isinstance(expected, type):
        _check(type(actual) is type(expected), f"{what}: {type(actual).__name__} is not {type(expected).__name__}")
        for field in dataclasses.fields(expected):
            assert_bitwise(getattr(actual, field.name), getattr(expected, field.name), f"{what}.{field.name}")
    elif isinstance(expected, dict):
        _check(
            isinstance(actual, dict) and actual.keys() == expected.keys(),
            f"{what}: keys {_keys(actual)} != {_keys(expected)}",
        )
        for k in expected:
            assert_bitwise(actual[k], expected[k], f"{what}[{k!r}]")
    elif isinstance(expected, (list, tuple)):
        _check(
            type(actual) is type(expected) and len(actual) == len(expected),
            f"{what}: {type(actual).__name__} of {_len(actual)} != {type(expected).__name__} of {len(expected)}",
        )
        for i, (a, e) in enumerate(zip(actual, expected)):
            assert_bitwise(a, e, f"{what}[{i}]")
    else:
        _check(type(actual) is type(expected) and actual == expected, f"{what}: {actual!r} != {expected!r}")


def _assert_tensor(actual: Any, expected: torch.Tensor, what: str) -> None:
    _check(isinstance(actual, torch.Tensor), f"{what}: {type(actual).__name__} is not a Tensor")
    meta_a = (actual.dtype, tuple(actual.shape), actual.device)
    meta_e = (expected.dtype, tuple(expected.shape), expected.device)
    _check(meta_a == meta_e, f"{what}: (dtype, shape, device) {meta_a} != {meta_e}")
    a, e = actual.detach().contiguous(), expected.detach().contiguous()
    if a.dtype in _INT_VIEW:
        a, e = a.view(_INT_VIEW[a.dtype]), e.view(_INT_VIEW[e.dtype])
    if torch.equal(a, e):
        return
    differs = (a != e).reshape(-1)
    first = int(differs.nonzero()[0])
    raise AssertionError(
        f"{what}: {int(differs.sum())} of {differs.numel()} elements differ in their bits; the first at flat "
        f"index {first}: {actual.reshape(-1)[first].item()!r} != {expected.reshape(-1)[first].item()!r}\n"
        f"actual:   {actual}\nexpected: {expected}"
    )


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise AssertionError(message)


def _keys(value: Any) -> Any:
    return sorted(map(repr, value.keys())) if isinstance(value, dict) else type(value).__name__


def _len(value: Any) -> Any:
    return len(value) if hasattr(value, "__len__") else "?"
