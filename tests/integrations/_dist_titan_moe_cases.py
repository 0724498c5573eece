"""The cases of tests/integrations/test_torchtitan_moe.py, run on 2 gloo ranks in one spawn.

torchtitan's Qwen3 MoE debugmodel (2 layers, 64 experts of hidden 768, top 8, SDPA) under its own
``parallelize_qwen3`` with expert parallelism 2 over FSDP2's 2 ranks (``ParallelDims(dp_shard=2,
ep=2)``): each rank holds 32 experts, sharded on the ``(efsdp=1, ep=2)`` mesh, and every other
parameter on the ``fsdp`` mesh; tokens reach their experts by torchtitan's all-to-all dispatch
and combine. Each rank trains on its own tokens, fp32 parameters, ``STEPS`` AdamW steps on
cross-entropy. fp16 with a loss scaler: ``unscale_``, then the gradients clipped to ``CLIP`` with
the global norm over both meshes (``_clip``: the expert gradients' norms over ``(efsdp, ep)``, the
others' over ``fsdp``); an inf is planted in rank 0's local shard of one expert gradient at
``PLANTED_STEP``.

* eager: ``torch.autocast("cpu", dtype)``; fp16 with FSDP's ``ShardedGradScaler`` (its found-inf
  flag all-reduced over every rank);
* amp_fx: ``amp_fx_parallelize(parallelize_qwen3, AmpFxTitanConfig(...))``; fp16 with ``amp_fx.GradScaler``;
* step: ``amp_fx.compile_step`` on the torchtitan-parallelized model, fp16, ``max_grad_norm=CLIP``;
* low precision on the experts (``LP_CASES``, bf16, ``LP_STEPS`` steps): amp_fx with
  ``low_precision`` in ``LOW_PRECISION`` and every ``nn.Linear`` kept in bf16 (``_experts_only``),
  against "seam": eager autocast with torchtitan's ``GroupedExperts._grouped_mm`` running the
  recipe's grouped GEMM (``amp_fx.testing.torchtitan.low_precision_experts``).

The cases of one spawn take about 10 minutes on 2 shared cores (each model build, and each
compile of its 13 graphs, runs on both ranks), so fp16 is clipped in every form rather than run
twice, with and without.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import math
import warnings
from typing import Any

import torch
import torch.nn.functional as F

from amp_fx._common.compat import local_tensor

STEPS = 3
PLANTED_STEP = 1
LR = 1e-2  # as tests/distributed/_dist_tp_cases.py: assert_within_traced_adam's bound assumes it
CLIP = 0.05  # below every step's norm: the test checks the eager recipe's norms exceed it
EXPERT = "layers.0.moe.routed_experts.inner_experts.w1_EFD"  # where the inf is planted
CASES = [("bf16", "eager"), ("bf16", "amp_fx"), ("fp16", "eager"), ("fp16", "amp_fx"), ("fp16", "step")]
LOW_PRECISION = ("rowwise", "mxfp8", "blockwise")
LP_STEPS = 2  # the second step's gradients follow an AdamW step on fp8-trained parameters
LP_CASES = [(recipe, form) for recipe in LOW_PRECISION for form in ("amp_fx", "seam")]
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
_BATCH, _SEQ = 2, 32


def tokens(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's tokens and labels at ``step`` (every rank its own)."""
    from amp_fx.testing.torchtitan import TITAN_VOCAB

    gen = torch.Generator().manual_seed(100 * rank + step)
    return tuple(torch.randint(0, TITAN_VOCAB, (_BATCH, _SEQ), generator=gen) for _ in range(2))  # type: ignore[return-value]


def _loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())


def _plant(model: torch.nn.Module, rank: int, step: int) -> None:
    """An inf in one element of rank 0's local shard of ``EXPERT``'s gradient at ``PLANTED_STEP``."""
    if rank != 0 or step != PLANTED_STEP:
        return
    with torch.no_grad():
        local_tensor(model.get_parameter(EXPERT).grad).view(-1)[0] = math.inf


def model(form: str, dtype: str = "bf16", **amp_fx_options: Any) -> torch.nn.Module:
    """The EP 2 x dp_shard 2 model, parallelized by torchtitan ("eager", "step", "seam") or through
    amp_fx's parallelize_fn ("amp_fx", ``AmpFxTitanConfig(dtype=dtype, **amp_fx_options)``).
    "seam": every ``GroupedExperts`` runs ``amp_fx_options["low_precision"]``'s grouped GEMM through
    torchtitan's own seam (``low_precision_experts``), the eager reference of amp_fx's recipe."""
    from torchtitan.models.qwen3 import parallelize_qwen3

    from amp_fx.integrations.torchtitan import AmpFxTitanConfig, amp_fx_parallelize
    from amp_fx.testing.torchtitan import cpu_qwen3_moe, low_precision_experts

    parallelize = None
    if form == "amp_fx":
        config = AmpFxTitanConfig(dtype=dtype, backend="aot_eager", **amp_fx_options)
        parallelize = amp_fx_parallelize(parallelize_qwen3, config)
    net = cpu_qwen3_moe(ep=2, dp_shard=2, parallelize_fn=parallelize)
    if form == "seam":
        swapped = low_precision_experts(net, amp_fx_options["low_precision"])
        assert swapped == 2, swapped  # one GroupedExperts per layer
    return net


