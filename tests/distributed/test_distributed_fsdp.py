"""amp_fx under FSDP2 (``fully_shard`` per Linear and on the root): 2 gloo ranks, bitwise with eager.

Reference: the eager sharded model + ``torch.autocast`` + FSDP's ``ShardedGradScaler``. amp_fx:
``amp_fx.compile(sharded_model, backend="aot_eager")`` + ``amp_fx.GradScaler``. 8 steps, with
overflows in one rank's batch (``INF_BATCH``) and an inf written into one element of rank 0's
*local shard* of a weight gradient (``INF_GRAD``), which no other rank holds: every rank must
skip that step, as with ShardedGradScaler. The negative twin runs amp_fx with the cross-rank
combination switched off and shows the ranks diverge. Also: FSDP2's MixedPrecisionPolicy,
accumulation without gradient sync plus global-norm clipping, resume from a distributed
checkpoint, and ``amp_fx.compile_step`` on the sharded model (bitwise with the same eager
recipe, sync-free, one collective for the flag); explain and compare on the sharded model, which
they leave as it was. All cases run in one spawn.
"""

from __future__ import annotations

import pytest
import torch

from amp_fx.testing import assert_bitwise
from amp_fx.testing.distributed import run_ranks
from tests.distributed._dist_asserts import assert_same_run, assert_same_state, skipped_steps
from tests.distributed._dist_cases import DTYPES, INF_BATCH, INF_GRAD, RECIPES, STEPS, fsdp_all
from tests.step._step_cases import ADAM_TRACED_RTOL

# slow: one spawn of 2 gloo ranks runs every case of this file (tests/distributed/test_distributed_ddp.py is
# the distributed file of the inner loop)
pytestmark = [
    pytest.mark.skipif(
        not (torch.distributed.is_available() and torch.distributed.is_gloo_available()),
        reason="needs torch.distributed with gloo",
    ),
    pytest.mark.slow,
]

