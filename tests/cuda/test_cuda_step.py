"""amp_fx.compile_step on CUDA: no host sync after warm-up, eager-AMP trajectories, CUDA graphs.

The CUDA twin of tests/step/test_step.py, with its model, optimizers, poisoned batches and checks
(tests/step/_step_cases.py):

* after warm-up a step reads nothing on the host (the profiler sees every ``.item()``-like call,
  in compiled code too) and compiles and breaks nothing;
* the trajectory (losses, scale history, parameters) with fp16 overflows injected is bitwise
  eager ``torch.autocast("cuda")`` + ``torch.amp.GradScaler("cuda")`` under ``aot_eager``;
* the whole step captured once as a CUDA graph (``torch.cuda.graph``) and replayed gives the
  same losses and parameters, bitwise, as calling the step each time. Capture itself fails on
  any host sync, so it is a second, independent sync check.
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo

from amp_fx.step import GradNorm, compile_step
from amp_fx.testing import assert_bitwise
from tests.cuda._gpu import GPU_TIER
from tests.step._step_cases import (
    BF16_POISON,
    FP16_POISON,
    OPTIMIZERS,
    assert_steps_are_sync_free,
    flat_params,
    make_batches,
    make_model,
    run_pair,
)

pytestmark = GPU_TIER


_CASES = [
    # dtype, optimizer, accumulate, clip, grad_norm
    (torch.float16, "adam_fused", 1, None, GradNorm.FUSED),
    (torch.float16, "sgd_momentum", 1, 0.5, GradNorm.TORCH),
    (torch.float16, "adamw_fused", 2, 0.5, GradNorm.TORCH),
    (torch.bfloat16, "adam_fused", 1, None, GradNorm.FUSED),
]


@pytest.mark.parametrize(
    "dtype,opt_name,accumulate,clip,grad_norm", _CASES, ids=lambda v: getattr(v, "name", str(v).replace("torch.", ""))
)
def test_cuda_aot_eager_trajectory_is_bitwise_eager_amp(
    dtype: torch.dtype, opt_name: str, accumulate: int, clip: float | None, grad_norm: GradNorm
) -> None:
    ours, ref, step = run_pair(
        dtype=dtype,
        opt_name=opt_name,
        accumulate=accumulate,
        clip=clip,
        grad_norm=grad_norm,
        backend="aot_eager",
        n=10,
        device="cuda",
        poison=FP16_POISON if dtype == torch.float16 else BF16_POISON,
    )
    for key in ("loss", "scale", "params"):
        for i, (a, e) in enumerate(zip(ours[key], ref[key], strict=True)):
            assert_bitwise(a, e, f"{key}[{i}]")
    assert int(step.skipped_steps) > 0, "the poisoned batches must have skipped steps"


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("opt_name", ["adam_fused", "sgd_momentum", "adam"])
def test_cuda_no_host_sync_after_warm_up(opt_name: str, backend: str) -> None:
    model = make_model(device="cuda")
    step = compile_step(
        model,
        OPTIMIZERS[opt_name](model.parameters()),
        torch.nn.functional.mse_loss,
        max_grad_norm=1.0,
        backend=backend,
    )
    for x, y in make_batches(3, {}, device="cuda"):
        step(x, y)
    assert_steps_are_sync_free(step, make_batches(4, {1: 1e6}, seed=3, device="cuda"))


# torch refuses to capture an Adam step in a CUDA graph unless ``capturable=True`` ("Attempting
# CUDA graph capture of step() for an instance of Adam but param_groups' capturable is False",
# seen on an H200): the optimizers as a user captures them.
_GRAPHED = {
    "adam_fused": lambda p: torch.optim.Adam(p, lr=1e-2, fused=True, capturable=True),
    "adam_capturable": lambda p: torch.optim.Adam(p, lr=1e-2, capturable=True),
    "sgd_momentum": OPTIMIZERS["sgd_momentum"],
}


@pytest.mark.parametrize("opt_name", list(_GRAPHED))
def test_cuda_graph_replay_is_bitwise_the_plain_step(opt_name: str) -> None:
    """Warm up both runs alike (the optimizer creates its state, the first step may read the
    flag once), then run the same batches through the plain step and through replays of one
    captured CUDA graph of it."""
    warm = make_batches(3, {}, device="cuda")
    batches = make_batches(8, {2: 1e6, 5: float("inf")}, seed=4, device="cuda")
    results = {}
    for graphed in (False, True):
        torch._dynamo.reset()
        model = make_model(device="cuda")
        step = compile_step(
            model,
            _GRAPHED[opt_name](model.parameters()),
            torch.nn.functional.mse_loss,
            dtype=torch.float16,
            max_grad_norm=1.0,
            backend="inductor",
        )
        static_x, static_y = (t.clone() for t in warm[0])
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for x, y in warm:
                static_x.copy_(x)
                static_y.copy_(y)
                step(static_x, static_y)
        torch.cuda.current_stream().wait_stream(side)
        losses = []
        if graphed:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                static_loss = step(static_x, static_y)
            for x, y in batches:
                static_x.copy_(x)
                static_y.copy_(y)
                graph.replay()
                losses.append(static_loss.clone())
        else:
            for x, y in batches:
                static_x.copy_(x)
                static_y.copy_(y)
                losses.append(step(static_x, static_y).clone())
        torch.cuda.synchronize()
        results[graphed] = (losses, flat_params(model), step.scale.clone(), step.skipped_steps.clone())
    plain, replayed = results[False], results[True]
    for i, (a, e) in enumerate(zip(replayed[0], plain[0], strict=True)):
        assert_bitwise(a, e, f"loss[{i}]")
    assert_bitwise(replayed[1], plain[1], "parameters")
    assert_bitwise(replayed[2], plain[2], "scale")
    assert_bitwise(replayed[3], plain[3], "skipped steps")
    assert int(plain[3]) == 2, "the two poisoned batches must be skipped"
