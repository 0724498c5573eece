"""What each of 4 gloo ranks runs for tests/distributed/test_distributed_tp4.py: FSDP2 x TP on a dp 2 x tp 2 mesh.

The model, the parallel plan and the recipe are tests/distributed/_dist_tp_cases.py's (its 2-rank spawn runs
FSDP2 x TP on a dp 1 x tp 2 mesh, where FSDP2 shards nothing); here both dimensions shard: TP as
in ``tensor_parallel`` on ``mesh["tp"]``, ``fully_shard`` per block and on the root over
``mesh["dp"]``, and each data-parallel rank trains on its own batch (the two TP ranks of one dp
rank share it), so FSDP2's reduce-scatter averages two different gradients. HSDP x TP
(replicate 2 x shard 1 x tp 2) runs the same recipe once in fp16; HSDP without TP (replicate 2 x
shard 2) runs fp8 tensorwise once (``fp8_hsdp_2x2``).
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import amp_fx
from amp_fx.testing.fp8_reference import cpu_autocast_torchao, torchao_float8, torchao_missing
from amp_fx.testing.memory import COUNTING_BACKEND, sent_bytes
from tests.distributed._dist_tp_cases import (
    _MLP,
    BATCH,
    SEQ,
    D,
    _batch,
    _local,
    make_model,
    sharded_model,
    tensor_parallel,
    train,
)

WORLD = 4
DP = 2

# (layout, dtype, form), as in _dist_tp_cases.CASES
CASES = [
    ("fsdp_tp", "bf16", "eager"),
    ("fsdp_tp", "bf16", "amp_fx"),
    ("fsdp_tp", "fp16", "eager"),
    ("fsdp_tp", "fp16", "amp_fx"),
    ("fsdp_tp", "fp16", "eager_clip"),
    ("fsdp_tp", "fp16", "step_clip"),
    ("fsdp_tp", "fp16", "step_fused_clip"),
    ("hsdp_tp", "fp16", "eager"),
    ("hsdp_tp", "fp16", "amp_fx"),
]


def dp_rank(rank: int) -> int:
    """The rank's index on the dp dimension (init_device_mesh lays ranks out row-major)."""
    return rank // (WORLD // DP)


