"""amp_fx.find_nonfinite names the planted overflow, forward and backward, and nothing on a
healthy model."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import amp_fx
from amp_fx.testing.zoo import ZOO
from tests.inspect._inspect_models import (
    SPLIT_CASES,
    BNNet,
    BreakInside,
    ExpOverflow,
    GradOverflow,
    KeywordLM,
    MaskedLog,
    NestedOverflow,
    Overflowing,
    TwoLayer,
    chain_overflow,
    keyword_batch,
    seeded,
    split_case,
    split_weights_noted,
    split_weights_reported,
)


def test_forward_overflow_names_the_linear():
    model, x = seeded(Overflowing, 3, 4)
    # the planted overflow, checked here: fp16 linear overflows, fp32 does not
    up = model.up
    assert torch.isinf(F.linear(x.half(), up.weight.half(), up.bias.half())).any()
    assert torch.isfinite(up(x)).all()
    report = amp_fx.find_nonfinite(model, x, dtype="fp16")
    assert report.found and report.phase == "forward"
    assert (report.op, report.module_path, report.module_type) == ("aten.linear", "up", "Linear")
    assert report.dtype_found is torch.float16
    assert "overflows fp16's max 65504" in report.reason
    assert report.fp32_finite is True
    assert report.suggestion_code == 'Policy(keep_fp32=("up",))'
    assert report.suggested_policy.keep_fp32 == ("up",)
    assert report.verified is True  # the LayerNorm after `up` brings values back to ~1
    assert [name for name, _ in report.inputs] == [
        "x (cast to fp16 by amp_fx)",
        "up.weight (cast to fp16 by amp_fx)",
        "up.bias (cast to fp16 by amp_fx)",
    ]
    text = str(report)
    assert "module `up`" in text and 'Policy(keep_fp32=("up",))' in text


def test_forward_overflow_gone_in_bf16_and_with_the_fix():
    model, x = seeded(Overflowing, 3, 4)
    assert not amp_fx.find_nonfinite(model, x, dtype="bf16").found
    fixed = amp_fx.find_nonfinite(model, x, dtype="fp16", policy=amp_fx.Policy(keep_fp32=("up",)))
    assert not fixed.found


def test_top_level_op_gets_an_op_policy():
    model, x = seeded(ExpOverflow, 2, 4)
    assert torch.isinf(torch.exp(model.fc(x).half())).any()  # e^(>11.1) > 65504
    report = amp_fx.find_nonfinite(model, x, dtype="fp16")
    assert report.found and report.op == "aten.exp" and report.module_path == ""
    assert report.suggestion_code == 'Policy(op_classes={"aten::exp": CastClass.FP32})'
    assert report.verified is True


def test_backward_overflow():
    model, x = seeded(GradOverflow, 3, 4)
    report = amp_fx.find_nonfinite(model, x, dtype="fp16")
    assert report.found and report.phase == "backward"
    assert (report.op, report.module_path) == ("aten.linear", "fc")
    assert report.dtype_found is torch.float16
    assert report.verified is True
    assert not amp_fx.find_nonfinite(model, x, dtype="fp16", backward=False).found


def test_loss_scale_makes_a_healthy_backward_overflow():
    model, x = seeded(TwoLayer, 3, 4)
    assert not amp_fx.find_nonfinite(model, x, dtype="fp16").found
    report = amp_fx.find_nonfinite(model, x, dtype="fp16", loss_scale=1e9, verify=False)
    assert report.found and report.phase == "backward"


def test_nan_input_is_reported_as_input():
    model, x = seeded(TwoLayer, 3, 4)
    x[1, 2] = float("nan")
    report = amp_fx.find_nonfinite(model, x, dtype="fp16", verify=False)
    assert report.found and report.op == "input" and "`x`" in report.reason


@pytest.mark.parametrize("name", ["mlp", "cnn_bn", "sdpa_block", "graph_break"])
def test_healthy_zoo_reports_nothing(name):
    model, inputs, loss_fn = ZOO[name].build()
    report = amp_fx.find_nonfinite(model, *inputs, dtype="fp16", loss_fn=loss_fn)
    assert not report.found, str(report)
    assert "no inf/NaN found" in str(report)


def test_user_model_untouched():
    model, x = seeded(BNNet, 2, 2, 4, 4)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    amp_fx.find_nonfinite(model, x)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())


def test_keyword_call_form():
    """find_nonfinite takes model(input_ids=..., labels=...) as HF models are called."""
    torch.manual_seed(0)
    model, batch = KeywordLM(), keyword_batch()
    with torch.no_grad():
        model.fc.weight.mul_(1e5)  # fc's output exceeds fp16's max; the LayerNorm after it does not
    # the planted overflow, checked here in plain fp16
    h = model.embed(batch["input_ids"]).half()
    assert torch.isinf(F.linear(h, model.fc.weight.half(), model.fc.bias.half())).any()
    report = amp_fx.find_nonfinite(model, dtype="fp16", loss_fn=lambda o: o["loss"], **batch)
    assert report.found and report.phase == "forward"
    assert (report.op, report.module_path) == ("aten.linear", "fc")
    assert report.verified is True
    assert not amp_fx.find_nonfinite(
        model, dtype="fp16", policy=report.suggested_policy, loss_fn=lambda o: o["loss"], **batch
    ).found


def test_fix_is_cumulative_with_what_the_user_kept():
    seq, x = chain_overflow(), torch.randn(3, 4, generator=torch.Generator().manual_seed(1))
    kept_0 = amp_fx.Policy(keep_fp32=("0",))
    report = amp_fx.find_nonfinite(seq, x, dtype="fp16", policy=kept_0)
    assert report.found and report.module_path == "1"
    assert report.suggestion_code == 'Policy(keep_fp32=("0", "1"))'
    assert report.suggested_policy.keep_fp32 == ("0", "1") and report.verified is True
    # the planted dependency, checked here: `1` alone still overflows at `0`
    alone = amp_fx.find_nonfinite(seq, x, dtype="fp16", policy=amp_fx.Policy(keep_fp32=("1",)), verify=False)
    assert alone.found and alone.module_path == "0"


@pytest.mark.parametrize(
    "build, expected",
    [
        (NestedOverflow, ("block",)),  # `block.0` is not enough; `block` encloses it and `block.1`
        (chain_overflow, ("0", "1")),  # `0` and `1` share only the root: both are listed
    ],
)
def test_one_module_not_enough_prefers_the_enclosing_module(build, expected):
    model, x = build(), torch.randn(3, 4, generator=torch.Generator().manual_seed(1))
    report = amp_fx.find_nonfinite(model, x, dtype="fp16")
    assert report.found and report.verified is True
    assert report.suggested_policy.keep_fp32 == expected
    assert "alone is not enough" in report.verification
    assert not amp_fx.find_nonfinite(model, x, dtype="fp16", policy=report.suggested_policy).found


def test_names_are_the_root_modules():
    """nn.Sequential: the inputs are `input` (its forward's argument) and `0.weight`, as in
    model.named_parameters(), not Dynamo's L['args'][0] / L['fn']._modules['0']..."""
    seq, x = chain_overflow(), torch.randn(3, 4, generator=torch.Generator().manual_seed(1))
    report = amp_fx.find_nonfinite(seq, x, dtype="fp16", verify=False)
    import inspect

    arg = next(iter(inspect.signature(seq.forward).parameters))
    expected = [arg] + [n for n, _ in seq[0].named_parameters(prefix="0")]
    assert [name.split(" ")[0] for name, _ in report.inputs] == expected
    assert "L[" not in str(report)


def test_backward_asked_but_not_checked_is_said(monkeypatch):
    """backward=True on a model whose output does not require grad: said once, an error in
    strict mode."""
    monkeypatch.delenv("AMP_FX_STRICT", raising=False)
    model, x = seeded(TwoLayer, 3, 4)

    def no_grad_loss(out):
        return out.detach().float().sum()

    with pytest.warns(amp_fx.AmpFxWarning, match="backward=True, but the backward was not checked"):
        report = amp_fx.find_nonfinite(model, x, dtype="fp16", loss_fn=no_grad_loss)
    assert not report.found and "every gradient" not in str(report)
    monkeypatch.setenv("AMP_FX_STRICT", "1")
    with pytest.raises(amp_fx.AmpFxError, match="backward was not checked"):
        amp_fx.find_nonfinite(model, x, dtype="fp16", loss_fn=no_grad_loss)
    # negative twin: backward=False asks for nothing more
    assert not amp_fx.find_nonfinite(model, x, dtype="fp16", backward=False).found


def test_graph_break_inside_a_submodule_names_modules_under_the_root():
    """Dynamo compiles model.forward as its own frame after the break; the report names `model.a`
    and the fix `model` (modules of the model passed, which amp_fx.compile accepts). `model.a`
    alone is not enough: its fp32 output still overflows at the fp16 cast into `model.head`, which
    the verification sees now that keep_fp32 names resolve in that frame (issue 8, item 1)."""
    torch.manual_seed(0)
    model, x = BreakInside(), torch.randn(2, 8, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        model.model.a.weight.mul_(1e5)
    assert torch.isinf(model.model.a(x).half()).any()  # the planted overflow, checked here
    report = amp_fx.find_nonfinite(model, x, dtype="fp16")
    assert (report.module_path, report.module_type) == ("model.a", "Linear")
    assert report.suggested_policy.keep_fp32 == ("model",)
    assert report.verified and "`model.a` alone is not enough" in report.verification
    assert dict(model.named_modules())["model"] is model.model


@pytest.mark.parametrize("case", SPLIT_CASES)
def test_names_the_weights_a_graph_break_splits(case):
    """The backward checked is amp_fx's, where a weight cast in two graphs sums its gradient in
    fp32 (eager autocast: in fp16); the report names those weights, as the backend reports them
    for the model compiled on its own, and none where every weight is on one side of the break."""
    model, inputs = split_case(case)
    expected = split_weights_reported(model, *inputs, dtype="fp16")
    assert bool(expected) == (case != "graph_break_branch")
    report = amp_fx.find_nonfinite(model, *inputs, dtype="fp16")
    assert not report.found
    assert split_weights_noted(report.notes) == expected
    for name in expected:
        assert f"note: {name} is used in graphs 0, 1" in str(report)


def _eager_autocast_finite(model, x):
    """The reference: whether eager fp16 autocast's output and every gradient are finite."""
    import copy

    ref = copy.deepcopy(model)
    with torch.autocast("cpu", dtype=torch.float16):
        out = ref(x)
    if not torch.isfinite(out).all():
        return False
    out.float().sum().backward()
    return all(torch.isfinite(p.grad).all() for p in ref.parameters() if p.grad is not None)


@pytest.mark.parametrize("between", [None, "break", "eager"])
def test_inf_every_consumer_discards_is_not_reported(between):
    """T5's relative position buckets in small: log of 0 gives -inf that torch.where discards, so
    eager autocast's output and gradients are finite, and find_nonfinite names nothing (it lists
    the log in `discarded`). Negative twin: the same -inf added to the output unmasked is named at
    the log, with the fp32 check saying it is not a precision problem. With a graph break between
    the log and the where, the -inf crosses graphs and is still traced to the log, as the same
    tensor or as a copy made by eager code between the graphs."""
    torch.manual_seed(0)
    model, x = MaskedLog(between=between), torch.randn(3, 4, generator=torch.Generator().manual_seed(1))
    assert torch.isinf(model.buckets(model.positions)).any()  # the planted -inf, checked here
    assert _eager_autocast_finite(model, x)
    report = amp_fx.find_nonfinite(model, x, dtype="fp16")
    assert not report.found, str(report)
    assert "no inf/NaN found: the model's outputs and every gradient" in str(report)
    assert len(report.discarded) == 1 and "node log (aten.log)" in report.discarded[0]
    assert report.discarded[0].startswith("graph 0,")

    torch.manual_seed(0)
    twin = MaskedLog(reaches=True, between=between)
    assert not _eager_autocast_finite(twin, x)
    report = amp_fx.find_nonfinite(twin, x, dtype="fp16")
    assert report.found and report.phase == "forward"
    assert (report.graph, report.node, report.op, report.module_path) == (0, "log", "aten.log", "buckets")
    assert report.fp32_finite is False and report.discarded == []


def test_discarded_inf_then_real_overflow_names_the_overflow():
    """A discarded -inf first, then fp16 overflow that reaches the output: the overflow is named,
    and its fix verifies although the discarded -inf is still there (it reaches no output)."""
    torch.manual_seed(0)
    model, x = MaskedLog(overflow=True), torch.randn(3, 4, generator=torch.Generator().manual_seed(1))
    assert not _eager_autocast_finite(model, x)
    report = amp_fx.find_nonfinite(model, x, dtype="fp16")
    assert report.found and report.phase == "forward"
    assert (report.op, report.module_path, report.dtype_found) == ("aten.linear", "up.up", torch.float16)
    assert report.fp32_finite is True
    assert report.suggested_policy.keep_fp32 == ("up.up",) and report.verified is True
    assert "no inf/NaN reaches the outputs, the loss or the gradients (1 discarded" in report.verification
    assert len(report.discarded) == 1 and "(aten.log)" in report.discarded[0]
    fixed = amp_fx.find_nonfinite(model, x, dtype="fp16", policy=report.suggested_policy)
    assert not fixed.found and len(fixed.discarded) == 1


class _Box:
    """An output pytree cannot see into."""

    def __init__(self, t):
        self.t = t


class _Boxed(torch.nn.Module):
    def __init__(self, **kw):
        super().__init__()
        self.inner = MaskedLog(**kw)

    def forward(self, x):
        return _Box(self.inner(x))


@pytest.mark.parametrize("backward", [False, True])
def test_output_it_cannot_see_into_hides_nothing(backward):
    """The model returns an object of its own class: without a loss (backward=False) every inf/NaN
    a graph returned is taken to reach the output; with one, the loss decides. The discarded -inf
    stays discarded (no graph returns it); the overflow is named."""
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(1))
    for overflow in (False, True):
        torch.manual_seed(0)
        report = amp_fx.find_nonfinite(
            _Boxed(overflow=overflow),
            x,
            dtype="fp16",
            backward=backward,
            loss_fn=lambda box: box.t.float().sum(),
            verify=False,
        )
        assert report.found is overflow, str(report)
        assert len(report.discarded) == 1 and "(aten.log)" in report.discarded[0]
        if overflow:
            assert (report.op, report.module_path) == ("aten.linear", "inner.up.up")


class _DroppedOverflow(torch.nn.Module):
    """``Overflowing``'s fp16 overflow in ``up``, whose inf the next op drops: ``masked_fill`` of
    the non-finite entries, or a clamp into fp16's range (Hugging Face T5 clamps its fp16 hidden
    states so); ``how=None`` (the twin) lets it reach the output."""

    def __init__(self, how: str | None) -> None:
        super().__init__()
        self.how = how
        self.up = torch.nn.Linear(4, 8)
        self.head = torch.nn.Linear(8, 2)
        with torch.no_grad():
            self.up.weight.mul_(1e5)

    def forward(self, x):
        h = self.up(x)
        if self.how == "masked_fill":
            h = h.masked_fill(~torch.isfinite(h), 0.0)
        elif self.how == "clamp":
            h = torch.clamp(h, -6e4, 6e4)
        return self.head(h / 1e5)


@pytest.mark.parametrize("how", ["masked_fill", "clamp"])
def test_inf_dropped_by_masked_fill_or_clamp_is_not_reported(how):
    """The inf of an fp16 overflow that masked_fill or a clamp drops before anything else reads it
    reaches no output, loss or gradient (checked in eager autocast): find_nonfinite lists `up`'s
    linear as discarded and reports nothing. Twin: without the drop the same inf reaches the output
    and is named at `up`."""
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(1))
    for drop in (how, None):
        torch.manual_seed(0)
        model = _DroppedOverflow(drop)
        with torch.autocast("cpu", dtype=torch.float16):
            assert torch.isinf(model.up(x)).any()  # the planted overflow, checked here
        assert _eager_autocast_finite(model, x) is (drop is not None)
        report = amp_fx.find_nonfinite(model, x, dtype="fp16", verify=False)
        if drop is not None:
            assert not report.found, str(report)
            assert len(report.discarded) == 1 and "(aten.linear) in module `up`" in report.discarded[0]
        else:
            assert report.found and (report.phase, report.op, report.module_path) == ("forward", "aten.linear", "up")
            assert report.discarded == []
