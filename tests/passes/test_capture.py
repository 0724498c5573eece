"""capture: what the pre-dispatch graph holds for constructs Dynamo leaves in its graph."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint

import amp_fx
from amp_fx.passes.capture import module_path


def _train_step_against_eager(
    model: nn.Module, x: torch.Tensor, dtype: torch.dtype, backend: str = "aot_eager", tol: float = 0.0
):
    """One forward+backward of eager autocast and of amp_fx on copies of ``model``, from the same
    RNG state; asserts outputs and every gradient equal (bitwise unless ``tol``, a relative and
    absolute tolerance, is given); returns the compiled module."""
    eager, ours = copy.deepcopy(model), copy.deepcopy(model)
    torch.manual_seed(1)
    with torch.autocast("cpu", dtype):
        ref = eager(x)
    ref.float().sum().backward()
    compiled = amp_fx.compile(ours, dtype=dtype, backend=backend)
    torch.manual_seed(1)
    out = compiled(x)
    out.float().sum().backward()
    assert out.dtype == ref.dtype
    torch.testing.assert_close(out, ref, atol=tol, rtol=tol)
    for (name, p), q in zip(ours.named_parameters(), eager.parameters()):
        if q.grad is None:
            assert p.grad is None, name
        else:
            assert p.grad is not None, name
            torch.testing.assert_close(p.grad, q.grad, atol=tol, rtol=tol, msg=name)
    return compiled


class Checkpointed(nn.Module):
    """An activation-checkpointed block and a no_grad region sharing a weight."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = checkpoint(lambda t: self.b(self.a(t).relu()), x, use_reentrant=False)
        with torch.no_grad():
            side = self.a(x).sum()
        return h * 2 + side


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_checkpointed_region_is_cast_and_bitwise(dtype):
    torch.manual_seed(0)
    compiled = _train_step_against_eager(Checkpointed(), torch.randn(4, 8), dtype)
    (record,) = compiled.amp_fx_records
    linears = [n for n in record.rewritten.graph.nodes if n.target is torch.ops.aten.linear.default]
    in_region = [n for n in linears if "recompute" in n.meta]
    # The two linears of the checkpointed block are inlined, cast, and tagged for recomputation;
    # the no_grad linear is not in the region.
    assert len(linears) == 3 and len(in_region) == 2
    assert all(n.meta["recompute"] == CheckpointPolicy.PREFER_RECOMPUTE for n in in_region)
    assert len({n.meta["ac_graph_id"] for n in in_region}) == 1
    assert all(n.args[1].meta["val"].dtype == dtype for n in linears)


@pytest.mark.parametrize(
    "source,path",
    [
        ("L['self'].fc", "fc"),
        ("L['self'].layers[0].attn", "layers.0.attn"),
        ("L['self']._modules['blocks']._modules['1']", "blocks.1"),
        ("getattr(L['self'].layers, '2')", "layers.2"),
        ("L['model'].head", "head"),
        # diffusers' UNet2DModel under torch 2.13 (the real-model tier): through the instance dict
        ("L['self'].__dict__['_modules']['down_blocks'].0.resnets.0.conv1", "down_blocks.0.resnets.0.conv1"),
        ("L['self'].__dict__['_modules']['time_embedding']", "time_embedding"),
    ],
)
def test_module_path_normalises_dynamo_sources(source, path):
    assert module_path(source) == path


class _ScaledMatmul(torch.autograd.Function):
    """A custom Function with an autocast op (mm) in its forward and a hand-written backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        return torch.mm(x, w) * 0.5

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x, w = ctx.saved_tensors  # x may be low precision: the backward computes in fp32
        return torch.mm(grad.float(), w.t()) * 0.5, torch.mm(x.t().float(), grad.float()) * 0.5


class WithFunction(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.w = nn.Parameter(torch.randn(8, 8) / 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _ScaledMatmul.apply(self.a(x), self.w).relu()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_custom_autograd_function_keeps_its_backward_and_is_bitwise(dtype):
    # Pre-dispatch tracing alone records a Function's forward under no_grad and drops its
    # backward: gradients of everything before it would silently be None.
    torch.manual_seed(0)
    _train_step_against_eager(WithFunction(), torch.randn(4, 8), dtype)


class _Fp32MatmulCastInputs(torch.autograd.Function):
    """custom_fwd(cast_inputs=float32): eager casts the inputs to fp32 and turns autocast off for
    the forward, so mm runs in fp32 and the Function returns fp32 under autocast."""

    @staticmethod
    @torch.amp.custom_fwd(device_type="cpu", cast_inputs=torch.float32)
    def forward(ctx, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        return torch.mm(x, w)

    @staticmethod
    @torch.amp.custom_bwd(device_type="cpu")
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x, w = ctx.saved_tensors
        return torch.mm(grad, w.t()), torch.mm(x.t(), grad)


class _MatmulCustomFwd(torch.autograd.Function):
    """custom_fwd without cast_inputs: the forward runs under the caller's autocast (mm in the low
    dtype), and custom_bwd runs the backward under the same autocast state."""

    @staticmethod
    @torch.amp.custom_fwd(device_type="cpu")
    def forward(ctx, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        return torch.mm(x, w)

    @staticmethod
    @torch.amp.custom_bwd(device_type="cpu")
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x, w = ctx.saved_tensors
        return torch.mm(grad, w.t().to(grad.dtype)).to(x.dtype), torch.mm(x.t().to(grad.dtype), grad)


class _Fp32MatmulAutocastOff(torch.autograd.Function):
    """A forward that opens torch.autocast(enabled=False) itself and computes in fp32."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        with torch.autocast("cpu", enabled=False):
            return torch.mm(x.float(), w.float())

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x, w = ctx.saved_tensors
        gx = torch.mm(grad.float(), w.float().t()).to(x.dtype)
        return gx, torch.mm(x.float().t(), grad.float()).to(w.dtype)


