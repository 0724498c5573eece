"""What each gloo rank runs for tests/models/test_tp_real_models.py (spawned processes import this).

transformers' Llama (the real-model tier's, amp_fx/testing/real_models.py) made tensor-parallel on
2 ranks the two ways users do it:

* "hf": transformers' own tensor parallelism, ``from_pretrained(path, distributed_config=
  DistributedConfig(tp_size=2))``: the model's ``_tp_plan`` (q/k/v/gate/up column-wise, o/down
  row-wise, ``lm_head`` column-wise with its output gathered), applied by transformers' TP layers,
  which replace each module's ``forward`` per instance. The checkpoint is the random-init model,
  saved by rank 0 (no download);
* "torch": torch's ``parallelize_module`` with ``ColwiseParallel``/``RowwiseParallel`` on the same
  modules (the plan transformers' config states, ``base_model_tp_plan``), as torchtitan-style code
  does; ``lm_head`` stays replicated.

Every rank trains on the same batch, 3 SGD steps; each run returns its losses, its local
parameter shards and amp_fx's warnings.
"""

from __future__ import annotations

import copy
import re
import tempfile
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import amp_fx
from amp_fx.passes import meta
from amp_fx.testing import eager_amp_step
from amp_fx.testing.real_models import REAL_MODELS
from tests.distributed._dist_real_model_cases import _run as _fsdp2_run
from tests.distributed._dist_real_model_cases import _sgd_step
from tests.distributed._dist_tp_cases import first_overflows

Step = Callable[..., torch.Tensor]


def _run(
    build: Callable[[nn.Module, torch.optim.Optimizer], Step], model: nn.Module, inputs: dict[str, torch.Tensor]
) -> dict[str, Any]:
    """The real-model tier's FSDP2 run (``_dist_real_model_cases._run``: ``STEPS`` SGD steps), and
    how many of the model's parameters are DTensors."""
    out = _fsdp2_run(build, model, inputs)
    out["dtensor_params"] = sum(hasattr(p, "device_mesh") for p in model.parameters())
    return out


def _bf16(form: str, loss_fn: Callable[[Any], torch.Tensor]) -> Callable[[nn.Module, torch.optim.Optimizer], Step]:
    """The bf16 SGD step of ``form``: eager autocast, or ``amp_fx.compile`` (strict)."""
    if form == "eager":
        return lambda m, opt: _sgd_step(m, loss_fn, opt, torch.bfloat16)
    return lambda m, opt: _sgd_step(
        amp_fx.compile(m, dtype="bf16", backend="aot_eager", strict=True), loss_fn, opt, None
    )


def torch_plan(model: nn.Module) -> dict[str, Any]:
    """``parallelize_module``'s plan for the modules transformers' ``base_model_tp_plan`` names
    ("layers.*.self_attn.q_proj": "colwise", ...), its ``*`` matched against the model's modules."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    plan = {}
    for pattern, style in model.config.base_model_tp_plan.items():
        matcher = re.compile(r"model\." + re.escape(pattern).replace(r"\*", r"\d+") + "$")
        plan.update({name: styles[style]() for name, _ in model.named_modules() if matcher.match(name)})
    return plan


def tp_real(rank: int, world_size: int) -> dict[tuple[str, str], dict[str, Any]]:
    """Each run by ``(how, form)``: how "hf" or "torch" (bf16), "fp16" (torch's plan;
    ``compile_step`` against eager autocast with ``amp_fx.GradScaler``: torch's scalers refuse this
    layout, whose norm weights are plain tensors beside DTensor gradients, "got mixed torch.Tensor
    and DTensor"), "fp8" (torch's plan, tensorwise);
    form "eager" or "amp_fx". ("torch", "amp_fx_cache"): amp_fx with ``weight_cache=True``;
    ("torch", "watch"): the non-finite watch against eager autocast's hooks, ``layers.0.mlp.up_proj``
    scaled (``first_overflows``)."""
    import torch.distributed as dist
    import transformers
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    model, inputs, loss_fn = REAL_MODELS["hf_llama"].build()
    mesh = init_device_mesh("cpu", (world_size,))

    def torch_tp() -> nn.Module:
        fresh = copy.deepcopy(model)
        return parallelize_module(fresh, mesh, torch_plan(fresh))

    out: dict[tuple[str, str], dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as scratch:
        path = [scratch]
        dist.broadcast_object_list(path, src=0)  # rank 0's folder: every rank loads the one checkpoint
        if rank == 0:
            model.save_pretrained(path[0])
        dist.barrier()
        for form in ("eager", "amp_fx"):
            hf = (
                type(model)
                .from_pretrained(path[0], distributed_config=transformers.DistributedConfig(tp_size=world_size))
                .train()
            )
            out[("hf", form)] = _run(_bf16(form, loss_fn), hf, inputs)
        dist.barrier()  # rank 0 removes its folder once every rank has loaded from it
    for form in ("eager", "amp_fx"):
        out[("torch", form)] = _run(_bf16(form, loss_fn), torch_tp(), inputs)
    out[("torch", "amp_fx_cache")] = _run(
        lambda m, opt: _sgd_step(
            amp_fx.compile(m, dtype="bf16", backend="aot_eager", strict=True, weight_cache=True), loss_fn, opt, None
        ),
        torch_tp(),
        inputs,
    )
    watched = torch_tp()
    out[("torch", "watch")] = first_overflows(
        watched, watched.model.layers[0].mlp.up_proj.weight, lambda forward: loss_fn(forward(**inputs))
    )
    out[("fp16", "eager")] = _run(
        lambda m, opt: eager_amp_step(
            m, opt, loss_fn, amp_fx.GradScaler("cpu", growth_interval=2), dtype=torch.float16
        ),
        torch_tp(),
        inputs,
    )
    out[("fp16", "amp_fx")] = _run(
        lambda m, opt: amp_fx.compile_step(
            m,
            opt,
            loss_fn,
            dtype="fp16",
            backend="aot_eager",
            strict=True,
            scaler=amp_fx.GradScaler("cpu", growth_interval=2),
        ),
        torch_tp(),
        inputs,
    )
    fp8 = torch_tp()
    compiled = amp_fx.compile(fp8, dtype="bf16", fp8="tensorwise", backend="aot_eager", strict=True)
    out[("fp8", "amp_fx")] = _run(lambda m, opt: _sgd_step(compiled, loss_fn, opt, None), fp8, inputs)
    decisions = [
        n.meta[meta.FP8] for r in amp_fx.records(compiled) for n in r.rewritten.graph.nodes if meta.FP8 in n.meta
    ]
    out[("fp8", "amp_fx")]["fp8"] = {
        "converted": sum(d.converted for d in decisions),
        "considered": len(decisions),
        "linears": sum(isinstance(m, nn.Linear) for m in fp8.modules()),
    }
    return out
