"""What finding the first overflowing op costs per training step: amp_fx's forward watch against
what users run today (issue 21).

Two Hugging Face models with random weights (no download): GPT-2-like (``--gpt2-layers`` x
``--gpt2-width``, 8 heads) and Llama-like (``--llama-layers`` x ``--llama-width``), fp16, SGD.

* ``compile_step(..., watch_nonfinite=True)`` vs ``watch_nonfinite=False`` (inductor): the same
  compiled step with and without the watch: the forward watch alone (the backward watch switched
  off for the bench: ``--watch forward``), and the forward and backward watch (``--watch both``,
  what ``watch_nonfinite=True`` does with inductor).
* eager ``torch.autocast`` + ``torch.amp.GradScaler``, with HF's ``DebugUnderflowOverflow`` (forward
  hooks that read every module's abs-max on the host) vs without.
* the same eager step under ``torch.autograd.detect_anomaly()`` vs without.

Each pair runs interleaved in one process (rounds of ``--steps`` steps of one, then of the other),
so drift and other processes affect both alike; the table gives the ratio (with / without) of each
round's median step time: median, p10, p90 over rounds.

    python bench/bench_overflow_watch.py --rounds 7 --steps 3 --batch 2 --seq 32
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from tabulate import tabulate

import amp_fx
from amp_fx.testing.bench import machine_lines, percentile


def gpt2(layers: int, width: int, vocab: int) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(
        n_layer=layers,
        n_embd=width,
        n_head=8,
        vocab_size=vocab,
        n_positions=256,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    return GPT2LMHeadModel(cfg)


def llama(layers: int, width: int, vocab: int) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        num_hidden_layers=layers,
        hidden_size=width,
        intermediate_size=int(width * 8 / 3) // 8 * 8,
        num_attention_heads=8,
        num_key_value_heads=4,
        vocab_size=vocab,
        max_position_embeddings=256,
    )
    return LlamaForCausalLM(cfg)


def lm_loss(out: Any, labels: torch.Tensor) -> torch.Tensor:
    logits = out.logits if hasattr(out, "logits") else out[0]
    return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())


def _compiled(make: Callable[[], torch.nn.Module], watch: bool, backward: bool = True) -> Callable[..., Any]:
    """``backward=False``: the forward watch alone, as before the backward watch existed (the
    downstream compile without it, amp_fx.backend's hook switched off while this step compiles)."""
    torch.manual_seed(0)
    model = make()
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    step = amp_fx.compile_step(model, opt, lm_loss, backend="inductor", watch_nonfinite=watch)
    if backward:
        return step

    def forward_watch_only(*args: Any) -> Any:
        import amp_fx.backend.compiler as backend

        hook = backend.watching_downstream
        backend.watching_downstream = lambda *a, **k: None  # the graphs compiled now: no backward watch
        try:
            return step(*args)
        finally:
            backend.watching_downstream = hook

    return forward_watch_only


def _eager(make: Callable[[], torch.nn.Module], variant: str) -> Callable[..., Any]:
    torch.manual_seed(0)
    model = make()
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    scaler = torch.amp.GradScaler("cpu")
    if variant == "debug":
        from transformers.debug_utils import DebugUnderflowOverflow

        DebugUnderflowOverflow(model)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        anomaly = torch.autograd.detect_anomaly(check_nan=True) if variant == "anomaly" else _Null()
        with anomaly:
            with torch.autocast("cpu", dtype=torch.float16):
                loss = lm_loss(model(x), y)
            scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return step


class _Null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *args: object) -> None:
        return None


def _time(step: Callable[..., Any], batch: tuple[torch.Tensor, torch.Tensor], n: int) -> float:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        step(*batch)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def compare(
    pair: tuple[Callable[..., Any], Callable[..., Any]],
    batch: tuple[torch.Tensor, torch.Tensor],
    rounds: int,
    steps: int,
    warmup: int,
) -> tuple[list[float], float, float]:
    """Ratios (second / first) of each round's median; the first's and second's overall medians."""
    base, other = pair
    for _ in range(warmup):
        base(*batch)
        other(*batch)
    ratios, a_all, b_all = [], [], []
    for _ in range(rounds):
        a = _time(base, batch, steps)
        b = _time(other, batch, steps)
        ratios.append(b / a)
        a_all.append(a)
        b_all.append(b)
    return ratios, statistics.median(a_all), statistics.median(b_all)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--gpt2-layers", type=int, default=6)
    p.add_argument("--gpt2-width", type=int, default=512)
    p.add_argument("--llama-layers", type=int, default=4)
    p.add_argument("--llama-width", type=int, default=256)
    p.add_argument("--only", choices=["compiled", "eager"], default=None)
    p.add_argument("--model", choices=["gpt2", "llama"], default=None, help="one model only (default: both)")
    p.add_argument(
        "--watch",
        choices=["forward", "both", "all"],
        default="all",
        help="compiled pairs: the forward watch / off, the forward+backward watch / off, or all three pairs",
    )
    args = p.parse_args()

    models = {
        f"GPT-2-like {args.gpt2_layers}x{args.gpt2_width}": lambda: gpt2(args.gpt2_layers, args.gpt2_width, args.vocab),
        f"Llama-like {args.llama_layers}x{args.llama_width}": lambda: llama(
            args.llama_layers, args.llama_width, args.vocab
        ),
    }
    if args.model is not None:
        models = {k: v for k, v in models.items() if k.lower().startswith(args.model[:3])}
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen)
    batch = (x, x.roll(-1, dims=1))
    rows = []
    for name, make in models.items():
        pairs = {}
        if args.only in (None, "compiled"):
            if args.watch in ("forward", "all"):
                pairs["compile_step inductor: forward watch / off"] = (
                    _compiled(make, False),
                    _compiled(make, True, backward=False),
                )
            if args.watch in ("both", "all"):
                pairs["compile_step inductor: forward+backward watch / off"] = (
                    _compiled(make, False),
                    _compiled(make, True),
                )
            if args.watch == "all":
                pairs["compile_step inductor: forward+backward watch / forward watch"] = (
                    _compiled(make, True, backward=False),
                    _compiled(make, True),
                )
        if args.only in (None, "eager"):
            pairs["eager: DebugUnderflowOverflow / none"] = (_eager(make, "none"), _eager(make, "debug"))
            pairs["eager: detect_anomaly / none"] = (_eager(make, "none"), _eager(make, "anomaly"))
        for what, pair in pairs.items():
            ratios, base, other = compare(pair, batch, args.rounds, args.steps, args.warmup)
            rows.append(
                [
                    name,
                    what,
                    f"{1e3 * base:.1f}",
                    f"{1e3 * other:.1f}",
                    f"{statistics.median(ratios):.3f}",
                    f"{percentile(ratios, 0.1):.3f}",
                    f"{percentile(ratios, 0.9):.3f}",
                ]
            )
            print(rows[-1], flush=True)
    for line in machine_lines():
        print(line)
    print(
        f"batch {args.batch} x seq {args.seq}, vocab {args.vocab}, {args.rounds} rounds x {args.steps} steps, "
        f"ratios = per-round median with / without"
    )
    print(tabulate(rows, headers=["model", "comparison", "without ms", "with ms", "ratio p50", "p10", "p90"]))


if __name__ == "__main__":
    main()
