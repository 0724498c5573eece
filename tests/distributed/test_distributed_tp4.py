"""amp_fx on FSDP2 x TP with both dimensions sharded: 4 gloo ranks on a dp 2 x tp 2 mesh.

What only a 2 x 2 mesh shows (tests/distributed/test_distributed_tp.py's dp 1 x tp 2 mesh shards nothing over
dp): FSDP2 all-gathers and reduce-scatters each TP shard over dp, the gradients of two different
batches are averaged, and the found-inf flag and the global gradient norm span both dimensions.
The model and the recipe: tests/distributed/_dist_tp_cases.py; the cases:
tests/distributed/_dist_tp4_cases.py. All cases run in one spawn.
"""

from __future__ import annotations

import pytest
import torch

from amp_fx.testing import assert_bitwise
from amp_fx.testing.distributed import run_ranks
from tests.distributed._dist_tp4_cases import CASES, FP8_STEPS, WORLD, dp_rank, hsdp_shard_rank, tp4_all
from tests.distributed._dist_tp_cases import PLANTED_STEP, assert_within_traced_adam, fused_norm_bound

pytestmark = [
    pytest.mark.skipif(
        not (torch.distributed.is_available() and torch.distributed.is_gloo_available()),
        reason="needs torch.distributed with gloo",
    ),
    pytest.mark.slow,
]


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return run_ranks(tp4_all, world_size=WORLD)


def _name(case: tuple) -> str:
    return " ".join(case)


@pytest.mark.parametrize("case", [c for c in CASES if c[2] == "amp_fx"], ids=_name)
def test_2x2_compile_bitwise_with_eager_autocast(ranks, case):
    """amp_fx.compile (fp16: amp_fx.GradScaler against ShardedGradScaler): no AmpFxWarning; the
    losses, scales and every rank's local parameter shards after 3 AdamW steps, bit for bit; the
    two dp ranks saw different batches (their losses differ), so the check covers FSDP2's average."""
    layout, dtype, _ = case
    for rank, res in enumerate(ranks):
        got, want = res[case], res[(layout, dtype, "eager")]
        what = f"rank {rank}, {_name(case)}"
        assert got["amp_fx_warnings"] == [], what
        assert_bitwise(got["losses"], want["losses"], f"{what}: losses")
        assert_bitwise(got["scales"], want["scales"], f"{what}: scales")
        for name in want["params"]:
            assert_bitwise(got["params"][name], want["params"][name], f"{what}: {name}")
    assert not torch.equal(ranks[0][case]["losses"], ranks[WORLD - 1][case]["losses"])


@pytest.mark.parametrize("layout", ["fsdp_tp", "hsdp_tp"])
def test_2x2_fp16_every_rank_skips_the_planted_step(ranks, layout):
    """The inf is in rank 0's local shard only; all 4 ranks back off at that step."""
    forms = ("eager", "amp_fx", "step_clip", "step_fused_clip") if layout == "fsdp_tp" else ("eager", "amp_fx")
    for form in forms:
        for rank, res in enumerate(ranks):
            scales = res[(layout, "fp16", form)]["scales"].tolist()
            assert scales[PLANTED_STEP] == scales[PLANTED_STEP - 1] / 2, f"rank {rank}, {form}: {scales}"


