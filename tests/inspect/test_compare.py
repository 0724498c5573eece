"""amp_fx.compare: ok on the zoo, and it names the planted divergence."""

from __future__ import annotations

import math

import pytest
import torch

import amp_fx
from amp_fx import AmpRunError
from amp_fx.inspect._probe import module_of
from amp_fx.passes import fold_casts as fold_module
from amp_fx.testing.zoo import ZOO
from tests.inspect._inspect_models import (
    AutocastMask,
    BNNet,
    BreakInside,
    KeywordLM,
    Overflowing,
    TwoLayer,
    keyword_batch,
    seeded,
)

# graph_break: its gradient difference is asserted in its own test below; lstm on a CPU without
# fp16 LSTM kernels: eager autocast itself fails (see test_eager_autocast_failure_is_explained)
COMPARE_ZOO = [n for n in ZOO if n != "graph_break"]


@pytest.mark.slow_cases
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("name", COMPARE_ZOO)
def test_zoo_agrees_bitwise(name, dtype):
    entry = ZOO[name]
    model, inputs, loss_fn = entry.build()
    try:
        with torch._dynamo.config.patch(dict(entry.dynamo_config)):
            try:
                report = amp_fx.compare(model, *inputs, dtype=dtype, loss_fn=loss_fn)
            except AmpRunError as e:
                if "fails the same way" not in str(e):
                    raise
                # aot_eager itself fails on this model (LSTM in bf16): compare on backend="eager"
                report = amp_fx.compare(model, *inputs, dtype=dtype, loss_fn=loss_fn, backend="eager")
    except AmpRunError as e:
        if "fails on it too" in str(e):
            pytest.skip(f"eager torch.autocast itself fails here: {e}")
        raise
    assert report.exact
    assert report.ok, str(report)
    assert report.first_divergence is None
    assert len(report.outputs) >= 1
    # the parameters that get a gradient, found here by a plain eager backward
    ref, ref_inputs, _ = entry.build()
    loss_fn(ref(*ref_inputs)).backward()
    assert [g.name for g in report.grads] == [n for n, p in ref.named_parameters() if p.grad is not None]
    assert "OK" in str(report)


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_graph_break_weight_used_across_break(dtype):
    """fc is used on both sides of a graph break. Eager autocast's cast cache spans the break (one
    cast, gradients summed in the lower dtype); amp_fx casts once per graph (summed in fp32)."""
    model, inputs, loss_fn = ZOO["graph_break"].build()
    report = amp_fx.compare(model, *inputs, dtype=dtype, loss_fn=loss_fn)
    assert {o.graph for o in report.ops} == {0, 1}
    assert all(o.agree for o in report.ops) and all(v.agree for v in report.outputs)
    assert sorted(g.name for g in report.grads if not g.agree) == ["fc.bias", "fc.weight"]
    assert any("fc.weight is used in graphs 0, 1" in n for n in report.notes)
    for g in report.grads:
        if not g.agree:  # amp_fx's fp32 sum is no further from float64 than eager's
            assert g.error_vs_reference.abs <= g.eager_error_vs_reference.abs * 1.5


def test_policy_divergence_is_named():
    model, x = seeded(TwoLayer, 3, 4)
    report = amp_fx.compare(model, x, dtype="bf16", policy=amp_fx.Policy(keep_fp32=("fc2",)))
    assert not report.ok
    # the expected op, found here from the graph amp_fx captured
    record = None
    compiled = amp_fx.compile(model, dtype="bf16", backend="eager", policy=amp_fx.Policy(keep_fp32=("fc2",)))
    compiled(x)
    record = amp_fx.records(compiled)[0]
    expected = next(
        n.name
        for n in record.captured.graph.nodes
        if n.target is torch.ops.aten.linear.default and module_of(n)[0] == "fc2"
    )
    first = report.first_divergence
    assert (first.node, first.op, first.module) == (expected, "aten.linear", "fc2")
    assert (first.eager_dtype, first.amp_dtype) == ("bf16", "fp32")
    assert report.first_dtype_divergence is first
    assert "kept by policy" in first.rule
    assert f"node {expected} (aten.linear, module fc2)" in str(report)
    # the ops before it agree
    before = report.ops[: report.ops.index(first)]
    assert before and all(o.agree for o in before)


