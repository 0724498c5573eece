"""amp_fx on tensor-parallel, FSDP2 x TP, HSDP and pipeline models: 2 gloo ranks, bitwise with eager autocast.

The model and the recipe: ``tests/distributed/_dist_tp_cases.py``. Reference: eager ``torch.autocast`` on the same
sharded model (fp16: FSDP's ``ShardedGradScaler``, whose found-inf flag is all-reduced over every rank).
amp_fx: ``amp_fx.compile(model, backend="aot_eager")`` with ``amp_fx.GradScaler``, and
``amp_fx.compile_step``. Before the fix in ``amp_fx/passes/capture.py`` (DTensor's ``from_local``,
``to_local`` and ``redistribute`` recorded whole) every graph of these models fell back to
``torch.compile`` + autocast with the warning "capture failed ... Unable to cast NotImplemented to
Tensor": ``test_no_fallback_on_tensor_parallel_models`` fails there. All cases run in one spawn.
"""

from __future__ import annotations

import pytest
import torch

from amp_fx.testing import assert_bitwise
from amp_fx.testing.distributed import run_ranks
from tests.distributed._dist_asserts import assert_same_state
from tests.distributed._dist_tp_cases import CASES, PLANTED_STEP, assert_within_traced_adam, fused_norm_bound, tp_all

pytestmark = [
    pytest.mark.skipif(
        not (torch.distributed.is_available() and torch.distributed.is_gloo_available()),
        reason="needs torch.distributed with gloo",
    ),
    pytest.mark.slow,
]

AMP_CASES = [c for c in CASES if c[2] != "eager"]


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return run_ranks(tp_all)


def _name(case: tuple) -> str:
    return " ".join(case)


@pytest.mark.parametrize("case", AMP_CASES, ids=_name)
def test_no_fallback_on_tensor_parallel_models(ranks, case):
    for rank, res in enumerate(ranks):
        assert res[case]["amp_fx_warnings"] == [], f"rank {rank}, {_name(case)}"


@pytest.mark.parametrize("case", [c for c in AMP_CASES if c[2] == "amp_fx"], ids=_name)
def test_tp_compile_bitwise_with_eager_autocast(ranks, case):
    """Loss, scale and every rank's local parameters after 3 AdamW steps, bit for bit."""
    layout, dtype, _ = case
    for rank, res in enumerate(ranks):
        got, want = res[case], res[(layout, dtype, "eager")]
        what = f"rank {rank}, {_name(case)}"
        assert_bitwise(got["losses"], want["losses"], f"{what}: losses")
        assert_bitwise(got["scales"], want["scales"], f"{what}: scales")
        for name in want["params"]:
            assert_bitwise(got["params"][name], want["params"][name], f"{what}: {name}")


@pytest.mark.parametrize("layout", ["sp", "fsdp_tp", "hsdp"])
def test_tp_fp16_skips_the_planted_step_on_every_rank(ranks, layout):
    """The inf is in rank 0's local shard only; every rank backs off at that step, eager and amp_fx."""
    for case in [(layout, "fp16", form) for form in ("eager", "amp_fx", "step")]:
        for rank, res in enumerate(ranks):
            scales = res[case]["scales"].tolist()
            assert scales[PLANTED_STEP] == scales[PLANTED_STEP - 1] / 2, f"rank {rank}, {_name(case)}: {scales}"
            assert scales[0] == scales[PLANTED_STEP - 1], f"rank {rank}, {_name(case)}: {scales}"


@pytest.mark.parametrize(
    ("layout", "clip"), [("sp", False), ("fsdp_tp", False), ("hsdp", False), ("sp", True), ("fsdp_tp", True)]
)
def test_tp_compile_step_matches_eager_recipe(ranks, layout, clip):
    """compile_step, fp16, on sequence parallelism (Replicate norm parameters whose compiled
    gradients are Partial until reduced), FSDP2 x TP (2-D parameters) and HSDP: losses and scales
    bitwise; the parameters within the traced Adam step's rounding (ADAM_TRACED_RTOL of each
    parameter's movement, as on FSDP2), where an unreduced Partial gradient was 5e3 times that
    (0.006-0.016 on the norms). With ``max_grad_norm`` against ``unscale_`` + ``clip_grad_norm_``
    (FSDP2 x TP: each gradient's norm taken whole, since torch's cannot stack norms of two meshes),
    and the clip must have changed the parameters."""
    form, ref = ("step_clip", "eager_clip") if clip else ("step", "eager")
    case = (layout, "fp16", form)
    for rank, res in enumerate(ranks):
        got, want = res[case], res[(layout, "fp16", ref)]
        if clip:
            unclipped = res[(layout, "fp16", "step")]["params"]
            assert any(not torch.equal(unclipped[n], got["params"][n]) for n in unclipped), f"rank {rank}"
        assert_bitwise(got["losses"], want["losses"], f"rank {rank}: losses")
        assert_bitwise(got["scales"], want["scales"], f"rank {rank}: scales")
        assert_within_traced_adam(got["params"], want["params"], f"rank {rank}")