KINDS = ["seq", "custom"]
PLANTED = sorted({step for step, _ in INF_BATCH} | {step for step, _ in INF_GRAD})


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    return run_ranks(fsdp_all, str(tmp_path_factory.mktemp("dcp") / "checkpoint"))


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("kind", KINDS)
def test_fsdp2_bitwise_with_eager_fsdp2_autocast_and_sharded_scaler(ranks, dtype, kind):
    for rank, res in enumerate(ranks):
        assert_same_run(res[(dtype, kind, "amp_fx")], res[(dtype, "seq", "eager")], f"rank {rank}, {dtype}, {kind}")


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
    unscale_ + clip_grad_norm_(0.5) over the DTensor gradients (the global norm across shards);
    bitwise with eager FSDP2 + ShardedGradScaler, norms included."""
    for rank, res in enumerate(ranks):
        got, want = res[("fp16", "seq", "amp_fx", "accum_clip")], res[("fp16", "seq", "eager", "accum_clip")]
        assert_same_run(got, want, f"rank {rank}")
        assert skipped_steps(got) == PLANTED
        assert got["scaler_collectives"] == STEPS  # unscale_ once per step, its one all-reduce


def _check_step_run(ranks: list[dict], dtype: str, recipe: str) -> None:
    """Every rank skips the planted steps with the same scales; sync-free, no new graph, captured."""
    for rank, res in enumerate(ranks):
        got = res[(dtype, "seq", "step", recipe)]
        assert skipped_steps(got) == PLANTED, f"rank {rank}"
        assert_bitwise(got["scales"], ranks[0][(dtype, "seq", "step", recipe)]["scales"], f"rank {rank} scales")
        assert got["host_reads"] == 0
        assert got["graphs_after_warm_up"] == 0
        assert got["linears"] == 2


def _check_overflow_reports(ranks: list[dict], key: tuple, reference: tuple, *, watched: bool) -> None:
    """overflow_report() after each optimizer step, on every rank, against the eager reference run
    (``reference``: FSDP2 + torch.autocast + ShardedGradScaler, the same recipe): None where no full
    (gathered) gradient held an inf/NaN, else that step's index and exactly those parameters'
    names. INF_GRAD's step is the case that needs the flags combined: the inf sits in rank 0's
    shard of ``0.weight`` only, so rank 1 names it only through the all-reduce. ``watched``: the
    forward record names the first Linear ("0", whose input cast meets the planted element) and
    the rank whose batch was planted (INF_BATCH), on every rank; None where only a gradient was."""
    grad_only = {step for step, _ in INF_GRAD} - {step for step, _ in INF_BATCH}
    batch_rank = {step: rank for step, rank in INF_BATCH}
    for rank, res in enumerate(ranks):
        want = res[reference]["nonfinite"]
        reports = res[key]["overflow_reports"]
        assert [i for i, names in enumerate(want) if names] == PLANTED, f"rank {rank}: reference {want}"
        for i, (report, names) in enumerate(zip(reports, want, strict=True)):
            if not names:
                assert report is None, f"rank {rank} step {i}: {report}"
                continue
            assert report is not None and report["step"] == i, f"rank {rank} step {i}: {report}"
            assert report["gradients"] == names, f"rank {rank} step {i}"
            if not watched:
                assert report["first_op"] is None
            elif i in grad_only:
                assert report["first_op"] is None, f"rank {rank} step {i}: {report}"
            else:
                assert report["first_op"] is not None, f"rank {rank} step {i}: {report}"
                assert report["first_op"][0] == "0" and report["first_op"][2] == batch_rank[i], (rank, i, report)
        assert reports == ranks[0][key]["overflow_reports"], f"rank {rank}: reports differ from rank 0's"
    assert any(names == ["0.weight"] for names in ranks[0][reference]["nonfinite"])  # INF_GRAD's step alone


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_fsdp2_grad_scaler_overflow_report_names_gradients_across_shards(ranks, dtype):
    """amp_fx.compile + amp_fx.GradScaler on FSDP2: the per-gradient flags of each rank's shards
    are combined in the found-inf all-reduce (ShardedGrads.combine_found_inf_), names under the
    root module, identical on every rank (not watched: first_op None)."""
    _check_overflow_reports(ranks, (dtype, "seq", "amp_fx"), (dtype, "seq", "eager"), watched=False)


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_fsdp2_grad_scaler_watched_names_first_op_in_the_one_found_inf_collective(ranks, dtype):
    """amp_fx.compile(watch_nonfinite=True) + amp_fx.GradScaler on FSDP2: the forward record is
    folded into the found-inf all-reduce of unscale_ (ShardedGrads.combine_found_inf_), so the
    scaler still makes one collective per step, and the report names the first op and the rank."""
    _check_overflow_reports(ranks, (dtype, "seq", "amp_fx", "watched"), (dtype, "seq", "eager"), watched=True)
    for res in ranks:
        assert res[(dtype, "seq", "amp_fx", "watched")]["scaler_collectives"] == STEPS


@pytest.mark.parametrize(
    ("dtype", "recipe"), [("bf16", "plain"), ("fp16", "plain"), ("fp16", "accum_clip"), ("fp16", "adamw_fused")]
)
def test_compile_step_on_fsdp2_overflow_report_names_gradients_and_first_op(ranks, dtype, recipe):
    """compile_step on FSDP2, watch_nonfinite=True: the gradients' flags and the forward record are
    folded into the found-inf all-reduce of the compiled finish (the collective count below stays
    one per step: ``test_compile_step_on_fsdp2_combines_flag_and_norm_in_one_collective_each``;
    no host read: ``_check_step_run``), and overflow_report() raises no AmpFxWarning."""
    reference = (dtype, "seq", "eager") if recipe == "plain" else (dtype, "seq", "eager", recipe)
    _check_overflow_reports(ranks, (dtype, "seq", "step", recipe), reference, watched=True)


@pytest.mark.parametrize(
    ("dtype", "recipe"), [("bf16", "plain"), ("fp16", "plain"), ("fp16", "accum_clip"), ("fp16", "adamw_fused")]
)
def test_compile_step_on_fsdp2_bitwise_sync_free_and_no_recompiles(ranks, dtype, recipe):
    """amp_fx.compile_step(fully_shard model) (SGD with momentum, or AdamW(fused=True) whose
    kernel runs on the local shards; StepMode.MASKED, GradNorm.TORCH, aot_eager) against eager
    FSDP2 + autocast + ShardedGradScaler with the same recipe: overflows in one rank's batch,
    the inf in rank 0's gradient shard only (every rank skips that step, the scales stay equal),
    with accumulation the first micro-batch of each window under set_requires_gradient_sync(False)
    and clipping to the global norm across shards (the norm DTensor's clip_grad_norm_ computes,
    bit for bit). After the warm-up: no host read, no new graph."""
    for rank, res in enumerate(ranks):
        want = res[(dtype, "seq", "eager")] if recipe == "plain" else res[(dtype, "seq", "eager", recipe)]
        if "norms" in want:  # clipping engaged on some step, so the global norm's bits matter
            assert (want["norms"][want["norms"].isfinite()] > RECIPES[recipe]["clip"]).any()
        assert_same_run(
            res[(dtype, "seq", "step", recipe)],
            want,
            f"rank {rank}, {dtype}, {recipe}",
            keys=("losses", "scales", "params"),
        )
    _check_step_run(ranks, dtype, recipe)


def test_compile_step_on_fsdp2_adamw_within_the_traced_adam_bound(ranks):
    """AdamW (state exp_avg, exp_avg_sq and a step tensor, stepped on the local shards): the scale
    history is bitwise the eager recipe's and the shards lie within the bound for traced
    non-fused Adam (bias corrections in fp32 instead of Python floats, as on one device)."""
    for rank, res in enumerate(ranks):
        got, want = res[("fp16", "seq", "step", "adamw")], res[("fp16", "seq", "eager", "adamw")]
        assert_bitwise(got["scales"], want["scales"], f"rank {rank} scales")
        for i, (a, e, moved) in enumerate(zip(got["params"], want["params"], want["moved"], strict=True)):
            bound = ADAM_TRACED_RTOL * moved + 2**-24 * e.abs()
            excess = ((a - e).abs() - bound).max()
            assert ((a - e).abs() <= bound).all(), f"rank {rank} params[{i}]: max excess {excess}"
    _check_step_run(ranks, "fp16", "adamw")


@pytest.mark.parametrize(("recipe", "own"), [("plain", 1), ("accum_clip", 2)])
def test_compile_step_on_fsdp2_combines_flag_and_norm_in_one_collective_each(ranks, recipe, own):
    """Per optimizer step, beyond FSDP2's own gradient reductions: one all-reduce for the found-inf
    flag, plus one for the global norm when clipping (gloo counts, profiler events)."""
    for res in ranks:
        baseline = res["fsdp_all_reduces"][recipe]
        assert baseline > 0
        assert res[("fp16", "seq", "step", recipe)]["all_reduces"] == [baseline + own] * (STEPS - 2)


def test_compile_step_on_fsdp2_refuses_an_optimizer_that_is_not_elementwise(ranks):
    for res in ranks:
        errors = res["compile_step_errors"]
        assert "LBFGS" in errors["lbfgs"] and "elementwise" in errors["lbfgs"]


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


@pytest.mark.parametrize("case", ["same", "root_without_reduce_dtype"])
def test_precision_report_fsdp2_dtypes_are_what_fsdp2_sends(ranks, case):
    """MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32) on a block's fully_shard; on the
    root's the same policy, or one without reduce_dtype (the planted downgrade: the root's gradients
    are reduce-scattered in bf16). The report's all-gather and reduce-scatter dtypes are those FSDP2
    handed to its collectives in one forward and backward; the downgrade warns (strict: raises)
    naming the root's fully_shard and the fix, and its twin says nothing."""
    for res in ranks:
        got = res["precision_report"][case]
        assert set(got["gather"]) == set(got["gather_sent"]) == {torch.bfloat16}
        assert set(got["reduce"]) == set(got["reduce_sent"])
        assert got["compute"] == torch.bfloat16  # FSDP2's param_dtype: mixed precision asked
        if case == "same":
            assert got["reduce_sent"] == [torch.float32]
            assert got["warnings"] == [] and got["strict"] == ""
        else:
            assert set(got["reduce_sent"]) == {torch.bfloat16, torch.float32}
            assert len(got["warnings"]) == 1
            for message in (got["warnings"][0], got["strict"]):
                assert "fully_shard(<root>) reduces in bfloat16" in message
                assert "to every fully_shard call, the root's included" in message


