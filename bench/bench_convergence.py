"""Convergence of the low-precision recipes: a tiny transformers Llama trained from random init in
bf16 and in each recipe, over a few seeds.

    python bench/bench_convergence.py                         # CPU: 4 x 64 Llama, 300 steps, 2 seeds
    python bench/bench_convergence.py --steps 100 --seeds 0,1,2 --recipes bf16,nvfp4
    python bench/bench_convergence.py --recipes bf16,rowwise --json a.jsonl   # runs in parallel processes,
    python bench/bench_convergence.py --recipes nvfp4 --json b.jsonl          # then one table of them all:
    python bench/bench_convergence.py --table a.jsonl b.jsonl

Per run: ``transformers.LlamaForCausalLM`` (vocab 256, hidden 64, 4 layers, 4 heads, SwiGLU
128, random init from the seed), ``amp_fx.compile_step(..., dtype="bf16", low_precision=recipe)``
under ``backend`` (``aot_eager`` by default: the fastest to compile), AdamW (peak lr 3e-3, 10-step
warm-up then cosine decay to 1e-5, weight decay 0.1, betas 0.9 / 0.95), batches of 8 sequences
of 64 tokens. The data is ``bench/bench_lowprec.py``'s synthetic language, a fixed random Markov
chain over the vocabulary (each token followed by one of 8 tokens with Dirichlet(0.5)
probabilities); its entropy rate, printed, is the lowest loss a model can reach, and chance is
ln(256) = 5.545 nats. The chain is the same for every run; a seed sets the initial weights, the
batch stream and stochastic rounding's random stream (NVFP4's gradients).

Rows: ``bf16`` (no low-precision recipe), ``rowwise``, ``blockwise``, ``mxfp8``, ``nvfp4`` (every
matmul with a parameter in the recipe) and ``nvfp4 keep_ends`` (``LowPrecision.keep_ends(recipe=
"nvfp4")``: the first and last blocks and ``lm_head`` in bf16). On a CPU every recipe's GEMM is
emulated (``_scaled_mm``'s reference kernel for fp8, amp_fx's dequantize-then-``mm`` for NVFP4):
the numerics are the recipe's, the steps/s say nothing about a GPU's tensor cores.

Columns: the final loss (the mean of the last 20 steps' training losses) as mean over seeds and
spread (max - min over seeds), its difference from bf16's mean and, per seed, from bf16's run at the
same seed (same initial weights and batches: the seeds' spread cancels), the first step's loss, and steps/s
(the steps after the first, whose time is mostly compilation, over their wall time; median over
seeds).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
import warnings
from dataclasses import dataclass

import torch
from tabulate import tabulate
from torch import Tensor, nn

import amp_fx
from amp_fx.testing.bench import machine_lines

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from bench_lowprec import MarkovText, lr_at  # noqa: E402 (the same synthetic language and schedule)

RECIPES = ("bf16", "rowwise", "blockwise", "mxfp8", "nvfp4", "nvfp4 keep_ends")
TAIL = 20  # the final loss: the mean of the last TAIL steps' losses


@dataclass(frozen=True)
class Run:
    """One recipe's training run at one seed."""

    recipe: str
    seed: int
    losses: list[float]
    steps_per_s: float


def final_loss(losses: list[float]) -> float:
    """The mean of the last ``TAIL`` losses (all of them when fewer)."""
    if not losses:
        raise ValueError("final_loss of a run with no losses")
    tail = losses[-TAIL:]
    return sum(tail) / len(tail)


def table_rows(runs: list[Run]) -> list[dict[str, str]]:
    """One row per recipe, in first-seen order: the final loss's mean and spread (max - min) over
    the recipe's seeds, the difference of its mean from bf16's (blank without a bf16 run) and of
    each seed's final loss from bf16's at the same seed (the same initial weights and batches, so
    the seeds' spread cancels), the first loss's mean and the median steps/s."""
    by_recipe: dict[str, list[Run]] = {}
    for run in runs:
        by_recipe.setdefault(run.recipe, []).append(run)
    base = statistics.fmean(final_loss(r.losses) for r in by_recipe["bf16"]) if "bf16" in by_recipe else None
    base_by_seed = {r.seed: final_loss(r.losses) for r in by_recipe.get("bf16", [])}
    rows = []
    for recipe, group in by_recipe.items():
        finals = [final_loss(r.losses) for r in group]
        mean = statistics.fmean(finals)
        rows.append(
            {
                "recipe": recipe,
                "seeds": str(len(group)),
                "final loss (mean)": f"{mean:.4f}",
                "spread (max-min)": f"{max(finals) - min(finals):.4f}",
                "- bf16": "" if base is None else f"{mean - base:+.4f}",
                "- bf16 per seed": " ".join(
                    f"{final_loss(r.losses) - base_by_seed[r.seed]:+.4f}" for r in group if r.seed in base_by_seed
                ),
                "first loss": f"{statistics.fmean(r.losses[0] for r in group):.4f}",
                "steps/s": f"{statistics.median(r.steps_per_s for r in group):.2f}",
            }
        )
    return rows


def _low_precision(recipe: str) -> amp_fx.LowPrecision | str | None:
    if recipe == "bf16":
        return None
    if recipe == "nvfp4 keep_ends":
        return amp_fx.LowPrecision.keep_ends(recipe="nvfp4")
    return recipe


