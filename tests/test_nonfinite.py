"""amp_fx.find_nonfinite names the planted overflow, forward and backward, and nothing on a
healthy model."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import amp_fx
from amp_fx.testing.zoo import ZOO
from tests._inspect_models import BNNet, ExpOverflow, GradOverflow, Overflowing, TwoLayer, seeded


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
        "x (cast to fp16 by amp_fx)", "up.weight (cast to fp16 by amp_fx)",
        "up.bias (cast to fp16 by amp_fx)"]
    text = str(report)
    assert "module `up`" in text and "Policy(keep_fp32=(\"up\",))" in text


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
