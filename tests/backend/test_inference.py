"""Inference (eval, no_grad / inference_mode) against eager autocast, and against torch.compile."""

from __future__ import annotations

import copy

import pytest
import torch

import amp_fx
from amp_fx.testing.zoo import ZOO


@pytest.mark.parametrize("name", ["mlp", "cnn_bn", "rmsnorm", "classifier_loss"])
@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_eval_inference_is_bitwise(name, mode):
    model, inputs, _ = ZOO[name].build()
    model.eval()
    guard = torch.no_grad if mode == "no_grad" else torch.inference_mode
    with guard(), torch.autocast("cpu", torch.bfloat16):
        ref = copy.deepcopy(model)(*inputs)
    compiled = amp_fx.compile(model, dtype="bf16", backend="aot_eager")
    with guard():
        out = compiled(*inputs)
    torch.testing.assert_close(out, ref, atol=0, rtol=0)


def test_mha_fast_path_matches_torch_compile_not_eager():
    # Eager nn.MultiheadAttention takes its fused fast path in eval + no_grad; Dynamo does not.
    # amp_fx must equal torch.compile under autocast there (docs/parity.md, Known differences).
    model, inputs, _ = ZOO["mha_block"].build()
    model.eval()
    baseline = torch.compile(copy.deepcopy(model), backend="aot_eager")
    with torch.no_grad(), torch.autocast("cpu", torch.bfloat16):
        expected = baseline(*inputs)
    compiled = amp_fx.compile(model, dtype="bf16", backend="aot_eager")
    with torch.no_grad():
        out = compiled(*inputs)
    torch.testing.assert_close(out, expected, atol=0, rtol=0)
