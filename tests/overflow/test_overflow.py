"""Overflow provenance (issue 21): ``overflow_report()`` names the skipped step, the first
non-finite forward op and the non-finite gradients, with no host read in the step.

The model (``_overflow_cases.PlantedNet``) overflows in ``layers.1.mlp.down_proj`` at step
``PLANTED_STEP`` only. References: the step index is where the overflow was planted; the module is
the planted one; the gradient names are those whose scaled gradients hold an inf/NaN in eager
``torch.autocast`` + ``torch.amp.GradScaler`` (``eager_nonfinite_gradients``).
"""

from __future__ import annotations

import copy
import re
from typing import Any

import pytest
import torch

import amp_fx
from amp_fx.testing import assert_bitwise
from tests.overflow._overflow_cases import (
    PLANTED_MODULE,
    PLANTED_STEP,
    STEPS,
    batches,
    dist_overflow_run,
    eager_nonfinite_gradients,
    loss_fn,
    make_model,
    make_scaler,
    plant,
    run_scaler,
    run_step,
)
from tests.step._step_cases import assert_steps_are_sync_free

BACKENDS = ["aot_eager", "inductor"]


@pytest.fixture(scope="module")
def reference_gradients() -> list[str]:
    names = eager_nonfinite_gradients()
    all_names = [n for n, _ in make_model().named_parameters()]
    # The test can fail: some gradients are non-finite, and not all of them (aux stays finite).
    assert names and len(names) < len(all_names), names
    return names


def _check_reports(reports: list[Any], reference: list[str], *, watched: bool) -> None:
    for i, report in enumerate(reports):
        if i != PLANTED_STEP:
            assert report is None, f"step {i}: {report}"
            continue
        assert report is not None, "the planted step was not reported"
        assert report.step == PLANTED_STEP
        assert list(report.gradients) == reference
        if watched:
            assert report.first_op is not None and report.first_op.module == PLANTED_MODULE, report
        else:
            assert report.first_op is None
        line = str(report)
        assert line.startswith(f"step {PLANTED_STEP} skipped: ")
        assert f"{len(reference)} gradients non-finite ({reference[0]}, " in line
        if watched:
            assert re.search(rf"first inf at {re.escape(PLANTED_MODULE)} \(aten\.\w+, fp16\)", line), line
        else:  # what the record knows: nothing was watched, and the call that watches (issue 61)
            assert line.startswith(
                f"step {PLANTED_STEP} skipped: the forward was not watched, so whether a layer overflowed is not known"
            ), line
            assert "; to name the layer: amp_fx.compile" in line, line


# Under inductor only the watched case: the unwatched report has nothing of the compiled graph's
# (no op is named; the gradients are the scaler's eager unscale's, or compile_step's finish's
# per-gradient flags, which the watched case reads too), which the aot_eager cases check. An
# unwatched inductor case cost 50 s a test in CI (its own kernels, no watch in them).
WATCH_CASES = pytest.mark.parametrize(
    "backend, watched",
    [("aot_eager", True), ("aot_eager", False), ("inductor", True)],
    ids=["aot_eager-watched", "aot_eager-unwatched", "inductor-watched"],
)


@pytest.mark.slow_cases
@WATCH_CASES
def test_grad_scaler_with_compile_names_step_module_and_gradients(backend, watched, reference_gradients):
    model = make_model()
    compiled = amp_fx.compile(model, dtype="fp16", backend=backend, watch_nonfinite=watched)
    scaler = make_scaler()
    scaler.watch(compiled)
    reports = run_scaler(model, compiled, scaler)
    _check_reports(reports, reference_gradients, watched=watched)
    assert int(scaler.skipped_steps) == 1
    assert int(scaler.last_skipped_step) == PLANTED_STEP


@pytest.mark.slow_cases
@WATCH_CASES
def test_compile_step_names_step_module_and_gradients(backend, watched, reference_gradients):
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    step = amp_fx.compile_step(model, opt, loss_fn, backend=backend, watch_nonfinite=watched, scaler=make_scaler())
    _check_reports(run_step(step, model), reference_gradients, watched=watched)
    # A device tensor without a sync; one skip.
    assert int(step.skipped_steps) == 1 and int(step.last_skipped_step) == PLANTED_STEP


