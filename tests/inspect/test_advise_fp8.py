"""amp_fx.advise(..., fp8=recipe): which matmuls to keep out of fp8, measured against float64.

The eager fp8 run advise measures is amp_fx's own (bitwise with ``amp_fx.compile(..., fp8=...,
backend="aot_eager")``); the planted hazards (an outlier that flushes the rest of a tensor to zero,
an input whose signal is below e4m3's mantissa) are kept out, and only they, checked through
``amp_fx.compile`` against float64 recomputed here; healthy twins keep nothing; the layers too
small to gain are torchao's own verdict. The real-model tier's cases are in
``tests/models/test_fp8_real_models.py``.
"""

from __future__ import annotations

import copy
import html
import json
from pathlib import Path

import pytest
import torch
from torch import nn

import amp_fx
from amp_fx.fp8 import Fp8Config
from amp_fx.inspect._fp8_eager import Fp8Eager
from amp_fx.inspect.advice import DEFAULT_TARGETS, FP8_ERROR_HAZARD
from amp_fx.kernels.fp8_support import rowwise_scales_missing
from amp_fx.testing import assert_bitwise
from amp_fx.testing.fp8_reference import torchao_missing
from amp_fx.testing.hazards import FP8_HAZARDS, build
from tests.inspect.test_advise import _amp_fx_error

_NO_ROWWISE = rowwise_scales_missing("cpu")
RECIPES = [
    pytest.param("tensorwise"),
    pytest.param("rowwise", marks=pytest.mark.skipif(_NO_ROWWISE is not None, reason=str(_NO_ROWWISE))),
]
TARGET = DEFAULT_TARGETS[torch.bfloat16]


