"""The eager-read record of FSDP2's fp8 all-gather (amp_fx/_dist/fp8_gather.py,
amp_fx/kernels/fp8_weight.py), on one process: each ``GatheredFp8Weights`` is built over stand-ins
for FSDP2's sharded parameters (only their ``_local_tensor`` is read) and its weights are made by
the all-gather extension it attaches, as FSDP2 calls it after a one-rank all-gather. The
distributed path (2 gloo ranks) is ``tests/distributed/test_distributed_fp8.py``."""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import torch
import torch._dynamo.testing

import amp_fx
from amp_fx._common.report import Reporter
from amp_fx._dist.fp8_gather import GatheredFp8Weights
from amp_fx.kernels.fp8_recipes import E4M3


def _gathered(name: str) -> tuple[GatheredFp8Weights, torch.Tensor]:
    """A GatheredFp8Weights of one weight, and that weight as FSDP2's all-gather hands it over."""
    shard = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
    gathered = GatheredFp8Weights([SimpleNamespace(_local_tensor=shard)], [name])  # type: ignore[list-item]
    scale = torch.tensor(16.0)
    weight, _ = shard.fsdp_post_all_gather(((shard * scale).to(E4M3),), (scale,), torch.float32)
    return gathered, weight


def _check(gathered: GatheredFp8Weights) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", amp_fx.AmpFxWarning)
        gathered.check([], Reporter(strict=False))
    return [str(w.message) for w in caught if issubclass(w.category, amp_fx.AmpFxWarning)]


def test_each_model_reports_its_own_eager_reads() -> None:
    """Two models' fp8-gathered weights in one process: an eager read of A's weight (through a
    view, as the fp8 pass's transpose) is A's to report, B's check neither reports nor clears it,
    and a third model built later does not clear it either."""
    a, wa = _gathered("a.weight")
    b, wb = _gathered("b.weight")
    assert torch.equal(wa.t().abs(), wa.dequantized().t().abs())  # a read sees data / scale
    wb.neg()
    _gathered("c.weight")

    got_b = _check(b)
    assert len(got_b) == 1 and "b.weight" in got_b[0], got_b
    assert "a weight by aten.neg.default outside any compiled graph" in got_b[0], got_b
    assert "aten.abs" not in got_b[0], got_b

    got_a = _check(a)
    assert len(got_a) == 1 and "a.weight" in got_a[0], got_a
    assert "a weight by aten.abs.default outside any compiled graph" in got_a[0], got_a
    assert "aten.neg" not in got_a[0], got_a
    assert _check(a) == []  # read and cleared: said once


def test_the_record_survives_compile_without_recompiles() -> None:
    """A weight flattened by Dynamo and AOTAutograd (aot_eager): a view the graph returns is
    rebuilt from the flatten context and still records into its model's reads; the context (the
    dtype and the record's int id) passes Dynamo's guard, which compares a deep copy of it with
    ``==``, so a second call compiles nothing (a record object in the context would not equal its
    copy: the guard fails). The matmul inside the graph reads data / scale of fake tensors:
    no eager read."""
    a, wa = _gathered("a.weight")
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    f = torch.compile(lambda x, w: (x @ w.t(), w.t()), backend=counter, fullgraph=True)
    x = torch.randn(2, 8, generator=torch.Generator().manual_seed(1))
    for _ in range(2):
        y, view = f(x, wa)
    assert counter.frame_count == 1
    assert torch.equal(y, x @ wa.dequantized().t())
    assert _check(a) == []
    view.abs()
    got = _check(a)
    assert len(got) == 1 and "a weight by aten.abs.default outside any compiled graph" in got[0], got


def test_an_eager_read_after_the_first_call_is_reported() -> None:
    """A DDP/FSDP2 model's call (``checked_units``) checks its fp8-gathered weights at every call
    that ran graphs, not only the first: an eager read that only a later call makes (a branch
    taken at step 100) is reported then. It used to be recorded and never said."""
    from amp_fx.backend.call import checked_units

    model = torch.nn.Linear(8, 4)
    compiled = amp_fx.compile(model, dtype="bf16", backend="aot_eager", strict=False)
    backend = compiled.__dict__["_amp_fx_backend"]
    gathered, weight = _gathered("a.weight")

    def call(x: torch.Tensor, read: bool) -> torch.Tensor:
        y = compiled(x)  # runs a captured graph
        if read:  # the weight read in eager code, as after a graph break
            weight.neg()
        return y

    checked = checked_units(call, model, backend, gathered=gathered)
    x = torch.randn(2, 8, generator=torch.Generator().manual_seed(2))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", amp_fx.AmpFxWarning)
        checked(x, False)
        checked(x, False)
        assert [w for w in caught if "all-gathers" in str(w.message)] == []
        checked(x, True)
        checked(x, True)
    said = [str(w.message) for w in caught if "all-gathers" in str(w.message)]
    assert len(said) == 1, said  # said once
    assert "a.weight" in said[0] and "a weight by aten.neg.default outside any compiled graph" in said[0], said
