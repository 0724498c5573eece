"""Memory and communication per training step: fp32, eager autocast, torch.compile, torchao fp8, amp_fx.

    python bench/bench_memory.py                    # CPU: Llama-like 4 x 256, batch 4 x 128 (exact counts)
    python bench/bench_memory.py --device cuda      # a GPU: Llama-like 4 x 2048, batch 4 x 2048
    python bench/bench_memory.py --no-dist --runs "amp_fx bf16;amp_fx fp8"   # a subset, no gloo ranks
    python bench/bench_memory.py --no-memory --layers 2               # the DDP/FSDP2 table only
    python bench/bench_memory.py --runs 'amp_fx bf16, compile$'      # one run ('$': the whole name)

One AdamW training step of the Llama-like model (``bench/bench_weight_casts.py``: RMSNorm, SwiGLU,
untied head; the loss in fp32), for every run below, each on a fresh copy of the same fp32 model
and the same batch. Baselines: fp32 (no autocast), eager ``torch.autocast`` bf16,
``torch.compile`` + autocast bf16, torchao's fp8 tensorwise (``convert_to_float8_training``) +
``torch.compile`` under autocast bf16 (in the DDP/FSDP2 table also with its
``enable_fsdp_float8_all_gather``: FSDP2 gathers the fp8 weights). amp_fx: bf16, fp16 (loss
scaling: ``amp_fx.GradScaler``,
``StepMode.MASKED``) and fp8 tensorwise (bf16 around the fp8 matmuls), each as ``amp_fx.compile``
+ the eager optimizer step and as ``amp_fx.compile_step``, without and with the weight cache.

Counted per run (``amp_fx/testing/memory.py``, the counters tests/backend/test_memory_counters.py checks
against hand counts), after 3 warm-up steps:

* **held between steps**, by kind: parameters, optimizer state, caches (amp_fx's weight cache),
  each storage once; **gradients**: the ``.grad`` storages from the backward to the update (every
  run here frees them after the step); **B/param**: the four together per model parameter;
* **saved**: the storages autograd saves for the backward in one step's forward, each once;
  **activations**: the saved storages that are neither parameters nor cached copies (what the
  forward allocates and keeps for the backward);
* **peak**: held between steps + the largest rise of allocated bytes during one step over its
  start (CPU: the allocator's records through the profiler; CUDA: ``max_memory_allocated``);
* **sent per step** under DDP and FSDP2 (2 gloo ranks, the same model, ``--dist-backend``):
  the bytes one rank hands to each kind of collective in one step, counted in the process group
  (every caller: DDP's reducer, FSDP2's hooks, amp_fx's own all-reduces of overflow flags), per
  model parameter. ``all_gather``: the rank's shard; ``reduce_scatter`` and ``all_reduce``: the
  whole input. What crosses the wire depends on the algorithm (a ring all-reduce sends
  2 (n - 1) / n of it). ``all_gather / anchor``: the all-gathered bytes over the anchor's (FSDP2
  gathering fp32 weights for bf16 compute); amp_fx fp8 gathers its fp8 matmuls' weights in fp8
  (``amp_fx/_dist/fp8_gather.py``).

Ratios are to the ``torch.compile + autocast`` row of the same invocation. CPU counts are exact
and do not depend on the machine's load; the default backend is inductor for the single-process
runs (what is saved depends on the partitioner) and aot_eager for the ranks (the collectives are
the same under both: they run outside the graphs, or inside them as the same op).
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
import warnings
from collections.abc import Callable
from contextlib import AbstractContextManager, ExitStack, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from tabulate import tabulate
from torch import Tensor, nn

import amp_fx
from amp_fx.testing.bench import machine_lines
from amp_fx.testing.fp8_reference import cpu_autocast_torchao, torchao_float8, torchao_missing
from amp_fx.testing.memory import (
    COUNTING_BACKEND,
    GradBytes,
    PeakBytes,
    SavedBytes,
    held_bytes,
    sent_bytes,
    weight_cache_tensors,
)

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from bench_weight_casts import Llama, LlamaBlock, lm_loss  # noqa: E402 (the same model as the weight-cast bench)

PRESETS = {
    "cpu": dict(vocab=512, d=256, layers=4, heads=4, seq=128, batch=4),
    "cuda": dict(vocab=32000, d=2048, layers=4, heads=16, seq=2048, batch=4),
}
MIB = 2**20
ANCHOR = "torch.compile + autocast"


@dataclass
class Trainer:
    """One run, built: ``step(ids, targets)`` is one optimizer step."""

    step: Callable[[Tensor, Tensor], Any]
    params: list[Tensor]
    opt: torch.optim.Optimizer
    caches: Callable[[], list[Tensor]] = list
    notes: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Run:
    name: str
    kind: str
    """"fp32", "autocast", "compile", "torchao", "amp_fx" or "amp_fx step"."""
    dtype: str = "bf16"
    fp8: str | None = None
    weight_cache: bool = False
    train_state: str | None = None
    fp8_all_gather: bool = False
    """torchao's ``enable_fsdp_float8_all_gather`` (+ ``precompute_float8_dynamic_scale_for_fsdp``
    after each step): a run of the DDP/FSDP2 table only (one process gathers nothing)."""


def runs() -> list[Run]:
    out = [
        Run("fp32", "fp32"),
        Run("eager autocast", "autocast"),
        Run(ANCHOR, "compile"),
        Run("torchao fp8 tensorwise + compile", "torchao", fp8="tensorwise"),
        Run("torchao fp8 tensorwise + compile, fp8 all-gather", "torchao", fp8="tensorwise", fp8_all_gather=True),
    ]
    for label, dtype, fp8 in (("bf16", "bf16", None), ("fp16", "fp16", None), ("fp8", "bf16", "tensorwise")):
        for kind, how in (("amp_fx", "compile"), ("amp_fx step", "compile_step")):
            for cache in (False, True):
                out.append(Run(f"amp_fx {label}, {how}" + (", weight cache" if cache else ""), kind, dtype, fp8, cache))
    for state in ("bf16_sr", "bf16_kahan"):  # bf16 parameters, gradients and moments (docs: compiled step)
        out.append(Run(f"amp_fx bf16, compile_step, train_state={state}", "amp_fx step", train_state=state))
    return out


def _shard(model: nn.Module) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    for m in model.modules():
        if isinstance(m, LlamaBlock):
            fully_shard(m)
    fully_shard(model)
    return model


def build(run: Run, dims: dict[str, int], device: str, backend: str, wrap: str = "") -> Trainer:
    """``run`` on a fresh seeded model; ``wrap``: "" (one process), "ddp" or "fsdp2"."""
    torch.manual_seed(0)
    model = Llama(dims["vocab"], dims["d"], dims["layers"], dims["heads"], dims["seq"]).to(device)
    if run.kind == "torchao":
        model = torchao_float8(model, run.fp8, fsdp_float8_all_gather=run.fp8_all_gather)
    if wrap == "fsdp2":
        model = _shard(model)
    precompute = run.fp8_all_gather and wrap == "fsdp2"
    if precompute:  # torchao's recipe: the fp8 scales of the sharded weights, once per step
        from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

        precompute_float8_dynamic_scale_for_fsdp(model)
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=1e-3)
    ddp: Callable[[nn.Module], nn.Module] = torch.nn.parallel.DistributedDataParallel if wrap == "ddp" else lambda m: m
    if run.kind == "amp_fx step":
        step = amp_fx.compile_step(
            ddp(model),
            opt,
            lm_loss,
            dtype=run.dtype,
            fp8=run.fp8,
            backend=backend,
            weight_cache=run.weight_cache,
            train_state=run.train_state,
            strict=False,
        )
        cache = getattr(step._forward, "amp_fx_weight_cache", None)
        return Trainer(step, params, opt, lambda: weight_cache_tensors(cache))

    def region() -> AbstractContextManager[object]:
        if run.kind not in ("autocast", "compile", "torchao"):
            return nullcontext()
        stack = ExitStack()
        if run.kind == "torchao" and device == "cpu":
            stack.enter_context(cpu_autocast_torchao())
        stack.enter_context(torch.autocast(device, torch.bfloat16))
        return stack

    cache = None
    if run.kind == "amp_fx":
        compiled = amp_fx.compile(
            model, dtype=run.dtype, fp8=run.fp8, backend=backend, weight_cache=run.weight_cache, strict=False
        )
        cache = compiled.amp_fx_weight_cache
        forward = ddp(compiled)
    elif run.kind in ("compile", "torchao"):
        forward = ddp(torch.compile(model, backend=backend))
    else:
        forward = ddp(model)
    scaler = (
        amp_fx.GradScaler(device, step_mode=amp_fx.StepMode.MASKED)
        if run.kind == "amp_fx" and run.dtype == "fp16"
        else None
    )

    def step(ids: Tensor, targets: Tensor) -> Tensor:
        with region():
            logits = forward(ids)
        loss = lm_loss(logits, targets)
        if scaler is None:
            loss.backward()
            opt.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        opt.zero_grad(set_to_none=True)
        if precompute:
            precompute_float8_dynamic_scale_for_fsdp(model)
        return loss.detach()

    return Trainer(step, params, opt, lambda: weight_cache_tensors(cache))


def _batch(dims: dict[str, int], device: str, seed: int = 0) -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, dims["vocab"], (dims["batch"], dims["seq"] + 1), generator=gen)
    return ids[:, :-1].to(device), ids[:, 1:].to(device)


def _graphs() -> int:
    from torch._dynamo.utils import counters

    return int(sum(counters["stats"].values()) + sum(counters["recompiles"].values()))


def measure(run: Run, dims: dict[str, int], device: str, backend: str, warmup: int = 3) -> dict[str, Any]:
    """One run's counts (module docstring), in bytes."""
    torch._dynamo.reset()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", amp_fx.AmpFxWarning)
        t = build(run, dims, device, backend)
        batch = _batch(dims, device)
        for _ in range(warmup - 1):
            t.step(*batch)
        # The last warm-up step under the allocator's records too: a block allocated before any
        # record and freed in the measured step (a weight-cache copy replaced by a fresh one) would
        # be a free of unknown size, left out of the count.
        with PeakBytes(device):
            t.step(*batch)
    gc.collect()
    before = _graphs()
    held = held_bytes(t.params, t.opt, t.caches())
    with PeakBytes(device) as peak, GradBytes(t.params) as grads:
        t.step(*batch)
    with SavedBytes() as saved:
        t.step(*batch)
        total, activations = saved.bytes(), saved.bytes(exclude=[*t.params, *t.caches()])
    n = sum(p.numel() for p in t.params)
    held_total = sum(held.values())
    out = dict(
        held,
        gradients=max(held["gradients"], grads.bytes),
        saved=total,
        activations=activations,
        peak=held_total + peak.bytes,
        net=peak.net,
        params=n,
        compiled_during=_graphs() - before,
        warnings=sorted(
            {str(w.message).split(";")[0][:120] for w in caught if issubclass(w.category, amp_fx.AmpFxWarning)}
        ),
    )
    out["per_param"] = (held_total - held["gradients"] + out["gradients"]) / n
    return out


