"""What each rank runs for tests/distributed/test_distributed_split_report.py: the report of a weight whose
cast is split between graphs, when Dynamo's DDPOptimizer splits the graphs at DDP's buckets.

Under DDP, DDPOptimizer cuts each captured graph at DDP's bucket boundaries and hands amp_fx
one piece at a time, with fake tensors for the parameters and one compile id for all pieces. A
weight used in two pieces (or on both sides of a graph break) is cast by each piece itself, so
its gradient contributions add up in fp32, where eager autocast adds them in the low dtype.

One spawn runs every case (``split_report_all``) and returns tensors and the AmpFxWarning and
AmpFxError messages; the test process compares them with eager ``DDP`` + ``torch.autocast`` +
``torch.amp.GradScaler`` (``_dist_weight_cache_cases._reference``), 3 optimizer steps, bf16.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import amp_fx
from amp_fx.errors import AmpFxError, AmpFxWarning
from tests.distributed._dist_cases import _batch, _local, _scale_of, _sgd, _train, make_model
from tests.distributed._dist_weight_cache_cases import SHARED_DDP, SharedAcrossGraphs, _small_first_bucket

STEPS = range(3)
# One DDP bucket per parameter (with _small_first_bucket): DDPOptimizer cuts every captured graph
# between the layers.
SPLIT_DDP = {"bucket_cap_mb": 1e-4}
FORMS = ("outer", "inner", "step")


class SharedAcrossBuckets(nn.Module):
    """``fc`` used first and last in one frame (no graph break): with one bucket per parameter,
    its two uses fall in two of DDPOptimizer's pieces."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.mid = nn.Linear(8, 8)
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.fc(x))
        h = torch.relu(self.mid(h))
        return self.head(self.fc(h))


MODELS: dict[str, tuple[Callable[[], nn.Module], dict[str, Any]]] = {
    "buckets": (SharedAcrossBuckets, SPLIT_DDP),
    # fc on both sides of a graph break, each side split again at buckets (and an unused layer)
    "break": (SharedAcrossGraphs, SHARED_DDP),
    "plain": (lambda: make_model("custom"), SPLIT_DDP),  # no weight used twice: the negative twin
}


def _build(kind: str) -> tuple[nn.Module, dict[str, Any]]:
    torch.manual_seed(0)
    build, ddp_kwargs = MODELS[kind]
    return build(), ddp_kwargs


def reference(rank: int, kind: str) -> dict[str, Any]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    model, ddp_kwargs = _build(kind)
    ddp = DDP(model, **ddp_kwargs)
    return _train(
        model, ddp, torch.amp.GradScaler("cpu", growth_interval=2), rank, torch.bfloat16, plant_grads=False, steps=STEPS
    )


def _step_train(model: nn.Module, step: Any, scaler: Any, rank: int) -> dict[str, Any]:
    losses, scales = [], []
    for i in STEPS:
        losses.append(step(*_batch(rank, i)).detach().clone())
        scales.append(_scale_of(scaler))
    return {
        "losses": torch.stack(losses),
        "scales": torch.stack(scales),
        "params": [_local(p) for p in model.parameters()],
    }


def run(rank: int, kind: str, form: str, *, weight_cache: bool, strict: bool) -> dict[str, Any]:
    """``amp_fx.compile(DDP(m))`` ("outer"), ``DDP(amp_fx.compile(m))`` ("inner") or
    ``amp_fx.compile_step(DDP(m))`` ("step"), bf16, aot_eager. Returns the run (or the AmpFxError
    that stopped it), the AmpFxWarnings it raised and how many graphs amp_fx compiled."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    model, ddp_kwargs = _build(kind)
    options = {"dtype": "bf16", "backend": "aot_eager", "weight_cache": weight_cache, "strict": strict}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            if form == "step":
                scaler = amp_fx.GradScaler("cpu", growth_interval=2, step_mode=amp_fx.StepMode.MASKED)
                compiled = amp_fx.compile_step(
                    DDP(model, **ddp_kwargs),
                    _sgd(model),
                    lambda out, y: F.mse_loss(out.float(), y),
                    scaler=scaler,
                    **options,
                )
                out = _step_train(model, compiled, scaler, rank)
                records = compiled._forward.amp_fx_records
            else:
                if form == "inner":
                    compiled = amp_fx.compile(model, **options)
                    wrapped: Any = DDP(compiled, **ddp_kwargs)
                else:
                    wrapped = compiled = amp_fx.compile(DDP(model, **ddp_kwargs), **options)
                out = _train(
                    model,
                    wrapped,
                    amp_fx.GradScaler("cpu", growth_interval=2),
                    rank,
                    None,
                    plant_grads=False,
                    steps=STEPS,
                )
                records = amp_fx.records(compiled)
        except AmpFxError as e:
            out, records = {"error": str(e)}, []
    out["warnings"] = [str(w.message) for w in caught if issubclass(w.category, AmpFxWarning)]
    out["graphs"] = len(records)
    return out


def split_report_all(rank: int, world_size: int) -> dict[Any, Any]:
    _small_first_bucket()
    results: dict[Any, Any] = {}
    for kind in MODELS:
        results[("eager", kind)] = reference(rank, kind)
    cases = [("buckets", form, cache) for form in FORMS for cache in (False, True)]
    cases += [("break", "outer", False), *(("plain", form, False) for form in FORMS)]
    for kind, form, cache in cases:
        torch._dynamo.reset()
        # Without the cache and with a weight used twice, non-strict: the warning and the run.
        strict = cache or kind == "plain"
        results[(kind, form, cache)] = run(rank, kind, form, weight_cache=cache, strict=strict)
    torch._dynamo.reset()
    results[("buckets", "outer", "strict")] = run(rank, "buckets", "outer", weight_cache=False, strict=True)
    return results
