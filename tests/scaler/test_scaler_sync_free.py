"""What amp_fx.GradScaler adds to torch's: the sync-free masked step, protection against a
collapsed scale, device-side skip statistics and the check-only mode. Each test shows torch's
scaler on the same inputs, so that the difference (or the equality) is what is asserted."""

from __future__ import annotations

import math
import warnings
from typing import Any

import pytest
import torch
from test_scaler import OPTIMIZERS, assert_bitwise, make_data, make_model, run_script, train_step
from torch.utils._python_dispatch import TorchDispatchMode

from amp_fx.errors import AmpFxError, AmpFxWarning
from amp_fx.scaler import GradScaler, ScalerMode, StepMode

# The ops through which a tensor's value reaches the host: .item(), float(t), int(t), bool(t),
# `if t:` all dispatch to one of these. On CUDA each one is a device synchronisation.
_HOST_READS = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.is_nonzero.default}


class HostReads(TorchDispatchMode):
    """Counts ATen calls that read a tensor value on the host."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func in _HOST_READS:
            self.count += 1
        return func(*args, **(kwargs or {}))


def host_reads_in_step_and_update(scaler: torch.amp.GradScaler, opt_name: str, poison: float | None) -> tuple[int, int]:
    """Host reads during scaler.step()+update() on a warmed-up optimizer, and during a bare
    optimizer.step() of an identical optimizer (reads the optimizer does by itself, such as
    non-capturable Adam reading its CPU step counter)."""
    model = make_model()
    opt = OPTIMIZERS[opt_name](model.parameters())
    data = make_data(3)
    train_step(scaler, model, opt, data[0])  # the first step creates optimizer state
    opt.zero_grad()
    x, y = data[1]
    scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
    if poison is not None:
        model[0].weight.grad[0, 0] = poison
    with HostReads() as reads:
        scaler.step(opt)
        scaler.update()
    with HostReads() as bare:
        opt.step()
    return reads.count, bare.count


NON_FUSED = ["sgd_momentum", "sgd_momentum_for_loop", "adam", "rmsprop"]


@pytest.mark.parametrize("opt_name", NON_FUSED)
@pytest.mark.parametrize("poison", [None, math.inf])
def test_masked_step_reads_nothing_on_the_host(opt_name: str, poison: float | None) -> None:
    torch_reads, baseline = host_reads_in_step_and_update(torch.amp.GradScaler("cpu"), opt_name, poison)
    ours_sync, _ = host_reads_in_step_and_update(GradScaler("cpu"), opt_name, poison)
    ours_masked, _ = host_reads_in_step_and_update(GradScaler("cpu", step_mode=StepMode.MASKED), opt_name, poison)
    # torch's scaler reads found_inf (that is what makes this test able to fail) and so does
    # ours in the default mode; in MASKED mode the only reads left are the optimizer's own
    # (none for SGD/RMSprop), which a skipped step in torch does not do.
    assert torch_reads >= 1 and ours_sync == torch_reads
    assert ours_masked == baseline


@pytest.mark.parametrize("opt_name", ["adam_fused", "adamw_fused", "sgd_fused", "adagrad_fused"])
@pytest.mark.parametrize("step_mode", list(StepMode))
def test_fused_optimizers_step_without_host_reads(opt_name: str, step_mode: StepMode) -> None:
    torch_reads, _ = host_reads_in_step_and_update(torch.amp.GradScaler("cpu"), opt_name, math.inf)
    ours, _ = host_reads_in_step_and_update(GradScaler("cpu", step_mode=step_mode), opt_name, math.inf)
    opt = OPTIMIZERS[opt_name](make_model().parameters())
    if not getattr(opt, "_step_supports_amp_scaling", False):
        # torch 2.11's fused Adagrad takes no grad_scale/found_inf (2.13 and 2.15's does): torch's
        # scaler then reads found_inf, as ours does in HOST_SYNC mode; MASKED mode still reads nothing.
        assert torch_reads == 1 and ours == (1 if step_mode is StepMode.HOST_SYNC else 0)
        return
    assert torch_reads == 0 and ours == 0


@pytest.mark.parametrize("opt_name", NON_FUSED)
def test_masked_step_leaves_params_and_state_untouched(opt_name: str) -> None:
    model = make_model()
    opt = OPTIMIZERS[opt_name](model.parameters())
    scaler = GradScaler("cpu", step_mode=StepMode.MASKED)
    data = make_data(3)
    train_step(scaler, model, opt, data[0])
    train_step(scaler, model, opt, data[1])
    before = (
        [p.detach().clone() for p in model.parameters()],
        [{k: v.clone() for k, v in opt.state[p].items()} for p in model.parameters()],
    )
    train_step(scaler, model, opt, data[2], poison=math.nan)
    after = (
        [p.detach() for p in model.parameters()],
        [dict(opt.state[p]) for p in model.parameters()],
    )
    assert_bitwise(after, before)
    assert bool(scaler.last_step_skipped)


class IntStepSGD(torch.optim.Optimizer):
    """A third-party style optimizer that counts steps in a Python int."""

    def __init__(self, params: Any, lr: float) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self) -> None:  # type: ignore[override]
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                state["step"] = state.get("step", 0) + 1
                p.add_(p.grad, alpha=-group["lr"] / state["step"])


def test_masked_step_with_python_state_falls_back_to_a_host_read(monkeypatch) -> None:
    """Non-tensor state cannot be selected on the device: the step reads found_inf on the host
    (an AmpFxWarning, once) and stays exactly torch's result."""
    monkeypatch.setenv("AMP_FX_STRICT", "0")  # the warning is under test (the suite runs strict)
    poison = {2: math.inf, 3: math.inf, 6: math.nan}
    results = []
    for scaler in (
        torch.amp.GradScaler("cpu", growth_interval=2),
        GradScaler("cpu", growth_interval=2, step_mode=StepMode.MASKED),
    ):
        model = make_model()
        opt = IntStepSGD(model.parameters(), lr=0.1)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for i, batch in enumerate(make_data(8)):
                train_step(scaler, model, opt, batch, poison.get(i))
        said = [
            w for w in caught if issubclass(w.category, AmpFxWarning) and "non-tensor state 'step'" in str(w.message)
        ]
        results.append(
            (
                [p.detach().clone() for p in model.parameters()],
                [opt.state[p]["step"] for p in model.parameters()],
            )
        )
    assert len(said) == 1
    assert_bitwise(results[1], results[0])


