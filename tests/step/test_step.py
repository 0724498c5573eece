"""amp_fx.compile_step against torch's eager AMP recipe (autocast + torch.amp.GradScaler).

Every numerical test runs the reference loop (amp_fx.testing.eager_amp_step) on an
identical copy of the model in the same test. The model, optimizers, batches (overflows planted
in them) and the run of both loops are in tests/step/_step_cases.py, shared with the GPU tier.
The backend ladder: aot_eager must be bit for bit; inductor within a derived tolerance (see
``inductor_tolerance``).
"""

from __future__ import annotations

import copy
import logging
import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

import amp_fx
from amp_fx._common import compat as _compat
from amp_fx.scaler import GradScaler, StepMode
from amp_fx.step import GradNorm, compile_step
from amp_fx.testing import HostSyncCounter, assert_bitwise, eager_amp_step
from amp_fx.testing.zoo import transformer_lm
from tests.step._step_cases import (
    ADAM_TRACED_RTOL,
    BF16_POISON,
    FP16_POISON,
    OPTIMIZERS,
    assert_steps_are_sync_free,
    flat_params,
    make_batches,
    make_model,
    run,
    run_pair,
    scalers,
)

PARAM_SIZES = [p.numel() for p in make_model().parameters()]


def cumulative_movement(ref: dict[str, list[torch.Tensor]]) -> list[torch.Tensor]:
    """Per parameter tensor, the sum over windows of max |update| of the reference run, up to
    each window (broadcast to the tensor's elements). Per tensor, not per element: a rounding
    error in a gradient element scales with the terms summed into it (a matmul's products), not
    with the element's own value, which cancellation can make arbitrarily small."""
    points = ref["init"] + ref["params"]
    out, total = [], torch.zeros_like(points[0])
    for a, b in zip(points, points[1:]):
        step = torch.cat([d.abs().max().expand(d.numel()) for d in (b - a).split(PARAM_SIZES)])
        total = total + step
        out.append(total)
    return out


PARITY_CASES = [
    # dtype, optimizer, accumulate, clip, grad_norm
    (torch.float16, "adam_fused", 1, None, GradNorm.FUSED),
    (torch.float16, "sgd_momentum", 1, None, GradNorm.FUSED),
    (torch.float16, "sgd_momentum", 1, 0.5, GradNorm.TORCH),
    (torch.float16, "adamw_fused", 1, 0.5, GradNorm.TORCH),
    (torch.float16, "adam_fused", 2, None, GradNorm.FUSED),
    (torch.float16, "sgd_momentum", 2, 0.5, GradNorm.TORCH),
    (torch.bfloat16, "sgd_momentum", 1, None, GradNorm.FUSED),
    (torch.bfloat16, "adam_fused", 2, 0.5, GradNorm.TORCH),
]


