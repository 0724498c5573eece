"""fp8 training: amp_fx's fp8 (tensorwise, rowwise) against bf16 (``torch.compile`` + autocast, amp_fx)
and torchao float8 + torch.compile.

    python bench/bench_fp8.py                              # CPU smoke run: llama-like and hf-gpt2, small
    python bench/bench_fp8.py --device cuda --preset h100  # a GPU: Llama-like 2048 x 4 layers, seq 2048
    python bench/bench_fp8.py --models hf-gpt2 --steps 10
    python bench/bench_fp8.py --tier                       # coverage on the real-model tier's transformers models
    python bench/bench_fp8.py --tier --models hf_qwen3_moe,hf_olmoe --recipes tensorwise

Per model and variant, on one device and one downstream backend (inductor by default):

* **fp8 share**: GEMM FLOPs (2 M K N per mm/addmm/bmm/_scaled_mm, forward and backward) that
  ran in fp8, counted from the ops of one training step by the profiler
  (``amp_fx.testing.fp8_reference.count_gemm_flops``, the counter the tests use). torchao converts
  ``nn.Linear`` only: on ``hf-gpt2`` (transformers' ``Conv1D`` layers) it reaches the tied head alone.
* **loss err, grad err**: relative error against the same model in float64 (eager, no autocast)
  on the first batch: ``|loss - loss64| / |loss64|``, and ``||g - g64|| / ||g64||`` over all
  gradients flattened together.
* **loss after N**: the training loss at the last of ``--steps`` AdamW steps (lr 1e-3) on a fixed
  stream of random token batches (the same for every variant).
* **tokens/s** (median step time after 3 warm-up steps; its spread: the slowest and fastest timed
  step) and **peak memory**
  (``torch.cuda.max_memory_allocated`` over the timed steps) on CUDA only. On a CPU, fp8 GEMMs run
  as ``_scaled_mm``'s reference kernel (it converts to fp32 and calls ``mm``): its time says nothing
  about a GPU's fp8 tensor cores, so the CPU table leaves both columns out.

``--tier``: per transformers model of the real-model tier (``amp_fx/testing/real_models.py``) and
the mixture-of-experts models Qwen3-MoE and OLMoE (same sizes, 4 experts, 2 per token), per
recipe, one forward and backward under ``aot_eager``: the matmuls with a parameter operand
(distinct weights; a grouped expert GEMM is one), how many run in fp8, how many of those are
padded to ``_scaled_mm``'s multiples of 16 and the FLOPs the padding adds (a fraction of all GEMM
FLOPs; the shares count unpadded FLOPs), why the others do not, and the shares of all GEMM FLOPs
(grouped expert GEMMs included) in low precision (fp8, bf16) and in fp8: eager
``torch.autocast`` (low only), amp_fx with ``fp8=recipe`` and torchao on the model as it is (the
tier's tests check amp_fx bitwise against torchao converting the same layers:
tests/models/test_fp8_real_models.py). The state-space models run with their traced path on
(eager runs the code Dynamo traces). Where torchao fails on a model (torchao 0.18's rowwise
``Float8Linear`` on a non-contiguous input, Mamba's ``x_proj``: its ``Float8TrainingTensor``
cannot reshape a rowwise-scaled tensor that needs a copy), its columns read ``-`` and the row
says why; the row's amp_fx columns are still measured.

torchao runs under ``torch.autocast(device, bf16)``; on a CPU its input-cast branch is pointed at
the CPU's autocast state (``cpu_autocast_torchao``: torchao reads CUDA's state there, see
``amp_fx/testing/fp8_reference.py``). Models: ``llama-like`` and ``gpt2-like`` (plain torch,
``bench/bench_weight_casts.py``: they need nothing but torch, so they run on a GPU machine
without transformers), ``hf-gpt2`` and ``hf-llama`` (transformers, random init).
"""

from __future__ import annotations

import argparse
import copy
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
from amp_fx.testing.bench import machine_lines, release, sync, token_batches
from amp_fx.testing.fp8_reference import count_gemm_flops, cpu_autocast_torchao, torchao_float8, torchao_missing

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from bench_weight_casts import MODELS, lm_loss  # noqa: E402 (the same models as the weight-cast bench)

