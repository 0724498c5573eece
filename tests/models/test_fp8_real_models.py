"""fp8 on the real-model tier's transformers models, against torchao converting the same layers.

Per model and recipe, ``amp_fx.compile(dtype="bf16", fp8=recipe, backend="aot_eager")`` runs one
forward and backward; the reference is torchao's ``convert_to_float8_training`` under CPU bf16
autocast (``amp_fx.testing.fp8_reference``: its input-cast branch pointed at the CPU's autocast
state) on the model's ``nn.Linear`` twin (GPT-2's ``Conv1D`` layers as the equivalent
``nn.Linear``), converting exactly the layers amp_fx ran in fp8 (``module_filter_fn``). The loss
and every gradient must be bitwise, and the share of GEMM FLOPs in fp8 (forward and backward,
counted from the ops that ran) the same. Every matmul amp_fx kept out of fp8 must say why.

Sizes that are not multiples of 16 (ViT's 2 x 17 tokens, ConvNeXt's 10-class head) run in fp8
padded; the reference is then torchao with ``pad_inner_dim=True`` (on the CPU its values equal
torchao's unpadded ones), and every ``_scaled_mm`` of amp_fx's must have sizes a GPU takes.
Where amp_fx converts a layer torchao cannot (GPT-2: every ``Conv1D``), or torchao would convert
one amp_fx does not, the test also runs torchao on the model as it is (every ``nn.Linear``), and
amp_fx's fp8 share must be at least that one; docs/fp8.md has the table.
"""

from __future__ import annotations

import copy
import functools
import warnings
from typing import Any

import pytest
import torch

import amp_fx
from amp_fx.kernels.fp8_support import rowwise_scales_missing
from amp_fx.testing import assert_bitwise
from amp_fx.testing.fp8_reference import (
    count_gemm_flops,
    cpu_autocast_torchao,
    linear_twin,
    torchao_float8,
    torchao_missing,
    torchao_mxfp8,
)
from amp_fx.testing.real_models import REAL_MODELS
from tests.inspect.test_advise import _amp_fx_error

pytestmark = [pytest.mark.models, pytest.mark.skipif(torchao_missing() is not None, reason=str(torchao_missing()))]

# The state-space models (traced_path set) are the tier's for amp_fx.compile (test_real_models.py);
# fp8 on them is not compared here.
TRANSFORMERS = [n for n, e in REAL_MODELS.items() if e.library == "transformers" and e.traced_path is None]
RECIPES = ("tensorwise", "rowwise")
# Default run: GPT-2 (Conv1D) and Llama (all nn.Linear) in both recipes, the others tensorwise;
# the rest is models_slow (about 20 s a case here).
_DEFAULT = {("hf_gpt2", "rowwise"), ("hf_llama", "rowwise")} | {(n, "tensorwise") for n in TRANSFORMERS}


_NO_ROWWISE = rowwise_scales_missing("cpu")  # torch 2.11's CPU _scaled_mm: per-tensor scales only


def _cases() -> list[object]:
    return [
        pytest.param(
            n,
            r,
            id=f"{n}-{r}",
            marks=[
                *(() if (n, r) in _DEFAULT else (pytest.mark.models_slow,)),
                *((pytest.mark.xdist_group(f"fp8_{n}"),) if n in _SHARED and r == "tensorwise" else ()),
                pytest.mark.skipif(r != "tensorwise" and _NO_ROWWISE is not None, reason=str(_NO_ROWWISE)),
            ],
        )
        for n in TRANSFORMERS
        for r in RECIPES
    ]


def _without_twin(model: torch.nn.Module) -> tuple[type, ...]:
    """The module types that own a 2-D parameter and are neither ``nn.Linear``, ``Conv1D`` (which
    ``linear_twin`` replaces) nor ``nn.Embedding``: Mixtral's router, an ``F.linear`` on its own
    weight (``N=4``: in fp8, padded, since every size runs in fp8), which torchao cannot convert.
    Kept out of fp8 for the comparison with torchao on the same layers."""
    return tuple(
        sorted(
            {
                type(m)
                for m in model.modules()
                if not isinstance(m, (torch.nn.Linear, torch.nn.Embedding))
                and type(m).__name__ != "Conv1D"
                and any(p.dim() == 2 for p in m.parameters(recurse=False))
            },
            key=str,
        )
    )


