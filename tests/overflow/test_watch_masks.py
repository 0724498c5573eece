"""The forward watch names the op that *created* an inf/NaN, not an intentional -inf mask (issue 21).

nanoGPT-style causal attention in fp16 puts -inf into the scores on purpose (``masked_fill``,
``masked_fill_``, ``where(mask, s, -inf)``, or an additive ``full(-inf).triu(1)`` mask); softmax
turns them into zeros and the forward's output is finite. The watch must not name the mask:

* a gradient-only overflow (a loss scale so large that the fp16 backward overflows) names no
  forward op on any skipped step: it names where the backward's first inf appeared, as eager
  autograd's backward shows it (``amp_fx.testing.backward_origin``);
* a forward overflow planted in a named Linear at one step names that Linear.

References: eager ``torch.autocast`` + ``torch.amp.GradScaler`` on the same model and batches, for
which steps are skipped and whether the forward output was finite; the planted module for the name.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import amp_fx
from amp_fx.testing.backward_origin import BackwardOrigin, first_backward_origin
from tests.overflow._overflow_cases import DownProj

MASKS = ["masked_fill", "masked_fill_", "where", "additive", "caller"]
# Under inductor, one model holds every kind of mask (EveryMask): one inductor build (its C++
# kernels, 20 to 45 s a graph on the 2-core machine) instead of one per kind, with every mask in
# the fused kernels the watch checks; aot_eager keeps a case per kind, where a failure names it.
EVERY = "every"
# The inductor cases of this file build the same kernels (one model, other scales and inputs): in
# one xdist worker, one after the other, each kernel compiles once and the later cases read it from
# inductor's cache; on two workers at once both compiled it (98 s and 81 s of a CI run, started
# within 3 s of each other).
INDUCTOR_GROUP = pytest.mark.xdist_group("test_watch_masks.py-inductor")
CASES = [pytest.param("aot_eager", m, id=f"aot_eager-{m}") for m in MASKS] + [
    pytest.param("inductor", EVERY, id=f"inductor-{EVERY}", marks=INDUCTOR_GROUP)
]
PLANTED_MODULE = "mlp.down"
PLANTED_STEP = 2
STEPS = 4
WIDTH, HEADS, SEQ = 16, 2, 8


class CausalSelfAttention(nn.Module):
    """nanoGPT's attention (without flash), the mask made in one of the ways of ``MASKS``."""

    def __init__(self, mask: str) -> None:
        super().__init__()
        self.mask_kind = mask
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH)
        self.proj = nn.Linear(WIDTH, WIDTH)
        self.register_buffer("bias", torch.tril(torch.ones(SEQ, SEQ)).view(1, 1, SEQ, SEQ))

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, HEADS, c // HEADS).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / (c // HEADS) ** 0.5)
        keep = self.bias[:, :, :t, :t] != 0
        if self.mask_kind == "masked_fill":
            att = att.masked_fill(~keep, float("-inf"))
        elif self.mask_kind == "masked_fill_":
            att.masked_fill_(~keep, float("-inf"))
        elif self.mask_kind == "where":
            att = torch.where(keep, att, float("-inf"))
        elif self.mask_kind == "additive":  # in the scores' own dtype
            att = att + torch.full((t, t), float("-inf"), dtype=att.dtype, device=att.device).triu(1)
        else:  # "caller": an additive fp32 -inf mask handed in with the batch, cast to the scores' dtype
            assert mask is not None
            att = att + mask[:t, :t].to(att.dtype)
        att = F.softmax(att, dim=-1)
        y = (att @ v).transpose(1, 2).contiguous().view(b, t, c)
        return self.proj(y)


class Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(WIDTH, 2 * WIDTH)
        self.down = DownProj(2 * WIDTH, WIDTH)  # weight * gain: 1.0, or 1e6 at the planted step

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class EveryMask(nn.Module):
    """One attention per kind of ``MASKS``, their outputs summed: every mask in one graph."""

    def __init__(self) -> None:
        super().__init__()
        self.heads = nn.ModuleList(CausalSelfAttention(kind) for kind in MASKS)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        return sum(head(x, mask) for head in self.heads)


