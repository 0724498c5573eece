"""Training-step time of amp_fx.compile_step against torch's AMP recipe, on a small transformer.

Three ways to run the same step (same model, data, dtype, AdamW, dynamic loss scaling):

* ``eager``: ``torch.autocast`` + ``torch.amp.GradScaler`` (amp_fx.testing.eager_amp_step,
  the reference the tests use);
* ``torch.compile(model)``: the same recipe with the model compiled by inductor;
* ``amp_fx.compile_step``: the whole step compiled (inductor);
* on CUDA also ``amp_fx.compile_step`` captured as a CUDA graph and replayed (possible because
  the step reads nothing on the host): one graph per optimizer step, all ``--accumulate``
  micro-batches in it (the step counts its calls on the host to find the window's end, so one
  captured micro-batch would replay the same phase of the window every time);
* with ``--weight-cache`` also ``amp_fx.compile_step(weight_cache=True)`` (and its CUDA graph):
  each fp32 weight cast once per optimizer step instead of once per micro-batch.

For each: median, p10 and p90 of the time of one optimizer step (``--accumulate`` micro-batches),
as ratios to eager's median; host reads of tensor values per optimizer step
(amp_fx.testing.HostSyncCounter: reads made by the step's code, and apart from them reads inside
CPU kernels of fused optimizers); graph breaks per optimizer step after warm-up; and, for the
record, the graph breaks torch.compile meets when asked to compile the whole eager recipe (the
reason compile_step exists).

    python bench/bench_step.py --steps 30 --d-model 64 --layers 2
    python bench/bench_step.py --device cuda
    python bench/bench_step.py --device cuda --accumulate 4 --weight-cache   # what .ci/gpu runs
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch._dynamo
from tabulate import tabulate
from torch._dynamo.utils import counters

import amp_fx
from amp_fx.policy import resolve_dtype
from amp_fx.testing import HostSyncCounter, eager_amp_step
from amp_fx.testing.bench import machine_lines, percentile


class TinyTransformer(torch.nn.Module):
    def __init__(self, vocab: int, d_model: int, heads: int, layers: int) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, d_model)
        layer = torch.nn.TransformerEncoderLayer(
            d_model, heads, 4 * d_model, dropout=0.0, batch_first=True, norm_first=True
        )
        self.encoder = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = torch.nn.Linear(d_model, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(tokens)))


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


Window = list[tuple[torch.Tensor, torch.Tensor]]
"""One optimizer step's micro-batches (``--accumulate`` of them): (tokens, targets) each."""


def cuda_graphed(
    step: Callable[..., torch.Tensor], window: Window, warmup: int = 3
) -> Callable[[Window], torch.Tensor]:
    """``step`` warmed up on a side stream for ``warmup`` optimizer steps, then one whole
    optimizer step (``len(window)`` micro-batches: the step decides on the host, by counting its
    calls, which call ends the accumulation window) captured as one CUDA graph, replayed once per
    optimizer step with the micro-batches copied into the captured inputs (torch.cuda.graphs'
    recipe)."""
    static = [[t.clone() for t in batch] for batch in window]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            for batch in static:
                step(*batch)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        losses = [step(*batch) for batch in static]

    def replay(micro_batches: Window) -> torch.Tensor:
        for dst, src in zip(static, micro_batches, strict=True):
            for d, s in zip(dst, src, strict=True):
                d.copy_(s)
        graph.replay()
        return losses[-1]

    return replay


def per_window(step: Callable[..., torch.Tensor]) -> Callable[[Window], torch.Tensor]:
    """One optimizer step of ``step``: one call per micro-batch of the window."""

    def run(micro_batches: Window) -> torch.Tensor:
        for x, y in micro_batches:
            loss = step(x, y)
        return loss

    return run