@pytest.mark.parametrize("layout", ["sp", "fsdp_tp", "hsdp"])
def test_tp_compile_step_fused_norm_matches_eager_recipe(ranks, layout):
    """compile_step fp16 with ``max_grad_norm`` and ``GradNorm.FUSED`` (one sum of squares per set of
    mesh dimensions the gradients are sharded on, taken in the unscale pass): losses and scales
    bitwise with the eager recipe (``unscale_`` + ``clip_grad_norm_`` on the DTensors), the
    parameters within the traced Adam bound plus the fused norm's (:func:`fused_norm_bound`), and
    within the fused norm's bound alone of the same step with ``GradNorm.TORCH`` where the spawn
    has it (sp, fsdp_tp: the same traced AdamW, only the norm differs). Before, compile_step
    refused these layouts; counted as FSDP2's one sum over every rank, the replicated gradients
    (sp, fsdp_tp: the norms and row-parallel biases) were counted twice and HSDP's whole norm
    over the replicate dimension: the parameters then differed from the eager recipe's by
    2.0e-4 (sp, fsdp_tp) and 1.7e-3 (hsdp), against bounds of 2.2e-5 (hsdp: 2.4e-5; 2.5e-6 from
    ``GradNorm.TORCH``)."""
    for rank, res in enumerate(ranks):
        got, want = res[(layout, "fp16", "step_fused_clip")], res[(layout, "fp16", "eager_clip")]
        what = f"rank {rank}, {layout}"
        unclipped = res[(layout, "fp16", "step")]["params"]
        assert any(not torch.equal(unclipped[n], got["params"][n]) for n in unclipped), what
        assert_bitwise(got["losses"], want["losses"], f"{what}: losses")
        assert_bitwise(got["scales"], want["scales"], f"{what}: scales")
        norm_bound = fused_norm_bound(want["params"])
        assert_within_traced_adam(got["params"], want["params"], what, extra=norm_bound)
        torch_norm = res.get((layout, "fp16", "step_clip"))
        if torch_norm is None:
            continue
        for name, e in torch_norm["params"].items():
            a = got["params"][name]
            bound = norm_bound + 2**-23 * e.abs()  # the update's own rounding: one ulp of the value
            assert ((a - e).abs() <= bound).all(), f"{what}, {name}: max diff {(a - e).abs().max()} from GradNorm.TORCH"