@pytest.mark.slow_cases
@pytest.mark.parametrize(
    "dtype,opt_name,accumulate,clip,grad_norm",
    PARITY_CASES,
    ids=lambda v: getattr(v, "name", str(v)).replace("torch.", ""),
)
def test_aot_eager_trajectory_is_bitwise_eager_amp(
    dtype: torch.dtype, opt_name: str, accumulate: int, clip: float | None, grad_norm: GradNorm
) -> None:
    poison = FP16_POISON if dtype == torch.float16 else BF16_POISON
    n = 10
    ours, ref, step = run_pair(
        dtype=dtype,
        opt_name=opt_name,
        accumulate=accumulate,
        clip=clip,
        grad_norm=grad_norm,
        backend="aot_eager",
        poison=poison,
        n=n,
    )
    for key in ("loss", "scale", "params"):
        for i, (a, e) in enumerate(zip(ours[key], ref[key], strict=True)):
            assert_bitwise(a, e, f"{key}[{i}]")
    # The run exercised what it claims: overflows skipped (and, for fp16, scale back-offs).
    poisoned_windows = {i // accumulate for i in poison}
    assert int(step.skipped_steps) == len(poisoned_windows)
    if dtype == torch.float16:
        assert len(set(s.item() for s in ref["scale"])) >= 3


@pytest.mark.parametrize("opt_name", ["sgd_momentum", "adamw_fused"])
def test_default_clipping_is_bitwise_eager_amp(opt_name: str) -> None:
    """The example of docs/compiled-step.md (max_grad_norm, no grad_norm given) reproduces unscale_ +
    clip_grad_norm_ bit for bit: the default is GradNorm.TORCH."""
    ours, ref, _ = run_pair(
        dtype=torch.float16,
        opt_name=opt_name,
        accumulate=1,
        clip=0.05,
        grad_norm=None,
        backend="aot_eager",
        poison=FP16_POISON,
        n=8,
    )
    for key in ("loss", "scale", "params"):
        for i, (a, e) in enumerate(zip(ours[key], ref[key], strict=True)):
            assert_bitwise(a, e, f"{key}[{i}]")


def test_fused_norm_clipping_matches_torch_clipping_within_fp32_rounding() -> None:
    """GradNorm.FUSED sums squares in one pass (fp32 pieces combined in fp64) instead of
    clip_grad_norm_'s norm of per-tensor norms: the norm differs by a few fp32 ulps, so the
    clipped update does too. Bound: 10 steps, each update off by <= 8 ulps relative (2^-20),
    measured against the total movement of each parameter in the reference run."""
    ours, ref, _ = run_pair(
        dtype=torch.float16,
        opt_name="sgd_momentum",
        accumulate=1,
        clip=0.05,
        grad_norm=GradNorm.FUSED,
        backend="aot_eager",
        poison=FP16_POISON,
        n=10,
    )
    for a, e in zip(ours["scale"], ref["scale"], strict=True):
        assert_bitwise(a, e, "scale")
    for i, (a, e, moved) in enumerate(zip(ours["params"], ref["params"], cumulative_movement(ref), strict=True)):
        bound = 2**-20 * moved + 2**-24 * e.abs()
        assert ((a - e).abs() <= bound).all(), f"params[{i}]: max excess {((a - e).abs() - bound).max()}"


# compile_step traces these optimizers' steps with Dynamo's rewrite of addcmul_/addcdiv_(value=x)
# (into mul/div + inductor_prims.fma, which aot_eager rounds twice; eager's kernels round once)
# turned off: amp_fx.step._EAGER_ROUNDING_STEPS. Without it, the parameters differed from the first
# compiled step on (torch 2.11, 2.13, 2.15). SGD, the other one there, is in PARITY_CASES.
@pytest.mark.parametrize("opt_name", ["rmsprop", "rmsprop_momentum", "adadelta"])
def test_traced_rmsprop_and_adadelta_are_bitwise_eager_amp(opt_name: str) -> None:
    ours, ref, step = run_pair(
        dtype=torch.float16,
        opt_name=opt_name,
        accumulate=1,
        clip=None,
        grad_norm=None,
        backend="aot_eager",
        poison=FP16_POISON,
        n=8,
    )
    for key in ("loss", "scale", "params"):
        for i, (a, e) in enumerate(zip(ours[key], ref[key], strict=True)):
            assert_bitwise(a, e, f"{key}[{i}]")
    assert int(step.skipped_steps) == len(FP16_POISON)
    assert_steps_are_sync_free(step, make_batches(3, {1: 1e6}, seed=5))


# The other optimizers traced by Dynamo that take the step counter as a tensor (Adamax, NAdam,
# RAdam; NAdam's momentum schedule, RAdam's rho_t, ASGD's eta) differ for Adam's reason
# (ADAM_TRACED_RTOL's derivation); Adagrad's lr / (1 + (t - 1) * lr_decay) is a tensor too, which
# Dynamo passes to addcdiv_'s value only through inductor_prims.fma (two roundings where eager's
# kernel rounds once), and the same fp16 flips follow. The same bound holds (measured worst over
# 10 steps with overflows, torch 2.11, 2.13, 2.15 alike: RAdam 2^-11.6, Adam 2^-12.5, AdamW
# 2^-13.5, NAdam 2^-17.3, Adamax 2^-19.6, ASGD 2^-19.7, Adagrad 2^-20.4).
@pytest.mark.slow_cases
@pytest.mark.parametrize("opt_name", ["adam", "adamw", "adamax", "nadam", "radam", "asgd", "adagrad"])
def test_traced_step_counter_optimizers_differ_from_eager_within_the_stated_bound(opt_name: str) -> None:
    ours, ref, step = run_pair(
        dtype=torch.float16,
        opt_name=opt_name,
        accumulate=1,
        clip=None,
        grad_norm=None,
        backend="aot_eager",
        poison=FP16_POISON,
        n=10,
    )
    for i, (a, e) in enumerate(zip(ours["scale"], ref["scale"], strict=True)):
        assert_bitwise(a, e, f"scale[{i}]")
    if opt_name != "adagrad":  # the eager warm-up step (Adagrad has state from the start: no warm-up)
        assert_bitwise(ours["params"][0], ref["params"][0], "params[0]")
    for i, (a, e, moved) in enumerate(zip(ours["params"], ref["params"], cumulative_movement(ref), strict=True)):
        bound = ADAM_TRACED_RTOL * moved + 2**-24 * e.abs()
        assert ((a - e).abs() <= bound).all(), f"params[{i}]: max excess {((a - e).abs() - bound).max()}"
    assert int(step.skipped_steps) == len(FP16_POISON)


# Inductor keeps a fused kernel's intermediates in fp32 (no fp16 round trip between ops), so a
# value can differ by up to half an fp16 ulp (2^-11 relative) per elided rounding. The loss passes
# 4 fp16 roundings (linear, layer_norm's input, gelu, linear): 2^-9 relative. A gradient passes
# those and about 4 more in the backward (two matmuls per linear, gelu's and layer_norm's
# backward): 8 * 2^-11 = 2^-8 relative, doubled to 2^-7 because the errors of the inputs of a
# matmul add. A parameter's update inherits its gradient's relative error (SGD: linearly; Adam:
# m / sqrt(v) to first order the same), and the errors of successive updates add up.
INDUCTOR_LOSS_RTOL = 2**-9
INDUCTOR_UPDATE_RTOL = 2**-7


@pytest.mark.slow
@pytest.mark.parametrize("opt_name,clip", [("sgd_momentum", 0.5), ("adam_fused", None)])
def test_inductor_trajectory_within_derived_tolerance_and_sync_free(opt_name: str, clip: float | None) -> None:
    n = 8
    ours, ref, step = run_pair(
        dtype=torch.float16,
        opt_name=opt_name,
        accumulate=1,
        clip=clip,
        grad_norm=GradNorm.FUSED,
        backend="inductor",
        poison=FP16_POISON,
        n=n,
    )
    for i, (a, e) in enumerate(zip(ours["scale"], ref["scale"], strict=True)):
        assert_bitwise(a, e, f"scale[{i}]")  # the same steps overflow, so the same scale history
    # The first loss depends on the forward only; later ones also on the parameters' drift.
    torch.testing.assert_close(ours["loss"][0], ref["loss"][0], rtol=INDUCTOR_LOSS_RTOL, atol=0)
    for i, (a, e) in enumerate(zip(ours["loss"], ref["loss"], strict=True)):
        assert a.isfinite() == e.isfinite(), f"loss[{i}]"
        torch.testing.assert_close(a, e, rtol=2 * INDUCTOR_LOSS_RTOL, atol=0, equal_nan=True, msg=f"loss[{i}]")
    for i, (a, e, moved) in enumerate(zip(ours["params"], ref["params"], cumulative_movement(ref), strict=True)):
        bound = INDUCTOR_UPDATE_RTOL * moved + 2**-24 * e.abs()
        assert ((a - e).abs() <= bound).all(), f"params[{i}]: max excess {((a - e).abs() - bound).max()}"
    # After warm-up, more steps (one overflowing) compile nothing, break nothing, read nothing.
    assert_steps_are_sync_free(step, make_batches(3, {1: 1e6}, seed=5))


@pytest.mark.slow_cases
@pytest.mark.parametrize("opt_name", ["adam_fused", "sgd_fused", "sgd_momentum", "adam", "sgd_plain"])
@pytest.mark.parametrize("clip", [None, 1.0])
def test_no_graph_break_no_host_sync_after_warm_up(opt_name: str, clip: float | None) -> None:
    model = make_model()
    opt = OPTIMIZERS[opt_name](model.parameters())
    step = compile_step(model, opt, torch.nn.functional.mse_loss, max_grad_norm=clip, accumulate=2, backend="aot_eager")
    for x, y in make_batches(4, {}):
        step(x, y)
    # Windows: skipped, clean, skipped (a non-finite step must not sync either).
    assert_steps_are_sync_free(step, make_batches(6, {0: 1e6, 5: math.inf}, seed=3))
    assert int(step.skipped_steps) == 2


def test_sync_detector_sees_torch_scalers_host_sync() -> None:
    """The control: the same detector on torch's recipe with a non-fused optimizer must see the
    found_inf read in scaler.step, or the sync-free tests above prove nothing."""
    model = make_model()
    opt = OPTIMIZERS["sgd_momentum"](model.parameters())
    ref_step = eager_amp_step(
        model, opt, torch.nn.functional.mse_loss, torch.amp.GradScaler("cpu"), dtype=torch.float16
    )
    batches = make_batches(3, {})
    ref_step(*batches[0])
    with HostSyncCounter() as syncs:
        for x, y in batches[1:]:
            ref_step(x, y)
    assert syncs.count >= 2, syncs.names
    # And torch.compile of the same recipe breaks the graph at scaler.step.
    compiled = torch.compile(lambda x, y: ref_step(x, y), backend="eager")
    compiled(*batches[0])
    assert sum(counters["graph_break"].values()) >= 1


def _no_amp_fx_warnings() -> Any:
    """Inside: an AmpFxWarning or a warning logged by amp_fx fails the test."""
    import contextlib
    import warnings

    @contextlib.contextmanager
    def cm() -> Any:
        class Fail(logging.Handler):
            def emit(self, record: logging.LogRecord) -> None:
                raise AssertionError(f"amp_fx logged a warning: {record.getMessage()}")

        handler = Fail(level=logging.WARNING)
        logging.getLogger("amp_fx").addHandler(handler)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("error", amp_fx.AmpFxWarning)
                yield
        finally:
            logging.getLogger("amp_fx").removeHandler(handler)

    return cm()


@pytest.mark.slow
@pytest.mark.parametrize(
    "dtype,weight_cache", [(torch.float16, False), (torch.bfloat16, True)], ids=["fp16", "bf16-weight_cache"]
)
def test_new_batch_and_length_bitwise_eager_amp(dtype: torch.dtype, weight_cache: bool) -> None:
    """A small LM whose head is a bias-free linear on a 3-d input, stepped at a new batch size, then
    a new length (Dynamo recompiles with symbolic sizes), then the first shape: losses, scale and
    parameters bitwise the eager recipe after every step. torch 2.11 failed in insert_casts at
    the head ("Cannot call numel() on tensor with symbolic sizes") at the second step."""
    model, ref_model = transformer_lm()[0], transformer_lm()[0]
    opt, ref_opt = OPTIMIZERS["sgd_momentum"](model.parameters()), OPTIMIZERS["sgd_momentum"](ref_model.parameters())
    ours_scaler, ref_scaler = scalers(dtype)

    def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten())

    step = compile_step(
        model, opt, loss_fn, dtype=dtype, scaler=ours_scaler, backend="aot_eager", weight_cache=weight_cache
    )
    ref_step = eager_amp_step(ref_model, ref_opt, loss_fn, ref_scaler, dtype=dtype)
    gen = torch.Generator().manual_seed(0)
    batches = [
        (torch.randint(0, 64, shape, generator=gen), torch.randint(0, 64, shape, generator=gen))
        for shape in ((2, 8), (3, 8), (3, 12), (2, 8))
    ]
    ours = run(step, batches, ours_scaler, model, 1)
    ref = run(ref_step, batches, ref_scaler, ref_model, 1)
    for key in ("loss", "scale", "params"):
        for i, (a, e) in enumerate(zip(ours[key], ref[key], strict=True)):
            assert_bitwise(a, e, f"{key}[{i}]")