def _dist_rank(
    rank: int, world_size: int, names: list[str], dims: dict[str, int], backend: str, warmup: int
) -> dict[str, dict[str, Any]]:
    torch.set_num_threads(1)
    out: dict[str, dict[str, Any]] = {}
    batch = _batch(dims, "cpu", seed=rank)
    for run in runs():
        if run.name not in names:
            continue
        for wrap in ("ddp", "fsdp2"):
            key = f"{run.name} | {wrap}"
            torch._dynamo.reset()
            try:
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always", amp_fx.AmpFxWarning)
                    t = build(run, dims, "cpu", backend, wrap)
                    for _ in range(warmup):
                        t.step(*batch)
                with sent_bytes() as sent:
                    t.step(*batch)
                n = sum(p.numel() for p in t.params)  # the whole model's: a DTensor's numel is global
                out[key] = {
                    "sent": dict(sent),
                    "params": n,
                    "warnings": sorted(
                        {str(w.message)[:200] for w in caught if issubclass(w.category, amp_fx.AmpFxWarning)}
                    ),
                }
            except Exception as e:  # noqa: BLE001 - one run's failure is a row, not the end of the table
                out[key] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
    return out


def _mib(b: float) -> str:
    return f"{b / MIB:.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--backend", default="inductor", help="single-process runs (default inductor)")
    parser.add_argument("--dist-backend", default="aot_eager", help="the gloo ranks' runs")
    parser.add_argument(
        "--runs",
        default="",
        help="prefixes of run names, separated by ';' (default: all); a name ending in '$' selects that run alone",
    )
    parser.add_argument("--no-dist", action="store_true", help="leave out the DDP/FSDP2 table")
    parser.add_argument("--no-memory", action="store_true", help="the DDP/FSDP2 table only")
    parser.add_argument("--warmup", type=int, default=3)
    for name in PRESETS["cpu"]:
        parser.add_argument(f"--{name}", type=int, default=None)
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench_memory: --device cuda, but torch.cuda.is_available() is False")
    dims = dict(PRESETS[args.device])
    dims.update({k: getattr(args, k) for k in dims if getattr(args, k) is not None})
    missing = torchao_missing()
    prefixes = [p.strip() for p in args.runs.split(";") if p.strip()]
    selected = [
        r
        for r in runs()
        if (not prefixes or any(_selects(p, r.name) for p in prefixes)) and not (r.kind == "torchao" and missing)
    ]
    if prefixes and ANCHOR not in [r.name for r in selected]:
        selected.insert(0, next(r for r in runs() if r.name == ANCHOR))  # the ratios' denominator

    print(*machine_lines(), sep="\n")
    if args.device == "cuda":
        print(f"device: {torch.cuda.get_device_name()}, CUDA {torch.version.cuda}")
    print(f"torchao: {missing or _version('torchao')}, amp_fx {_version('amp_fx')}")
    print(f"Llama-like {dims}, AdamW, one step after {args.warmup} warm-up; backend {args.backend}; MiB = 2^20 bytes")
    warnings.filterwarnings("ignore", category=UserWarning, module="torchao")

    results = {}
    for run in [] if args.no_memory else [r for r in selected if not r.fp8_all_gather]:
        began = time.perf_counter()
        try:
            results[run.name] = measure(run, dims, args.device, args.backend, args.warmup)
        except Exception as e:  # noqa: BLE001 - one run's failure is a row, not the end of the table
            results[run.name] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"}
        # each run as it comes (stderr), so a run stopped by a time limit still shows what it had measured
        r = results[run.name]
        done = (
            f"failed: {r['error']}"
            if "error" in r
            else f"peak {_mib(r['peak'])} MiB, activations {_mib(r['activations'])} MiB, B/param {r['per_param']:.2f}"
        )
        print(f"[bench_memory] {run.name}: {done} ({time.perf_counter() - began:.0f} s)", file=sys.stderr, flush=True)
    if results:
        print(tabulate(_memory_rows(results), headers="keys", disable_numparse=True, tablefmt="github"))
    notes = {f"{name}: {w}" for name, r in results.items() for w in r.get("warnings", [])}
    notes |= {
        f"{name}: {r['compiled_during']} graph(s) compiled during the measured steps"
        for name, r in results.items()
        if r.get("compiled_during")
    }
    notes |= {
        f"{name}: the measured step allocated {r['net']} bytes more than it freed (a free of unknown "
        "size, or a step that grows)"
        for name, r in results.items()
        if r.get("net")
    }
    for note in sorted(notes):
        print(f"- {note}")
    if args.no_dist:
        return
    from amp_fx.testing.distributed import run_ranks

    # compile_step refuses train_state on DDP and FSDP2 models (it warns and keeps fp32 state), so
    # those rows would measure fp32 runs under a train_state name
    names = [r.name for r in selected if r.train_state is None]
    left_out = [r.name for r in selected if r.train_state is not None]
    dist = run_ranks(_dist_rank, names, dims, args.dist_backend, args.warmup, backend=COUNTING_BACKEND)
    print(
        f"\nsent per step, rank 0 (2 gloo ranks, backend {args.dist_backend}; "
        "B/param: per parameter of the whole model)"
    )
    print(tabulate(_dist_rows(dist), headers="keys", disable_numparse=True, tablefmt="github"))
    if left_out:
        print(
            f"- left out: {', '.join(left_out)} (train_state is for a model that is not wrapped: "
            "compile_step keeps a DDP or FSDP2 model's state in fp32 and says so)"
        )
    notes = {f"{key}: {w}" for key, r in dist[0].items() for w in r.get("warnings", [])}
    for note in sorted(notes):
        print(f"- {note}")