def _llama(vocab: int, d: int, layers: int, heads: int, seq: int) -> nn.Module:
    import transformers as tf

    config = tf.LlamaConfig(
        vocab_size=vocab,
        hidden_size=d,
        intermediate_size=2 * d,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=seq,
        use_cache=False,
    )
    return tf.LlamaForCausalLM(config)


def _loss(out: object, targets: Tensor) -> Tensor:
    logits = out.logits  # type: ignore[attr-defined]
    return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def _reset(model: nn.Module, init: dict[str, Tensor], opt: torch.optim.Optimizer) -> None:
    """The model back to ``init`` and the optimizer's state to zero, in place: the compiled step
    holds these tensors, so the next seed reuses it instead of compiling again (a minute and more
    per recipe on this CPU)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(init[name])
            p.grad = None
        for state in opt.state.values():
            for value in state.values():
                if isinstance(value, Tensor):
                    value.zero_()


def append_run(path: str, run: Run) -> None:
    """``run`` as one JSON line at the end of ``path`` (``--json``): written as each run ends, so
    that a run cut short keeps the seeds it finished."""
    with open(path, "a") as f:
        f.write(json.dumps(dataclasses.asdict(run)) + "\n")


def read_runs(paths: list[str]) -> list[Run]:
    """The runs that ``--json`` wrote, one JSON object a line, from each file in order."""
    runs = []
    for path in paths:
        with open(path) as f:
            runs += [Run(**json.loads(line)) for line in f if line.strip()]
    return runs


def train(recipe: str, seeds: list[int], data: MarkovText, args: argparse.Namespace) -> list[Run]:
    """``recipe`` trained from each seed's initial weights on each seed's batches, through one
    compiled step: the model and optimizer are reset in place between seeds (``_reset``)."""
    model = _llama(data.vocab, args.d, args.layers, args.heads, args.seq)
    opt = torch.optim.AdamW(model.parameters(), lr=lr_at(0, 1), betas=(0.9, 0.95), weight_decay=0.1)
    runs = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the emulation notices: the docstring says it
        step = amp_fx.compile_step(
            model, opt, _loss, dtype="bf16", backend=args.backend, low_precision=_low_precision(recipe)
        )
        for seed in seeds:
            torch.manual_seed(seed)  # initial weights, then stochastic rounding's stream
            init = {
                k: v.detach().clone()
                for k, v in _llama(data.vocab, args.d, args.layers, args.heads, args.seq).named_parameters()
            }
            _reset(model, init, opt)
            gen = torch.Generator().manual_seed(1000 + seed)
            batches = [data.batch(args.batch, args.seq, gen) for _ in range(args.steps)]
            losses: list[float] = []
            start = time.perf_counter()
            for i, (x, y) in enumerate(batches):
                for group in opt.param_groups:
                    group["lr"] = lr_at(i, args.steps, peak=args.lr)
                losses.append(float(step(x, y)))
                if i == 0:
                    start = time.perf_counter()
            seconds = time.perf_counter() - start
            run = Run(recipe, seed, losses, (args.steps - 1) / seconds if args.steps > 1 else float("nan"))
            runs.append(run)
            if args.json:
                append_run(args.json, run)
            print(
                f"  {recipe} seed {seed}: final {final_loss(run.losses):.4f}, {run.steps_per_s:.2f} steps/s",
                file=sys.stderr,
                flush=True,
            )
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seeds", default="0,1", help="comma-separated seeds")
    parser.add_argument("--recipes", default=",".join(RECIPES), help=f"comma-separated, of {list(RECIPES)}")
    parser.add_argument("--backend", default="aot_eager")
    parser.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads (1: on a loaded machine more threads spin, 40x slower)"
    )
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--d", type=int, default=64)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--json", default="", help="append each run (its losses) to this file, a JSON line each")
    parser.add_argument(
        "--table", nargs="+", default=None, help="only print the table of the runs in these --json files"
    )
    args = parser.parse_args()
    if args.table:
        runs = sorted(read_runs(args.table), key=lambda r: RECIPES.index(r.recipe))  # stable: seeds in order
        print(tabulate(table_rows(runs), headers="keys", tablefmt="github", disable_numparse=True))
        return
    torch.set_num_threads(args.threads)
    recipes = [r.strip() for r in args.recipes.split(",") if r.strip()]
    unknown = [r for r in recipes if r not in RECIPES]
    if unknown:
        parser.error(f"unknown recipes {unknown}; expected some of {list(RECIPES)}")
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]

    torch.manual_seed(1234)  # the chain's probabilities (MarkovText draws them from the global RNG)
    data = MarkovText(args.vocab)
    print("\n".join(machine_lines()))
    import torchao
    import transformers

    print(f"torchao {torchao.__version__}, transformers {transformers.__version__}")
    print(
        f"transformers Llama vocab {args.vocab}, hidden {args.d}, {args.layers} layers, {args.heads} heads, "
        f"seq {args.seq}, batch {args.batch}; {args.steps} AdamW steps (peak lr {args.lr}), "
        f"backend {args.backend}, seeds {seeds}; "
        f"data: Markov chain, entropy rate {data.entropy_rate():.4f} nats/token (the lowest loss), "
        f"chance {torch.tensor(float(args.vocab)).log():.4f}"
    )
    runs = []
    for recipe in recipes:
        runs += train(recipe, seeds, data, args)
        torch._dynamo.reset()
    print(tabulate(table_rows(runs), headers="keys", tablefmt="github", disable_numparse=True))


if __name__ == "__main__":
    main()
