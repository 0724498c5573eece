"""What each rank runs for tests/distributed/test_distributed_weight_cache.py (the weight cache under DDP).

One spawn runs every case (``weight_cache_all``) and returns tensors and counters; the test
process compares them. The recipe is ``_dist_cases``'s: SGD with momentum, ``growth_interval=2``,
overflows planted in one rank's batch (``INF_BATCH``), so DDP's all-reduce spreads them and every
rank skips those steps. The reference is always eager ``DDP`` + ``torch.autocast`` +
``torch.amp.GradScaler`` (FSDP2: ``ShardedGradScaler``) on a model built from the same seed.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import amp_fx
from amp_fx.errors import AmpFxWarning
from amp_fx.passes import meta
from amp_fx.testing import HostSyncCounter
from tests.distributed._dist_cases import DTYPES, STEPS, _batch, _local, _scale_of, _sgd, _shard, _train, make_model

# (dtype, micro-batches per optimizer step) of the compile_step runs on the nn.Sequential model:
# each dtype without accumulation, and accumulation (the cache refreshed once per window, DDP's
# no_sync) in fp16, where the loss scaler runs on top of it; bf16 accumulation adds no path.
STEP_CASES = [(dtype, 1) for dtype in DTYPES] + [("fp16", 4)]
# Optimizer steps that run eagerly before compile_step's finish is compiled (its warm-up).
WARM_UP = 2


class SharedAcrossGraphs(nn.Module):
    """``fc`` used on both sides of a graph break, twice after it: its four gradient contributions
    meet in the cached cast's node only if every graph of the forward gets the same node.
    ``unused`` gets no gradient (DDP's ``find_unused_parameters=True`` marks it ready itself)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.mid = nn.Linear(8, 8)
        self.head = nn.Linear(8, 4)
        self.unused = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.fc(x))
        torch._dynamo.graph_break()
        h = torch.relu(self.mid(h)) + self.fc(F.gelu(self.fc(h)))
        return self.head(h)


def _shared_model() -> nn.Module:
    torch.manual_seed(0)
    return SharedAcrossGraphs()


# DDP arguments of the SharedAcrossGraphs runs: one bucket per parameter, so that Dynamo's
# DDPOptimizer splits each captured graph at every bucket boundary (more graphs per forward).
SHARED_DDP = {"bucket_cap_mb": 1e-4, "find_unused_parameters": True}


def _small_first_bucket() -> None:
    # DDP and DDPOptimizer give the first bucket at least 1 MiB and refuse a smaller cap for the
    # others; this rank's process only, set before both the reference and amp_fx build their DDP.
    torch.distributed._DEFAULT_FIRST_BUCKET_BYTES = 100


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out.float(), y)


class _DownstreamGraphs:
    """A backend (aot_eager underneath) that counts, in the graphs amp_fx hands it, the casts of
    parameters (``_to_copy`` of an fp32 ``nn.Parameter`` input) and the lifted cached-copy inputs."""

    def __init__(self) -> None:
        self.param_casts = 0
        self.lifted = 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        params = {
            n for n, t in zip(placeholders, example_inputs) if isinstance(t, nn.Parameter) and t.dtype == torch.float32
        }
        self.lifted += sum(1 for n in placeholders if n.meta.get(meta.WEIGHT_CACHE))
        self.param_casts += sum(
            1 for n in gm.graph.nodes if n.target is torch.ops.aten._to_copy.default and n.args[0] in params
        )
        return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)


def _fresh_copies(cache: Any, params: list[torch.Tensor], dtype: torch.dtype) -> tuple[int, int]:
    """(cached copies that the next forward would use as they are and that hold exactly their
    parameter's cast, cached copies)."""
    pairs = cache.pairs(params)
    return sum(cache.is_fresh(w, lowp) and torch.equal(lowp, w.detach().to(dtype)) for w, lowp in pairs), len(pairs)


def _reference(
    rank: int, dtype: str, accumulate: int, build: Callable[[], nn.Module], ddp_kwargs: dict[str, Any]
) -> dict[str, Any]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = build()
    ddp = DDP(model, **ddp_kwargs)
    return _train(
        model,
        ddp,
        torch.amp.GradScaler("cpu", growth_interval=2),
        rank,
        DTYPES[dtype],
        plant_grads=False,
        accumulate=accumulate,
        no_sync=ddp.no_sync,
    )