def test_fsdp2_root_frame_skipped_by_dynamo_is_reported_with_the_fix(ranks):
    """A root that loops over its sharded blocks: the graph break at each block's call makes Dynamo
    skip the root's frame, so its own modules (inp, norm) run as eager autocast, outside the
    Policy. amp_fx warns once over two calls, naming them and both fixes (strict: raises); the
    output is eager FSDP2 + autocast's, bit for bit; a keep_fp32 entry naming norm is pointed at
    that report. Where a named module shares its weight with another (``TiedRoot``, GPT-2's tied
    embedding), the report names the one ``fully_shard([a, b])`` call FSDP2 takes, and that works.
    The fixes are not reported, and the first
    (the loop in a method: the root's frame is captured) reaches the Policy (keep_fp32 on norm: an
    fp32 output)."""
    for rank, res in enumerate(ranks):
        got = res["root_frame"]
        assert len(got["loop_warnings"]) == 1, got["loop_warnings"]
        for message in (got["loop_warnings"][0], got["loop_strict"]):
            assert "amp_fx.compile(LoopRoot) under FSDP2" in message
            assert "ran no op of inp, norm," in message
            assert "eager autocast" in message and "Policy" in message
            assert "def run_blocks(self, x)" in message and "fully_shard those modules too" in message
        assert_bitwise(got["loop_out"], got["eager_out"], f"rank {rank} LoopRoot output")
        # keep_fp32 naming a module of the skipped frame: pointed at that report, not told to name
        # a module that runs ops (the entry is right; the frame is the problem)
        root_report, keep = got["loop_keep_warnings"]
        assert "ran no op of inp, norm," in root_report
        assert "entry 'norm' selects norm, which ran outside every captured graph" in keep, keep
        assert "Name a module that runs ops" not in keep
        assert got["method_strict"] == "" and got["method_kept_dtype"] == torch.float32
        assert got["own_units_strict"] == ""
        assert "ran no op of body.inp," in got["tied_strict"]
        assert (
            "body.inp shares a parameter with head (tied weights), and FSDP2 takes tied parameters in one "
            "unit: fully_shard([model.body.inp, model.head])"
        ) in got["tied_strict"], got["tied_strict"]
        assert got["tied_fixed_strict"] == ""


