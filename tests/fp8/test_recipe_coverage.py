"""What works for fp8 works for ``blockwise`` and ``nvfp4`` (issue 60), or is refused, said once.

Each feature against the recipe's own eager kernel (:func:`amp_fx.kernels.blockwise_fp8.
blockwise_fp8_matmul`, :func:`amp_fx.kernels.nvfp4.nvfp4_matmul`) called on the autocast dtype's
input and the fp32 weight, the bias added after the GEMM, as the pass computes it: ``compile_step``,
``explain``, ``compare``'s and ``advise``'s eager side, FSDP2's all-gather (said to stay in high
precision), tensor parallelism on a one-rank mesh (which shardings convert, which are refused and
why). NVFP4 runs with stochastic rounding off where a test compares bits (the compiled backward
may draw its random numbers in another order than eager autograd); checkpoints are in
``tests/backend/test_checkpoint.py``, the weight cache in ``test_blockwise.py``/``test_nvfp4.py``.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import amp_fx
from amp_fx.errors import AmpFxError
from amp_fx.fp8 import Fp8Config, Fp8Recipe, Nvfp4Options
from amp_fx.inspect._fp8_eager import Fp8Eager, module_stack
from amp_fx.kernels import blockwise_fp8 as bw
from amp_fx.kernels import mxfp8_matmul as mx
from amp_fx.kernels import nvfp4 as nv
from amp_fx.testing import assert_bitwise, distributed

pytestmark = [
    pytest.mark.filterwarnings("ignore:amp_fx. fp8='nvfp4' runs emulated here"),
    pytest.mark.filterwarnings("ignore:amp_fx. fp8='blockwise' runs emulated here"),
    pytest.mark.filterwarnings("ignore:amp_fx. fp8='mxfp8' runs emulated here"),
]

_NO_SR = Nvfp4Options(stochastic_rounding=False)
CONFIGS = {"blockwise": Fp8Config("blockwise"), "nvfp4": Fp8Config("nvfp4", nvfp4=_NO_SR)}
RECIPES = list(CONFIGS)


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)  # 32 and 64: multiples of nvfp4's 16, padded to blockwise's 128
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32))


def _kernel(recipe: str, x: Tensor, w: Tensor) -> Tensor:
    if recipe == "nvfp4":
        return nv.nvfp4_matmul(x, w, options=_NO_SR)
    if recipe == "mxfp8":
        return mx.mxfp8_matmul(x, w, emulate=True)
    return bw.blockwise_fp8_matmul(x, w, emulate=True)


def _eager(model: nn.Sequential, x: Tensor, recipe: str) -> Tensor:
    """The reference: each Linear as the recipe's kernel on the bf16 input and the fp32 weight as
    ``[K, N]``, the bias added in bf16 after the GEMM; the ReLU in bf16."""
    h = x.bfloat16()
    for i, lin in enumerate((model[0], model[2])):
        h = _kernel(recipe, h, lin.weight.t()) + lin.bias.bfloat16()
        h = F.relu(h) if i == 0 else h
    return h


def _mse(out: Tensor, y: Tensor) -> Tensor:
    return (out.float() - y).pow(2).mean()


def _converted(compiled: object) -> list[tuple[str, bool, Fp8Recipe | None]]:
    return [(d.weight, d.converted, d.recipe) for r in amp_fx.records(compiled) if r.fp8 for d in r.fp8.decisions]


# --- compile_step ---------------------------------------------------------------------------------


@pytest.mark.slow_cases  # a compiled step and a traced optimizer: 12 s (blockwise), 20 s (nvfp4) here
@pytest.mark.parametrize("recipe", RECIPES)
def test_compile_step_is_bitwise_with_the_eager_kernel(recipe: str) -> None:
    """``compile_step(dtype="bf16", low_precision=recipe)``, 3 fused-AdamW steps: losses and
    parameters bitwise with the eager loop calling the recipe's kernel (fused AdamW: the same
    update kernel on both sides)."""
    model = _mlp()
    ours = copy.deepcopy(model)
    x, y = torch.randn(2, 8, 32), torch.randn(2, 8, 32)
    opt_ref = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    opt = torch.optim.AdamW(ours.parameters(), lr=1e-2, fused=True)
    step = amp_fx.compile_step(ours, opt, _mse, dtype="bf16", low_precision=CONFIGS[recipe], backend="aot_eager")
    losses, losses_ref = [], []
    for i in range(3):
        xs = x * (1 + i / 4)
        loss_ref = _mse(_eager(model, xs, recipe), y)
        loss_ref.backward()
        opt_ref.step()
        opt_ref.zero_grad()
        losses_ref.append(loss_ref.detach())
        losses.append(step(xs, y))
    assert_bitwise(losses, losses_ref, f"{recipe}: losses")
    assert_bitwise(dict(ours.named_parameters()), dict(model.named_parameters()), f"{recipe}: parameters")


@pytest.mark.slow_cases  # two compiled steps per case: 6 to 7 s here, more when the machine is loaded
@pytest.mark.parametrize("recipe", RECIPES)
def test_compile_step_weight_cache_is_bitwise_with_uncached(recipe: str) -> None:
    """``compile_step(weight_cache=True, accumulate=2, strict=True)`` (strict: a cache that fell
    back would raise), NVFP4 with TE's defaults (stochastic rounding on, seeded per step): 3
    fused-AdamW steps, losses and parameters bitwise with the same step uncached; the finish
    graph's update makes the next forward quantize the weights anew."""
    model = _mlp()
    x, y = torch.randn(2, 8, 32), torch.randn(2, 8, 32)
    runs = []
    for cached in (False, True):
        ours = copy.deepcopy(model)
        opt = torch.optim.AdamW(ours.parameters(), lr=1e-2, fused=True)
        options = {"weight_cache": cached, "accumulate": 2, "strict": True}
        step = amp_fx.compile_step(ours, opt, _mse, dtype="bf16", low_precision=recipe, backend="aot_eager", **options)
        losses = []
        for i in range(3):
            torch.manual_seed(i)
            losses.append(step(x * (1 + i), y))
        runs.append((losses, dict(ours.named_parameters())))
    assert_bitwise(runs[1], runs[0], f"{recipe}: cached against uncached")