def step_run(
    rank: int,
    dtype: str,
    accumulate: int,
    *,
    build: Callable[[], nn.Module] = lambda: make_model("seq"),
    ddp_kwargs: dict[str, Any] | None = None,
    weight_cache: bool = True,
) -> dict[str, Any]:
    """``amp_fx.compile_step(DDP(model), weight_cache=...)`` with a dynamic-scale amp_fx.GradScaler
    (bf16 too, as the reference's torch.amp.GradScaler), aot_eager. Per optimizer step after the
    warm-up: host reads, new graphs, casts the cache computed, and whether every cached copy
    equals its weight's cast."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = build()
    params = list(model.parameters())
    downstream = _DownstreamGraphs()
    scaler = amp_fx.GradScaler("cpu", growth_interval=2, step_mode=amp_fx.StepMode.MASKED)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", AmpFxWarning)  # the no-cache twin's reports (strict with the cache)
        step = amp_fx.compile_step(
            DDP(model, **(ddp_kwargs or {})),
            _sgd(model),
            _loss,
            dtype=dtype,
            scaler=scaler,
            accumulate=accumulate,
            backend=downstream,
            weight_cache=weight_cache,
            strict=weight_cache,
        )
        cache = step._forward.amp_fx_weight_cache
        losses, scales, host_reads, new_graphs, recasts, fresh = [], [], 0, 0, [], []
        for i in range(STEPS):
            counter = HostSyncCounter()
            graphs, refreshes = step.graphs_compiled, cache.refreshes if cache is not None else 0
            with counter:
                for micro in range(accumulate):
                    losses.append(step(*_batch(rank, i, micro)).detach().clone())
            scales.append(_scale_of(scaler))
            if i < WARM_UP:
                continue
            host_reads += counter.count
            new_graphs += step.graphs_compiled - graphs
            if cache is not None:
                recasts.append(cache.refreshes - refreshes)
                fresh.append(_fresh_copies(cache, params, DTYPES[dtype]))
    return {
        "losses": torch.stack(losses),
        "scales": torch.stack(scales),
        "params": [_local(p) for p in params],
        "host_reads": host_reads,
        "graphs_after_warm_up": new_graphs,
        "recasts_after_warm_up": recasts,
        "copies_fresh": fresh,
        "has_cache": cache is not None,
        "param_casts": downstream.param_casts,
        "lifted": downstream.lifted,
        "graphs": len(step._forward.amp_fx_records),
        "warnings": [str(w.message) for w in caught if issubclass(w.category, AmpFxWarning)],
    }


def forms_run(rank: int, form: str, accumulate: int) -> dict[str, Any]:
    """``amp_fx.compile(DDP(m), weight_cache=True)`` ("outer") or ``DDP(amp_fx.compile(m,
    weight_cache=True))`` ("inner") with amp_fx.GradScaler (StepMode.HOST_SYNC: a skipped step
    does not call ``optimizer.step()``), fp16. Per window: casts computed, copies reused, whether
    the step was skipped."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = make_model("seq")
    if form == "inner":
        compiled = amp_fx.compile(model, dtype="fp16", backend="aot_eager", weight_cache=True)
        wrapped: Any = DDP(compiled)
    else:
        wrapped = compiled = amp_fx.compile(DDP(model), dtype="fp16", backend="aot_eager", weight_cache=True)
    cache = compiled.amp_fx_weight_cache
    scaler = amp_fx.GradScaler("cpu", growth_interval=2)
    counts = {"refreshes": [], "hits": [], "skipped": []}
    seen = [0, 0]

    def on_window(step: int) -> None:
        counts["refreshes"].append(cache.refreshes - seen[0])
        counts["hits"].append(cache.hits - seen[1])
        counts["skipped"].append(bool(scaler.last_step_skipped))
        seen[:] = [cache.refreshes, cache.hits]

    out = _train(
        model,
        wrapped,
        scaler,
        rank,
        None,
        plant_grads=False,
        accumulate=accumulate,
        no_sync=wrapped.no_sync,
        on_window=on_window,
    )
    out.update(counts)
    return out


