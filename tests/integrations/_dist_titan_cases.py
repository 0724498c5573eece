"""The torchtitan cases of tests/integrations/test_torchtitan.py, run on 2 gloo ranks in one spawn.

torchtitan's Llama 3 debugmodel (2 layers, SDPA) parallelized by torchtitan's own
``parallelize_llama`` with fp32 parameters (``mixed_precision_param="float32"``), trained 3 AdamW
steps on cross-entropy over random tokens:

* eager: ``torch.autocast("cpu", dtype)`` around the model's forward; fp16 with FSDP's
  ``ShardedGradScaler`` (its found-inf flag all-reduced over every rank);
* amp_fx: bf16 through the ``parallelize_fn`` that ``with_amp_fx`` puts in the debugmodel's spec
  (what torchtitan's Trainer calls when a config module applied it); fp16 through
  ``amp_fx_parallelize(parallelize_llama, ...)`` with ``amp_fx.GradScaler``.

tp: tensor parallel 2 (sequence parallel, torchtitan's default), the same tokens on both ranks.
dp: FSDP2 over 2 ranks, each its own tokens.
dp_tp: FSDP2 2 x tensor parallel 2 on 4 ranks (torchtitan's mesh puts tp innermost: ranks 0-1 and
2-3 are the tp groups), each tp group its own tokens. The cases of one world size run in one spawn.
"""

from __future__ import annotations

import contextlib
import functools
import math
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch

STEPS = 3
LAYOUTS = {"tp": {"tp": 2}, "dp": {"dp_shard": 2}, "dp_tp": {"dp_shard": 2, "tp": 2}}
CASES = [(layout, dtype, form) for layout in LAYOUTS for dtype in ("bf16", "fp16") for form in ("eager", "amp_fx")]


_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}

# fp8 against torchtitan's own float8 converter (torchao's Float8Linear): (layout, recipe,
# training.mixed_precision_param). "bfloat16" is torchtitan's default (FSDP2 gathers bf16 weights, no
# autocast: the Float8Linear layers scale bf16 operands) against amp_fx's second mode; "float32" is
# autocast semantics, the reference then runs under torch.autocast (torchao's autocast branch pointed
# at the CPU's state: amp_fx.testing.fp8_reference.cpu_autocast_torchao). On tp 2 the recipe is
# tensorwise: torchtitan's converter builds it (its Config types only the rowwise recipes, but passes
# any torchao recipe name on), and amp_fx's rowwise on tp 2 raises on gloo (docs/torchtitan.md).
# One layer and 2 steps: the CPU's _scaled_mm reference kernel is slow (docs/torchtitan.md).
FP8_CASES = [
    ("dp", "rowwise", "bfloat16"),
    ("dp", "rowwise", "float32"),
    ("dp", "rowwise_with_gw_hp", "bfloat16"),
    ("tp", "tensorwise", "bfloat16"),
]
FP8_STEPS = 2