def _twin_policy(entry: Any, model: torch.nn.Module) -> amp_fx.Policy:
    """The policy of the comparisons with torchao on the ``nn.Linear`` twin: what has no twin kept
    out of fp8, and the experts as the tier runs them (in fp32, as in the twin, whose grouped GEMMs
    eager autocast runs in fp32; with fp8= alone they run in fp8: tests/fp8/test_fp8_experts.py)."""
    return amp_fx.Policy(keep_out_of_fp8=_without_twin(model), autocast_experts=entry.policy.autocast_experts)


# The models whose tensorwise compile several tests ask different questions of: it is compiled
# once per process (_compiled) and their cases run on one xdist worker (xdist_group, --dist loadgroup).
_SHARED = ("hf_gpt2", "hf_llama", "hf_t5")


def _shared(name: str) -> Any:
    return pytest.param(name, marks=pytest.mark.xdist_group(f"fp8_{name}"))


@functools.cache
def _compiled_once(name: str, recipe: str) -> dict[str, Any]:
    entry = REAL_MODELS[name]
    model, inputs, loss_fn = entry.build()
    ours = copy.deepcopy(model)
    policy = _twin_policy(entry, model)
    compiled = amp_fx.compile(ours, dtype="bf16", fp8=recipe, backend="aot_eager", strict=False, policy=policy)
    with warnings.catch_warnings(record=True) as caught:  # compiles forward and backward
        warnings.simplefilter("always", amp_fx.AmpFxWarning)
        loss_fn(compiled(**inputs)).backward()
    for p in ours.parameters():
        p.grad = None
    return {
        "model": model,
        "inputs": inputs,
        "loss_fn": loss_fn,
        "ours": ours,
        "compiled": compiled,
        "caught": caught,
        "start": copy.deepcopy(ours.state_dict()),
    }


def _compiled(name: str, recipe: str = "tensorwise") -> dict[str, Any]:
    """``amp_fx.compile(copy of the model, dtype="bf16", fp8=recipe, backend="aot_eager")``, compiled
    (forward and backward) once per process, with the AmpFxWarnings of that first call: the copy's
    parameters back at the model's, no gradients. ``model``, the fp32 original, is not to be changed."""
    if name not in _SHARED or recipe != "tensorwise":  # asked once: not kept
        return _compiled_once.__wrapped__(name, recipe)
    shared = _compiled_once(name, recipe)
    shared["ours"].load_state_dict(shared["start"])
    for p in shared["ours"].parameters():
        p.grad = None
    return shared