def test_lr_scheduler_keeps_working_without_recompiles() -> None:
    """The pattern of docs/compiled-step.md: a scheduler changing lr compiles once more, silently (the lr is then a
    device tensor inside the step), and users still read a float lr from param_groups."""
    model, ref_model = make_model(), make_model()
    opt, ref_opt = OPTIMIZERS["sgd_momentum"](model.parameters()), OPTIMIZERS["sgd_momentum"](ref_model.parameters())
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.8)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, 1, gamma=0.8)
    step = compile_step(model, opt, torch.nn.functional.mse_loss, backend="aot_eager")
    ref_step = eager_amp_step(
        ref_model, ref_opt, torch.nn.functional.mse_loss, torch.amp.GradScaler("cpu"), dtype=torch.float16
    )
    batches = make_batches(8, {4: 1e6})
    graphs_after = []
    with _no_amp_fx_warnings():
        for x, y in batches:
            step(x, y)
            ref_step(x, y)
            sched.step()
            ref_sched.step()
            graphs_after.append(step.graphs_compiled)
            lr = opt.param_groups[0]["lr"]
            assert type(lr) is float and lr == ref_opt.param_groups[0]["lr"]
    # Warm-up (eager), the first compiled step and the one recompile when the float lr becomes a
    # tensor; then none. The skip is visible to a scheduler that wants it, on the device.
    assert len(set(graphs_after[3:])) == 1, graphs_after
    assert int(step.skipped_steps) == 1
    # A tensor lr changes the optimizer's arithmetic: Dynamo traces add_(grad, alpha=-lr) as a
    # multiply, then an add (2.11: torch.mul + add_; 2.13, 2.15: inductor_prims.fma, which aot_eager
    # runs as (a * b) + c), two roundings where eager's kernel rounds once: 2^-20 relative per
    # update (a few fp32 ulps), against the movement of the reference.
    for p, q in zip(model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(p, q, rtol=2**-18, atol=1e-7)


@pytest.mark.parametrize("opt_name", ["adam", "sgd_momentum"])
def test_one_cycle_lr_default_neither_recompiles_nor_fails(opt_name: str) -> None:
    """OneCycleLR also schedules betas (Adam) or momentum (SGD), which the optimizer cannot take as
    device tensors: the optimizer then steps eagerly, masked (said once), bitwise the eager recipe
    over more steps than Dynamo's recompile limit (8)."""
    n = 12
    model, ref_model = make_model(), make_model()
    opt, ref_opt = OPTIMIZERS[opt_name](model.parameters()), OPTIMIZERS[opt_name](ref_model.parameters())
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.01, total_steps=n)
    ref_sched = torch.optim.lr_scheduler.OneCycleLR(ref_opt, max_lr=0.01, total_steps=n)
    step = compile_step(
        model, opt, torch.nn.functional.mse_loss, backend="aot_eager", strict=False
    )  # the warning is under test (the suite runs strict)
    ref_step = eager_amp_step(
        ref_model, ref_opt, torch.nn.functional.mse_loss, torch.amp.GradScaler("cpu"), dtype=torch.float16
    )
    with pytest.warns(amp_fx.AmpFxWarning, match=r"param_groups\[0\]\['(betas|momentum)'\] changed") as said:
        for i, (x, y) in enumerate(make_batches(n, {4: 1e6})):
            assert_bitwise(step(x, y), ref_step(x, y), f"loss[{i}]")
            sched.step()
            ref_sched.step()
            assert type(opt.param_groups[0]["lr"]) is float
    assert len([w for w in said if issubclass(w.category, amp_fx.AmpFxWarning)]) == 1
    assert step.graphs_compiled <= 2  # the forward; the finish never needed compiling
    assert_bitwise(flat_params(model), flat_params(ref_model), "params")
    assert int(step.skipped_steps) == 1


