"""amp_fx under expert parallelism: torchtitan's Qwen3 MoE debugmodel (2 layers, 64 experts, top 8)
parallelized by torchtitan's own ``parallelize_qwen3`` with EP 2 over FSDP2's 2 gloo ranks,
bitwise with eager autocast; ``compile_step`` with the planted overflow skipped on both ranks and
the gradient norm over the ep and fsdp meshes; the watch, compare and explain per rank; the
experts in fp8 rowwise, MXFP8 and blockwise against torchtitan's own low-precision seam. The cases:
tests/integrations/_dist_titan_moe_cases.py (one spawn: 6 to 14 minutes on 2 cores shared with other
work; the three low-precision recipes add about 5 of them, measured alone).

EP 2 x dp_shard 2 on 4 ranks is not run: one 2-rank spawn of these cases takes minutes, a 4-rank
one would double the ranks on the same 2 cores (the CI budget, docs/contributing.md).
"""

from __future__ import annotations

import re

import pytest
import torch

pytest.importorskip("torchtitan", reason="needs torchtitan (pip install amp_fx[torchtitan]; torch >= 2.12)")

from amp_fx.testing import assert_bitwise  # noqa: E402
from amp_fx.testing.distributed import run_ranks  # noqa: E402
from tests.integrations._dist_titan_moe_cases import (  # noqa: E402
    CLIP,
    EXPERT,
    LOW_PRECISION,
    LP_STEPS,
    PLANTED_STEP,
    moe_all,
)

pytestmark = [
    pytest.mark.skipif(
        not (torch.distributed.is_available() and torch.distributed.is_gloo_available()),
        reason="needs torch.distributed with gloo",
    ),
    pytest.mark.slow,
]


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return run_ranks(moe_all, world_size=2)


def _ok(res: dict, key: object, rank: int) -> dict:
    run = res[key]
    assert "error" not in run, f"rank {rank}, {key}: {run.get('error')}"
    return run


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_expert_parallel_bitwise_with_eager_autocast(ranks, dtype):
    """Losses, loss scales, every local gradient of the last step (the 32 local experts' included)
    and every parameter after it, on both ranks, bit for bit (their digests: ``_digest``); no
    AmpFxWarning. The ranks hold different experts and train on different tokens (the comparison is
    not of one thing twice)."""
    for rank, res in enumerate(ranks):
        got, want = _ok(res, (dtype, "amp_fx"), rank), _ok(res, (dtype, "eager"), rank)
        what = f"rank {rank}, {dtype}"
        assert got["amp_fx_warnings"] == [], what
        assert_bitwise(got["losses"], want["losses"], f"{what}: losses")
        assert_bitwise(got["scales"], want["scales"], f"{what}: scales")
        assert set(got["grads"]) == set(want["grads"]) and len(want["grads"]) == 23, what
        for name in want["grads"]:
            assert got["grads"][name] == want["grads"][name], f"{what}: grad {name}"
            assert got["params"][name] == want["params"][name], f"{what}: {name}"
    r0, r1 = ranks[0][(dtype, "amp_fx")], ranks[1][(dtype, "amp_fx")]
    assert r0["params"][EXPERT][1] == (32, 768, 256), r0["params"][EXPERT]  # 64 experts over ep 2
    assert r0["params"][EXPERT] != r1["params"][EXPERT]
    assert not torch.equal(r0["losses"], r1["losses"])


@pytest.mark.parametrize("form", ["eager", "amp_fx", "step"])
def test_expert_parallel_fp16_every_rank_skips_the_planted_step(ranks, form):
    """The inf is in rank 0's local shard of one expert's gradient (an expert rank 1 does not hold):
    both ranks back off at that step."""
    for rank, res in enumerate(ranks):
        scales = _ok(res, ("fp16", form), rank)["scales"].tolist()
        assert scales[PLANTED_STEP] == scales[PLANTED_STEP - 1] / 2, f"rank {rank}, {form}: {scales}"