PRESETS = {
    "cpu": dict(vocab=512, d=128, layers=2, heads=4, seq=128, batch=4),
    "h100": dict(vocab=32000, d=2048, layers=4, heads=16, seq=2048, batch=4),
}


@dataclass
class Variant:
    name: str
    build: Callable[[nn.Module], nn.Module]
    """The model to train, from a fresh copy of the fp32 model."""
    region: Callable[[], AbstractContextManager[object]]
    """What the forward runs inside (torch.autocast for torchao; nothing for amp_fx)."""


def variants(device: str, backend: str, recipes: list[str], with_torchao: bool) -> list[Variant]:
    def bf16_autocast() -> AbstractContextManager[object]:
        return torch.autocast(device, torch.bfloat16)

    out = [
        Variant("torch.compile + autocast bf16", lambda m: torch.compile(m, backend=backend), bf16_autocast),
        Variant("amp_fx bf16", lambda m: amp_fx.compile(m, dtype="bf16", backend=backend), nullcontext),
    ]
    for r in recipes:
        out.append(
            Variant(
                f"amp_fx fp8 {r}",
                lambda m, r=r: amp_fx.compile(m, dtype="bf16", fp8=r, backend=backend, strict=False),
                nullcontext,
            )
        )
    if with_torchao:

        def autocast() -> AbstractContextManager[object]:
            stack = ExitStack()
            if device == "cpu":
                stack.enter_context(cpu_autocast_torchao())
            stack.enter_context(torch.autocast(device, torch.bfloat16))
            return stack

        for r in recipes:  # torchao_float8 converts a copy: the variant trains the copy's parameters
            out.append(
                Variant(
                    f"torchao {r} + torch.compile",
                    lambda m, r=r: torch.compile(torchao_float8(m, r), backend=backend),
                    autocast,
                )
            )
    return out


def _grads(model: nn.Module) -> Tensor:
    return torch.cat([p.grad.double().flatten() for p in model.parameters() if p.grad is not None])


def run(
    kind: str,
    dims: dict[str, int],
    variant: Variant,
    batches: list[tuple[Tensor, Tensor]],
    exact: tuple[float, Tensor],
    device: str,
) -> dict[str, object]:
    torch.manual_seed(0)
    # torchao converts a copy: without its name the unconverted model (1.25 GiB of fp32 parameters
    # on the h100 preset) is freed, and is no part of torchao's peak memory (amp_fx's model is it)
    model = variant.build(MODELS[kind](dims["vocab"], dims["d"], dims["layers"], dims["heads"], dims["seq"]).to(device))
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=1e-3)

    def step(ids: Tensor, targets: Tensor) -> Tensor:
        with variant.region():
            logits = model(ids)
        loss = lm_loss(logits, targets)
        loss.backward()
        return loss

    # error against float64, on the first batch (the first call compiles)
    loss = step(*batches[0])
    loss64, grads64 = exact
    loss_err = abs(loss.item() - loss64) / abs(loss64)
    grad_err = ((_grads(model).to(grads64.device) - grads64).norm() / grads64.norm()).item()
    opt.zero_grad(set_to_none=True)
    step(*batches[0])  # a second call: recompiles, if any, happen here, not in the count
    opt.zero_grad(set_to_none=True)
    with count_gemm_flops() as flops:
        step(*batches[0])
    opt.zero_grad(set_to_none=True)

    times = []
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    for i, (ids, targets) in enumerate(batches):
        sync(device)
        t0 = time.perf_counter()
        loss = step(ids, targets)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync(device)
        if i >= 3:
            times.append(time.perf_counter() - t0)
    row: dict[str, object] = {
        "variant": variant.name,
        "fp8 share": f"{flops.fp8_share:.3f}",
        "loss err": f"{loss_err:.2e}",
        "grad err": f"{grad_err:.2e}",
        f"loss after {len(batches)}": f"{loss.item():.4f}",
    }
    if device == "cuda":
        tokens = dims["batch"] * dims["seq"]
        row["tokens/s"] = f"{tokens / statistics.median(times):,.0f}" if times else "-"
        # the spread of the timed steps: tokens/s of the slowest and of the fastest
        row["tokens/s min-max"] = f"{tokens / max(times):,.0f}-{tokens / min(times):,.0f}" if times else "-"
        row["peak GiB"] = f"{torch.cuda.max_memory_allocated() / 2**30:.2f}"
    return row


