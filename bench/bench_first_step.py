"""What a user waits for in the first steps of ``compile_step`` (issue 61): each progress line's
time from the call of the step that printed it, on a 2-layer Llama-like model (hidden 128,
random weights, no download), fp16, AdamW, inductor.

    python bench/bench_first_step.py                     # the caches as they are
    TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) python bench/bench_first_step.py   # an empty inductor cache

Prints, per step, its wall time and the progress lines with their offset from the step's call;
then eager autocast + GradScaler's step times on the same model, for scale.
"""

from __future__ import annotations

import argparse
import logging
import time

import torch
import torch.nn.functional as F
from bench_overflow_watch import llama  # bench/ is on the path of a script run from it: the same model

import amp_fx
from amp_fx._common.progress import PROGRESS_LOGGER
from amp_fx.testing.bench import machine_lines


class _Stamps(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[tuple[float, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append((time.perf_counter(), record.getMessage()))


def _loss(out: object, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.logits.float().flatten(0, 1), y.flatten())  # type: ignore[attr-defined]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--vocab", type=int, default=8192)
    args = p.parse_args()
    stamps = _Stamps()
    logging.getLogger(PROGRESS_LOGGER).addHandler(stamps)
    torch.manual_seed(0)
    model = llama(args.layers, args.width, args.vocab)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    step = amp_fx.compile_step(model, opt, _loss, dtype="fp16")
    x = torch.randint(0, args.vocab, (2, 32), generator=torch.Generator().manual_seed(0))
    y = x.roll(-1, 1)
    for i in range(args.steps):
        seen, start = len(stamps.lines), time.perf_counter()
        step(x, y)
        print(f"compile_step, step {i}: {time.perf_counter() - start:.1f} s")
        for t, line in stamps.lines[seen:]:
            print(f"  +{t - start:6.1f} s  {line}")
    torch.manual_seed(0)
    eager = llama(args.layers, args.width, args.vocab)
    eager_opt = torch.optim.AdamW(eager.parameters(), lr=1e-4)
    scaler = torch.amp.GradScaler("cpu")
    for i in range(args.steps):
        start = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = _loss(eager(x), y)
        scaler.scale(loss).backward()
        scaler.step(eager_opt)
        scaler.update()
        eager_opt.zero_grad()
        print(f"eager autocast + GradScaler, step {i}: {time.perf_counter() - start:.1f} s")
    for line in machine_lines():
        print(line)


if __name__ == "__main__":
    main()