def test_expert_parallel_compile_step_clips_with_the_norm_over_both_meshes(ranks):
    """compile_step fp16 with ``max_grad_norm`` against ``unscale_`` and clip_grad_norm_'s rule on
    the DTensor gradients (``_clip``: the expert gradients' norms reduced over ``(efsdp, ep)``, the
    others' over ``fsdp``): the losses and scales bit for bit, the parameters within the traced Adam
    step's rounding (``assert_within_traced_adam`` with ``fused_norm_bound``, run in the rank). The
    clip is not vacuous: the norm exceeds ``CLIP`` at every finite step. The eager norm is the
    global one: within 2^-12 of torchtitan's own EP norm and of the float64 norm of the whole
    gradients (measured: 6e-6 relative, the fp32 sums of 6.3M squares per expert shard), where
    leaving a mesh's sum out (one rank's experts, or the other rank's dense shards) would drop
    whole parameters' squares from it."""
    for rank, res in enumerate(ranks):
        got, want = _ok(res, ("fp16", "step"), rank), _ok(res, ("fp16", "eager"), rank)
        what = f"rank {rank}"
        assert got["amp_fx_warnings"] == [], what
        norms = want["norms"]  # per step: the reference's norm, torchtitan's, float64's
        finite = torch.isfinite(norms[:, 0])
        assert finite.tolist() == [True, False, True], f"{what}: {norms}"  # the planted step: inf
        assert bool((norms[finite, 0] > CLIP).all()), f"{what}: {norms}"
        for other in (1, 2):
            torch.testing.assert_close(norms[finite, 0], norms[finite, other], rtol=2**-12, atol=0)
        assert_bitwise(got["losses"], want["losses"], f"{what}: losses")
        assert_bitwise(got["scales"], want["scales"], f"{what}: scales")
        assert res["clip_check"] is None, res["clip_check"]  # assert_within_traced_adam, in the rank


def test_expert_parallel_watch_names_eager_autocasts_first_overflow(ranks):
    """fp16, ``layers.0.attention.wo``'s weight scaled by 1e6 on each rank's shard: the watch names
    the module eager autocast first overflows in, on each rank."""
    for rank, res in enumerate(ranks):
        run = _ok(res, ("watch", 0), rank)
        assert run["eager_first"] == "layers.0.attention.wo", f"rank {rank}: {run}"
        assert run["watch_first"] == run["eager_first"], f"rank {rank}: {run}"


def test_expert_parallel_watch_names_the_second_block(ranks):
    """The same with ``layers.1.attention.wo`` scaled: eager autocast's first overflow is there, and
    the watch names it, though FSDP2's units of one class share one compiled graph whose records
    carry the first unit's names (the watch renames the shared graph's ops for the unit that ran
    it: amp_fx/overflow/watch.py; before, it named ``layers.0.attention.wo``)."""
    for rank, res in enumerate(ranks):
        run = _ok(res, ("watch", 1), rank)
        assert run["eager_first"] == "layers.1.attention.wo", f"rank {rank}: {run}"
        assert run["watch_first"] == run["eager_first"], f"rank {rank}: {run}"


def test_expert_parallel_compare_agrees_with_eager_and_leaves_the_model_as_it_was(ranks):
    """compare (bf16) on each rank: op by op bit for bit with eager autocast, every gradient
    compared, and the model (lent to it: FSDP2) left as it was. Before ``fsdp_param_groups``
    (amp_fx/_common/compat.py) the loan raised: torchtitan's MoE blocks hold two FSDP2 parameter
    groups (experts on ``(efsdp, ep)``, the rest on ``fsdp``) and FSDP2's ``_fsdp_param_group``
    refuses a module with more than one."""
    for rank, res in enumerate(ranks):
        run = _ok(res, "compare", rank)
        assert run["ok"] and run["exact"], f"rank {rank}: {run}"
        assert run["ops"] > 0 and run["grads"] == 23, f"rank {rank}: {run}"
        assert run["state_kept"] is None, run["state_kept"]  # assert_same_state, in the rank


