"""``fp8="mxfp8"`` against torchao 0.18's MXFP8 training in its emulated mode, the reference.

The reference is ``amp_fx.testing.fp8_reference.torchao_mxfp8``: every ``nn.Linear`` runs torchao's
``_to_mxfp8_then_scaled_mm(x, w, KernelPreference.EMULATED, ScaleCalculationMode.RCEIL)`` on the
operands cast to bf16, under ``torch.autocast("cpu", bf16)``. The ladder: the kernel alone (eager),
then the pass under ``aot_eager`` (bitwise: loss, every gradient, 10 AdamW steps). This CPU has no
MX kernel, so amp_fx emulates MXFP8 here and says so (tested below); the ``torch._scaled_mm`` path
of a Blackwell GPU is not run by these tests.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import amp_fx
from amp_fx.fp8 import Fp8Recipe
from amp_fx.inspect.explanation import Explanation
from amp_fx.kernels import mxfp8_matmul as mx
from amp_fx.kernels.fp8_matmul import fp8_matmul
from amp_fx.kernels.fp8_padding import padding
from amp_fx.testing import assert_bitwise
from amp_fx.testing.fp8_reference import torchao_missing, torchao_mxfp8

pytestmark = [
    pytest.mark.skipif(torchao_missing() is not None, reason=str(torchao_missing())),
    pytest.mark.filterwarnings("ignore:amp_fx. fp8='mxfp8' runs emulated here"),
]


def _torchao_mm(x: Tensor, w: Tensor) -> Tensor:
    """torchao's emulated MXFP8 linear: ``x @ w.T``, ``w`` as ``[N, K]``, both bf16."""
    from torchao.prototype.moe_training.mxfp8_linear import _to_mxfp8_then_scaled_mm
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.quantization.quantize_.common.kernel_preference import KernelPreference

    return _to_mxfp8_then_scaled_mm(x, w, KernelPreference.EMULATED, ScaleCalculationMode.RCEIL)


class MLP(nn.Module):
    """Linears with and without bias, 3-D input; every size a multiple of 32 (torchao's MXFP8
    asserts it for M, K and N)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(32, 64)
        self.fc2 = nn.Linear(64, 96, bias=False)
        self.head = nn.Linear(96, 32)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(torch.relu(self.fc2(F.gelu(self.fc1(x)))))


def loss_fn(out: Tensor) -> Tensor:
    return out.float().pow(2).mean()


def _compile(model: nn.Module, **kwargs: object) -> nn.Module:
    return amp_fx.compile(model, dtype="bf16", fp8="mxfp8", backend="aot_eager", strict=False, **kwargs)


# --- the kernel alone ---------------------------------------------------------------------------


@pytest.mark.parametrize("m, k, n", [(64, 64, 32), (33, 40, 17)], ids=["aligned", "odd"])
def test_kernel_bitwise_with_torchao_emulated(m: int, k: int, n: int) -> None:
    """Forward and both gradients. Odd sizes (torchao asserts multiples of 32): against torchao
    on the operands zero-padded to 64 x 64 x 32, sliced, as amp_fx's padding claims."""
    torch.manual_seed(0)
    x = torch.randn(m, k).bfloat16().requires_grad_()
    w = torch.randn(n, k).bfloat16().requires_grad_()
    g = torch.randn(m, n).bfloat16()
    out = mx.mxfp8_matmul(x, w.t(), emulate=True)
    out.backward(g)
    xp = F.pad(x.detach(), (0, 64 - k, 0, 64 - m)).requires_grad_()
    wp = F.pad(w.detach(), (0, 64 - k, 0, 32 - n)).requires_grad_()
    ref = _torchao_mm(xp, wp)
    ref.backward(F.pad(g, (0, 32 - n, 0, 64 - m)))
    assert_bitwise(out, ref[:m, :n], "out")
    assert_bitwise(x.grad, xp.grad[:m, :k], "grad_x")
    assert_bitwise(w.grad, wp.grad[:n, :k], "grad_w")
    # a negative twin: the MXFP8 result is not bf16's (relative error of e4m3, ~2**-4)
    assert not torch.equal(out, (x @ w.t()).detach())


