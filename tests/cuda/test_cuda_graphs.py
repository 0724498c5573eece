"""``amp_fx.compile(..., mode="reduce-overhead")``: inductor's CUDA graph trees with static parameters.

Inductor copies every non-static input of a graph into the graph's own buffer at each replay. The
parameters are static only if the graph amp_fx hands on carries Dynamo's input metadata
(``amp_fx/backend/dynamo_inputs.py``); without it every parameter was copied at every replay.
Inductor counts the non-static inputs of each graph it records
(``counters["inductor"]["cudagraph_recorded_non_static_inputs"]``): amp_fx's count must be
``torch.compile`` + autocast's on the same model (the batch, and in the backward the saved
activations and the incoming gradient: no parameter), and the replays must train as the same
compiled model without CUDA graphs does, bitwise (a replay that read stale parameters would not).
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
from torch import nn
from torch._dynamo.utils import counters

import amp_fx
from tests.cuda._gpu import GPU_TIER

pytestmark = GPU_TIER

_STEPS = 5


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 128), nn.GELU(), nn.Linear(128, 16)).cuda()


def _train(compiled: nn.Module, model: nn.Module, autocast: bool) -> list[torch.Tensor]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator(device="cuda").manual_seed(1)
    losses = []
    for _ in range(_STEPS):
        x = torch.randn(32, 64, device="cuda", generator=gen)
        with torch.autocast("cuda", torch.bfloat16, enabled=autocast):
            out = compiled(x)
        loss = out.float().square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach().clone())
    return losses


def _non_static_inputs(build: object, autocast: bool) -> tuple[int, int, list[torch.Tensor]]:
    torch._dynamo.reset()
    counters.clear()
    model = _model()
    losses = _train(build(model), model, autocast)  # type: ignore[operator]
    return (
        counters["inductor"]["cudagraph_recorded_non_static_inputs"],
        counters["inductor"]["cudagraph_skips"],
        losses,
    )


def test_reduce_overhead_replays_copy_no_parameter() -> None:
    n_params = len(list(_model().parameters()))
    ref, ref_skips, _ = _non_static_inputs(lambda m: torch.compile(m, mode="reduce-overhead"), autocast=True)
    ours, skips, losses = _non_static_inputs(
        lambda m: amp_fx.compile(m, dtype="bf16", mode="reduce-overhead"), autocast=False
    )
    assert (ref_skips, skips) == (0, 0), "a graph ran without CUDA graphs (cudagraph_skips)"
    assert ref > 0, "inductor recorded no CUDA graph"
    assert ref < n_params, f"torch.compile's graphs took {ref} non-static inputs for {n_params} parameters"
    assert ours == ref, (
        f"amp_fx's CUDA graphs copy {ours} inputs per replay, torch.compile + autocast's {ref}: "
        f"the parameters are not static"
    )
    _, _, plain = _non_static_inputs(lambda m: amp_fx.compile(m, dtype="bf16"), autocast=False)
    for step, (a, b) in enumerate(zip(losses, plain)):
        assert torch.equal(a, b), f"step {step}: loss {a.item()} with CUDA graphs, {b.item()} without"


@pytest.mark.parametrize("weight_cache", [False, True])
def test_reduce_overhead_trains_as_without_cuda_graphs(weight_cache: bool) -> None:
    """The weight cache adds inputs of its own (the parameters' casts, refreshed once per optimizer
    step): replays must still see each step's new weights."""
    _, skips, losses = _non_static_inputs(
        lambda m: amp_fx.compile(m, dtype="bf16", mode="reduce-overhead", weight_cache=weight_cache), autocast=False
    )
    _, _, plain = _non_static_inputs(
        lambda m: amp_fx.compile(m, dtype="bf16", weight_cache=weight_cache), autocast=False
    )
    assert skips == 0
    for step, (a, b) in enumerate(zip(losses, plain)):
        assert torch.equal(a, b), f"step {step}: loss {a.item()} with CUDA graphs, {b.item()} without"
