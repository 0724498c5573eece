"""amp_fx's per-call overhead: amp_fx.compile(model) against torch.compile(model) under torch.autocast.

    python bench/bench_call_overhead.py                  # inductor, bf16, 15 repeats x 2,000 calls
    python bench/bench_call_overhead.py --repeats 31 --calls 1000 --backend aot_eager

The model is the tests' 3-layer MLP (``amp_fx.testing.zoo.MLP``) at width 16 (16 -> 16 -> 16 -> 16,
GELU and ReLU), on a batch of 4, with ``torch.set_num_threads(1)``: its graph runs in a few
microseconds, so what is timed is mostly the Python around it, which is what ``generate()`` pays on
every token. Both variants compile to the same kernels (same downstream backend, same dtype);
amp_fx's difference is its own call path (:func:`amp_fx.backend.call.amp_call`).

* baseline: ``with torch.autocast("cpu", dtype=...): out = torch.compile(model)(x)``, the autocast
  region opened per call as a user's loop does;
* amp_fx: ``out = amp_fx.compile(model, dtype=...)(x)``.

Two modes: ``no_grad`` (a forward under ``torch.no_grad()``, as in ``generate()``), and
``fwd+bwd`` (the forward, then ``out.float().sum().backward()`` outside the autocast region, as
torch's AMP recipe does). Each repeat times ``--calls`` calls of one variant; the variants alternate
repeat by repeat so that machine noise hits both alike, and the garbage collector is off inside a
timed block. Time is the thread's CPU time (``time.thread_time_ns``: with one torch thread every
kernel runs on it), which leaves out the time other processes hold the CPU; sharing a core or its
caches still slows it. Per-call time is the block's time over ``--calls``; the table gives the
median, min and max over ``--repeats`` repeats, and amp_fx's difference from the baseline three
ways: from the medians, from the minima ("best of"), and per repeat (amp_fx's block minus the
baseline block timed just before it: median, min, max of those paired differences). On a shared
machine the minima and the paired median are the figures least disturbed by other processes; the
max columns show how much they disturbed this run.
"""

from __future__ import annotations

import argparse
import copy
import gc
import statistics
import time
from collections.abc import Callable

import torch
from tabulate import tabulate
from torch import Tensor

import amp_fx
from amp_fx.testing.bench import machine_lines
from amp_fx.testing.zoo import MLP

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
MODES = ("no_grad", "fwd+bwd")
Call = Callable[[], Tensor]


def _variants(backend: str, dtype: torch.dtype, width: int, batch: int) -> dict[str, Call]:
    torch.manual_seed(0)
    model = MLP(d_in=width, d_hidden=width, d_out=width)
    x = torch.randn(batch, width)
    baseline = torch.compile(copy.deepcopy(model), backend=backend)
    ours = amp_fx.compile(copy.deepcopy(model), dtype=dtype, backend=backend)

    def torch_compile_autocast() -> Tensor:
        with torch.autocast("cpu", dtype=dtype):
            return baseline(x)

    def amp_fx_compile() -> Tensor:
        return ours(x)

    return {"torch.compile + autocast": torch_compile_autocast, "amp_fx.compile": amp_fx_compile}


CLOCKS = {"thread": time.thread_time_ns, "wall": time.perf_counter_ns}
clock = CLOCKS["thread"]


def _time_block(fn: Call, mode: str, calls: int) -> float:
    """Microseconds per call over ``calls`` calls of ``fn`` in ``mode``."""
    gc.collect()
    gc.disable()
    try:
        if mode == "no_grad":
            with torch.no_grad():
                t0 = clock()
                for _ in range(calls):
                    fn()
                elapsed = clock() - t0
        else:
            t0 = clock()
            for _ in range(calls):
                fn().float().sum().backward()
            elapsed = clock() - t0
    finally:
        gc.enable()
    return elapsed / calls / 1e3


def measure(variants: dict[str, Call], mode: str, *, calls: int, repeats: int, warmup: int) -> dict[str, list[float]]:
    """Per-call microseconds of each variant, one value per repeat, the variants alternating."""
    for fn in variants.values():
        _time_block(fn, mode, warmup)
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(repeats):
        for name, fn in variants.items():
            times[name].append(_time_block(fn, mode, calls))
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--width", type=int, default=16)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--calls", type=int, default=2000, help="calls per timed block")
    parser.add_argument("--repeats", type=int, default=15, help="timed blocks per variant and mode")
    parser.add_argument("--warmup", type=int, default=200, help="untimed calls per variant and mode first")
    parser.add_argument(
        "--clock", choices=sorted(CLOCKS), default="thread", help="thread: this thread's CPU time; wall: perf_counter"
    )
    args = parser.parse_args()
    global clock
    clock = CLOCKS[args.clock]
    torch.set_num_threads(1)
    dtype = DTYPES[args.dtype]

    variants = _variants(args.backend, dtype, args.width, args.batch)
    rows = []
    for mode in MODES:
        times = measure(variants, mode, calls=args.calls, repeats=args.repeats, warmup=args.warmup)
        for name, values in times.items():
            rows.append([mode, name, statistics.median(values), min(values), max(values)])
        (_, base), (_, ours) = times.items()
        paired = [a - b for a, b in zip(ours, base, strict=True)]
        rows.append(
            [
                mode,
                "amp_fx - baseline",
                statistics.median(ours) - statistics.median(base),
                min(ours) - min(base),
                None,
                statistics.median(paired),
                min(paired),
                max(paired),
            ]
        )

    for line in machine_lines():
        print(line)
    print(
        f"MLP {args.width}->{args.width}->{args.width}->{args.width}, batch {args.batch}, "
        f"{args.dtype}, backend {args.backend}; {args.repeats} repeats x {args.calls} calls per "
        f"variant and mode (after {args.warmup} warm-up calls), variants alternating, {args.clock} clock"
    )
    print(
        tabulate(
            rows,
            headers=[
                "mode",
                "variant",
                "median us/call",
                "min us/call",
                "max us/call",
                "paired diff median",
                "paired min",
                "paired max",
            ],
            floatfmt=".1f",
            missingval="-",
        )
    )


if __name__ == "__main__":
    main()
