"""What each gloo rank runs for tests/models/test_fsdp2_real_models.py (spawned processes import this).

transformers' Llama and GPT-2 (the real-model tier's, amp_fx/testing/real_models.py) sharded as
users shard them with FSDP2: ``fully_shard`` on each decoder layer, then on the root; "own_units"
also shards the root's own modules first (Llama's embedding; GPT-2's tied ``wte`` and ``lm_head``
together, ``wpe``, ``ln_f``), which is what amp_fx's report of the root's skipped frame tells
users to do.
Every rank trains on the same batch, 3 SGD steps; each run returns its losses, its local parameter
shards and the warnings it gave (amp_fx's, and FSDP2's "returned a view tensor").
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import amp_fx
from amp_fx.testing import eager_amp_step
from amp_fx.testing.real_models import REAL_MODELS
from tests.distributed._dist_cases import _local

STEPS = 3
LR = 0.1


def _shard(model: nn.Module, own_units: bool) -> nn.Module:
    """Llama: ``model.model.layers``; GPT-2: ``model.transformer.h``, whose embedding ``wte`` is
    tied to ``lm_head`` (FSDP2 takes both in one unit or neither)."""
    from torch.distributed.fsdp import fully_shard

    gpt2 = hasattr(model, "transformer")
    inner = model.transformer if gpt2 else model.model
    if own_units and gpt2:
        fully_shard([inner.wte, model.lm_head])
        fully_shard(inner.wpe)
        fully_shard(inner.ln_f)
    elif own_units:
        fully_shard(inner.embed_tokens)
    for layer in inner.h if gpt2 else inner.layers:
        fully_shard(layer)
    return fully_shard(model)


def _run(
    build: Callable[[nn.Module, torch.optim.Optimizer], Callable[..., torch.Tensor]],
    model: nn.Module,
    inputs: dict[str, torch.Tensor],
) -> dict[str, Any]:
    """``STEPS`` calls of the step ``build`` makes of the sharded model and its SGD."""
    torch._dynamo.reset()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    step = build(model, opt)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        losses = [step(**inputs).float() for _ in range(STEPS)]
    return {
        "losses": torch.stack(losses),
        "params": [_local(p) for p in model.parameters()],
        "amp_fx_warnings": [str(w.message) for w in caught if issubclass(w.category, amp_fx.AmpFxWarning)],
        "view_warnings": [str(w.message) for w in caught if "returned a view tensor" in str(w.message)],
    }


def _sgd_step(
    forward: Callable[..., Any],
    loss_fn: Callable[[Any], torch.Tensor],
    opt: torch.optim.Optimizer,
    dtype: torch.dtype | None,
) -> Callable[..., torch.Tensor]:
    """Forward (under eager autocast where ``dtype`` is given), backward, SGD, zero_grad."""

    def step(**batch: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
            loss = loss_fn(forward(**batch))
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    return step


def fsdp2_gpt2(
    fresh: Callable[[], nn.Module], loss_fn: Callable[[Any], torch.Tensor], inputs: dict[str, torch.Tensor]
) -> dict[tuple[str, str, str], dict[str, Any]]:
    """GPT-2 in bf16: eager autocast, amp_fx in both shardings (strict where nothing is reported)."""
    out = {
        ("gpt2", "any", "eager"): _run(
            lambda m, opt: _sgd_step(m, loss_fn, opt, torch.bfloat16), _shard(fresh(), True), inputs
        )
    }
    for own_units in (False, True):
        out[("gpt2", "own_units" if own_units else "layers", "amp_fx")] = _run(
            lambda m, opt: _sgd_step(
                amp_fx.compile(m, dtype="bf16", backend="aot_eager", strict=own_units), loss_fn, opt, None
            ),
            _shard(fresh(), own_units),
            inputs,
        )
    return out


def fsdp2_real(rank: int, world_size: int) -> dict[str, Any]:
    """Each run by ``(what, sharding, form)``: what is "gpt2" (bf16) or Llama's dtype (fp16:
    compile_step; fp8); sharding "layers", "own_units", "none" (the unsharded model), or "any"
    for eager autocast."""
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    model, inputs, loss_fn = REAL_MODELS["hf_gpt2"].build()
    out = fsdp2_gpt2(lambda: copy.deepcopy(model), loss_fn, inputs)
    model, inputs, loss_fn = REAL_MODELS["hf_llama"].build()
    fresh = lambda: copy.deepcopy(model)  # noqa: E731 - every run starts from the same weights
    # Llama: sharded as the report says only (GPT-2 above covers the per-layer sharding), strict
    out[("fp16", "own_units", "eager")] = _run(
        lambda m, opt: eager_amp_step(
            m, opt, loss_fn, ShardedGradScaler("cpu", growth_interval=2), dtype=torch.float16
        ),
        _shard(fresh(), True),
        inputs,
    )
    out[("fp16", "own_units", "amp_fx")] = _run(
        lambda m, opt: amp_fx.compile_step(
            m,
            opt,
            loss_fn,
            dtype="fp16",
            backend="aot_eager",
            strict=True,
            scaler=amp_fx.GradScaler("cpu", growth_interval=2),
        ),
        _shard(fresh(), True),
        inputs,
    )
    # fp8: the reference is amp_fx's fp8 on the unsharded model, in this rank (the same batch on
    # every rank: FSDP2's averaged gradient is each rank's own), its parameters cut as FSDP2 cuts
    # them (dim 0, torch.chunk)
    fp8 = lambda m: amp_fx.compile(m, dtype="bf16", fp8="tensorwise", backend="aot_eager", strict=True)  # noqa: E731
    whole = _run(lambda m, opt: _sgd_step(fp8(m), loss_fn, opt, None), fresh(), inputs)
    whole["params"] = [p.chunk(world_size)[rank] for p in whole["params"]]
    out[("fp8", "none", "amp_fx")] = whole
    out[("fp8", "own_units", "amp_fx")] = _run(
        lambda m, opt: _sgd_step(fp8(m), loss_fn, opt, None), _shard(fresh(), True), inputs
    )
    return out
