"""What the fp8 monitor costs per training step (issue 64): ``monitor=Fp8Monitor(every=1)`` (every
step a logging step), ``every=100`` (the usual schedule) and off, on the same model and recipe.

The model: ``--layers`` blocks of two ``nn.Linear`` (``--width`` to 4x and back, GELU), a
linear head; every Linear runs in ``--recipe``; SGD on a fixed batch of ``--batch`` x ``--width``.
All three variants are compiled in one process and run interleaved (rounds of ``--steps`` steps
of each), so drift and other processes affect them alike; the table gives, per variant, each
round's median step time and its ratio to the same round's "off": median, p10 and p90 over
rounds. With ``every=100`` and fewer than 100 steps per variant the logging step is the first of
the run only (step 0): its rows show the steps that run the plain graphs.

    OMP_NUM_THREADS=1 python bench/bench_fp8_monitor.py --rounds 7 --steps 5 --backend aot_eager
    python bench/bench_fp8_monitor.py --device cuda --width 2048 --layers 1 --batch 4096 --rounds 5 --steps 10
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from tabulate import tabulate

import amp_fx
from amp_fx.testing.bench import machine_lines, percentile, sync

VARIANTS = {"off": None, "every=1": 1, "every=100": 100}


def _model(width: int, layers: int) -> torch.nn.Module:
    blocks = [
        torch.nn.Sequential(torch.nn.Linear(width, 4 * width), torch.nn.GELU(), torch.nn.Linear(4 * width, width))
        for _ in range(layers)
    ]
    return torch.nn.Sequential(*blocks, torch.nn.Linear(width, width))


def _step(args: argparse.Namespace, every: int | None) -> Callable[[], None]:
    torch.manual_seed(0)
    model = _model(args.width, args.layers).to(args.device)
    monitor = amp_fx.Fp8Monitor(every=every) if every is not None else None
    compiled = amp_fx.compile(model, dtype="bf16", low_precision=args.recipe, backend=args.backend, monitor=monitor)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    x = torch.randn(args.batch, args.width, device=args.device)

    def step() -> None:
        compiled(x).float().square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--backend", default="inductor")
    p.add_argument("--recipe", default="tensorwise")
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--steps", type=int, default=5)
    args = p.parse_args()

    for line in machine_lines():
        print(line)
    print(
        f"device {args.device}, backend {args.backend}, recipe {args.recipe}, width {args.width}, "
        f"{args.layers} blocks, batch {args.batch}, {args.rounds} rounds x {args.steps} steps"
    )
    steps = {}
    for name, every in VARIANTS.items():
        t0 = time.perf_counter()
        steps[name] = _step(args, every)
        steps[name]()  # compiles (forward, backward; the monitored graphs too)
        sync(args.device)
        print(
            f"[bench_fp8_monitor] {name}: compiled and ran its first step in {time.perf_counter() - t0:.1f} s",
            flush=True,
        )
    medians: dict[str, list[float]] = {name: [] for name in VARIANTS}
    for _ in range(args.rounds):
        for name, step in steps.items():
            times = []
            for _ in range(args.steps):
                sync(args.device)
                t0 = time.perf_counter()
                step()
                sync(args.device)
                times.append(time.perf_counter() - t0)
            medians[name].append(statistics.median(times))
    rows = []
    for name in VARIANTS:
        ratios = [m / off for m, off in zip(medians[name], medians["off"], strict=True)]
        rows.append(
            [
                name,
                f"{1e3 * statistics.median(medians[name]):.2f}",
                f"{statistics.median(ratios):.3f}",
                f"{percentile(ratios, 0.1):.3f}",
                f"{percentile(ratios, 0.9):.3f}",
            ]
        )
    print(tabulate(rows, headers=["monitor", "step ms (median)", "ratio to off", "p10", "p90"]))


if __name__ == "__main__":
    main()