def test_scheduled_lr_and_momentum_without_cycling_stay_compiled_and_sync_free() -> None:
    """OneCycleLR(cycle_momentum=False) changes lr only: compiled, one expected recompile, silent."""
    n = 12
    model = make_model()
    opt = OPTIMIZERS["adam"](model.parameters())
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.01, total_steps=n + 3, cycle_momentum=False)
    step = compile_step(model, opt, torch.nn.functional.mse_loss, backend="aot_eager", strict=True)
    batches = make_batches(n, {6: 1e6})
    with _no_amp_fx_warnings():
        for x, y in batches[:4]:
            step(x, y)
            sched.step()
        graphs = step.graphs_compiled
        with HostSyncCounter() as syncs:
            for x, y in batches[4:]:
                step(x, y)
                sched.step()
    assert syncs.count == 0, syncs.names
    assert step.graphs_compiled == graphs
    assert int(step.skipped_steps) == 1


def test_strict_mode_makes_an_eager_optimizer_step_an_error() -> None:
    model = make_model()
    opt = OPTIMIZERS["sgd_momentum"](model.parameters())
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.01, total_steps=5)
    step = compile_step(model, opt, torch.nn.functional.mse_loss, backend="aot_eager", strict=True)
    x, y = make_batches(1, {})[0]
    step(x, y)
    sched.step()
    with pytest.raises(amp_fx.AmpFxError, match=r"\['momentum'\] changed.*cycle_momentum=False"):
        step(x, y)