def fsdp_run(rank: int) -> dict[str, Any]:
    """``amp_fx.compile(fully_shard(m), weight_cache=True)``: the cache is refused (FSDP2 writes
    its gathered parameters without a trace the cache can see); 3 steps against eager FSDP2."""
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    steps = range(3)
    model = _shard(make_model("seq"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled = amp_fx.compile(model, dtype="bf16", backend="aot_eager", weight_cache=True, strict=False)
        out = _train(
            model, compiled, amp_fx.GradScaler("cpu", growth_interval=2), rank, None, plant_grads=False, steps=steps
        )
    ref_model = _shard(make_model("seq"))
    ref = _train(
        ref_model,
        ref_model,
        ShardedGradScaler("cpu", growth_interval=2),
        rank,
        torch.bfloat16,
        plant_grads=False,
        steps=steps,
    )
    return {
        "ours": out,
        "ref": ref,
        "has_cache": compiled.amp_fx_weight_cache is not None,
        "warnings": [str(w.message) for w in caught if issubclass(w.category, AmpFxWarning)],
    }


def weight_cache_all(rank: int, world_size: int) -> dict[Any, Any]:
    results: dict[Any, Any] = {}
    for dtype, accumulate in STEP_CASES:
        results[("eager", dtype, accumulate)] = _reference(rank, dtype, accumulate, lambda: make_model("seq"), {})
        torch._dynamo.reset()
        results[("step", dtype, accumulate)] = step_run(rank, dtype, accumulate)
    for form in ("outer", "inner"):
        torch._dynamo.reset()
        results[(form, "fp16", 4)] = forms_run(rank, form, 4)
    _small_first_bucket()
    results[("eager", "shared")] = _reference(rank, "bf16", 2, _shared_model, SHARED_DDP)
    for weight_cache in (True, False):
        torch._dynamo.reset()
        results[("step", "shared", weight_cache)] = step_run(
            rank, "bf16", 2, build=_shared_model, ddp_kwargs=SHARED_DDP, weight_cache=weight_cache
        )
    torch._dynamo.reset()
    results["fsdp"] = fsdp_run(rank)
    results.update(tp_run(rank, world_size))
    return results


# optimizer steps of the tensor-parallel runs (each compiles its own graphs: kept short)
TP_STEPS = 3


def _tp_window(
    forward: Callable[[torch.Tensor], torch.Tensor], step: int, accumulate: int, autocast: bool
) -> torch.Tensor:
    from tests.distributed._dist_tp_cases import _batch as tp_batch

    loss = torch.zeros(())
    for micro in range(accumulate):
        x, y = tp_batch(step * accumulate + micro)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            micro_loss = F.mse_loss(forward(x).float(), y)
        (micro_loss / accumulate).backward()
        loss = loss + micro_loss.detach()
    return loss


def tp_run(rank: int, world_size: int) -> dict[Any, Any]:
    """The cache on a tensor-parallel model (tests/distributed/_dist_tp_cases.py's transformer with sequence
    parallelism: every parameter a DTensor), the same batches on both ranks.

    ("tp", form): ``amp_fx.compile`` bf16, 2 micro-batches per SGD step, against eager autocast:
    "cache" (``weight_cache=True``), "fp8" and "fp8_cache" (``fp8="tensorwise"`` without and with
    the cache, on TP without sequence parallelism), with the cache's casts and reuses per window.
    ("tp_step", weight_cache):
    ``compile_step`` fp16 (AdamW, ``amp_fx.GradScaler``), whose finish updates each parameter's
    local tensor and writes the copies there, with the casts per step after the warm-up and
    whether each copy then holds its weight's cast."""
    from torch.distributed.device_mesh import init_device_mesh

    from tests.distributed._dist_tp_cases import _adamw, tensor_parallel
    from tests.distributed._dist_tp_cases import _batch as tp_batch
    from tests.distributed._dist_tp_cases import make_model as tp_model

    mesh = init_device_mesh("cpu", (world_size,))
    build = lambda: tensor_parallel(tp_model(), mesh, sequence_parallel=True)  # noqa: E731
    out: dict[Any, Any] = {}
    for form in ("eager", "cache", "fp8", "fp8_cache"):
        torch._dynamo.reset()
        # fp8 too on the sequence-parallel model: its activations are all-gathered in fp8 (the
        # matmuls take the input's cast through fp8_matmul's x_fp8, which the cache keeps)
        model = build()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        forward: Any = (
            model
            if form == "eager"
            else amp_fx.compile(
                model,
                dtype="bf16",
                backend="aot_eager",
                strict=True,
                weight_cache=form.endswith("cache"),
                fp8="tensorwise" if form.startswith("fp8") else None,
            )
        )
        cache = getattr(forward, "amp_fx_weight_cache", None)
        losses, refreshes, hits = [], [], []
        for step in range(TP_STEPS):
            seen = (cache.refreshes, cache.hits) if cache is not None else (0, 0)
            losses.append(_tp_window(forward, step, 2, autocast=form == "eager"))
            opt.step()
            opt.zero_grad(set_to_none=True)
            if cache is not None:
                refreshes.append(cache.refreshes - seen[0])
                hits.append(cache.hits - seen[1])
        out[("tp", form)] = {
            "losses": torch.stack(losses),
            "params": [_local(p) for p in model.parameters()],
            "refreshes": refreshes,
            "hits": hits,
        }
    params_of_linears = None
    for weight_cache in (False, True):
        torch._dynamo.reset()
        model = build()
        params = list(model.parameters())
        params_of_linears = sum(
            p.dim() >= 1 for m in model.modules() if isinstance(m, nn.Linear) for p in m.parameters(recurse=False)
        )
        step = amp_fx.compile_step(
            model,
            _adamw(model),
            _loss,
            dtype="fp16",
            backend="aot_eager",
            strict=True,
            scaler=amp_fx.GradScaler("cpu", growth_interval=2),
            weight_cache=weight_cache,
        )
        cache = step._forward.amp_fx_weight_cache
        losses, recasts, fresh = [], [], []
        for i in range(TP_STEPS + WARM_UP):
            seen = cache.refreshes if cache is not None else 0
            losses.append(step(*tp_batch(i)).detach().clone())
            if cache is not None and i >= WARM_UP:
                recasts.append(cache.refreshes - seen)
                pairs = cache.pairs(params)
                fresh.append(
                    sum(
                        cache.is_fresh(w, lowp) and torch.equal(_local(lowp), _local(w).to(torch.float16))
                        for w, lowp in pairs
                    )
                )
        out[("tp_step", weight_cache)] = {
            "losses": torch.stack(losses),
            "params": [_local(p) for p in params],
            "recasts": recasts,
            "fresh": fresh,
        }
    out["tp_cast_params"] = params_of_linears
    return out
