"""The model, optimizers, batches and runs that tests/step/test_step.py and the GPU tier's
tests/cuda/test_cuda_step.py share: one home, on any device.

Overflows are injected by planting a value in an input batch: 1e6 makes the fp16 matmul overflow
(|x| * |w| * 8 inputs > 65504), inf poisons fp16 and bf16 alike.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch._dynamo.utils import counters

from amp_fx.scaler import GradScaler, ScalerMode, StepMode
from amp_fx.step import GradNorm, compile_step
from amp_fx.testing import HostSyncCounter, eager_amp_step

# Non-fused Adam/AdamW traced by Dynamo (compile_step, on one device and on FSDP2 shards) take
# the step counter as a tensor: the bias corrections
# 1 - beta**t are computed in fp32 instead of Python's fp64, off by up to 2^-24 / (1 - beta2**t)
# relative (2^-14 at t=1 with beta2=0.999; halved by the sqrt), so the first compiled update is
# off by a few 2^-17 relative. The parameters then differ in their last bits, which can flip an
# fp16 rounding in the next forward or backward: a gradient element off by half an fp16 ulp
# (2^-11 relative), doubled because the errors of a matmul's two operands add; Adam's update
# m / sqrt(v) inherits that to first order. Bound: 2^-10 of each parameter's cumulative
# movement (measured worst over 10 steps with overflows: 2^-12.5).
ADAM_TRACED_RTOL = 2**-10


def make_model(seed: int = 0, *, device: str = "cpu") -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.GELU(), torch.nn.Linear(16, 4)
    ).to(device)


OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "adam_fused": lambda p: torch.optim.Adam(p, lr=1e-2, fused=True),
    "adamw_fused": lambda p: torch.optim.AdamW(p, lr=1e-2, fused=True),
    "sgd_fused": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, fused=True),
    "sgd_momentum": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True),
    "adam": lambda p: torch.optim.Adam(p, lr=1e-2, weight_decay=0.01),
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-2),
    "sgd_plain": lambda p: torch.optim.SGD(p, lr=0.05),  # keeps no optimizer state
    "rmsprop": lambda p: torch.optim.RMSprop(p, lr=1e-2),
    "rmsprop_momentum": lambda p: torch.optim.RMSprop(p, lr=1e-2, momentum=0.9),
    "adadelta": lambda p: torch.optim.Adadelta(p, lr=1.0),
    "adagrad": lambda p: torch.optim.Adagrad(p, lr=1e-2),  # creates its state in the constructor
    "adamax": lambda p: torch.optim.Adamax(p, lr=1e-2),
    "nadam": lambda p: torch.optim.NAdam(p, lr=1e-2),
    "radam": lambda p: torch.optim.RAdam(p, lr=1e-2),
    "asgd": lambda p: torch.optim.ASGD(p, lr=1e-2),
}


def make_batches(
    n: int, poison: dict[int, float], seed: int = 1, *, device: str = "cpu"
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``n`` (x, y) batches drawn on the CPU (the same values on every device), ``poison[i]``
    planted in batch i, then moved to ``device``."""
    g = torch.Generator().manual_seed(seed)
    batches = []
    for i in range(n):
        x, y = torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)
        if i in poison:
            x[0, 0] = poison[i]
        batches.append((x.to(device), y.to(device)))
    return batches


def scalers(dtype: torch.dtype, *, device: str = "cpu") -> tuple[GradScaler, torch.amp.GradScaler]:
    """(ours, the reference's): growth_interval=3 so that the run also grows the scale."""
    if dtype == torch.bfloat16:
        # torch's scaler has no check-only mode; amp_fx's (bitwise torch's in every other
        # respect, tests/scaler/test_scaler.py) is the reference here, in its eager host-sync mode.
        return (
            GradScaler(device, mode=ScalerMode.CHECK_ONLY, step_mode=StepMode.MASKED),
            GradScaler(device, mode=ScalerMode.CHECK_ONLY),
        )
    return (
        GradScaler(device, growth_interval=3, step_mode=StepMode.MASKED),
        torch.amp.GradScaler(device, growth_interval=3),
    )


def run(
    step: Callable[..., torch.Tensor],
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    scaler: torch.amp.GradScaler,
    model: torch.nn.Module,
    accumulate: int,
) -> dict[str, list[torch.Tensor]]:
    out: dict[str, list[torch.Tensor]] = {"loss": [], "scale": [], "params": [], "init": [flat_params(model)]}
    for i, (x, y) in enumerate(batches):
        out["loss"].append(step(x, y).clone())
        if (i + 1) % accumulate == 0:
            out["scale"].append(scaler._scale.clone())
            out["params"].append(flat_params(model))
    return out


def flat_params(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten().clone() for p in model.parameters()])


def run_pair(
    *,
    dtype: torch.dtype,
    opt_name: str,
    accumulate: int,
    clip: float | None,
    grad_norm: GradNorm | None,
    backend: str,
    poison: dict[int, float],
    n: int,
    device: str = "cpu",
) -> tuple[dict[str, list[torch.Tensor]], dict[str, list[torch.Tensor]], Any]:
    """compile_step and the eager recipe on identical models and batches on ``device``;
    ``grad_norm`` None: compile_step's default."""
    ours_scaler, ref_scaler = scalers(dtype, device=device)
    model, ref_model = make_model(device=device), make_model(device=device)
    opt, ref_opt = OPTIMIZERS[opt_name](model.parameters()), OPTIMIZERS[opt_name](ref_model.parameters())
    loss_fn = torch.nn.functional.mse_loss
    options = {} if grad_norm is None else {"grad_norm": grad_norm}
    step = compile_step(
        model,
        opt,
        loss_fn,
        dtype=dtype,
        scaler=ours_scaler,
        max_grad_norm=clip,
        accumulate=accumulate,
        backend=backend,
        **options,
    )
    ref_step = eager_amp_step(
        ref_model, ref_opt, loss_fn, ref_scaler, dtype=dtype, accumulate=accumulate, max_grad_norm=clip
    )
    batches = make_batches(n, poison, device=device)
    ours = run(step, batches, ours_scaler, model, accumulate)
    ref = run(ref_step, batches, ref_scaler, ref_model, accumulate)
    return ours, ref, step


# Overflows at micro-batches 2..4 (three windows in a row with accumulate=1, a window straddled
# with accumulate=2) and at 7; growth happens after 3 clean windows.
FP16_POISON = {2: 1e6, 3: 1e6, 4: math.inf, 7: 1e6}
BF16_POISON = {2: math.inf, 3: math.inf, 7: -math.inf}


def assert_steps_are_sync_free(step: Callable[..., torch.Tensor], batches: list[Any]) -> None:
    """The steps read nothing on the host, break no graph and compile nothing new."""
    graphs = step.graphs_compiled
    breaks = sum(counters["graph_break"].values())
    with HostSyncCounter() as syncs:
        for x, y in batches:
            step(x, y)
    assert syncs.count == 0, f"host reads in a step: {syncs.names}"
    # Reads inside an ATen kernel: only the CPU kernels of fused optimizers reading their CPU
    # step counters (HostSyncCounter's docstring), at most one per parameter and step.
    n_params = sum(1 for _ in step.model.parameters())
    allowed = n_params * len(batches) if step._fused else 0
    assert syncs.in_cpu_kernels <= allowed, (
        f"{syncs.in_cpu_kernels} host reads inside ATen ops (at most {allowed} allowed): "
        f"{sorted(set(syncs.in_kernel_names))}"
    )
    assert sum(counters["graph_break"].values()) == breaks == 0
    assert step.graphs_compiled == graphs