@pytest.mark.parametrize("opt_name", ["adam_fused", "sgd_momentum"])
def test_checkpoint_resume_is_bitwise_and_scaler_state_is_torchs(opt_name: str) -> None:
    n, cut = 8, 4
    batches = make_batches(n, {2: 1e6, 5: 1e6})

    def build(scaler: GradScaler) -> tuple[torch.nn.Module, torch.optim.Optimizer, Any]:
        model = make_model()
        opt = OPTIMIZERS[opt_name](model.parameters())
        return model, opt, compile_step(model, opt, torch.nn.functional.mse_loss, scaler=scaler, backend="aot_eager")

    model, opt, step = build(GradScaler("cpu", growth_interval=2, step_mode=StepMode.MASKED))
    losses = [step(x, y) for x, y in batches]
    final = [p.detach().clone() for p in model.parameters()]

    torch._dynamo.reset()
    model, opt, step = build(GradScaler("cpu", growth_interval=2, step_mode=StepMode.MASKED))
    for x, y in batches[:cut]:
        step(x, y)
    saved = copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict(), "scaler": step.state_dict()})
    # The scaler state round-trips through torch's scaler.
    torch_scaler = torch.amp.GradScaler("cpu")
    torch_scaler.load_state_dict(saved["scaler"])
    assert torch_scaler.get_scale() == saved["scaler"]["scale"]

    torch._dynamo.reset()
    model, opt, step = build(GradScaler("cpu", step_mode=StepMode.MASKED))
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    step.load_state_dict(torch_scaler.state_dict())
    resumed = [step(x, y) for x, y in batches[cut:]]
    for i, (a, e) in enumerate(zip(resumed, losses[cut:], strict=True)):
        assert_bitwise(a, e, f"loss[{cut + i}]")
    for a, e in zip(model.parameters(), final, strict=True):
        assert_bitwise(a, e, "param")


