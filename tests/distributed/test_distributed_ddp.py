"""amp_fx under DistributedDataParallel: 2 gloo ranks on 127.0.0.1, bitwise with eager DDP.

Reference: eager ``DDP(model)`` + ``torch.autocast`` + ``torch.amp.GradScaler``. amp_fx, both
wrappings: ``DDP(amp_fx.compile(model))`` and ``amp_fx.compile(DDP(model))``, with
``amp_fx.GradScaler``, backend aot_eager. 8 steps of SGD with momentum, overflows planted in one
rank's batch only (``_dist_cases.INF_BATCH``): DDP's all-reduce spreads them, every rank skips.
The model is an ``nn.Sequential`` (torch.nn classes only, where ``torch.compile(DDP(m))`` captures
nothing) and, for the outer form, a user-defined module too. All cases run in one spawn.
"""

from __future__ import annotations

import pytest
import torch

from amp_fx.testing import assert_bitwise
from amp_fx.testing.distributed import run_ranks
from tests.distributed._dist_asserts import assert_same_run, skipped_steps
from tests.distributed._dist_cases import DTYPES, INF_BATCH, ddp_all

pytestmark = pytest.mark.skipif(
    not (torch.distributed.is_available() and torch.distributed.is_gloo_available()),
    reason="needs torch.distributed with gloo",
)

FORMS = [("seq", "inner"), ("seq", "outer"), ("custom", "outer")]


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return run_ranks(ddp_all)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize(("kind", "form"), FORMS)
def test_ddp_bitwise_with_eager_ddp_autocast_and_torch_scaler(ranks, dtype, kind, form):
    for rank, res in enumerate(ranks):
        assert_same_run(res[(dtype, kind, form)], res[(dtype, "seq", "eager")], f"rank {rank}, {dtype}, {kind}, {form}")


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize(("kind", "form"), [("seq", "eager"), *FORMS])
def test_ddp_one_rank_overflow_skips_on_every_rank(ranks, dtype, kind, form):
    planted = sorted({step for step, _ in INF_BATCH})
    runs = [res[(dtype, kind, form)] for res in ranks]
    for rank, run in enumerate(runs):
        assert skipped_steps(run) == planted, f"rank {rank}"
        # DDP keeps the replicas equal: the same scale and parameters on every rank.
        assert_bitwise(run["scales"], runs[0]["scales"], f"rank {rank} scales")
        assert_bitwise(run["params"], runs[0]["params"], f"rank {rank} params")


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize(("kind", "form"), FORMS)
def test_ddp_graphs_captured_and_no_scaler_collective(ranks, dtype, kind, form):
    for res in ranks:
        run = res[(dtype, kind, form)]
        # Both Linear layers ran in a captured graph (not as eager autocast).
        assert run["linears"] == 2
        # Replicated (all-reduced) gradients need no extra collective for the found-inf flag.
        assert run["scaler_collectives"] == 0


@pytest.mark.parametrize("form", ["inner", "outer"])
def test_ddp_accumulation_with_no_sync_and_clipping_bitwise(ranks, form):
    """Two micro-batches per step, the first under ``no_sync()`` (for amp_fx.compile(DDP(m)) the
    compiled module forwards ``no_sync`` to DDP), unscale_ + clip_grad_norm_(0.5); the inf in one
    rank's batch sits in the no-sync micro-batch and reaches the other rank with the next
    all-reduce. Bitwise with the eager recipe, every rank skips the same steps."""
    planted = sorted({step for step, _ in INF_BATCH})
    for rank, res in enumerate(ranks):
        got, want = res[("fp16", "seq", form, "accum_clip")], res[("fp16", "seq", "eager", "accum_clip")]
        assert_same_run(got, want, f"rank {rank}, {form}")
        assert skipped_steps(got) == planted
        assert got["scaler_collectives"] == 0


@pytest.mark.parametrize("recipe", ["plain", "accum_clip"])
def test_compile_step_on_ddp_bitwise_sync_free_and_no_recompiles(ranks, recipe):
    """amp_fx.compile_step(DDP(model)) (StepMode.MASKED, GradNorm.TORCH, aot_eager) against eager
    DDP + autocast + torch.amp.GradScaler with the same recipe; with accumulation, the first
    micro-batch of each window runs under no_sync (one all-reduce per optimizer step), the
    inf planted in one rank's batch included. After the warm-up: no host read, no new graph."""
    planted = sorted({step for step, _ in INF_BATCH})
    for rank, res in enumerate(ranks):
        got, want = res[("fp16", "seq", "step", recipe)], res[("fp16", "seq", "eager", recipe)]
        assert_same_run(got, want, f"rank {rank}, {recipe}", keys=("losses", "scales", "params"))
        assert skipped_steps(got) == planted
        assert got["host_reads"] == 0
        assert got["graphs_after_warm_up"] == 0
        assert got["linears"] == 2


def test_keep_fp32_names_under_the_root_apply_on_ddp(ranks):
    """keep_fp32=("module.2",), a name under the wrapped model the user compiled, keeps that module
    in fp32 inside the separately compiled units, and nothing is reported."""
    for res in ranks:
        report = res["keep_fp32_names"]
        assert report["kept_dtype"] == torch.float32
        assert report["plain_dtype"] != torch.float32
        assert report["warnings"] == []


def test_keep_fp32_names_apply_in_the_inner_form(ranks):
    for res in ranks:
        assert res["inner_keep_fp32_dtype"] == torch.float32


@pytest.mark.parametrize("hook", ["none", "fp16_compress"])
def test_precision_report_names_ddps_all_reduce_dtype(ranks, hook):
    """amp_fx.precision_report's DDP row against the dtype DDP sent in one backward: with
    fp16_compress_hook, what its dist.all_reduce received; without a hook, the gradients' dtype
    (the reducer all-reduces its bucket in it, and calls no Python all_reduce). The same through
    amp_fx.compile(DDP(m)); fp32 gradients reduced in fp32 are no downgrade."""
    for res in ranks:
        got = res["precision_report"][hook]
        want = got["hook_sent"] if hook != "none" else got["grad_dtypes"]
        if hook == "none":
            assert got["hook_sent"] == []
        assert list(got["reported"]) == want == [torch.float16 if hook != "none" else torch.float32]
        assert got["wrapped"] == got["reported"]
        assert got["downgrades"] == []
