"""fp8 training, the pass up the backend ladder against torchao 0.18 (the reference,
``_fp8_cases.py``): eager and aot_eager bitwise (loss, every gradient, 20 AdamW steps); inductor
bitwise where the casts round, and elsewhere no worse than torchao + ``torch.compile`` against
float64.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import Tensor

from amp_fx.testing import assert_bitwise
from amp_fx.testing.fp8_reference import (
    cpu_autocast_torchao,
    torchao_float8,
    torchao_missing,
)
from tests.fp8._fp8_cases import (
    INDUCTOR_RECIPES,
    RECIPES,
    amp_step,
    compile_fp8,
    loss_fn,
    mlp,
    torchao_step,
)

pytestmark = pytest.mark.skipif(torchao_missing() is not None, reason=str(torchao_missing()))


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("recipe", RECIPES)
def test_loss_and_gradients_bitwise_with_torchao(recipe: str, backend: str) -> None:
    model, x = mlp()
    expected = torchao_step(model, x, recipe)
    actual = amp_step(copy.deepcopy(model), x, recipe, backend)
    assert_bitwise(actual, expected, f"amp_fx fp8={recipe} ({backend}) vs torchao")


def test_without_fp8_the_loss_differs_from_torchao() -> None:
    """Negative twin: amp_fx's bf16 (fp8 off) is not torchao's fp8, so the test above can fail."""
    model, x = mlp()
    expected, _ = torchao_step(model, x, "tensorwise")
    actual, _ = amp_step(copy.deepcopy(model), x, None, "aot_eager")  # type: ignore[arg-type]
    assert not torch.equal(actual, expected)


@pytest.mark.parametrize("recipe", RECIPES)
def test_adamw_trajectory_bitwise_with_torchao(recipe: str) -> None:
    """20 AdamW steps: the loss of every step and the final parameters, bit for bit (aot_eager)."""
    model, x = mlp()
    ref = torchao_float8(model, recipe)
    ours = copy.deepcopy(model)
    compiled = compile_fp8(ours, recipe)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt = torch.optim.AdamW(ours.parameters(), lr=1e-2)
    losses_ref, losses = [], []
    for step in range(20):
        xs = x * (1 + step / 10)  # a new batch each step, larger each time
        with cpu_autocast_torchao(), torch.autocast("cpu", torch.bfloat16):
            loss_ref = loss_fn(ref(xs))
        loss_ref.backward()
        opt_ref.step()
        opt_ref.zero_grad()
        loss = loss_fn(compiled(xs))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses_ref.append(loss_ref.detach())
        losses.append(loss.detach())
    assert_bitwise(losses, losses_ref, "losses")
    assert_bitwise(dict(ours.named_parameters()), dict(ref.named_parameters()), "parameters")


@pytest.mark.slow
@pytest.mark.primary
@pytest.mark.parametrize("recipe", INDUCTOR_RECIPES)
def test_inductor_bitwise_with_torchao_when_casts_round(recipe: str) -> None:
    """With ``emulate_precision_casts`` (inductor rounds every cast it fuses, as eager does), the
    inductor build is bitwise with torchao's eager numerics: the fp8 construct reaches inductor
    whole, scale and cast ops included."""
    model, x = mlp()
    expected = torchao_step(model, x, recipe)
    ref = torch.compile(torchao_float8(model, recipe), backend="inductor", options={"emulate_precision_casts": True})
    with cpu_autocast_torchao(), torch.autocast("cpu", torch.bfloat16):
        loss_ref = loss_fn(ref(x))
    if not torch.equal(loss_ref, expected[0]):
        pytest.skip(
            f"torch {torch.__version__}'s inductor does not reproduce eager's roundings even "
            f"with emulate_precision_casts: torchao + torch.compile's own loss differs from its "
            f"eager one ({loss_ref.item()!r} != {expected[0].item()!r}); the error test below applies"
        )
    ours = copy.deepcopy(model)
    compiled = compile_fp8(ours, recipe, backend="inductor", options={"emulate_precision_casts": True})
    loss = loss_fn(compiled(x))
    loss.backward()
    assert_bitwise(
        (loss.detach(), {n: p.grad for n, p in ours.named_parameters()}),
        expected,
        f"amp_fx fp8={recipe} (inductor, emulate_precision_casts) vs torchao",
    )


def _relative_error(value: Tensor, reference: Tensor) -> float:
    return ((value.double() - reference).norm() / reference.norm()).item()


# amp_fx's and torchao's inductor builds differ only in which bf16 roundings inductor elides in
# its fused kernels (they are bitwise equal once it rounds them all, test above). Each elided
# rounding moves some values to a neighbouring fp8 code, so one batch's error can land either
# side of the other's (up to 7 % apart on single batches of this model); averaged over 8 batches
# the two stayed within 1 % (0.984x to 1.009x for the loss and every gradient, 3 recipes).
# 5 % keeps that margin while a real loss of accuracy (e5m2 where e4m3 belongs, no power-of-2
# rounding) costs far more.
INDUCTOR_SLACK = 1.05


@pytest.mark.slow
@pytest.mark.primary
@pytest.mark.parametrize("recipe", INDUCTOR_RECIPES)
def test_inductor_error_no_worse_than_torchao_compiled(recipe: str) -> None:
    """Default inductor (casts fused, intermediate roundings elided) for both: amp_fx's error
    against float64, loss and every gradient averaged over 8 batches, is within INDUCTOR_SLACK of
    torchao + ``torch.compile``'s."""
    model, x = mlp()
    exact = copy.deepcopy(model).double()
    ref = torchao_float8(model, recipe)
    ref_compiled = torch.compile(ref, backend="inductor")
    ours = copy.deepcopy(model)
    compiled = compile_fp8(ours, recipe, backend="inductor")
    errors: dict[str, list[list[float]]] = {"torchao": [], "amp_fx": []}
    for seed in range(8):
        xs = torch.randn(x.shape, generator=torch.Generator().manual_seed(seed))
        for p in (*ref.parameters(), *ours.parameters(), *exact.parameters()):
            p.grad = None
        loss64 = loss_fn(exact(xs.double()))
        loss64.backward()
        with cpu_autocast_torchao(), torch.autocast("cpu", torch.bfloat16):
            loss_ref = loss_fn(ref_compiled(xs))
        loss_ref.backward()
        loss = loss_fn(compiled(xs))
        loss.backward()
        for key, value, module in (("torchao", loss_ref, ref), ("amp_fx", loss, ours)):
            errors[key].append(
                [_relative_error(value, loss64)]
                + [_relative_error(p.grad, q.grad) for p, q in zip(module.parameters(), exact.parameters())]
            )
    names = ["loss"] + [f"{n}.grad" for n, _ in ours.named_parameters()]
    theirs, mine = torch.tensor(errors["torchao"]).mean(0), torch.tensor(errors["amp_fx"]).mean(0)
    worse = {n: (m, t) for n, m, t in zip(names, mine.tolist(), theirs.tolist()) if m > INDUCTOR_SLACK * t}
    assert not worse, f"amp_fx's error (mean of 8 batches) above {INDUCTOR_SLACK} x torchao's: {worse}"