def test_batch_shape_changes_recompile_a_bounded_number_of_times() -> None:
    model = make_model()
    opt = OPTIMIZERS["adam_fused"](model.parameters())
    step = compile_step(model, opt, torch.nn.functional.mse_loss, backend="aot_eager")
    graphs = []
    for b in (3, 4, 5, 6, 7, 9):
        step(torch.randn(b, 8), torch.randn(b, 4))
        graphs.append(step.graphs_compiled)
    # Dynamo's automatic dynamic shapes: the second batch size recompiles the forward with a
    # symbolic batch dimension, after which no size recompiles.
    assert graphs[-1] == graphs[1] <= graphs[0] + 2, graphs


# ------------------------------------------------------------------------------- bad input
def test_non_scalar_loss_is_a_clear_error() -> None:
    model = make_model()
    step = compile_step(
        model, OPTIMIZERS["sgd_momentum"](model.parameters()), lambda out, y: (out - y).square(), backend="aot_eager"
    )
    with pytest.raises(ValueError, match=r"scalar \(0-dim\).*shape \(6, 4\)"):
        step(*make_batches(1, {})[0])


def test_foreign_parameters_are_refused() -> None:
    model = make_model()
    other = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD([*model.parameters(), *other.parameters()], lr=0.1)
    with pytest.raises(ValueError, match="2 parameter.*not parameters of the model"):
        compile_step(model, opt, torch.nn.functional.mse_loss)


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        ({"accumulate": 0}, ValueError, "accumulate must be an int >= 1"),
        ({"accumulate": 2.0}, ValueError, "accumulate must be an int >= 1"),
        ({"max_grad_norm": -1.0}, ValueError, "max_grad_norm must be positive"),
        ({"grad_norm": "fused"}, TypeError, "grad_norm must be a GradNorm"),
        ({"dtype": "fp8"}, ValueError, "unknown dtype"),
        ({"scaler": torch.amp.GradScaler("cpu")}, TypeError, "load its state"),
        ({"scaler": GradScaler("cpu", enabled=False)}, ValueError, "scaler is disabled"),
        ({"n_inputs": 0}, ValueError, "n_inputs must be an int >= 1"),
    ],
)
def test_bad_options_are_clear_errors(kwargs: dict[str, Any], error: type[Exception], match: str) -> None:
    model = make_model()
    with pytest.raises(error, match=match):
        compile_step(model, OPTIMIZERS["sgd_momentum"](model.parameters()), torch.nn.functional.mse_loss, **kwargs)


def test_public_api() -> None:
    assert amp_fx.compile_step is compile_step and "compile_step" in amp_fx.__all__


# ------------------------------------------------------------------------- usage patterns
@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_sgd_update_is_traced_as_eager_computes_it(momentum: float) -> None:
    """SGD's ``param.add_(grad, alpha=-lr)`` stays one add_ with its alpha in the finish graph: one
    rounding, as eager's kernel. torch 2.11's Dynamo splits a number alpha into mul + add_ (two
    roundings, amp_fx._common.compat.dynamo_decomposes_number_scalars) unless told not to; the parameters then
    differed from the eager recipe in the last bits (with these inputs: after the first compiled step)."""
    graphs: list[torch.fx.GraphModule] = []

    def record(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        graphs.append(gm)
        return gm.forward

    torch.manual_seed(101)
    x, y = torch.randn(3, 4), torch.randn(3, 2)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    ref_model = copy.deepcopy(model)
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1, momentum=momentum) for m in (model, ref_model))
    scaler = GradScaler("cpu", init_scale=2.0**8, step_mode=StepMode.MASKED)
    step = compile_step(model, opt, torch.nn.functional.mse_loss, scaler=scaler, backend=record)
    ref_step = eager_amp_step(
        ref_model,
        ref_opt,
        torch.nn.functional.mse_loss,
        torch.amp.GradScaler("cpu", init_scale=2.0**8),
        dtype=torch.float16,
    )
    for i in range(3):  # a warm-up step, then compiled ones
        assert_bitwise(step(x, y), ref_step(x, y), f"loss[{i}]")
        assert_bitwise(flat_params(model), flat_params(ref_model), f"params[{i}]")
    assert step._finish_backend.graphs == 1
    finish = graphs[-1]
    alphas = [
        n.kwargs["alpha"]
        for n in finish.graph.nodes
        if n.op == "call_method" and n.target == "add_" and "alpha" in n.kwargs
    ]
    # per parameter: the momentum buffer's add_(grad, alpha=1 - dampening), then the update
    assert alphas == ([1.0, -0.1] if momentum else [-0.1]) * 2, finish.code
    assert not [n for n in finish.graph.nodes if n.target in (torch.mul, "mul")], finish.code