class Functional(nn.Module):
    """The matmuls torchao's module swap cannot reach: ``x @ W.T`` on a parameter, ``F.linear``
    with a transposed parameter as its weight, and an ``nn.Linear`` between them."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(64, 32) / 32**0.5)
        self.lin = nn.Linear(64, 48)
        self.v = nn.Parameter(torch.randn(48, 16) / 48**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.lin(x @ self.w.t()))
        return nn.functional.linear(h, self.v.t())


def _gpt2() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(
        n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0
    )
    return transformers.GPT2LMHeadModel(cfg), (torch.randint(0, 128, (2, 16)),)


def _logits(out) -> torch.Tensor:
    return (out.logits if hasattr(out, "logits") else out).float().pow(2).mean()


@pytest.mark.slow_cases
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("name", ["functional", "functional_18_rows", "hf_gpt2_conv1d"])
def test_fp8_eager_run_is_bitwise_with_amp_fx_compile(name: str, recipe: str) -> None:
    """What advise measures with fp8 on is what amp_fx.compile runs: the eager fp8 mode
    (Fp8Eager, under CPU bf16 autocast) and ``amp_fx.compile(dtype="bf16", fp8=recipe,
    backend="aot_eager")`` give the same loss and gradients bit for bit, and convert the same
    matmuls. ``functional`` also pins a bug of the fp8 pass: ``F.linear(h, v.t())`` (a transposed
    parameter as the weight) was rewritten with the parameter's shape and failed in the backward;
    ``functional_18_rows`` (2 x 9 tokens) converts too, padded."""
    torch.manual_seed(0)
    rows = {"functional": 16, "functional_18_rows": 9}
    model, inputs = (Functional(), (torch.randn(2, rows[name], 32),)) if name in rows else _gpt2()
    ours = copy.deepcopy(model)
    stack: list[str] = []
    handles = [m.register_forward_pre_hook(lambda mod, a, n=n: stack.append(n)) for n, m in model.named_modules()]
    handles += [m.register_forward_hook(lambda mod, a, o: [stack.pop(), None][1]) for m in model.modules()]
    with torch.autocast("cpu", torch.bfloat16), Fp8Eager(Fp8Config(recipe), torch.bfloat16, "cpu", stack) as mode:
        loss = _logits(model(*inputs))
    loss.backward()
    for h in handles:
        h.remove()
    compiled = amp_fx.compile(ours, dtype="bf16", fp8=recipe, backend="aot_eager", strict=True)
    loss_c = _logits(compiled(*inputs))
    loss_c.backward()
    assert_bitwise(loss.detach(), loss_c.detach(), f"{name} {recipe}: loss")
    assert_bitwise(
        {n: p.grad for n, p in model.named_parameters()},
        {n: p.grad for n, p in ours.named_parameters()},
        f"{name} {recipe}: gradients",
    )
    converted = sorted(
        d.module for r in amp_fx.records(compiled) if r.fp8 is not None for d in r.fp8.decisions if d.converted
    )
    assert sorted(c.module for c in mode.calls) == converted and converted


@pytest.mark.slow_cases
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("name", sorted(FP8_HAZARDS))
def test_fp8_planted_hazard_is_kept_out_of_fp8_and_only_it(name: str, recipe: str) -> None:
    """An fp8-only hazard (fine in bf16, order-1 error in fp8: FP8_HAZARDS) is found by its fp8
    GEMM error and kept out of fp8, alone, after one search run; checked through amp_fx.compile
    against float64 recomputed here: bf16 alone meets the target, every matmul in fp8 does not,
    the advised policy does."""
    model, inputs, loss_fn = build(name)
    advice = amp_fx.advise(model, *inputs, dtype="bf16", fp8=recipe, loss_fn=loss_fn)
    culprit = FP8_HAZARDS[name]
    assert advice.keep_out_of_fp8 == (culprit,) and advice.verified and advice.runs == 2, str(advice)
    assert advice.policy == amp_fx.Policy(keep_out_of_fp8=(culprit,))
    assert advice.module(culprit).finding == "fp8 error" and advice.module(culprit).fp8_error > FP8_ERROR_HAZARD
    assert [m.module for m in advice.fp8_matmuls if m.error > FP8_ERROR_HAZARD] == [culprit]
    assert advice.cost.fp8_flop_share < advice.cost.default_fp8_flop_share == 1.0
    assert advice.kept[0].to == "bf16" and f"keep {culprit} out of fp8" in str(advice)
    assert _amp_fx_error(model, inputs, loss_fn, "bf16", amp_fx.Policy()) <= TARGET
    assert not (_amp_fx_error(model, inputs, loss_fn, "bf16", amp_fx.Policy(), fp8=recipe) <= TARGET)
    assert _amp_fx_error(model, inputs, loss_fn, "bf16", advice.policy, fp8=recipe) <= TARGET


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("name", sorted(FP8_HAZARDS))
def test_fp8_healthy_twin_keeps_nothing(name: str, recipe: str) -> None:
    model, inputs, loss_fn = build(name, hazard=False)
    advice = amp_fx.advise(model, *inputs, dtype="bf16", fp8=recipe, loss_fn=loss_fn)
    assert advice.keep_out_of_fp8 == () and advice.verified and advice.runs == 1, str(advice)
    assert not advice.hazards and all(m.error < FP8_ERROR_HAZARD for m in advice.fp8_matmuls)
    assert _amp_fx_error(model, inputs, loss_fn, "bf16", amp_fx.Policy(), fp8=recipe) <= TARGET


class _Sizes(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.small = nn.Linear(32, 64)  # too small for every recipe
        self.wide = nn.Linear(64, 1040)  # N > 1024: tensorwise gains, rowwise (N <= 2048) not
        self.big = nn.Linear(1040, 4112)  # gains for both

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.big(self.wide(self.small(x)))


@pytest.mark.skipif(torchao_missing() is not None, reason=str(torchao_missing()))
@pytest.mark.parametrize("recipe", RECIPES)
def test_fp8_too_small_to_gain_is_torchaos_verdict(recipe: str) -> None:
    """The layers flagged too small to gain are exactly those torchao 0.18's own size filter
    (``_auto_filter_for_recipe``, from its H100 benchmarks) would not convert, per recipe."""
    from torchao.float8.float8_linear_utils import _auto_filter_for_recipe

    torch.manual_seed(0)
    model = _Sizes()
    advice = amp_fx.advise(model, torch.randn(2, 16, 32), dtype="bf16", fp8=recipe)
    keep = _auto_filter_for_recipe(recipe, [])
    expected = {n for n, m in model.named_modules() if isinstance(m, nn.Linear) and not keep(m, n)}
    assert {m.module for m in advice.fp8_matmuls} == {"small", "wide", "big"}
    assert {m.module for m in advice.fp8_matmuls if m.too_small} == expected
    assert set(advice.too_small_for_fp8) == expected and "too small to gain" in str(advice)


class _LeftWeight(nn.Module):
    """``(W @ x.T).T``: a matmul whose parameter is the left operand, which fp8 does not take."""

    def __init__(self, n_in: int, n_out: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n_out, n_in) / n_in**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.weight @ x.t()).t()


def test_fp8_advise_says_when_no_matmul_runs_in_fp8() -> None:
    """A model none of whose matmuls the fp8 pass converts (each weight the left operand, ``W @ x``;
    odd sizes convert, padded): advise warns once, naming the model and why, and says so in its
    text; strict mode raises."""
    model = nn.Sequential(_LeftWeight(10, 24), nn.ReLU(), _LeftWeight(24, 10))
    x = torch.randn(16, 10)
    with pytest.warns(amp_fx.AmpFxWarning, match="no matmul of Sequential ran in fp8"):
        advice = amp_fx.advise(model, x, dtype="bf16", fp8="tensorwise", strict=False)
    assert "no matmul ran in fp8" in str(advice) and advice.fp8_matmuls == ()
    with pytest.raises(amp_fx.AmpFxError, match="no matmul of Sequential ran in fp8"):
        amp_fx.advise(model, x, dtype="bf16", fp8="tensorwise", strict=True)


def test_fp8_advise_refuses_rowwise_where_scaled_mm_takes_no_rowwise_scales(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where _scaled_mm takes no rowwise scales (torch 2.11's CPU kernel; simulated here where it
    does), advise refuses a rowwise recipe before it measures, through the check the fp8 pass
    uses (tests/fp8/test_fp8_config.py::test_rowwise_without_rowwise_scaled_mm_is_refused), naming itself."""
    import amp_fx.kernels.fp8_support as fp8_support

    monkeypatch.setattr(fp8_support, "rowwise_scales_missing", lambda device_type: "no rowwise here")
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32))
    why = "^amp_fx.advise: fp8='rowwise' needs rowwise scales.*no rowwise here.*fp8='tensorwise'"
    with pytest.raises(amp_fx.AmpFxError, match=why):
        amp_fx.advise(model, torch.randn(16, 32), dtype="bf16", fp8="rowwise")


