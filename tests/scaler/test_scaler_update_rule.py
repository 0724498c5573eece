"""The scale update rule: ``torch.ops.amp_fx.update_scale_`` against ``torch._amp_update_scale_``
(bitwise, default configuration) and against a float64 reference model written here (bounds
and hysteresis), alone, inside ``GradScaler``, and under ``torch.compile``."""

from __future__ import annotations

import dataclasses
import math
import random

import numpy as np
import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import amp_fx.kernels.scale_update  # noqa: F401  (registers the op)
from amp_fx.scaler import GradScaler, StepMode

F32_MAX = float(np.finfo(np.float32).max)
F32_TINY_DENORMAL = float(np.finfo(np.float32).smallest_subnormal)


# ----------------------------------------------------------------------------- reference model
def f32(x: float) -> float:
    """Round a float64 to float32 (round to nearest even, overflow to inf), as C++ does."""
    with np.errstate(over="ignore"):
        return float(np.float64(x).astype(np.float32))


@dataclasses.dataclass(frozen=True)
class Rule:
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    min_scale: float = 0.0
    max_scale: float = math.inf
    hysteresis: int = 1
    consecutive_hysteresis: bool = False

    def op_args(self) -> tuple:
        return (
            self.growth_factor,
            self.backoff_factor,
            self.growth_interval,
            self.min_scale,
            self.max_scale,
            self.hysteresis,
            self.consecutive_hysteresis,
        )


@dataclasses.dataclass(frozen=True)
class State:
    scale: float  # a float32 value, held as a Python float
    tracker: int
    hyst: int


def reference_update(s: State, found: bool, r: Rule) -> State:
    """The rule in Python floats (float64), rounded to float32 where ATen stores a float.

    Megatron-LM's hysteresis: an overflow spends one unit of the budget and backs off once it
    is spent; only a growth refills it (or, with consecutive_hysteresis, any clean step).
    """
    if found:
        hyst = max(s.hyst - 1, 0)
        scale = s.scale
        if hyst == 0:
            scale = f32(max(s.scale * r.backoff_factor, min(s.scale, r.min_scale)))
        return State(scale, 0, hyst)
    successful = s.tracker + 1
    if successful == r.growth_interval:
        grown = f32(min(s.scale * r.growth_factor, max(s.scale, r.max_scale)))
        return State(grown if math.isfinite(grown) else s.scale, 0, r.hysteresis)
    return State(s.scale, successful, r.hysteresis if r.consecutive_hysteresis else s.hyst)


def run_op(s: State, found_inf: float, r: Rule) -> State:
    scale = torch.tensor(s.scale, dtype=torch.float32)
    tracker = torch.tensor(s.tracker, dtype=torch.int32)
    hyst = torch.tensor(s.hyst, dtype=torch.int32)
    torch.ops.amp_fx.update_scale_(scale, tracker, hyst, torch.tensor(found_inf), *r.op_args())
    return State(scale.item(), int(tracker), int(hyst))


def same_state(a: State, b: State) -> bool:
    def bits(x: float) -> np.ndarray:  # NaN-safe, -0.0-safe
        return np.float32(x).view(np.int32)

    return bits(a.scale) == bits(b.scale) and (a.tracker, a.hyst) == (b.tracker, b.hyst)


EDGE_SCALES = [
    0.0,
    -0.0,
    F32_TINY_DENORMAL,
    1.0,
    3.0,
    2.0**16,
    2.0**127,
    F32_MAX,
    math.inf,
    math.nan,
    -4.0,
]


