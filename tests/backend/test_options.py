"""The options record: built and checked once, read back through ``amp_fx.options_of``.

Every entry point (``amp_fx.compile``, ``amp_fx.compile_step``, ``torch.compile(backend="amp_fx")``,
the Lightning plugin) builds one ``amp_fx.Options``; a bad value fails with the same message
wherever it is given, and what a compiled model (or a copy of it) reads back is what it runs with.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import io
import pickle
import warnings

import pytest
import torch

import amp_fx
from amp_fx import Options, Policy
from amp_fx._common.report import regions_from_env
from amp_fx.testing.zoo import MLP

BAD = [
    ({"dtype": "fp8"}, ValueError, "unknown dtype 'fp8'"),
    ({"policy": "fp32"}, TypeError, "policy must be an amp_fx.Policy"),
    ({"backend": "no_such_backend"}, ValueError, "unknown backend 'no_such_backend'"),
    ({"backend": 3}, TypeError, "backend must be a torch.compile backend name"),
    ({"fold": 1}, TypeError, "fold must be True or False"),
    ({"weight_cache": "yes"}, TypeError, "weight_cache must be True or False"),
    ({"watch_nonfinite": None}, TypeError, "watch_nonfinite must be True or False"),
    ({"strict": "on"}, TypeError, "strict must be True, False or None"),
]


@pytest.mark.parametrize("kwargs, error, match", BAD, ids=[next(iter(k)) for k, _, _ in BAD])
def test_a_bad_option_fails_alike_in_the_record_compile_and_compile_step(kwargs, error, match):
    with pytest.raises(error, match=match):
        Options(**kwargs)
    with pytest.raises(error, match=match):
        amp_fx.compile(MLP(), **kwargs)
    if next(iter(kwargs)) in inspect.signature(amp_fx.compile_step).parameters:  # not fold: compile's only
        model = MLP()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with pytest.raises(error, match=match):
            amp_fx.compile_step(model, opt, torch.nn.functional.mse_loss, **kwargs)


def test_inductor_options_need_the_inductor_backend():
    with pytest.raises(ValueError, match="configure inductor"):
        Options(backend="aot_eager", inductor={"max_autotune": True})
    with pytest.raises(ValueError, match="configure inductor"):
        amp_fx.compile(MLP(), backend="aot_eager", options={"max_autotune": True})


def test_the_record_is_frozen_normalised_and_pickles_as_itself():
    options = Options(dtype="fp16", policy=Policy(keep_fp32=("fc1",)), backend="aot_eager", strict=False)
    assert options.dtype is torch.float16 and options.strict is False
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.dtype = torch.bfloat16  # type: ignore[misc]
    assert pickle.loads(pickle.dumps(options)) == options
    assert options.replace(dtype="bf16").dtype is torch.bfloat16 and options.dtype is torch.float16
    with pytest.raises(ValueError, match="unknown dtype"):
        options.replace(dtype="int8")


def test_strict_none_reads_the_environment_when_built(monkeypatch):
    monkeypatch.setenv("AMP_FX_STRICT", "1")
    assert Options().strict is True
    monkeypatch.setenv("AMP_FX_STRICT", "0")
    assert Options().strict is False
    assert Options(strict=True).strict is True


def _compiled_kinds():
    def fn(x):
        return torch.nn.functional.linear(x, torch.ones(3, 4))

    wrapped = amp_fx.compile(MLP(), dtype="fp16", backend="aot_eager", fold=False, dynamic=False)
    inplace = amp_fx.compile(MLP(), dtype="fp16", backend="aot_eager", fold=False, dynamic=False, inplace=True)
    function = amp_fx.compile(fn, dtype="fp16", backend="aot_eager", fold=False, dynamic=False)
    return {"module": wrapped, "inplace": inplace, "function": function}


@pytest.mark.parametrize("kind", ["module", "inplace", "function"])
def test_options_of_reads_what_was_asked(kind):
    compiled = _compiled_kinds()[kind]
    got = amp_fx.options_of(compiled)
    # regions: compile's default, read from AMP_FX_REGIONS (False where unset, as the record's)
    assert got == Options(
        dtype=torch.float16,
        backend="aot_eager",
        fold=False,
        strict=got.strict,
        torch_compile={"dynamic": False},
        regions=regions_from_env(),
    )


def test_copies_keep_their_options():
    model = MLP()
    compiled = amp_fx.compile(model, dtype="fp16", backend="aot_eager", policy=Policy(keep_fp32=("fc1",)), fold=False)
    buffer = io.BytesIO()
    torch.save(compiled, buffer)
    buffer.seek(0)
    for copied in (copy.deepcopy(compiled), torch.load(buffer, weights_only=False)):
        assert amp_fx.options_of(copied) == amp_fx.options_of(compiled)
        assert copied(torch.randn(2, 16)).dtype == torch.float16


def test_options_of_holds_what_is_in_effect():
    """weight_cache=True with a policy that turns the shared leaf cast off: amp_fx says the cache is
    off, and the record says the same (so a copy compiles without it, and says nothing again)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled = amp_fx.compile(
            MLP(), backend="aot_eager", weight_cache=True, strict=False, policy=Policy(cast_cache=False)
        )
    assert any("weight_cache=True needs the shared leaf cast" in str(w.message) for w in caught)
    assert amp_fx.options_of(compiled).weight_cache is False
    assert compiled.amp_fx_weight_cache is None


def test_compile_step_builds_the_forward_from_one_record():
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = amp_fx.compile_step(
        model, opt, torch.nn.functional.mse_loss, dtype="bf16", backend="aot_eager", dynamic=False
    )
    assert step.options.dtype is torch.bfloat16
    assert step.options.torch_compile == {"dynamic": False}
    assert step.options.backend == "aot_eager"


@pytest.mark.parametrize("thing", [MLP(), lambda x: x, torch.compile(MLP(), backend="eager"), 3])
def test_options_of_something_amp_fx_did_not_compile_raises(thing):
    with pytest.raises(TypeError, match="was not compiled by amp_fx.compile"):
        amp_fx.options_of(thing)
