"""The public surface of amp_fx.compile: state sharing, modes, functions, arguments, policies."""

from __future__ import annotations

import copy
from collections.abc import Iterator

import pytest
import torch
import torch._dynamo
import torch.nn.functional as F
from torch import Tensor, nn

import amp_fx
from amp_fx import CastClass, Policy
from amp_fx.passes import meta
from amp_fx.testing.zoo import MLP, ZOO, eager_autocast_step, step

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
BACKEND = "aot_eager"  # the bitwise rung of the ladder, and the fastest one that traces to ATen


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> Iterator[None]:
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


# --- state sharing ----------------------------------------------------------------------------


def test_shares_parameters_buffers_and_state_dict_keys() -> None:
    model, inputs, _ = ZOO["cnn_bn"].build()
    compiled = amp_fx.compile(model, dtype="bf16", backend=BACKEND)
    params, cparams = dict(model.named_parameters()), dict(compiled.named_parameters())
    assert params.keys() == cparams.keys()
    assert all(cparams[n] is p for n, p in params.items())
    buffers, cbuffers = dict(model.named_buffers()), dict(compiled.named_buffers())
    assert buffers.keys() == cbuffers.keys() and any("running_mean" in n for n in buffers)
    assert all(cbuffers[n] is b for n, b in buffers.items())
    assert list(compiled.state_dict()) == list(model.state_dict())
    # Running the compiled module updates the original's BatchNorm statistics in place.
    before = model.bn1.running_mean.clone()
    compiled(*inputs)
    assert not torch.equal(model.bn1.running_mean, before)
    assert compiled.original_module is model


def _other_weights() -> dict[str, Tensor]:
    torch.manual_seed(1234)
    return {k: v.clone() for k, v in MLP().state_dict().items()}


def test_state_dict_loads_both_ways_and_the_compiled_graph_sees_it() -> None:
    model, inputs, loss_fn = ZOO["mlp"].build()
    compiled = amp_fx.compile(model, dtype="bf16", backend=BACKEND)
    compiled(*inputs)  # compile first: loading must not need a recompile to take effect
    other = _other_weights()
    assert not torch.equal(other["fc1.weight"], model.fc1.weight)

    compiled.load_state_dict(other)  # into the compiled module ...
    for k, v in other.items():
        # ... lands in the original
        torch.testing.assert_close(model.state_dict()[k], v, atol=0, rtol=0)
    reference = MLP()
    reference.load_state_dict(other)
    expected = eager_autocast_step(reference, inputs, loss_fn, torch.bfloat16)
    actual = step(compiled, model, inputs, loss_fn)
    torch.testing.assert_close(actual.out, expected.out, atol=0, rtol=0)

    fresh = MLP()
    fresh.load_state_dict(compiled.state_dict())  # and the compiled module's state loads elsewhere
    for k, v in fresh.state_dict().items():
        torch.testing.assert_close(v, other[k], atol=0, rtol=0)


def test_train_eval_propagate_to_the_original_and_recompile() -> None:
    """eval() on the compiled module switches the original (BatchNorm uses running stats, which
    then stay put) and the next call matches eager autocast in eval mode."""
    model, inputs, loss_fn = ZOO["cnn_bn"].build()
    reference = copy.deepcopy(model)
    compiled = amp_fx.compile(model, dtype="bf16", backend=BACKEND)
    step(compiled, model, inputs, loss_fn)
    eager_autocast_step(reference, inputs, loss_fn, torch.bfloat16)

    assert compiled.eval() is compiled
    assert not model.training and not compiled.training
    assert all(not m.training for m in model.modules())
    stats = model.bn1.running_mean.clone()
    reference.eval()
    with torch.no_grad():
        out = compiled(*inputs)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            expected = reference(*inputs)
    torch.testing.assert_close(out, expected, atol=0, rtol=0)
    torch.testing.assert_close(model.bn1.running_mean, stats, atol=0, rtol=0)

    compiled.train()
    assert model.training and all(m.training for m in model.modules())
    assert len(compiled.amp_fx_records) == 2  # one graph per mode: BatchNorm's branch differs


# --- functions --------------------------------------------------------------------------------


def test_plain_function() -> None:
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(8, 16, generator=gen, requires_grad=True)
    w_ref = w.detach().clone().requires_grad_()
    x = torch.randn(4, 16, generator=gen)

    def fn(x: Tensor, w: Tensor) -> Tensor:
        return F.softmax(F.linear(x, w).relu(), dim=-1).sum(0)

    compiled = amp_fx.compile(fn, dtype="bf16", backend=BACKEND)
    out = compiled(x, w)
    out.float().pow(2).sum().backward()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = fn(x, w_ref)
    expected.float().pow(2).sum().backward()
    torch.testing.assert_close(out, expected, atol=0, rtol=0)
    torch.testing.assert_close(w.grad, w_ref.grad, atol=0, rtol=0)
    assert amp_fx.records(compiled) is compiled.amp_fx_records
    assert len(compiled.amp_fx_records) == 1 and compiled.amp_fx_records[0].casts > 0


