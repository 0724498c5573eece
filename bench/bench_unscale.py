"""Bandwidth of gradient unscale (+ norm) on this CPU: amp_fx against torch.

    python bench/bench_unscale.py            # 64 fp32 gradients of 1M elements (64M, 256 MiB)
    python bench/bench_unscale.py --reps 5   # quicker, noisier

Every method runs once per repetition, in turn, on the same gradients, so machine noise hits
them alike; each row reports the median and the p10/p50/p90 percentiles over repetitions after
warm-up. GB/s counts 8 bytes per fp32 element for every method (one read and one write: the
useful traffic of an in-place unscale), so a method that reads the gradients more often shows
as fewer GB/s. The ceiling is an in-place ``torch._foreach_mul_``: one read and one write.

inv_scale alternates between 0.5 and 2.0 across repetitions so the multiply is real and the
values neither underflow to (slow) subnormals nor overflow; ``clip_grad_norm_`` gets a max_norm
it never reaches, so it multiplies by 1.0 as it always does (it clamps instead of branching).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from tabulate import tabulate

from amp_fx.kernels import unscale_check_, unscale_check_norm_
from amp_fx.testing.bench import machine_lines, percentile
from amp_fx.testing.unscale_reference import reference_unscale_check_, torch_unscale_then_clip_

_BYTES_PER_ELEMENT = 8  # fp32 read + write
_TARGET_CHECK = 0.95  # issue: unscale+check at >= 0.95 of the _foreach_mul_ ceiling
_TARGET_NORM_SPEEDUP = 1.8  # issue: unscale+check+norm >= 1.8x torch unscale_ + clip_grad_norm_


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tensors", type=int, default=64)
    parser.add_argument("--numel", type=int, default=1 << 20, help="elements per tensor")
    parser.add_argument("--reps", type=int, default=21)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()

    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.empty(args.numel)) for _ in range(args.tensors)]
    for p in params:
        p.grad = torch.randn(args.numel)
    grads = [p.grad for p in params]
    found_inf = torch.zeros(())
    inv = {0: torch.tensor(0.5), 1: torch.tensor(2.0)}

    methods: dict[str, Callable[[torch.Tensor], object]] = {
        "in-place _foreach_mul_ (ceiling)": lambda s: torch._foreach_mul_(grads, s),
        "torch _amp_foreach_non_finite_check_and_unscale_": (
            lambda s: reference_unscale_check_(grads, found_inf, s)
        ),
        "amp_fx unscale_check_": lambda s: unscale_check_(grads, found_inf, s),
        "torch unscale_ + clip_grad_norm_": (
            lambda s: torch_unscale_then_clip_(params, found_inf, s, max_norm=1e30)
        ),
        "torch unscale_ + _foreach_norm (no clip multiply)": lambda s: (
            reference_unscale_check_(grads, found_inf, s),
            torch._foreach_norm(grads),
        ),
        "amp_fx unscale_check_norm_": lambda s: unscale_check_norm_(grads, found_inf, s),
    }
    times: dict[str, list[float]] = {name: [] for name in methods}
    for rep in range(args.warmup + args.reps):
        for name, fn in methods.items():
            start = time.perf_counter()
            fn(inv[rep % 2])
            elapsed = time.perf_counter() - start
            if rep >= args.warmup:
                times[name].append(elapsed)
    assert found_inf.item() == 0.0, "randn gradients must not be flagged"

    total_bytes = _BYTES_PER_ELEMENT * args.tensors * args.numel
    ceiling = statistics.median(times["in-place _foreach_mul_ (ceiling)"])
    rows = []
    for name, ts in times.items():
        gbps = [total_bytes / t / 1e9 for t in ts]
        rows.append(
            [
                name,
                f"{statistics.median(ts) * 1e3:.1f}",
                f"{percentile(gbps, 0.1):.1f}",
                f"{percentile(gbps, 0.5):.1f}",
                f"{percentile(gbps, 0.9):.1f}",
                f"{ceiling / statistics.median(ts):.2f}",
            ]
        )

    print(*machine_lines(), sep="\n")
    print(
        f"{args.tensors} fp32 gradients x {args.numel} elements, {args.reps} repetitions after "
        f"{args.warmup} warm-up; GB/s at {_BYTES_PER_ELEMENT} bytes per element"
    )
    print(
        tabulate(
            rows,
            headers=["method", "median ms", "p10 GB/s", "p50 GB/s", "p90 GB/s", "x ceiling"],
            tablefmt="github",
        )
    )
    check_ratio = ceiling / statistics.median(times["amp_fx unscale_check_"])
    speedup = statistics.median(times["torch unscale_ + clip_grad_norm_"]) / statistics.median(
        times["amp_fx unscale_check_norm_"]
    )
    print(
        f"unscale+check at {check_ratio:.2f} of the ceiling (target >= {_TARGET_CHECK}): "
        f"{'met' if check_ratio >= _TARGET_CHECK else 'NOT met'}"
    )
    print(
        f"unscale+check+norm {speedup:.2f}x torch unscale_ + clip_grad_norm_ "
        f"(target >= {_TARGET_NORM_SPEEDUP}x): "
        f"{'met' if speedup >= _TARGET_NORM_SPEEDUP else 'NOT met'}"
    )


if __name__ == "__main__":
    main()
