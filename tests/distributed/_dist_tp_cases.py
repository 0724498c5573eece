"""What each rank runs for tests/distributed/test_distributed_tp.py: tensor parallelism (``parallelize_module``).

A small pre-norm transformer (SDPA attention, ReLU MLP) sharded as torchtitan and torch's TP tutorial
shard one: ``ColwiseParallel`` on q/k/v and the MLP's first linear, ``RowwiseParallel`` on the
attention's output projection and the MLP's second linear. With ``sequence_parallel`` the norms are
``SequenceParallel`` (their parameters replicated DTensors, the activations between the blocks sharded
on the sequence), the attention and MLP gather their input with ``PrepareModuleInput`` and the row-wise
linears reduce-scatter it back (``output_layouts=Shard(1)``): every parameter is a DTensor, and the
residual stream is each rank's local slice of the sequence, as in torchtitan's Llama.

One recipe, run by the reference (eager ``torch.autocast`` on the same sharded model, with FSDP's
``ShardedGradScaler`` for fp16, whose found-inf flag is all-reduced over every rank) and by amp_fx:
AdamW, MSE loss in fp32, an inf planted in rank 0's *local shard* of one gradient at step 1 (no other
rank holds that element: every rank must skip that step).
"""

from __future__ import annotations

import contextlib
import copy
import math
import warnings
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import amp_fx
from amp_fx._common.compat import local_tensor
from amp_fx.kernels.fp8_support import rowwise_scales_missing
from amp_fx.passes import meta
from tests.distributed._dist_asserts import model_state