# --- arguments --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "alias, expected",
    [
        ("bf16", torch.bfloat16),
        ("bfloat16", torch.bfloat16),
        (torch.bfloat16, torch.bfloat16),
        ("fp16", torch.float16),
        ("float16", torch.float16),
        (torch.float16, torch.float16),
    ],
    ids=lambda v: str(v).replace("torch.", ""),
)
def test_dtype_aliases(alias: object, expected: torch.dtype) -> None:
    model = nn.Linear(8, 4)
    x = torch.randn(2, 8, generator=torch.Generator().manual_seed(0))
    compiled = amp_fx.compile(model, dtype=alias, backend=BACKEND)
    out = compiled(x)
    assert out.dtype == expected
    assert compiled.amp_fx_records[0].dtype == expected


@pytest.mark.parametrize("bad", ["fp8", torch.float32, 3], ids=repr)
def test_unknown_dtype_raises_naming_accepted_values(bad: object) -> None:
    with pytest.raises(ValueError) as info:
        amp_fx.compile(nn.Linear(4, 4), dtype=bad, backend=BACKEND)
    msg = str(info.value)
    assert repr(bad) in msg
    accepted_values = ('"bf16"', '"bfloat16"', '"fp16"', '"float16"', "torch.bfloat16", "torch.float16")
    for accepted in accepted_values:
        assert accepted in msg, (accepted, msg)


@pytest.mark.parametrize("bad", [3, "model", None], ids=repr)
def test_non_callable_raises_type_error(bad: object) -> None:
    with pytest.raises(TypeError, match="callable"):
        amp_fx.compile(bad, dtype="bf16", backend=BACKEND)


# --- policies ---------------------------------------------------------------------------------


def test_two_policies_on_one_model_never_share_a_graph() -> None:
    """Policy() and Policy(keep_fp32=("fc3",)) on the *same* model object: each compiled module
    keeps its own graphs, records and output dtype, however the calls interleave."""
    model, inputs, _ = ZOO["mlp"].build()
    default = amp_fx.compile(model, dtype="bf16", policy=Policy(), backend=BACKEND)
    kept = amp_fx.compile(model, dtype="bf16", policy=Policy(keep_fp32=("fc3",)), backend=BACKEND)
    outs = [default(*inputs), kept(*inputs), default(*inputs), kept(*inputs)]
    assert [o.dtype for o in outs] == [torch.bfloat16, torch.float32] * 2
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = model(*inputs)
    torch.testing.assert_close(outs[0], expected, atol=0, rtol=0)
    torch.testing.assert_close(outs[2], expected, atol=0, rtol=0)
    assert default.amp_fx_records is not kept.amp_fx_records
    assert len(default.amp_fx_records) == 1 and len(kept.amp_fx_records) == 1
    r_default, r_kept = default.amp_fx_records[0], kept.amp_fx_records[0]
    assert r_default.rewritten is not r_kept.rewritten
    assert r_kept.casts < r_default.casts  # fc3's weight, bias and input are not cast down
    reasons = {str(n.meta.get(meta.DECISION)) for n in r_kept.rewritten.graph.nodes}
    assert any("fc3" in r for r in reasons), reasons


def test_keep_fp32_unknown_module_raises_naming_it() -> None:
    with pytest.raises(ValueError, match="nonexistent"):
        amp_fx.compile(MLP(), dtype="bf16", policy=Policy(keep_fp32=("nonexistent",)), backend=BACKEND)


@pytest.mark.parametrize("op", ["aten.not_an_op", "aten::linear.not_an_overload"])
def test_policy_unknown_op_raises(op: str) -> None:
    with pytest.raises(ValueError, match="not_an_"):
        Policy(op_classes={op: CastClass.FP32})


# --- dtypes of parameters and gradients --------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_parameters_and_grads_stay_fp32(dtype: torch.dtype) -> None:
    model, inputs, loss_fn = ZOO["sdpa_block"].build()
    compiled = amp_fx.compile(model, dtype=dtype, backend=BACKEND)
    out = compiled(*inputs)
    loss_fn(out).backward()
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in model.parameters())
    # ...while the matmuls ran in the low dtype: the rewritten graph casts weights down.
    record = compiled.amp_fx_records[0]
    low = [
        n
        for n in record.rewritten.graph.nodes
        if n.target is torch.ops.aten._to_copy.default and n.kwargs.get("dtype") == dtype
    ]
    assert low


