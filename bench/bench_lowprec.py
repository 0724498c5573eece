"""bf16 training state against fp32 master weights: a Llama-like model trained with ``compile_step``.

    python bench/bench_lowprec.py                       # CPU: Llama-like 4 x 256, 300 AdamW steps
    python bench/bench_lowprec.py --steps 600 --device cuda --backend inductor

Four runs of the same model (``bench/bench_weight_casts.py``'s Llama: RMSNorm, SwiGLU, untied
head), from the same fp32 initialisation, on the same batches, each through
``amp_fx.compile_step(..., dtype="bf16")`` with AdamW (lr 1e-3, 10-step warm-up then cosine decay
to 1e-5, weight decay 0.1, betas 0.9 / 0.95):

* **fp32 master**: fp32 parameters, gradients and moments (16 bytes per parameter);
* **bf16 + stochastic rounding**: ``train_state="bf16_sr"`` (8 bytes);
* **bf16 + Kahan**: ``train_state="bf16_kahan"`` (10 bytes);
* **bf16 round-to-nearest**: the model turned to bf16 (``model.bfloat16()``) and torch's AdamW as
  it is (its moments inherit bf16): what a user gets without the option (8 bytes).

The data is a synthetic language with something to learn throughout: a fixed random Markov chain
over the vocabulary (each token followed by one of 8 tokens, with Dirichlet(0.5) probabilities;
its entropy rate is the best loss a model can reach, printed). Reported per run: the train loss
(mean of the last 20 steps), the loss on 8 held-out batches (fp32 weights of each run evaluated
the same way, eager autocast bf16) and its gap to fp32 master, and bytes held per parameter
(parameters, a gradient of the parameter's dtype, optimizer state but its step counters).

What the run must show (docs/memory.md records it): both bf16 states end within 0.01 nats of
held-out loss of fp32 master weights, and round-to-nearest bf16 weights measurably above it.
"""

from __future__ import annotations

import argparse
import copy
import math
import sys
import time
import warnings
from collections.abc import Callable

import torch
from tabulate import tabulate
from torch import Tensor, nn

import amp_fx
from amp_fx.testing.bench import machine_lines

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from bench_memory import PRESETS  # noqa: E402 (the tier's Llama-like shapes)
from bench_weight_casts import Llama, lm_loss  # noqa: E402 (the same model as the weight-cast bench)

RUNS = ("fp32 master", "bf16 + stochastic rounding", "bf16 + Kahan", "bf16 round-to-nearest")
TRAIN_STATE = {"bf16 + stochastic rounding": "bf16_sr", "bf16 + Kahan": "bf16_kahan"}


class MarkovText:
    """Batches from a fixed random Markov chain over ``vocab`` tokens (``fanout`` successors each)."""

    def __init__(self, vocab: int, fanout: int = 8, seed: int = 1234) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.next = torch.stack([torch.randperm(vocab, generator=gen)[:fanout] for _ in range(vocab)])
        alpha = torch.full((fanout,), 0.5)
        probs = torch.distributions.Dirichlet(alpha).sample((vocab,))  # (global RNG: seeded by the caller)
        self.probs = probs / probs.sum(-1, keepdim=True)
        self.vocab = vocab

    def entropy_rate(self) -> float:
        """The chain's entropy per token (nats) under its stationary distribution: the lowest loss."""
        dense = torch.zeros(self.vocab, self.vocab, dtype=torch.float64)
        dense.scatter_(1, self.next, self.probs.double())
        pi = torch.full((self.vocab,), 1.0 / self.vocab, dtype=torch.float64)
        for _ in range(1000):
            pi = pi @ dense
        h = -(self.probs.double() * self.probs.double().clamp_min(1e-300).log()).sum(-1)
        return float((pi * h).sum())

    def batch(self, batch: int, seq: int, gen: torch.Generator) -> tuple[Tensor, Tensor]:
        tokens = torch.empty(batch, seq + 1, dtype=torch.int64)
        tokens[:, 0] = torch.randint(0, self.vocab, (batch,), generator=gen)
        for t in range(seq):
            pick = torch.multinomial(self.probs[tokens[:, t]], 1, generator=gen).squeeze(1)
            tokens[:, t + 1] = self.next[tokens[:, t], pick]
        return tokens[:, :-1], tokens[:, 1:]