# ----------------------------------------------------------------------------- vs ATen
def test_default_rule_is_bitwise_aten_on_edge_and_random_inputs() -> None:
    rng = random.Random(0)
    cases = []
    for scale in EDGE_SCALES:
        for found in (0.0, 1.0, 2.0, math.nan, -1.0):
            for tracker in (0, 1, 2, 5):
                cases.append(
                    (
                        scale,
                        found,
                        tracker,
                        rng.choice([2.0, 1.5, 3.7]),
                        rng.choice([0.5, 0.1, 0.999]),
                        3,
                    )
                )
    for _ in range(2000):
        scale = f32(rng.uniform(0, 10) * 10.0 ** rng.randint(-45, 38))
        cases.append(
            (
                scale,
                rng.choice([0.0, 1.0]),
                rng.randint(0, 4),
                rng.uniform(1.0001, 4.0),
                rng.uniform(0.01, 0.9999),
                rng.randint(1, 5),
            )
        )
    mismatches = []
    for scale, found, tracker, growth, backoff, interval in cases:
        ref_scale = torch.tensor(scale, dtype=torch.float32)
        ref_tracker = torch.tensor(tracker, dtype=torch.int32)
        torch._amp_update_scale_(ref_scale, ref_tracker, torch.tensor(found), growth, backoff, interval)
        got = run_op(State(scale, tracker, 1), found, Rule(growth, backoff, interval))
        if not same_state(got, State(ref_scale.item(), int(ref_tracker), got.hyst)):
            mismatches.append((scale, found, tracker, growth, backoff, interval))
    assert mismatches == []


def test_rejects_what_aten_rejects() -> None:
    ok = {
        "scale": torch.ones(()),
        "tracker": torch.zeros((), dtype=torch.int32),
        "found": torch.zeros(()),
    }
    for key, bad, aten_msg in [
        ("scale", torch.ones((), dtype=torch.float64), "current_scale must be a float tensor."),
        ("tracker", torch.zeros(()), "growth_tracker must be an int tensor."),
        ("found", torch.zeros(2), "found_inf must be a 1-element tensor."),
    ]:
        args = {**ok, key: bad}
        with pytest.raises(RuntimeError, match=aten_msg):
            torch._amp_update_scale_(args["scale"], args["tracker"], args["found"], 2.0, 0.5, 3)
        with pytest.raises(RuntimeError, match=aten_msg):
            torch.ops.amp_fx.update_scale_(
                args["scale"],
                args["tracker"],
                torch.ones((), dtype=torch.int32),
                args["found"],
                *Rule().op_args(),
            )


# ----------------------------------------------------------------------------- vs reference
RULES = {
    "torch": Rule(growth_interval=3),
    "bounds": Rule(growth_interval=2, min_scale=0.75, max_scale=48.0),
    "odd_factors": Rule(growth_factor=1.7, backoff_factor=0.3, growth_interval=2, min_scale=0.3, max_scale=100.0),
    "hysteresis": Rule(growth_interval=4, hysteresis=3),
    "hysteresis_consecutive": Rule(growth_interval=4, hysteresis=2, consecutive_hysteresis=True),
    "all": Rule(growth_interval=2, min_scale=1.0, max_scale=2.0**20, hysteresis=2),
}


@pytest.mark.parametrize("name", sorted(RULES))
@pytest.mark.parametrize("start", [8.0, 1.0, 2.0**20, 100.0])
def test_rule_matches_float64_reference(name: str, start: float) -> None:
    rule = RULES[name]
    rng = random.Random(name)
    # Runs of overflows and of clean steps, so that bounds, growth and hysteresis all engage.
    flags: list[bool] = []
    while len(flags) < 300:
        flags += [rng.random() < 0.5] * rng.randint(1, 6)
    ref = got = State(start, 0, rule.hysteresis)
    for i, found in enumerate(flags):
        ref = reference_update(ref, found, rule)
        got = run_op(got, float(found), rule)
        assert same_state(got, ref), (i, got, ref)


def test_bounds_hold_and_never_move_the_wrong_way() -> None:
    rule = Rule(growth_interval=1, min_scale=4.0, max_scale=64.0)
    s = State(16.0, 0, 1)
    for _ in range(10):
        s = run_op(s, 1.0, rule)
    assert s.scale == rule.min_scale == reference_update(State(4.0, 0, 1), True, rule).scale
    for _ in range(10):
        s = run_op(s, 0.0, rule)
    assert s.scale == rule.max_scale
    # A scale set outside the bounds (update(new_scale)) is not pulled across them.
    assert run_op(State(2.0, 0, 1), 1.0, rule).scale == 2.0  # no back-off raises it
    assert run_op(State(128.0, 0, 1), 0.0, rule).scale == 128.0  # no growth lowers it
    # Without a max_scale the growth still stops short of inf, as in ATen.
    assert run_op(State(F32_MAX, 0, 1), 0.0, Rule(growth_interval=1)).scale == F32_MAX


