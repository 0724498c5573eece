"""Where amp_fx's coverage wins: training steps of GPT-2 (transformers' ``Conv1D``), a mixture of
experts (3-D expert parameters) and Llama 3 8B-shaped layers, each variant beside its anchors in
one run.

    python bench/bench_coverage.py --preset tiny                  # CPU, small shapes, seconds per row
    python bench/bench_coverage.py --device cuda --workloads gpt2  # a GPU, GPT-2 small shapes
    python bench/bench_coverage.py --device cuda --workloads moe,llama3-8b

Workloads (transformers models, random init, no dropout; ``--preset gpu`` unless ``tiny``):

* ``gpt2``: ``GPT2LMHeadModel``, d 768, 12 heads, seq 1024, vocabulary 50257, batch 8, 4 layers
  (``--layers`` up to GPT-2 small's 12 where the window allows: compile time grows with it).
  torchao's ``convert_to_float8_training`` converts ``nn.Linear`` only: GPT-2's ``Conv1D``
  layers stay bf16, the tied head alone is fp8. amp_fx converts every matmul with a weight.
* ``moe``: ``OlmoeForCausalLM`` at OLMoE-1B-7B's shapes (d 2048, 64 experts of width 1024, 8 per
  token, vocabulary 50304), 2 layers, seq 4096. Under ``torch.compile`` + autocast the experts
  run in fp32 (no autocast table lists the grouped GEMM; compiled, transformers' fallback is a
  ``torch.mm`` per expert behind a host sync); amp_fx runs them as one bf16 ``_grouped_mm``
  (``Policy(autocast_experts=True)``) or in fp8 (rowwise: ``_scaled_grouped_mm`` on sm_90);
  torchao's MoE training (``torchao.prototype.moe_training``, ``Float8TrainingOpConfig`` on the
  experts, rowwise ``Float8Linear`` elsewhere) where it runs: CUDA only, and a row says why not.
* ``llama3-8b``: ``LlamaForCausalLM`` with Llama 3 8B's layer (d 4096, FFN 14336, 32 heads, 8 KV
  heads, vocabulary 128256, rope theta 500000), 1 layer, seq 8192, batch 1.

Variants: ``torch.compile`` + autocast bf16, torchao fp8 + ``torch.compile`` (under autocast bf16),
amp_fx bf16, amp_fx fp8 (the workload's recipe). Columns: the share of GEMM FLOPs in low
precision and in fp8 (``amp_fx.testing.fp8_reference.count_gemm_flops``, one step); the loss after
the last step (the same batches for every variant); and on CUDA tokens/s, median over the timed
steps with its p10-p90 (``amp_fx.testing.bench.percentile``), the ratio of the median to the
first row's, and peak memory (``torch.cuda.max_memory_allocated`` over the timed steps). On a CPU
the time columns are left out (fp8 runs ``_scaled_mm``'s reference kernel there). A variant that
fails is a row (``failed: ...``), printed to stderr as ``[bench_coverage] ...`` as it comes.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from contextlib import AbstractContextManager, ExitStack, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from tabulate import tabulate
from torch import Tensor, nn

import amp_fx
from amp_fx.testing.bench import machine_lines, percentile, release, sync, token_batches
from amp_fx.testing.fp8_reference import count_gemm_flops, cpu_autocast_torchao, torchao_float8, torchao_missing

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from bench_weight_casts import HFLogits, lm_loss  # noqa: E402 (the same loss as bench_fp8)


def _gpt2(d: dict[str, int]) -> nn.Module:
    import transformers as tf

    return HFLogits(
        tf.GPT2LMHeadModel(
            tf.GPT2Config(
                vocab_size=d["vocab"],
                n_positions=d["seq"],
                n_embd=d["d"],
                n_layer=d["layers"],
                n_head=d["heads"],
                resid_pdrop=0.0,
                embd_pdrop=0.0,
                attn_pdrop=0.0,
            )
        )
    )


def _moe(d: dict[str, int]) -> nn.Module:
    import transformers as tf

    return HFLogits(
        tf.OlmoeForCausalLM(
            tf.OlmoeConfig(
                vocab_size=d["vocab"],
                hidden_size=d["d"],
                intermediate_size=d["ffn"],
                num_hidden_layers=d["layers"],
                num_attention_heads=d["heads"],
                num_key_value_heads=d["heads"],
                num_experts=d["experts"],
                num_experts_per_tok=d["top_k"],
                max_position_embeddings=d["seq"],
                use_cache=False,
            )
        )
    )


def _llama3(d: dict[str, int]) -> nn.Module:
    import transformers as tf

    return HFLogits(
        tf.LlamaForCausalLM(
            tf.LlamaConfig(
                vocab_size=d["vocab"],
                hidden_size=d["d"],
                intermediate_size=d["ffn"],
                num_hidden_layers=d["layers"],
                num_attention_heads=d["heads"],
                num_key_value_heads=d["kv_heads"],
                max_position_embeddings=d["seq"],
                rope_theta=500000.0,
                use_cache=False,
            )
        )
    )


@dataclass(frozen=True)
class Workload:
    build: Callable[[dict[str, int]], nn.Module]
    presets: dict[str, dict[str, int]]
    recipe: str
    """amp_fx's and torchao's fp8 recipe on this workload."""
    moe: bool = False


WORKLOADS: dict[str, Workload] = {
    "gpt2": Workload(
        _gpt2,
        {
            "gpu": dict(vocab=50257, d=768, layers=4, heads=12, seq=1024, batch=8),
            "tiny": dict(vocab=256, d=64, layers=2, heads=4, seq=64, batch=2),
        },
        "tensorwise",
    ),
    "moe": Workload(
        _moe,
        {
            "gpu": dict(vocab=50304, d=2048, ffn=1024, layers=2, heads=16, experts=64, top_k=8, seq=4096, batch=1),
            "tiny": dict(vocab=256, d=64, ffn=32, layers=1, heads=4, experts=8, top_k=2, seq=32, batch=2),
        },
        "rowwise",
        moe=True,
    ),
    "llama3-8b": Workload(
        _llama3,
        {
            "gpu": dict(vocab=128256, d=4096, ffn=14336, layers=1, heads=32, kv_heads=8, seq=8192, batch=1),
            "tiny": dict(vocab=256, d=64, ffn=224, layers=1, heads=4, kv_heads=2, seq=64, batch=2),
        },
        "tensorwise",
    ),
}


@dataclass
class Variant:
    name: str
    build: Callable[[nn.Module], nn.Module]
    region: Callable[[], AbstractContextManager[object]]
    missing: str | None = None
    """Why the variant cannot run here (its row says so), or None."""


def _torchao_moe(model: nn.Module, recipe: str) -> nn.Module:
    """torchao's MoE fp8 training: ``Float8TrainingOpConfig`` on the 3-D expert parameters, its
    ``Float8Linear`` (``recipe``) on the ``nn.Linear`` layers except the routers (torchtitan's
    filter: a router's output width is the number of experts, not a multiple of 16)."""
    from torchao.prototype.moe_training.config import Float8TrainingOpConfig
    from torchao.quantization import quantize_

    model = torchao_float8(model, recipe, lambda m, fqn: not fqn.endswith(".gate"))
    quantize_(
        model, Float8TrainingOpConfig(float8_linear_recipe=recipe), filter_fn=lambda m, fqn: fqn.endswith(".experts")
    )
    return model


def variants(work: Workload, device: str, backend: str) -> list[Variant]:
    no_torchao = torchao_missing()
    policy = amp_fx.Policy(autocast_experts=True) if work.moe else None

    def autocast() -> AbstractContextManager[object]:
        return torch.autocast(device, torch.bfloat16)

    def torchao_region() -> AbstractContextManager[object]:
        stack = ExitStack()
        if device == "cpu":
            stack.enter_context(cpu_autocast_torchao())
        stack.enter_context(torch.autocast(device, torch.bfloat16))
        return stack

    r = work.recipe
    out = [Variant("torch.compile + autocast bf16", lambda m: torch.compile(m, backend=backend), autocast)]
    if work.moe:
        why = no_torchao or (
            None if device == "cuda" else "torchao's MoE fp8 runs its grouped GEMMs with CUDA kernels only"
        )
        out.append(
            Variant(
                f"torchao MoE fp8 {r} + torch.compile",
                lambda m: torch.compile(_torchao_moe(m, r), backend=backend),
                torchao_region,
                why,
            )
        )
    else:
        out.append(
            Variant(
                f"torchao fp8 {r} + torch.compile",
                lambda m: torch.compile(torchao_float8(m, r), backend=backend),
                torchao_region,
                no_torchao,
            )
        )
    out += [
        Variant(
            "amp_fx bf16",
            lambda m: amp_fx.compile(m, dtype="bf16", policy=policy, backend=backend, strict=False),
            nullcontext,
        ),
        Variant(
            f"amp_fx fp8 {r}",
            lambda m: amp_fx.compile(m, dtype="bf16", fp8=r, policy=policy, backend=backend, strict=False),
            nullcontext,
        ),
    ]
    return out


def run(
    work: Workload,
    dims: dict[str, int],
    variant: Variant,
    batches: list[tuple[Tensor, Tensor]],
    device: str,
    warmup: int,
) -> dict[str, Any]:
    """One variant's row: two untimed steps (compiles and recompiles), one counted step, then
    ``len(batches)`` AdamW steps of which the first ``warmup`` are not timed."""
    torch.manual_seed(0)
    model = variant.build(work.build(dims).to(device))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step(ids: Tensor, targets: Tensor) -> Tensor:
        with variant.region():
            logits = model(ids)
        loss = lm_loss(logits, targets)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    for _ in range(2):
        step(*batches[0])
    with count_gemm_flops() as flops:
        step(*batches[0])
    times = []
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    for i, (ids, targets) in enumerate(batches):
        sync(device)
        t0 = time.perf_counter()
        loss = step(ids, targets)
        sync(device)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    row: dict[str, Any] = {
        "variant": variant.name,
        "low share": f"{flops.low_share:.3f}",
        "fp8 share": f"{flops.fp8_share:.3f}",
        f"loss after {len(batches)}": f"{loss.item():.4f}",
    }
    if device == "cuda":
        tokens = dims["batch"] * dims["seq"]
        row["tokens/s"] = tokens / statistics.median(times)
        # p10 of tokens/s is the p90 of the step times
        row["tokens/s p10-p90"] = f"{tokens / percentile(times, 0.9):,.0f}-{tokens / percentile(times, 0.1):,.0f}"
        row["peak GiB"] = f"{torch.cuda.max_memory_allocated() / 2**30:.2f}"
    return row


def table(rows: list[dict[str, Any]]) -> str:
    """The rows with tokens/s formatted and its ratio to the first row's (the anchor)."""
    anchor = rows[0].get("tokens/s") if rows else None
    out = []
    for row in rows:
        row = dict(row)
        if isinstance(row.get("tokens/s"), float):
            if isinstance(anchor, float):
                row["vs first"] = f"{row['tokens/s'] / anchor:.3f}x"
            row["tokens/s"] = f"{row['tokens/s']:,.0f}"
        out.append(row)
    return tabulate(out, headers="keys")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help=f"of {', '.join(WORKLOADS)}")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--preset", choices=("gpu", "tiny"), default=None, help="shapes (default: gpu on CUDA, tiny on a CPU)"
    )
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--steps", type=int, default=10, help="AdamW steps per variant, timed after --warmup")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument(
        "--variants", default=None, help="only the variants whose name contains one of these comma-separated strings"
    )
    parser.add_argument("--layers", type=int, default=None, help="override the preset's layer count")
    args = parser.parse_args()
    preset = args.preset or ("gpu" if args.device == "cuda" else "tiny")
    print("\n".join(machine_lines()))
    print(
        f"device {args.device}, backend {args.backend}, preset {preset}, {args.steps} AdamW steps "
        f"({args.warmup} untimed)"
    )
    if args.device == "cpu":
        print(
            "CPU: tokens/s and peak memory are not reported (fp8 GEMMs run as _scaled_mm's reference "
            "kernel here; its speed says nothing about a GPU's)"
        )
    warnings.filterwarnings("ignore", category=amp_fx.AmpFxWarning)
    for name in args.workloads.split(","):
        work = WORKLOADS[name]
        dims = dict(work.presets[preset])
        if args.layers is not None:
            dims["layers"] = args.layers
        batches = token_batches(args.steps, dims["vocab"], dims["batch"], dims["seq"], args.device)
        rows: list[dict[str, Any]] = []
        for variant in variants(work, args.device, args.backend):
            if args.variants and not any(s in variant.name for s in args.variants.split(",")):
                continue
            if variant.missing:
                rows.append({"variant": variant.name, "low share": f"not run: {variant.missing}"})
                continue
            release(args.device)
            began = time.perf_counter()
            try:
                rows.append(run(work, dims, variant, batches, args.device, args.warmup))
            except Exception as e:  # noqa: BLE001 - one variant's failure is a row, not the end of the table
                # a peer that fails on a workload is where its coverage ends, not a failure of this run
                why = "not run: torchao fails here" if variant.name.startswith("torchao") else "failed"
                rows.append({"variant": variant.name, "low share": f"{why}: {type(e).__name__}: {str(e)[:100]}"})
            print(
                f"[bench_coverage] {name}: {rows[-1]} ({time.perf_counter() - began:.0f} s)",
                file=sys.stderr,
                flush=True,
            )
        print(f"\n{name} {dims}")
        print(table(rows))


if __name__ == "__main__":
    main()