def test_tp_fp8_converts_every_sharded_linear_and_matches_the_unsharded_run(ranks):
    """fp8 tensorwise on the TP model: every matmul with a (DTensor) parameter operand converted,
    the scales taken over the whole tensor (DTensor reduces the amax across ranks: a column-parallel
    linear alone is bitwise with the unsharded one). The row-parallel linears add two ranks' bf16
    partial outputs where the unsharded GEMM rounds once, and a one-ulp change of a bf16 input can move
    an e4m3 value by one spacing (2^-3 relative) in the next fp8 matmul: the bound on the output is
    2^-4 of its largest magnitude, on the gradients 2^-3 of the model's gradient norm."""
    for rank, res in enumerate(ranks):
        tp, whole = res["fp8_tp"], res["fp8_whole"]
        assert tp["amp_fx_warnings"] == [], f"rank {rank}"
        assert tp["converted"] == tp["considered"] == whole["converted"] == 12, f"rank {rank}"
        out_err = (tp["out"].float() - whole["out"].float()).abs().max()
        assert out_err <= 2**-4 * whole["out"].float().abs().max(), f"rank {rank}: output error {out_err}"
        diffs, norms = [], []
        for name, g in tp["grads"].items():
            ref = whole["grads"][name]
            if g.shape != ref.shape:  # this rank's shard of the unsharded gradient
                dim = 0 if g.shape[0] != ref.shape[0] else 1
                ref = ref.narrow(dim, rank * g.shape[dim], g.shape[dim])
            diffs.append((g - ref).flatten())
            norms.append(ref.flatten())
        err, norm = torch.cat(diffs).norm(), torch.cat(norms).norm()
        assert err <= 2**-3 * norm, f"rank {rank}: gradient error {err} of norm {norm}"


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_pipeline_stages_fp16_skip_together_bitwise_with_eager_by_hand(ranks, schedule):
    """Two stages (torch.distributed.pipelining), fp16: amp_fx.compile per stage and
    amp_fx.GradScaler(process_group=WORLD) against eager autocast + torch.amp.GradScaler with its
    found-inf all-reduced by hand. The inf planted in stage 0's gradient backs off the scale on
    both stages (without the combined flag stage 1 would step and keep its scale); the loss on
    the last stage, the scales and every stage's parameters bitwise."""
    for rank, res in enumerate(ranks):
        got, want = res[("pp", schedule, "fp16", "amp_fx")], res[("pp", schedule, "fp16", "eager")]
        what = f"stage {rank}, {schedule}"
        assert got["amp_fx_warnings"] == [], what
        scales = got["scales"].tolist()
        assert scales[PLANTED_STEP] == scales[PLANTED_STEP - 1] / 2, f"{what}: {scales}"
        assert_bitwise(got["scales"], want["scales"], f"{what}: scales")
        assert_bitwise(got["losses"], want["losses"], f"{what}: losses")
        for name in want["params"]:
            assert_bitwise(got["params"][name], want["params"][name], f"{what}: {name}")


def test_pipeline_stages_bf16_bitwise_with_eager_autocast(ranks):
    """Two stages (torch.distributed.pipelining, GPipe, 2 micro-batches), bf16, 3 AdamW steps:
    amp_fx.compile per stage against eager autocast around the schedule's step. The loss on the
    last stage and every stage's parameters bit for bit, no warning."""
    for rank, res in enumerate(ranks):
        got, want = res[("pp", "gpipe", "bf16", "amp_fx")], res[("pp", "gpipe", "bf16", "eager")]
        what = f"stage {rank}"
        assert got["amp_fx_warnings"] == [], what
        assert_bitwise(got["losses"], want["losses"], f"{what}: losses")
        for name in want["params"]:
            assert_bitwise(got["params"][name], want["params"][name], f"{what}: {name}")


def test_pipeline_stages_fp8_bitwise_with_torchao(ranks):
    """Two stages (GPipe, 2 micro-batches), bf16 with fp8 tensorwise on every Linear of each stage,
    3 AdamW steps: ``amp_fx.compile(stage, fp8="tensorwise")`` against torchao's ``Float8Linear``
    under eager autocast around the schedule's step. The loss on the last stage and every stage's
    parameters bit for bit; the 6 Linears of each stage's block converted (q, k, v, o, the MLP's
    two), no warning."""
    if ("pp", "gpipe", "fp8", "eager") not in ranks[0]:
        pytest.skip("torchao is not installed (the test extra pins it)")
    for rank, res in enumerate(ranks):
        got, want = res[("pp", "gpipe", "fp8", "amp_fx")], res[("pp", "gpipe", "fp8", "eager")]
        what = f"stage {rank}"
        assert got["amp_fx_warnings"] == [], what
        assert got["fp8_converted"] == 6, f"{what}: {got['fp8_converted']}"
        assert_bitwise(got["losses"], want["losses"], f"{what}: losses")
        for name in want["params"]:
            assert_bitwise(got["params"][name], want["params"][name], f"{what}: {name}")


def test_tp_fp8_bitwise_with_torchaos_float8_tensor_parallel(ranks):
    """amp_fx fp8 tensorwise on ColwiseParallel/RowwiseParallel against torchao's
    Float8ColwiseParallel/Float8RowwiseParallel on Float8Linear, same mesh: bias-free linears fed a
    bf16-exact input (where both recipes scale the same values) give the same output and gradients
    bit for bit."""
    if ranks[0]["fp8_torchao"] is None:
        pytest.skip("torchao is not installed (the test extra pins it)")
    for rank, res in enumerate(ranks):
        case = res["fp8_torchao"]["same"]
        (out, grads), (want_out, want_grads) = case["amp_fx"], case["torchao"]
        assert_bitwise(out, want_out, f"rank {rank}: output")
        for name, g in want_grads.items():
            assert_bitwise(grads[name], g, f"rank {rank}: {name}")