def test_masked_step_host_read_is_an_error_in_strict_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AMP_FX_STRICT", "1")
    scaler = GradScaler("cpu", step_mode=StepMode.MASKED)
    model = make_model()
    opt = IntStepSGD(model.parameters(), lr=0.1)
    batches = make_data(2)
    train_step(scaler, model, opt, batches[0], None)  # creates the state: expected, not reported
    with pytest.raises(AmpFxError, match="non-tensor state 'step'.*reads found_inf on the host"):
        train_step(scaler, model, opt, batches[1], None)


def test_found_inf_is_exactly_zero_or_one() -> None:
    seen: list[torch.Tensor] = []

    class Recording(torch.optim.SGD):
        _step_supports_amp_scaling = True

        def step(self, closure: Any = None) -> None:  # type: ignore[override]
            seen.append(self.found_inf.clone())

    scaler = GradScaler("cpu")
    model = make_model()
    opt_a, opt_b = (
        torch.optim.SGD(model[0].parameters(), lr=0.1),
        Recording(model[2].parameters(), lr=0.1),
    )
    for poison in (None, math.inf, math.nan):
        opt_a.zero_grad()
        opt_b.zero_grad()
        scaler.scale(model(torch.ones(2, 5)).sum()).backward()
        if poison is not None:
            model[0].bias.grad[0] = poison
            model[2].bias.grad[0] = poison
        scaler.step(opt_a)
        scaler.step(opt_b)
        flags = [
            *scaler._found_inf_per_device(opt_a).values(),
            *scaler._found_inf_per_device(opt_b).values(),
        ]
        scaler.update()
        flags.append(scaler.last_step_skipped.float())
        assert all(f.item() in (0.0, 1.0) for f in flags + seen), flags + seen
    assert [f.item() for f in seen] == [0.0, 1.0, 1.0]


