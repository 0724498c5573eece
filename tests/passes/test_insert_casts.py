"""insert_casts: structure of the rewritten graph (each positive case with its negative twin)."""

from __future__ import annotations

import copy

import pytest
import torch

import amp_fx
from amp_fx import CastClass, Policy
from amp_fx.passes import meta

cast = torch.ops.aten._to_copy.default


def _record(model, *args, **kwargs):
    compiled = amp_fx.compile(model, backend="aot_eager", **kwargs)
    out = compiled(*args)
    (records,) = [compiled.amp_fx_records]
    assert len(records) == 1
    return out, records[0]


def _casts_of(record, arg_filter=lambda n: True):
    return [n for n in record.rewritten.graph.nodes if n.target is cast and arg_filter(n)]


class TwoUses(torch.nn.Module):
    """One weight used by two linears, and one activation fed to both."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.relu()
        return self.fc(h) + self.fc(h * 2)


@pytest.mark.parametrize("cache", [True, False])
def test_leaf_weight_cast_is_shared_only_with_the_cast_cache(cache):
    _, rec = _record(TwoUses(), torch.randn(2, 8), policy=Policy(cast_cache=cache))
    weight_casts = _casts_of(rec, lambda n: n.args[0].op == "placeholder" and n.meta["val"].dim() == 2)
    assert len(weight_casts) == (1 if cache else 2)
    assert rec.inserted.casts_shared == (2 if cache else 0)  # weight and bias, second use


def test_activation_casts_are_per_use():
    # Eager autocast does not cache activations: each linear casts its input itself, and the two
    # casts' gradients add up in fp32. Merging them would add them in bf16.
    _, rec = _record(TwoUses(), torch.randn(2, 8))
    act_casts = _casts_of(rec, lambda n: n.args[0].op != "placeholder")
    assert len(act_casts) == 2


class Mixed(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)
        self.fc64 = torch.nn.Linear(4, 4).double()
        self.emb = torch.nn.Embedding(10, 4)

    def forward(self, x, x64, idx):
        return self.fc(x + self.emb(idx)).float().sum() + self.fc64(x64).sum()


def test_float64_and_integer_tensors_are_never_cast():
    x, x64, idx = torch.randn(3, 4), torch.randn(3, 4, dtype=torch.float64), torch.tensor([1, 2, 3])
    model = Mixed()
    with torch.autocast("cpu", torch.bfloat16):
        ref = copy.deepcopy(model)(x, x64, idx)
    out, rec = _record(model, x, x64, idx)
    for n in _casts_of(rec):
        assert n.args[0].meta["val"].dtype not in (torch.float64, torch.int64)
    assert out.dtype == ref.dtype == torch.float64
    torch.testing.assert_close(out, ref, atol=0, rtol=0)


class Kept(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Linear(8, 8)
        self.norm = torch.nn.LayerNorm(8)
        self.lm_head = torch.nn.Linear(8, 4)

    def forward(self, x):
        return self.lm_head(self.norm(self.body(x)))


@pytest.mark.parametrize("keep", [("lm_head",), (torch.nn.Linear,)])
def test_keep_fp32_runs_the_kept_module_in_fp32(keep):
    out, rec = _record(Kept(), torch.randn(2, 8), policy=Policy(keep_fp32=keep))
    linears = [n for n in rec.rewritten.graph.nodes if n.target is torch.ops.aten.linear.default]
    head = linears[-1]
    assert all(a.meta["val"].dtype == torch.float32 for a in head.all_input_nodes)
    assert "kept by policy" in head.meta[meta.DECISION].reason
    assert out.dtype == torch.float32
    # Body: bf16 unless the whole type is kept.
    body_dtype = linears[0].meta["val"].dtype
    assert body_dtype == (torch.float32 if keep == (torch.nn.Linear,) else torch.bfloat16)


def test_without_keep_fp32_the_head_is_lower_precision():
    out, rec = _record(Kept(), torch.randn(2, 8))
    assert out.dtype == torch.bfloat16
    assert not rec.inserted.autocast_mismatches


def test_policy_moves_an_op_and_it_is_no_longer_decomposed():
    # On CPU, layer_norm is not in autocast's table: it decomposes and runs in its input dtype.
    _, default = _record(Kept(), torch.randn(2, 8))
    torch._dynamo.reset()
    _, moved = _record(Kept(), torch.randn(2, 8), policy=Policy(op_classes={"aten.layer_norm": CastClass.FP32}))
    targets = lambda r: {n.target for n in r.rewritten.graph.nodes}  # noqa: E731
    assert torch.ops.aten.layer_norm.default not in targets(default)
    assert torch.ops.aten.layer_norm.default in targets(moved)
    ln = next(n for n in moved.rewritten.graph.nodes if n.target is torch.ops.aten.layer_norm.default)
    assert ln.meta["val"].dtype == torch.float32
    assert "moved by policy" in ln.meta[meta.DECISION].reason


def test_user_casts_stay_where_they_are():
    class Upcast(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = torch.nn.Linear(4, 4)

        def forward(self, x):
            return self.fc(x).float().exp()  # exp on CPU is not autocast: runs in fp32 by the user's cast

    model = Upcast()
    x = torch.randn(2, 4)
    with torch.autocast("cpu", torch.bfloat16):
        ref = copy.deepcopy(model)(x)
    out, rec = _record(model, x)
    assert out.dtype == ref.dtype == torch.float32
    torch.testing.assert_close(out, ref, atol=0, rtol=0)
    user = [n for n in _casts_of(rec) if n.meta.get(meta.CAST) != meta.CAST_INSERTED]
    assert len(user) == 1 and user[0].meta["val"].dtype == torch.float32


def test_banned_op_raises_a_clear_error():
    policy = Policy(op_classes={"aten.binary_cross_entropy": CastClass.BANNED})
    fn = amp_fx.compile(lambda p, t: torch.nn.functional.binary_cross_entropy(p, t), backend="aot_eager", policy=policy)
    with pytest.raises(amp_fx.AmpFxError, match="binary_cross_entropy_with_logits"):
        fn(torch.rand(4), torch.rand(4))


def test_set_opt_dtype_sets_float32_on_cuda_softmax_only_when_unset():
    # On CUDA, softmax is FP32_SET_OPT_DTYPE; checked on fake CUDA tensors (no GPU needed).
    from torch._subclasses.fake_tensor import FakeTensorMode

    from amp_fx.passes.capture import capture
    from amp_fx.passes.insert_casts import insert_casts

    for given, expected in [(None, torch.float32), (torch.float16, torch.float16)]:
        with FakeTensorMode() as mode:
            x = torch.empty(4, 4, device="cuda", dtype=torch.float16)
            gm = capture(
                lambda t: torch.softmax(t, -1, dtype=given),
                [x],
                policy=Policy(),
                device_type="cuda",
                dtype=torch.float16,
                leaf_flags=[False],
            )
            insert_casts(gm, policy=Policy(), device_type="cuda", dtype=torch.float16, fake_mode=mode)
            out = gm(x)
        assert out.dtype == expected
