"""Where amp_fx's step differs from its peer's: the kernels in inductor's generated code, per variant.

    python bench/gap_kernels.py                              # CPU: the llama-like model, small (inductor's C++)
    python bench/gap_kernels.py --device cuda --preset h100  # a GPU: 2048 x 4 layers, seq 2048 (Triton)

The GPU runs of 2026-11-27 (bench/results/2026-11-27-h200, run 6) put amp_fx fp8 0.7 % behind
torchao and amp_fx bf16 0.8 % behind ``torch.compile`` + autocast on the llama-like model of
``bench/bench_fp8.py``. This script compiles each of the four variants of ``bench_fp8.variants``
(the same builders), runs one training step (forward and backward), and reads the wrapper code
inductor generated for each graph (``GraphLowering.save_output_code``, caches off so every graph
is generated): per graph, the fused kernels it launches (Triton on CUDA, C++ on a CPU) and the
extern calls (``extern_kernels.mm``, ``torch.ops.aten._scaled_mm`` ...). Then, per pair (amp_fx
against its peer), the kernels and extern calls one side launches and the other does not, by name
(the name without inductor's running index: ``triton_poi_fused__to_copy_mul_3`` counts as
``triton_poi_fused__to_copy_mul``). On CUDA, ``--profile`` adds each variant's device time per
step (torch.profiler, the kernels' own time, 3 steps after the compile) and, per pair, the kernel
names whose time differs most.
"""

from __future__ import annotations

import argparse
import re
import sys
import warnings
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from tabulate import tabulate

import amp_fx
from amp_fx.testing.bench import machine_lines, release, token_batches
from amp_fx.testing.fp8_reference import torchao_missing

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from bench_fp8 import PRESETS, variants  # noqa: E402 (the variants the gap was measured on)
from bench_weight_casts import MODELS, lm_loss  # noqa: E402

PAIRS = (
    ("amp_fx bf16", "torch.compile + autocast bf16"),
    ("amp_fx fp8 tensorwise", "torchao tensorwise + torch.compile"),
)

_KERNEL_CALL = re.compile(r"^\s+((?:triton|cpp)_\w+?)(?:_\d+)?(?:\.run)?\(", re.M)
_EXTERN_CALL = re.compile(r"\b(extern_kernels\.\w+|torch\.ops\.\w+\.\w+|aten\.\w+)(?:\.default)?\(")


@dataclass
class GraphCode:
    """What one generated graph launches, by name (inductor's running index dropped)."""

    kernels: Counter[str] = field(default_factory=Counter)
    externs: Counter[str] = field(default_factory=Counter)


def parse(code: str) -> GraphCode:
    """The kernel launches and extern calls of the ``call`` function of inductor's wrapper code."""
    start = code.find("def call(")
    if start < 0:
        return GraphCode()
    body = code[start:]
    end = re.search(r"\n\S", body)  # the first line back at column 0 ends the function (a method too)
    body = body[: end.start()] if end else body
    return GraphCode(Counter(_KERNEL_CALL.findall(body)), Counter(_EXTERN_CALL.findall(body)))


@contextmanager
def generated_code() -> Iterator[list[str]]:
    """The wrapper code of every graph inductor generates inside, caches off (a cache hit would
    generate nothing)."""
    from torch._inductor import config
    from torch._inductor.graph import GraphLowering

    codes: list[str] = []
    saved = GraphLowering.save_output_code
    GraphLowering.save_output_code = codes.append
    try:
        with config.patch(force_disable_caches=True):
            yield codes
    finally:
        GraphLowering.save_output_code = saved


def _total(graphs: list[GraphCode]) -> GraphCode:
    out = GraphCode()
    for g in graphs:
        out.kernels += g.kernels
        out.externs += g.externs
    return out


def diff(ours: Counter[str], theirs: Counter[str]) -> str:
    more, fewer = ours - theirs, theirs - ours
    parts = [f"+{n} {k}" for k, n in sorted(more.items())] + [f"-{n} {k}" for k, n in sorted(fewer.items())]
    return "; ".join(parts) or "same"