_FUNCTIONS = {
    "custom_fwd_cast_inputs": _Fp32MatmulCastInputs,
    "custom_fwd": _MatmulCustomFwd,
    "autocast_off_in_forward": _Fp32MatmulAutocastOff,
}


class WithAutocastFunction(nn.Module):
    """An autocast op before and after the Function: the linear after it must be cast as eager
    casts it, which needs the dtype the Function really returns (fp32 for two of the three)."""

    def __init__(self, fn: type[torch.autograd.Function]) -> None:
        super().__init__()
        self.fn = fn
        self.a = nn.Linear(8, 8)
        self.w = nn.Parameter(torch.randn(8, 8) / 3)
        self.b = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.fn.apply(self.a(x), self.w).relu())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("fn", sorted(_FUNCTIONS))
def test_function_changing_autocast_state_is_bitwise(fn, dtype):
    torch.manual_seed(0)
    compiled = _train_step_against_eager(WithAutocastFunction(_FUNCTIONS[fn]), torch.randn(4, 8), dtype)
    hop = next(
        n
        for r in compiled.amp_fx_records
        for n in r.captured.graph.nodes
        if n.op == "call_function" and n.target.__name__ == "autocast_hop"
    )
    returned = hop.meta["val"][0].dtype
    assert returned == (dtype if fn == "custom_fwd" else torch.float32)


# Inductor fuses the fp32 ops around the Function (relu, the bias add) with the rounding to
# bf16/fp16 and keeps them in fp32 (excess precision), so values differ by up to a few ulps of
# the low dtype: bf16's eps is 2**-7, fp16's 2**-10; 4 eps relative covers a sum of 8 products.
_INDUCTOR_TOL = {torch.bfloat16: 4 * 2.0**-7, torch.float16: 4 * 2.0**-10}


@pytest.mark.slow_cases
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_function_with_cast_inputs_under_inductor(dtype):
    torch.manual_seed(0)
    _train_step_against_eager(
        WithAutocastFunction(_Fp32MatmulCastInputs),
        torch.randn(4, 8),
        dtype,
        backend="inductor",
        tol=_INDUCTOR_TOL[dtype],
    )