def test_tp_fp8_column_parallel_numerics_are_the_unsharded_ones(ranks):
    """With a bias and an fp32 input, torchao's float8 TP styles change torchao's own numerics
    (the hook scales the fp32 input; the bias gradient comes from the fp8 grad_output); amp_fx's
    column-parallel linear stays bitwise with torchao's *unsharded* Float8Linear: output, weight and
    bias gradients, each rank's slice."""
    if ranks[0]["fp8_torchao"] is None:
        pytest.skip("torchao is not installed (the test extra pins it)")
    for rank, res in enumerate(ranks):
        case = res["fp8_torchao"]["bias"]
        (out, grads), (whole_out, whole_grads) = case["amp_fx_w1"], case["torchao_w1"]
        rows = out.shape[-1]
        assert_bitwise(out, whole_out[..., rank * rows : (rank + 1) * rows], f"rank {rank}: output")
        for name, g in grads.items():
            assert_bitwise(g, whole_grads[name].narrow(0, rank * g.shape[0], g.shape[0]), f"rank {rank}: {name}")


def test_fsdp2_x_tp_fp8_converts_every_matmul_and_gathers_in_fp8(ranks):
    """fp8 tensorwise on FSDP2 x TP: every matmul with a parameter operand in fp8 (share 1.0 >= the
    0.95 asked), and FSDP2 gathers the Linear weights in fp8 on the 2-D mesh too: no AmpFxWarning
    (before, one named each weight "placements ... on a 2-D mesh, not Shard(0) on a 1-D mesh" and
    gathered it in fp32). The values and bytes on a dp 2 x tp 2 mesh:
    tests/distributed/test_distributed_tp4.py."""
    for rank, res in enumerate(ranks):
        run = res["fp8_fsdp_tp"]
        assert run["converted"] == run["considered"] == 12, f"rank {rank}"
        assert run["amp_fx_warnings"] == [], f"rank {rank}: {run['amp_fx_warnings']}"


def test_watch_and_compare_on_a_sequence_parallel_model(ranks):
    """The non-finite watch names the module eager autocast's forward hooks see overflow first
    (blocks.1.mlp.w1, its fp16 output past 65504) on every rank; before, its flags (DTensors beside
    plain tensors) made the step raise "got mixed torch.Tensor and DTensor". compare runs op by op
    (before: "aten.nonzero" has no sharding rule) and agrees with eager autocast, bf16."""
    for rank, res in enumerate(ranks):
        run = res["inspect_sp"]
        assert run["eager_first"] == "blocks.1.mlp.w1", f"rank {rank}: {run}"
        assert run["watch_first"] == run["eager_first"], f"rank {rank}: {run}"
        assert run["compare_ok"] and run["compared_ops"] > 0, f"rank {rank}: {run}"


def test_watch_on_fsdp2_x_tp_names_eager_autocasts_first_overflow(ranks):
    """FSDP2 x TP (dp 1 x tp 2: FSDP2's units gather 2-D DTensor parameters each forward): the
    non-finite watch names the module eager autocast's forward hooks see overflow first
    (blocks.1.mlp.w1, its fp16 output past 65504) on every rank, as on sequence parallelism."""
    for rank, res in enumerate(ranks):
        run = res["inspect_fsdp_tp"]
        assert run["eager_first"] == "blocks.1.mlp.w1", f"rank {rank}: {run}"
        assert run["watch_first"] == run["eager_first"], f"rank {rank}: {run}"


@pytest.mark.parametrize("case", ["inspect_fsdp_tp", "compare_hsdp"])
def test_compare_on_fsdp2_x_tp_and_hsdp_agrees_with_eager_and_leaves_the_model_as_it_was(ranks, case):
    """compare (bf16, aot_eager: bitwise) on FSDP2 x TP (dp 1 x tp 2) and HSDP (replicate 2 x shard
    1), lent to compare (FSDP2 refuses deep copies; before, compare raised TypeError): every op, the
    output and all 32 gradients (the rank's local shards) bitwise with eager autocast on the sharded
    model. The model's parameters (objects, local values), gradients (objects, values), buffers and
    each FSDP2 group's sharding state are bitwise what they were before
    (tests/distributed/test_distributed_fsdp.py has the negative twin of this check)."""
    for rank, res in enumerate(ranks):
        run = res[case]
        assert run["compare_ok"] and run["compare_exact"], f"rank {rank}: {run}"
        assert run["compared_ops"] > 0 and run["compared_grads"] == 32, f"rank {rank}: {run}"
        before, after = run["states"]
        assert_same_state(after, before, f"rank {rank}, {case}")