def exact_reference(kind: str, dims: dict[str, int], batch: tuple[Tensor, Tensor], device: str) -> tuple[float, Tensor]:
    """The float64 loss and flattened gradients, the gradients kept on the CPU: on a GPU they
    would stay allocated through every variant's timed steps (2.6 GB on the h100 preset) and
    count in its peak memory."""
    torch.manual_seed(0)
    model = MODELS[kind](dims["vocab"], dims["d"], dims["layers"], dims["heads"], dims["seq"]).to(device).double()
    loss = lm_loss(model(batch[0]), batch[1])
    loss.backward()
    return loss.item(), _grads(model).cpu()


def _moe_models() -> dict[str, object]:
    """Qwen3-MoE and OLMoE at the tier's sizes (2 layers x hidden 64, 4 experts, 2 per token,
    vocabulary 128, 2 x 16 tokens), random init: transformers keeps each expert layer as one 3-D
    parameter and multiplies it with a grouped GEMM. Not in the tier; here for the counts."""
    from amp_fx.testing import real_models as rm

    def qwen3_moe(gen: torch.Generator) -> object:
        import transformers as tf

        config = tf.Qwen3MoeConfig(
            **rm._HF_DIMS,
            moe_intermediate_size=64,
            num_key_value_heads=4,
            head_dim=16,
            num_experts=4,
            num_experts_per_tok=2,
            decoder_sparse_step=1,
            use_cache=False,
        )
        return rm._hf_causal(config, tf.Qwen3MoeForCausalLM, gen)

    def olmoe(gen: torch.Generator) -> object:
        import transformers as tf

        dims = dict(rm._HF_DIMS, intermediate_size=64)
        config = tf.OlmoeConfig(**dims, num_key_value_heads=4, num_experts=4, num_experts_per_tok=2, use_cache=False)
        return rm._hf_causal(config, tf.OlmoeForCausalLM, gen)

    return {
        "hf_qwen3_moe": rm.RealModel("hf_qwen3_moe", "transformers", qwen3_moe),
        "hf_olmoe": rm.RealModel("hf_olmoe", "transformers", olmoe),
    }


def _share(flops: object, low: bool) -> str:
    if isinstance(flops, str):  # why torchao failed (_torchao_flops)
        return "-"
    return f"{flops.low_share if low else flops.fp8_share:.3f}"  # type: ignore[attr-defined]


def _torchao_flops(model: nn.Module, recipe: str, inputs: dict[str, Tensor], loss_fn: object) -> object:
    """The GEMM FLOPs of one forward and backward of torchao's float8 ``recipe`` on ``model`` as it
    is (``count_gemm_flops``), or why torchao fails on it (a line), instead of raising."""
    ref = torchao_float8(model, recipe)
    try:
        with count_gemm_flops() as flops:
            with cpu_autocast_torchao(), torch.autocast("cpu", torch.bfloat16):
                loss_fn(ref(**inputs)).backward()  # type: ignore[operator]
    except Exception as e:  # noqa: BLE001 - torchao's failure is a cell of the table, not its end
        return f"torchao fails: {type(e).__name__}: {str(e).strip().splitlines()[0][:100]}"
    return flops


def tier(recipes: list[str], only: list[str] | None = None) -> None:
    """The coverage table of ``--tier`` (see the module docstring)."""
    from amp_fx.testing.real_models import REAL_MODELS

    rows = []
    models = {**REAL_MODELS, **_moe_models()}
    for name, entry in models.items():
        if entry.library != "transformers" or entry.missing() or (only and name not in only):
            continue
        with entry.traced_path() if entry.traced_path is not None else nullcontext():
            rows.extend(_tier_rows(name, entry, recipes))
    print(tabulate(rows, headers="keys"))


