"""amp_fx.compile vs torch.compile under torch.autocast: compile time, pass time, step time, casts.

    python bench/bench_compile.py                          # bf16, backends aot_eager and inductor
    python bench/bench_compile.py --dtypes bf16 fp16 --steps 50

The model is the tests' small causal transformer LM (``amp_fx.testing.zoo.transformer_lm``: SDPA blocks,
LayerNorm, GELU MLP, tied embedding head; 2 layers, d_model 64, seq 32, batch 4 by default).

* compile: wall time of the first forward+backward after ``torch._dynamo.reset()``, for
  ``amp_fx.compile(model, backend=B)`` and for ``torch.compile(model, backend=B)`` called under
  ``torch.autocast`` (same backend, same dtype). Each is timed in a fresh process with an empty
  inductor cache directory (unless ``--keep-cache``): the two graphs lower to largely the same
  kernels, so in one process whichever compiled second would reuse the first one's C++ builds. A
  warm-up compile of an unrelated nn.Linear in that process pays the one-time imports. amp_fx's
  own passes are timed from ``GraphRecord.pass_seconds`` (capture, insert_casts, fold_casts), also
  per 1,000 nodes of the captured ATen graph.
* step: forward+backward, amp_fx and the baseline alternating step by step in one run so machine
  noise hits both alike; median and p10/p90 over ``--steps`` steps after ``--warmup``; the ratio is
  amp_fx's median over the baseline's.
* casts: ``aten._to_copy`` calls in one eager-autocast forward (counted with a TorchDispatchMode;
  autocast's weight casts are cached per region) against the ``_to_copy`` nodes left in amp_fx's
  rewritten graphs (``GraphRecord.casts``), user casts included in both.

This CPU has no bf16/fp16 arithmetic units: low-precision matmuls run emulated, ~25x slower than
fp32, so no speed-up over fp32 is expected. Only the ratios between amp_fx and torch.compile +
autocast mean anything here.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch._dynamo
from tabulate import tabulate
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode

import amp_fx
from amp_fx.testing import zoo
from amp_fx.testing.bench import machine_lines, percentile

LossFn = Callable[[object], Tensor]

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
PASSES = ("capture", "insert_casts", "fold_casts")


class _CountCasts(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.casts = 0

    def __torch_dispatch__(self, func: torch._ops.OpOverload, types: object,
                           args: tuple[object, ...] = (), kwargs: dict | None = None) -> object:
        if func is torch.ops.aten._to_copy.default:
            self.casts += 1
        return func(*args, **(kwargs or {}))


def eager_casts_per_forward(model: nn.Module, inputs: tuple[Tensor, ...],
                            dtype: torch.dtype) -> int:
    model = copy.deepcopy(model)
    counter = _CountCasts()
    with torch.autocast("cpu", dtype=dtype), counter:
        model(*inputs)
    return counter.casts


Step = Callable[[], None]


def _amp_fx_step(compiled: nn.Module, model: nn.Module, inputs: tuple[Tensor, ...],
                 loss_fn: LossFn) -> Step:
    def run() -> None:
        model.zero_grad(set_to_none=True)
        loss_fn(compiled(*inputs)).backward()
    return run


def _autocast_step(compiled: nn.Module, model: nn.Module, inputs: tuple[Tensor, ...],
                   loss_fn: LossFn, dtype: torch.dtype) -> Step:
    def run() -> None:
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=dtype):
            loss = loss_fn(compiled(*inputs))
        loss.backward()
    return run


@dataclass
class Compiled:
    amp_fx: Step
    baseline: Step
    amp_fx_module: amp_fx.AmpCompiledModule


def _build(args: argparse.Namespace) -> tuple[nn.Module, tuple[Tensor, ...], LossFn]:
    return zoo.transformer_lm(vocab=args.vocab, d_model=args.d_model, n_heads=args.heads,
                              n_layers=args.layers, seq=args.seq, batch=args.batch)


def _compile_pair(args: argparse.Namespace, backend: str, dtype: torch.dtype) -> Compiled:
    """Compile both (the first call, with backward, compiles); both stay usable together."""
    model, inputs, loss_fn = _build(args)
    base_model = copy.deepcopy(model)
    torch._dynamo.reset()
    compiled = amp_fx.compile(model, dtype=dtype, backend=backend)
    amp_step = _amp_fx_step(compiled, model, inputs, loss_fn)
    amp_step()
    base_step = _autocast_step(torch.compile(base_model, backend=backend), base_model, inputs,
                               loss_fn, dtype)
    base_step()
    return Compiled(amp_step, base_step, compiled)


def _compile_once(args: argparse.Namespace) -> None:
    """Child process: time one cold compile (first forward+backward) and print it as JSON."""
    backend, dtype = args.child_backend, DTYPES[args.child_dtype]
    _warm_up_imports([backend])
    model, inputs, loss_fn = _build(args)
    torch._dynamo.reset()
    if args.child == "amp_fx":
        compiled = amp_fx.compile(model, dtype=dtype, backend=backend)
        run = _amp_fx_step(compiled, model, inputs, loss_fn)
    else:
        run = _autocast_step(torch.compile(model, backend=backend), model, inputs, loss_fn, dtype)
    t0 = time.perf_counter()
    run()
    seconds = time.perf_counter() - t0
    out: dict[str, object] = {"seconds": seconds}
    if args.child == "amp_fx":
        records = compiled.amp_fx_records
        out.update(graphs=len(records), nodes=sum(len(r.captured.graph.nodes) for r in records),
                   passes={p: sum(r.pass_seconds[p] for r in records) for p in PASSES})
    print(_CHILD_MARK + json.dumps(out))


_CHILD_MARK = "amp_fx-bench-compile-result: "


def _cold_compile(args: argparse.Namespace, which: str, backend: str, dtype_name: str) -> dict:
    """Run :func:`_compile_once` in a fresh process with an empty inductor cache directory, so
    neither compile profits from kernels the other one built (their kernels largely coincide)."""
    sizes = [f"--{k.replace('_', '-')}={getattr(args, k)}"
             for k in ("layers", "d_model", "heads", "seq", "batch", "vocab")]
    env = dict(os.environ)
    if not args.keep_cache:
        env["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="amp_fx_bench_compile_")
    proc = subprocess.run(
        [sys.executable, __file__, *sizes, "--child", which, "--child-backend", backend,
         "--child-dtype", dtype_name], env=env, capture_output=True, text=True, check=False)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(_CHILD_MARK)]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"compile-timing child failed ({which}, {backend}, {dtype_name}):\n"
                           f"{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len(_CHILD_MARK):])


def _time_steps(pair: Compiled, steps: int, warmup: int) -> tuple[list[float], list[float]]:
    for _ in range(warmup):
        pair.amp_fx()
        pair.baseline()
    amp_times, base_times = [], []
    for i in range(steps):
        order = [(pair.amp_fx, amp_times), (pair.baseline, base_times)]
        for run, out in order if i % 2 == 0 else reversed(order):
            t0 = time.perf_counter()
            run()
            out.append(time.perf_counter() - t0)
    return amp_times, base_times


def _ms(values: list[float]) -> str:
    return (f"{statistics.median(values) * 1e3:.2f} "
            f"({percentile(values, 0.1) * 1e3:.2f}-{percentile(values, 0.9) * 1e3:.2f})")


def _warm_up_imports(backends: list[str]) -> None:
    """Pay one-time imports and initialisation before anything is timed."""
    for backend in backends:
        torch._dynamo.reset()
        lin = nn.Linear(4, 4)
        torch.compile(lin, backend=backend)(torch.randn(2, 4)).sum().backward()
        torch._dynamo.reset()
        compiled = amp_fx.compile(nn.Linear(4, 4), dtype="bf16", backend=backend)
        compiled(torch.randn(2, 4)).float().sum().backward()
    torch._dynamo.reset()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=128)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--backends", nargs="+", default=["aot_eager", "inductor"])
    parser.add_argument("--dtypes", nargs="+", default=["bf16"], choices=sorted(DTYPES))
    parser.add_argument("--compile-repeats", type=int, default=1,
                        help="cold compiles of each kind (median reported; each is a process)")
    parser.add_argument("--keep-cache", action="store_true",
                        help="use inductor's usual cache directory (compile times may be warm)")
    parser.add_argument("--child", choices=["amp_fx", "baseline"], help=argparse.SUPPRESS)
    parser.add_argument("--child-backend", help=argparse.SUPPRESS)
    parser.add_argument("--child-dtype", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _compile_once(args)
        return

    model, inputs, _ = _build(args)
    n_params = sum(p.numel() for p in model.parameters())
    print(*machine_lines(), sep="\n")
    print(f"model: transformer_lm layers={args.layers} d_model={args.d_model} heads={args.heads} "
          f"seq={args.seq} batch={args.batch} vocab={args.vocab} ({n_params:,} parameters)")
    print("no bf16/fp16 units on this CPU: compare amp_fx with torch.compile+autocast, "
          "not with fp32\n")

    compile_rows, step_rows, cast_rows = [], [], []
    for dtype_name in args.dtypes:
        dtype = DTYPES[dtype_name]
        for backend in args.backends:
            amps, bases = [], []
            for i in range(args.compile_repeats):  # alternate which one goes first
                pair_order = [("amp_fx", amps), ("baseline", bases)]
                for which, out in pair_order if i % 2 == 0 else reversed(pair_order):
                    out.append(_cold_compile(args, which, backend, dtype_name))
            amp = amps[0]
            amp_s = statistics.median(a["seconds"] for a in amps)
            base_s = statistics.median(b["seconds"] for b in bases)
            passes = {p: statistics.median(a["passes"][p] for a in amps) for p in PASSES}
            nodes = amp["nodes"]
            total = sum(passes.values())
            compile_rows.append([
                backend, dtype_name, amp["graphs"], nodes,
                f"{amp_s:.2f}", f"{base_s:.2f}", f"{amp_s / base_s:.2f}",
                *(f"{passes[p] * 1e3:.1f}" for p in PASSES),
                f"{total * 1e3:.1f}", f"{total / nodes * 1e6:.1f}",
            ])
            pair = _compile_pair(args, backend, dtype)
            if backend == args.backends[0]:
                records = pair.amp_fx_module.amp_fx_records
                cast_rows.append([
                    dtype_name, eager_casts_per_forward(model, inputs, dtype),
                    sum(r.inserted.casts_inserted for r in records),
                    sum(r.inserted.casts_shared for r in records),
                    sum(r.folded.total for r in records), sum(r.casts for r in records),
                ])
            amp_times, base_times = _time_steps(pair, args.steps, args.warmup)
            step_rows.append([
                backend, dtype_name, _ms(amp_times), _ms(base_times),
                f"{statistics.median(amp_times) / statistics.median(base_times):.3f}",
            ])
            print(f"done: {backend} {dtype_name}", file=sys.stderr, flush=True)

    print(f"compile: first forward+backward after torch._dynamo.reset(), cold (a fresh process and "
          f"inductor cache each), seconds, median of {args.compile_repeats}; amp_fx's passes, ms")
    print(tabulate(compile_rows, headers=[
        "backend", "dtype", "graphs", "ATen nodes", "amp_fx s", "torch.compile+autocast s",
        "ratio", "capture ms", "insert_casts ms", "fold_casts ms", "passes ms",
        "passes ms / 1k nodes"]))
    print(f"\nstep: forward+backward, ms, median (p10-p90) over {args.steps} steps after "
          f"{args.warmup} warm-up, amp_fx and baseline alternating")
    print(tabulate(step_rows, headers=["backend", "dtype", "amp_fx", "torch.compile+autocast",
                                       "ratio (median)"]))
    print("\ncasts per forward: eager autocast (aten._to_copy calls) vs amp_fx's rewritten graphs")
    print(tabulate(cast_rows, headers=["dtype", "eager autocast", "amp_fx inserted",
                                       "leaf-cast uses shared", "folded", "amp_fx in graph"]))


if __name__ == "__main__":
    main()