def _any_block(rows: list[tuple]) -> set[tuple]:
    """The rows with the block index of their module replaced by ``*``."""
    return {(kind, op, re.sub(r"^layers\.\d+\.", "layers.*.", module), *rest) for kind, op, module, *rest in rows}


def test_expert_parallel_explain_decides_as_on_the_unsharded_model(ranks):
    """explain (bf16) on each rank: every matmul, grouped expert GEMM and attention op, and each cast
    before them, decided (dtype, rule) as on the same model unsharded: each row of the EP model is
    a row of the unsharded one, and every row of the unsharded one is there up to the block index.
    Under FSDP2 the two blocks are units of one class that share compiled graphs, which explain
    lists once, under the name of the block that compiled them (here the attention part of
    ``layers.1`` ran ``layers.0``'s graph; its experts, behind the dispatcher's graph break, got
    their own); the unsharded model's one graph holds both blocks."""
    for rank, res in enumerate(ranks):
        run = _ok(res, "explain", rank)
        assert sum("_grouped_mm" in row[1] for row in run["ep"]) >= 3, f"rank {rank}: {run['ep']}"
        assert all(row in run["whole"] for row in run["ep"]), f"rank {rank}"
        assert _any_block(run["ep"]) == _any_block(run["whole"]), f"rank {rank}"


_EXPERT_WEIGHTS = {
    f"layers.{layer}.moe.routed_experts.inner_experts.{w}" for layer in (0, 1) for w in ("w1_EFD", "w3_EFD", "w2_EDF")
}


@pytest.mark.parametrize("recipe", LOW_PRECISION)
def test_expert_parallel_experts_run_the_recipe_bitwise_with_torchtitans_seam(ranks, recipe):
    """``AmpFxTitanConfig(low_precision=recipe)`` with every ``nn.Linear`` kept in bf16
    (``Policy(keep_out_of_fp8=[nn.Linear])``) against eager autocast with torchtitan's own seam
    for low-precision experts (``GroupedExperts._grouped_mm``) running the recipe's grouped GEMM
    (``low_precision_experts``: torchao's emulated MXFP8 grouped GEMM; amp_fx's rowwise and
    blockwise grouped kernels, held to torchao in tests/fp8, so for those two the pass under EP
    against its own kernel in eager): every grouped GEMM of both layers converted
    (each rank's 32 local experts, behind ``to_local()`` and the model's own ``bfloat16()``), in
    strict mode; losses, every local gradient of the last of ``LP_STEPS`` AdamW steps and every
    parameter after it bit for bit, on both ranks. Before, all 6 stayed in bf16 (the fp8 pass saw
    ``to_local`` as an op computing the weight; strict mode raised). The reference is not bf16:
    its losses differ from the bf16 case's on the same tokens and weights."""
    for rank, res in enumerate(ranks):
        got, want = _ok(res, (recipe, "amp_fx"), rank), _ok(res, (recipe, "seam"), rank)
        what = f"rank {rank}, {recipe}"
        grouped = [d for d in got["decisions"] if d[0] == "aten._grouped_mm"]
        assert all(d[3] for d in grouped), f"{what}: {[d for d in grouped if not d[3]]}"
        assert {d[2] for d in grouped} == _EXPERT_WEIGHTS, f"{what}: {grouped}"
        dense = [d for d in got["decisions"] if d[0] != "aten._grouped_mm"]
        assert dense and not any(d[3] for d in dense), f"{what}: {dense}"  # the Linears: kept by the policy
        assert all("fp8 tensor cores" in w or "emulated" in w for w in got["amp_fx_warnings"]), got["amp_fx_warnings"]
        assert_bitwise(got["losses"], want["losses"], f"{what}: losses")
        assert set(got["grads"]) == set(want["grads"]) and len(want["grads"]) == 23, what
        for name in want["grads"]:
            assert got["grads"][name] == want["grads"][name], f"{what}: grad {name}"
            assert got["params"][name] == want["params"][name], f"{what}: {name}"
        bf16 = _ok(res, ("bf16", "amp_fx"), rank)["losses"][:LP_STEPS]
        assert not torch.equal(want["losses"], bf16), f"{what}: the reference ran in bf16"
