"""Greedy generate() through amp_fx: graphs captured, parity with eager autocast, time per call.

    python bench/bench_generate.py                 # GPT-2 and Llama, dynamic and static cache, bf16
    python bench/bench_generate.py --dtypes bf16 fp16 --repeats 7

Models: ``amp_fx.testing.generate.tiny_causal_lm`` (2 layers of width 64, random init), a prompt of
2 x 5 tokens, 6 new tokens, ``do_sample=False``. Variants, each on the same calls:

* eager: ``model.generate`` under ``torch.autocast`` (the reference);
* torch in place: ``model.compile(backend=B)``, generate under ``torch.autocast``;
* torch wrapper: ``torch.compile(model, backend=B).generate`` under ``torch.autocast`` (its
  ``generate`` is the original's, so it runs the original forward and captures nothing);
* amp_fx: ``amp_fx.compile(model, dtype=..., backend=B, inplace=True).generate``.

Graphs: graphs the backend received over the first call, made right after ``torch._dynamo.reset()``
(Dynamo keeps automatic-dynamic shape state per code location, shared by every variant of one model
class in a process; Dynamo's CompileCounterWithBackend for torch, ``amp_fx.records`` for amp_fx).
Parity: tokens equal and every step's logits bitwise equal to eager. Time: generate wall time after
one warm-up call; median and p10/p90 over ``--repeats``,
the variants interleaved call by call so that machine noise hits all alike.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from tabulate import tabulate
from torch._dynamo.testing import CompileCounterWithBackend

import amp_fx
from amp_fx.testing.bench import machine_lines, percentile
from amp_fx.testing.generate import ARCHS, greedy_generate, prompt, tiny_causal_lm

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _variants(arch: str, dtype: str, backend: str):
    """name -> (model to call generate on, whether to run under torch.autocast, graph counter)."""
    out = {"eager": (tiny_causal_lm(arch), True, None)}
    inplace = tiny_causal_lm(arch)
    counter = CompileCounterWithBackend(backend)
    inplace.compile(backend=counter)
    out["torch in place"] = (inplace, True, counter)
    wrapper_counter = CompileCounterWithBackend(backend)
    out["torch wrapper"] = (torch.compile(tiny_causal_lm(arch), backend=wrapper_counter), True, wrapper_counter)
    ours = amp_fx.compile(tiny_causal_lm(arch), dtype=dtype, backend=backend, inplace=True)
    out["amp_fx"] = (ours, False, ours)
    return out


def _run(model, autocast: bool, dtype: str, ids, cache: str):
    if autocast:
        with torch.autocast("cpu", dtype=DTYPES[dtype]):
            return greedy_generate(model, ids, cache)
    return greedy_generate(model, ids, cache)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtypes", nargs="+", default=["bf16"], choices=sorted(DTYPES))
    parser.add_argument("--backend", default="aot_eager")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    print("\n".join(machine_lines()))
    rows = []
    ids = prompt()
    for arch in ARCHS:
        for cache in ("dynamic", "static"):
            for dtype in args.dtypes:
                torch._dynamo.reset()
                variants = _variants(arch, dtype, args.backend)
                try:
                    ref = _run(variants["eager"][0], True, dtype, ids, cache)
                except RuntimeError as e:  # Llama + StaticCache under autocast: see docs/everyday.md
                    rows.append([arch, cache, dtype, "eager fails", "-", "-", "-", f"{str(e)[:60]}..."])
                    continue
                results, graphs, times = {}, {}, {name: [] for name in variants}
                for name, (model, autocast, counter) in variants.items():
                    torch._dynamo.reset()
                    results[name] = _run(model, autocast, dtype, ids, cache)
                    graphs[name] = (
                        "-"
                        if counter is None
                        else len(amp_fx.records(counter))
                        if name == "amp_fx"
                        else counter.frame_count
                    )
                for name, (model, autocast, _) in variants.items():
                    _run(model, autocast, dtype, ids, cache)  # warm-up after the resets: compiles again
                for _ in range(args.repeats):
                    for name, (model, autocast, _) in variants.items():
                        t0 = time.perf_counter()
                        _run(model, autocast, dtype, ids, cache)
                        times[name].append(time.perf_counter() - t0)
                for name in variants:
                    out = results[name]
                    same = torch.equal(out.sequences, ref.sequences)
                    bitwise = all(torch.equal(a, b) for a, b in zip(out.logits, ref.logits, strict=True))
                    t = times[name]
                    rows.append(
                        [
                            arch,
                            cache,
                            dtype,
                            name,
                            graphs[name],
                            same,
                            bitwise,
                            f"{1e3 * statistics.median(t):.1f} ({1e3 * percentile(t, 0.1):.1f}-"
                            f"{1e3 * percentile(t, 0.9):.1f})",
                        ]
                    )
    print(
        tabulate(
            rows,
            headers=[
                "model",
                "cache",
                "dtype",
                "variant",
                "graphs",
                "tokens equal",
                "logits bitwise",
                "ms per generate, median (p10-p90)",
            ],
        )
    )


if __name__ == "__main__":
    main()