def test_clean_run_reports_none():
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    step = amp_fx.compile_step(model, opt, loss_fn, backend="aot_eager", watch_nonfinite=True, scaler=make_scaler())
    assert run_step(step, model, planted=None) == [None] * STEPS
    assert int(step.last_skipped_step) == -1


def test_report_is_read_once_then_none_until_the_next_skip():
    model = make_model()
    compiled = amp_fx.compile(model, dtype="fp16", backend="aot_eager", watch_nonfinite=True)
    scaler = make_scaler()
    scaler.watch(compiled)
    run_scaler(model, compiled, scaler, steps=PLANTED_STEP + 1)
    # run_scaler read the report after the planted step; nothing new since.
    assert scaler.overflow_report() is None


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_watch_changes_no_value(backend):
    """Parameters bitwise with and without the watch over the same run (the overflow included)."""
    results = []
    for watched in (False, True):
        torch._dynamo.reset()
        model = make_model()
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        step = amp_fx.compile_step(model, opt, loss_fn, backend=backend, watch_nonfinite=watched, scaler=make_scaler())
        run_step(step, model)
        results.append([p.detach().clone() for p in model.parameters()])
    assert_bitwise(results[1], results[0], f"{backend}: parameters with vs without the watch")


def _host_reads_per_step(step: Any, model: Any, first: int, n: int) -> list[int]:
    names = {"aten::_local_scalar_dense", "aten::item", "aten::is_nonzero"}
    counts = []
    for i, (x, y) in enumerate(batches(first + n)[first:], start=first):
        plant(model, i, None)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            step(x, y)
        counts.append(sum(e.count for e in prof.key_averages() if e.key in names))
    return counts


@pytest.mark.slow
def test_no_host_read_added_by_the_watch():
    """compile_step, steady state: profiler counts of host reads per clean step are the same with
    and without the watch (both zero here), and the steps are sync-free by the dispatch counter."""
    per_step = {}
    for watched in (False, True):
        model = make_model()
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        step = amp_fx.compile_step(
            model, opt, loss_fn, backend="aot_eager", watch_nonfinite=watched, scaler=make_scaler()
        )
        run_step(step, model, planted=None, steps=2)  # warm-up and compile
        per_step[watched] = _host_reads_per_step(step, model, first=2, n=3)
        assert_steps_are_sync_free(step, batches(2, seed=7))
    assert per_step[True] == per_step[False], per_step


@pytest.mark.slow
def test_checks_fuse_into_inductor_kernels():
    """With inductor, the watch adds at most two small kernels to the forward (the combined record,
    and one reduction that reads the last Linear's input and output again: inductor does not fuse
    it into the kernels that wrote them), not one per watched op: the per-op checks are fused into
    the kernels that produce the values."""
    from torch._inductor.utils import run_and_get_code

    counts = {}
    for watched in (False, True):
        torch._dynamo.reset()
        compiled = amp_fx.compile(make_model(), dtype="fp16", backend="inductor", watch_nonfinite=watched)
        with torch.no_grad():
            _, codes = run_and_get_code(compiled, batches(1)[0][0])
        counts[watched] = len(re.findall(r"^cpp_fused_\w+ = ", "\n".join(codes), flags=re.M))
        if watched:
            n_ops = len(compiled.amp_fx_records[0].watched.ops)
    assert n_ops > 10
    assert counts[False] > 0 and counts[True] <= counts[False] + 2, counts


@pytest.fixture(scope="module")
def dist_ranks() -> list[dict[str, Any]]:
    """The DDP and FSDP2 cases, one spawn of 2 gloo ranks (``_overflow_cases.dist_overflow_run``)."""
    if not (torch.distributed.is_available() and torch.distributed.is_gloo_available()):
        pytest.skip("needs torch.distributed with gloo")
    from amp_fx.testing.distributed import run_ranks

    return run_ranks(dist_overflow_run)


def _check_dist_report(report: dict[str, Any], reference: list[str], what: Any) -> None:
    """A report of the planted step read on any rank: the step, the reference gradients, the planted
    module as first_op, and rank 0 (the only rank whose forward overflowed) as the rank that saw it."""
    assert report["step"] == PLANTED_STEP, what
    assert report["gradients"] == reference, what
    assert report["first_op"] is not None and report["first_op"][0] == PLANTED_MODULE, (what, report)
    assert report["first_op"][2] == 0, (what, report)
    assert f"fp16) on rank 0; {len(reference)} gradients" in report["str"], (what, report["str"])


