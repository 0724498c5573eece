"""The byte counters of amp_fx/testing/memory.py (what bench/bench_memory.py prints), checked
against counts made by hand from shapes and dtypes."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import amp_fx
from amp_fx.testing.memory import (
    COUNTING_BACKEND,
    GradBytes,
    PeakBytes,
    SavedBytes,
    held_bytes,
    sent_bytes,
    unique_bytes,
    weight_cache_tensors,
)

IN, OUT, BATCH = 16, 32, 8
WEIGHT, BIAS, X = OUT * IN, OUT, BATCH * IN  # elements


def _linear() -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(IN, OUT)


def test_saved_bytes_of_a_linear_fp32_and_autocast() -> None:
    # y = x @ W.T + b saves x (for W's gradient) and W (a view of it, for x's gradient); b nothing.
    layer, x = _linear(), torch.randn(BATCH, IN, requires_grad=True)
    with SavedBytes() as saved:
        layer(x).sum().backward()
    assert saved.bytes() == 4 * (X + WEIGHT)
    assert saved.bytes(exclude=list(layer.parameters())) == 4 * X
    # Under autocast it saves the bf16 casts of both instead: new storages, none a parameter.
    with SavedBytes() as saved, torch.autocast("cpu", torch.bfloat16):
        layer(x).sum().backward()
    assert saved.bytes() == saved.bytes(exclude=list(layer.parameters())) == 2 * (X + WEIGHT)


def test_fp8_saves_the_weight_for_the_backward_not_its_fp8_cast() -> None:
    """Saved for the backward, a weight's fp8 cast (one byte per element) lives from the forward to
    the backward; the fp32 weight is held anyway (a parameter), so the backward casts it again, as
    torchao does (tests/fp8/ compares the bytes with torchao's where it is installed). The
    partitioner (``aot_eager_decomp_partition`` runs inductor's) counts a weight free to keep only
    where AOTAutograd sees it as a static input: amp_fx/backend/dynamo_inputs.py."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(IN, OUT, bias=False), nn.ReLU(), nn.Linear(OUT, IN, bias=False))
    compiled = amp_fx.compile(model, dtype="bf16", fp8="tensorwise", backend="aot_eager_decomp_partition")
    x = torch.randn(BATCH, IN)  # no gradient: only the second weight's cast feeds a backward GEMM
    compiled(x).float().sum().backward()  # compiles outside the hooks (fake tensors)
    with SavedBytes() as saved:
        out = compiled(x)
    out.float().sum().backward()
    weight_size = model[2].weight.numel()
    fp8_weights = [
        tuple(t.shape)
        for t in saved.tensors
        if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) and t.numel() == weight_size
    ]
    assert fp8_weights == []
    ptr = model[2].weight.untyped_storage().data_ptr()
    assert any(t.untyped_storage().data_ptr() == ptr for t in saved.tensors), "the fp32 weight is saved"


class _Logits(nn.Module):
    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lm(input_ids=ids).logits


def test_fp8_saves_the_weight_not_its_cast_in_a_graph_with_captured_constants() -> None:
    """GPT-2 (transformers) builds tensor constants in its attention while traced: capture makes
    them buffers of the graph (``_tensor_constant0``...), which Dynamo has no source for, and
    ``carry_dynamo_inputs`` left every such graph on AOTAutograd's plain path, where the
    partitioner saves the fp8 cast of the LM head's weight (128 x 64, 1 byte an element) for the
    backward instead of the (tied, fp32) weight. Now each constant gets a source: the cast is not
    saved, the weight is, in the graph Dynamo recompiles with a symbolic batch and length (the
    first graph, static, has constants too). (The Conv1D projections are kept out of fp8 here:
    in fp8 they save a cast of the weight's transpose, constants or not, a matter of Conv1D's
    ``addmm``, not of this.)"""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    lm = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(  # one layer: the graph has its constants
            n_layer=1, n_embd=64, n_head=4, vocab_size=128, n_positions=64, bos_token_id=0, eos_token_id=0
        )
    )
    from transformers.pytorch_utils import Conv1D

    # the projections (Conv1D) kept out of fp8: only the head's matmul, a smaller graph to compile
    compiled = amp_fx.compile(
        _Logits(lm),
        dtype="bf16",
        fp8="tensorwise",
        backend="aot_eager_decomp_partition",
        policy=amp_fx.Policy(keep_out_of_fp8=(Conv1D,)),
    )
    batches = [torch.randint(0, 128, shape, generator=torch.Generator().manual_seed(0)) for shape in ((2, 8), (3, 12))]
    for ids in batches:
        compiled(ids).float().sum().backward()  # compiles outside the hooks; the second recompiles
    records = amp_fx.records(compiled)
    symbolic = [
        n
        for n in records[-1].rewritten.graph.find_nodes(op="placeholder")
        if isinstance(n.meta.get("val"), torch.SymInt)
    ]
    assert len(records) == 2 and symbolic, "the premise: a second graph, with symbolic sizes"
    assert any(name.startswith("_tensor_constant") for name, _ in records[1].rewritten.named_buffers()), "the premise"
    with SavedBytes() as saved:
        out = compiled(batches[1])
    out.float().sum().backward()
    head = lm.lm_head.weight
    casts = [tuple(t.shape) for t in saved.tensors if t.dtype == torch.float8_e4m3fn and t.shape == head.shape]
    assert casts == [], "the LM head's fp8 cast is saved for the backward"
    ptr = head.untyped_storage().data_ptr()
    assert any(t.untyped_storage().data_ptr() == ptr for t in saved.tensors), "the fp32 weight is saved"