def test_ten_compile_steps_in_one_process_each_own_their_cache_entries() -> None:
    """Dynamo keeps 8 cache entries per code object: every step must compile its own graphs
    (once all steps shared one code object and the 9th step raised FailOnRecompileLimitHit)."""
    x, y = torch.randn(3, 4), torch.randn(3, 2)
    for i in range(10):
        torch.manual_seed(i)
        model = torch.nn.Linear(4, 2)
        ref_model = copy.deepcopy(model)
        opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (model, ref_model))
        # A scale at which the fp16 gradients do not overflow, so that the second step is compiled.
        scaler = GradScaler("cpu", init_scale=2.0**8, step_mode=StepMode.MASKED)
        step = compile_step(model, opt, torch.nn.functional.mse_loss, scaler=scaler, backend="eager")
        ref_step = eager_amp_step(
            ref_model,
            ref_opt,
            torch.nn.functional.mse_loss,
            torch.amp.GradScaler("cpu", init_scale=2.0**8),
            dtype=torch.float16,
        )
        for _ in range(2):  # a warm-up step, then a compiled one
            assert_bitwise(step(x, y), ref_step(x, y), f"step {i}: loss")
        assert len(step._forward.amp_fx_records) >= 1 and step._finish_backend.graphs == 1, f"step {i}"
        assert_bitwise(flat_params(model), flat_params(ref_model), f"step {i}: params")


class _HFStyleOutput(dict):  # what transformers' ModelOutput is: a dict with attributes
    __getattr__ = dict.get