class WithCond(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        return torch.cond(h.sum() > 0, lambda t: self.b(t), lambda t: t.exp(), (h,))


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_other_higher_order_ops_run_under_eager_autocast(sign):
    # torch.cond stays whole in the graph; the ops of the branch taken are cast by eager
    # autocast itself, so the result is eager autocast's, backward included.
    torch.manual_seed(0)
    compiled = _train_step_against_eager(WithCond(), torch.randn(4, 8) * sign, torch.bfloat16)
    (record,) = compiled.amp_fx_records
    assert any(n.target is amp_fx.passes.capture.autocast_hop for n in record.rewritten.graph.nodes)


class WithTransform(nn.Module):
    """A linear, a functorch transform that Dynamo inlines into its graph, and a linear. Each
    transform runs an autocast op (a matmul) on batched tensors, so its casts show in the values."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.a = nn.Linear(8, 16)
        self.w = nn.Parameter(torch.randn(16, 16) / 4)
        self.b = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch._higher_order_ops.associative_scan import associative_scan

        h = self.a(x)  # (batch, tokens, 16)
        if self.kind == "associative_scan":
            # As transformers' Mamba scans on CPU: combine_mode="generic" vmaps the combine function.
            # Matrix products are associative: a running product of 4x4 matrices, one per token.
            m = torch.tanh(h).unflatten(-1, (4, 4))
            y = associative_scan(lambda left, right: left @ right, m, dim=1, combine_mode="generic").flatten(-2)
        elif self.kind == "vmap":
            y = torch.vmap(lambda row: row @ self.w)(h)
        else:  # torch.func.grad: a backward inside the forward
            y = torch.func.grad(lambda t: (t @ self.w).float().pow(2).sum())(h)
        return self.b(y)


@pytest.mark.slow_cases
@pytest.mark.parametrize(
    "kind,dtype",
    [
        ("associative_scan", torch.bfloat16),
        ("associative_scan", torch.float16),
        ("vmap", torch.bfloat16),
        ("grad", torch.bfloat16),
    ],
    ids=["associative_scan-bf16", "associative_scan-fp16", "vmap-bf16", "grad-bf16"],
)
def test_functorch_transform_regions_run_under_eager_autocast(kind, dtype):
    # Pre-dispatch tracing records ops above functorch's batching layer: traced as is, the vmap'd
    # ops were recorded on batched tensors held as constants, cut off from the inputs, and
    # AOTAutograd failed on them ("NYI: querying is_contiguous inside of vmap", transformers'
    # Mamba). The region stays whole and runs under eager autocast, backward included.
    torch.manual_seed(0)
    compiled = _train_step_against_eager(WithTransform(kind), torch.randn(2, 6, 8), dtype)
    (record,) = compiled.amp_fx_records
    nodes = list(record.captured.graph.nodes)
    regions = [n for n in nodes if n.target is amp_fx.passes.capture.autocast_region]
    assert regions and not [n for n in nodes if n.op == "get_attr" and "_tensor_constant" in str(n.target)]
    if kind == "vmap":  # the matmul inside was cast by eager autocast: the region returns the low dtype
        assert [n.meta["val"][0].dtype for n in regions] == [dtype]


class WithDropout(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 16)
        self.b = nn.Linear(16, 16)
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.drop(self.a(x)))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_dropout_decomposes_as_eager_does(dtype):
    # torch registers a Python kernel for dropout's CompositeImplicitAutograd key that returns
    # native_dropout's output, whose backward scales by 1/(1-p) in fp32; eager's C++ kernel
    # multiplies by a mask holding 1/(1-p) rounded to bf16/fp16. capture must follow eager.
    torch.manual_seed(0)
    compiled = _train_step_against_eager(WithDropout(), torch.randn(4, 16), dtype)
    # Only native_dropout's mask is used: the gradient flows through eager's multiply by the
    # low-precision noise, not through native_dropout's fp32-scaled backward.
    (record,) = compiled.amp_fx_records
    dropouts = [n for n in record.rewritten.graph.nodes if n.target is torch.ops.aten.native_dropout.default]
    assert len(dropouts) == 1
    assert [u.args[1] for u in dropouts[0].users if u.users] == [1]


class _SplitByBreak(nn.Module):
    def __init__(self, reuse: bool) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.other = nn.Linear(4, 4)
        self.reuse = reuse

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x)
        torch._dynamo.graph_break()
        return (self.fc if self.reuse else self.other)(y)


@pytest.mark.parametrize("reuse", [True, False])
def test_weight_split_by_a_graph_break_is_reported_once(reuse):
    """An AmpFxWarning per split weight, once (a logged warning would be lost to the amp_fx
    logger's NullHandler); recompiles of the same frames are not splits."""
    compiled = amp_fx.compile(_SplitByBreak(reuse), backend="aot_eager", strict=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for batch in (2, 3, 5):
            compiled(torch.randn(batch, 4))
    warned = [str(w.message) for w in caught if issubclass(w.category, amp_fx.AmpFxWarning)]
    if reuse:
        assert sorted(m.split()[1] for m in warned) == ["fc.bias", "fc.weight"]
        assert all("both sides of a graph break" in m for m in warned)
    else:
        assert warned == []


def test_weight_split_by_a_graph_break_is_an_error_in_strict_mode():
    compiled = amp_fx.compile(_SplitByBreak(reuse=True), backend="aot_eager", strict=True)
    with pytest.raises(amp_fx.AmpFxError, match=r"fc\.(weight|bias) is used on both sides of a graph break"):
        compiled(torch.randn(2, 4))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_transformer_layer_with_dropout_trains_bitwise(dtype):
    # Three dropouts, one on a non-contiguous input (the attention output), plus attention
    # dropout inside SDPA: masks, outputs and every gradient equal eager autocast's.
    torch.manual_seed(0)
    model = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.1, batch_first=True)
    _train_step_against_eager(model, torch.randn(2, 8, 32), dtype)
