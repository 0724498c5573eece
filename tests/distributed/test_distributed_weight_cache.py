"""The weight-cast cache under DistributedDataParallel: 2 gloo ranks on 127.0.0.1.

``compile_step(DDP(model), weight_cache=True)`` and both wrappings with ``amp_fx.GradScaler``,
aot_eager, against eager DDP + ``torch.autocast`` + ``torch.amp.GradScaler``, bit for bit, with
overflows planted in one rank's batch (``_dist_cases.INF_BATCH``). Bitwise parameters on every
rank also show that DDP all-reduced every gradient: the cached cast's backward hands the fp32
gradient to the parameter's AccumulateGrad, where DDP's hooks wait. Every case runs in one spawn
(``_dist_weight_cache_cases.weight_cache_all``).
"""

from __future__ import annotations

import pytest
import torch

from amp_fx.testing.distributed import run_ranks
from tests.distributed._dist_asserts import assert_same_run, skipped_steps
from tests.distributed._dist_cases import INF_BATCH, STEPS
from tests.distributed._dist_weight_cache_cases import STEP_CASES, TP_STEPS, WARM_UP

# slow: one spawn of 2 gloo ranks runs every case of this file (tests/distributed/test_distributed_ddp.py is
# the distributed file of the inner loop)
pytestmark = [
    pytest.mark.skipif(
        not (torch.distributed.is_available() and torch.distributed.is_gloo_available()),
        reason="needs torch.distributed with gloo",
    ),
    pytest.mark.slow,
]

PLANTED = sorted({step for step, _ in INF_BATCH})
N_PARAMS = 4  # the nn.Sequential model: two Linear layers


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    from tests.distributed._dist_weight_cache_cases import weight_cache_all

    return run_ranks(weight_cache_all)


@pytest.mark.parametrize(("dtype", "accumulate"), STEP_CASES)
def test_compile_step_on_ddp_with_weight_cache_bitwise_and_sync_free(ranks, dtype, accumulate):
    """Losses, scales and parameters bitwise with the eager recipe (all but the last micro-batch
    of a window under no_sync); every rank skips the planted steps; after the warm-up no host
    read and no new graph."""
    for rank, res in enumerate(ranks):
        got, want = res[("step", dtype, accumulate)], res[("eager", dtype, accumulate)]
        assert_same_run(
            got, want, f"rank {rank}, {dtype}, accumulate={accumulate}", keys=("losses", "scales", "params")
        )
        assert skipped_steps(got) == PLANTED
        assert got["host_reads"] == 0
        assert got["graphs_after_warm_up"] == 0


@pytest.mark.parametrize(("dtype", "accumulate"), STEP_CASES)
def test_compile_step_on_ddp_forward_casts_no_weight(ranks, dtype, accumulate):
    """The cache is used: the graphs handed to the backend read the cached copies (lifted inputs,
    no cast of a parameter); after the warm-up the forwards compute no cast at all (the finish
    graph writes the copies with the update), and after every optimizer step, skipped ones
    included, each copy is exactly its weight's cast."""
    assert any(step >= WARM_UP for step in PLANTED), "no skipped step after the warm-up to check"
    for res in ranks:
        got = res[("step", dtype, accumulate)]
        assert got["has_cache"]
        assert got["param_casts"] == 0 and got["lifted"] == N_PARAMS
        assert got["recasts_after_warm_up"] == [0] * (STEPS - WARM_UP)
        assert got["copies_fresh"] == [(N_PARAMS, N_PARAMS)] * (STEPS - WARM_UP)


@pytest.mark.parametrize("form", ["outer", "inner"])
def test_ddp_forms_with_weight_cache_bitwise_one_cast_per_step(ranks, form):
    """amp_fx.compile(DDP(m), weight_cache=True) and DDP(amp_fx.compile(m, weight_cache=True)),
    4 micro-batches per step: bitwise with the eager recipe; each weight is cast by the first
    micro-batch after an optimizer step that ran and reused by the other three; after a skipped
    step (no optimizer.step()) the next window casts nothing."""
    for rank, res in enumerate(ranks):
        got = res[(form, "fp16", 4)]
        assert_same_run(got, res[("eager", "fp16", 4)], f"rank {rank}, {form}")
        assert skipped_steps(got) == PLANTED
        stepped = [True, *(not s for s in got["skipped"][:-1])]
        assert got["refreshes"] == [N_PARAMS if s else 0 for s in stepped]
        assert [r + h for r, h in zip(got["refreshes"], got["hits"])] == [4 * N_PARAMS] * STEPS