@pytest.mark.slow
def test_ddp_overflow_on_one_rank(dist_ranks, reference_gradients):
    """2 gloo ranks, overflow planted on rank 0 only. The gradients are all-reduced, so both ranks
    skip the same step and name the same gradients (names under the root module, no ``module.``);
    the forward records are combined across ranks on the device, so rank 1, whose own forward was
    finite, names the planted module too, and both say it was rank 0's. compile_step, clean steps
    after the warm-up, with and without the watch: no host read either way (dispatch-level
    counter), and the watch adds exactly one gloo all-reduce per step."""
    ranks = [res["ddp"] for res in dist_ranks]
    for kind in ("scaler", "step"):
        for rank, res in enumerate(ranks):
            reports = res[kind]
            assert [i for i, r in enumerate(reports) if r is not None] == [PLANTED_STEP], (kind, rank, reports)
            # DDP averages the gradients: a non-finite one on rank 0 is non-finite on both.
            _check_dist_report(reports[PLANTED_STEP], reference_gradients, (kind, rank))
        assert ranks[1][kind][PLANTED_STEP] == ranks[0][kind][PLANTED_STEP], kind
    for rank, res in enumerate(ranks):
        assert res["step_host_reads", True] == res["step_host_reads", False] == 0, rank
        # the combined forward record costs one all-reduce (one int64) per step, on top of DDP's own.
        # The profiler can miss a gloo event run on gloo's own thread (once in a loaded torch 2.11
        # run: 0 counted for one unwatched step); it never adds one, so compare the most counted
        # over the clean steps.
        unwatched, watched = res["step_all_reduces", False], res["step_all_reduces", True]
        assert max(unwatched) > 0 and max(watched) == max(unwatched) + 1, res


@pytest.mark.slow
def test_fsdp2_grad_scaler_overflow_on_one_rank(dist_ranks, reference_gradients):
    """FSDP2 + ``amp_fx.compile`` + ``amp_fx.GradScaler``, 2 gloo ranks, the overflow planted on rank 0
    only. Each rank flags only its own shards of each gradient; the flags go through the found-inf
    all-reduce (``ShardedGrads.combine_found_inf_``), the forward records through one more at
    ``update()``. Both ranks report the planted step, the same gradients as the reference (eager
    autocast + torch.amp.GradScaler on the full model with rank 0's inputs: FSDP2 averages the
    ranks' gradients, so a gradient with a non-finite element on rank 0 has one after the
    reduce-scatter, and rank 1's are finite), the planted module, seen on rank 0. A clean run
    reports None on both. The root's own head and aux, in the root's frame that Dynamo skips, are
    reported once per run, and nothing else is."""
    for rank, res in enumerate(dist_ranks):
        reports = res["fsdp2"]["planted"]
        assert [i for i, r in enumerate(reports) if r is not None] == [PLANTED_STEP], (rank, reports)
        _check_dist_report(reports[PLANTED_STEP], reference_gradients, rank)
        assert res["fsdp2"]["clean"] == [None] * STEPS, rank
        for caught in res["fsdp2"]["warnings"]:  # the root's head and aux, in its skipped frame, and nothing else
            assert len(caught) == 1 and "ran no op of head, aux, of the root" in caught[0], (rank, caught)
    assert dist_ranks[1]["fsdp2"]["planted"] == dist_ranks[0]["fsdp2"]["planted"]


@pytest.mark.slow
def test_distributed_scaler_without_watch_names_what_watch_names(dist_ranks, reference_gradients):
    """DDP(amp_fx.compile(model)) and FSDP2, 2 gloo ranks, the overflow on rank 0 only, the seeds'
    loop without ``scaler.watch``: every rank finds the model (under DDP, the DDP module its forward
    ran in, whose ranks combine the forward records), so each rank's reports are those of the run
    with ``scaler.watch``: rank 1, whose forward was finite, names rank 0's op too."""
    for rank, res in enumerate(dist_ranks):
        assert res["ddp"]["scaler_unwatched"] == res["ddp"]["scaler"], rank
        assert res["fsdp2"]["planted_unwatched"] == res["fsdp2"]["planted"], rank
        _check_dist_report(res["ddp"]["scaler_unwatched"][PLANTED_STEP], reference_gradients, rank)