def train(rank: int, dtype: str, form: str, *, low_precision: str | None = None, steps: int = STEPS) -> dict[str, Any]:
    """``steps`` steps of ``form`` (module docstring): losses, loss scales, the eager recipe's
    gradient norms, the last step's local gradients, the parameters after it, the AmpFxWarnings;
    with ``low_precision`` (bf16 only), amp_fx's decisions on every matmul ("amp_fx") or the
    recipe's experts through torchtitan's seam ("seam")."""
    import amp_fx
    from tests.distributed._dist_tp_cases import step_and_zero

    torch._dynamo.reset()
    net = model(form, dtype) if low_precision is None else model(form, dtype, **_experts_only(low_precision))
    opt = torch.optim.AdamW(net.parameters(), lr=LR, foreach=False)
    losses, scales, norms = [], [], []
    grads: dict[str, torch.Tensor] = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", amp_fx.AmpFxWarning)
        if form == "step":
            at = {"step": 0}
            opt.register_step_pre_hook(lambda *_: _plant(net, rank, at["step"]))
            scaler = amp_fx.GradScaler("cpu", step_mode=amp_fx.StepMode.MASKED)
            step = amp_fx.compile_step(
                net, opt, _loss, dtype=dtype, scaler=scaler, backend="aot_eager", max_grad_norm=CLIP
            )
            for i in range(steps):
                losses.append(step(*tokens(rank, i)).detach().clone())
                scales.append(step.scale.clone())
                at["step"] = i + 1
        else:
            scaler = _scaler(dtype, form)
            for i in range(steps):
                x, y = tokens(rank, i)
                autocast = torch.autocast("cpu", dtype=_DTYPES[dtype]) if form != "amp_fx" else contextlib.nullcontext()
                with autocast:
                    loss = _loss(net(x), y)
                (loss if scaler is None else scaler.scale(loss)).backward()
                if scaler is not None:
                    _plant(net, rank, i)
                    scaler.unscale_(opt)
                grads = {n: local_tensor(p.grad).clone() for n, p in net.named_parameters()}
                if scaler is not None:
                    norms.append(_clip(net))
                step_and_zero(opt, scaler, scales)
                losses.append(loss.detach().clone())
    return {
        "losses": torch.stack(losses),
        "scales": torch.stack(scales) if scales else torch.zeros(0),
        "norms": torch.stack(norms) if norms else torch.zeros(0),
        "grads": grads,
        "params": {n: local_tensor(p).detach().clone() for n, p in net.named_parameters()},
        "amp_fx_warnings": [str(w.message) for w in caught if issubclass(w.category, amp_fx.AmpFxWarning)],
        "decisions": _decisions(net) if form == "amp_fx" and low_precision is not None else [],
    }


def _experts_only(recipe: str) -> dict[str, Any]:
    """amp_fx's options for ``recipe`` on the experts alone: every ``nn.Linear`` (attention, router,
    ``lm_head``) kept in bf16 by ``Policy(keep_out_of_fp8=...)``, as in the "seam" reference, whose
    dense layers run under eager autocast (amp_fx's bf16 is bitwise with it: the bf16 cases)."""
    import amp_fx

    return {"low_precision": recipe, "policy": amp_fx.Policy(keep_out_of_fp8=[torch.nn.Linear])}


def _decisions(net: torch.nn.Module) -> list[tuple[str, str, str, bool, str]]:
    """amp_fx's low-precision decisions in every captured graph: (op, module, weight, converted,
    reason)."""
    import amp_fx

    return [
        (d.op, d.module, d.weight, d.converted, d.reason)
        for record in amp_fx.records(net)
        if record.fp8 is not None
        for d in record.fp8.decisions
    ]


def _scaler(dtype: str, form: str) -> Any:
    import amp_fx

    if dtype == "bf16":
        return None
    if form == "amp_fx":
        return amp_fx.GradScaler("cpu")
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    return ShardedGradScaler("cpu")


def _clip(net: torch.nn.Module) -> torch.Tensor:
    """``clip_grad_norm_(CLIP)``'s rule on the DTensor gradients, eagerly: each gradient's 2-norm as
    DTensor reduces it over its mesh (``vector_norm`` of the local shard, ``_NormPartial``, then
    ``full_tensor``), the 2-norm of those norms in the parameters' order, the clamped coefficient
    multiplied in. torch's ``clip_grad_norm_`` cannot stack norms of two meshes, and torchtitan's EP
    clip (recorded beside it, unclipped: ``max_norm=inf`` multiplies by exactly 1.0) sums the expert
    and the dense norms apart, which rounds otherwise: an ulp of the clipped gradients moves the
    parameters, and then the router's top-8 choices, so the steps after it are not comparable.
    Returns (this norm, torchtitan's, the float64 norm of the whole gradients)."""
    from torchtitan.distributed.utils import clip_grad_norm_

    params = [p for p in net.parameters() if p.grad is not None]
    whole = sum(float(p.grad.full_tensor().double().pow(2).sum()) for p in params) ** 0.5
    titan = clip_grad_norm_(params, math.inf, ep_enabled=True).detach().clone()
    with torch.no_grad():
        norms = [torch.linalg.vector_norm(p.grad, 2.0).full_tensor() for p in params]
        total = torch.linalg.vector_norm(torch.stack(norms), 2.0)
        coef = torch.clamp(CLIP / (total + 1e-6), max=1.0)
        for p in params:
            p.grad.mul_(coef)
    return torch.stack([total, titan, torch.tensor(whole, dtype=torch.float32)])