def _tier_rows(name: str, entry: Any, recipes: list[str]) -> list[dict[str, object]]:
    """The ``--tier`` rows of one model, one per recipe."""
    rows = []
    torch._dynamo.reset()
    model, inputs, loss_fn = entry.build()
    with count_gemm_flops() as autocast_flops:
        with torch.autocast("cpu", torch.bfloat16):
            loss = loss_fn(copy.deepcopy(model)(**inputs))
        loss.backward()
    for recipe in recipes:
        torch._dynamo.reset()
        model, inputs, loss_fn = entry.build()
        ref_flops = _torchao_flops(model, recipe, inputs, loss_fn)
        compiled = amp_fx.compile(model, dtype="bf16", fp8=recipe, backend="aot_eager", strict=False)
        for _ in range(2):  # compiles, and recompiles where the model's first call changes its config
            loss_fn(compiled(**inputs)).backward()
        with count_gemm_flops() as flops:
            loss_fn(compiled(**inputs)).backward()
        decisions = {d.weight: d for r in amp_fx.records(compiled) if r.fp8 is not None for d in r.fp8.decisions}
        kept = sorted(
            {
                d.reason.removeprefix("not fp8: ").split(" not a multiple")[0].split(";")[0]
                for d in decisions.values()
                if not d.converted
            }
        )
        rows.append(
            {
                "model": name,
                "recipe": recipe,
                "matmuls": len(decisions),
                "fp8": sum(d.converted for d in decisions.values()),
                "padded": sum(d.padding is not None for d in decisions.values() if d.converted),
                "padding FLOPs": f"{flops.padding / flops.total:.3f}" if flops.total else "-",
                "low autocast": _share(autocast_flops, True),
                "low amp_fx": _share(flops, True),
                "fp8 amp_fx": _share(flops, False),
                "low torchao": _share(ref_flops, True),
                "fp8 torchao": _share(ref_flops, False),
                "kept out (why)": "; ".join(kept + ([ref_flops] if isinstance(ref_flops, str) else [])) or "-",
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--models",
        default=None,
        help="models to run (default llama-like,hf-gpt2; with "
        "--tier: names of the tier's models and hf_qwen3_moe, hf_olmoe; default all)",
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--preset", choices=sorted(PRESETS), default=None)
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--recipes", default="tensorwise,rowwise")
    parser.add_argument("--steps", type=int, default=8, help="training steps per variant (3 are warm-up for timing)")
    parser.add_argument("--tier", action="store_true", help="the coverage table on the real-model tier (CPU)")
    for name in PRESETS["cpu"]:
        parser.add_argument(f"--{name}", type=int, default=None)
    args = parser.parse_args()
    args.models_given = args.models is not None
    args.models = args.models or "llama-like,hf-gpt2"
    dims = dict(PRESETS[args.preset or ("h100" if args.device == "cuda" else "cpu")])
    dims.update({k: getattr(args, k) for k in dims if getattr(args, k) is not None})
    recipes = args.recipes.split(",")
    missing = torchao_missing()
    print("\n".join(machine_lines()))
    print(f"device {args.device}, backend {args.backend}, dims {dims}, {args.steps} AdamW steps")
    if missing:
        print(f"torchao rows left out: {missing}")
    if args.tier:
        warnings.filterwarnings("ignore", category=amp_fx.AmpFxWarning)
        tier(recipes, args.models.split(",") if args.models_given else None)
        return
    if args.device == "cpu":
        print(
            "CPU: tokens/s and peak memory are not reported (fp8 GEMMs run as _scaled_mm's reference "
            "kernel here; its speed says nothing about a GPU's)"
        )
    warnings.filterwarnings("ignore", category=amp_fx.AmpFxWarning)
    for kind in args.models.split(","):
        batches = token_batches(args.steps, dims["vocab"], dims["batch"], dims["seq"], args.device)
        exact = exact_reference(kind, dims, batches[0], args.device)
        rows = []
        for variant in variants(args.device, args.backend, recipes, missing is None):
            release(args.device)
            began = time.perf_counter()
            try:
                rows.append(run(kind, dims, variant, batches, exact, args.device))
            except Exception as e:  # noqa: BLE001 - one variant's failure is a row, not the end of the table
                rows.append({"variant": variant.name, "fp8 share": f"failed: {type(e).__name__}: {str(e)[:80]}"})
            # each row as it comes (stderr), so a run stopped by a time limit still shows the rows it had
            print(f"[bench_fp8] {kind}: {rows[-1]} ({time.perf_counter() - began:.0f} s)", file=sys.stderr, flush=True)
        print(f"\n{kind}")
        print(tabulate(rows, headers="keys"))


if __name__ == "__main__":
    main()