def test_a_record_of_a_graph_this_rank_did_not_compile_is_named_unknown():
    """A forward record combined across ranks names an op by graph and position; where this rank
    has no such graph (it compiled other graphs), the report says so instead of failing."""
    from amp_fx.overflow import _GRAPH_STRIDE, ForwardWatch

    first = ForwardWatch().describe(3 * _GRAPH_STRIDE + 7, rank=1)
    assert first is not None and first.module == "<unknown>" and first.rank == 1
    assert "op 7 of graph 3" in first.op


def test_weight_cache_with_the_watch(reference_gradients):
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    step = amp_fx.compile_step(
        model, opt, loss_fn, backend="aot_eager", watch_nonfinite=True, weight_cache=True, scaler=make_scaler()
    )
    _check_reports(run_step(step, model), reference_gradients, watched=True)


# ------------------------------------------------------------------ a scaler told nothing (issue 30)
def _seeds_loop_reports(watch: bool, scaler: Any = None) -> tuple[list[Any], Any]:
    """The seeds' loop (``scaler.scale(loss).backward(); scaler.step(opt); scaler.update()``) around
    ``amp_fx.compile(model, watch_nonfinite=True)``, with or without ``scaler.watch(compiled)``."""
    model = make_model()
    compiled = amp_fx.compile(model, dtype="fp16", backend="aot_eager", watch_nonfinite=True)
    scaler = make_scaler() if scaler is None else scaler
    if watch:
        scaler.watch(compiled)
    return run_scaler(model, compiled, scaler), compiled


def test_scaler_without_watch_names_what_watch_names(reference_gradients):
    """No ``scaler.watch``: the scaler finds the compiled model whose parameters its optimizer
    holds, so the report is the one ``scaler.watch(compiled)`` gives (same step, first op, graph,
    node and gradient names), which names the planted module and the reference gradients. Before,
    it read "forward finite or not watched" and named ``<parameter 0>, ...``."""
    wired, _ = _seeds_loop_reports(watch=True)
    unwired, _ = _seeds_loop_reports(watch=False)
    _check_reports(wired, reference_gradients, watched=True)
    assert unwired == wired


def test_scaler_without_watch_says_when_it_cannot_tell():
    """Two compiled modules with the watch hold the optimizer's parameters (the model compiled twice,
    both alive): the scaler cannot tell whose forward ran, attaches neither, and the report says so
    once (a warning; strict mode: an error), naming the gradients by position. Twin: the same run
    with ``scaler.watch`` names the op and warns nothing."""
    import warnings

    model = make_model()
    twice = [amp_fx.compile(model, dtype="fp16", backend="aot_eager", watch_nonfinite=True) for _ in range(2)]
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for wired in (False, True):
        scaler = amp_fx.GradScaler("cpu", init_scale=2.0**10, step_mode=amp_fx.StepMode.MASKED, strict=False)
        if wired:
            scaler.watch(twice[1])
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            reports = []
            for i, (x, y) in enumerate(batches()):
                plant(model, i)
                scaler.scale(loss_fn(twice[1](x), y)).backward()
                scaler.step(opt)
                scaler.update()
                opt.zero_grad()
                reports.append(scaler.overflow_report())
        said = [str(w.message) for w in caught if issubclass(w.category, amp_fx.AmpFxWarning)]
        report = reports[PLANTED_STEP]
        assert report is not None and report.step == PLANTED_STEP
        if wired:
            assert said == [] and report.first_op is not None and report.first_op.module == PLANTED_MODULE
            continue
        assert report.first_op is None and report.gradients[0].startswith("<parameter "), report
        assert len(said) == 1 and "belong to 2 models compiled with watch_nonfinite=True" in said[0], said
        assert "scaler.watch(model)" in said[0]
    strict = amp_fx.GradScaler("cpu", init_scale=2.0**10, step_mode=amp_fx.StepMode.MASKED, strict=True)
    with pytest.raises(amp_fx.AmpFxError, match="belong to 2 models"):
        for i, (x, y) in enumerate(batches(PLANTED_STEP + 1)):
            plant(model, i)
            strict.scale(loss_fn(twice[1](x), y)).backward()
            strict.step(opt)
            strict.update()
            opt.zero_grad()
            strict.overflow_report()


