"""Per-step time, collectives and host reads per step: eager DDP/FSDP2 recipes against amp_fx.

    python bench/bench_ddp.py [--dtype fp16] [--backend aot_eager|inductor] [--rounds 5] [--steps 10]

Two gloo ranks on this machine (127.0.0.1), one thread each. Every configuration trains the same
MLP on the same batches; rounds are interleaved (one round = ``--steps`` steps of each
configuration in turn) so that load on a shared machine hits all of them alike. Printed per
configuration, by rank 0: the median step time as a ratio to its eager baseline (DDP rows to
eager DDP, FSDP2 rows to eager FSDP2) with the spread of the per-round ratios, and from one
profiled round: gloo collectives per step, and host reads of a tensor value per step as the
tests count them (``amp_fx.testing.HostSyncCounter``: reads by the code under test, not reads a
CPU kernel makes of its own CPU memory). Only ratios are printed: absolute CPU times say nothing
about a GPU. On CPU the "device" is the host, so a host read costs little here; on GPUs each is
a stream synchronisation.

The amp_fx rows are ``amp_fx.compile`` + ``amp_fx.GradScaler`` (``StepMode.MASKED`` where no host
read is wanted), and ``amp_fx.compile_step`` on the DDP model, without and with the weight cache
(``weight_cache=True``: the finish graph writes each weight's low-precision copy with the update,
so the forward casts no weight), and on the FSDP2 model. Collectives are profiler events
(``gloo:*``): an ``async_op=True`` collective (ShardedGradScaler's flag) shows as two.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import amp_fx
from amp_fx.testing import HostSyncCounter
from amp_fx.testing.bench import machine_lines
from amp_fx.testing.distributed import run_ranks

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(128, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 16))


def _shard(model: nn.Module) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    for m in model:
        if isinstance(m, nn.Linear):
            fully_shard(m)
    fully_shard(model)
    return model


StepFn = Callable[[torch.Tensor, torch.Tensor], None]


def _configs(dtype: str, backend: str) -> dict[str, tuple[str, Callable[[], StepFn]]]:
    """name -> (baseline name, builder of a step function)."""
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
    from torch.nn.parallel import DistributedDataParallel as DDP

    low = DTYPES[dtype]

    def recipe(
        model: nn.Module, forward: Callable[..., torch.Tensor], scaler: Any, autocast: bool
    ) -> Callable[[torch.Tensor, torch.Tensor], None]:
        opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)

        def step(x: torch.Tensor, y: torch.Tensor) -> None:
            if autocast:
                with torch.autocast("cpu", dtype=low):
                    loss = F.mse_loss(forward(x).float(), y)
            else:
                loss = F.mse_loss(forward(x).float(), y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)

        return step

    def eager_ddp() -> Callable[..., None]:
        m = _model()
        return recipe(m, DDP(m), torch.amp.GradScaler("cpu"), True)

    def amp_ddp(step_mode: amp_fx.StepMode) -> Callable[[], Callable[..., None]]:
        def build() -> Callable[..., None]:
            m = _model()
            ddp = DDP(amp_fx.compile(m, dtype=dtype, backend=backend))
            return recipe(m, ddp, amp_fx.GradScaler("cpu", step_mode=step_mode), False)

        return build

    def step_ddp(weight_cache: bool = False) -> Callable[..., None]:
        m = _model()
        step = amp_fx.compile_step(
            DDP(m),
            torch.optim.SGD(m.parameters(), lr=1e-3, momentum=0.9),
            lambda out, y: F.mse_loss(out.float(), y),
            dtype=dtype,
            backend=backend,
            scaler=amp_fx.GradScaler("cpu", step_mode=amp_fx.StepMode.MASKED),
            weight_cache=weight_cache,
        )

        def run(x: torch.Tensor, y: torch.Tensor) -> None:
            step(x, y)

        return run

    def eager_fsdp() -> Callable[..., None]:
        m = _shard(_model())
        return recipe(m, m, ShardedGradScaler("cpu"), True)

    def step_fsdp() -> Callable[..., None]:
        m = _shard(_model())
        step = amp_fx.compile_step(
            m,
            torch.optim.SGD(m.parameters(), lr=1e-3, momentum=0.9),
            lambda out, y: F.mse_loss(out.float(), y),
            dtype=dtype,
            backend=backend,
            scaler=amp_fx.GradScaler("cpu", step_mode=amp_fx.StepMode.MASKED),
        )

        def run(x: torch.Tensor, y: torch.Tensor) -> None:
            step(x, y)

        return run

    def amp_fsdp() -> Callable[..., None]:
        m = _shard(_model())
        compiled = amp_fx.compile(m, dtype=dtype, backend=backend)
        return recipe(m, compiled, amp_fx.GradScaler("cpu", step_mode=amp_fx.StepMode.MASKED), False)

    return {
        "eager DDP + autocast + torch.amp.GradScaler": ("", eager_ddp),
        "DDP(amp_fx.compile(m)) + amp_fx.GradScaler": (
            "eager DDP + autocast + torch.amp.GradScaler",
            amp_ddp(amp_fx.StepMode.HOST_SYNC),
        ),
        "DDP(amp_fx.compile(m)) + GradScaler(MASKED)": (
            "eager DDP + autocast + torch.amp.GradScaler",
            amp_ddp(amp_fx.StepMode.MASKED),
        ),
        "amp_fx.compile_step(DDP(m))": ("eager DDP + autocast + torch.amp.GradScaler", step_ddp),
        "amp_fx.compile_step(DDP(m), weight_cache=True)": (
            "eager DDP + autocast + torch.amp.GradScaler",
            lambda: step_ddp(weight_cache=True),
        ),
        "eager FSDP2 + autocast + ShardedGradScaler": ("", eager_fsdp),
        "amp_fx.compile(FSDP2 m) + GradScaler(MASKED)": ("eager FSDP2 + autocast + ShardedGradScaler", amp_fsdp),
        "amp_fx.compile_step(FSDP2 m)": ("eager FSDP2 + autocast + ShardedGradScaler", step_fsdp),
    }


def _bench(rank: int, world_size: int, dtype: str, backend: str, rounds: int, steps: int) -> dict[str, Any]:
    configs = _configs(dtype, backend)
    gen = torch.Generator().manual_seed(rank)
    batches = [(torch.randn(32, 128, generator=gen), torch.randn(32, 16, generator=gen)) for _ in range(steps)]
    fns = {name: build() for name, (_, build) in configs.items()}
    for fn in fns.values():  # warm-up: compile, create optimizer state
        for x, y in batches[:3]:
            fn(x, y)
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            start = time.perf_counter()
            for x, y in batches:
                fn(x, y)
            times[name].append((time.perf_counter() - start) / steps)
    counts: dict[str, tuple[float, float]] = {}
    for name, fn in fns.items():
        with torch.profiler.profile() as prof:
            for x, y in batches:
                fn(x, y)
        collectives = sum(e.name.startswith("gloo:") for e in prof.events())
        with HostSyncCounter() as reads:  # the tests' counter: outermost host reads only
            for x, y in batches:
                fn(x, y)
        counts[name] = (collectives / steps, reads.count / steps)
    return {"times": times, "counts": counts, "baselines": {name: base for name, (base, _) in configs.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtype", default="fp16", choices=list(DTYPES))
    parser.add_argument("--backend", default="aot_eager")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    result = run_ranks(_bench, args.dtype, args.backend, args.rounds, args.steps)[0]
    times, counts, baselines = result["times"], result["counts"], result["baselines"]
    for line in machine_lines():
        print(line)
    print(
        f"2 gloo ranks, 1 thread each, dtype {args.dtype}, backend {args.backend}, "
        f"{args.rounds} interleaved rounds x {args.steps} steps (rank 0's timings)"
    )
    print(
        f"{'configuration':48s} {'time ratio':>10s} {'spread':>15s} {'collectives/step':>17s} {'host reads/step':>16s}"
    )
    for name, per_round in times.items():
        base = baselines[name]
        if base:
            ratios = [t / b for t, b in zip(per_round, times[base])]
            ratio, spread = (f"{statistics.median(ratios):.2f}", f"{min(ratios):.2f}-{max(ratios):.2f}")
        else:
            ratio, spread = "1.00", "(baseline)"
        collectives, reads = counts[name]
        print(f"{name:48s} {ratio:>10s} {spread:>15s} {collectives:17.1f} {reads:16.1f}")


if __name__ == "__main__":
    main()
