"""fold_casts: each rule fires where it is exact and nowhere else; folding never changes a value."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import amp_fx
from amp_fx.passes.fold_casts import RULES, covers, fold_casts

cast = torch.ops.aten._to_copy.default
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


def _all_values(dtype: torch.dtype) -> torch.Tensor:
    """Every finite value of a 16-bit float dtype, from its bit patterns."""
    bits = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    vals = bits.view(dtype)
    return vals[torch.isfinite(vals)]


@pytest.mark.parametrize(
    "narrow,wide", [(BF16, FP32), (FP16, FP32), (BF16, FP16), (FP16, BF16), (BF16, torch.float64), (FP32, BF16)]
)
def test_covers_matches_exhaustive_round_trip(narrow, wide):
    # The predicate must agree with brute force: covers(wide, narrow) iff every value survives
    # narrow -> wide -> narrow. FP32 has too many values to enumerate; it is never covered by a
    # 16-bit type, which a single rounding witness (1 + 2^-20) proves.
    vals = _all_values(narrow) if narrow.itemsize == 2 else torch.tensor([1 + 2**-20], dtype=FP32)
    exact = bool(torch.equal(vals.to(wide).to(narrow), vals))
    assert covers(wide, narrow) == exact


def _count_casts(gm: torch.fx.GraphModule) -> int:
    return sum(1 for n in gm.graph.nodes if n.target is cast)


def _trace(fn, *args):
    return make_fx(fn)(*args)


def _fold_and_check(fn, *args, rule: str, fires: bool):
    gm = _trace(fn, *args)
    reference = copy.deepcopy(gm)
    before = _count_casts(gm)
    gm, record = fold_casts(gm)
    assert (record.by_rule[rule] > 0) == fires, record.by_rule
    assert (_count_casts(gm) < before) == fires
    # Values and gradients are bitwise those of the unfolded graph.
    leaves = [a.detach().clone().requires_grad_(a.is_floating_point()) for a in args]
    leaves_ref = [a.detach().clone().requires_grad_(a.is_floating_point()) for a in args]
    out, ref = gm(*leaves), reference(*leaves_ref)
    torch.testing.assert_close(out, ref, atol=0, rtol=0)
    out.float().sum().backward()
    ref.float().sum().backward()
    for a, b in zip(leaves, leaves_ref):
        if a.grad is not None:
            torch.testing.assert_close(a.grad, b.grad, atol=0, rtol=0)


x32 = torch.randn(6) * 3
xb = x32.to(BF16)


def test_noop_cast_fires_on_same_dtype_copy():
    _fold_and_check(lambda x: cast(x * 2, dtype=FP32) + 1, x32, rule="noop_cast", fires=True)


def test_noop_cast_keeps_copy_of_graph_input():
    # Folding would make the op read the caller's tensor directly: harmless for the value, but
    # the rule is deliberately conservative about inputs and outputs (aliasing).
    _fold_and_check(lambda x: cast(x, dtype=FP32) + 1, x32, rule="noop_cast", fires=False)


def test_exact_round_trip_fires_for_bf16_through_fp32():
    _fold_and_check(lambda x: cast(cast(x * 2, dtype=FP32), dtype=BF16) + 1, xb, rule="exact_round_trip", fires=True)


def test_exact_round_trip_never_folds_fp32_through_bf16():
    # fp32 -> bf16 -> fp32 rounds: 1 + 2^-20 becomes 1.
    _fold_and_check(lambda x: cast(cast(x * 2, dtype=BF16), dtype=FP32) + 1, x32, rule="exact_round_trip", fires=False)


def test_exact_round_trip_keeps_middle_cast_with_other_users():
    # Bypassing the fp32 middle would make this branch's gradient add up with the other
    # user's in bf16 instead of fp32.
    def f(x):
        mid = cast(x * 2, dtype=FP32)
        return cast(mid, dtype=BF16).float() + mid.exp()

    _fold_and_check(f, xb, rule="exact_round_trip", fires=False)


def test_widen_then_cast_fires_for_bf16_fp32_fp16():
    _fold_and_check(lambda x: cast(cast(x * 2, dtype=FP32), dtype=FP16) + 1, xb, rule="widen_then_cast", fires=True)


def test_widen_then_cast_never_skips_a_rounding_step():
    # fp32 -> bf16 rounds, then bf16 -> fp16 rounds again: not the same as fp32 -> fp16.
    _fold_and_check(lambda x: cast(cast(x * 2, dtype=BF16), dtype=FP16) + 1, x32, rule="widen_then_cast", fires=False)


def test_every_rule_has_a_test_pair():
    tested = {"noop_cast", "exact_round_trip", "widen_then_cast"}
    assert set(RULES) == tested


class _UpcastingBlock(torch.nn.Module):
    """Llama-style code: the user upcasts to fp32 around an op and the next linear casts back."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(8, 8)
        self.fc2 = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x).float()  # bf16 -> fp32, and the only use of it is fc2's cast to bf16
        return self.fc2(h).relu()


@pytest.mark.parametrize("dtype", [BF16, FP16])
def test_folding_removes_casts_in_a_model_and_keeps_parity(dtype):
    torch.manual_seed(0)
    model = _UpcastingBlock()
    x = torch.randn(4, 8)
    eager = copy.deepcopy(model)
    with torch.autocast("cpu", dtype):
        ref = eager(x)
    ref.float().sum().backward()

    results = {}
    for fold in (False, True):
        torch._dynamo.reset()
        m = copy.deepcopy(model)
        compiled = amp_fx.compile(m, dtype=dtype, backend="aot_eager", fold=fold)
        out = compiled(x)
        out.float().sum().backward()
        torch.testing.assert_close(out, ref, atol=0, rtol=0)
        for p, q in zip(m.parameters(), eager.parameters()):
            torch.testing.assert_close(p.grad, q.grad, atol=0, rtol=0)
        results[fold] = compiled.amp_fx_records[0]
    assert results[True].folded.by_rule["exact_round_trip"] == 1
    assert results[True].casts == results[False].casts - 2