class _BCEModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 4)

    def forward(self, x: Tensor, target: Tensor) -> Tensor:
        return F.binary_cross_entropy(torch.sigmoid(self.fc(x)), target)


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_binary_cross_entropy_runs_in_fp32_as_on_cpu_eager(dtype: torch.dtype) -> None:
    """binary_cross_entropy is in the *CPU* fp32 table (it is banned only on CUDA): eager casts
    its low-precision input up and returns fp32; amp_fx must match dtype, value and gradient."""
    torch.manual_seed(0)
    model = _BCEModel()
    reference = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(4, 8, generator=gen)
    target = torch.rand(4, 4, generator=gen)
    expected = eager_autocast_step(reference, (x, target), lambda o: o, dtype)
    assert expected.out.dtype == torch.float32
    compiled = amp_fx.compile(model, dtype=dtype, backend=BACKEND)
    actual = step(compiled, model, (x, target), lambda o: o)
    torch.testing.assert_close(actual.out, expected.out, atol=0, rtol=0)
    for n, g in expected.grads.items():
        torch.testing.assert_close(actual.grads[n], g, atol=0, rtol=0)
    graph = compiled.amp_fx_records[0].rewritten.graph
    decisions = [
        n.meta.get(meta.DECISION) for n in graph.nodes if n.target is torch.ops.aten.binary_cross_entropy.default
    ]
    assert [d.cast_class for d in decisions] == [CastClass.FP32]


# --- a banned op names itself and the policy entry (issue 8, item 11) ---------------------------


def test_user_banned_op_names_the_op_and_the_policy_entry() -> None:
    model = MLP()
    policy = Policy(op_classes={"aten.linear": CastClass.BANNED})
    compiled = amp_fx.compile(model, backend=BACKEND, policy=policy)
    with pytest.raises(amp_fx.AmpFxError) as info:
        compiled(torch.randn(2, 16))
    message = str(info.value)
    assert "aten.linear is banned by your policy" in message
    assert "Policy(op_classes={'aten.linear': CastClass.BANNED})" in message
    assert "binary_cross_entropy" not in message


def test_torch_banned_op_keeps_the_bce_advice() -> None:
    from amp_fx.policy import banned_message

    message = banned_message("aten::binary_cross_entropy", Policy(), "cuda")
    assert "binary_cross_entropy_with_logits" in message and "cuda" in message


# --- backend validated at compile() (item 12) -------------------------------------------------


@pytest.mark.parametrize(
    "bad, error, match",
    [
        (3, TypeError, r"backend must be .* got 3 \(int\)"),
        (None, TypeError, r"backend must be .* got None"),
        ("not_a_backend", ValueError, r"unknown backend 'not_a_backend'.*aot_eager"),
    ],
)
def test_bad_backend_raises_at_compile(bad: object, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        amp_fx.compile(MLP(), backend=bad)  # type: ignore[arg-type]


# --- copy.deepcopy, pickle, torch.save (item 13) ----------------------------------------------


def _pickle_copy(obj: object) -> object:
    import pickle

    return pickle.loads(pickle.dumps(obj))


def _torch_save_copy(obj: object) -> object:
    import io

    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


_COPIES = {"deepcopy": copy.deepcopy, "pickle": _pickle_copy, "torch_save": _torch_save_copy}


@pytest.mark.parametrize("how", sorted(_COPIES))
def test_policy_copies_equal(how: str) -> None:
    policy = Policy(
        op_classes={
            torch.ops.aten.linear.default: CastClass.FP32,
            torch.ops.aten.layer_norm: CastClass.FP32,
            "aten.conv2d": CastClass.LOWER_PRECISION_FP,
        },
        keep_fp32=("fc1", nn.LayerNorm),
        cast_cache=False,
    )
    copied = _COPIES[how](policy)
    assert copied == policy and hash(copied) == hash(policy)
    assert copied.op_entries == policy.op_entries


@pytest.mark.parametrize("how", sorted(_COPIES))
def test_compiled_module_copies_compute_the_same_and_are_independent(how: str) -> None:
    model, inputs, loss_fn = ZOO["mlp"].build()
    policy = Policy(keep_fp32=("fc3",))
    compiled = amp_fx.compile(model, dtype="fp16", backend=BACKEND, policy=policy)
    compiled(*inputs)  # copies after the first call too (compiled state is not copied)
    copied = _COPIES[how](compiled)
    assert isinstance(copied, amp_fx.AmpCompiledModule)
    assert copied.amp_fx_records == [] and amp_fx.options_of(copied).policy == policy
    assert amp_fx.options_of(copied).dtype == torch.float16
    for (name, p), (_, q) in zip(compiled.named_parameters(), copied.named_parameters()):
        assert p is not q and p.data_ptr() != q.data_ptr(), name
        torch.testing.assert_close(p, q, atol=0, rtol=0)
    expected = step(compiled, model, inputs, loss_fn)
    actual = step(copied, copied.original_module, inputs, loss_fn)
    torch.testing.assert_close(actual.out, expected.out, atol=0, rtol=0)
    assert actual.out.dtype == torch.float32  # fc3 kept in fp32 in the copy too
    for name, g in expected.grads.items():
        torch.testing.assert_close(actual.grads[name], g, atol=0, rtol=0, msg=name)
    # Independent: changing the copy leaves the original alone.
    with torch.no_grad():
        copied.original_module.fc1.weight.add_(1.0)
    assert not torch.equal(copied.original_module.fc1.weight, model.fc1.weight)
    assert copied.amp_fx_records and copied._amp_fx_backend is not compiled._amp_fx_backend
