"""amp_fx under FSDP2 (``fully_shard`` per Linear and on the root): 2 gloo ranks, bitwise with eager.

Reference: the eager sharded model + ``torch.autocast`` + FSDP's ``ShardedGradScaler``. amp_fx:
``amp_fx.compile(sharded_model, backend="aot_eager")`` + ``amp_fx.GradScaler``. 8 steps, with
overflows in one rank's batch (``INF_BATCH``) and an inf written into one element of rank 0's
*local shard* of a weight gradient (``INF_GRAD``), which no other rank holds: every rank must
skip that step, as with ShardedGradScaler. The negative twin runs amp_fx with the cross-rank
combination switched off and shows the ranks diverge. Also: FSDP2's MixedPrecisionPolicy,
accumulation without gradient sync plus global-norm clipping, resume from a distributed
checkpoint, and compile_step's refusal. All cases run in one spawn.
"""

from __future__ import annotations

import pytest
import torch
from _dist_asserts import assert_same_run, skipped_steps
from _dist_cases import DTYPES, INF_BATCH, INF_GRAD, STEPS, fsdp_all

from amp_fx.testing import assert_bitwise
from amp_fx.testing.distributed import run_ranks

pytestmark = pytest.mark.skipif(
    not (torch.distributed.is_available() and torch.distributed.is_gloo_available()),
    reason="needs torch.distributed with gloo")

KINDS = ["seq", "custom"]
PLANTED = sorted({step for step, _ in INF_BATCH} | {step for step, _ in INF_GRAD})


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    return run_ranks(fsdp_all, str(tmp_path_factory.mktemp("dcp") / "checkpoint"))


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("kind", KINDS)
def test_fsdp2_bitwise_with_eager_fsdp2_autocast_and_sharded_scaler(ranks, dtype, kind):
    for rank, res in enumerate(ranks):
        assert_same_run(res[(dtype, kind, "amp_fx")], res[(dtype, "seq", "eager")],
                       f"rank {rank}, {dtype}, {kind}")


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize(("kind", "form"), [("seq", "eager"), ("seq", "amp_fx"), ("custom", "amp_fx")])
def test_fsdp2_inf_in_one_ranks_shard_skips_on_every_rank(ranks, dtype, kind, form):
    runs = [res[(dtype, kind, form)] for res in ranks]
    for rank, run in enumerate(runs):
        assert skipped_steps(run) == PLANTED, f"rank {rank}"
        assert_bitwise(run["scales"], runs[0]["scales"], f"rank {rank} scales")


def test_fsdp2_without_cross_rank_flag_the_ranks_diverge(ranks):
    """The planted gradient inf is in rank 0's shard only: proof that the test above can fail."""
    rank0, rank1 = (res[("fp16", "seq", "amp_fx", "no_combine")] for res in ranks)
    grad_step = next(step for step, rank in INF_GRAD if rank == 0)
    assert grad_step in skipped_steps(rank0)
    assert grad_step not in skipped_steps(rank1)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("kind", KINDS)
def test_fsdp2_graphs_captured_and_one_scaler_collective_per_step(ranks, dtype, kind):
    for res in ranks:
        run = res[(dtype, kind, "amp_fx")]
        assert run["linears"] == 2  # both sharded Linear layers ran in captured graphs
        assert run["scaler_collectives"] == STEPS


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_fsdp2_mixed_precision_policy_param_dtype_bitwise_with_eager(ranks, dtype):
    """MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=float32): FSDP2 gathers low-precision
    weights, amp_fx casts compute; bitwise with eager FSDP2 under the same policy + autocast."""
    for rank, res in enumerate(ranks):
        got, want = res[(dtype, "seq", "amp_fx", "param_dtype")], res[(dtype, "seq", "eager", "param_dtype")]
        assert_same_run(got, want, f"rank {rank}, {dtype}")
        assert got["linears"] == 2
        assert skipped_steps(got) == PLANTED


def test_fsdp2_mixed_precision_policy_other_param_dtype_is_refused(ranks):
    for res in ranks:
        message = res["mismatch_error"]
        assert "param_dtype=torch.float16" in message and "dtype=torch.bfloat16" in message


def test_fsdp2_accumulation_without_gradient_sync_and_global_clipping_bitwise(ranks):
    """Two micro-batches per step, the first under ``set_requires_gradient_sync(False)``, then
    unscale_ + clip_grad_norm_(1.0) over the DTensor gradients (the global norm across shards);
    bitwise with eager FSDP2 + ShardedGradScaler, norms included."""
    for rank, res in enumerate(ranks):
        got, want = res[("fp16", "seq", "amp_fx", "accum_clip")], res[("fp16", "seq", "eager", "accum_clip")]
        assert_same_run(got, want, f"rank {rank}")
        assert skipped_steps(got) == PLANTED
        assert got["scaler_collectives"] == STEPS  # unscale_ once per step, its one all-reduce


def test_compile_step_on_fsdp2_is_refused_clearly(ranks):
    for res in ranks:
        assert "fully_shard" in res["compile_step_error"]
        assert "amp_fx.compile(model)" in res["compile_step_error"]


def test_fsdp2_resume_from_distributed_checkpoint_bitwise(ranks):
    """Save model, optimizer (sharded, torch.distributed.checkpoint) and scaler state after 4 of
    8 steps, load into fresh objects, continue: the same losses, scales and shards bit for bit."""
    for rank, res in enumerate(ranks):
        assert_same_run(res["resume"]["resumed"], res["resume"]["straight"], f"rank {rank}")


def test_keep_fp32_names_under_the_root_apply_on_fsdp2(ranks):
    """keep_fp32=("2",), a name under the wrapped model the user compiled, keeps that module
    in fp32 inside the separately compiled units, and nothing is reported."""
    for res in ranks:
        report = res["keep_fp32_names"]
        assert report["kept_dtype"] == torch.float32
        assert report["plain_dtype"] != torch.float32
        assert report["warnings"] == []