def test_fp8_matmul_routes_mxfp8_and_its_weight_casts_are_the_uncached_ones() -> None:
    """``fp8_matmul(..., MXFP8)`` on an fp32 weight = the MXFP8 matmul of its bf16 cast; the weight
    cache's entry point with ``weight_casts`` gives the same bits, gradient included."""
    from amp_fx.kernels.fp8_matmul import fp8_matmul_cached_weight, weight_casts

    torch.manual_seed(0)
    x = torch.randn(2, 32, 64).bfloat16()
    w = torch.randn(48, 64, requires_grad=True)
    out = fp8_matmul(x, w.t(), Fp8Recipe.MXFP8)
    out.float().sum().backward()
    grad, w.grad = w.grad, None
    ref = _torchao_mm(x.reshape(-1, 64), w.detach().bfloat16()).reshape(2, 32, 48)
    assert_bitwise(out, ref, "out")
    cached = fp8_matmul_cached_weight(x, w.t(), *weight_casts(w.detach().t(), Fp8Recipe.MXFP8), Fp8Recipe.MXFP8)
    cached.float().sum().backward()
    assert_bitwise(cached, out, "cached out")
    assert_bitwise(w.grad, grad, "cached grad_w")


@pytest.mark.parametrize("ends", [(32, 64, 96), (20, 50, 96)], ids=["groups_of_32", "groups_straddle_blocks"])
def test_grouped_kernel_bitwise_with_torchao_emulated(ends: tuple[int, ...]) -> None:
    """The grouped expert GEMM (emulated): output and both gradients
    against torchao's ``_to_mxfp8_then_scaled_grouped_mm(..., EMULATED)``, including groups whose
    sizes are not multiples of 32 (weight-gradient blocks straddle two experts, in both)."""
    from torchao.prototype.moe_training.mxfp8_grouped_mm import _to_mxfp8_then_scaled_grouped_mm
    from torchao.quantization.quantize_.common.kernel_preference import KernelPreference

    torch.manual_seed(0)
    x = torch.randn(96, 64).bfloat16().requires_grad_()
    w = torch.randn(3, 32, 64).bfloat16().transpose(-2, -1).requires_grad_()  # [E, K, N], torchao's layout
    offs = torch.tensor(ends, dtype=torch.int32)
    ref = _to_mxfp8_then_scaled_grouped_mm(x, w, offs, kernel_preference=KernelPreference.EMULATED)
    g = torch.randn_like(ref)
    ref.backward(g)
    x2, w2 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    out = mx.mxfp8_grouped_mm(x2, w2, offs)
    out.backward(g)
    assert_bitwise(out, ref, "out")
    assert_bitwise(x2.grad, x.grad, "grad_x")
    assert_bitwise(w2.grad, w.grad, "grad_w")
    assert not torch.equal(out, torch._grouped_mm(x, w, offs=offs))  # not a bf16 grouped GEMM
    # a tensor of its own, as torch._grouped_mm's output (not a slice of the padded GEMM's columns)
    assert torch._grouped_mm(x, w, offs=offs)._base is None and out._base is None


def _grouped_grads(fn: object, x: Tensor, w: Tensor, offs: Tensor, g: Tensor) -> tuple[Tensor, ...]:
    x, w = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    out = fn(x, w, offs)  # type: ignore[operator]
    out.backward(g)
    assert x.grad is not None and w.grad is not None
    return out, x.grad, w.grad


def test_quantizing_the_tokens_before_the_dispatch_keeps_the_forward_not_the_weight_gradient() -> None:
    """Why the MXFP8 token dispatch (torchao's ``a2a_dispatch_mxfp8_fwd_hp_bwd``: the experts'
    input quantized along K before expert parallelism's all-to-all, its e4m3 data and e8m0
    scales moved) is not a value-preserving rewrite of ``low_precision="mxfp8"``
    (docs/distributed.md, "The low-precision all-to-all"). The experts then receive
    ``dequantize(quantize_K(x))`` instead of ``x``. Each row's blocks along K quantize alone, so
    the forward GEMM and the input gradient are bit for bit the same (rows may move first). The
    weight gradient quantizes ``x`` along the tokens, with other scales: equal on ordinary
    activations (rounding to e4m3's 3 mantissa bits twice is rounding once), not where a value is
    an e4m3 subnormal under its K-block's scale (a large value in its row) and normal under its
    token block's. And torchao, given the quantized tokens, computes that gradient in high
    precision from them (``wgrad_with_hp``, which it requires for such inputs): another recipe,
    whose weight gradient differs from its own MXFP8 grouped GEMM's on the same values."""
    from torchao.prototype.moe_training.mxfp8_grouped_mm import _to_mxfp8_then_scaled_grouped_mm
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.prototype.mx_formats.mx_tensor import MXTensor
    from torchao.quantization.quantize_.common.kernel_preference import KernelPreference

    def dispatched(x: Tensor) -> Tensor:
        q = MXTensor.to_mx(x, torch.float8_e4m3fn, 32, scaling_mode=ScaleCalculationMode.RCEIL)
        return q.dequantize(torch.bfloat16)

    def torchao(wgrad_with_hp: bool) -> object:
        return lambda x, w, offs: _to_mxfp8_then_scaled_grouped_mm(
            x, w, offs, kernel_preference=KernelPreference.EMULATED, wgrad_with_hp=wgrad_with_hp
        )

    torch.manual_seed(0)
    x = torch.randn(96, 64).bfloat16()
    w = torch.randn(3, 64, 64).bfloat16().transpose(-2, -1).contiguous().transpose(-2, -1)  # [E, K, N]
    offs, g = torch.tensor([32, 40, 96], dtype=torch.int32), torch.randn(96, 64).bfloat16()
    plain = _grouped_grads(mx.mxfp8_grouped_mm, x, w, offs, g)
    moved = _grouped_grads(mx.mxfp8_grouped_mm, dispatched(x), w, offs, g)
    for name, got, want in zip(("out", "grad_x", "grad_w"), moved, plain, strict=True):
        assert_bitwise(got, want, name)

    corner = x.clone()
    corner[:, 0] = 1e-5  # column 0's token blocks: every value small, so each is normal there
    corner[5, 1] = 300.0  # row 5's first K-block: 1e-5 is a subnormal under its scale
    plain = _grouped_grads(mx.mxfp8_grouped_mm, corner, w, offs, g)
    moved = _grouped_grads(mx.mxfp8_grouped_mm, dispatched(corner), w, offs, g)
    assert_bitwise(moved[0], plain[0], "out")
    assert_bitwise(moved[1], plain[1], "grad_x")
    assert not torch.equal(moved[2], plain[2]), "grad_w: the corner must differ"

    ours = _grouped_grads(torchao(False), x, w, offs, g)
    theirs = _grouped_grads(torchao(True), dispatched(x), w, offs, g)
    assert_bitwise(theirs[0], ours[0], "torchao's out")
    assert not torch.equal(theirs[2], ours[2]), "torchao's grad_w in high precision"


