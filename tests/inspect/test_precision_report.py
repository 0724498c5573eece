"""amp_fx.precision_report and CompiledStep.precision_report: the dtype and bytes per parameter of
each part of a training setup, and the silent downgrades.

Every number is asserted against a value computed here from the tensors (numel x element size
summed over the parameters, the gradients, the optimizer's state, the weights the cache copies),
not against the report's own arithmetic. Each planted downgrade warns once, naming itself and its
fix, and raises in strict mode; the correct twin of each says nothing (the suite runs strict, so a
stray warning would raise). The DDP and FSDP2 rows are checked against the dtype each collective
actually sent, in tests/distributed/test_distributed_ddp.py and tests/distributed/test_distributed_fsdp.py (the spawns
those files already make); the FSDP2 reduce_dtype rule is checked here on the policy objects,
against torch's own ``FSDPParam.init_dtype_attrs``.
"""

from __future__ import annotations

import types
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import amp_fx
from amp_fx.inspect.precision import Downgrade, FsdpUnit, fsdp2_dtypes, fsdp2_rows

needs_fsdp = pytest.mark.skipif(not torch.distributed.is_available(), reason="needs torch.distributed (FSDP2)")


def _model(dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).to(dtype)


def _stepped(model: nn.Module) -> torch.optim.AdamW:
    """An AdamW that has taken one step (its state exists), with the gradients left in ``.grad``:
    no forward needed, so amp_fx.compile (lazy) compiles nothing."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.full_like(p, 0.5)
    opt.step()
    return opt


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _n(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def _quiet(call):
    """``call()`` with every warning recorded: (result, [AmpFxWarning messages])."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = call()
    return out, [str(w.message) for w in caught if issubclass(w.category, amp_fx.AmpFxWarning)]


# --- a correct setup -------------------------------------------------------------------------------


def test_correct_bf16_setup_numbers_and_silence():
    """fp32 parameters, AdamW (fp32 state), no scaler, bf16 compute: every row against the tensors."""
    inner = _model()
    model = amp_fx.compile(inner, dtype="bf16", backend="aot_eager")  # strict (the suite's default)
    opt = _stepped(inner)
    loss = torch.zeros((), dtype=torch.float32)
    report, said = _quiet(lambda: amp_fx.precision_report(model, opt, loss=loss))
    assert said == [] and report.downgrades == {}
    params = list(inner.parameters())
    n = _n(inner)
    assert report.params == n == 8 * 16 + 16 + 16 * 4 + 4
    assert report.compute_dtype == torch.bfloat16
    assert report.row("master weights").dtypes == (torch.float32,)
    assert report.row("master weights").bytes_per_param == _bytes(params) / n == 4.0
    assert report.row("compute weights").dtypes == (torch.bfloat16,)
    assert report.row("gradients").bytes_per_param == _bytes(p.grad for p in params) / n == 4.0
    state = [v for s in opt.state.values() for v in s.values() if v.dim() > 0]
    assert report.row("optimizer state").dtypes == (torch.float32,)
    assert report.row("optimizer state").bytes_per_param == _bytes(state) / n == 8.0
    assert report.row("caches").bytes_per_param == 0.0
    assert report.row("loss").dtypes == (torch.float32,)
    text = str(report)
    assert "master weights" in text and "downgrade" not in text


def test_correct_fp16_setup_with_amp_fx_scaler_says_nothing():
    inner = _model()
    model = amp_fx.compile(inner, dtype="fp16", backend="aot_eager")
    report, said = _quiet(lambda: amp_fx.precision_report(model, _stepped(inner), scaler=amp_fx.GradScaler("cpu")))
    assert said == [] and report.downgrades == {}
    assert "scaling the loss" in report.row("loss scaling").note


def test_weight_cache_bytes_are_the_cached_copies():
    """weight_cache=True: after one forward the cache holds a bf16 copy of each Linear's weight and
    bias (2 bytes per parameter, all of this model's parameters being Linear's)."""
    inner = _model()
    model = amp_fx.compile(inner, dtype="bf16", backend="aot_eager", weight_cache=True)
    model(torch.randn(2, 8)).sum().backward()
    report = amp_fx.precision_report(model)
    n = _n(inner)
    copies = _bytes(torch.empty_like(p, dtype=torch.bfloat16) for p in inner.parameters())
    assert report.row("caches").dtypes == (torch.bfloat16,)
    assert report.row("caches").bytes_per_param == copies / n == 2.0


# --- each planted downgrade: warns once (name + fix), raises when strict; its twin is silent ------


def _bf16_parameters():
    inner = _model(torch.bfloat16)
    return dict(model=amp_fx.compile(inner, dtype="bf16", backend="aot_eager", strict=False), optimizer=_stepped(inner))