def lr_at(step: int, steps: int, peak: float = 1e-3, floor: float = 1e-5, warmup: int = 10) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return floor + 0.5 * (peak - floor) * (1 + math.cos(math.pi * progress))


def build(
    name: str, init: nn.Module, backend: str
) -> tuple[Callable[[Tensor, Tensor], Tensor], nn.Module, torch.optim.Optimizer]:
    model = copy.deepcopy(init)
    if name == "bf16 round-to-nearest":
        model = model.bfloat16()
    opt = torch.optim.AdamW(model.parameters(), lr=lr_at(0, 1), betas=(0.9, 0.95), weight_decay=0.1)
    step = amp_fx.compile_step(model, opt, lm_loss, dtype="bf16", backend=backend, train_state=TRAIN_STATE.get(name))  # type: ignore[arg-type]
    return step, model, opt


def held_per_param(model: nn.Module, opt: torch.optim.Optimizer) -> float:
    """Parameters + gradients (one per parameter, the parameter's dtype) + optimizer state, per parameter."""
    params = list(model.parameters())
    state = sum(v.nbytes for p in params for k, v in opt.state[p].items() if k != "step")
    return (2 * sum(p.nbytes for p in params) + state) / sum(p.numel() for p in params)


@torch.no_grad()
def eval_loss(model: nn.Module, batches: list[tuple[Tensor, Tensor]], device: str) -> float:
    fp32 = copy.deepcopy(model).float()  # exact for bf16 weights: every run evaluated alike
    with torch.autocast(device, torch.bfloat16):
        losses = [lm_loss(fp32(x.to(device)), y.to(device)) for x, y in batches]
    return float(torch.stack(losses).mean())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--backend", default="aot_eager")
    parser.add_argument("--runs", default="", help="prefixes of run names, separated by ';' (default: all)")
    for key in ("vocab", "d", "layers", "heads", "seq", "batch"):
        parser.add_argument(f"--{key}", type=int, default=None)
    args = parser.parse_args()
    dims = dict(PRESETS["cuda" if args.device == "cuda" else "cpu"])
    dims.update({k: getattr(args, k) for k in dims if getattr(args, k) is not None})
    prefixes = [p.strip() for p in args.runs.split(";") if p.strip()]
    names = [n for n in RUNS if not prefixes or any(n.startswith(p) for p in prefixes)]

    torch.manual_seed(0)
    data = MarkovText(dims["vocab"])
    init = Llama(dims["vocab"], dims["d"], dims["layers"], dims["heads"], dims["seq"]).to(args.device)
    eval_gen = torch.Generator().manual_seed(99)
    held_out = [data.batch(dims["batch"], dims["seq"], eval_gen) for _ in range(8)]
    train_gen = torch.Generator().manual_seed(7)
    batches = [data.batch(dims["batch"], dims["seq"], train_gen) for _ in range(args.steps)]

    print("\n".join(machine_lines()))
    print(
        f"Llama-like {dims}, {args.steps} AdamW steps, backend {args.backend}, device {args.device}; "
        f"data: Markov chain, entropy rate {data.entropy_rate():.4f} nats/token (the lowest loss)"
    )
    rows, fp32_eval = [], None
    for name in names:
        torch.manual_seed(0)  # the same stream for stochastic rounding in every invocation
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # compile-time chatter; the table is the result
            step, model, opt = build(name, init, args.backend)
        losses = []
        start = time.perf_counter()
        for i, (x, y) in enumerate(batches):
            for group in opt.param_groups:
                group["lr"] = lr_at(i, args.steps)
            losses.append(step(x.to(args.device), y.to(args.device)))
        train = float(torch.stack(losses[-20:]).mean())
        seconds = time.perf_counter() - start
        held = held_per_param(model, opt)
        ev = eval_loss(model, held_out, args.device)
        fp32_eval = ev if name == "fp32 master" else fp32_eval
        rows.append(
            {
                "run": name,
                "train loss (last 20)": f"{train:.4f}",
                "held-out loss": f"{ev:.4f}",
                "- fp32 master": "" if fp32_eval is None else f"{ev - fp32_eval:+.4f}",
                "B/param held": f"{held:.2f}",
                "first loss": f"{float(losses[0]):.4f}",
                "s": f"{seconds:.0f}",
            }
        )
        print(f"  {name}: done in {seconds:.0f} s", file=sys.stderr)
    print(tabulate(rows, headers="keys", tablefmt="github"))


if __name__ == "__main__":
    main()