STEPS = 3
LR = 1e-2  # AdamW's
CLIP = 0.05  # small enough to clip (the test checks the clipped run's parameters differ from the unclipped)
PLANTED_STEP = 1
D, HEADS, SEQ, BATCH = 32, 4, 8, 2


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v, self.wo = (nn.Linear(D, D) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (m(x).view(b, t, -1, D // HEADS).transpose(1, 2) for m in (self.q, self.k, self.v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(a.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1, self.w2 = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.relu(self.w1(x)))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.attn, self.norm2, self.mlp = nn.LayerNorm(D), Attention(), nn.LayerNorm(D), MLP()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class Transformer(nn.Module):
    def __init__(self, layers: int = 2) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def make_model() -> Transformer:
    torch.manual_seed(0)
    return Transformer()


def tensor_parallel(model: Transformer, mesh: Any, *, sequence_parallel: bool = False) -> Transformer:
    """Shard ``model`` over ``mesh`` (1-D) in place."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        PrepareModuleOutput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    for block in model.blocks:
        plan: dict[str, Any] = {
            "attn.q": ColwiseParallel(),
            "attn.k": ColwiseParallel(),
            "attn.v": ColwiseParallel(),
            "mlp.w1": ColwiseParallel(),
        }
        if sequence_parallel:
            plan.update(
                {
                    "norm1": SequenceParallel(),
                    "norm2": SequenceParallel(),
                    "attn": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                    "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                    "attn.wo": RowwiseParallel(output_layouts=Shard(1)),
                    "mlp.w2": RowwiseParallel(output_layouts=Shard(1)),
                }
            )
        else:
            plan.update({"attn.wo": RowwiseParallel(), "mlp.w2": RowwiseParallel()})
        # src_data_rank=None: every rank built the same model from one seed, so each keeps its own
        # shard (no scatter: the byte-counting backend has none, and its Python-side delegation
        # cannot hand a tensor subclass such as torchao's weights to gloo)
        parallelize_module(block, mesh, plan, src_data_rank=None)
    if sequence_parallel:  # the replicated input enters sharded on the sequence, the output leaves whole
        parallelize_module(
            model,
            mesh,
            {
                "blocks.0": PrepareModuleInput(
                    input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),), use_local_output=True
                ),
                f"blocks.{len(model.blocks) - 1}": PrepareModuleOutput(
                    output_layouts=(Shard(1),), desired_output_layouts=(Replicate(),), use_local_output=True
                ),
            },
            src_data_rank=None,
        )
    return model


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The same batch on every rank (tensor parallelism replicates the input)."""
    g = torch.Generator().manual_seed(step)
    return torch.randn(BATCH, SEQ, D, generator=g), torch.randn(BATCH, SEQ, D, generator=g)


def _local(t: torch.Tensor) -> torch.Tensor:
    return (t.to_local() if hasattr(t, "to_local") else t).detach().clone()


def _plant(model: nn.Module, rank: int, step: int) -> None:
    """An inf in one element of rank 0's local shard of ``blocks.0.attn.q.weight``'s gradient."""
    if rank != 0 or step != PLANTED_STEP:
        return
    grad = model.blocks[0].attn.q.weight.grad
    with torch.no_grad():
        (grad._local_tensor if hasattr(grad, "_local_tensor") else grad).view(-1)[0] = math.inf


def _adamw(model: nn.Module) -> torch.optim.Optimizer:
    # foreach=False: without sequence parallelism the norms' parameters are plain tensors beside
    # DTensors, which torch's foreach kernels refuse to mix in one list
    return torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1, foreach=False)


def _clip(model: nn.Module) -> None:
    """``clip_grad_norm_(model.parameters(), CLIP)``, by hand where torch's cannot: its norms of
    gradients on different meshes (FSDP2 x TP: the norms' parameters on the dp sub-mesh, the rest on
    the 2-D mesh) cannot be stacked ("All operands in aten.stack.default must have the same
    mesh"), so each gradient's norm is taken whole (``full_tensor``), as torchtitan's own
    ``clip_grad_norm_`` does, then clip_grad_norm_'s formula."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    meshes = {id(g.device_mesh) for g in grads if hasattr(g, "device_mesh")}
    if len(meshes) <= 1:
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        return
    norms = [torch.linalg.vector_norm(g.full_tensor() if hasattr(g, "full_tensor") else g, 2.0) for g in grads]
    total = torch.linalg.vector_norm(torch.stack(norms), 2.0)
    coef = torch.clamp(CLIP / (total + 1e-6), max=1.0)
    with torch.no_grad():
        for g in grads:
            g.mul_(coef)


def assert_within_traced_adam(
    got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str, *, extra: float = 0.0
) -> None:
    """compile_step's parameters against the eager recipe's: within the traced Adam step's rounding,
    ADAM_TRACED_RTOL of each element's movement (STEPS AdamW steps at lr 1e-2, one skipped: at
    most 2 * lr), plus one fp32 ulp of the value, plus ``extra`` (:func:`fused_norm_bound`)."""
    from tests.step._step_cases import ADAM_TRACED_RTOL

    for name, e in want.items():
        a = got[name]
        bound = ADAM_TRACED_RTOL * 2 * LR + extra + 2**-24 * e.abs()
        assert ((a - e).abs() <= bound).all(), f"{what}, {name}: max diff {(a - e).abs().max()}"


def fused_norm_bound(params: dict[str, torch.Tensor]) -> float:
    """How far ``GradNorm.FUSED`` may move a parameter from ``GradNorm.TORCH`` (or the eager recipe),
    ``params`` one rank's local tensors.

    Both norms start from the same unscaled gradients. With u = 2^-24 and the sum of squares S,
    torch's norm of norms errs on S by at most (m + P + 7) u: each local norm sums at most m
    squares (m the largest local gradient's size: (m - 1) u for any order of non-negative terms,
    u per square, 2 u for its sqrt squared back), then the squaring, the all-reduces over at most
    two groups and the norm of the P norms (P u). The fused sum errs by at most (m + 5) u (the same
    per-tensor sums, their fp64 total rounded to fp32, two all-reduces, the sum of at most three
    segments). So the norms, and clip_grad_norm_'s coefficient (2 u more), differ by at most
    delta = (m + P / 2 + 10) u relative; written (m + P + 16) u. Only the last of the STEPS steps
    clips in the compiled finish (the first is the eager warm-up, the second skipped), AdamW's
    second update, lr * m^ / (sqrt(v^) + eps) with betas (0.9, 0.999): scaling its gradient by
    1 + delta moves m^ / sqrt(v^) by at most (0.1 / 0.19) * sqrt(0.001999 / 0.001) = 0.744 times
    delta, and sqrt(v^) by at most delta relative while |m^ / sqrt(v^)| <= 1.0 (Cauchy-Schwarz):
    1.75 * lr * delta, written 2 * lr * delta. For the sequence-parallel model (m = 2048, P = 32),
    2.5e-6."""
    m, count = max(p.numel() for p in params.values()), len(params)
    return 2 * LR * (m + count + 16) * 2**-24


def _fallbacks(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, amp_fx.AmpFxWarning)]


def train(
    model: nn.Module,
    rank: int,
    dtype: str,
    form: str,
    batch: Callable[[int], tuple[torch.Tensor, torch.Tensor]] = _batch,
) -> dict[str, Any]:
    """``form``: "eager" (torch.autocast; fp16 with ShardedGradScaler), "amp_fx" (amp_fx.compile and
    amp_fx.GradScaler), "step" (amp_fx.compile_step, fp16); "eager_clip" and "step_clip" the same
    with the gradients clipped to a global norm of ``CLIP`` (eager: ``unscale_`` then
    ``clip_grad_norm_`` on the DTensors; compile_step: ``max_grad_norm``), "step_fused_clip" that
    with ``grad_norm=GradNorm.FUSED``. ``batch(step)``: this
    rank's batch (the same on every rank by default, as tensor parallelism wants)."""
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    low = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    opt = _adamw(model)
    losses, scales = [], []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if form in ("step", "step_clip", "step_fused_clip"):
            at = {"step": 0}
            opt.register_step_pre_hook(lambda *_: _plant(model, rank, at["step"]))
            scaler = amp_fx.GradScaler("cpu", growth_interval=2, step_mode=amp_fx.StepMode.MASKED)
            step = amp_fx.compile_step(
                model,
                opt,
                lambda out, y: F.mse_loss(out.float(), y),
                dtype=dtype,
                scaler=scaler,
                backend="aot_eager",
                max_grad_norm=None if form == "step" else CLIP,
                grad_norm=amp_fx.GradNorm.FUSED if form == "step_fused_clip" else amp_fx.GradNorm.TORCH,
            )
            for i in range(STEPS):
                losses.append(step(*batch(i)).detach().clone())
                scales.append(
                    scaler.get_scale_tensor().clone()
                    if hasattr(scaler, "get_scale_tensor")
                    else torch.tensor(scaler.get_scale())
                )
                at["step"] = i + 1
        else:
            eager = form.startswith("eager")
            forward: Any = model if eager else amp_fx.compile(model, dtype=dtype, backend="aot_eager")
            scaler = (
                None
                if dtype == "bf16"
                else ShardedGradScaler("cpu", growth_interval=2)
                if eager
                else amp_fx.GradScaler("cpu", growth_interval=2)
            )
            for i in range(STEPS):
                x, y = batch(i)
                ctx = torch.autocast("cpu", dtype=low) if eager else contextlib.nullcontext()
                with ctx:
                    loss = F.mse_loss(forward(x).float(), y)
                (loss if scaler is None else scaler.scale(loss)).backward()
                if scaler is not None:
                    _plant(model, rank, i)
                if form == "eager_clip":
                    scaler.unscale_(opt)
                    _clip(model)
                step_and_zero(opt, scaler, scales)
                losses.append(loss.detach().clone())
    return {
        "losses": torch.stack(losses),
        "scales": torch.stack(scales) if scales else torch.zeros(0),
        "params": {n: _local(p) for n, p in model.named_parameters()},
        "amp_fx_warnings": _fallbacks(caught),
    }


def step_and_zero(opt: torch.optim.Optimizer, scaler: Any, scales: list[torch.Tensor]) -> None:
    """``opt.step()`` (no scaler: bf16), or the scaler's step and update with the new scale appended
    to ``scales``; then the gradients set to None. The training loops of these cases and of
    tests/integrations/_dist_titan_moe_cases.py end their steps so."""
    if scaler is None:
        opt.step()
    else:
        scaler.step(opt)
        scaler.update()
        scales.append(torch.tensor(scaler.get_scale()))
    opt.zero_grad(set_to_none=True)


def fp8_outputs(
    model: nn.Module, x: torch.Tensor, *, strict: bool | None = None, recipe: str = "tensorwise"
) -> dict[str, Any]:
    """One amp_fx fp8 (``recipe``) forward and backward: the output, the local gradients, and how many
    of the captured matmuls with a parameter operand were converted. ``strict=False``: what amp_fx
    reports is recorded as warnings (the suite runs strict)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled = amp_fx.compile(model, dtype="bf16", fp8=recipe, backend="aot_eager", strict=strict)
        out = compiled(x)
        out.float().pow(2).mean().backward()
    decisions = [
        n.meta[meta.FP8] for r in amp_fx.records(compiled) for n in r.rewritten.graph.nodes if meta.FP8 in n.meta
    ]
    return {
        "out": _local(out),
        "grads": {n: _local(p.grad) for n, p in model.named_parameters()},
        "converted": sum(d.converted for d in decisions),
        "kept": sorted(d.module for d in decisions if not d.converted),
        "considered": len(decisions),
        "amp_fx_warnings": _fallbacks(caught),
    }


# (layout, dtype, form). Layouts: "tp" (column/row-wise), "sp" (the same with sequence parallelism),
# "fsdp_tp" (FSDP2 x TP on a dp 1 x tp 2 mesh: 2-D DTensor parameters, FSDP2's units and TP's hooks
# together; a 2 x 2 mesh needs 4 ranks and proves nothing this does not), "hsdp" (fully_shard on a
# replicate 2 x shard 1 mesh). fp16 not on "tp": there the norms' parameters are plain tensors beside
# DTensors, and the reference's ShardedGradScaler (torch's unscale kernel on DTensors) refuses the mix
# ("got mixed torch.Tensor and DTensor").
CASES = [
    ("tp", "bf16", "eager"),
    ("tp", "bf16", "amp_fx"),
    ("sp", "bf16", "eager"),
    ("sp", "bf16", "amp_fx"),
    ("sp", "fp16", "eager"),
    ("sp", "fp16", "amp_fx"),
    ("sp", "fp16", "step"),
    ("fsdp_tp", "bf16", "eager"),
    ("fsdp_tp", "bf16", "amp_fx"),
    ("fsdp_tp", "fp16", "eager"),
    ("fsdp_tp", "fp16", "amp_fx"),
    ("fsdp_tp", "fp16", "step"),
    ("hsdp", "bf16", "eager"),
    ("hsdp", "bf16", "amp_fx"),
    ("hsdp", "fp16", "eager"),
    ("hsdp", "fp16", "amp_fx"),
    ("hsdp", "fp16", "step"),
    ("sp", "fp16", "eager_clip"),
    ("sp", "fp16", "step_clip"),
    ("fsdp_tp", "fp16", "eager_clip"),
    ("fsdp_tp", "fp16", "step_clip"),
    ("hsdp", "fp16", "eager_clip"),
    ("sp", "fp16", "step_fused_clip"),
    ("fsdp_tp", "fp16", "step_fused_clip"),
    ("hsdp", "fp16", "step_fused_clip"),
]


def sharded_model(layout: str, world_size: int, dp: int = 1, dp_backend: str | None = None) -> Transformer:
    """``make_model()`` laid out as ``layout`` (see CASES) over ``world_size`` ranks; "fsdp_tp" on a
    dp ``dp`` x tp ``world_size // dp`` mesh (its dp groups on ``dp_backend`` if given: the
    byte-counting one), "hsdp_tp" on a replicate ``dp`` x shard 1 x tp ``world_size // dp`` one
    (tests/distributed/_dist_tp4_cases.py runs both with dp 2)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = make_model()
    if layout in ("tp", "sp"):
        return tensor_parallel(model, init_device_mesh("cpu", (world_size,)), sequence_parallel=layout == "sp")
    if layout in ("fsdp_tp", "hsdp_tp"):
        shape, names = (
            ((dp, world_size // dp), ("dp", "tp"))
            if layout == "fsdp_tp"
            else ((dp, 1, world_size // dp), ("replicate", "shard", "tp"))
        )
        mesh = init_device_mesh(
            "cpu", shape, mesh_dim_names=names, backend_override={"dp": dp_backend} if dp_backend else None
        )
        tensor_parallel(model, mesh["tp"])
        dp_mesh = mesh["dp"] if layout == "fsdp_tp" else mesh["replicate", "shard"]
        for block in model.blocks:
            fully_shard(block, mesh=dp_mesh)
        return fully_shard(model, mesh=dp_mesh)
    mesh = init_device_mesh("cpu", (world_size, 1), mesh_dim_names=("replicate", "shard"))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    return fully_shard(model, mesh=mesh)


class _MLP(nn.Module):
    def __init__(self, bias: bool) -> None:
        super().__init__()
        self.w1, self.w2 = nn.Linear(D, 2 * D, bias=bias), nn.Linear(2 * D, D, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.relu(self.w1(x)))


def fp8_against_torchao(mesh: Any, rank: int) -> dict[str, Any] | None:
    """fp8 tensorwise, amp_fx on a TP MLP (Colwise w1, Rowwise w2) against torchao's
    ``Float8ColwiseParallel``/``Float8RowwiseParallel`` on its ``Float8Linear``s, same mesh and
    weights: "same" on bias-free linears fed a bf16-exact input, where both recipes scale the same
    values; "bias" with biases and an fp32 input, where torchao's TP styles scale the fp32 input
    (their hook runs before Float8Linear's autocast cast) and take the bias gradient from the fp8
    grad_output, so torchao's TP differs from torchao unsharded, and amp_fx's TP (whose column-wise
    layer is bitwise with unsharded fp8) is compared with torchao *unsharded* instead. None
    without torchao."""
    from amp_fx.testing.fp8_reference import cpu_autocast_torchao, torchao_float8, torchao_missing

    if torchao_missing() is not None:
        return None
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from torchao.float8.float8_tensor_parallel import Float8ColwiseParallel, Float8RowwiseParallel

    def run_torchao(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        with cpu_autocast_torchao(), torch.autocast("cpu", torch.bfloat16):
            out = model(x)
        out.float().pow(2).sum().backward()  # sum: the same loss on a shard and on the whole
        return _local(out), {n: _local(p.grad) for n, p in model.named_parameters()}

    def run_amp_fx(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        out = amp_fx.compile(model, dtype="bf16", fp8="tensorwise", backend="aot_eager")(x)
        out.float().pow(2).sum().backward()  # sum: the same loss on a shard and on the whole
        return _local(out), {n: _local(p.grad) for n, p in model.named_parameters()}

    results: dict[str, Any] = {}
    for kind, bias in (("same", False), ("bias", True)):
        torch.manual_seed(0)
        base = _MLP(bias)
        x = torch.randn(BATCH, SEQ, D, generator=torch.Generator().manual_seed(5))
        if not bias:
            x = x.bfloat16().float()
        ours = copy.deepcopy(base)
        parallelize_module(ours, mesh, {"w1": ColwiseParallel(), "w2": RowwiseParallel()})
        theirs = torchao_float8(copy.deepcopy(base), "tensorwise")
        if bias:  # the unsharded torchao run, the column-wise layer alone (its output sharded here)
            ours_w1 = copy.deepcopy(base.w1)
            parallelize_module(ours_w1, mesh, ColwiseParallel())
            results[kind] = {
                "amp_fx_w1": run_amp_fx(ours_w1, x),
                "torchao_w1": run_torchao(torchao_float8(copy.deepcopy(base.w1), "tensorwise"), x),
            }
            continue
        parallelize_module(theirs, mesh, {"w1": Float8ColwiseParallel(), "w2": Float8RowwiseParallel()})
        torch._dynamo.reset()
        results[kind] = {"amp_fx": run_amp_fx(ours, x), "torchao": run_torchao(theirs, x)}
    return results


def first_overflows(
    model: nn.Module, weight: torch.Tensor, loss: Callable[[Callable[..., Any]], torch.Tensor]
) -> dict[str, str | None]:
    """The non-finite watch against eager autocast, fp16: ``weight`` (this rank's shard) scaled by
    1e6, so that its module's fp16 output overflows; the first module whose output holds an inf
    under eager autocast (forward hooks, this rank's values) and the first op's module in the watch's
    overflow report after one amp_fx step. ``loss(forward)``: the loss of one forward."""
    with torch.no_grad():
        local_tensor(weight).mul_(1e6)
    first: list[str] = []
    handles = [
        m.register_forward_hook(
            lambda mod, args, out, name=name: (
                first.append(name)
                if not first and isinstance(out, torch.Tensor) and not bool(torch.isfinite(_local(out)).all())
                else None
            )
        )
        for name, m in model.named_modules()
        if name
    ]
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
        loss(model)
    for h in handles:
        h.remove()
    torch._dynamo.reset()
    compiled = amp_fx.compile(model, dtype="fp16", backend="aot_eager", watch_nonfinite=True)
    scaler = amp_fx.GradScaler("cpu")
    scaler.watch(compiled)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler.scale(loss(compiled)).backward()
    scaler.step(opt)
    scaler.update()
    report = scaler.overflow_report()
    torch._dynamo.reset()
    return {
        "eager_first": first[0] if first else None,
        "watch_first": None if report is None or report.first_op is None else report.first_op.module,
    }


def inspection(layout: str, world_size: int) -> dict[str, Any]:
    """The non-finite watch and compare on the sharded model. Watch (:func:`first_overflows`):
    ``blocks.1.mlp.w1``'s weight scaled; compare: :func:`compare_sharded`."""
    model = sharded_model(layout, world_size)
    x, _ = _batch(0)
    watched = first_overflows(model, model.blocks[1].mlp.w1.weight, lambda forward: forward(x).float().pow(2).mean())
    return watched | compare_sharded(layout, world_size)


def compare_sharded(layout: str, world_size: int) -> dict[str, Any]:
    """compare, amp_fx against eager autocast op by op, bf16, on a fresh sharded model after one
    forward and backward (gradients present), with its :func:`model_state` before and after (FSDP2
    x TP, HSDP: the model is lent to compare)."""
    model = sharded_model(layout, world_size)
    x, _ = _batch(0)
    model(x).float().pow(2).mean().backward()
    before = model_state(model)
    result = amp_fx.compare(model, x, dtype="bf16")
    return {
        "compare_ok": result.ok,
        "compare_exact": result.exact,
        "compared_ops": len(result.ops),
        "compared_grads": len(result.grads),
        "states": (before, model_state(model)),
    }


def _advise_loss(out: torch.Tensor) -> torch.Tensor:
    return out.float().pow(2).mean()


def _expected_cast_bytes(model: nn.Module) -> int:
    """The bytes one fp16 forward of ``model`` casts on this rank, counted from the model: each
    Linear's weight and bias (this rank's shard) cast once fp32 -> fp16, 6 bytes per element, and the
    norms' fp32 output cast before q, k, v and w1 of each block, whole ([BATCH, SEQ, D]: under
    sequence parallelism the attention and MLP gather their input first)."""
    params = sum(_local(p).numel() for m in model.modules() if isinstance(m, nn.Linear) for p in m.parameters())
    return 6 * (params + 4 * len(model.blocks) * BATCH * SEQ * D)


def explain_and_advise(world_size: int) -> dict[str, Any]:
    """``amp_fx.explain`` and ``amp_fx.advise`` (fp16) on the sequence-parallel model and on the
    unsharded one with the same weights: explain's rows (kind, op, module, dtype, rule, cast) of
    the ops both graphs run, each one's cast bytes and the count from the model
    (:func:`_expected_cast_bytes`); advise's policy, error, cost and findings."""
    x, _ = _batch(0)
    out: dict[str, Any] = {}
    for name in ("sp", "whole"):
        model = sharded_model("sp", world_size) if name == "sp" else make_model()
        torch._dynamo.reset()
        explained = amp_fx.explain(model, x, dtype="fp16")
        advice = amp_fx.advise(model, x, dtype="fp16", loss_fn=_advise_loss)
        out[name] = {
            "rows": [(n.kind, n.op, n.module, n.dtype_name, n.rule, n.cast) for n in explained.nodes()],
            "graphs": len(explained.records),
            "cast_bytes": explained.cast_bytes(0),
            "expected_cast_bytes": _expected_cast_bytes(model),
            "keep_fp32": advice.keep_fp32,
            "verified": advice.verified,
            "error": advice.error,
            "cost": advice.cost,
            "findings": {m.name: m.finding for m in advice.modules},
        }
    return out


def inductor_errors(world_size: int) -> dict[str, Any]:
    """The TP model's loss and gradients under inductor, bf16: eager autocast, ``torch.compile`` under
    autocast and ``amp_fx.compile``, one forward and backward each; their differences from eager."""
    runs: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    x, y = _batch(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for form in ("eager", "torch.compile", "amp_fx"):
            torch._dynamo.reset()
            model = sharded_model("tp", world_size)
            if form == "amp_fx":
                out = amp_fx.compile(model, dtype="bf16")(x)
            else:
                run = model if form == "eager" else torch.compile(model)
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    out = run(x)
            loss = F.mse_loss(out.float(), y)
            loss.backward()
            runs[form] = (loss.detach(), torch.cat([_local(p.grad).flatten() for p in model.parameters()]))
    eager_loss, eager_grads = runs["eager"]
    return {
        form: {"loss": (loss - eager_loss).abs().item(), "grads": (grads - eager_grads).abs().max().item()}
        for form, (loss, grads) in runs.items()
        if form != "eager"
    } | {"amp_fx_warnings": _fallbacks(caught)}


def fp8_sequence_parallel(world_size: int) -> dict[str, Any]:
    """fp8 tensorwise on the sequence-parallel model, one forward and backward per form, with the
    bytes each rank hands to functional collectives (DTensor's, inside the compiled graphs): "bf16"
    (no fp8), "fp8" (amp_fx as it is: the norms' outputs cast to e4m3 on each rank's shard, then
    gathered), "fp8_gather_hp" (the same with the pass's fp8 gather switched off: the activation
    gathered in its own dtype and cast after, as before), "fp8_keep_v" (``blocks.0.attn.v`` kept
    out of fp8: its bf16 matmul reads block 0's gathered input too, so that gather stays in fp32,
    strict=False to record the report, as for "fp8_gather_hp"). The backend is ``aot_eager`` counting the bytes the
    compiled graphs hand to functional collectives (``collective_counting_backend``)."""
    from unittest import mock

    from torch.distributed.device_mesh import init_device_mesh

    from amp_fx.kernels.fp8_activation_gather import fp8_gather_input
    from amp_fx.passes import fp8_matmuls
    from amp_fx.testing.memory import collective_counting_backend

    mesh = init_device_mesh("cpu", (world_size,))
    x, _ = _batch(0)
    out: dict[str, Any] = {}
    for form in ("bf16", "fp8", "fp8_gather_hp", "fp8_keep_v"):
        torch._dynamo.reset()
        model = tensor_parallel(make_model(), mesh, sequence_parallel=True)
        policy = amp_fx.Policy(keep_out_of_fp8=["blocks.0.attn.v"]) if form == "fp8_keep_v" else None
        hp = (
            mock.patch.object(fp8_matmuls._Fp8Rewriter, "gather_in_fp8", lambda self: set())
            if form == "fp8_gather_hp"
            else contextlib.nullcontext()
        )
        sent: Counter[str] = Counter()
        with warnings.catch_warnings(record=True) as caught, hp:
            warnings.simplefilter("always")
            compiled = amp_fx.compile(
                model,
                dtype="bf16",
                fp8=None if form == "bf16" else "tensorwise",
                policy=policy,
                backend=collective_counting_backend(sent),
                strict=form in ("bf16", "fp8"),
            )
            y = compiled(x)
            y.float().pow(2).mean().backward()
        graphs = [r.rewritten.graph for r in amp_fx.records(compiled)]
        out[form] = {
            "out": _local(y),
            "grads": {n: _local(p.grad) for n, p in model.named_parameters()},
            "all_gather": sent["all_gather"],
            "fp8_gathers": sum(n.target is fp8_gather_input for g in graphs for n in g.nodes),
            "amp_fx_warnings": _fallbacks(caught),
        }
    return out


def tp_all(rank: int, world_size: int) -> dict[Any, Any]:
    """Every case of tests/distributed/test_distributed_tp.py in one spawn (torch._dynamo.reset() between them)."""
    from torch.distributed.device_mesh import init_device_mesh

    results: dict[Any, Any] = {}
    for case in CASES:
        layout, dtype, form = case
        torch._dynamo.reset()
        results[case] = train(sharded_model(layout, world_size), rank, dtype, form)
    torch._dynamo.reset()
    x, _ = _batch(0)
    results["fp8_tp"] = fp8_outputs(tensor_parallel(make_model(), init_device_mesh("cpu", (world_size,))), x)
    torch._dynamo.reset()
    results["fp8_whole"] = fp8_outputs(make_model(), x)
    torch._dynamo.reset()
    results["fp8_tp_rowwise"] = (
        None
        if rowwise_scales_missing("cpu") is not None
        else fp8_outputs(
            tensor_parallel(make_model(), init_device_mesh("cpu", (world_size,))), x, strict=False, recipe="rowwise"
        )
    )
    torch._dynamo.reset()
    results["fp8_fsdp_tp"] = fp8_outputs(sharded_model("fsdp_tp", world_size), x, strict=False)
    torch._dynamo.reset()
    results["inspect_sp"] = inspection("sp", world_size)
    results["explain_advise_sp"] = explain_and_advise(world_size)
    torch._dynamo.reset()
    results["inspect_fsdp_tp"] = inspection("fsdp_tp", world_size)
    torch._dynamo.reset()
    results["compare_hsdp"] = compare_sharded("hsdp", world_size)
    results["inductor"] = inductor_errors(world_size)
    torch._dynamo.reset()
    results["fp8_torchao"] = fp8_against_torchao(init_device_mesh("cpu", (world_size,)), rank)
    results["fp8_sp"] = fp8_sequence_parallel(world_size)
    from amp_fx.testing.fp8_reference import torchao_missing

    for schedule, dtype, form in PP_CASES:
        if dtype == "fp8" and torchao_missing() is not None:
            continue  # the reference is torchao's; the test skips
        torch._dynamo.reset()
        results[("pp", schedule, dtype, form)] = pipeline_run(rank, world_size, schedule, dtype, form)
    return results


# ------------------------------------------------------------------------------------ pipeline
PP_MICROBATCHES = 2


class _Stage(nn.Module):
    """One pipeline stage: the block of the unsplit model at this rank's index (a user-defined
    module, so Dynamo starts a frame in it)."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(x)


def pipeline_run(rank: int, world_size: int, schedule: str, dtype: str, form: str) -> dict[str, Any]:
    """Stage ``rank`` of a ``world_size``-stage pipeline (``torch.distributed.pipelining``, GPipe or
    1F1B, 2 micro-batches), 3 AdamW steps. fp16: an inf planted in stage 0's gradient at step 1;
    ``form``: "eager" (torch.autocast around the schedule's step, torch.amp.GradScaler driven by hand:
    unscale_, its found-inf all-reduced (MAX) over every stage, step, update) or "amp_fx"
    (``amp_fx.compile`` of the stage, ``amp_fx.GradScaler(process_group=WORLD)``). bf16: no scaler,
    nothing planted. "fp8": bf16 with fp8 tensorwise on every Linear of the stage, "eager" torchao's
    ``Float8Linear`` under eager autocast (``cpu_autocast_torchao``), "amp_fx" ``fp8="tensorwise"``;
    the run also counts the stage's matmuls amp_fx converted (``fp8_converted``)."""
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    fp8 = dtype == "fp8"
    stage_module: nn.Module = _Stage(make_model().blocks[rank])
    if fp8 and form == "eager":
        from amp_fx.testing.fp8_reference import torchao_float8

        stage_module = torchao_float8(stage_module, "tensorwise")
    opt = _adamw(stage_module)
    low = torch.float16 if dtype == "fp16" else torch.bfloat16
    scaler: Any = None
    if form == "eager":
        scaler = torch.amp.GradScaler("cpu", growth_interval=2) if dtype == "fp16" else None
        run_module: nn.Module = stage_module
    else:
        if dtype == "fp16":
            scaler = amp_fx.GradScaler("cpu", growth_interval=2, process_group=dist.group.WORLD)
        run_module = amp_fx.compile(
            stage_module, dtype="bf16" if fp8 else dtype, fp8="tensorwise" if fp8 else None, backend="aot_eager"
        )
    stage = PipelineStage(run_module, rank, world_size, torch.device("cpu"))
    kind = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule]

    def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = F.mse_loss(out.float(), y)
        return loss if scaler is None else scaler.scale(loss)

    pipe = kind(stage, PP_MICROBATCHES, loss_fn=loss_fn)
    losses, scales = [], []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(STEPS):
            x, y = _batch(i)
            step_losses: list[torch.Tensor] = []
            ctx = contextlib.ExitStack()
            if form == "eager":
                if fp8:
                    from amp_fx.testing.fp8_reference import cpu_autocast_torchao

                    ctx.enter_context(cpu_autocast_torchao())
                ctx.enter_context(torch.autocast("cpu", dtype=low))
            with ctx:
                if rank == 0:
                    pipe.step(x)
                else:
                    pipe.step(target=y, losses=step_losses)
            if scaler is None:
                opt.step()
                opt.zero_grad(set_to_none=True)
            else:
                _pipeline_scaled_step(scaler, opt, stage_module, rank, i, eager=form == "eager")
                scales.append(torch.tensor(scaler.get_scale()))
            if step_losses:
                losses.append(torch.stack([loss.detach() for loss in step_losses]))
    return {
        "losses": torch.stack(losses) if losses else torch.zeros(0),
        "scales": torch.stack(scales) if scales else torch.zeros(0),
        "params": {n: p.detach().clone() for n, p in stage_module.named_parameters()},
        "amp_fx_warnings": _fallbacks(caught),
        "fp8_converted": sum(
            d.converted for r in amp_fx.records(run_module) if r.fp8 is not None for d in r.fp8.decisions
        )
        if form == "amp_fx"
        else 0,
    }


def _pipeline_scaled_step(
    scaler: Any, opt: torch.optim.Optimizer, stage_module: nn.Module, rank: int, step: int, *, eager: bool
) -> None:
    """The fp16 step of one stage: the inf planted in stage 0's gradient at ``PLANTED_STEP``; the
    eager reference combines torch's found-inf flag over every stage by hand."""
    import torch.distributed as dist

    if rank == 0 and step == PLANTED_STEP:
        with torch.no_grad():
            stage_module.block.attn.q.weight.grad.view(-1)[0] = math.inf
    if eager:  # the flag combined over every stage by hand
        if rank == 0:  # torch's scaler makes its scale in scale(), which only the loss's stage calls
            scaler.scale(torch.zeros(()))
        scaler.unscale_(opt)
        for found in scaler._per_optimizer_states[id(opt)]["found_inf_per_device"].values():
            dist.all_reduce(found, op=dist.ReduceOp.MAX)
    scaler.step(opt)
    scaler.update()
    opt.zero_grad(set_to_none=True)


# (schedule, dtype, form); bf16 on GPipe alone: 1F1B differs in the order of the micro-batches'
# backward, not in what autocast casts
PP_CASES = [(schedule, "fp16", form) for schedule in ("gpipe", "1f1b") for form in ("eager", "amp_fx")] + [
    ("gpipe", dtype, form) for dtype in ("bf16", "fp8") for form in ("eager", "amp_fx")
]
