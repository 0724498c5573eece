"""The weight cache with fp8: each weight's fp8 casts made once per optimizer step, with
``compile_step`` and under inductor, parameters only.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from torch import Tensor, nn

import amp_fx
from amp_fx.testing import assert_bitwise
from amp_fx.testing.fp8_reference import (
    torchao_missing,
)
from tests.fp8._fp8_cases import (
    RECIPES,
    compile_fp8,
    loss_fn,
    mlp,
    sgd_uncached_and_cached,
)

pytestmark = pytest.mark.skipif(torchao_missing() is not None, reason=str(torchao_missing()))


def _weight_amaxes(model: nn.Module, run: Callable[[], None]) -> int:
    """How many amaxes (``aten::max`` for a tensorwise scale, ``aten::amax`` for a rowwise one:
    torchao's ``tensor_to_amax``) ran on a tensor of one of ``model``'s 2-D weights' shapes (either
    orientation), counted at the dispatcher by the profiler (eager code, the weight cache and
    compiled graphs alike), outermost calls only. The inputs' and gradients' shapes must differ
    from every weight's (the callers use 80 rows)."""
    shapes = {tuple(p.shape)[::k] for p in model.parameters() if p.dim() == 2 for k in (1, -1)}
    names = ("aten::max", "aten::amax")
    with torch.profiler.profile(record_shapes=True) as prof:
        run()
    return sum(
        1
        for e in prof.events()
        if e.name in names
        and e.input_shapes
        and tuple(e.input_shapes[0]) in shapes
        and (e.cpu_parent is None or e.cpu_parent.name not in names)
    )


@pytest.mark.slow
@pytest.mark.parametrize("recipe", RECIPES)
def test_weight_cache_casts_fp8_weights_once_per_optimizer_step(recipe: str) -> None:
    """weight_cache=True with fp8: each weight's amax, scale and fp8 casts are computed once per
    optimizer step and reused by every micro-batch. 3 SGD steps of 4 accumulated micro-batches:
    losses and parameters bitwise with the uncached fp8 run (the same ops on the same values:
    ``weight_casts`` is the uncached path's own code), and, counted from the executed ops, the
    uncached run takes the weights' amaxes in every micro-batch, the cached one in the first
    micro-batch after each optimizer step only. strict=True: nothing is said to be left undone."""
    model, _ = mlp()
    batches = torch.randn(4, 5, 16, 32)  # 80 rows: no activation has a weight's shape
    runs = {}
    for cached in (False, True):
        ours = copy.deepcopy(model)
        compiled = amp_fx.compile(ours, dtype="bf16", fp8=recipe, backend="aot_eager", weight_cache=cached, strict=True)
        opt = torch.optim.SGD(ours.parameters(), lr=0.5)
        losses, amaxes = [], []
        for step in range(3):
            for mb in batches * (step + 1):

                def micro_batch(mb: Tensor = mb) -> None:
                    loss = loss_fn(compiled(mb))
                    loss.backward()
                    losses.append(loss.detach())

                amaxes.append(_weight_amaxes(ours, micro_batch))
            opt.step()
            opt.zero_grad()
        runs[cached] = losses, dict(ours.named_parameters()), amaxes[4:]  # after step 0 (it compiles)
    (plain_losses, plain_params, plain_amaxes), (losses, params, amaxes) = runs[False], runs[True]
    assert_bitwise(losses, plain_losses, "losses")
    assert_bitwise(params, plain_params, "parameters")
    assert plain_amaxes[0] > 0 and plain_amaxes == plain_amaxes[:1] * 8, plain_amaxes
    assert amaxes[0] > 0 and amaxes == (amaxes[:1] + [0, 0, 0]) * 2, amaxes


def test_weight_cache_fp8_casts_follow_the_compiled_step() -> None:
    """compile_step(weight_cache=True, fp8=..., accumulate=2) with a non-fused AdamW (its update
    traced into the finish graph, which rewrites the bf16 copies; the fp8 casts are recomputed by
    the next forward): 3 steps bitwise with the same step uncached."""
    model, _ = mlp()
    batches = torch.randn(6, 5, 16, 32)
    target = torch.randn(5, 16, 16)

    def mse(out: Tensor, y: Tensor) -> Tensor:
        return (out.float() - y).pow(2).mean()

    runs = []
    for cached in (False, True):
        ours = copy.deepcopy(model)
        opt = torch.optim.AdamW(ours.parameters(), lr=1e-2)
        step = amp_fx.compile_step(
            ours,
            opt,
            mse,
            dtype="bf16",
            fp8="tensorwise",
            backend="aot_eager",
            accumulate=2,
            weight_cache=cached,
            strict=True,
        )
        losses = [step(x, target) for x in batches]
        runs.append((losses, dict(ours.named_parameters())))
    assert_bitwise(runs[1], runs[0], "compile_step with the fp8 weight cache vs without")


@pytest.mark.slow
@pytest.mark.primary
def test_weight_cache_fp8_under_inductor_bitwise_when_casts_round() -> None:
    """Under inductor with ``emulate_precision_casts`` (its fp8 numerics then are torchao's eager
    ones: test_inductor_bitwise_with_torchao_when_casts_round), the cached casts (computed in
    eager) are bitwise with the uncached build's: 2 SGD steps of 2 micro-batches."""
    model, _ = mlp()
    batches = torch.randn(2, 5, 16, 32)
    runs = sgd_uncached_and_cached(
        model,
        [batches * (step + 1) for step in range(2)],
        lr=0.5,
        fp8="tensorwise",
        backend="inductor",
        options={"emulate_precision_casts": True},
    )
    assert_bitwise(runs[1], runs[0], "inductor, fp8 weight cache vs without")


def test_only_parameters_count_as_weights() -> None:
    """A buffer, and an input that requires grad, as the right operand: not a layer's weight, not
    fp8 (the negative twins of x @ W on a parameter)."""

    class NotWeights(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.randn(32, 32) / 6)
            self.register_buffer("b", torch.randn(32, 32) / 6)

        def forward(self, x: Tensor, y: Tensor) -> Tensor:
            return (x @ self.w) @ self.b @ y

    model = NotWeights()
    compiled = compile_fp8(model, "tensorwise")
    compiled(torch.randn(16, 32), torch.randn(32, 16, requires_grad=True))
    (record,) = compiled.amp_fx_records
    assert [(d.weight, d.converted) for d in record.fp8.decisions] == [("w", True)]
    assert len([n for n in record.rewritten.graph.nodes if n.target is torch.ops.aten.matmul.default]) == 2