def test_fsdp1_is_reported_with_fsdp2_named_as_the_alternative(ranks):
    """FullyShardedDataParallel (FSDP1): amp_fx.compile(FSDP1(m)) warns at once (and
    strict mode raises), then runs as eager FSDP1 + autocast (bitwise that reference);
    FSDP1(amp_fx.compile(m)) warns at its first call, which captured nothing; compile_step refuses.
    Each message names fully_shard (FSDP2)."""
    for res in ranks:
        report = res["fsdp1"]
        assert any("FullyShardedDataParallel (FSDP1)" in w and "fully_shard" in w for w in report["outer_at_compile"])
        assert_bitwise(report["outer_out"], report["eager_out"], "amp_fx.compile(FSDP1(m)) output")
        assert "FSDP1" in report["strict"] and "fully_shard" in report["strict"]
        assert any("FSDP1" in w and "fully_shard" in w for w in report["inner_at_call"])
        assert "FSDP1" in report["step"] and "fully_shard" in report["step"]


@pytest.mark.parametrize("tool", ["explain", "compare", "refused", "find_nonfinite"])
def test_inspection_tools_leave_the_fsdp2_model_as_it_was(ranks, tool):
    """explain, compare, and advise and compare(fp8=...) refusing (after compare's eager check ran a
    forward), each on the FSDP2 model lent to it: every registered parameter the same object (FSDP2's
    sharded DTensor, or its unsharded tensor where the root was unsharded) with the same local
    values, each gradient the same object with the same values, the BatchNorm's buffers, and each
    group's sharding state (explain: all SHARDED before, its forward leaves the root UNSHARDED;
    compare: the root UNSHARDED before, its backward reshards it), all bitwise."""
    for rank, res in enumerate(ranks):
        before, after = res["inspection"]["states"][tool]
        assert_same_state(after, before, f"rank {rank}, {tool}")


