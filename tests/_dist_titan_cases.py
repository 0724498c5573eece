"""The torchtitan cases of tests/test_torchtitan.py, run on 2 gloo ranks in one spawn.

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

import math
import warnings

import torch

STEPS = 3
LAYOUTS = {"tp": {"tp": 2}, "dp": {"dp_shard": 2}, "dp_tp": {"dp_shard": 2, "tp": 2}}
CASES = [(layout, dtype, form) for layout in LAYOUTS for dtype in ("bf16", "fp16") for form in ("eager", "amp_fx")]


def world_size_of(layout: str) -> int:
    return math.prod(LAYOUTS[layout].values())
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _train(rank: int, layout: str, dtype: str, form: str) -> dict:
    from torch.amp import GradScaler
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
    from torchtitan.models.llama3 import parallelize_llama

    import amp_fx
    from amp_fx.integrations.torchtitan import AmpFxTitanConfig, amp_fx_parallelize, with_amp_fx
    from amp_fx.testing.torchtitan import TITAN_VOCAB, cpu_debugmodel, trainer_config_fields

    parallelize = None
    if form == "amp_fx":
        config = AmpFxTitanConfig(dtype=dtype, backend="aot_eager")
        if dtype == "bf16":  # what torchtitan's Trainer calls, from a config module that applied with_amp_fx
            parallelize = with_amp_fx(trainer_config_fields(), config).model_spec.parallelize_fn
        else:  # fp16: a loop of one's own, with amp_fx.GradScaler (the Trainer has no loss scaling)
            parallelize = amp_fx_parallelize(parallelize_llama, config)
    model = cpu_debugmodel(parallelize_fn=parallelize, **LAYOUTS[layout])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler: GradScaler | None = None
    if dtype == "fp16":
        scaler = amp_fx.GradScaler("cpu") if form == "amp_fx" else ShardedGradScaler("cpu")
    gen = torch.Generator().manual_seed(100 + rank // LAYOUTS[layout].get("tp", 1))  # the data-parallel rank
    losses, scales = [], []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", amp_fx.AmpFxWarning)
        for _ in range(STEPS):
            tokens = torch.randint(0, TITAN_VOCAB, (2, 32), generator=gen)
            labels = torch.randint(0, TITAN_VOCAB, (2, 32), generator=gen)
            opt.zero_grad(set_to_none=True)
            if form == "eager":
                with torch.autocast("cpu", dtype=_DTYPES[dtype]):
                    logits = model(tokens)
            else:
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
    return {"losses": torch.stack(losses), "scales": torch.tensor(scales), "grads": grads,
            "params": {n: _local(p.detach()).clone() for n, p in model.named_parameters()},
            "amp_fx_warnings": [str(w.message) for w in caught if issubclass(w.category, amp_fx.AmpFxWarning)]}


def titan_all(rank: int, world_size: int) -> dict:
    """Every case of this world size on this rank; a case that raised holds its error (so the
    others still run)."""
    results: dict = {}
    for case in (c for c in CASES if world_size_of(c[0]) == world_size):
        try:
            results[case] = _train(rank, *case)
        except Exception as e:  # noqa: BLE001 - reported by the test that reads this case
            results[case] = {"error": f"{type(e).__name__}: {str(e)[:2000]}"}
    return results