def test_explain_on_a_sequence_parallel_model_decides_as_on_the_unsharded_one(ranks):
    """explain (fp16) on the sequence-parallel model against the unsharded model with the same
    weights: one graph each, and the rows (kind, op, module, dtype, the rule that decided it, cast)
    of the ops and casts are the same, in order, on every rank, where the op is one the unsharded
    graph runs (the sharded graph adds DTensor's own: from_local, to_local, detach; its inputs
    differ by the hooks' state). Its cast bytes are this rank's, counted
    from the rank's own shards (each Linear's parameters, the gathered activations whole); on the
    unsharded model the same count is the whole model's. Before, a DTensor cast counted its global
    size: 175,488 B on each rank where a rank casts 100,416."""
    for rank, res in enumerate(ranks):
        sp, whole = res["explain_advise_sp"]["sp"], res["explain_advise_sp"]["whole"]
        assert sp["graphs"] == whole["graphs"] == 1, f"rank {rank}"
        ops = {row[1] for row in whole["rows"] if row[0] in ("op", "cast")}
        want = [row for row in whole["rows"] if row[0] in ("op", "cast")]
        assert [row for row in sp["rows"] if row[0] in ("op", "cast") and row[1] in ops] == want, f"rank {rank}"
        counts = {k: (sp[k], whole[k]) for k in ("cast_bytes", "expected_cast_bytes")}
        assert sp["cast_bytes"] == sp["expected_cast_bytes"] < whole["cast_bytes"], f"rank {rank}: {counts}"
        assert whole["cast_bytes"] == whole["expected_cast_bytes"], f"rank {rank}: {counts}"


def test_advise_on_a_sequence_parallel_model_gives_the_unsharded_models_advice(ranks):
    """advise (fp16, gradients measured) on the sequence-parallel model against the unsharded model
    with the same weights: the same policy (nothing kept in fp32), verified, no module flagged on
    either; the end-to-end error each rank measures on its shards within 25% of the unsharded
    model's (measured 2%: the row-parallel linears round two partial sums where the unsharded one
    rounds once; a shard compared with the whole, or a misread DTensor, is an error of order 1).
    Its cost is this rank's: the cast bytes as explain counts them on this rank, and exactly half
    the unsharded model's matmul and attention FLOPs (every matmul is split over the 2 ranks; the
    heads of the attention too). Before, a DTensor counted its global size: 175,488 B, and 802,816
    FLOPs where the rank runs 409,600."""
    for rank, res in enumerate(ranks):
        sp, whole = res["explain_advise_sp"]["sp"], res["explain_advise_sp"]["whole"]
        assert sp["keep_fp32"] == whole["keep_fp32"] == (), f"rank {rank}"
        assert sp["verified"] and whole["verified"], f"rank {rank}"
        assert sp["findings"].keys() == whole["findings"].keys(), f"rank {rank}"
        assert not any(sp["findings"].values()) and not any(whole["findings"].values()), f"rank {rank}"
        assert abs(sp["error"] - whole["error"]) <= 0.25 * whole["error"], f"rank {rank}: {sp['error']}"
        assert sp["cost"].cast_bytes == sp["cost"].default_cast_bytes == sp["cast_bytes"], f"rank {rank}"
        assert whole["cost"].cast_bytes == whole["cast_bytes"], f"rank {rank}"
        assert sp["cost"].matmul_flops * 2 == whole["cost"].matmul_flops, f"rank {rank}: {sp['cost']}"


def test_tp_inductor_within_torch_compile_autocasts_error(ranks):
    """Inductor (bf16, TP): amp_fx's loss and gradients differ from eager autocast by no more than
    torch.compile + autocast's do (inductor keeps fused intermediates in fp32, so neither is bitwise;
    the slack is one fp32 ulp of the largest gradient difference, 2^-24 relative), no fallback."""
    for rank, res in enumerate(ranks):
        run = res["inductor"]
        assert run["amp_fx_warnings"] == [], f"rank {rank}"
        ours, theirs = run["amp_fx"], run["torch.compile"]
        assert ours["loss"] <= theirs["loss"] * (1 + 2**-24), f"rank {rank}: {run}"
        assert ours["grads"] <= theirs["grads"] * (1 + 2**-24), f"rank {rank}: {run}"


