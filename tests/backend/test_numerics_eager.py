"""``numerics="eager"`` (amp_fx/backend/eager_numerics.py): under inductor, bitwise with eager autocast.

The ladder's top rung held to the bottom rung's standard: logits, loss and every gradient equal bit
for bit to eager ``torch.autocast``, forward and backward, on a small model whose default-inductor
run differs (:class:`NormChain`), on the real-model tier's transformers, and for one ``compile_step``
with the fp16 scaler. Each knob of :data:`~amp_fx.backend.eager_numerics.INDUCTOR_KNOBS` that a
small case shows is needed has a test that fails without it.
"""

from __future__ import annotations

import copy
import logging
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch._inductor.exc import InductorError

import amp_fx
from amp_fx._common.progress import PROGRESS_LOGGER
from amp_fx.backend import eager_numerics
from amp_fx.errors import AmpFxError, AmpFxWarning
from amp_fx.scaler import GradScaler, StepMode
from amp_fx.testing import assert_bitwise, eager_amp_step
from amp_fx.testing.real_models import REAL_MODELS, eager_autocast_real_step, real_step
from amp_fx.testing.zoo import ZOO

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


class NormChain(nn.Module):
    """A linear, a low-precision pointwise chain inductor fuses (``* 1.5 + shift``), a LayerNorm
    (an fp32 op under autocast: its reductions, forward and backward) and a head whose bias
    gradient is a sum over the batch. Under inductor with only ``emulate_precision_casts`` its
    output and every gradient differ from eager autocast (measured, torch 2.13 CPU). ``shift``
    0.25 is exact in bf16 and fp16; 0.3 is not (the scalar rule)."""

    def __init__(self, d: int = 64, shift: float = 0.25) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, d)
        self.shift = shift

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.ln(self.fc(x) * 1.5 + self.shift))