@pytest.mark.slow
@pytest.mark.parametrize("name, recipe", _cases())
def test_fp8_bitwise_with_torchao_converting_the_same_layers(name: str, recipe: str) -> None:
    entry = REAL_MODELS[name]
    if entry.missing():
        pytest.skip(entry.missing())
    shared = _compiled(name, recipe)
    model, inputs, loss_fn = shared["model"], shared["inputs"], shared["loss_fn"]
    ours, compiled, caught = shared["ours"], shared["compiled"], shared["caught"]
    with count_gemm_flops() as flops:
        loss = loss_fn(compiled(**inputs))
        loss.backward()

    decisions = [d for r in amp_fx.records(compiled) if r.fp8 is not None for d in r.fp8.decisions]
    converted = {d.module for d in decisions if d.converted}
    for d in decisions:
        if not d.converted:
            assert d.reason.startswith("not fp8: ") and len(d.reason) > 20, d
    if not converted:  # then amp_fx says so
        assert any("was asked, but none of its" in str(w.message) for w in caught), [str(w.message) for w in caught]

    twin = linear_twin(model)
    linears = {n for n, m in twin.named_modules() if isinstance(m, torch.nn.Linear)}
    assert converted <= linears, f"converted outside nn.Linear (no torchao twin): {converted - linears}"
    ref = torchao_float8(twin, recipe, module_filter_fn=lambda m, fqn: fqn in converted, pad_inner_dim=True)
    with count_gemm_flops() as ref_flops:
        with cpu_autocast_torchao(), torch.autocast("cpu", torch.bfloat16):
            loss_ref = loss_fn(ref(**inputs))
        loss_ref.backward()

    assert_bitwise(loss.detach(), loss_ref.detach(), f"{name} fp8={recipe}: loss")
    conv1d = {n for n, m in model.named_modules() if type(m).__name__ == "Conv1D"}
    assert_bitwise(
        {n: p.grad for n, p in ours.named_parameters()}, _ref_grads(model, ref), f"{name} fp8={recipe}: grads"
    )
    assert flops.fp8_share == ref_flops.fp8_share, (flops, ref_flops)
    assert flops.unaligned == 0, flops  # every _scaled_mm as a GPU takes it (padded where needed)

    # where amp_fx converts exactly the model's nn.Linear, ref is torchao on the model as it is
    originals = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    if conv1d or converted != originals:  # what torchao reaches on the model as it is
        as_is = torchao_float8(model, recipe)  # its Conv1D layers stay in bf16
        with count_gemm_flops() as as_is_flops:
            with cpu_autocast_torchao(), torch.autocast("cpu", torch.bfloat16):
                loss_fn(as_is(**inputs)).backward()
        assert as_is_flops.fp8_share <= flops.fp8_share, (as_is_flops, flops)
        if conv1d:
            assert as_is_flops.fp8_share < flops.fp8_share


def _ref_grads(model: torch.nn.Module, ref: torch.nn.Module) -> dict[str, torch.Tensor | None]:
    """The reference's gradients under the original's names and layouts: a ``Conv1D``'s twin
    weight is the transpose of the original's."""
    conv1d = {n for n, m in model.named_modules() if type(m).__name__ == "Conv1D"}
    grads = {}
    for n, p in ref.named_parameters():
        transposed = n.rpartition(".")[0] in conv1d and n.endswith("weight")
        grads[n] = p.grad.t() if transposed and p.grad is not None else p.grad
    return grads


# fp8="mxfp8": ConvNeXt in the default run (the cheapest case, 23 to 32 s on a loaded 2-core CPU;
# its 16-wide layers and 10-class head pad K, N and M to 32); the rest of the tier (all bitwise
# here, docs/fp8.md) is models_slow: 34 to 120 s a case there.
_MX_DEFAULT = {"hf_convnext"}


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:amp_fx. fp8='mxfp8' runs emulated here")
@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=() if n in _MX_DEFAULT else pytest.mark.models_slow) for n in TRANSFORMERS]
)
def test_mxfp8_bitwise_with_torchao_emulated_on_the_same_layers(name: str) -> None:
    """``fp8="mxfp8"``: one forward and backward, loss and every gradient bitwise with torchao's
    emulated MXFP8 linear (``torchao_mxfp8``: ``_to_mxfp8_then_scaled_mm(..., EMULATED, RCEIL)`` on
    the bf16 operands, zero-padded to multiples of 32 where a size is not one, as amp_fx pads) on
    the model's ``nn.Linear`` twin, converting exactly the layers amp_fx converted: every
    ``nn.Linear`` of the twin (GPT-2's ``Conv1D`` included), nothing else. Mixtral's router
    (no twin) and experts (fp32 in eager autocast) stay out, as in the float8 test above."""
    entry = REAL_MODELS[name]
    if entry.missing():
        pytest.skip(entry.missing())
    model, inputs, loss_fn = entry.build()
    ours = copy.deepcopy(model)
    policy = _twin_policy(entry, model)
    compiled = amp_fx.compile(ours, dtype="bf16", fp8="mxfp8", backend="aot_eager", strict=False, policy=policy)
    loss = loss_fn(compiled(**inputs))
    loss.backward()

    converted = {
        d.module for r in amp_fx.records(compiled) if r.fp8 is not None for d in r.fp8.decisions if d.converted
    }
    twin = linear_twin(model)
    assert converted == {n for n, m in twin.named_modules() if isinstance(m, torch.nn.Linear)}
    ref = torchao_mxfp8(twin, lambda m, fqn: fqn in converted, pad=True)
    with torch.autocast("cpu", torch.bfloat16):
        loss_ref = loss_fn(ref(**inputs))
    loss_ref.backward()
    assert_bitwise(loss.detach(), loss_ref.detach(), f"{name} fp8=mxfp8: loss")
    assert_bitwise({n: p.grad for n, p in ours.named_parameters()}, _ref_grads(model, ref), f"{name} fp8=mxfp8: grads")