def test_value_divergence_from_a_bad_fold(monkeypatch):
    """A fold rule that drops a rounding cast (fp32 -> bf16 -> fp32 is *not* value-preserving):
    dtypes still agree everywhere, values do not, from the first op after the fold."""

    def bad_round_trip(node):
        mid = node.args[0]
        if not fold_module.is_pure_cast(mid):
            return None
        src = mid.args[0]
        return src if src.meta["val"].dtype == node.meta["val"].dtype else None

    monkeypatch.setitem(fold_module.RULES, "bad_round_trip", bad_round_trip)

    def fn(x):
        return torch.relu(x.to(torch.bfloat16).float() * 3.0)

    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
    report = amp_fx.compare(fn, x, dtype="bf16", grads=False)
    assert not report.ok
    folded = [o for o in report.ops if o.status == "folded"]
    assert len(folded) == 2 and all(o.op == "aten._to_copy" for o in folded)
    first = report.first_divergence
    assert first.op == "aten.mul.Tensor" and first.dtype_agrees
    assert first.error_vs_eager.abs > 0
    # reference computed here: eager multiplies x rounded to bf16, amp_fx the unrounded x
    expected = ((x * 3.0).double() - (x.to(torch.bfloat16).float() * 3.0).double()).abs().max()
    assert first.error_vs_eager.abs == float(expected)


def test_eager_backend_is_exact_and_inductor_tolerance_is_stated():
    model, x = seeded(TwoLayer, 3, 4)
    report = amp_fx.compare(model, x, dtype="fp16", backend="eager")
    assert report.ok and report.exact


def test_user_model_untouched():
    model, x = seeded(BNNet, 2, 2, 4, 4)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    amp_fx.compare(model, x)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())


def test_integer_only_and_empty():
    report = amp_fx.compare(lambda x: x * 2 + 1, torch.arange(4), grads=False)
    assert report.ok
    assert any("no floating-point ops" in n for n in report.notes)
    report = amp_fx.compare(lambda x: x, torch.randn(3), grads=False)
    assert report.ok and any("no ops were captured" in n for n in report.notes)


def test_shape_mismatch():
    model, _ = seeded(TwoLayer, 3, 4)
    with pytest.raises(ValueError, match="inputs do not match the model.*mat1 and mat2"):
        amp_fx.compare(model, torch.randn(3, 7))


def test_eager_autocast_failure_is_explained():
    model, inputs, _ = ZOO["lstm"].build()
    try:
        with torch.autocast("cpu", dtype=torch.float16):
            model(*inputs)
    except RuntimeError:
        with pytest.raises(AmpRunError, match="eager torch.autocast.*fails on it too"):
            amp_fx.compare(model, *inputs, dtype="fp16")
    else:
        pytest.skip("this CPU has fp16 LSTM kernels: eager autocast runs")


def _loss_of(out):
    return out["loss"]