def _bf16_state_only():
    inner = _model()
    opt = _stepped(inner)
    for state in opt.state.values():  # as a bf16 optimizer checkpoint loaded raw would leave it
        for key in ("exp_avg", "exp_avg_sq"):
            state[key] = state[key].to(torch.bfloat16)
    return dict(model=amp_fx.compile(inner, dtype="bf16", backend="aot_eager", strict=False), optimizer=opt)


def _torch_scaler_with_bf16():
    inner = _model()
    return dict(
        model=amp_fx.compile(inner, dtype="bf16", backend="aot_eager", strict=False), scaler=torch.amp.GradScaler("cpu")
    )


def _amp_fx_dynamic_scaler_with_bf16():
    inner = _model()
    return dict(
        model=amp_fx.compile(inner, dtype="bf16", backend="aot_eager", strict=False), scaler=amp_fx.GradScaler("cpu")
    )


def _fp16_no_scaler():
    return dict(model=amp_fx.compile(_model(), dtype="fp16", backend="aot_eager", strict=False))


def _fp16_check_only_scaler():
    return dict(
        model=amp_fx.compile(_model(), dtype="fp16", backend="aot_eager", strict=False),
        scaler=amp_fx.GradScaler("cpu", mode=amp_fx.ScalerMode.CHECK_ONLY),
    )


PLANTED = {
    "bf16 parameters": (
        _bf16_parameters,
        {Downgrade.MASTER_WEIGHTS_16BIT: "model.float()", Downgrade.OPTIMIZER_STATE_16BIT: "exp_avg"},
    ),
    "bf16 optimizer state": (_bf16_state_only, {Downgrade.OPTIMIZER_STATE_16BIT: "exp_avg_sq"}),
    "torch scaler with bf16": (_torch_scaler_with_bf16, {Downgrade.SCALER_WITH_BF16: "ScalerMode.CHECK_ONLY"}),
    "amp_fx scaler with bf16": (_amp_fx_dynamic_scaler_with_bf16, {Downgrade.SCALER_WITH_BF16: "Drop the scaler"}),
    "fp16 without a scaler": (_fp16_no_scaler, {Downgrade.FP16_WITHOUT_SCALING: "amp_fx.GradScaler(device_type)"}),
    "fp16 check-only scaler": (_fp16_check_only_scaler, {Downgrade.FP16_WITHOUT_SCALING: "check_only"}),
}


@pytest.mark.parametrize("case", list(PLANTED))
def test_planted_downgrade_warns_once_with_its_fix(case):
    make, expected = PLANTED[case]
    setup = make()
    report, said = _quiet(lambda: amp_fx.precision_report(**setup))
    assert set(report.downgrades) == set(expected)
    assert len(said) == len(expected)
    for kind, fix in expected.items():
        message = "amp_fx.precision_report: " + report.downgrades[kind]
        assert message in said and fix in message, (kind, said)
    # once per compiled model: asking again says nothing more
    _, again = _quiet(lambda: amp_fx.precision_report(**setup))
    assert again == []


@pytest.mark.parametrize("case", list(PLANTED))
def test_planted_downgrade_raises_in_strict_mode(case):
    make, expected = PLANTED[case]
    setup = make()
    with pytest.raises(amp_fx.AmpFxError) as raised:
        amp_fx.precision_report(**setup, strict=True)
    message = str(raised.value)
    assert all(fix in message for fix in expected.values()), message  # every downgrade, in one error


def test_bf16_parameters_numbers():
    """The downgraded setup's numbers: 2-byte master weights, 4 bytes of AdamW state per parameter."""
    setup = _bf16_parameters()
    report, _ = _quiet(lambda: amp_fx.precision_report(**setup))
    opt = setup["optimizer"]
    params = [p for g in opt.param_groups for p in g["params"]]
    n = sum(p.numel() for p in params)
    state = [v for s in opt.state.values() for v in s.values() if v.dim() > 0]
    assert report.row("master weights").dtypes == (torch.bfloat16,)
    assert report.row("master weights").bytes_per_param == _bytes(params) / n == 2.0
    assert report.row("optimizer state").dtypes == (torch.bfloat16,)
    assert report.row("optimizer state").bytes_per_param == _bytes(state) / n == 4.0


def test_pure_bf16_without_mixed_precision_asked_is_not_a_downgrade():
    """A bf16 model trained as such (no amp_fx dtype, no dtype=): reported, not warned."""
    model = _model(torch.bfloat16)
    report, said = _quiet(lambda: amp_fx.precision_report(model, _stepped(model)))
    assert said == [] and report.compute_dtype is None
    assert report.row("optimizer state").dtypes == (torch.bfloat16,)