def test_weight_shared_across_graph_breaks_and_ddp_buckets_bitwise(ranks):
    """A weight used on both sides of a graph break, each graph split again at DDP's bucket
    boundaries, with ``find_unused_parameters=True`` and a parameter that gets no gradient:
    every graph of one forward gets the same cached-cast node, so the gradient contributions add
    up in bf16 as in eager autocast: bitwise, and DDP's unused-parameter search still reaches
    every used parameter (else DDP raises or the ranks diverge)."""
    for rank, res in enumerate(ranks):
        got, want = res[("step", "shared", True)], res[("eager", "shared")]
        assert got["graphs"] >= 3  # the graph break and DDPOptimizer's splits
        assert_same_run(got, want, f"rank {rank}", keys=("losses", "scales", "params"))
        assert got["param_casts"] == 0
        assert got["copies_fresh"] == [(6, 6)] * (STEPS - WARM_UP)  # fc, mid, head; not unused


def test_without_the_cache_the_shared_weight_is_not_bitwise(ranks):
    """Negative twin: without the cache each graph casts fc itself and its gradient
    contributions add up in fp32, so the run leaves eager's trajectory; the graphs cast weights,
    and amp_fx says so (DDPOptimizer's pieces hand fake tensors: fc is found by its source)."""
    for res in ranks:
        got, want = res[("step", "shared", False)], res[("eager", "shared")]
        assert not got["has_cache"] and got["param_casts"] > 0
        assert not torch.equal(got["params"][0], want["params"][0])
        split = [w.split(" ")[1] for w in got["warnings"] if "is used on both sides of a graph break" in w]
        assert sorted(split) == ["module.fc.bias", "module.fc.weight"], got["warnings"]


def test_weight_cache_refused_on_fsdp2(ranks):
    """FSDP2 gathers every parameter again in each forward, into the same tensor, without bumping
    its version counter: a cache would keep the first forward's weights. It is refused with a
    warning, and the run stays bitwise with eager FSDP2."""
    for rank, res in enumerate(ranks):
        got = res["fsdp"]
        assert not got["has_cache"]
        assert any("sharded with fully_shard (FSDP2)" in w for w in got["warnings"]), got["warnings"]
        assert_same_run(got["ours"], got["ref"], f"rank {rank}, FSDP2")


def test_tensor_parallel_with_weight_cache_bitwise_one_cast_per_step(ranks):
    """A sequence-parallel model (every parameter a DTensor), 2 micro-batches per SGD step: with
    the cache bitwise with eager autocast; every weight cast by the first micro-batch of a window
    and reused by the second (before, the lifted graph refused the DTensor weights' copies, "got
    mixed torch.Tensor and DTensor", and ran without the cache). With fp8, the cached fp8 casts
    give the same bits as casting in every forward."""
    for rank, res in enumerate(ranks):
        n = res["tp_cast_params"]
        got, want = res[("tp", "cache")], res[("tp", "eager")]
        assert_same_run(got, want, f"rank {rank}, TP", keys=("losses", "params"))
        assert got["refreshes"] == [n] * TP_STEPS and got["hits"] == [n] * TP_STEPS, (n, got["refreshes"], got["hits"])
        got, want = res[("tp", "fp8_cache")], res[("tp", "fp8")]
        assert_same_run(got, want, f"rank {rank}, TP fp8", keys=("losses", "params"))
        assert all(h > 0 for h in got["hits"]), got["hits"]


def test_compile_step_on_tensor_parallel_with_weight_cache_writes_the_copies_in_the_finish(ranks):
    """compile_step's finish updates a DTensor parameter through its local tensor, which leaves the
    DTensor's version counter where it was: the cache must see the local tensor's counter too, and
    the finish must write the copy's local tensor. Bitwise with compile_step without the cache
    (before: the stale copies were reused, the losses left the run at the first compiled step),
    nothing recast after the warm-up, every copy holding its weight's cast."""
    for rank, res in enumerate(ranks):
        got, want = res[("tp_step", True)], res[("tp_step", False)]
        assert_same_run(got, want, f"rank {rank}, TP compile_step", keys=("losses", "params"))
        assert got["recasts"] == [0] * TP_STEPS, got["recasts"]
        assert got["fresh"] == [res["tp_cast_params"]] * TP_STEPS, got["fresh"]
