"""Eager autocast as the reference, and amp_fx's capture + insert_casts run on the same call.

The reference is always eager autocast on the same inputs: whatever dtype it gives (or the error it
raises) is what amp_fx must give. Nothing here hard-codes an expected dtype.

CPU: eager runs under ``torch.autocast("cpu")`` on real tensors; amp_fx captures on fake copies and
its rewritten graph then runs on the real tensors, so values can be compared bit for bit.

CUDA on a CPU-only build: tensors created with ``device="cuda"`` inside a ``FakeTensorMode`` are
fake CUDA tensors, and switching autocast on for "cuda" by hand (:func:`cuda_autocast`) runs the
real AutocastCUDA kernels on them: ``torch.autocast("cuda")`` would disable itself without a CUDA
device, setting the state by hand does not. A few entries of torch's CUDA table (e.g. gru_cell)
still need real CUDA. Only dtypes and shapes can be compared there.
"""

from __future__ import annotations

import contextlib
import importlib.util
import sys
import types
import unittest
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any
from unittest import mock

import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_flatten, tree_unflatten

from amp_fx import AmpFxError, Policy
from amp_fx.passes.capture import capture
from amp_fx.passes.insert_casts import insert_casts

DTYPES = (torch.bfloat16, torch.float16)

# Eager autocast's message for a banned op (binary_cross_entropy on CUDA). Where eager refuses an op
# as banned, amp_fx must refuse it with its own AmpFxError, not merely fail somewhere.
BANNED_MESSAGE = "unsafe to autocast"


def load_autocast_test_lists() -> types.ModuleType:
    """``torch.testing._internal.autocast_test_lists``, also where ``expecttest`` is missing.

    The module takes only ``TEST_WITH_ROCM`` and ``TestCase`` from ``common_utils``, which imports
    ``expecttest`` (not a dependency of amp_fx). Without it, the module is loaded with a stand-in
    ``common_utils`` that holds just those two names; ``sys.modules`` is restored afterwards.
    """
    try:
        from torch.testing._internal import autocast_test_lists

        return autocast_test_lists
    except ModuleNotFoundError as e:
        if e.name != "expecttest":
            raise
    stand_in = types.ModuleType("torch.testing._internal.common_utils")
    stand_in.TEST_WITH_ROCM = torch.version.hip is not None
    stand_in.TestCase = unittest.TestCase
    spec = importlib.util.find_spec("torch.testing._internal.autocast_test_lists")
    module = importlib.util.module_from_spec(spec)
    with mock.patch.dict(sys.modules, {"torch.testing._internal.common_utils": stand_in}):
        spec.loader.exec_module(module)
    return module


@contextlib.contextmanager
def cuda_autocast(dtype: torch.dtype) -> Iterator[None]:
    """Eager CUDA autocast without CUDA: the AutocastCUDA kernels run on fake CUDA tensors."""
    assert not torch.is_autocast_enabled("cuda")
    torch.set_autocast_enabled("cuda", True)
    torch.set_autocast_dtype("cuda", dtype)
    torch.autocast_increment_nesting()
    try:
        yield
    finally:
        torch.autocast_decrement_nesting()
        torch.set_autocast_enabled("cuda", False)
        torch.clear_autocast_cache()


def eager_autocast(device_type: str, dtype: torch.dtype) -> contextlib.AbstractContextManager:
    if device_type == "cuda":
        return cuda_autocast(dtype)
    return torch.autocast(device_type, dtype=dtype)


@dataclass
class Call:
    """One call of an op: ``fn(*args, **kwargs)``; tensors may sit inside lists and tuples."""

    fn: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any] = field(default_factory=dict)

    def run(self) -> Any:
        return self.fn(*self.args, **self.kwargs)

    def tensors_and_rebuild(self) -> tuple[list[torch.Tensor], Callable[..., Any]]:
        """The call's tensors, and a function of exactly those tensors that makes the call.

        Non-tensor arguments (ints, strings, dtypes) are closed over, so the captured graph's
        placeholders are the tensors only, as in a Dynamo graph.
        """
        leaves, spec = tree_flatten((self.args, self.kwargs))
        where = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]

        def call(*tensors: torch.Tensor) -> Any:
            filled = list(leaves)
            for i, t in zip(where, tensors, strict=True):
                filled[i] = t
            args, kwargs = tree_unflatten(filled, spec)
            return self.fn(*args, **kwargs)

        return [leaves[i] for i in where], call


@dataclass
class Outcome:
    """What one side gave: its output, or the exception it raised."""

    value: Any = None
    error: BaseException | None = None
    graph: torch.fx.GraphModule | None = None


