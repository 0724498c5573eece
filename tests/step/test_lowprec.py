"""``compile_step(train_state=...)``: bf16 parameters and moments (amp_fx/step/lowprec.py).

Numerics against torchao: its ``_fp32_to_bf16_sr`` statistics, its ``_AdamW(bf16_stochastic_round=True)``
bit for bit, its ``single_param_adam`` on fp32 weights for Kahan's write-back. The training run
against fp32 master weights is ``bench/bench_lowprec.py`` (slow; not a test).
"""

from __future__ import annotations

import copy
import math
import unittest.mock
import warnings

import numpy as np
import pytest
import torch
from torch import nn

import amp_fx
from amp_fx.errors import AmpFxError, AmpFxWarning
from amp_fx.step.lowprec import round_bf16_stochastic
from amp_fx.testing import HostSyncCounter


def _torchao_adam():
    try:
        from torchao.optim import _AdamW
        from torchao.optim.adam import single_param_adam
    except Exception as e:  # noqa: BLE001 (an optional dependency; any import failure skips)
        pytest.skip(f"torchao.optim is not importable: {e}")
    return _AdamW, single_param_adam


class _Affine(nn.Module):
    """``w * x + b``: with ``loss = (out * t).sum()`` the gradients are ``t * x`` and ``t``, the
    same bits eager and compiled, so that only the optimizer step is compared."""

    def __init__(self, shape: tuple[int, ...], fill: float | None = None) -> None:
        super().__init__()
        w = torch.randn(shape) if fill is None else torch.full(shape, fill)
        self.w = nn.Parameter(w)
        self.b = nn.Parameter(torch.zeros(shape[-1]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w * x + self.b


def _dot_loss(out: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return (out * t).sum()


def test_stochastic_rounding_is_unbiased() -> None:
    # fp32 values with bf16's dropped 16 bits = f: rounded away from zero with p = f / 2^16. The mean
    # of N roundings is lo + ulp * p_hat with sd(p_hat) = sqrt(p (1 - p) / N); bound 6 sd (+ one
    # count, for p = 2^-16 where the normal approximation is poor): a false failure has probability
    # below 1e-6 per value. Round-to-nearest misses 1.0 + 0.3, 0.5, 0.7 ulp by > 40 bounds: the test can fail.
    n = 1 << 18
    fractions = [1, 0x4CCD, 0x8000, 0xB333, 0xFFFF]
    bases = [0x3F800000, 0xBF800000, 0x4B000000, 0x00800000]  # 1.0, -1.0, 2^23, the smallest normal
    bits = torch.from_numpy(np.array([b | f for b in bases for f in fractions], dtype=np.uint32).view(np.int32))
    x = bits.view(torch.float32)
    torch.manual_seed(0)
    rounded = round_bf16_stochastic(x[:, None].expand(-1, n).contiguous()).float()
    lo = (bits & ~0xFFFF).view(torch.float32).double()
    hi = ((bits & ~0xFFFF) + 0x10000).view(torch.float32).double()
    assert bool(((rounded == lo.float()[:, None]) | (rounded == hi.float()[:, None])).all())
    p = torch.tensor([f / 65536 for _ in bases for f in fractions], dtype=torch.float64)
    ulp = (hi - lo).abs()
    bound = ulp * (6 * torch.sqrt(p * (1 - p) / n) + 1 / n)
    err = (rounded.double().mean(dim=1) - x.double()).abs()
    assert bool((err <= bound).all()), (err / ulp, bound / ulp)
    nearest_err = (x.to(torch.bfloat16).double() - x.double()).abs()
    assert bool((nearest_err[1:4] > 40 * bound[1:4]).all())


@pytest.mark.slow  # 15 s (two compiled pieces under aot_eager)
def test_bf16_sr_step_is_bitwise_torchao() -> None:
    """Three compiled steps (aot_eager), then one eager (a scheduled beta: the step runs masked through
    the scaler, still amp_fx's), bit for bit torchao's ``_AdamW(bf16_stochastic_round=True)`` run
    eagerly with the same seed; 8 bytes held per parameter, no host read."""
    adamw_ao, _ = _torchao_adam()
    torch.manual_seed(0)
    model = _Affine((3, 40))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    grad_bytes: list[int] = []
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda p: grad_bytes.append(p.grad.nbytes))
    step = amp_fx.compile_step(
        model, opt, _dot_loss, dtype="bf16", backend="aot_eager", train_state="bf16_sr", strict=False
    )  # the scheduled beta below is reported, not an error
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    batches = [(torch.randn(3, 40), torch.randn(3, 40)) for _ in range(5)]
    step(*batches[0])  # compiles; then both start from the same weights and state
    ref = copy.deepcopy(model)
    ref_opt = adamw_ao(ref.parameters(), lr=1e-2, weight_decay=0.1, bf16_stochastic_round=True)
    for p, r in zip(model.parameters(), ref.parameters()):
        ref_opt.state[r] = {k: v.clone() for k, v in opt.state[p].items()}
    grad_bytes.clear()
    torch.manual_seed(1)
    with HostSyncCounter() as syncs:
        for x, t in batches[1:4]:
            step(x, t)
    assert syncs.count == 0, syncs.names
    opt.param_groups[0]["betas"] = (0.8, 0.99)
    with pytest.warns(AmpFxWarning, match="betas") as said:
        step(*batches[4])
    # train_state's step replaces the optimizer's, fused or not: that advice would not help
    assert not [w for w in said if "fused=True" in str(w.message)], [str(w.message) for w in said]
    torch.manual_seed(1)
    # torchao compiles its update with inductor, whose random bits come from inductor's own
    # generator: run it as written (eager) to draw from the default generator as ours does.
    with unittest.mock.patch("torch.compile", lambda fn, **kw: fn):
        for i, (x, t) in enumerate(batches[1:]):
            if i == 3:
                ref_opt.param_groups[0]["betas"] = (0.8, 0.99)
            _dot_loss(ref(x), t).backward()
            ref_opt.step()
            ref_opt.zero_grad()
    for (name, p), r in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p, r), name
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(opt.state[p][key], ref_opt.state[r][key]), (name, key)
    numel = sum(p.numel() for p in model.parameters())
    held = sum(
        p.nbytes + opt.state[p]["exp_avg"].nbytes + opt.state[p]["exp_avg_sq"].nbytes for p in model.parameters()
    )
    assert grad_bytes and (held + sum(grad_bytes[:2])) / numel == 8.0


@pytest.mark.slow_cases  # 9 s each
@pytest.mark.parametrize("train_state", ["bf16_kahan", "bf16_sr"])
def test_updates_below_half_an_ulp_survive(train_state: str) -> None:
    """40 AdamW steps of about lr = 1e-3 each on weights of 1.0: bf16's next value below 1.0 is
    1 - 2^-8, so round-to-nearest takes a step only above 2^-9 = 1.95e-3 and never moves them;
    Kahan and stochastic rounding follow the same update written to fp32 weights (torchao's
    ``single_param_adam`` with bf16 moments), which moves them by about 0.04."""
    _, single_param_adam = _torchao_adam()
    steps, n, g = 40, 4096, 2.0**-4  # a constant gradient: the moments do not depend on the weights
    model = _Affine((n,), fill=1.0)
    model.b.requires_grad_(False)
    opt = torch.optim.AdamW([model.w], lr=1e-3, weight_decay=0.0)
    step = amp_fx.compile_step(model, opt, _dot_loss, dtype="bf16", backend="aot_eager", train_state=train_state)
    x, t = torch.ones(n), torch.full((n,), g)
    torch.manual_seed(0)
    for _ in range(steps):
        step(x, t)
    # The reference: the same update written back to fp32 weights (bf16 moments: their rounding
    # is the same in both runs, so only the write-back differs).
    w32 = torch.ones(n)
    m, v, k = torch.zeros(n, dtype=torch.bfloat16), torch.zeros(n, dtype=torch.bfloat16), torch.zeros(())
    for _ in range(steps):
        k += 1
        single_param_adam(
            w32,
            torch.full((n,), g, dtype=torch.bfloat16),
            k,
            m,
            v,
            None,
            torch.tensor(1e-3),
            0.9,
            0.999,
            0.0,
            1e-8,
            True,
            False,
        )
    nearest = torch.ones(n, dtype=torch.bfloat16)
    rtn_opt = torch.optim.AdamW([nn.Parameter(nearest)], lr=1e-3, weight_decay=0.0)
    for _ in range(steps):
        rtn_opt.param_groups[0]["params"][0].grad = torch.full((n,), g, dtype=torch.bfloat16)
        rtn_opt.step()
    assert torch.equal(nearest, torch.ones(n, dtype=torch.bfloat16))  # stalled: what the option fixes
    assert float(1 - w32.mean()) > 0.035
    w = model.w.detach().float()
    ulp = 2.0**-8  # bf16's spacing in [0.5, 1)
    if train_state == "bf16_kahan":
        comp = opt.state[model.w]["kahan_comp"].float()
        # weight + compensation is the fp32 run up to bf16's rounding of the compensation
        # (2^-9 of |comp| <= ulp / 2) and fp32's of each step's sums (2^-24 each, 3 per step)
        torch.testing.assert_close(w + comp, w32, rtol=0, atol=ulp / 2 * 2.0**-8 + 3 * steps * 2.0**-24)
        torch.testing.assert_close(w, w32, rtol=0, atol=ulp / 2 + 1e-6)
        held = sum(opt.state[model.w][k].nbytes for k in ("exp_avg", "exp_avg_sq", "kahan_comp"))
        assert (model.w.nbytes * 2 + held) / n == 10.0  # weight, gradient, two moments, compensation
    else:
        # each element: a sum of 40 independent zero-mean roundings, each within one ulp, so its sd
        # is at most sqrt(40) * ulp / 2; the mean of 4096 elements within 6 sd of the fp32 run
        sd = math.sqrt(steps) * ulp / 2 / math.sqrt(n)
        assert abs(float(w.mean() - w32.mean())) <= 6 * sd
        # and no element strays far: Hoeffding, 40 roundings each within an interval of one ulp,
        # P(|sum| > a) <= 2 exp(-2 a^2 / (40 ulp^2)); a = 22 ulp makes it < 1e-6 over 4096 elements
        assert float((w - w32).abs().max()) <= 22 * ulp
    # the step's precision report: its bf16 parameters and moments are on purpose, no downgrade
    # (the suite runs strict: a reported downgrade would raise here)
    report = step.precision_report()
    assert report.downgrades == {}, report.downgrades
    assert report.row("master weights").dtypes == (torch.bfloat16,)
    state_bytes = sum(t.nbytes for t in opt.state[model.w].values() if t.dim() > 0)
    assert (
        report.row("optimizer state").bytes_per_param
        == state_bytes / n
        == (6.0 if train_state == "bf16_kahan" else 4.0)
    )


def test_train_state_is_checked() -> None:
    model = nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters())
    with pytest.raises(ValueError, match="train_state must be None, 'bf16_sr', 'bf16_kahan'"):
        amp_fx.compile_step(model, opt, nn.functional.mse_loss, dtype="bf16", train_state="bf16")
    with pytest.raises(ValueError, match="pass dtype='bf16'"):
        amp_fx.compile_step(model, opt, nn.functional.mse_loss, dtype="fp16", train_state="bf16_sr")
    assert model.weight.dtype == torch.float32  # refused before anything was converted
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.warns(AmpFxWarning, match=r"train_state=.bf16_sr.*optim.sgd.SGD"):
        amp_fx.compile_step(
            model, sgd, nn.functional.mse_loss, dtype="bf16", backend="aot_eager", train_state="bf16_sr", strict=False
        )
    assert model.weight.dtype == torch.float32  # not honoured: the model is left as it was
    amsgrad = torch.optim.AdamW(model.parameters(), amsgrad=True)
    with pytest.raises(AmpFxError, match="amsgrad"):
        amp_fx.compile_step(model, amsgrad, nn.functional.mse_loss, dtype="bf16", train_state="bf16_kahan", strict=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", AmpFxWarning)
        amp_fx.compile_step(model, opt, nn.functional.mse_loss, dtype="bf16", train_state="bf16_kahan")
    assert model.weight.dtype == torch.bfloat16 and model.bias.dtype == torch.bfloat16
    assert opt.state[model.weight]["kahan_comp"].dtype == torch.bfloat16


def test_compile_step_leaves_the_random_stream_alone() -> None:
    """The first step asks once whether Dynamo guards requires_grad, by compiling a small probe
    module; building it drew from the default generator, so a seeded run's first step moved the
    user's random stream (dropout masks, stochastic rounding) by 3 draws."""
    from amp_fx._common import compat

    compat._guards_requires_grad = None  # the answer is cached per process: ask again
    torch.manual_seed(1)
    before = torch.get_rng_state()
    compat.dynamo_guards_param_requires_grad()
    assert compat._guards_requires_grad is not None  # the probe ran
    assert torch.equal(torch.get_rng_state(), before)