def test_tp_rowwise_fp8_keeps_row_parallel_matmuls_in_bf16_and_says_so(ranks):
    """A rowwise recipe on a row-parallel linear (its input ``Shard(-1)``: the contraction dimension
    sharded) has no DTensor sharding rule for its rowwise-scaled ``_scaled_mm``: DTensor gathered
    the fp8 operands, which over gloo (no float8) raised "Invalid scalar type" at the first call.
    amp_fx keeps those matmuls in bf16 (wo and w2 of each block) and says so once, naming them;
    the column-parallel ones run in fp8."""
    if ranks[0]["fp8_tp_rowwise"] is None:
        pytest.skip("this torch's CPU _scaled_mm takes no rowwise scales")
    for rank, res in enumerate(ranks):
        got = res["fp8_tp_rowwise"]
        row_parallel = sorted(f"blocks.{b}.{m}" for b in range(2) for m in ("attn.wo", "mlp.w2"))
        assert got["kept"] == row_parallel, f"rank {rank}: {got['kept']}"
        assert got["converted"] == got["considered"] - len(row_parallel) > 0, f"rank {rank}: {got}"
        said = [w for w in got["amp_fx_warnings"] if "contraction dimension is sharded" in w]
        assert len(said) == 1 and all(m in said[0] for m in row_parallel[:2]), f"rank {rank}: {got['amp_fx_warnings']}"
        assert torch.isfinite(got["out"]).all()


def test_sequence_parallel_fp8_gathers_e4m3_bitwise_with_the_high_precision_gather(ranks):
    """fp8 tensorwise under sequence parallelism: each norm output feeding column-parallel fp8
    matmuls (q, k, v and w1 of each block: 4 gathers) is cast to e4m3 on each rank's shard, with
    the whole tensor's scale, and gathered as bytes, where eager autocast (and amp_fx before)
    gathers the fp32 norm output and casts after. The values must not change: the output and every
    local gradient bitwise with the same pass gathering in high precision (the norm weights'
    gradients read the input gradient, which the fp8 gather's backward reduce-scatters in fp32 as
    the redistribute's did). Bytes each rank hands to all-gathers: 3 fewer per gathered element
    (4 gathers of a (BATCH, SEQ / 2, D) shard), the rest (the last block's output, gathered whole
    in fp32) unchanged, and the high-precision run gathers what the bf16 run gathers. No report
    (before: "all-gathered before its fp8 cast"), strict."""
    from tests.distributed._dist_tp_cases import BATCH, SEQ, D

    for rank, res in enumerate(ranks):
        runs = res["fp8_sp"]
        fp8, hp, bf16 = runs["fp8"], runs["fp8_gather_hp"], runs["bf16"]
        what = f"rank {rank}"
        assert fp8["amp_fx_warnings"] == [] and fp8["fp8_gathers"] == 4, f"{what}: {fp8['amp_fx_warnings']}"
        assert hp["fp8_gathers"] == 0, what
        assert_bitwise(fp8["out"], hp["out"], f"{what}: output")
        for name, g in hp["grads"].items():
            assert_bitwise(fp8["grads"][name], g, f"{what}: {name}")
        shard = BATCH * (SEQ // 2) * D
        assert hp["all_gather"] == bf16["all_gather"], f"{what}: {hp['all_gather']} != {bf16['all_gather']}"
        assert fp8["all_gather"] == hp["all_gather"] - 4 * 3 * shard, f"{what}: {fp8['all_gather']}, {hp['all_gather']}"


def test_sequence_parallel_fp8_keeps_a_gather_other_ops_read_and_says_so(ranks):
    """With ``blocks.0.attn.v`` kept out of fp8, its bf16 matmul reads block 0's gathered norm
    output beside q and k: that gather stays in fp32 (v needs the high-precision values) and
    amp_fx says so once, naming q and k and why; the other 3 gathers move to fp8."""
    for rank, res in enumerate(ranks):
        run = res["fp8_sp"]["fp8_keep_v"]
        said = [w for w in run["amp_fx_warnings"] if "all-gathered before its fp8 cast" in w]
        assert len(said) == 1 and run["fp8_gathers"] == 3, f"rank {rank}: {run['amp_fx_warnings']}"
        assert "the input of 2 fp8 matmul(s)" in said[0] and "blocks.0.attn.k ((Shard(dim=1),)" in said[0], said[0]
        assert "another op reads the gathered input" in said[0], said[0]