def measure(
    steps: dict[str, Callable[[Window], torch.Tensor]], windows: list[Window], warmup: int, device: torch.device
) -> dict[str, dict[str, Any]]:
    """Time the variants interleaved, one optimizer step (one accumulation window) of each in
    turn, so that load from other processes on a shared machine falls on all of them alike; then
    count host reads and graph breaks."""
    results: dict[str, dict[str, Any]] = {name: {"times": []} for name in steps}
    for name, step in steps.items():
        t0 = time.perf_counter()
        for window in windows[:warmup]:
            step(window)
        _sync(device)
        results[name]["warmup_s"] = time.perf_counter() - t0
    breaks = sum(counters["graph_break"].values())
    timed = windows[warmup:-3]
    for window in timed:
        for name, step in steps.items():
            _sync(device)
            t0 = time.perf_counter()
            step(window)
            _sync(device)
            results[name]["times"].append(time.perf_counter() - t0)
    breaks = (sum(counters["graph_break"].values()) - breaks) / len(timed)
    for name, step in steps.items():
        with HostSyncCounter() as syncs:
            for window in windows[-3:]:
                step(window)
        # Graph breaks are counted over all variants together; only compiled code can break.
        results[name].update(syncs=syncs.count / 3, kernel_reads=syncs.in_cpu_kernels / 3, breaks=breaks)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--dtype", default="fp16")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=30, help="timed optimizer steps per variant")
    parser.add_argument("--warmup", type=int, default=3, help="optimizer steps before the timed ones")
    parser.add_argument(
        "--accumulate",
        type=int,
        default=1,
        help="micro-batches per optimizer step (gradient accumulation); every time in the table "
        "is one optimizer step, all its micro-batches included",
    )
    parser.add_argument(
        "--weight-cache",
        action="store_true",
        help="also amp_fx.compile_step(weight_cache=True) (and its CUDA graph on CUDA), beside the rows without it",
    )
    parser.add_argument(
        "--backend",
        default="inductor",
        help="torch.compile backend of the compiled variants (aot_eager: a quick CPU check)",
    )
    parser.add_argument(
        "--fused",
        action="store_true",
        help="AdamW(fused=True) (skips on the device in torch's recipe too); default: "
        "AdamW's default implementation, which torch's GradScaler skips on the host",
    )
    args = parser.parse_args()
    dtype = resolve_dtype(args.dtype)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench_step: --device cuda, but torch.cuda.is_available() is False")
    if args.accumulate < 1:
        raise SystemExit(f"bench_step: --accumulate must be >= 1, got {args.accumulate}")
    device = torch.device(args.device)

    g = torch.Generator().manual_seed(0)
    n = args.warmup + args.steps + 3
    windows = [
        [
            (
                torch.randint(args.vocab, (args.batch, args.seq), generator=g).to(device),
                torch.randint(args.vocab, (args.batch, args.seq), generator=g).to(device),
            )
            for _ in range(args.accumulate)
        ]
        for _ in range(n)
    ]

    def fresh() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = TinyTransformer(args.vocab, args.d_model, args.heads, args.layers).to(device)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3, fused=args.fused or None)

    def scaler() -> torch.amp.GradScaler:
        # check-only semantics for bf16 would need amp_fx's scaler; torch's scales either way.
        return torch.amp.GradScaler(device.type)

    def eager() -> Callable[..., torch.Tensor]:
        model, opt = fresh()
        return eager_amp_step(model, opt, lm_loss, scaler(), dtype=dtype, accumulate=args.accumulate)

    def compiled_model() -> Callable[..., torch.Tensor]:
        model, opt = fresh()
        return eager_amp_step(
            torch.compile(model, backend=args.backend),
            opt,
            lm_loss,
            scaler(),
            dtype=dtype,
            accumulate=args.accumulate,
            params=list(model.parameters()),
        )

    def compile_step(weight_cache: bool = False) -> Callable[..., torch.Tensor]:
        model, opt = fresh()
        return amp_fx.compile_step(
            model,
            opt,
            lm_loss,
            dtype=dtype,
            backend=args.backend,
            accumulate=args.accumulate,
            weight_cache=weight_cache,
        )

    variants: dict[str, Callable[[], Callable[[Window], torch.Tensor]]] = {
        "eager autocast + GradScaler": lambda: per_window(eager()),
        "torch.compile(model) + GradScaler": lambda: per_window(compiled_model()),
        "amp_fx.compile_step": lambda: per_window(compile_step()),
    }
    if device.type == "cuda":
        variants["amp_fx.compile_step, CUDA graph"] = lambda: cuda_graphed(compile_step(), windows[0])
    if args.weight_cache:
        variants["amp_fx.compile_step, weight cache"] = lambda: per_window(compile_step(weight_cache=True))
        if device.type == "cuda":
            variants["amp_fx.compile_step, weight cache, CUDA graph"] = lambda: cuda_graphed(
                compile_step(weight_cache=True), windows[0]
            )
    torch._dynamo.reset()
    results = measure({name: build() for name, build in variants.items()}, windows, args.warmup, device)

    # What torch.compile makes of the whole eager recipe (Dynamo only: backend="eager").
    torch._dynamo.reset()
    counters.clear()
    model, opt = fresh()
    whole = torch.compile(
        eager_amp_step(model, opt, lm_loss, scaler(), dtype=dtype, accumulate=args.accumulate), backend="eager"
    )
    for window in windows[:3]:
        per_window(whole)(window)
    whole_breaks = sum(counters["graph_break"].values())

    base = statistics.median(results["eager autocast + GradScaler"]["times"])
    rows = []
    for name, r in results.items():
        t = r["times"]
        rows.append(
            [
                name,
                f"{statistics.median(t) * 1e3:.2f}",
                f"{statistics.median(t) / base:.2f}",
                f"{percentile(t, 0.1) / base:.2f}",
                f"{percentile(t, 0.9) / base:.2f}",
                f"{r['syncs']:.1f}",
                f"{r['kernel_reads']:.1f}",
                f"{r['breaks']:.1f}",
                f"{r['warmup_s']:.0f}",
            ]
        )
    print(*machine_lines(), sep="\n")
    if device.type == "cuda":
        print(
            f"device: {torch.cuda.get_device_name(device)}, CUDA {torch.version.cuda}; each optimizer step timed "
            "from a synchronized device to a synchronized device"
        )
    print(
        f"model: TinyTransformer(vocab={args.vocab}, d_model={args.d_model}, heads={args.heads}, "
        f"layers={args.layers}), batch {args.batch}x{args.seq}, {dtype}, AdamW(fused={args.fused}), "
        f"{args.accumulate} micro-batch(es) per optimizer step, backend {args.backend}, "
        f"{args.steps} timed optimizer steps after {args.warmup} warm-up, variants interleaved"
    )
    print(
        tabulate(
            rows,
            headers=[
                "variant",
                "median ms/opt. step",
                "median/eager",
                "p10/eager",
                "p90/eager",
                "host reads/opt. step",
                "reads in CPU kernels/opt. step",
                "graph breaks/opt. step",
                "warm-up s (compile)",
            ],
        )
    )
    for name in ("amp_fx.compile_step, CUDA graph", "amp_fx.compile_step, weight cache, CUDA graph"):
        if name in results:
            graphed = statistics.median(results[name]["times"]) / base
            print(
                f"CUDA-graphed {name.removeprefix('amp_fx.').removesuffix(', CUDA graph')}: {graphed:.2f}x eager "
                f"autocast + GradScaler's median step time (target < 1: {'met' if graphed < 1 else 'NOT met'})"
            )
    reasons = sorted(
        {
            key.splitlines()[0]
            + (": " + key.splitlines()[1].split("function `")[-1].split("`")[0] if "function `" in key else "")
            for key in counters["graph_break"]
        }
    )
    print(f"torch.compile of the whole eager recipe (Dynamo, 3 optimizer steps): {whole_breaks} graph breaks:")
    for reason in reasons:
        print(f"  - {reason}")


if __name__ == "__main__":
    main()