class TransposedCopy(nn.Module):
    """A matmul's output (an ATen kernel's fixed layout) split into heads, transposed, made
    contiguous and viewed. ``contiguous()`` is ``aten.clone``: fused by inductor, its output (or
    its gradient's, in the backward) keeps the transposed strides and the ATen ``view`` after it
    fails, where eager's clone gave contiguous strides."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(64, 64)

    def forward(self, x: Tensor) -> Tensor:
        h = self.fc(x).view(2, 16, 4, 16).transpose(1, 2)
        return h.contiguous().view(2, 4, 256).float().sum(-1)


def _step(run: nn.Module, model: nn.Module, x: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
    out = run(x)
    out.float().pow(2).mean().backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out.detach(), grads


def _eager(model: nn.Module, x: Tensor, dtype: torch.dtype) -> tuple[Tensor, dict[str, Tensor]]:
    with torch.autocast("cpu", dtype=dtype):
        return _step(model, model, x)


def _differs(actual: tuple[Tensor, dict[str, Tensor]], expected: tuple[Tensor, dict[str, Tensor]]) -> list[str]:
    """What is not bitwise: 'out' and the names of the gradients."""
    bad = [] if torch.equal(actual[0], expected[0]) else ["out"]
    return bad + [n for n, g in expected[1].items() if not torch.equal(actual[1][n], g)]


def _small(cls: type[nn.Module] = NormChain) -> tuple[nn.Module, Tensor]:
    torch.manual_seed(0)
    x = torch.randn(32, 64) if cls is NormChain else torch.randn(2, 16, 64)
    return cls(), x


def _needs_fusion() -> None:
    """Skip where this torch's CPU inductor ignores emulate_precision_casts (torch 2.11): there the
    mode fuses nothing (said once; strict raises), so a test of what fusion keeps exact has nothing
    to test (test_small_model_bitwise and test_ignored_emulation_said_unfused_and_bitwise run)."""
    if not eager_numerics.emulates_precision_casts("cpu"):
        pytest.skip(f"torch {torch.__version__}'s CPU inductor ignores emulate_precision_casts: nothing is fused")


# --- options ----------------------------------------------------------------------------------


def test_numerics_option_checked() -> None:
    assert amp_fx.Options(numerics="eager").numerics is amp_fx.Numerics.EAGER
    assert amp_fx.Options().numerics is amp_fx.Numerics.DEFAULT
    with pytest.raises(ValueError, match="numerics must be one of"):
        amp_fx.Options(numerics="fast")
    with pytest.raises(ValueError, match="backend='aot_eager' is already bitwise"):
        amp_fx.Options(numerics="eager", backend="aot_eager")
    with pytest.raises(ValueError, match="watch_nonfinite"):
        amp_fx.Options(numerics="eager", watch_nonfinite=True)
    assert hash(amp_fx.Options(numerics="eager")) != hash(amp_fx.Options())


# --- the small case: bitwise, and each knob needed ----------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_small_model_bitwise(dtype: torch.dtype) -> None:
    """Bitwise, fused; where inductor ignores emulate_precision_casts (torch 2.11's CPU inductor),
    bitwise unfused, said once (strict=False here: strict raises, test_ignored_emulation...)."""
    fused = eager_numerics.emulates_precision_casts("cpu")
    model, x = _small()
    expected = _eager(model, x, dtype)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        actual = _step(amp_fx.compile(model, dtype=dtype, numerics="eager", strict=fused), model, x)
    assert _differs(actual, expected) == []
    ignored = [w for w in said if "ignores emulate_precision_casts" in str(w.message)]
    assert len(ignored) == (0 if fused else 1), [str(w.message) for w in said]


def test_small_model_differs_under_default_inductor() -> None:
    """The negative twin: the same model under inductor's defaults plus emulate_precision_casts
    is not bitwise (else the test above would test nothing)."""
    model, x = _small()
    expected = _eager(model, x, torch.bfloat16)
    compiled = amp_fx.compile(model, dtype="bf16", options={"emulate_precision_casts": True})
    assert _differs(_step(compiled, model, x), expected) != []


@pytest.mark.parametrize(
    "left_out",
    [("fallback_by_default", "selective_decompose"), ("selective_decompose",), ("emulate_precision_casts",)],
    ids=lambda knobs: "+".join(knobs),
)
def test_each_knob_needed(left_out: tuple[str, ...], monkeypatch: pytest.MonkeyPatch) -> None:
    """With a knob left out of the mode's config, NormChain is no longer bitwise. (Without
    fallback_by_default, selective_decompose leaves ops undecomposed that inductor has no
    lowering for: :func:`test_selective_decompose_needs_fallback`.)"""
    _needs_fusion()
    knobs = {k: v for k, v in eager_numerics.INDUCTOR_KNOBS.items() if k not in left_out}
    monkeypatch.setattr(eager_numerics, "INDUCTOR_KNOBS", knobs)
    model, x = _small()
    expected = _eager(model, x, torch.bfloat16)
    actual = _step(amp_fx.compile(model, dtype="bf16", numerics="eager"), model, x)
    assert _differs(actual, expected) != [], f"bitwise without {left_out}: the test does not show it is needed"


def test_selective_decompose_needs_fallback(monkeypatch: pytest.MonkeyPatch) -> None:
    _needs_fusion()
    knobs = {k: v for k, v in eager_numerics.INDUCTOR_KNOBS.items() if k != "fallback_by_default"}
    monkeypatch.setattr(eager_numerics, "INDUCTOR_KNOBS", knobs)
    model, x = _small()
    with pytest.raises(AmpFxError, match="both a fallback and a decomp"):
        amp_fx.compile(model, dtype="bf16", numerics="eager")(x)


def test_inexact_scalar_left_on_aten(monkeypatch: pytest.MonkeyPatch) -> None:
    """``x + 0.3`` on bf16 stays on ATen (pytorch#136896): bitwise; fused, it is not."""
    _needs_fusion()
    torch.manual_seed(0)
    model, x = NormChain(shift=0.3), torch.randn(32, 64)
    expected = _eager(model, x, torch.bfloat16)
    assert _differs(_step(amp_fx.compile(model, dtype="bf16", numerics="eager"), model, x), expected) == []
    torch._dynamo.reset()
    monkeypatch.setattr(eager_numerics, "_inexact_scalar", lambda node: False)
    # the cache key names the rule's version, not this test's patch: compile afresh
    with torch._inductor.config.patch(force_disable_caches=True):
        assert _differs(_step(amp_fx.compile(model, dtype="bf16", numerics="eager"), model, x), expected) != []


def test_clone_left_on_aten(monkeypatch: pytest.MonkeyPatch) -> None:
    _needs_fusion()
    model, x = _small(TransposedCopy)
    expected = _eager(model, x, torch.bfloat16)
    assert _differs(_step(amp_fx.compile(model, dtype="bf16", numerics="eager"), model, x), expected) == []
    torch._dynamo.reset()
    monkeypatch.setattr(eager_numerics, "_EXACT_OPS", eager_numerics._EXACT_OPS | {torch.ops.aten.clone.default})
    # the backward, compiled at the first backward call (outside amp_fx's compile), fails
    with torch._inductor.config.patch(force_disable_caches=True), pytest.raises(InductorError, match="Cannot view"):
        _step(amp_fx.compile(model, dtype="bf16", numerics="eager"), model, x)


# --- the backward compile, announced; inference graphs fused -----------------------------------


def test_backward_compile_announced_and_bitwise(caplog: pytest.LogCaptureFixture) -> None:
    """The backward graph goes through the backward-announcing downstream
    (``with_backward_compile`` wrapping the eager-numerics compile): its compile is announced and
    timed like every backend's, and the backward stays bitwise. The caches are off: a backward
    served from a warm cache is not compiled, so not announced."""
    _needs_fusion()
    caplog.set_level(logging.INFO, logger=PROGRESS_LOGGER)
    model, x = _small()
    expected = _eager(model, x, torch.bfloat16)
    compiled = amp_fx.compile(model, dtype="bf16", numerics="eager")
    with torch._inductor.config.patch(force_disable_caches=True):
        actual = _step(compiled, model, x)
    lines = [r.getMessage() for r in caplog.records if r.name == PROGRESS_LOGGER]
    assert "amp_fx: NormChain: compiling the backward of graph 0 (its first backward) ..." in lines, lines
    assert any(line.startswith("amp_fx: NormChain: compiled the backward of graph 0 (") for line in lines), lines
    assert _differs(actual, expected) == []


def _kernels_and_out(model: nn.Module, x: Tensor, **compile_kwargs: object) -> tuple[int, Tensor]:
    torch._inductor.metrics.reset()
    compiled = amp_fx.compile(model, dtype="bf16", numerics="eager", **compile_kwargs)  # type: ignore[arg-type]
    with torch.no_grad(), torch._inductor.config.patch(force_disable_caches=True):
        out = compiled(x)
    return torch._inductor.metrics.generated_kernel_count, out


def test_inference_graph_fused_and_bitwise() -> None:
    """A graph without a backward (no joint graph: AOTAutograd's inference graph) gets its fusible
    ops tagged too: inductor generates kernels for them (none without the tagging: every op an
    ATen extern call) and the output is bitwise with eager autocast under no_grad."""
    _needs_fusion()
    model, x = _small()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        expected = model(x)
    kernels, out = _kernels_and_out(model, x)
    assert kernels > 0, "the inference graph ran unfused"
    assert_bitwise(out, expected, "inference output")


# --- torch versions: emulate_precision_casts checked by what it does -----------------------------


_EMULATES_ON_CPU = {(2, 11): False, (2, 13): True}
"""Measured: torch 2.11's CPU inductor ignores emulate_precision_casts, 2.13's honours it."""


def test_emulation_feature_test_can_fail() -> None:
    """The feature test of emulate_precision_casts: false without the knob (so it can tell a
    torch whose inductor ignores it), and with it what was measured on the torches we know."""
    assert not eager_numerics.emulates_precision_casts("cpu", emulate=False)
    version = tuple(int(v) for v in torch.__version__.split(".")[:2])
    if version not in _EMULATES_ON_CPU:
        pytest.skip(f"torch {torch.__version__}: not measured (torch 2.11: ignored; 2.13: honoured)")
    assert eager_numerics.emulates_precision_casts("cpu") is _EMULATES_ON_CPU[version]


def test_ignored_emulation_said_unfused_and_bitwise(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where inductor ignores emulate_precision_casts (torch 2.11's CPU inductor): said once naming
    the knob, nothing fused (no kernel generated), still bitwise; strict raises."""
    monkeypatch.setattr(eager_numerics, "emulates_precision_casts", lambda device_type: False)
    model, x = _small()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        expected = model(x)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        kernels, out = _kernels_and_out(model, x, strict=False)
    messages = [str(w.message) for w in said if issubclass(w.category, AmpFxWarning)]
    assert len([m for m in messages if "ignores emulate_precision_casts" in m]) == 1, messages
    assert kernels == 0
    assert_bitwise(out, expected, "inference output")
    torch._dynamo.reset()
    with pytest.raises(AmpFxError, match="emulate_precision_casts"):
        amp_fx.compile(model, dtype="bf16", numerics="eager", strict=True)(x)


# --- scope: this graph's compile only ---------------------------------------------------------


def test_scope_and_cache_key() -> None:
    """The default-numerics compile of the same graph runs first (caches on): the eager-numerics
    compile after it must not reuse its artifact, and leaves the global config as it found it."""
    _needs_fusion()
    before = (torch._inductor.config.fallback_by_default, torch._functorch.config.joint_custom_pass)
    model, x = _small()
    expected = _eager(model, x, torch.bfloat16)
    with torch._inductor.config.patch(fx_graph_cache=True), torch._functorch.config.patch(enable_autograd_cache=True):
        default = _step(amp_fx.compile(model, dtype="bf16", options={"emulate_precision_casts": True}), model, x)
        torch._dynamo.reset()
        options = {"emulate_precision_casts": True}  # the user's options: same config entries as above
        eager = _step(amp_fx.compile(model, dtype="bf16", numerics="eager", options=options), model, x)
    assert _differs(default, expected) != []
    assert _differs(eager, expected) == []
    assert (torch._inductor.config.fallback_by_default, torch._functorch.config.joint_custom_pass) == before


# --- a torch without the knobs ------------------------------------------------------------------


def test_missing_knobs_said_and_bitwise(monkeypatch: pytest.MonkeyPatch) -> None:
    """No lite-mode knobs (torch before them): said once naming them, compiled with aot_eager
    (bitwise); strict raises."""
    monkeypatch.setattr(eager_numerics, "missing_knobs", lambda: ["fallback_by_default", "selective_decompose"])
    model, x = _small()
    expected = _eager(model, x, torch.bfloat16)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        compiled = amp_fx.compile(model, dtype="bf16", numerics="eager", strict=False)
        actual = _step(compiled, model, x)
    messages = [str(w.message) for w in said if issubclass(w.category, AmpFxWarning)]
    assert any("fallback_by_default" in m and "aot_eager" in m for m in messages), messages
    assert _differs(actual, expected) == []
    with pytest.raises(AmpFxError, match="fallback_by_default"):
        amp_fx.compile(model, dtype="bf16", numerics="eager", strict=True)(x)


def test_conflicting_option_said() -> None:
    """An inductor option the mode sets itself, passed with another value: said (strict: raised)."""
    model, x = _small()
    with pytest.raises(AmpFxError, match="emulate_precision_casts"):
        amp_fx.compile(model, dtype="bf16", numerics="eager", options={"emulate_precision_casts": False})(x)


# --- compile_step: fp16 with the scaler ---------------------------------------------------------


def test_compile_step_fp16_scaler_bitwise(caplog: pytest.LogCaptureFixture) -> None:
    """compile_step(numerics="eager") against eager autocast + torch.amp.GradScaler: losses,
    parameters and scale bitwise over steps that include an overflow (a skipped step). The
    optimizer graph runs through aot_eager (eager's numbers, unfused): its progress line names it."""
    _needs_fusion()
    caplog.set_level(logging.INFO, logger=PROGRESS_LOGGER)
    model = ZOO["mlp"].build()[0]
    ref_model = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ref_opt = torch.optim.SGD(ref_model.parameters(), lr=0.05, momentum=0.9)
    ours_scaler = GradScaler("cpu", growth_interval=2, step_mode=StepMode.MASKED)
    ref_scaler = torch.amp.GradScaler("cpu", growth_interval=2)
    ours = amp_fx.compile_step(model, opt, F.mse_loss, dtype="fp16", scaler=ours_scaler, numerics="eager")
    ref = eager_amp_step(ref_model, ref_opt, F.mse_loss, ref_scaler, dtype=torch.float16)
    g = torch.Generator().manual_seed(1)
    for i in range(5):
        x, y = torch.randn(6, 16, generator=g), torch.randn(6, 8, generator=g)
        if i == 3:
            x[0, 0] = 1e30  # an fp16 overflow: the step is skipped and the scale backs off
        assert_bitwise(ours(x, y), ref(x, y), f"loss {i}")
        assert_bitwise(ours_scaler._scale, ref_scaler._scale, f"scale after step {i}")
        for (n, p), q in zip(model.named_parameters(), ref_model.parameters(), strict=True):
            assert_bitwise(p, q, f"{n} after step {i}")
    lines = [r.getMessage() for r in caplog.records if r.name == PROGRESS_LOGGER]
    assert any("compiling the optimizer step (" in line and "backend aot_eager)" in line for line in lines), lines


# --- the real-model tier ------------------------------------------------------------------------


def _real_pair(name: str, dtype: torch.dtype, **compile_kwargs: object) -> tuple[list[str], int]:
    """(what differs from eager autocast, how many gradients) for one real model's step."""
    entry = REAL_MODELS[name]
    if (missing := entry.missing()) is not None:
        pytest.skip(missing)
    model, inputs, loss_fn = entry.build()
    expected = eager_autocast_real_step(model, inputs, loss_fn, dtype)
    model.zero_grad(set_to_none=True)
    compiled = amp_fx.compile(model, dtype=dtype, policy=entry.policy, **compile_kwargs)  # type: ignore[arg-type]
    actual = real_step(compiled, model, inputs, loss_fn)
    bad = [k for k, v in expected.out.items() if not torch.equal(actual.out[k], v)]
    bad += ["loss"] if not torch.equal(actual.loss, expected.loss) else []
    bad += [n for n, g in expected.grads.items() if g is not None and not torch.equal(actual.grads[n], g)]
    return bad, sum(g is not None for g in expected.grads.values())


_VIT_FP16 = pytest.mark.xfail(
    strict=True,
    reason="ViT in fp16 under numerics='eager': 18 or 19 of its gradients, run to run (the embeddings, some attention "
    "and norm weights, the classifier) differ from eager autocast; cause not found yet (docs/numerics.md)",
)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("name", ["hf_llama", "hf_gpt2", "hf_bert", "hf_t5", "hf_vit"])
def test_real_models_bitwise(name: str, dtype: torch.dtype, request: pytest.FixtureRequest) -> None:
    _needs_fusion()
    if name == "hf_vit" and dtype == torch.float16:
        request.applymarker(_VIT_FP16)
    bad, _ = _real_pair(name, dtype, numerics="eager")
    assert bad == [], f"{name} {dtype}: not bitwise with eager autocast: {bad}"


@pytest.mark.slow
def test_comparison_row_counted(record_property: pytest.RecordProperty) -> None:
    """The comparison row (issue 63): amp_fx under inductor's defaults plus emulate_precision_casts
    on the 2-layer Llama, counted and recorded, not asserted bitwise (15 of 21 measured on torch
    2.13); asserted only to leave something numerics='eager' closes."""
    bad, total = _real_pair("hf_llama", torch.bfloat16, options={"emulate_precision_casts": True})
    record_property("bitwise_gradients", f"{total - len([b for b in bad if '.' in b])}/{total}")
    assert bad, "the default row is bitwise on this torch: numerics='eager' would buy nothing here"


# --- compare: a policy difference or a fusion difference --------------------------------------


def test_compare_tells_fusion_from_policy() -> None:
    """Under inductor's defaults compare's end-to-end values on NormChain leave eager's (within
    its tolerance); with numerics="eager" they are bitwise, so that difference was fusion's. A
    policy difference (the LayerNorm in bf16 by amp_fx's policy) stays with numerics="eager"."""
    _needs_fusion()
    model, x = _small()
    default = amp_fx.compare(model, x, backend="inductor")
    eager = amp_fx.compare(model, x, backend="inductor", numerics="eager")
    assert eager.exact and eager.ok, eager
    assert any(v.error_vs_eager.abs > 0 for v in default.outputs + default.grads), default
    policy = amp_fx.Policy(op_classes={"aten::native_layer_norm": amp_fx.CastClass.LOWER_PRECISION_FP})
    moved = amp_fx.compare(model, x, backend="inductor", numerics="eager", policy=policy)
    assert moved.exact and not moved.ok and moved.first_divergence is not None


class ExcessPrecision(nn.Module):
    """``h * 1.5 - h`` on a bf16 matmul output: eager rounds ``h * 1.5`` to bf16 before the
    subtraction; inductor's default fusion subtracts from the fp32 product (measured: the ``sub``
    differs, ``mul`` itself does not)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(64, 64)

    def forward(self, x: Tensor) -> Tensor:
        h = self.fc(x)
        return h * 1.5 - h


def test_compare_names_where_each_inductor_run_leaves_eager() -> None:
    """compare under inductor names, per compiled run, the first op whose compiled value leaves
    the op-by-op run: none for numerics='eager', the fused ``sub`` for inductor's defaults."""
    _needs_fusion()
    torch.manual_seed(0)
    model, x = ExcessPrecision(), torch.randn(32, 64)
    report = amp_fx.compare(model, x, backend="inductor", numerics="eager")
    eager_run, default_run = report.compiled
    assert eager_run.run == "inductor, numerics='eager'" and eager_run.node is None, report.compiled
    assert default_run.run == "inductor, default numerics" and default_run.node == "sub", report.compiled
    assert not eager_run.not_compiled and not default_run.not_compiled, report.notes
    assert "compiled: inductor, default numerics: first op that differs: graph 0, node sub (aten.sub" in str(report)