@pytest.mark.parametrize("form", ["step_clip", "step_fused_clip"])
def test_2x2_compile_step_with_max_grad_norm_matches_eager_recipe(ranks, form):
    """compile_step fp16 with ``max_grad_norm`` against ``unscale_`` + the global norm over both
    dimensions clipped by hand (_dist_tp_cases._clip): losses and scales bitwise, the parameters
    within the traced Adam step's rounding (the 2-rank tests' bound, ``assert_within_traced_adam``).
    Before the fix in amp_fx/_dist/step.py (FSDP2's ``_StridedShard`` dp placement counted as
    replicated) each dp rank clipped with a partial norm of its own: the second loss differed and
    ``blocks.0.attn.k.bias`` by 0.01, a whole AdamW step. ``GradNorm.FUSED`` ("step_fused_clip":
    its sums of the 2-D gradients all-reduced over dp and tp, of the norms' 1-D ones over dp)
    within that bound plus the fused norm's (``fused_norm_bound``), and within the latter alone of
    ``GradNorm.TORCH``'s parameters."""
    for rank, res in enumerate(ranks):
        got, want = res[("fsdp_tp", "fp16", form)], res[("fsdp_tp", "fp16", "eager_clip")]
        assert got["amp_fx_warnings"] == [], f"rank {rank}"
        assert_bitwise(got["losses"], want["losses"], f"rank {rank}: losses")
        assert_bitwise(got["scales"], want["scales"], f"rank {rank}: scales")
        if form == "step_clip":
            assert_within_traced_adam(got["params"], want["params"], f"rank {rank}")
            continue
        norm_bound = fused_norm_bound(want["params"])
        assert_within_traced_adam(got["params"], want["params"], f"rank {rank}", extra=norm_bound)
        for name, e in res[("fsdp_tp", "fp16", "step_clip")]["params"].items():
            a = got["params"][name]
            bound = norm_bound + 2**-23 * e.abs()  # the update's own rounding: one ulp of the value
            assert ((a - e).abs() <= bound).all(), f"rank {rank}, {name}: {(a - e).abs().max()} from GradNorm.TORCH"


def _fp8_gather_bytes(run: dict, gathers: int) -> int:
    """The bytes ``gathers`` all-gathers of this rank's shards move when each ``nn.Linear`` weight
    element travels as 1 byte (e4m3) and every other parameter element as 4 (fp32)."""
    return gathers * (run["weight_numel"] + 4 * (run["numel"] - run["weight_numel"]))


def _assert_gathered_as_torchao(runs: dict, what: str) -> None:
    """The "amp_fx" run's all-gathered bytes: each Linear weight element as 1 byte, over as many
    gathers as the "bf16" run made at 4 bytes per element; where torchao ran, its output, weight
    gradients and bytes the same."""
    ours, bf16 = runs["amp_fx"], runs["bf16"]
    gathers, left = divmod(bf16["all_gather"], 4 * bf16["numel"])
    assert gathers >= 1 and left == 0, f"{what}: {bf16['all_gather']} bytes of {bf16['numel']} fp32 elements"
    assert ours["all_gather"] == _fp8_gather_bytes(ours, gathers), f"{what}: {ours['all_gather']}"
    if "torchao" not in runs:
        return
    theirs = runs["torchao"]
    assert_bitwise(ours["out"], theirs["out"], f"{what}: output against torchao")
    for name in ("w1.weight", "w2.weight"):
        assert_bitwise(ours["grads"][name], theirs["grads"][name], f"{what}: {name} against torchao")
    assert ours["all_gather"] == theirs["all_gather"], f"{what}: {ours['all_gather']} != {theirs['all_gather']}"


def test_2x2_fp8_all_gather_bitwise_with_torchao_and_with_no_gather(ranks):
    """FSDP2 x TP (dp 2 x tp 2), fp8 tensorwise, a Colwise/Rowwise MLP with biases fed a bf16-exact
    input: each rank casts its dp shard of the TP shard with the whole weight's scale (amax over dp
    and tp) and FSDP2 gathers it in fp8. The output and every gradient bitwise with amp_fx's fp8 on
    the TP shards without FSDP2 (its own cast of the gathered TP shard; this rank's dp slice), the
    output and the weight gradients bitwise with torchao's ``enable_fsdp_float8_all_gather`` +
    ``Float8ColwiseParallel``/``Float8RowwiseParallel`` (torchao's TP styles take the bias
    gradient from the fp8 grad_output: tests/distributed/test_distributed_tp.py). Bytes all-gathered: the
    weights at 1 per element, the biases at 4, as torchao's; the bf16 run gathers all at 4."""
    for rank, res in enumerate(ranks):
        runs = res["fp8_gather"]
        ours, alone = runs["amp_fx"], runs["tp"]
        what = f"rank {rank}"
        assert_bitwise(ours["out"], alone["out"], f"{what}: output")
        for name, g in ours["grads"].items():
            ref = alone["grads"][name]
            assert_bitwise(g, ref.narrow(0, dp_rank(rank) * g.shape[0], g.shape[0]), f"{what}: {name}")
        assert ours["weight_numel"] > 0
        _assert_gathered_as_torchao(runs, what)
    if "torchao" not in ranks[0]["fp8_gather"]:
        pytest.skip("torchao is not installed (the test extra pins it): compared with the no-gather run only")