@pytest.mark.slow
@pytest.mark.parametrize("name", [_shared(n) for n in ("hf_gpt2", "hf_llama", "hf_t5")])
def test_fp8_weight_cache_bitwise_on_real_models(name: str) -> None:
    """fp8 with ``weight_cache=True`` on GPT-2 (``Conv1D``: the weight read as it is), Llama (a
    linear's ``aten.t`` view) and T5 (tied embedding and head): 2 SGD steps of 2 micro-batches,
    every loss and parameter bitwise with the uncached fp8 run (the one the torchao test checks),
    and nothing reported (strict)."""
    entry = REAL_MODELS[name]
    if entry.missing():
        pytest.skip(entry.missing())
    uncached = _compiled(name)
    model, inputs, loss_fn = uncached["model"], uncached["inputs"], uncached["loss_fn"]
    runs = []
    for cached in (False, True):
        if cached:
            ours = copy.deepcopy(model)
            compiled = amp_fx.compile(
                ours, dtype="bf16", fp8="tensorwise", backend="aot_eager", weight_cache=True, strict=True
            )
        else:
            ours, compiled = uncached["ours"], uncached["compiled"]
        opt = torch.optim.SGD(ours.parameters(), lr=0.1)
        losses = []
        for _ in range(2):
            for _ in range(2):
                loss = loss_fn(compiled(**inputs))
                loss.backward()
                losses.append(loss.detach())
            opt.step()
            opt.zero_grad()
        runs.append((losses, {n: p.detach().clone() for n, p in ours.named_parameters()}))
    assert_bitwise(runs[1], runs[0], f"{name}: fp8 weight cache vs uncached")


def _float64_loss(model: torch.nn.Module, inputs: dict, loss_fn) -> float:
    return float(loss_fn(copy.deepcopy(model).double()(**inputs)).detach())


@pytest.mark.slow
@pytest.mark.parametrize("name", [_shared(n) for n in ("hf_gpt2", "hf_llama")])
def test_fp8_advise_on_real_models(name: str) -> None:
    """``amp_fx.advise(..., fp8="tensorwise")`` on GPT-2 (``Conv1D``) and Llama, random init: the
    fp8 run it measures is amp_fx's (the same matmuls as ``amp_fx.compile(fp8=...)`` converts, and
    the same loss error against float64, recomputed here from the compiled run), every matmul in
    fp8 meets the target (nothing kept out, one policy run), and every layer of these small models
    is too small to gain by torchao's rule. Then one Llama MLP gets a planted outlier (a channel of
    10**6 entering ``down_proj``, whose weights ignore it; its other weights 20x, so that its output
    dominates the residual stream and the damage reaches the output): the advice keeps that one
    ``Linear`` out of fp8, checked through amp_fx.compile against float64 (loss, gradients,
    outputs)."""
    entry = REAL_MODELS[name]
    if entry.missing():
        pytest.skip(entry.missing())
    shared = _compiled(name)
    model, inputs, loss_fn, compiled = shared["model"], shared["inputs"], shared["loss_fn"], shared["compiled"]
    advice = amp_fx.advise(model, dtype="bf16", fp8="tensorwise", loss_fn=loss_fn, **inputs)
    assert advice.keep_out_of_fp8 == () and advice.verified and advice.runs == 1, str(advice)
    loss = float(loss_fn(compiled(**inputs)).detach())
    converted = {
        d.module for r in amp_fx.records(compiled) if r.fp8 is not None for d in r.fp8.decisions if d.converted
    }
    assert {m.module for m in advice.fp8_matmuls} == converted and converted
    ref = _float64_loss(model, inputs, loss_fn)
    assert dict(advice.baseline_parts)["loss"] == abs(loss - ref) / abs(ref)
    assert set(advice.too_small_for_fp8) == converted
    if name != "hf_llama":
        return

    model = copy.deepcopy(model)  # the shared one stays as built
    leaf = "model.layers.1.mlp.down_proj"
    down = model.get_submodule(leaf)
    spike = torch.zeros(down.in_features)
    spike[0] = 1e6
    with torch.no_grad():
        down.weight.mul_(20.0)
        down.weight[:, 0] = 0.0
    down.register_forward_pre_hook(lambda m, args: (args[0] + spike.to(args[0].dtype),))
    advice = amp_fx.advise(model, dtype="bf16", fp8="tensorwise", loss_fn=loss_fn, **inputs)
    assert advice.keep_out_of_fp8 == (leaf,) and advice.verified and advice.runs == 2, str(advice)
    default = _amp_fx_error(model, (), loss_fn, "bf16", amp_fx.Policy(), fp8="tensorwise", **inputs)
    advised = _amp_fx_error(model, (), loss_fn, "bf16", advice.policy, fp8="tensorwise", **inputs)
    assert default > advice.target >= advised, (default, advised)