def test_find_nonfinite_on_fsdp2_finds_what_it_finds_on_the_unsharded_model(ranks):
    """find_nonfinite (fp16, an input that overflows ``a``'s output) on the FSDP2 model lent to it:
    the same first op, module and suggested policy as on the unsharded model with the same weights
    (before: a TypeError, FSDP2 refusing the deep copy); the model left as it was (above)."""
    for rank, res in enumerate(ranks):
        sharded, whole = res["inspection"]["nonfinite"]
        assert whole[0] and whole[1] == "a", f"rank {rank}: {whole}"
        assert sharded == whole, f"rank {rank}: {sharded} != {whole}"


def test_the_state_check_sees_what_one_eager_step_changes(ranks):
    """The negative twin: one more eager forward and backward, what the tools' runs do to the model
    without the loan, changes its state (gradients accumulated, running stats updated)."""
    for res in ranks:
        before, after = res["inspection"]["states"]["eager step"]
        with pytest.raises(AssertionError):
            assert_same_state(after, before, "eager step")


def test_compare_on_fsdp2_agrees_op_by_op_with_eager_autocast(ranks):
    """compare (bf16, aot_eager: bitwise) on the FSDP2 model: every op of amp_fx's graphs has eager
    autocast's dtype and value bit for bit, as do the output and every parameter's gradient (the
    rank's shard, reduce-scattered by FSDP2 on both sides); the float64 end-to-end columns are
    missing, with a note saying why (no float64 copy of an FSDP2 model)."""
    for rank, res in enumerate(ranks):
        got = res["inspection"]
        assert got["compare_ok"] and got["compare_exact"], f"rank {rank}: {got['compare_ops']}"
        assert sum(row[0] == "aten.linear" for row in got["compare_ops"]) == 2, f"rank {rank}"
        assert all(row[-1] for row in got["compare_ops"]), f"rank {rank}"
        names = [name for name, _ in got["compare_values"]]
        assert names == ["output", "a.weight", "a.bias", "bn.weight", "bn.bias", "b.weight", "b.bias"]
        assert all(agree for _, agree in got["compare_values"]), f"rank {rank}"
        assert any("fully_shard" in n for n in got["compare_notes"]), got["compare_notes"]


def test_explain_on_fsdp2_decides_as_on_the_unsharded_model(ranks):
    """explain (bf16) on the FSDP2 model against the unsharded model with the same weights: the rows
    (kind, op, module, dtype, the rule that decided it, cast) of every op and cast are the same, in
    order (FSDP2's units are graphs of their own: the graph inputs differ, the decisions do not)."""
    for rank, res in enumerate(ranks):
        got = res["inspection"]

        def decisions(rows):
            return [row for row in rows if row[0] in ("op", "cast")]

        assert decisions(got["explain_rows"]) == decisions(got["whole_explain_rows"]), f"rank {rank}"
        assert len(decisions(got["explain_rows"])) > 4


def test_advise_and_fp8_compare_refuse_fsdp2_naming_what_to_do(ranks):
    """advise needs copies of the model (a float64 reference, patched forwards, optimizer steps);
    compare(fp8=...) would leave amp_fx's fp8 all-gather on the sharded parameters: both refuse with
    a TypeError that says to run on the model before fully_shard."""
    for res in ranks:
        refused = res["inspection"]["refused"]
        assert refused.keys() == {"advise", "compare_fp8"}, refused
        assert all("before fully_shard" in message for message in refused.values()), refused