def _selects(pattern: str, name: str) -> bool:
    """``--runs``' rule: a prefix of the name, or the whole name where the pattern ends in '$'."""
    return name == pattern[:-1] if pattern.endswith("$") else name.startswith(pattern)


def _version(module: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(module)
    except PackageNotFoundError:
        return "not installed"


def _memory_rows(results: dict[str, dict[str, Any]]) -> list[dict[str, str]]:
    anchor = results.get(ANCHOR, {})
    rows = []
    for name, r in results.items():
        if "error" in r:
            rows.append({"run": name, "parameters": f"failed: {r['error']}"})
            continue
        rows.append(
            {
                "run": name,
                "parameters": _mib(r["parameters"]),
                "gradients": _mib(r["gradients"]),
                "optimizer state": _mib(r["optimizer state"]),
                "caches": _mib(r["caches"]),
                "B/param": f"{r['per_param']:.2f}",
                "saved": _mib(r["saved"]),
                "activations": _mib(r["activations"]),
                "activations / anchor": f"{r['activations'] / anchor['activations']:.2f}"
                if "activations" in anchor
                else "-",
                "peak": _mib(r["peak"]),
                "peak / anchor": f"{r['peak'] / anchor['peak']:.2f}" if "peak" in anchor else "-",
            }
        )
    return rows


def _dist_rows(per_rank: list[dict[str, dict[str, Any]]]) -> list[dict[str, str]]:
    """Rank 0's counts (the ranks run the same steps on same-sized batches: the same bytes);
    ``all_gather / anchor``: to the anchor's FSDP2 all-gather (bf16 compute, fp32 weights gathered)."""
    rows = []
    kinds = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")
    anchor = per_rank[0].get(f"{ANCHOR} | fsdp2", {}).get("sent", {}).get("all_gather")
    for key, r in per_rank[0].items():
        name, wrap = key.split(" | ")
        row = {"run": name, "wrapper": wrap}
        if "error" in r:
            row["all_reduce"] = f"not supported: {r['error']}"
            rows.append(row)
            continue
        for kind in kinds:
            b = r["sent"].get(kind, 0)
            size = f"{_mib(b)} MiB" if b >= MIB // 10 else f"{b} B"
            row[kind] = f"{size}, {b / r['params']:.2f} B/param" if b else "0"
        gathered = r["sent"].get("all_gather", 0)
        row["all_gather / anchor"] = f"{gathered / anchor:.3f}" if anchor and gathered else "-"
        rows.append(row)
    return rows


if __name__ == "__main__":
    main()