def _mesh(world_size: int) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(
        "cpu", (DP, world_size // DP), mesh_dim_names=("dp", "tp"), backend_override={"dp": COUNTING_BACKEND}
    )


def _fp8_run(model: nn.Module, x: torch.Tensor, form: str, strict: bool | None = None) -> dict[str, Any]:
    """One forward and backward (``sum(out ** 2)``: the same loss on a shard and on the whole) of
    ``model`` as ``form`` runs it: its output, local gradients, all-gathered bytes and AmpFxWarnings."""
    with warnings.catch_warnings(record=True) as caught, sent_bytes() as sent:
        warnings.simplefilter("always")
        if form == "torchao":
            with cpu_autocast_torchao(), torch.autocast("cpu", torch.bfloat16):
                out = model(x)
        else:
            dtype, fp8 = ("bf16", None) if form == "bf16" else ("bf16", "tensorwise")
            out = amp_fx.compile(model, dtype=dtype, fp8=fp8, backend="aot_eager", strict=strict)(x)
        out.float().pow(2).sum().backward()
    return {
        "out": _local(out),
        "grads": {n: _local(p.grad) for n, p in model.named_parameters()},
        "all_gather": sent["all_gather"],
        "amp_fx_warnings": [str(w.message) for w in caught if issubclass(w.category, amp_fx.AmpFxWarning)],
        **_numels(model),
    }


def _fp8_forms(
    bias: bool, forms: tuple[str, ...], shard: Callable[[nn.Module, str], nn.Module], strict: bool | None = None
) -> dict[str, Any]:
    """``_fp8_run`` of each form of one ``_MLP(bias)`` (seeded) fed a bf16-exact input, the same on
    every rank, laid out by ``shard(model, form)``; "torchao" (skipped without torchao) on its
    ``Float8Linear``s with ``enable_fsdp_float8_all_gather``, then
    ``precompute_float8_dynamic_scale_for_fsdp``."""
    torch.manual_seed(0)
    base = _MLP(bias=bias)
    x = torch.randn(BATCH, SEQ, D, generator=torch.Generator().manual_seed(5)).bfloat16().float()
    results: dict[str, Any] = {}
    for form in forms:
        torch._dynamo.reset()
        model = copy.deepcopy(base)
        if form == "torchao":
            if torchao_missing() is not None:
                continue
            model = torchao_float8(model, "tensorwise", fsdp_float8_all_gather=True)
        model = shard(model, form)
        if form == "torchao":
            from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

            precompute_float8_dynamic_scale_for_fsdp(model)
        results[form] = _fp8_run(model, x, form, strict=strict)
    return results


def _numels(model: nn.Module) -> dict[str, int]:
    """This rank's elements of the ``nn.Linear`` weights (what FSDP2 gathers in fp8) and of all parameters."""
    linears = {n for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    local = {n: _local(p).numel() for n, p in model.named_parameters()}
    weights = [k for n, k in local.items() if n.rpartition(".")[0] in linears and n.endswith(".weight")]
    return {"weight_numel": sum(weights), "numel": sum(local.values())}


def fp8_gather_2x2(world_size: int) -> dict[str, Any]:
    """fp8 tensorwise on a bias-free TP MLP (Colwise ``w1``, Rowwise ``w2``) under FSDP2 over dp,
    dp 2 x tp 2, fed a bf16-exact input (the same on every rank: FSDP2's dp average of two equal
    gradients is exact). Forms: "amp_fx" (FSDP2 gathers each weight's dp shard in fp8), "tp"
    (the same model on the tp mesh alone: no FSDP2, no gather, amp_fx's fp8 cast of the TP
    shard), "torchao" (``Float8Linear`` with ``enable_fsdp_float8_all_gather``,
    ``Float8ColwiseParallel``/``Float8RowwiseParallel``, ``precompute_float8_dynamic_scale_for_fsdp``),
    "bf16" (amp_fx bf16 under FSDP2 x TP: the fp32 gather the fp8 one replaces)."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = _mesh(world_size)
    torch.manual_seed(0)
    plain = {"w1": ColwiseParallel(), "w2": RowwiseParallel()}

    def shard(model: nn.Module, form: str) -> nn.Module:
        styles: dict[str, Any] = plain
        if form == "torchao":
            from torchao.float8.float8_tensor_parallel import Float8ColwiseParallel, Float8RowwiseParallel

            styles = {"w1": Float8ColwiseParallel(), "w2": Float8RowwiseParallel()}
        parallelize_module(model, mesh["tp"], styles, src_data_rank=None)
        if form != "tp":
            fully_shard(model, mesh=mesh["dp"])
        return model

    return _fp8_forms(True, ("amp_fx", "tp", "bf16", "torchao"), shard)


def hsdp_shard_rank(rank: int) -> int:
    """The rank's index on the shard dimension of the replicate 2 x shard 2 mesh (row-major)."""
    return rank % (WORLD // DP)


def fp8_hsdp_2x2(world_size: int) -> dict[str, Any]:
    """fp8 tensorwise on the bias-free ``_MLP`` (no TP) under HSDP, replicate 2 x shard 2
    (``fully_shard`` on the 2-D mesh; its shard groups on the byte-counting backend, where FSDP2
    all-gathers), fed a bf16-exact input, the same on every rank (FSDP2's average of equal
    gradients over both dimensions is exact). Forms: "amp_fx" (FSDP2 gathers each weight's shard
    in fp8), "plain" (the same model without FSDP2: amp_fx's fp8 cast of the whole weight),
    "torchao" (``Float8Linear`` with ``enable_fsdp_float8_all_gather`` and
    ``precompute_float8_dynamic_scale_for_fsdp`` on the same mesh), "bf16" (amp_fx bf16 under
    HSDP: the fp32 gather). amp_fx's forms run with ``strict=True``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(
        "cpu",
        (DP, world_size // DP),
        mesh_dim_names=("replicate", "shard"),
        backend_override={"shard": COUNTING_BACKEND},
    )

    def shard(model: nn.Module, form: str) -> nn.Module:
        return model if form == "plain" else fully_shard(model, mesh=mesh)

    return _fp8_forms(False, ("amp_fx", "plain", "bf16", "torchao"), shard, strict=True)


FP8_STEPS = 2  # the second step's all-gathers write into the first one's storage (FSDP2's ``out=``)


def fp8_transformer_2x2(world_size: int) -> dict[str, Any]:
    """fp8 tensorwise on the transformer: "gathered" under FSDP2 x TP (dp 2 x tp 2; FSDP2 gathers
    every Linear weight's dp shard in fp8) and "tp" on the tp mesh alone (no FSDP2: the fp8 matmul
    casts the TP shard itself), ``FP8_STEPS`` SGD steps on one batch for every rank (FSDP2's dp
    average of two equal gradients is exact): the losses, this rank's parameters, how many matmuls
    ran in fp8, the AmpFxWarnings and the bytes all-gathered."""
    results: dict[str, Any] = {}
    for form in ("gathered", "tp"):
        torch._dynamo.reset()
        model = (
            sharded_model("fsdp_tp", world_size, dp=DP, dp_backend=COUNTING_BACKEND)
            if form == "gathered"
            else tensor_parallel(make_model(), _mesh(world_size)["tp"])
        )
        opt = torch.optim.SGD(model.parameters(), lr=0.1, foreach=False)
        with warnings.catch_warnings(record=True) as caught, sent_bytes() as sent:
            warnings.simplefilter("always")
            compiled = amp_fx.compile(model, dtype="bf16", fp8="tensorwise", backend="aot_eager", strict=False)
            losses = []
            for step in range(FP8_STEPS):
                loss = compiled(_batch(step)[0]).float().pow(2).mean()
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                losses.append(loss.detach())
        decisions = [d for r in amp_fx.records(compiled) if r.fp8 is not None for d in r.fp8.decisions]
        results[form] = {
            "losses": torch.stack(losses),
            "params": {n: _local(p) for n, p in model.named_parameters()},
            "converted": sum(d.converted for d in decisions),
            "considered": len(decisions),
            "amp_fx_warnings": [str(w.message) for w in caught if issubclass(w.category, amp_fx.AmpFxWarning)],
            "all_gather": sent["all_gather"],
            **_numels(model),
        }
    return results


def tp4_all(rank: int, world_size: int) -> dict[Any, Any]:
    """Every case of tests/distributed/test_distributed_tp4.py in one spawn (torch._dynamo.reset() between them)."""
    assert world_size == WORLD, world_size

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        return _batch(step + 100 * dp_rank(rank))

    results: dict[Any, Any] = {}
    for case in CASES:
        layout, dtype, form = case
        torch._dynamo.reset()
        results[case] = train(sharded_model(layout, world_size, dp=DP), rank, dtype, form, batch)
    results["fp8_gather"] = fp8_gather_2x2(world_size)
    results["fp8_transformer"] = fp8_transformer_2x2(world_size)
    results["fp8_hsdp"] = fp8_hsdp_2x2(world_size)
    return results