class _HFStyleLM(torch.nn.Module):
    """Called as HF models are (keywords, loss inside, None without labels), with a logger call
    in forward that Dynamo cannot trace (transformers' ``logger.warning_once``)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.head = torch.nn.Embedding(16, 8), torch.nn.Linear(8, 16)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> _HFStyleOutput:
        logging.getLogger("amp_fx.tests.hf_style").debug("loss_type=None")  # a graph break
        logits = self.head(self.emb(input_ids))
        loss = None if labels is None else torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
        return _HFStyleOutput(loss=loss, logits=logits)


def _hf_batches(n: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [
        {"input_ids": torch.randint(0, 16, (2, 5), generator=g), "labels": torch.randint(0, 16, (2, 5), generator=g)}
        for _ in range(n)
    ]


def test_keyword_inputs_and_graph_breaks_in_the_forward_hf_style() -> None:
    model, ref_model = _HFStyleLM(), _HFStyleLM()
    opt, ref_opt = OPTIMIZERS["adamw_fused"](model.parameters()), OPTIMIZERS["adamw_fused"](ref_model.parameters())
    step = compile_step(model, opt, lambda out: out.loss, backend="aot_eager")
    ref_scaler = torch.amp.GradScaler("cpu")
    for i, batch in enumerate(_hf_batches(3)):
        loss = step(**batch)
        with torch.autocast("cpu", dtype=torch.float16):
            ref_loss = ref_model(**batch).loss
        ref_scaler.scale(ref_loss).backward()
        ref_scaler.step(ref_opt)
        ref_scaler.update()
        ref_opt.zero_grad()
        assert_bitwise(loss, ref_loss.detach(), f"loss[{i}]")
    assert_bitwise(flat_params(model), flat_params(ref_model), "params")
    assert sum(counters["graph_break"].values()) >= 1  # the logger call did break the graph


def test_loss_fn_returning_none_is_amp_fx_error() -> None:
    model = _HFStyleLM()
    step = compile_step(model, OPTIMIZERS["adamw_fused"](model.parameters()), lambda out: out.loss, backend="aot_eager")
    batch = _hf_batches(1)[0]
    with pytest.raises(ValueError, match=r"loss_fn must return a floating-point scalar.*got a NoneType.*no labels"):
        step(input_ids=batch["input_ids"])


@pytest.mark.parametrize("strict", [False, True])
def test_strict_argument_reaches_the_forward(strict: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """compile_step(strict=...) decides for the forward's reports too, whatever the environment
    says (a policy entry that matches no op is reported by the forward)."""
    monkeypatch.setenv("AMP_FX_STRICT", "0" if strict else "1")
    model = make_model()
    policy = amp_fx.Policy(op_classes={"aten.conv2d": amp_fx.CastClass.FP32})
    step = compile_step(
        model,
        OPTIMIZERS["sgd_plain"](model.parameters()),
        torch.nn.functional.mse_loss,
        backend="eager",
        policy=policy,
        strict=strict,
    )
    x, y = make_batches(1, {})[0]
    if strict:
        with pytest.raises(amp_fx.AmpFxError, match="'aten.conv2d' -> CastClass.FP32 matched no op"):
            step(x, y)
    else:
        with pytest.warns(amp_fx.AmpFxWarning, match="'aten.conv2d' -> CastClass.FP32 matched no op"):
            step(x, y)


def test_trainable_parameters_outside_the_optimizer_are_a_user_warning() -> None:
    """The user's setup, not amp_fx doing less: a UserWarning (not AmpFxWarning, so not strict)
    naming the parameters; its twin, every parameter in the optimizer, warns nothing."""
    import warnings

    model = make_model()
    opt = torch.optim.SGD(model[0].parameters(), lr=0.1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compile_step(model, opt, torch.nn.functional.mse_loss, backend="eager")
        compile_step(model, OPTIMIZERS["sgd_plain"](model.parameters()), torch.nn.functional.mse_loss, backend="eager")
    assert [(w.category, w.filename) for w in caught] == [(UserWarning, __file__)]
    assert "not in the optimizer" in str(caught[0].message)
    assert "['1.weight', '1.bias', '3.weight', '3.bias']" in str(caught[0].message)


@pytest.mark.slow_cases
@pytest.mark.parametrize("weight_cache", [False, True], ids=["no_cache", "weight_cache"])
@pytest.mark.parametrize("opt_name", ["sgd_momentum", "adam_fused", "sgd_plain"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_param_group_added_between_steps_is_followed_bitwise(dtype, opt_name, weight_cache):
    """Progressive unfreezing: the head is frozen, then unfrozen and given to the optimizer with
    ``add_param_group`` after two windows. The step must unscale and check the new gradients too
    (before the fix their scaled gradients were applied as they were and the head went to NaN)."""
    poison = FP16_POISON if dtype == torch.float16 else BF16_POISON
    ours_scaler, ref_scaler = scalers(dtype)
    model, ref_model = make_model(), make_model()
    for m in (model, ref_model):
        m[3].requires_grad_(False)
    body = [p for p in model.parameters() if p.requires_grad]
    ref_body = [p for p in ref_model.parameters() if p.requires_grad]
    opt, ref_opt = OPTIMIZERS[opt_name](body), OPTIMIZERS[opt_name](ref_body)
    loss_fn = torch.nn.functional.mse_loss
    step = compile_step(
        model, opt, loss_fn, dtype=dtype, scaler=ours_scaler, backend="aot_eager", weight_cache=weight_cache
    )
    ref_step = eager_amp_step(ref_model, ref_opt, loss_fn, ref_scaler, dtype=dtype)
    for i, (x, y) in enumerate(make_batches(10, poison)):
        if i == 5:  # after an overflowed window and a clean one
            for m, o in ((model, opt), (ref_model, ref_opt)):
                m[3].requires_grad_(True)
                o.add_param_group({"params": list(m[3].parameters())})
            if not _compat.dynamo_guards_param_requires_grad():
                # torch 2.11: Dynamo would not recompile, the head would get no gradient; the
                # step says so (strict: raises before running anything) and names the fix.
                with pytest.raises(amp_fx.AmpFxError, match=r"requires_grad changed for \['3.weight', '3.bias'\]"):
                    step(x, y)
                torch._dynamo.reset()
                step = compile_step(
                    model, opt, loss_fn, dtype=dtype, scaler=ours_scaler, backend="aot_eager", weight_cache=weight_cache
                )
        assert_bitwise(step(x, y), ref_step(x, y), f"loss {i}")
        assert_bitwise(flat_params(model), flat_params(ref_model), f"parameters after micro-batch {i}")
        if dtype == torch.float16:
            assert_bitwise(step.scale, ref_scaler._scale, f"scale after micro-batch {i}")