def world_size_of(layout: str) -> int:
    return math.prod(LAYOUTS[layout].values())


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _train(rank: int, layout: str, dtype: str, form: str) -> dict:
    from torch.amp import GradScaler
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
    from torchtitan.models.llama3 import parallelize_llama

    import amp_fx
    from amp_fx.integrations.torchtitan import AmpFxTitanConfig, amp_fx_parallelize, with_amp_fx
    from amp_fx.testing.torchtitan import cpu_debugmodel, trainer_config_fields

    parallelize = None
    if form == "amp_fx":
        config = AmpFxTitanConfig(dtype=dtype, backend="aot_eager")
        if dtype == "bf16":  # what torchtitan's Trainer calls, from a config module that applied with_amp_fx
            parallelize = with_amp_fx(trainer_config_fields(), config).model_spec.parallelize_fn
        else:  # fp16: a loop of one's own, with amp_fx.GradScaler (the Trainer has no loss scaling)
            parallelize = amp_fx_parallelize(parallelize_llama, config)
    model = cpu_debugmodel(parallelize_fn=parallelize, **LAYOUTS[layout])
    scaler: GradScaler | None = None
    if dtype == "fp16":
        scaler = amp_fx.GradScaler("cpu") if form == "amp_fx" else ShardedGradScaler("cpu")
    autocast = functools.partial(torch.autocast, "cpu", dtype=_DTYPES[dtype]) if form == "eager" else None
    return _steps(model, data_rank=rank // LAYOUTS[layout].get("tp", 1), steps=STEPS, autocast=autocast, scaler=scaler)


def _steps(
    model: torch.nn.Module,
    *,
    data_rank: int,
    steps: int,
    autocast: Callable[[], contextlib.AbstractContextManager] | None,
    scaler: Any = None,
) -> dict:
    """``steps`` AdamW steps of cross-entropy over random tokens seeded by ``data_rank``, the
    forward under ``autocast()`` where given; the losses, loss scales, the last step's
    local gradients, the parameters after it and the amp_fx warnings."""
    import amp_fx
    from amp_fx.testing.torchtitan import TITAN_VOCAB

    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(100 + data_rank)
    losses, scales = [], []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", amp_fx.AmpFxWarning)
        for _ in range(steps):
            tokens = torch.randint(0, TITAN_VOCAB, (2, 32), generator=gen)
            labels = torch.randint(0, TITAN_VOCAB, (2, 32), generator=gen)
            opt.zero_grad(set_to_none=True)
            with autocast() if autocast is not None else contextlib.nullcontext():
                logits = model(tokens)
            logits = logits.full_tensor() if hasattr(logits, "full_tensor") else logits
            loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), labels.flatten())
            if scaler is None:
                loss.backward()
                grads = {n: _local(p.grad).clone() for n, p in model.named_parameters()}
                opt.step()
            else:
                scaler.scale(loss).backward()
                scaler.unscale_(opt)
                grads = {n: _local(p.grad).clone() for n, p in model.named_parameters()}
                scaler.step(opt)
                scaler.update()
                scales.append(scaler.get_scale())
            losses.append(loss.detach())
    return {
        "losses": torch.stack(losses),
        "scales": torch.tensor(scales),
        "grads": grads,
        "params": {n: _local(p.detach()).clone() for n, p in model.named_parameters()},
        "amp_fx_warnings": [str(w.message) for w in caught if issubclass(w.category, amp_fx.AmpFxWarning)],
    }


def _train_fp8(rank: int, layout: str, recipe: str, param_dtype: str, form: str) -> dict:
    """torchtitan's float8 converter ("torchtitan") or amp_fx's fp8 ("amp_fx"), on 2 ranks."""
    from torchtitan.models.llama3 import parallelize_llama

    from amp_fx.integrations.torchtitan import AmpFxTitanConfig, amp_fx_parallelize
    from amp_fx.testing.torchtitan import cpu_debugmodel

    autocast = None
    if form == "torchtitan":
        model = cpu_debugmodel(n_layers=1, param_dtype=param_dtype, float8_recipe=recipe, **LAYOUTS[layout])
        if param_dtype == "float32":
            autocast = _torchao_under_cpu_autocast
    else:  # strict from the suite's environment (no fp8 tensor cores is a notice, not a shortfall), but
        # on tp: amp_fx reports that sequence parallelism gathers activations before their fp8 cast (the test reads it)
        strict = False if layout == "tp" else None
        config = AmpFxTitanConfig(dtype="bf16", fp8=recipe, backend="aot_eager", strict=strict)
        model = cpu_debugmodel(
            n_layers=1,
            param_dtype=param_dtype,
            parallelize_fn=amp_fx_parallelize(parallelize_llama, config),
            **LAYOUTS[layout],
        )
    result = _steps(model, data_rank=rank // LAYOUTS[layout].get("tp", 1), steps=FP8_STEPS, autocast=autocast)
    result["linear_types"] = sorted(
        {
            type(m).__name__
            for m in model.modules()  # the layers that own a weight
            if "Linear" in type(m).__name__ and "weight" in m._parameters
        }
    )
    return result


@contextlib.contextmanager
def _torchao_under_cpu_autocast() -> Iterator[None]:
    from amp_fx.testing.fp8_reference import cpu_autocast_torchao

    with cpu_autocast_torchao(), torch.autocast("cpu", dtype=torch.bfloat16):
        yield


def titan_fp8(rank: int, world_size: int) -> dict:
    """Every fp8 case on this rank, keyed (layout, recipe, param_dtype, form); errors held as in titan_all."""
    return _each(
        {
            (*case, form): functools.partial(_train_fp8, rank, *case, form)
            for case in FP8_CASES
            for form in ("torchtitan", "amp_fx")
        }
    )


def _each(runs: dict) -> dict:
    results: dict = {}
    for key, run in runs.items():
        try:
            results[key] = run()
        except Exception as e:  # noqa: BLE001 - reported by the test that reads this case
            results[key] = {"error": f"{type(e).__name__}: {str(e)[:2000]}"}
    return results


def titan_all(rank: int, world_size: int) -> dict:
    """Every case of this world size on this rank; a case that raised holds its error (so the
    others still run)."""
    return _each(
        {case: functools.partial(_train, rank, *case) for case in CASES if world_size_of(case[0]) == world_size}
    )