def test_compile_step_refuses_fp16_for_nvfp4_and_not_for_blockwise() -> None:
    """NVFP4 quantizes bf16 operands (TE's recipe): fp16 is a ValueError naming both, at
    ``compile_step`` time; blockwise scales the fp32 weight and takes fp16 (the negative twin:
    no error building the step)."""
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"fp8='nvfp4' needs dtype=torch.bfloat16.*float16"):
        amp_fx.compile_step(model, opt, _mse, dtype="fp16", low_precision="nvfp4", backend="aot_eager")
    amp_fx.compile_step(model, opt, _mse, dtype="fp16", low_precision="blockwise", backend="aot_eager")


# --- explain, compare, advise ---------------------------------------------------------------------


@pytest.mark.parametrize("recipe", RECIPES)
def test_explain_shows_the_recipe_of_each_gemm_as_compile_decides_it(recipe: str) -> None:
    """``explain(low_precision=recipe)``: each matmul, its recipe, its padding, the same decisions
    as ``amp_fx.compile`` records (backend eager: the pass runs, the graph does not lower)."""
    x = torch.randn(2, 8, 32)
    report = amp_fx.explain(_mlp(), x, dtype="bf16", low_precision=CONFIGS[recipe])
    compiled = amp_fx.compile(_mlp(), dtype="bf16", low_precision=CONFIGS[recipe], backend="eager")
    compiled(x)
    expected = [("0.weight", True, Fp8Recipe(recipe)), ("2.weight", True, Fp8Recipe(recipe))]
    assert _converted(compiled) == expected
    explained = [(d.weight, d.converted, d.recipe) for r in report.records if r.fp8 for d in r.fp8.decisions]
    assert explained == expected
    text = report.fp8_text(0)
    assert text.count(f"  {recipe}  ") == 2, text
    if recipe == "blockwise":  # 32 and 64 padded to its 128; nvfp4's 16 divides both (no padding)
        assert "padded to multiples of 128" in text, text
    else:
        assert "padded" not in text, text


@pytest.mark.parametrize("recipe", RECIPES)
def test_compare_and_advise_run_the_recipe_on_their_eager_side(recipe: str) -> None:
    """The eager low-precision run ``compare`` and ``advise`` measure against (``Fp8Eager``): loss
    and gradients bitwise with the recipe's kernel called eagerly; ``compare`` agrees with it
    everywhere, bitwise, each Linear's rule the recipe, whose error against float64 is the recipe's
    (above bf16's rounding 2^-8 by far: > 2^-6); ``advise`` counts both GEMMs as low precision
    (before: 0.0 %, the emulated GEMMs ran ``torch.mm``, not ``_scaled_mm``)."""
    x = torch.randn(2, 8, 32)
    model, eager = _mlp(), _mlp()
    stack: list[str] = []
    with (
        module_stack(eager, stack),
        torch.autocast("cpu", torch.bfloat16),
        Fp8Eager(CONFIGS[recipe], torch.bfloat16, "cpu", stack, measure=False),
    ):
        loss = eager(x).float().pow(2).mean()
    loss.backward()
    ref_loss = _eager(model, x, recipe).float().pow(2).mean()
    ref_loss.backward()
    assert_bitwise(
        (loss.detach(), {n: p.grad for n, p in eager.named_parameters()}),
        (ref_loss.detach(), {n: p.grad for n, p in model.named_parameters()}),
        f"{recipe}: eager low-precision run against the kernel",
    )

    report = amp_fx.compare(_mlp(), x, dtype="bf16", low_precision=CONFIGS[recipe])
    assert report.first_divergence is None and all(o.agree for o in report.ops), str(report)
    assert all(v.agree for v in report.outputs) and report.grads and all(g.agree for g in report.grads)
    low = [o for o in report.ops if o.rule.startswith(f"fp8 {recipe}") or o.rule.startswith(recipe)]
    assert len(low) == 2, str(report)
    assert all(o.error_vs_reference is not None and o.error_vs_reference.rel > 2**-6 for o in low), str(report)

    advice = amp_fx.advise(
        _mlp(), x, dtype="bf16", low_precision=CONFIGS[recipe], loss_fn=lambda o: o.float().pow(2).mean()
    )
    assert advice.cost.fp8_flop_share == advice.cost.default_fp8_flop_share == 1.0, str(advice)