# --- the pass -----------------------------------------------------------------------------------


@pytest.mark.slow  # ~13 s on a loaded 2-core CPU
def test_grouped_experts_in_the_pass_bitwise_with_torchao_emulated() -> None:
    """``fp8="mxfp8"`` on a mixture whose experts are one 3-D parameter per projection
    (transformers' ``grouped_mm_fallback``, ``tests/fp8/test_fp8_experts.py``'s model): both grouped
    GEMMs become ``mxfp8_grouped_mm``, bitwise (loss, every gradient) with the same mixture whose
    experts call torchao's ``_to_mxfp8_then_scaled_grouped_mm(..., EMULATED)`` on the bf16 casts
    of their operands, under ``torch.autocast("cpu", bf16)``. The router (``N=4``: torchao's MX
    GEMMs take multiples of 32 only) is kept out of fp8 on both sides (bf16)."""
    from torchao.prototype.moe_training.mxfp8_grouped_mm import _to_mxfp8_then_scaled_grouped_mm
    from torchao.quantization.quantize_.common.kernel_preference import KernelPreference

    from tests.fp8.test_fp8_experts import _GroupedMixture, loss_fn

    class _TorchaoExperts(_GroupedMixture):
        def experts(self, xs: Tensor, offs: Tensor) -> Tensor:
            def grouped(a: Tensor, w: Tensor) -> Tensor:
                return _to_mxfp8_then_scaled_grouped_mm(
                    a.to(torch.bfloat16),
                    w.to(torch.bfloat16).transpose(-2, -1),
                    offs,
                    kernel_preference=KernelPreference.EMULATED,
                )

            return grouped(torch.relu(grouped(xs, self.w_in)), self.w_out)

    torch.manual_seed(0)  # hidden 64: torchao's MX GEMMs take multiples of 32 (amp_fx pads the rest)
    model, x = _GroupedMixture(hidden=64), torch.randn(2, 16, 32)
    ref = _TorchaoExperts(hidden=64)
    ref.load_state_dict(model.state_dict())
    compiled = amp_fx.compile(
        copy.deepcopy(model),
        dtype="bf16",
        fp8="mxfp8",
        backend="aot_eager",
        policy=amp_fx.Policy(keep_out_of_fp8=["router"]),
        strict=False,
    )
    loss = loss_fn(compiled(x))
    loss.backward()
    decisions = [d for r in amp_fx.records(compiled) if r.fp8 is not None for d in r.fp8.decisions]
    grouped = [d for d in decisions if d.op == "aten._grouped_mm"]
    assert len(grouped) == 2 and all(d.converted for d in grouped), decisions
    with torch.autocast("cpu", torch.bfloat16):
        ref_loss = loss_fn(ref(x))
    ref_loss.backward()
    assert_bitwise(loss.detach(), ref_loss.detach(), "loss")
    assert_bitwise(
        {n: p.grad for n, p in compiled.named_parameters()}, {n: p.grad for n, p in ref.named_parameters()}, "gradients"
    )


