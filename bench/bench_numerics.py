"""What ``numerics="eager"`` costs: step and compile time against inductor's defaults and aot_eager.

    python bench/bench_numerics.py                                  # hf_llama, bf16, 20 steps
    python bench/bench_numerics.py --models hf_llama hf_gpt2 --dtype fp16 --steps 30

Each model is the real-model tier's (``amp_fx.testing.real_models``: transformers, 2 layers x hidden
64, batch 2 x 16 tokens, random init), trained one forward+backward per step through
``amp_fx.compile`` with three downstream settings: ``backend="aot_eager"`` (ATen's kernels, no
fusion: eager's numbers), ``backend="inductor"`` (defaults) and ``backend="inductor",
numerics="eager"``. compile: wall time of the variant's first step (inductor's caches are
those of the process: run with ``TORCHINDUCTOR_FORCE_DISABLE_CACHES=1`` for cold compiles; each
variant keeps its own compiled code). step: the three variants alternate step by step so machine
load hits them alike; the median and p10/p90 over ``--steps`` steps after ``--warmup``.
bitwise: whether the step's loss and every gradient equal eager autocast's.

The ratio the issue asks for: ``numerics="eager"``'s median step over inductor's and over
aot_eager's (goal: closer to inductor than to aot_eager). This CPU has no bf16/fp16 units: only the
ratios mean anything.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from tabulate import tabulate

import amp_fx
from amp_fx.testing.bench import machine_lines, percentile
from amp_fx.testing.real_models import REAL_MODELS, eager_autocast_real_step, real_step

VARIANTS: dict[str, dict[str, Any]] = {
    "aot_eager": {"backend": "aot_eager"},
    "inductor": {"backend": "inductor"},
    "inductor numerics=eager": {"backend": "inductor", "numerics": "eager"},
}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _bench_model(name: str, dtype: torch.dtype, steps: int, warmup: int) -> list[list[object]]:
    entry = REAL_MODELS[name]
    model, inputs, loss_fn = entry.build()
    reference = eager_autocast_real_step(model, inputs, loss_fn, dtype)
    runs: dict[str, Callable[[], Any]] = {}
    compile_s: dict[str, float] = {}
    bitwise: dict[str, bool] = {}
    torch._dynamo.reset()
    for label, kwargs in VARIANTS.items():  # no reset between variants: each keeps its compiled code
        model.zero_grad(set_to_none=True)
        compiled = amp_fx.compile(model, dtype=dtype, policy=entry.policy, **kwargs)
        start = time.perf_counter()
        got = real_step(compiled, model, inputs, loss_fn)
        compile_s[label] = time.perf_counter() - start
        bitwise[label] = torch.equal(got.loss, reference.loss) and all(
            g is None or torch.equal(got.grads[n], g)  # type: ignore[arg-type]
            for n, g in reference.grads.items()
        )

        def run(compiled: Any = compiled) -> None:
            model.zero_grad(set_to_none=True)
            real_step(compiled, model, inputs, loss_fn)

        runs[label] = run
    times: dict[str, list[float]] = {label: [] for label in runs}
    for i in range(warmup + steps):
        for label, run in runs.items():
            start = time.perf_counter()
            run()
            if i >= warmup:
                times[label].append(time.perf_counter() - start)
    median = {label: statistics.median(t) for label, t in times.items()}
    rows = []
    for label, t in times.items():
        rows.append(
            [
                name,
                label,
                f"{compile_s[label]:.1f}",
                f"{median[label] * 1e3:.2f}",
                f"{percentile(t, 0.1) * 1e3:.2f}/{percentile(t, 0.9) * 1e3:.2f}",
                f"{median[label] / median['inductor']:.2f}",
                f"{median[label] / median['aot_eager']:.2f}",
                "yes" if bitwise[label] else "no",
            ]
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["hf_llama"], choices=sorted(REAL_MODELS))
    parser.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()
    for line in machine_lines():
        print(line)
    rows = []
    for name in args.models:
        rows += _bench_model(name, DTYPES[args.dtype], args.steps, args.warmup)
    headers = ["model", "variant", "compile s", "step ms", "p10/p90 ms", "/ inductor", "/ aot_eager", "bitwise"]
    print(f"dtype {args.dtype}, {args.steps} steps after {args.warmup} warm-up, variants alternating")
    print(tabulate(rows, headers=headers))


if __name__ == "__main__":
    main()