@pytest.mark.slow
def test_scaler_without_watch_says_when_the_watched_model_is_not_the_trained_one():
    """A model compiled with the watch is alive but the optimizer trains another one: the report
    names no op and says that no watched model holds the parameters. Twin: with no watched model
    at all (nothing was asked), the same unwatched run says nothing."""
    import gc
    import warnings

    results = {}
    for watched_elsewhere in (True, False):
        gc.collect()  # the watched models of earlier tests (and of the first pass) are gone
        other = make_model(seed=1)
        elsewhere = amp_fx.compile(other, dtype="fp16", backend="aot_eager", watch_nonfinite=watched_elsewhere)
        model = make_model()
        compiled = amp_fx.compile(model, dtype="fp16", backend="aot_eager")
        scaler = amp_fx.GradScaler("cpu", init_scale=2.0**10, step_mode=amp_fx.StepMode.MASKED, strict=False)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            reports = run_scaler(model, compiled, scaler)
        results[watched_elsewhere] = [str(w.message) for w in caught if issubclass(w.category, amp_fx.AmpFxWarning)]
        assert reports[PLANTED_STEP] is not None and reports[PLANTED_STEP].first_op is None
        del elsewhere
    assert results[False] == []
    assert len(results[True]) == 1 and "hold none of the optimizer's parameters" in results[True][0], results


# ------------------------------------------------------------------ skip-aware LR scheduling
SCHEDULERS = {
    "LambdaLR": lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda e: 0.9**e),
    "StepLR": lambda o: torch.optim.lr_scheduler.StepLR(o, 2, 0.5),
    "MultiStepLR": lambda o: torch.optim.lr_scheduler.MultiStepLR(o, [2, 5], 0.3),
    "CosineAnnealingLR": lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, 10, eta_min=0.01),
    "LinearLR": lambda o: torch.optim.lr_scheduler.LinearLR(o, 0.1, 1.0, 5),
    "OneCycleLR": lambda o: torch.optim.lr_scheduler.OneCycleLR(o, 1.0, total_steps=14, cycle_momentum=False),
}
SKIPS = (2, 3, 7)


class _Flag:
    """Stands for a scaler: ``last_step_skipped`` is a 0-dim bool tensor."""

    last_step_skipped = torch.tensor(False)


@pytest.mark.parametrize("name", list(SCHEDULERS))
def test_skip_aware_scheduler_stands_still_on_skipped_steps(name):
    """Reference: the same scheduler stepped only after steps that were not skipped (decided on the
    host). Ours: every step, the decision on the device. The lr is an fp32 tensor: equal within
    one fp32 rounding of the reference's fp64 value (rtol 2^-23; the closed forms differ from
    torch's recursive ones by a few fp64 ulps, far below that)."""
    model = torch.nn.Linear(2, 2)
    ref_opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref, flag = SCHEDULERS[name](ref_opt), _Flag()
    ours = amp_fx.skip_aware(SCHEDULERS[name](opt), flag)
    seen = []
    for i in range(12):
        flag.last_step_skipped = torch.tensor(i in SKIPS)
        if i not in SKIPS:
            ref.step()
        ours.step()
        got = opt.param_groups[0]["lr"]
        assert isinstance(got, torch.Tensor) and got.dtype == torch.float32
        torch.testing.assert_close(
            got.double(), torch.tensor(ref_opt.param_groups[0]["lr"], dtype=torch.float64), rtol=2.0**-23, atol=0
        )
        seen.append(float(got))
    assert len(set(seen)) > 2  # the schedule moved


@pytest.mark.parametrize(
    "make",
    [
        lambda o: torch.optim.lr_scheduler.ReduceLROnPlateau(o),
        lambda o: torch.optim.lr_scheduler.OneCycleLR(o, 1.0, total_steps=10),  # cycles momentum too
    ],
    ids=["ReduceLROnPlateau", "OneCycleLR-cycle_momentum"],
)
def test_skip_aware_refuses_schedulers_it_cannot_hold(make):
    opt = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1, momentum=0.9)
    with pytest.raises(TypeError, match="amp_fx.skip_aware"):
        amp_fx.skip_aware(make(opt), _Flag())