@pytest.mark.slow  # ~20 s on a loaded 2-core CPU, mostly the first compile
def test_loss_gradients_and_adamw_bitwise_with_torchao() -> None:
    """10 AdamW steps under aot_eager: the first step's gradients, every loss, the final
    parameters, bit for bit with torchao's emulated MXFP8. Also (one compile for all): every
    linear is an MXFP8 matmul, the first call warns that it is emulated, explain says both."""
    torch.manual_seed(0)
    model, x = MLP(), torch.randn(2, 16, 32)
    ref = torchao_mxfp8(model)
    ours = copy.deepcopy(model)
    compiled = _compile(ours)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt = torch.optim.AdamW(ours.parameters(), lr=1e-2)
    losses_ref, losses = [], []
    for step in range(10):
        xs = x * (1 + step / 10)
        with torch.autocast("cpu", torch.bfloat16):
            loss_ref = loss_fn(ref(xs))
        loss_ref.backward()
        if step == 0:
            with pytest.warns(UserWarning, match="fp8='mxfp8' runs emulated here: cpu has no MXFP8 matmul"):
                loss = loss_fn(compiled(xs))
        else:
            loss = loss_fn(compiled(xs))
        loss.backward()
        if step == 0:
            assert_bitwise(
                {n: p.grad for n, p in ours.named_parameters()},
                {n: p.grad for n, p in ref.named_parameters()},
                "gradients",
            )
        for opt_ in (opt_ref, opt):
            opt_.step()
            opt_.zero_grad()
        losses_ref.append(loss_ref.detach())
        losses.append(loss.detach())
    assert_bitwise(losses, losses_ref, "losses")
    assert_bitwise(dict(ours.named_parameters()), dict(ref.named_parameters()), "parameters")

    records = amp_fx.records(compiled)
    decisions = [d for r in records for d in r.fp8.decisions]
    assert [(d.weight, d.converted, d.recipe) for d in decisions] == [
        (f"{m}.weight", True, Fp8Recipe.MXFP8) for m in ("fc1", "fc2", "head")
    ]
    assert "e8m0 scale per 32" in decisions[0].reason
    ex = Explanation.from_records(records)
    assert "fp8=mxfp8" in ex.table() and "runs emulated here" in str(ex)


@pytest.mark.slow  # 7 to 12 s on a loaded 2-core CPU: two compiles
@pytest.mark.filterwarnings("error:amp_fx. weight_cache=True")  # the cache fell back: a failure
def test_weight_cache_bitwise_with_uncached() -> None:
    """``weight_cache=True`` casts the weight to MXFP8 once per step: same losses and parameters
    as uncached over 3 SGD steps."""
    torch.manual_seed(0)
    model, x = nn.Linear(32, 64), torch.randn(32, 32)
    runs = []
    for cached in (False, True):
        ours = copy.deepcopy(model)
        compiled = _compile(ours, weight_cache=cached)
        opt = torch.optim.SGD(ours.parameters(), lr=0.5)
        losses = []
        for step in range(3):
            loss = loss_fn(compiled(x * (1 + step)))
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
        runs.append((losses, dict(ours.named_parameters())))
    assert_bitwise(runs[1][0], runs[0][0], "losses")
    assert_bitwise(runs[1][1], runs[0][1], "parameters")


def test_odd_sizes_are_padded_to_the_block_and_explain_counts_it() -> None:
    pad = padding(33, 40, 17, Fp8Recipe.MXFP8)
    assert pad is not None and pad.dims == {"K": (40, 64), "M": (33, 64), "N": (17, 32)}
    assert padding(64, 64, 32, Fp8Recipe.MXFP8) is None
    assert padding(16, 16, 16, Fp8Recipe.TENSORWISE) is None
    assert padding(16, 16, 16, Fp8Recipe.MXFP8) is not None  # 16 is not a multiple of 32


# --- what amp_fx says ----------------------------------------------------------------------------
# (that it runs emulated, and that strict mode does not refuse it: tests/fp8/,
# test_a_slow_fp8_kernel_is_one_notice_even_in_strict_mode)


@pytest.mark.parametrize(
    "capability, missing", [((9, 0), "needs a Blackwell GPU"), ((10, 0), None)], ids=["h100", "b200"]
)
def test_hopper_is_told_blackwell_is_needed(
    monkeypatch: pytest.MonkeyPatch, capability: tuple[int, int], missing: str | None
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(torch.version, "hip", None)
    text = mx.mx_kernels_missing.__wrapped__("cuda")
    assert (text is None) if missing is None else (missing in text and "9.0" in text)


def test_fp16_is_refused() -> None:
    with pytest.raises(ValueError, match="low-precision recipe 'mxfp8' needs dtype=torch.bfloat16"):
        amp_fx.compile(MLP(), dtype="fp16", fp8="mxfp8", backend="aot_eager")