def test_cli_advise_fp8_json(capsys: pytest.CaptureFixture[str]) -> None:
    from amp_fx.cli import main

    example = str(Path(__file__).resolve().parents[2] / "examples" / "advise_fp8.py") + ":build"
    rc = main(["advise", example, "--loss", "loss_fn", "--dtype", "bf16", "--fp8", "tensorwise", "--json"])
    data = json.loads(capsys.readouterr().out)
    model, inputs, loss_fn = build("fp8_outlier")
    advice = amp_fx.advise(model, *inputs, dtype="bf16", fp8="tensorwise", loss_fn=loss_fn)
    assert rc == 0 and data["fp8"] == "tensorwise" and data["verified"]
    assert data["keep_out_of_fp8"] == list(advice.keep_out_of_fp8) == ["up"] and data["keep_fp32"] == []
    assert data["error"] == advice.error and data["policy"] == 'Policy(keep_out_of_fp8=("up",))'
    assert [m["module"] for m in data["fp8_matmuls"]] == [m.module for m in advice.fp8_matmuls]


def test_fp8_html_page_says_out_of_fp8(tmp_path: Path) -> None:
    """The HTML page of an fp8 advice names the recipe, the fp8 policy, the fp8 matmul table and
    the kept module as kept out of fp8 (not in fp32), and its picture (explain with the same fp8
    recipe and the advised policy) is drawn."""
    model, inputs, loss_fn = build("fp8_outlier")
    advice = amp_fx.advise(model, *inputs, dtype="bf16", fp8="tensorwise", loss_fn=loss_fn)
    text = advice.to_html(tmp_path / "advice.html").read_text()
    assert "amp_fx.advise (bf16, fp8 tensorwise)" in text and "kept out of fp8" in text
    assert html.escape('Policy(keep_out_of_fp8=("up",))') in text and "fp8 matmuls" in text
    assert "amp_fx.explain failed" not in text and "in fp8 (every eligible matmul: 100.0%)" in text