@pytest.mark.slow
@pytest.mark.parametrize("name", [_shared(n) for n in ("hf_gpt2", "hf_llama")])
def test_fp8_compare_on_real_models(name: str) -> None:
    """``amp_fx.compare(..., fp8="tensorwise")`` on GPT-2 (``Conv1D``) and Llama: every op, the
    outputs and every gradient agree bit for bit with eager autocast running the same matmuls in
    fp8 (torchao's numerics), and the ops compared as fp8 are exactly the matmuls amp_fx converted."""
    entry = REAL_MODELS[name]
    if entry.missing():
        pytest.skip(entry.missing())
    shared = _compiled(name)
    model, inputs, loss_fn, compiled = shared["model"], shared["inputs"], shared["loss_fn"], shared["compiled"]
    report = amp_fx.compare(model, dtype="bf16", fp8="tensorwise", loss_fn=loss_fn, **inputs)
    assert report.ok and report.grads, str(report)
    # a set: the shared compiled model holds the records of every graph it has compiled so far
    converted = sorted(
        {d.module for r in amp_fx.records(compiled) if r.fp8 is not None for d in r.fp8.decisions if d.converted}
    )
    assert sorted(o.module for o in report.ops if o.rule.startswith("fp8 tensorwise")) == converted and converted


@pytest.mark.skipif(_NO_ROWWISE is not None, reason=str(_NO_ROWWISE))
def test_bench_tier_gives_torchaos_rowwise_failure_as_a_cell() -> None:
    """``bench/bench_fp8.py --tier``: torchao 0.18's rowwise ``Float8Linear`` fails on a
    non-contiguous 3-D input (Mamba's ``x_proj`` gets a transposed view; its ``Float8TrainingTensor``
    cannot clone a rowwise-scaled tensor for the reshape). ``_torchao_flops`` returns why, and the
    table gets the row (its torchao cells ``-``) instead of the bench crashing; tensorwise counts."""
    import importlib
    import pathlib
    import sys

    bench = str(pathlib.Path(__file__).parents[2] / "bench")
    sys.path.insert(0, bench)
    try:
        module = importlib.import_module("bench_fp8")
    finally:
        sys.path.remove(bench)

    class _Transposed(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(32, 16)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x.transpose(1, 2))

    torch.manual_seed(0)
    inputs, loss = {"x": torch.randn(2, 32, 32)}, (lambda out: out.float().pow(2).mean())
    why = module._torchao_flops(_Transposed(), "rowwise", inputs, loss)
    assert isinstance(why, str) and "axiswise scaling is not supported" in why, why
    assert module._share(why, low=False) == "-"
    assert module._torchao_flops(_Transposed(), "tensorwise", inputs, loss).fp8_share == 1.0