class Block(nn.Module):
    def __init__(self, mask: str) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(WIDTH)
        self.attn = EveryMask() if mask == EVERY else CausalSelfAttention(mask)
        self.ln_2 = nn.LayerNorm(WIDTH)
        self.mlp = Mlp()
        self.head = nn.Linear(WIDTH, 4)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), mask)
        x = x + self.mlp(self.ln_2(x))
        return self.head(x)


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(2, SEQ, WIDTH, generator=gen), torch.randn(2, SEQ, 4, generator=gen)) for _ in range(STEPS)]


def _run(model: nn.Module, x: torch.Tensor, mask: str) -> torch.Tensor:
    """The forward, with the caller's -inf mask where the model's attention takes one."""
    if mask not in ("caller", EVERY):
        return model(x)
    return model(x, torch.full((SEQ, SEQ), float("-inf")).triu(1))


def _plant(model: Block, step: int, planted: int | None) -> None:
    model.mlp.down.gain.fill_(1e6 if step == planted else 1.0)


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out.float(), y)


def _eager_reference(
    mask: str, init_scale: float, planted: int | None, origins: list[BackwardOrigin] | None = None
) -> tuple[list[int], list[bool]]:
    """Eager ``torch.autocast`` + ``torch.amp.GradScaler``: the skipped steps (the scale went down)
    and, per step, whether the forward output was finite; ``origins`` gets, per step, where the
    eager backward first made an inf/NaN."""
    torch.manual_seed(0)
    model = Block(mask)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale)
    skipped, finite = [], []
    for i, (x, y) in enumerate(_batches()):
        _plant(model, i, planted)

        def scaled_loss(x: torch.Tensor = x, y: torch.Tensor = y) -> torch.Tensor:
            with torch.autocast("cpu", dtype=torch.float16):
                out = _run(model, x, mask)
            finite.append(bool(torch.isfinite(out).all()))
            return scaler.scale(_loss(out, y))

        origin = first_backward_origin(model, scaled_loss, torch.float16)
        if origins is not None:
            origins.append(origin)
        before = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        if scaler.get_scale() < before:
            skipped.append(i)
    return skipped, finite