# --- FSDP2 and tensor parallelism on one rank -----------------------------------------------------


@pytest.fixture
def one_rank() -> Iterator[None]:
    if not torch.distributed.is_available():
        pytest.skip("torch built without torch.distributed")
    with distributed.one_rank():
        yield


@pytest.mark.usefixtures("one_rank")
@pytest.mark.parametrize("recipe", RECIPES)
def test_fsdp2_says_once_that_block_scaled_weights_gather_in_high_precision(recipe: str) -> None:
    """FSDP2 (one rank, gloo): amp_fx's low-precision all-gather is tensorwise only; a blockwise or
    nvfp4 model is told so at compile time, naming each weight and its recipe, the reason and the
    fix (``AmpFxWarning``; ``strict=True``: an ``AmpFxError``). The negative twin: with
    ``MixedPrecisionPolicy(param_dtype=bf16)`` the weights gather in 2 bytes already: nothing said."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    def sharded(param_dtype: torch.dtype | None = None) -> nn.Module:
        model = _mlp()
        mp = MixedPrecisionPolicy(param_dtype=param_dtype)
        for m in (model[0], model[2], model):
            fully_shard(m, mp_policy=mp)
        return model

    with pytest.warns(amp_fx.AmpFxWarning) as seen:
        amp_fx.compile(sharded(), dtype="bf16", low_precision=recipe, backend="aot_eager", strict=False)
    said = [str(w.message) for w in seen if "all-gathers" in str(w.message)]
    assert len(said) == 1, said
    assert f"0.weight ({recipe}), 2.weight ({recipe}) in fp32" in said[0], said[0]
    assert "tensorwise fp8 only" in said[0] and "MixedPrecisionPolicy(param_dtype=torch.bfloat16)" in said[0]
    with pytest.raises(AmpFxError, match="all-gathers 0.weight"):
        amp_fx.compile(sharded(), dtype="bf16", low_precision=recipe, backend="aot_eager", strict=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        amp_fx.compile(sharded(torch.bfloat16), dtype="bf16", low_precision=recipe, backend="aot_eager", strict=False)


@pytest.mark.usefixtures("one_rank")
@pytest.mark.parametrize("recipe", [*RECIPES, "mxfp8"])
def test_tensor_parallel_shardings_each_recipe_takes_and_refuses(recipe: str) -> None:
    """A Colwise/Rowwise MLP on a one-rank mesh. The row-parallel Linear's input is sharded on its
    contraction dimension, which each recipe scales along (blocks of 128, 16 or mxfp8's 32): kept
    in bf16 and said (mxfp8's before: converted). The column-parallel one: blockwise and mxfp8
    convert it, its output bitwise the kernel's on the plain model; nvfp4 refuses any DTensor
    operand (its emulated GEMM unpacks codes through a lookup table DTensor has no rule for:
    before, the pass failed and the whole graph fell back to bf16, saying no matmul was found),
    said, strict an error."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    model, x = _mlp(), torch.randn(4, 32)
    plain = copy.deepcopy(model)
    parallelize_module(model, init_device_mesh("cpu", (1,)), {"0": ColwiseParallel(), "2": RowwiseParallel()})
    compiled = amp_fx.compile(model, dtype="bf16", low_precision=recipe, backend="aot_eager", strict=False)
    with pytest.warns(amp_fx.AmpFxWarning) as seen:
        compiled(x)
    said = " | ".join(str(w.message) for w in seen)
    decisions = {d.weight: d for r in amp_fx.records(compiled) if r.fp8 for d in r.fp8.decisions}
    assert not decisions["2.weight"].converted
    assert "contraction dimension sharded" in decisions["2.weight"].reason
    assert "contraction dimension is sharded" in said or "scales on a contraction dimension" in said, said
    if recipe != "nvfp4":
        assert decisions["0.weight"].converted and decisions["0.weight"].recipe is Fp8Recipe(recipe)
        h = _kernel(recipe, x.bfloat16(), plain[0].weight.t()) + plain[0].bias.bfloat16()
        got = amp_fx.compile(model[0], dtype="bf16", low_precision=recipe, backend="aot_eager")(x)
        assert_bitwise(got.full_tensor() if hasattr(got, "full_tensor") else got, h, f"column-parallel {recipe}")
    else:
        assert not decisions["0.weight"].converted
        assert "nvfp4 takes no DTensor operand" in decisions["0.weight"].reason
        assert "nvfp4 takes no DTensor operand" in said, said
        strict = amp_fx.compile(model, dtype="bf16", low_precision=recipe, backend="aot_eager", strict=True)
        with pytest.raises(AmpFxError, match="nvfp4 takes no DTensor operand"):
            strict(x)