def test_skip_aware_with_compile_step_holds_lr_on_the_planted_skip():
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=2.0**-3)
    ref_opt = torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=2.0**-3)
    ref = torch.optim.lr_scheduler.StepLR(ref_opt, 1, 0.5)
    step = amp_fx.compile_step(model, opt, loss_fn, backend="aot_eager", scaler=make_scaler())
    sched = amp_fx.skip_aware(torch.optim.lr_scheduler.StepLR(opt, 1, 0.5), step)
    for i, (x, y) in enumerate(batches(STEPS + 2)):
        plant(model, i)
        step(x, y)
        sched.step()
        if i != PLANTED_STEP:
            ref.step()
        assert float(opt.param_groups[0]["lr"]) == ref_opt.param_groups[0]["lr"], i  # powers of two: exact
    assert_steps_are_sync_free(step, batches(2, seed=9))


class _TiedNet(torch.nn.Module):
    """An embedding tied to the output head (GPT-2's wte/lm_head): one parameter, two names."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(16, 8)
        self.mid = torch.nn.Linear(8, 8)
        self.head = torch.nn.Linear(8, 16, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.mid(self.embed(ids)))


def test_tied_weight_is_named_as_named_parameters_names_it():
    """A tied weight's gradient is named by its first path, as ``named_parameters()`` (and so the
    eager reference) names it (``embed.weight``), not by its last alias (``head.weight``). Reference:
    eager autocast + torch.amp.GradScaler, the names of the non-finite gradients after unscale_."""
    torch.manual_seed(0)
    model = _TiedNet()
    ref_model = copy.deepcopy(model)
    ids = torch.randint(0, 16, (2, 5))
    with torch.no_grad():  # the planted overflow: mid's fp16 cast holds inf
        for m in (model, ref_model):
            m.mid.weight.mul_(2.0**24)
    ref_opt = torch.optim.SGD(ref_model.parameters(), lr=0.01)
    ref_scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    with torch.autocast("cpu", dtype=torch.float16):
        ref_loss = ref_model(ids).float().pow(2).mean()
    ref_scaler.scale(ref_loss).backward()
    ref_scaler.unscale_(ref_opt)
    reference = [n for n, p in ref_model.named_parameters() if not torch.isfinite(p.grad).all()]
    assert "embed.weight" in reference

    compiled = amp_fx.compile(model, dtype="fp16", backend="aot_eager", watch_nonfinite=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = amp_fx.GradScaler("cpu", init_scale=2.0**10, step_mode=amp_fx.StepMode.MASKED)
    scaler.watch(compiled)
    scaler.scale(compiled(ids).float().pow(2).mean()).backward()
    scaler.step(opt)
    scaler.update()
    report = scaler.overflow_report()
    assert report is not None and list(report.gradients) == reference, report
    assert report.first_op is not None and report.first_op.module == "mid", report


class _InplaceResidual(torch.nn.Module):
    """A residual added in place after the branch ran (timm's ResNet blocks: ``x += shortcut``)."""

    def __init__(self) -> None:
        super().__init__()
        self.main = torch.nn.Linear(8, 8)
        self.shortcut = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.main(x)
        h += self.shortcut(x)
        return h


@pytest.mark.parametrize("backend", BACKENDS)
def test_first_op_is_not_an_earlier_producer_written_in_place_later(backend):
    """The overflow is planted in ``shortcut``; ``main``'s output was finite when ``main`` made it and
    only became inf through the later ``+=``. The first non-finite op is in ``shortcut`` (its weight's
    fp16 cast), not ``main``: each check sees the value as its op left it."""
    torch.manual_seed(0)
    model = _InplaceResidual()
    with torch.no_grad():
        model.shortcut.weight.mul_(2.0**24)  # its fp16 cast holds inf
    compiled = amp_fx.compile(model, dtype="fp16", backend=backend, watch_nonfinite=True)
    scaler = amp_fx.GradScaler("cpu", init_scale=2.0**10, step_mode=amp_fx.StepMode.MASKED)
    scaler.watch(compiled)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler.scale(compiled(torch.randn(2, 8)).float().pow(2).mean()).backward()
    scaler.step(opt)
    scaler.update()
    report = scaler.overflow_report()
    assert report is not None and report.first_op is not None, report
    assert report.first_op.module == "shortcut", report