def _amp_fx_reports(mask: str, backend: str, init_scale: float, planted: int | None) -> list[Any]:
    """``amp_fx.compile(watch_nonfinite=True)`` + ``amp_fx.GradScaler``: the report after each step."""
    torch.manual_seed(0)
    model = Block(mask)
    compiled = amp_fx.compile(model, dtype="fp16", backend=backend, watch_nonfinite=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = amp_fx.GradScaler("cpu", init_scale=init_scale, step_mode=amp_fx.StepMode.MASKED)
    scaler.watch(compiled)
    reports = []
    for i, (x, y) in enumerate(_batches()):
        _plant(model, i, planted)
        scaler.scale(_loss(_run(compiled, x, mask), y)).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        reports.append(scaler.overflow_report())
    return reports


@pytest.mark.slow_cases
@pytest.mark.parametrize("backend, mask", CASES)
def test_gradient_only_overflow_names_no_forward_op(backend, mask):
    """At a loss scale of 2^40 the scaled fp16 gradients overflow while the forward stays finite:
    no skipped step names a forward op (the -inf mask is not an overflow). The first inf is the
    backward's: eager autograd makes it outside the model (the loss's ``out.float()``, whose
    backward casts the scaled gradient to fp16), and ``head`` is the first module whose output
    gradient is non-finite; amp_fx compiles the model, not the loss, so it names the gradient of
    ``head``'s output as it entered the compiled backward."""
    init_scale = 2.0**40
    origins: list[BackwardOrigin] = []
    skipped, finite = _eager_reference(mask, init_scale, planted=None, origins=origins)
    # The premise: the eager reference skips steps, and its forward output is finite at every step.
    assert skipped and all(finite), (skipped, finite)
    reports = _amp_fx_reports(mask, backend, init_scale, planted=None)
    assert [i for i, r in enumerate(reports) if r is not None] == skipped, reports
    for i in skipped:
        assert reports[i].step == i and reports[i].gradients, reports[i]
        first = reports[i].first_op
        assert origins[i].module == "" and origins[i].entered == "head", origins[i]
        assert first is not None and first.backward and first.incoming, str(reports[i])
        assert first.module == origins[i].entered, (str(reports[i]), origins[i])
        assert str(reports[i]).startswith(
            f"step {i} skipped: first inf in the backward at head (the gradient of its aten.linear output, fp16, "
            "entered the compiled backward non-finite)"
        ), str(reports[i])


@pytest.mark.slow_cases
@pytest.mark.parametrize("backend, mask", CASES)
def test_planted_forward_overflow_names_the_linear_not_the_mask(backend, mask):
    """The weight of ``mlp.down`` times 1e6 at step ``PLANTED_STEP`` only (its fp16 cast exceeds
    65504): that step is the only skip, and its first op is in ``mlp.down``, which runs after the
    mask in graph order."""
    init_scale = 2.0**10  # small enough that no step overflows by itself (checked by the reference)
    skipped, finite = _eager_reference(mask, init_scale, planted=PLANTED_STEP)
    assert skipped == [PLANTED_STEP] and finite == [i != PLANTED_STEP for i in range(STEPS)], (skipped, finite)
    reports = _amp_fx_reports(mask, backend, init_scale, planted=PLANTED_STEP)
    assert [i for i, r in enumerate(reports) if r is not None] == skipped, reports
    report = reports[PLANTED_STEP]
    assert report.first_op is not None and report.first_op.module == PLANTED_MODULE, str(report)
    assert str(report).startswith(f"step {PLANTED_STEP} skipped: first inf at {PLANTED_MODULE} (aten.")


def _first_low_precision_nonfinite_module(model: nn.Module, x: torch.Tensor) -> str | None:
    """Eager reference for a non-finite batch: under ``torch.autocast``, the first leaf module (in
    call order) whose fp16 output holds an inf/NaN (``DebugUnderflowOverflow``'s question, asked
    of the low-precision outputs only: ``ln_1`` passes the NaN on in fp32)."""
    found: list[str] = []
    handles = [
        m.register_forward_hook(
            lambda _m, _i, out, name=name: (
                found.append(name) if out.dtype == torch.float16 and not torch.isfinite(out).all() else None
            )
        )
        for name, m in model.named_modules()
        if not list(m.children())
    ]
    try:
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
            model(x)
    finally:
        for h in handles:
            h.remove()
    return found[0] if found else None


@pytest.mark.slow_cases
@pytest.mark.parametrize("value", [float("inf"), float("nan")])
@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=INDUCTOR_GROUP)])
def test_nonfinite_batch_is_named_at_the_first_op_that_reads_it(backend, value):
    """An inf or NaN in the caller's batch is the cause of the skip, though no op created it: the
    first watched op that reads it (here through ``ln_1``, which runs in fp32, then ``attn.qkv``'s
    input cast) is named. Only the caller's -inf is taken for a mask (the "caller" mask above)."""
    torch.manual_seed(0)
    model = Block("masked_fill")
    compiled = amp_fx.compile(model, dtype="fp16", backend=backend, watch_nonfinite=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = amp_fx.GradScaler("cpu", init_scale=2.0**10, step_mode=amp_fx.StepMode.MASKED)
    scaler.watch(compiled)
    reports, expected = [], []
    for i, (x, y) in enumerate(_batches()):
        if i == PLANTED_STEP:
            x[1, 3, 5] = value
        expected.append(_first_low_precision_nonfinite_module(model, x))
        scaler.scale(_loss(compiled(x), y)).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        reports.append(scaler.overflow_report())
    assert expected == [("attn.qkv" if i == PLANTED_STEP else None) for i in range(STEPS)], expected
    assert [i for i, r in enumerate(reports) if r is not None] == [PLANTED_STEP], reports
    report = reports[PLANTED_STEP]
    assert report.first_op is not None and report.first_op.module == expected[PLANTED_STEP], str(report)