@pytest.mark.parametrize("split", ["keywords", "positional_and_keywords"])
def test_keyword_call_form(split):
    """compare takes the model's own call form: model(input_ids=..., labels=...) as HF models."""
    torch.manual_seed(0)
    model, batch = KeywordLM(), keyword_batch()
    if split == "keywords":
        args, kwargs = (), batch
    else:
        args, kwargs = (batch["input_ids"],), {k: v for k, v in batch.items() if k != "input_ids"}
    report = amp_fx.compare(model, *args, dtype="bf16", loss_fn=_loss_of, **kwargs)
    assert report.exact and report.ok, str(report)
    assert sorted(v.name for v in report.outputs) == ["output['logits']", "output['loss']"]
    # the parameters that get a gradient, found here by a plain eager backward with the same call
    model(*args, **kwargs)["loss"].backward()
    assert [g.name for g in report.grads] == [n for n, p in model.named_parameters() if p.grad is not None]
    # the keyword input is used: without the mask the logits differ (a planted, checked effect)
    unmasked = amp_fx.compare(model, batch["input_ids"], dtype="bf16", grads=False)
    assert unmasked.ops != report.ops


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_graph_constant_with_autocast_dtype_is_reported_not_raised(dtype):
    """HF T5's case: the op-by-op reference (the captured graph without autocast) cannot run, since
    a mask's dtype was read under autocast; compare still compares amp_fx with eager autocast."""
    model, x = seeded(AutocastMask, 2, 4, 8)
    lower = torch.bfloat16 if dtype == "bf16" else torch.float16
    with torch.autocast("cpu", dtype=lower):
        model(x)  # eager autocast runs it
    report = amp_fx.compare(model, x, dtype=dtype)
    assert report.exact and report.ok, str(report)
    assert any("graph 0 has no op-by-op reference" in n and "attn_mask" in n for n in report.notes)
    sdpa = next(o for o in report.ops if o.op == "aten.scaled_dot_product_attention")
    assert sdpa.agree and math.isnan(sdpa.error_vs_reference.abs)
    # the end-to-end reference runs the model itself in float64
    assert all(v.error_vs_reference is not None for v in (*report.outputs, *report.grads))


def test_agreeing_on_nonfinite_values_is_flagged():
    """Both sides overflow alike (agreement is right) but the verdict line says so."""
    model, x = seeded(Overflowing, 3, 4)
    with torch.autocast("cpu", dtype=torch.float16):
        eager = model(x)  # the planted overflow, checked here: eager autocast gives NaN too
    assert torch.isnan(eager).any()
    report = amp_fx.compare(model, x, dtype="fp16")
    assert report.ok
    verdict = str(report).splitlines()[0]
    assert verdict.startswith("OK: ") and "NOT FINITE: output holds " in verdict
    assert "(amp_fx and eager)" in verdict and "amp_fx.find_nonfinite" in verdict
    assert any(t.startswith("gradient of up.weight holds") for t in report.nonfinite)
    # negative twin: a healthy model is not flagged
    healthy, y = seeded(TwoLayer, 3, 4)
    clean = amp_fx.compare(healthy, y, dtype="fp16")
    assert clean.ok and not clean.nonfinite and "NOT FINITE" not in str(clean)


def test_verdict_counts_are_pluralised():
    torch.manual_seed(0)
    report = amp_fx.compare(torch.nn.Linear(4, 4), torch.randn(2, 4), dtype="bf16")
    assert report.verdict() == (
        "OK: amp_fx agrees with eager torch.autocast (bf16) on 1 op, 1 output and 2 gradients (bitwise)"
    )


def test_grads_asked_but_none_compared_is_said(monkeypatch):
    """grads=True on a function (no parameters): compare says it compared no gradient; strict
    mode makes that an error."""
    monkeypatch.delenv("AMP_FX_STRICT", raising=False)
    w = torch.randn(4, 4, generator=torch.Generator().manual_seed(0))

    def fn(x):
        return x @ w

    x = torch.randn(2, 4, requires_grad=True)
    with pytest.warns(amp_fx.AmpFxWarning, match="grads=True, but no gradient was compared"):
        report = amp_fx.compare(fn, x, dtype="bf16")
    assert report.ok and not report.grads
    assert any("no gradient was compared: it is a function" in n for n in report.notes)
    assert amp_fx.compare(fn, x, dtype="bf16", grads=False).ok  # negative twin: nothing to say
    monkeypatch.setenv("AMP_FX_STRICT", "1")
    with pytest.raises(amp_fx.AmpFxError, match="no gradient was compared"):
        amp_fx.compare(fn, x, dtype="bf16")


def test_graph_break_inside_a_submodule_names_modules_under_the_root():
    torch.manual_seed(0)
    model, x = BreakInside(), torch.randn(2, 8)
    report = amp_fx.compare(model, x, dtype="bf16")
    names = dict(model.named_modules())
    modules = [o.module for o in report.ops]
    # the reference: each op's module found by the op it is (two linears, a relu between)
    assert modules == ["model.a", "model", "model.head"]
    assert all(m in names for m in modules)