def test_saved_bytes_count_a_storage_once() -> None:
    # Two linears read the same x: two saves, one storage. A view of x is x's storage too.
    a, b, x = _linear(), _linear(), torch.randn(BATCH, IN)
    with SavedBytes() as saved:
        (a(x).sum() + b(x[1:]).sum()).backward()
    assert len(saved.tensors) == 2
    assert saved.bytes() == 4 * X


def _allocate() -> torch.Tensor:
    a = torch.empty(1000)  # 4,000 live
    b = torch.empty(2000)  # 12,000: the peak
    del a
    c = torch.empty(500)  # 10,000
    del b, c  # 0
    return torch.empty(3000)  # 12,000 again, kept


def test_peak_bytes_follows_every_allocation_and_free() -> None:
    with PeakBytes("cpu") as peak:
        kept = _allocate()
    assert peak.bytes == 12_000
    assert peak.net == kept.numel() * 4 == 12_000


def test_held_bytes_after_an_adamw_step_and_in_the_weight_cache() -> None:
    layer = _linear()
    opt = torch.optim.AdamW(layer.parameters())
    params = list(layer.parameters())
    with GradBytes(params) as grads:
        layer(torch.randn(BATCH, IN)).sum().backward()
    assert grads.bytes == 4 * (WEIGHT + BIAS)
    opt.step()
    # AdamW: exp_avg and exp_avg_sq like each parameter, and a 0-dim fp32 step count per parameter.
    assert held_bytes(params, opt) == {
        "parameters": 4 * (WEIGHT + BIAS),
        "gradients": 4 * (WEIGHT + BIAS),
        "optimizer state": 2 * 4 * (WEIGHT + BIAS) + 2 * 4,
        "caches": 0,
    }
    opt.zero_grad(set_to_none=True)
    assert held_bytes(params, opt)["gradients"] == 0
    # amp_fx's weight cache holds one bf16 copy of W and of b (autocast casts all of addmm's operands).
    compiled = amp_fx.compile(layer, dtype="bf16", backend="aot_eager", weight_cache=True)
    compiled(torch.randn(BATCH, IN))
    cache = weight_cache_tensors(compiled.amp_fx_weight_cache)
    assert held_bytes(params, opt, cache)["caches"] == unique_bytes(cache) == 2 * (WEIGHT + BIAS)


def _collectives(rank: int, world_size: int) -> dict[str, Any]:
    """Known collectives on ``world_size`` ranks; what ``sent_bytes`` counted, and their results."""
    from torch.distributed import _functional_collectives as funcol

    out: dict[str, Any] = {}
    with sent_bytes() as sent:
        t = torch.full((10,), float(rank + 1))
        dist.all_reduce(t)  # 10 fp32
        gathered = torch.empty(world_size * 3)
        dist.all_gather_into_tensor(gathered, torch.full((3,), float(rank)))  # this rank's 3 fp32
        scattered = torch.empty(4 // world_size)
        dist.reduce_scatter_tensor(scattered, torch.arange(4.0))  # the whole 4 fp32
        reduced = funcol.all_reduce(torch.ones(5, dtype=torch.bfloat16), "sum", dist.group.WORLD)  # 5 bf16
    out["collectives"] = dict(sent)
    out["values"] = (t, gathered, scattered, reduced)
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(_linear())
    with sent_bytes() as sent:
        model(torch.randn(BATCH, IN)).sum().backward()  # one bucket: every fp32 gradient
    out["ddp"] = dict(sent)
    return out


def _check_sent(r: dict[str, Any]) -> None:
    assert r["collectives"] == {"all_reduce": 4 * 10 + 2 * 5, "all_gather": 4 * 3, "reduce_scatter": 4 * 4}
    assert r["ddp"] == {"all_reduce": 4 * (WEIGHT + BIAS)}


def test_sent_bytes_in_one_rank() -> None:
    # One rank in this process (fast): the counts, and that each collective still ran.
    dist.init_process_group(COUNTING_BACKEND, store=dist.HashStore(), rank=0, world_size=1)
    try:
        r = _collectives(0, 1)
    finally:
        dist.destroy_process_group()
    _check_sent(r)
    t, gathered, scattered, reduced = r["values"]
    torch.testing.assert_close(t, torch.full((10,), 1.0), atol=0, rtol=0)
    torch.testing.assert_close(gathered, torch.zeros(3), atol=0, rtol=0)
    torch.testing.assert_close(scattered, torch.arange(4.0), atol=0, rtol=0)
    torch.testing.assert_close(reduced, torch.ones(5, dtype=torch.bfloat16), atol=0, rtol=0)


@pytest.mark.slow  # two spawned gloo ranks: about 10-60 s on a loaded 2-core machine
def test_sent_bytes_in_two_ranks() -> None:
    # all_gather counts this rank's shard, reduce_scatter the whole input: told apart with 2 ranks.
    from amp_fx.testing.distributed import run_ranks

    for rank, r in enumerate(run_ranks(_collectives, backend=COUNTING_BACKEND)):
        _check_sent(r)
        t, gathered, scattered, reduced = r["values"]
        # the collectives still ran (gloo underneath): sums and gathers of what the ranks sent
        torch.testing.assert_close(t, torch.full((10,), 3.0), atol=0, rtol=0)
        torch.testing.assert_close(gathered, torch.tensor([0.0, 0, 0, 1, 1, 1]), atol=0, rtol=0)
        torch.testing.assert_close(scattered, 2 * torch.arange(2.0 * rank, 2.0 * rank + 2), atol=0, rtol=0)
        torch.testing.assert_close(reduced, torch.full((5,), 2.0, dtype=torch.bfloat16), atol=0, rtol=0)