def _device_times(step: object, batches: list, device: str) -> Counter[str]:
    """Device microseconds per step by kernel name (index dropped), over 3 profiled steps."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for ids, targets in batches[:3]:
            step(ids, targets)  # type: ignore[operator]
        torch.cuda.synchronize()
    out: Counter[str] = Counter()
    for e in prof.key_averages():
        if e.device_time_total > 0:
            out[re.sub(r"_\d+$", "", e.key)] += e.device_time_total / 3
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--preset", choices=sorted(PRESETS), default=None)
    parser.add_argument("--profile", action="store_true", help="CUDA: device time per step by kernel")
    parser.add_argument("--layers", type=int, default=None)
    args = parser.parse_args()
    dims = dict(PRESETS[args.preset or ("h100" if args.device == "cuda" else "cpu")])
    if args.layers is not None:
        dims["layers"] = args.layers
    missing = torchao_missing()
    print("\n".join(machine_lines()))
    print(f"device {args.device}, llama-like {dims}, inductor; one training step's generated code per variant")
    if missing:
        print(f"torchao rows left out: {missing}")
    warnings.filterwarnings("ignore", category=amp_fx.AmpFxWarning)
    batches = token_batches(4, dims["vocab"], dims["batch"], dims["seq"], args.device)
    graphs: dict[str, list[GraphCode]] = {}
    times: dict[str, Counter[str]] = {}
    rows = []
    for variant in variants(args.device, "inductor", ["tensorwise"], missing is None):
        release(args.device)
        torch.manual_seed(0)
        model = variant.build(
            MODELS["llama-like"](dims["vocab"], dims["d"], dims["layers"], dims["heads"], dims["seq"]).to(args.device)
        )

        def step(
            ids: torch.Tensor, targets: torch.Tensor, model: torch.nn.Module = model, variant: object = variant
        ) -> None:
            with variant.region():  # type: ignore[attr-defined]
                logits = model(ids)
            lm_loss(logits, targets).backward()
            model.zero_grad(set_to_none=True)

        try:
            with generated_code() as codes:
                step(*batches[0])
                step(*batches[1])  # a recompile, if any, is part of the step
        except Exception as e:  # noqa: BLE001 - one variant's failure is a row
            rows.append([variant.name, f"failed: {type(e).__name__}: {str(e)[:100]}"])
            continue
        graphs[variant.name] = [parse(c) for c in codes]
        total = _total(graphs[variant.name])
        row = [
            variant.name,
            len(codes),
            sum(total.kernels.values()),
            sum(total.externs.values()),
            ", ".join(f"{k} {n}" for k, n in sorted(total.externs.items())),
        ]
        if args.profile and args.device == "cuda":
            times[variant.name] = _device_times(step, batches, args.device)
            row.append(f"{sum(times[variant.name].values()) / 1e3:.2f}")
        rows.append(row)
        print(f"[gap_kernels] {rows[-1]}", file=sys.stderr, flush=True)
    headers = ["variant", "graphs", "fused kernels", "extern calls", "extern calls by name"]
    if times:
        headers.append("device ms/step")
    print(tabulate(rows, headers=headers))
    for ours, theirs in PAIRS:
        if ours not in graphs or theirs not in graphs:
            print(f"\n{ours} vs {theirs}: not compared (a side did not run)")
            continue
        a, b = _total(graphs[ours]), _total(graphs[theirs])
        print(f"\n{ours} vs {theirs}")
        print(f"  fused kernels: {sum(a.kernels.values())} vs {sum(b.kernels.values())}: {diff(a.kernels, b.kernels)}")
        print(f"  extern calls: {sum(a.externs.values())} vs {sum(b.externs.values())}: {diff(a.externs, b.externs)}")
        if ours in times and theirs in times:
            delta = {k: times[ours][k] - times[theirs][k] for k in times[ours].keys() | times[theirs].keys()}
            top = sorted(delta.items(), key=lambda kv: -abs(kv[1]))[:10]
            print("  device time per step, largest differences (us, + where amp_fx spends more):")
            for k, d in top:
                print(f"    {d:+9.1f}  {k[:110]}")


if __name__ == "__main__":
    main()
