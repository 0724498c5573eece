"""What each gloo rank runs for tests/test_distributed_fp8.py (spawned processes import this).

fp8 training on 2 ranks, against the eager reference torchao gives: torchao's
``convert_to_float8_training`` under ``torch.autocast("cpu", bf16)`` (its autocast branch pointed
at the CPU's state: ``amp_fx.testing.fp8_reference.cpu_autocast_torchao``), wrapped as the amp_fx
run is (DDP, FSDP2). bf16, no loss scaling; SGD with momentum; each rank its own batch.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import amp_fx
from amp_fx.testing.fp8_reference import cpu_autocast_torchao, torchao_float8

STEPS = 4


def make_model() -> nn.Module:
    """Every dimension a multiple of 16 (``_scaled_mm``'s rule, which amp_fx applies on CPU too)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32))


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(16, 32, generator=g), torch.randn(16, 32, generator=g)


def _local(t: torch.Tensor) -> torch.Tensor:
    return (t.to_local() if hasattr(t, "to_local") else t).detach().clone()


def _train(model: nn.Module, forward: Any, rank: int, reference: bool) -> dict[str, Any]:
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses = []
    for step in range(STEPS):
        x, y = _batch(rank, step)
        if reference:
            with cpu_autocast_torchao(), torch.autocast("cpu", torch.bfloat16):
                loss = F.mse_loss(forward(x).float(), y)
        else:
            loss = F.mse_loss(forward(x).float(), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach().clone())
    return {"losses": torch.stack(losses), "params": [_local(p) for p in model.parameters()]}


def _converted(compiled: Any) -> int:
    return sum(d.converted for r in amp_fx.records(compiled) if r.fp8 is not None for d in r.fp8.decisions)


def _shard(model: nn.Module) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    for m in model.modules():
        if isinstance(m, nn.Linear):
            fully_shard(m)
    fully_shard(model)
    return model


def run(rank: int, world_size: int, wrapper: str, form: str, recipe: str) -> dict[str, Any]:
    """``wrapper``: "ddp" or "fsdp2"; ``form``: "torchao" (the reference), "inner"
    (``DDP(amp_fx.compile(m))``), "inner_cached" (the same with ``weight_cache=True``: the fp8
    weight casts once per step), "outer" (``amp_fx.compile(DDP(m))``, ``amp_fx.compile`` of the
    FSDP2-sharded model), "step" (``amp_fx.compile_step`` of the wrapped model, the same SGD)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch._dynamo.reset()
    model = make_model()
    if form == "torchao":
        model = torchao_float8(model, recipe)
        wrapped = DDP(model) if wrapper == "ddp" else _shard(model)
        return _train(model, wrapped, rank, reference=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", amp_fx.AmpFxWarning)
        if form == "step":
            inner = DDP(model) if wrapper == "ddp" else _shard(model)
            opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
            step = amp_fx.compile_step(inner, opt, lambda out, y: F.mse_loss(out.float(), y), dtype="bf16",
                                       fp8=recipe, backend="aot_eager", strict=False)
            losses = [step(*_batch(rank, i)).detach().clone() for i in range(STEPS)]
            return {"losses": torch.stack(losses), "params": [_local(p) for p in model.parameters()],
                    "converted": _converted(step._forward), "warnings": [str(w.message) for w in caught]}
        if wrapper == "ddp" and form in ("inner", "inner_cached"):
            compiled = amp_fx.compile(model, dtype="bf16", fp8=recipe, backend="aot_eager", strict=False,
                                      weight_cache=form == "inner_cached")
            wrapped = DDP(compiled)
        else:
            inner = DDP(model) if wrapper == "ddp" else _shard(model)
            wrapped = compiled = amp_fx.compile(inner, dtype="bf16", fp8=recipe, backend="aot_eager", strict=False)
        out = _train(model, wrapped, rank, reference=False)
    out["converted"] = _converted(compiled)
    out["warnings"] = [str(w.message) for w in caught]
    return out


CASES = [("ddp", "inner"), ("ddp", "inner_cached"), ("ddp", "outer"), ("ddp", "step"),
         ("fsdp2", "outer"), ("fsdp2", "step")]


def run_all(rank: int, world_size: int, recipes: list[str]) -> dict[Any, Any]:
    results: dict[Any, Any] = {}
    for recipe in recipes:
        for wrapper in ("ddp", "fsdp2"):
            results[wrapper, "torchao", recipe] = run(rank, world_size, wrapper, "torchao", recipe)
        for wrapper, form in CASES:
            results[wrapper, form, recipe] = run(rank, world_size, wrapper, form, recipe)
    return results