def run_eager(call: Call, device_type: str, dtype: torch.dtype, fake_mode: FakeTensorMode | None = None) -> Outcome:
    """The reference: ``call`` under eager autocast (inside ``fake_mode`` for fake CUDA tensors)."""
    with fake_mode or contextlib.nullcontext(), eager_autocast(device_type, dtype):
        try:
            return Outcome(value=call.run())
        except Exception as e:  # noqa: BLE001 - the reference's error is itself the result
            return Outcome(error=e)


def run_amp_fx(call: Call, device_type: str, dtype: torch.dtype, fake_mode: FakeTensorMode | None = None) -> Outcome:
    """``call`` through capture + insert_casts, with autocast off.

    Without ``fake_mode`` (CPU, real tensors) the capture runs on fake copies in a fresh mode and
    the rewritten graph on the real tensors; with it (fake CUDA tensors) everything runs there.
    """
    assert not torch.is_autocast_enabled(device_type)
    tensors, fn = call.tensors_and_rebuild()
    real = fake_mode is None
    mode = FakeTensorMode() if real else fake_mode
    gm = None
    try:
        fake_args = [mode.from_tensor(t) for t in tensors] if real else tensors
        with mode:
            gm = capture(
                fn, fake_args, policy=Policy(), device_type=device_type, dtype=dtype, leaf_flags=[False] * len(tensors)
            )
        gm, _ = insert_casts(gm, policy=Policy(), device_type=device_type, dtype=dtype, fake_mode=mode)
        if real:
            return Outcome(value=gm(*tensors), graph=gm)
        with mode:
            return Outcome(value=gm(*tensors), graph=gm)
    except Exception as e:  # noqa: BLE001 - compared against the reference's error
        return Outcome(error=e, graph=gm)


def _describe(value: Any) -> list[Any]:
    leaves, _ = tree_flatten(value)
    return [(t.dtype, tuple(t.shape)) if isinstance(t, torch.Tensor) else t for t in leaves]


def _bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype.is_floating_point or a.dtype.is_complex:
        # Same bits, except that any NaN matches any NaN (payloads are not part of the contract).
        a_nan, b_nan = torch.isnan(a), torch.isnan(b)
        if not torch.equal(a_nan, b_nan):
            return False
        a, b = a[~a_nan], b[~b_nan]
        width = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
        if a.dtype.is_complex:
            a, b = torch.view_as_real(a), torch.view_as_real(b)
            width = {4: torch.int16, 8: torch.int32, 16: torch.int64}[a.element_size() * 2]
        return torch.equal(a.contiguous().view(width), b.contiguous().view(width))
    return torch.equal(a, b)


def assert_parity(eager: Outcome, amp: Outcome, *, compare_values: bool) -> None:
    """amp_fx gives eager autocast's output dtypes and shapes (and bits), or fails as eager does."""
    graph = amp.graph.print_readable(print_output=False) if amp.graph is not None else "<none>"
    if eager.error is not None:
        assert amp.error is not None, (
            f"eager autocast raised {eager.error!r}, but amp_fx ran and gave {_describe(amp.value)}\n{graph}"
        )
        if BANNED_MESSAGE in str(eager.error):
            assert isinstance(amp.error, AmpFxError), (
                f"eager autocast bans the op ({eager.error}); amp_fx must raise AmpFxError, got {amp.error!r}"
            )
        else:
            assert isinstance(amp.error, type(eager.error)), (
                f"eager raised {eager.error!r}, amp_fx raised {amp.error!r}"
            )
        return
    if amp.error is not None:
        raise AssertionError(
            f"eager autocast gave {_describe(eager.value)}, amp_fx raised {amp.error!r}\n{graph}"
        ) from amp.error
    assert _describe(amp.value) == _describe(eager.value), (
        f"dtypes/shapes differ: eager autocast {_describe(eager.value)}, amp_fx {_describe(amp.value)}\n{graph}"
    )
    if compare_values:
        eager_leaves, _ = tree_flatten(eager.value)
        amp_leaves, _ = tree_flatten(amp.value)
        for i, (e, a) in enumerate(zip(eager_leaves, amp_leaves, strict=True)):
            if isinstance(e, torch.Tensor):
                assert _bitwise_equal(a, e), (
                    f"output {i}: amp_fx's values differ from eager autocast's bitwise\neager {e}\namp_fx {a}\n{graph}"
                )


def check(call: Call, device_type: str, dtype: torch.dtype, fake_mode: FakeTensorMode | None = None) -> None:
    """Run both sides and assert parity (values bitwise where the tensors are real)."""
    eager = run_eager(call, device_type, dtype, fake_mode)
    amp = run_amp_fx(call, device_type, dtype, fake_mode)
    assert_parity(eager, amp, compare_values=fake_mode is None)
