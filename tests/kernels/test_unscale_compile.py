"""The custom ops under torch.compile: the backend ladder eager -> aot_eager -> inductor.

Each rung must trace the ops in one graph (``fullgraph=True`` and a compile counter of one
frame, no graph-break counter) and give eager's results bit for bit: the ops are opaque to the
compiler, so the same kernels run on the same data.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch._dynamo.testing
from torch._dynamo.utils import counters

from amp_fx.kernels import unscale_check_, unscale_check_norm_

_INT_VIEW = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}


def _inputs() -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(n, generator=gen) * 1e4 for n in (1, 130, 1025)]
    grads.append((torch.randn(33, 40, generator=gen) * 1e4).to(torch.bfloat16).t())
    grads[2][7] = float("inf")
    return grads, torch.zeros(()), torch.tensor(1.0 / 3.0)


def _step(grads: list[torch.Tensor], found_inf: torch.Tensor, inv_scale: torch.Tensor) -> torch.Tensor:
    """A training-step fragment: unscale+check+norm, then use the norm and the flag on device."""
    sum_sq = unscale_check_norm_(grads, found_inf, inv_scale)
    return torch.where(found_inf > 0, torch.zeros(()), sum_sq.sqrt())


def _check_only(grads: list[torch.Tensor], found_inf: torch.Tensor, inv_scale: torch.Tensor) -> torch.Tensor:
    unscale_check_(grads, found_inf, inv_scale)
    return found_inf + 0.0


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(_INT_VIEW[t.dtype])


# Inductor only on the norm op: one inductor compile costs ~10-18 s on this 2-core machine, and
# the check op's graph is the norm op's minus its output.
_LADDER = [
    ("eager", _check_only),
    ("eager", _step),
    ("aot_eager", _check_only),
    ("aot_eager", _step),
    ("inductor", _step),
]


@pytest.mark.slow_cases
@pytest.mark.parametrize("backend, fn", _LADDER, ids=[f"{b}-{f.__name__.strip('_')}" for b, f in _LADDER])
def test_compiles_without_graph_break(
    backend: str, fn: Callable[[list[torch.Tensor], torch.Tensor, torch.Tensor], torch.Tensor]
) -> None:
    torch._dynamo.reset()
    counters.clear()
    eager_grads, eager_found, inv_scale = _inputs()
    eager_out = fn(eager_grads, eager_found, inv_scale)

    grads, found_inf, _ = _inputs()
    identities = [id(g) for g in grads]
    counter = torch._dynamo.testing.CompileCounterWithBackend(backend)
    compiled = torch.compile(fn, backend=counter, fullgraph=True)
    out = compiled(grads, found_inf, inv_scale)

    assert counter.frame_count == 1, f"{counter.frame_count} frames compiled"
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert [id(g) for g in grads] == identities
    for i, (g, e) in enumerate(zip(grads, eager_grads)):
        assert torch.equal(_bits(g), _bits(e)), f"grads[{i}] differs from eager under {backend}"
    assert torch.equal(found_inf, eager_found) and found_inf.item() == 1.0
    assert torch.equal(out, eager_out), f"{out} != {eager_out}"


def test_fake_impl_shapes() -> None:
    """Under FakeTensorMode the norm op returns a 0-dim fp32 tensor on found_inf's device."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        grads = [torch.empty(5), torch.empty(3, 4)]
        sum_sq = torch.ops.amp_fx.unscale_check_norm_(grads, torch.zeros(()), torch.ones(()), None)
        assert sum_sq.shape == () and sum_sq.dtype == torch.float32
        assert torch.ops.amp_fx.unscale_check_(grads, torch.zeros(()), torch.ones(()), None) is None


@pytest.mark.parametrize("op_name", ["unscale_check_", "unscale_check_norm_"])
def test_opcheck(op_name: str) -> None:
    """torch.library.opcheck: schema (mutations declared), fake impl, dispatch consistency."""
    op = getattr(torch.ops.amp_fx, op_name).default
    grads = [torch.randn(17) * 100, torch.randn(4, 5) * 100]
    torch.library.opcheck(
        op,
        (grads, torch.zeros(()), torch.tensor(0.25), None),
        test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_static"),
    )