def test_dtype_given_for_a_plain_module():
    model = _model(torch.bfloat16)
    report, said = _quiet(lambda: amp_fx.precision_report(model, dtype="bf16", strict=False))
    assert set(report.downgrades) == {Downgrade.MASTER_WEIGHTS_16BIT} and len(said) == 1


# --- FSDP2's reduce_dtype, on the policy objects (no ranks) ---------------------------------------


@needs_fsdp
@pytest.mark.parametrize("param_dtype", [None, torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("reduce_dtype", [None, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("orig", [torch.float32, torch.bfloat16])
def test_fsdp2_dtypes_match_torchs_fsdp_param(param_dtype, reduce_dtype, orig):
    """The gathered and reduced dtypes against torch's own FSDPParam.init_dtype_attrs (run on a
    stand-in holding only the sharded parameter) and foreach_reduce's ``reduce_dtype or grad dtype``."""
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam

    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    stand_in = types.SimpleNamespace(sharded_param=torch.empty(2, dtype=orig))
    FSDPParam.init_dtype_attrs(stand_in, policy)
    gathered = stand_in.param_dtype or stand_in.orig_dtype
    assert fsdp2_dtypes(policy, orig) == (gathered, stand_in.reduce_dtype or gathered)


@needs_fsdp
def test_fsdp2_reduce_dtype_set_on_the_blocks_only_is_named():
    """The user report: reduce_dtype=float32 on each block's fully_shard, none on the root's, so the
    root's parameters (here 100 elements) are reduce-scattered in bf16."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    root = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    units = [
        FsdpUnit("layers.0", mp, ((300, torch.float32),)),
        FsdpUnit("layers.1", mp, ((300, torch.float32),)),
        FsdpUnit("<root>", root, ((100, torch.float32),)),
    ]
    rows, message = fsdp2_rows(units, 700)
    assert "fully_shard(<root>) reduces in bfloat16" in message
    assert "layers.0" not in message and "root's included" in message
    gather, reduce = rows
    assert gather.dtypes == (torch.bfloat16,) and gather.bytes_per_param == 2.0
    assert reduce.dtypes == (torch.float32, torch.bfloat16)
    assert reduce.bytes_per_param == (600 * 4 + 100 * 2) / 700
    # the twin: the same policy on every call
    units[2] = FsdpUnit("<root>", mp, ((100, torch.float32),))
    rows, message = fsdp2_rows(units, 700)
    assert message is None and rows[1].dtypes == (torch.float32,) and rows[1].bytes_per_param == 4.0


@needs_fsdp
def test_fsdp2_reduce_dtype_without_param_dtype_is_applied():
    """MixedPrecisionPolicy(reduce_dtype=bf16) alone: torch reduce-scatters fp32 gradients in bf16
    (FSDPParam keeps reduce_dtype when param_dtype is None): applied, nothing to say."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    mp = MixedPrecisionPolicy(reduce_dtype=torch.bfloat16)
    rows, message = fsdp2_rows([FsdpUnit("<root>", mp, ((10, torch.float32),))], 10)
    assert message is None and rows[1].dtypes == (torch.bfloat16,) and rows[0].dtypes == (torch.float32,)


# --- the compiled step's own report ----------------------------------------------------------------


def test_compiled_step_report_and_its_scaler_downgrade():
    """compile_step(dtype="bf16") given a loss-scaling amp_fx.GradScaler: its report names it (once
    per step); the loss of the last call and AdamW's state are read from the step."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step = amp_fx.compile_step(
        model, opt, F.mse_loss, dtype="bf16", backend="aot_eager", strict=False, scaler=amp_fx.GradScaler("cpu")
    )
    step(torch.randn(4, 8), torch.randn(4, 4))
    report, said = _quiet(step.precision_report)
    assert set(report.downgrades) == {Downgrade.SCALER_WITH_BF16}
    assert len(said) == 1 and "compile_step's default for bf16" in said[0]
    assert _quiet(step.precision_report)[1] == []
    n = _n(model)
    state = [v for s in opt.state.values() for v in s.values() if v.dim() > 0]
    assert report.row("optimizer state").bytes_per_param == _bytes(state) / n == 8.0
    assert report.row("loss").dtypes == (torch.float32,)
    assert report.row("master weights").bytes_per_param == 4.0
    # between steps there is no .grad (the step clears it): the row says what the step does
    gradients = report.row("gradients")
    assert all(p.grad is None for p in model.parameters())
    assert (gradients.dtypes, gradients.bytes_per_param) == ((torch.float32,), 4.0), gradients
    assert gradients.note.startswith("written by each step's backward"), gradients
    # the default scaler for bf16 (check-only) is the fix: silent, also in strict mode
    step = amp_fx.compile_step(model, opt, F.mse_loss, dtype="bf16", backend="aot_eager", strict=True)
    assert step.precision_report().downgrades == {}