@pytest.mark.parametrize("consecutive", [False, True])
def test_hysteresis_semantics(consecutive: bool) -> None:
    # hysteresis=2: two overflows separated by a clean step. Megatron's tracker refills only on
    # growth, so the second overflow backs off; with consecutive_hysteresis it does not.
    rule = Rule(growth_interval=100, hysteresis=2, consecutive_hysteresis=consecutive)
    s0 = State(1024.0, 0, 2)
    s = run_op(run_op(run_op(s0, 1.0, rule), 0.0, rule), 1.0, rule)
    assert (s.scale < s0.scale) is (not consecutive)
    s = run_op(run_op(s0, 1.0, rule), 1.0, rule)  # two in a row back off either way
    assert s.scale < s0.scale
    assert run_op(s0, 1.0, rule).scale == s0.scale  # one alone never does


# ----------------------------------------------------------------------------- inside GradScaler
@pytest.mark.parametrize("name", ["bounds", "hysteresis", "hysteresis_consecutive", "all"])
@pytest.mark.parametrize("step_mode", list(StepMode))
def test_grad_scaler_follows_reference(name: str, step_mode: StepMode) -> None:
    rule = RULES[name]
    init = 16.0
    scaler = GradScaler(
        "cpu",
        init_scale=init,
        growth_factor=rule.growth_factor,
        backoff_factor=rule.backoff_factor,
        growth_interval=rule.growth_interval,
        step_mode=step_mode,
        min_scale=rule.min_scale or None,
        max_scale=None if math.isinf(rule.max_scale) else rule.max_scale,
        hysteresis=rule.hysteresis,
        consecutive_hysteresis=rule.consecutive_hysteresis,
    )
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([p], lr=0.01)
    flags = [True] * 5 + [False] * 9 + [True, False, True, True, False] * 3 + [True] * 7
    ref = State(init, 0, rule.hysteresis)
    for found in flags:
        opt.zero_grad()
        scaler.scale(p.sum()).backward()
        if found:
            p.grad[0] = math.inf
        scaler.step(opt)
        scaler.update()
        ref = reference_update(ref, found, rule)
        got = State(scaler.get_scale(), scaler._get_growth_tracker(), int(scaler._hysteresis_tracker))
        assert same_state(got, ref), (got, ref)
    assert int(scaler.skipped_steps) == sum(flags)


# ----------------------------------------------------------------------------- torch.compile
def test_opcheck() -> None:
    args = (
        torch.tensor(8.0),
        torch.tensor(1, dtype=torch.int32),
        torch.tensor(2, dtype=torch.int32),
        torch.tensor(1.0),
        *Rule(growth_interval=2, min_scale=1.0, max_scale=64.0, hysteresis=2).op_args(),
    )
    torch.library.opcheck(torch.ops.amp_fx.update_scale_.default, args)


@pytest.mark.parametrize("backend", ["eager", "aot_eager", "inductor"])
def test_compiles_without_graph_break(backend: str) -> None:
    rule = RULES["all"]

    def step(scale: torch.Tensor, tracker: torch.Tensor, hyst: torch.Tensor, found: torch.Tensor) -> torch.Tensor:
        torch.ops.amp_fx.update_scale_(scale, tracker, hyst, found, *rule.op_args())
        return scale * 2

    torch._dynamo.reset()
    counter = CompileCounterWithBackend(backend)
    compiled = torch.compile(step, backend=counter, fullgraph=True)
    state = [
        torch.tensor(8.0),
        torch.tensor(1, dtype=torch.int32),
        torch.tensor(2, dtype=torch.int32),
    ]
    ref = State(8.0, 1, 2)
    for found in (0.0, 1.0, 1.0, 0.0, 0.0):
        out = compiled(*state, torch.tensor(found))
        ref = reference_update(ref, bool(found), rule)
        assert same_state(State(state[0].item(), int(state[1]), int(state[2])), ref)
        assert out.item() == 2 * ref.scale
    assert counter.frame_count == 1
