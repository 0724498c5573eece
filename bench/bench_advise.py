"""amp_fx.advise's wall time as a multiple of one fp32 forward+backward of the same model and batch.

GPT-2 (transformers, random init, n_embd 128, 4 heads, vocabulary 1000, eager attention) at 6 and 12
layers, to show how the time grows with depth; per dtype, the healthy model (no search: one float64
and one low-precision run) and, with ``--hazard``, the same model with the first block's query and key
projections scaled by 300 so its attention scores overflow fp16 (a search; in bf16 they fit).
Eager attention because CPU SDPA computes the scores in fp32 internally, where nothing overflows.

With ``--fp8 RECIPE`` each bf16 row is followed by ``advise(..., dtype="bf16", fp8=RECIPE)`` on the
same model, and the ``--hazard`` model of those rows is an fp8 hazard instead: block 0's
``mlp.c_proj`` reads a massive activation (one input channel at 10**6, which its weights ignore),
which flushes the rest of its fp8 input to zero (``amp_fx.testing.hazards.FP8_HAZARDS``'s outlier).

Reported per row: the median of ``--repeats`` advise calls over the median of ``--repeats`` fp32
forward+backward calls, with p10-p90 of advise's time (spread), the modules kept and the share of the
matmul/conv/attention FLOPs their keep moves to fp32, and for reference one forward+backward
under eager autocast in the dtype (bf16/fp16 matmuls on a CPU without low-precision units are
several times slower than fp32, which bounds what any low-precision measurement can cost).

    python bench/bench_advise.py
    python bench/bench_advise.py --layers 6 12 --dtypes bf16 fp16 --repeats 3
    python bench/bench_advise.py --layers 6 --dtypes bf16 --fp8 tensorwise --hazard
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
from amp_fx.policy import resolve_dtype
from amp_fx.testing.bench import machine_lines, percentile


def gpt2(layers: int, *, hazard: bool = False, fp8_hazard: bool = False) -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(
        n_layer=layers,
        n_embd=128,
        n_head=4,
        vocab_size=1000,
        n_positions=128,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        attn_implementation="eager",
    )
    model = transformers.GPT2LMHeadModel(cfg)
    if hazard:  # query/key projections of block 0 x300: q.k over 32 dims reaches ~1e5 > 65504
        with torch.no_grad():
            model.transformer.h[0].attn.c_attn.weight[:, :256].mul_(300.0)
    if fp8_hazard:  # a massive activation entering block 0's c_proj (Conv1D: weight [in, out])
        proj = model.transformer.h[0].mlp.c_proj
        with torch.no_grad():
            proj.weight[0].zero_()
        spike = torch.zeros(proj.weight.shape[0])
        spike[0] = 1e6
        proj.register_forward_pre_hook(lambda m, args: (args[0] + spike.to(args[0].dtype),))
    return model


def _times(fn: Callable[[], Any], repeats: int) -> list[float]:
    fn()  # warm-up (allocator, lazy init)
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, nargs="+", default=[6, 12])
    p.add_argument("--dtypes", nargs="+", default=["bf16", "fp16"])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--hazard", action="store_true", help="also time the model with a planted fp16 overflow")
    p.add_argument("--fp8", default=None, help="also advise for this fp8 recipe after each bf16 row")
    args = p.parse_args()
    ids = torch.randint(0, 1000, (args.batch, args.seq), generator=torch.Generator().manual_seed(1))

    def loss_fn(out: Any) -> torch.Tensor:
        return out.loss

    rows = []
    for layers in args.layers:
        for hazard in [False, True] if args.hazard else [False]:
            model = gpt2(layers, hazard=hazard and not args.fp8, fp8_hazard=hazard and bool(args.fp8))

            def fwd_bwd(dtype: torch.dtype | None = None) -> None:
                model.zero_grad(set_to_none=True)
                with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
                    loss = model(input_ids=ids, labels=ids).loss
                loss.backward()

            base = statistics.median(_times(fwd_bwd, args.repeats))
            variants = [(name, None) for name in args.dtypes]
            if args.fp8:
                variants += [("bf16", args.fp8)]
            if args.fp8 and hazard:  # the fp8 hazard model is healthy in bf16/fp16: fp8 rows only
                variants = [("bf16", args.fp8)]
            for name, fp8 in variants:
                low = resolve_dtype(name)
                low_time = statistics.median(_times(lambda: fwd_bwd(low), args.repeats))
                last: list[amp_fx.Advice] = []
                ts = _times(
                    lambda: last.append(
                        amp_fx.advise(model, dtype=name, loss_fn=loss_fn, input_ids=ids, labels=ids, fp8=fp8)
                    ),
                    args.repeats,
                )
                a = last[-1]
                kept = a.keep_out_of_fp8 if fp8 else a.keep_fp32
                rows.append(
                    [
                        layers,
                        "yes" if hazard else "no",
                        name + (f" + fp8 {fp8}" if fp8 else ""),
                        f"{base * 1e3:.0f}",
                        f"{low_time / base:.1f}x",
                        f"{statistics.median(ts):.2f}",
                        f"{statistics.median(ts) / base:.1f}x",
                        f"{percentile(ts, 0.1) / base:.1f}-{percentile(ts, 0.9) / base:.1f}x",
                        a.runs,
                        ", ".join(kept) or "-",
                        f"{sum(k.flop_share for k in a.kept):.1%}" if a.kept else "-",
                    ]
                )
    for line in machine_lines():
        print(line)
    print(f"GPT-2 n_embd 128, batch {args.batch} x {args.seq} tokens, {args.repeats} repeats (medians)")
    print(
        tabulate(
            rows,
            headers=[
                "layers",
                "hazard",
                "dtype",
                "fp32 fwd+bwd ms",
                "autocast fwd+bwd",
                "advise s",
                "advise / fp32 fwd+bwd",
                "p10-p90",
                "policy runs",
                "kept (fp32, or out of fp8)",
                "kept FLOP share",
            ],
        )
    )


if __name__ == "__main__":
    main()
