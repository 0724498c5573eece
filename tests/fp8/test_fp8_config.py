"""fp8's option: ``Fp8Config`` and the recipe names, wherever amp_fx takes options (compile's
record, the dynamo backend by name), the refusals (rowwise without a rowwise ``_scaled_mm``) and
the one notice of a slow fp8 kernel.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import amp_fx
from amp_fx.fp8 import Fp8Config, Fp8Recipe
from amp_fx.testing import assert_bitwise
from amp_fx.testing.fp8_reference import (
    torchao_missing,
)
from tests.fp8._fp8_cases import (
    _needs_rowwise,
    compile_fp8,
    loss_fn,
    mlp,
    torchao_step,
)

pytestmark = pytest.mark.skipif(torchao_missing() is not None, reason=str(torchao_missing()))


@pytest.mark.parametrize(
    "value, recipe",
    [
        ("rowwise", Fp8Recipe.ROWWISE),
        (Fp8Recipe.TENSORWISE, Fp8Recipe.TENSORWISE),
        (Fp8Config("rowwise_with_gw_hp"), Fp8Recipe.ROWWISE_WITH_GW_HP),
    ],
)
def test_config_accepts_a_name_a_recipe_or_a_config(value: object, recipe: Fp8Recipe) -> None:
    config = Fp8Config.of(value)  # type: ignore[arg-type]
    assert config is not None and config.recipe is recipe


@pytest.mark.parametrize("value, error", [("rowwize", ValueError), (8, TypeError)])
def test_config_refuses_what_is_not_a_recipe(value: object, error: type[Exception]) -> None:
    with pytest.raises(error, match="recipe|fp8 must be"):
        Fp8Config.of(value)  # type: ignore[arg-type]


def test_config_is_frozen() -> None:
    config = Fp8Config("rowwise")
    with pytest.raises(AttributeError):
        config.recipe = Fp8Recipe.TENSORWISE  # type: ignore[misc]


def test_options_record_holds_the_config() -> None:
    model, _ = mlp()
    compiled = compile_fp8(model, "rowwise")
    assert amp_fx.options_of(compiled).fp8 == Fp8Config(Fp8Recipe.ROWWISE)
    assert amp_fx.options_of(compile_fp8(mlp()[0], None)).fp8 is None


def test_a_bad_fp8_value_fails_at_compile_time() -> None:
    with pytest.raises(ValueError, match="unknown low-precision recipe 'rowwize'"):
        compile_fp8(mlp()[0], "rowwize")


def test_dynamo_backend_by_name_takes_fp8() -> None:
    """torch.compile(backend="amp_fx", options={"fp8": ...}) under torch.autocast: bitwise torchao."""
    _needs_rowwise()
    model, x = mlp()
    expected = torchao_step(model, x, "rowwise")
    ours = copy.deepcopy(model)
    compiled = torch.compile(ours, backend="amp_fx", options={"backend": "aot_eager", "fp8": "rowwise"})
    with torch.autocast("cpu", torch.bfloat16):
        loss = loss_fn(compiled(x))
    loss.backward()
    assert_bitwise(
        (loss.detach(), {n: p.grad for n, p in ours.named_parameters()}),
        expected,
        "torch.compile(backend='amp_fx', fp8) vs torchao",
    )


def test_rowwise_without_rowwise_scaled_mm_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where _scaled_mm takes no rowwise scales (torch 2.11's CPU kernel; simulated here where it
    does), a rowwise recipe is refused at compile time with the reason and the fix, not by an
    internal assert of _scaled_mm at the first GEMM. tensorwise still runs."""
    import amp_fx.kernels.fp8_support as fp8_support

    monkeypatch.setattr(fp8_support, "rowwise_scales_missing", lambda device_type: "no rowwise here")
    model, x = mlp()
    why = "fp8='rowwise' needs rowwise scales.*no rowwise here.*fp8='tensorwise'"
    with pytest.raises(amp_fx.AmpFxError, match=why):
        compile_fp8(copy.deepcopy(model), "rowwise")(x)
    compile_fp8(model, "tensorwise")(x)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the notice is for a device without fp8 tensor cores")
@pytest.mark.parametrize(
    "recipe, says",
    [
        ("tensorwise", "runs without fp8 tensor cores here: cpu has no fp8 tensor cores, so torch._scaled_mm runs its"),
        ("mxfp8", "runs emulated here: cpu has no MXFP8 matmul kernel"),
    ],
)
def test_a_slow_fp8_kernel_is_one_notice_even_in_strict_mode(recipe: str, says: str) -> None:
    """One rule for every recipe: a kernel with the recipe's numerics but slower than bf16 is said
    once (a UserWarning, not an AmpFxWarning: nothing asked is undone, so strict mode runs it),
    with where fp8 is fast; explain says it as a note. Its twin, fp8 off, says nothing."""
    import warnings

    x = torch.randn(32, 32)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled = amp_fx.compile(nn.Linear(32, 32), dtype="bf16", fp8=recipe, backend="eager", strict=True)
        compiled(x)
        compiled(x)
        amp_fx.compile(nn.Linear(32, 32), dtype="bf16", backend="eager", strict=True)(x)
    said = [(w.category, w.filename) for w in caught if "amp_fx: fp8=" in str(w.message)]
    assert said == [(UserWarning, __file__)], [str(w.message) for w in caught]
    message = next(str(w.message) for w in caught if "amp_fx: fp8=" in str(w.message))
    assert says in message and "slower than bf16" in message and ("H100" in message or "B200" in message)
    assert says in str(amp_fx.explain(nn.Linear(32, 32), x, dtype="bf16", fp8=recipe))


def test_every_recipe_has_a_kernel_check() -> None:
    """``slow_fp8_text`` reads one table, recipe -> (kernel check, text): a recipe missing from it
    would raise at the first compile that converts a matmul with it."""
    from amp_fx.backend.audit import _SLOW_KERNELS

    assert set(_SLOW_KERNELS) == set(Fp8Recipe)