def watch(rank: int, layer: int) -> dict[str, Any]:
    """The non-finite watch (``first_overflows``): ``layers.{layer}.attention.wo``'s weight scaled
    by 1e6 on this rank's shard, fp16."""
    from tests.distributed._dist_tp_cases import first_overflows

    x, y = tokens(rank, 0)
    torch._dynamo.reset()
    net = model("eager")
    wo = net.get_parameter(f"layers.{layer}.attention.wo.weight")
    return first_overflows(net, wo, lambda forward: _loss(forward(x), y))


def compare(rank: int) -> dict[str, Any]:
    """compare (bf16) after a forward and backward; ``state_kept``: None, or how the model's state
    after it differs from before (``assert_same_state``, run here: the state is 1.2 GB)."""
    import amp_fx
    from tests.distributed._dist_asserts import assert_same_state, model_state

    x, y = tokens(rank, 0)
    torch._dynamo.reset()
    net = model("eager")
    _loss(net(x), y).backward()
    before = model_state(net)
    compared = amp_fx.compare(net, x, dtype="bf16")
    try:
        assert_same_state(model_state(net), before, f"rank {rank}")
        kept = None
    except AssertionError as e:
        kept = str(e)
    return {
        "ok": compared.ok,
        "exact": compared.exact,
        "ops": len(compared.ops),
        "grads": len(compared.grads),
        "state_kept": kept,
    }


def explain(rank: int) -> dict[str, Any]:
    """explain (bf16) on the EP model and on the same model unsharded on this rank: the rows (kind,
    op, module, dtype, rule, cast) of the matmul and attention ops and their casts."""
    import amp_fx
    from amp_fx.testing.torchtitan import cpu_qwen3_moe

    x, _ = tokens(rank, 0)
    out = {}
    for name, built in (("ep", lambda: model("eager")), ("whole", lambda: cpu_qwen3_moe(unsharded=True))):
        torch._dynamo.reset()
        explained = amp_fx.explain(built(), x, dtype="bf16")
        out[name] = [
            (n.kind, n.op, n.module, n.dtype_name, n.rule, n.cast)
            for n in explained.nodes()
            if n.kind in ("op", "cast") and any(k in str(n.op) for k in ("mm", "linear", "attention"))
        ]
    return out


def _digest(t: torch.Tensor) -> tuple[str, tuple[int, ...], str]:
    """A tensor's dtype, shape and the SHA-256 of its bytes: equal digests, equal bits. The ranks
    hold 37.7M expert elements each; 6 cases of gradients and parameters would be 1.5 GB per rank
    through ``torch.save``."""
    return (
        str(t.dtype),
        tuple(t.shape),
        hashlib.sha256(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()).hexdigest(),
    )


def moe_all(rank: int, world_size: int) -> dict[Any, Any]:
    """Every case on this rank; a case that raised holds its error (so the others still run). The
    gradients and parameters come back as digests (``_digest``); compile_step's parameters are held
    to the eager recipe's here, in the rank (``clip_check``: the message of
    ``assert_within_traced_adam``'s failure, or None)."""
    from tests.distributed._dist_tp_cases import assert_within_traced_adam, fused_norm_bound
    from tests.integrations._dist_titan_cases import _each

    assert world_size == 2, world_size
    runs: dict[Any, Any] = {case: functools.partial(train, rank, *case) for case in CASES}
    runs |= {
        (recipe, form): functools.partial(train, rank, "bf16", form, low_precision=recipe, steps=LP_STEPS)
        for recipe, form in LP_CASES
    }
    runs |= {tool.__name__: functools.partial(tool, rank) for tool in (compare, explain)}
    runs |= {("watch", layer): functools.partial(watch, rank, layer) for layer in (0, 1)}
    results = _each(runs)
    got, want = results[("fp16", "step")], results[("fp16", "eager")]
    if "error" not in got and "error" not in want:
        try:
            assert_within_traced_adam(
                got["params"], want["params"], f"rank {rank}", extra=fused_norm_bound(want["params"])
            )
            results["clip_check"] = None
        except AssertionError as e:
            results["clip_check"] = str(e)
    for case in (*CASES, *LP_CASES):
        for key in ("grads", "params"):
            if key in results[case]:
                results[case][key] = {n: _digest(t) for n, t in results[case][key].items()}
    return results