# ----------------------------------------------------------------------------- collapsed scale
def _train_at_scale(scaler: torch.amp.GradScaler, opt_name: str, n: int = 3) -> list[torch.Tensor]:
    model = make_model()
    opt = OPTIMIZERS[opt_name](model.parameters())
    for batch in make_data(n):
        train_step(scaler, model, opt, batch)
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("opt_name", ["sgd_momentum", "adam", "adam_fused"])
@pytest.mark.parametrize("step_mode", list(StepMode))
@pytest.mark.parametrize("scale", [0.0, 1e-45])
def test_collapsed_scale_never_makes_nan(opt_name: str, step_mode: StepMode, scale: float) -> None:
    """At scale 0 the loss and gradients are 0, pass the check, and 0 * (1/0) = NaN; at a
    denormal scale the fp32 reciprocal is inf. torch's scaler steps with NaN gradients."""
    torch_params = _train_at_scale(torch.amp.GradScaler("cpu", init_scale=scale), opt_name)
    if scale == 0.0 or not opt_name.endswith("fused"):
        # (fused Adam divides by the scale instead: at 1e-45 it overflows only for scaled
        # gradients above 3.4e-7, which this tiny loss does not have.)
        assert any(p.isnan().any() for p in torch_params), "torch's scaler no longer corrupts: revisit"
    ours = GradScaler("cpu", init_scale=scale, step_mode=step_mode)
    params = _train_at_scale(ours, opt_name)
    assert_bitwise(params, [p.detach() for p in make_model().parameters()])  # never stepped
    assert int(ours.skipped_steps) == 3


def test_scale_decays_to_zero_by_back_offs() -> None:
    """The realistic path: repeated overflows halve the scale to 0 (about 166 back-offs from
    2**16; 50 from 2**-100), then a clean step. min_scale stops the decay."""

    def run(scaler: torch.amp.GradScaler) -> list[torch.Tensor]:
        model = make_model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        data = make_data(1)[0]
        for i in range(56):
            train_step(scaler, model, opt, data, math.inf if i < 55 else None)
        return [p.detach().clone() for p in model.parameters()]

    ref = torch.amp.GradScaler("cpu", init_scale=2.0**-100)
    assert any(p.isnan().any() for p in run(ref)) and ref.get_scale() == 0.0
    ours = GradScaler("cpu", init_scale=2.0**-100, step_mode=StepMode.MASKED)
    assert not any(p.isnan().any() for p in run(ours)) and ours.get_scale() == 0.0
    assert int(ours.skipped_steps) == 56  # the clean step at scale 0 is skipped too
    bounded = GradScaler("cpu", init_scale=2.0**-100, min_scale=2.0**-110)
    params = run(bounded)
    assert bounded.get_scale() == 2.0**-110 and not any(p.isnan().any() for p in params)
    assert int(bounded.skipped_steps) == 55  # the last, clean step was taken
    assert not torch.equal(params[0], make_model()[0].weight)
    with pytest.raises(ValueError, match="reciprocal"):
        GradScaler("cpu", init_scale=1.0, min_scale=1e-40)  # its inverse overflows float32


# ----------------------------------------------------------------------------- statistics
def test_skip_statistics_follow_the_schedule_without_host_reads() -> None:
    poison = {1: math.inf, 2: math.nan, 5: math.inf}
    scaler = GradScaler("cpu", growth_interval=2, step_mode=StepMode.MASKED)
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    skipped, last = [], []
    for i, batch in enumerate(make_data(8)):
        with HostReads() as reads:
            train_step(scaler, model, opt, batch, poison.get(i))
            stats = (scaler.skipped_steps, scaler.last_step_skipped)
        assert reads.count == 0 or i == 0  # step 0 creates the momentum buffers
        skipped.append(int(stats[0]))
        last.append(bool(stats[1]))
    assert last == [i in poison for i in range(8)]
    assert skipped == [sum(j in poison for j in range(i + 1)) for i in range(8)]
    assert scaler.state_dict()["amp_fx"]["skipped_steps"] == len(poison)
    assert stats[0].dtype == torch.int64 and stats[1].dtype == torch.bool and stats[0].dim() == 0


def test_skip_statistics_match_torch_scale_history() -> None:
    # The only way to see a skip with torch's scaler is a drop in the scale (a host read).
    poison = {0: math.inf, 3: math.inf, 4: math.nan}
    ref, ours = (
        torch.amp.GradScaler("cpu", growth_interval=100),
        GradScaler("cpu", growth_interval=100),
    )
    for scaler in (ref, ours):
        model = make_model()
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        drops = []
        for i, batch in enumerate(make_data(6)):
            before = scaler.get_scale()
            train_step(scaler, model, opt, batch, poison.get(i))
            drops.append(scaler.get_scale() < before)
    assert int(ours.skipped_steps) == sum(drops) == len(poison)