def test_2x2_fp8_transformer_gathers_in_fp8_bitwise_with_no_gather(ranks):
    """The transformer under FSDP2 x TP, fp8 tensorwise: every matmul with a parameter operand in
    fp8 (share 1.0 >= the 0.95 asked), no AmpFxWarning (before: "FSDP2 all-gathers ... in fp32
    ... placements ... on a 2-D mesh"), the losses and this rank's parameters after FP8_STEPS SGD
    steps bitwise with the same model on the TP mesh alone (the second step's all-gathers refresh
    the scale of the DTensor FSDP2 keeps: before the fix, set on the DTensor instead of the fp8
    weight inside it, it kept the first step's). Bytes: every block gathered twice per step (forward,
    and again for the backward after FSDP2's reshard), each Linear weight element as 1 byte."""
    for rank, res in enumerate(ranks):
        ours, alone = res["fp8_transformer"]["gathered"], res["fp8_transformer"]["tp"]
        what = f"rank {rank}"
        assert ours["amp_fx_warnings"] == [] and alone["amp_fx_warnings"] == [], what
        assert ours["converted"] == ours["considered"] == alone["converted"] == 12, what
        assert_bitwise(ours["losses"], alone["losses"], f"{what}: losses")
        for name, p in ours["params"].items():
            ref = alone["params"][name]
            if ref.shape != p.shape:  # FSDP2's dp shard of the TP shard
                ref = ref.narrow(0, dp_rank(rank) * p.shape[0], p.shape[0])
            assert_bitwise(p, ref, f"{what}: {name}")
        assert ours["all_gather"] == _fp8_gather_bytes(ours, 2 * FP8_STEPS), f"{what}: {ours['all_gather']}"


def test_hsdp_2x2_fp8_all_gather_bitwise_with_torchao_and_without_fsdp(ranks):
    """HSDP (replicate 2 x shard 2, ``fully_shard`` on the 2-D mesh), fp8 tensorwise, the bias-free
    ``_MLP`` (no TP) fed the same bf16-exact input on every rank: no AmpFxWarning (``strict=True``);
    the output and this rank's gradient shards bitwise with amp_fx's fp8 on the model without FSDP2
    (narrowed to this rank's shard: FSDP2's average of equal gradients over both dimensions is
    exact), and with torchao's ``enable_fsdp_float8_all_gather`` on the same mesh. Bytes
    all-gathered over the shard dimension: 1 per Linear weight element, as torchao's; the bf16 run 4.
    (torchao's all-fp8 gather buffer runs on gloo through the counting backend, which gathers fp8
    as bytes: gloo has no fp8 type.)"""
    for rank, res in enumerate(ranks):
        runs = res["fp8_hsdp"]
        ours, alone, bf16 = runs["amp_fx"], runs["plain"], runs["bf16"]
        what = f"rank {rank}"
        assert ours["amp_fx_warnings"] == bf16["amp_fx_warnings"] == alone["amp_fx_warnings"] == [], what
        assert_bitwise(ours["out"], alone["out"], f"{what}: output")
        assert set(ours["grads"]) == {"w1.weight", "w2.weight"}, what
        for name, g in ours["grads"].items():
            ref = alone["grads"][name]
            assert_bitwise(g, ref.narrow(0, hsdp_shard_rank(rank) * g.shape[0], g.shape[0]), f"{what}: {name}")
        assert ours["weight_numel"] == ours["numel"] > 0, what
        _assert_gathered_as_torchao(runs, what)
    if "torchao" not in ranks[0]["fp8_hsdp"]:
        pytest.skip("torchao is not installed (the test extra pins it): compared with the no-FSDP2 run only")