def test_cli_fp8_choices_are_the_recipes() -> None:
    from amp_fx.cli import _FP8
    from amp_fx.fp8 import Fp8Recipe

    assert _FP8 == [r.value for r in Fp8Recipe]


def _converted(compiled: object) -> dict[str, tuple[bool, object]]:
    """Each matmul's (converted, recipe) by weight, as the fp8 pass decided it (what explain shows)."""
    records = [r.fp8 for r in amp_fx.records(compiled) if r.fp8 is not None]
    return {d.weight: (d.converted, d.recipe) for fp8 in records for d in fp8.decisions}


@pytest.mark.slow_cases
@pytest.mark.parametrize("recipe", RECIPES)
def test_fp8_advice_as_a_per_module_map_compiles_to_what_it_advised(recipe: str) -> None:
    """``advice.low_precision`` (and its code, printed in the advice) is a per-module recipe map:
    passed back to ``amp_fx.compile(low_precision=...)`` it converts the matmuls the advised policy
    converts, kept module's in bf16 and the rest in the recipe (the fp8 pass's decisions, which
    explain shows, selector and all), gives the same loss and gradients bit for bit, and meets the
    target against float64 where every matmul in fp8 does not."""
    model, inputs, loss_fn = build("fp8_outlier")
    advice = amp_fx.advise(model, *inputs, dtype="bf16", fp8=recipe, loss_fn=loss_fn)
    culprit = FP8_HAZARDS["fp8_outlier"]
    lp = advice.low_precision
    assert lp == amp_fx.LowPrecision(recipe=recipe, modules={culprit: None}), lp
    code = f'LowPrecision(recipe="{recipe}", modules={{"{culprit}": None}})'
    assert f"  low_precision = {code}" in str(advice) and advice.to_dict()["low_precision"] == code
    assert eval(code, {"LowPrecision": amp_fx.LowPrecision}) == lp

    runs = {}
    for how, kwargs in {
        "map": {"low_precision": lp},
        "policy": {"fp8": recipe, "policy": advice.policy},
    }.items():
        m = copy.deepcopy(model)
        compiled = amp_fx.compile(m, dtype="bf16", backend="aot_eager", strict=True, **kwargs)
        loss = loss_fn(compiled(*inputs))
        loss.backward()
        runs[how] = (_converted(compiled), loss.detach(), {n: p.grad for n, p in m.named_parameters()})
    decisions = runs["map"][0]
    assert decisions == runs["policy"][0]
    assert {w for w, (conv, _) in decisions.items() if not conv} == {f"{culprit}.weight"}, decisions
    assert {r for conv, r in decisions.values() if conv} == {Fp8Config(recipe).recipe}
    assert_bitwise(runs["map"][1:], runs["policy"][1:], "advice.low_precision against fp8= with advice.policy")
    shown = amp_fx.explain(model, *inputs, dtype="bf16", low_precision=lp).table()
    assert f"kept in bf16 by the low-precision map ('{culprit}')" in shown, shown
    for module in ("inp", "down"):
        assert any(line.split()[2:3] == [module] and f"fp8 {recipe} -> bf16" in line for line in shown.splitlines())
    assert _amp_fx_error(model, inputs, loss_fn, "bf16", amp_fx.Policy(), fp8=lp) <= TARGET
    assert not (_amp_fx_error(model, inputs, loss_fn, "bf16", amp_fx.Policy(), fp8=recipe) <= TARGET)


def test_advice_without_fp8_has_no_low_precision_map() -> None:
    model, inputs, loss_fn = build("fp8_outlier", hazard=False)
    advice = amp_fx.advise(model, *inputs, dtype="bf16", loss_fn=loss_fn)
    assert advice.low_precision is None and "low_precision =" not in str(advice)
    assert advice.to_dict()["low_precision"] is None