# ----------------------------------------------------------------------------- check-only mode
def _plain_loop_skipping_non_finite(opt_name: str, poison: dict[int, float], n: int) -> list[torch.Tensor]:
    """The reference for CHECK_ONLY: no scaling, step only when all gradients are finite."""
    model = make_model()
    opt = OPTIMIZERS[opt_name](model.parameters())
    for i, (x, y) in enumerate(make_data(n)):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        if i in poison:
            model[0].weight.grad[1, 2] = poison[i]
        if all(torch.isfinite(p.grad).all() for p in model.parameters()):
            opt.step()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("opt_name", ["sgd_momentum", "adam", "adam_fused"])
@pytest.mark.parametrize("step_mode", list(StepMode))
def test_check_only_skips_without_scaling(opt_name: str, step_mode: StepMode) -> None:
    poison = {1: math.inf, 2: math.inf, 4: math.nan}
    scaler = GradScaler("cpu", mode=ScalerMode.CHECK_ONLY, step_mode=step_mode, growth_interval=1)
    ours = run_script(scaler, opt_name, 7, poison)
    assert_bitwise(ours["params"], _plain_loop_skipping_non_finite(opt_name, poison, 7))
    assert scaler.get_scale() == 1.0 and int(scaler.skipped_steps) == len(poison)
    # Where nothing overflows, torch's scaler at scale 1 that never grows is the same run.
    torch_run = run_script(torch.amp.GradScaler("cpu", init_scale=1.0, growth_interval=10**9), opt_name, 7, {})
    assert_bitwise(
        run_script(GradScaler("cpu", mode=ScalerMode.CHECK_ONLY), opt_name, 7, {})["params"],
        torch_run["params"],
    )


def test_check_only_leaves_loss_and_grads_alone() -> None:
    scaler = GradScaler("cpu", mode=ScalerMode.CHECK_ONLY)
    p = torch.nn.Parameter(torch.tensor([1.0, 2.0], dtype=torch.float16))
    loss = (p * 3).sum()
    assert scaler.scale(loss) is loss
    assert scaler.scale([loss])[0] is loss
    loss.backward()
    grad = p.grad.clone()
    opt = torch.optim.SGD([p], lr=0.5)
    scaler.unscale_(opt)  # fp16 gradients are fine: nothing is multiplied
    assert_bitwise(p.grad, grad)
    with pytest.raises(ValueError, match="Attempting to unscale FP16 gradients."):
        dyn = GradScaler("cpu")
        dyn.scale(loss)
        dyn.unscale_(opt)
    scaler.step(opt)
    scaler.update()
    with pytest.raises(ValueError, match="CHECK_ONLY"):
        scaler.update(4.0)


def test_check_only_state_dict_loads_into_torch_and_ignores_a_loaded_scale() -> None:
    ours = GradScaler("cpu", mode=ScalerMode.CHECK_ONLY)
    ours.scale(torch.ones(()))
    ref = torch.amp.GradScaler("cpu")
    ref.load_state_dict(ours.state_dict())
    assert ref.get_scale() == 1.0
    ours.load_state_dict(torch.amp.GradScaler("cpu").state_dict())
    assert ours.get_scale() == 1.0


# ----------------------------------------------------------------------------- misc
def test_masked_step_returns_the_optimizer_return_value() -> None:
    class Returning(torch.optim.SGD):
        def step(self, closure: Any = None) -> str:  # type: ignore[override]
            super().step()
            return "ran"

    model = make_model()
    opt = Returning(model.parameters(), lr=0.1, momentum=0.9)
    scaler = GradScaler("cpu", step_mode=StepMode.MASKED)
    assert train_step(scaler, model, opt, make_data(1)[0], poison=math.inf) == "ran"
    ref = torch.amp.GradScaler("cpu")
    assert train_step(ref, model, opt, make_data(1)[0], poison=math.inf) is None


@pytest.mark.parametrize("strict", [False, True])
def test_strict_argument_wins_over_the_environment(strict: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """GradScaler(strict=...) decides whether the host read is a warning or an error, whatever
    AMP_FX_STRICT says (set to the opposite here)."""
    monkeypatch.setenv("AMP_FX_STRICT", "0" if strict else "1")
    scaler = GradScaler("cpu", step_mode=StepMode.MASKED, strict=strict)
    model = make_model()
    opt = IntStepSGD(model.parameters(), lr=0.1)
    batches = make_data(2)
    train_step(scaler, model, opt, batches[0], None)  # creates the state: expected, not reported
    message = "non-tensor state 'step'.*reads found_inf on the host"
    if strict:
        with pytest.raises(AmpFxError, match=message):
            train_step(scaler, model, opt, batches[1], None)
    else:
        with pytest.warns(AmpFxWarning, match=message):
            train_step(scaler, model, opt, batches[1], None)
