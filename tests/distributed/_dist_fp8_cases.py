"""What each gloo rank runs for tests/distributed/test_distributed_fp8.py (spawned processes import this).

fp8 training on 2 ranks, against the eager reference torchao gives: torchao's
``convert_to_float8_training`` under ``torch.autocast("cpu", bf16)`` (its autocast branch pointed
at the CPU's state: ``amp_fx.testing.fp8_reference.cpu_autocast_torchao``), wrapped as the amp_fx
run is (DDP, FSDP2). bf16, no loss scaling; SGD with momentum; each rank its own batch.

FSDP2's fp8 all-gather: torchao's reference with ``enable_fsdp_float8_all_gather=True`` and
``precompute_float8_dynamic_scale_for_fsdp`` after each step ("torchao_ag"); amp_fx gathers the
converted weights in fp8 on its own. Every run counts the bytes each rank hands to each collective
(the ``amp_fx_counting`` gloo backend), and "bf16" (``amp_fx.compile`` of the sharded model, no
fp8) gives the bf16 all-gather the fp8 one is compared with.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import amp_fx
from amp_fx.testing.fp8_reference import cpu_autocast_torchao, torchao_float8
from amp_fx.testing.memory import sent_bytes

STEPS = 4


def make_model() -> nn.Module:
    """Every dimension a multiple of 16 (``_scaled_mm``'s rule, which amp_fx applies on CPU too)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32))


class ReadsWeight(nn.Module):
    """A Linear whose weight the model also reads outside the matmul (an fp8 all-gather's misuse)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.lin.weight.abs().amax()


def reads_weight(rank: int) -> dict[str, Any]:
    """``ReadsWeight`` sharded, fp8: what amp_fx reports after the first call."""
    from torch.distributed.fsdp import fully_shard

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = fully_shard(ReadsWeight())
    compiled = amp_fx.compile(model, dtype="bf16", fp8="tensorwise", backend="aot_eager", strict=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", amp_fx.AmpFxWarning)
        compiled(_batch(rank, 0)[0]).float().sum().backward()
    return {
        "warnings": [str(w.message) for w in caught if issubclass(w.category, amp_fx.AmpFxWarning)],
        "reads": [r for rec in amp_fx.records(compiled) if rec.fp8 for r in rec.fp8.fp8_weight_reads],
    }


class RootReadsHead(nn.Module):
    """A root that reads its own Linear's weight in its eager frame (the loop over the sharded
    block makes Dynamo skip the frame): that read sees the fp8 weight."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(32, 32)])
        self.head = nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x) * self.head.weight.abs().amax()


def root_reads_head(rank: int) -> list[str]:
    """``RootReadsHead`` sharded (the block, then the root), fp8: the AmpFxWarnings of one step."""
    from torch.distributed.fsdp import fully_shard

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = RootReadsHead()
    fully_shard(model.blocks[0])
    compiled = amp_fx.compile(fully_shard(model), dtype="bf16", fp8="tensorwise", backend="aot_eager", strict=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", amp_fx.AmpFxWarning)
        compiled(_batch(rank, 0)[0]).float().sum().backward()
    return [str(w.message) for w in caught if issubclass(w.category, amp_fx.AmpFxWarning)]


def shared_weight(rank: int) -> list[str]:
    """Two Linears sharing one weight, sharded, fp8: the AmpFxWarnings ``amp_fx.compile`` gives
    (FSDP2 gathers a shared weight in fp32: each module's use would need its own cast)."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32))
    model[1].weight = model[0].weight
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", amp_fx.AmpFxWarning)
        amp_fx.compile(fully_shard(model), dtype="bf16", fp8="tensorwise", backend="aot_eager", strict=False)
    return [str(w.message) for w in caught if issubclass(w.category, amp_fx.AmpFxWarning)]


def _shortfalls(caught: list[warnings.WarningMessage]) -> list[str]:
    """The AmpFxWarnings (amp_fx did less than asked); not the notice that fp8 runs slower than
    bf16 without fp8 tensor cores, which every CPU run of fp8 gives once."""
    return [str(w.message) for w in caught if issubclass(w.category, amp_fx.AmpFxWarning)]


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(16, 32, generator=g), torch.randn(16, 32, generator=g)


def _local(t: torch.Tensor) -> torch.Tensor:
    return (t.to_local() if hasattr(t, "to_local") else t).detach().clone()


def _train(model: nn.Module, forward: Any, rank: int, reference: bool, precompute: bool = False) -> dict[str, Any]:
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses = []
    with sent_bytes() as sent:
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
            if precompute:  # torchao's recipe for its fp8 all-gather: the scales after each step
                from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

                precompute_float8_dynamic_scale_for_fsdp(model)
            losses.append(loss.detach().clone())
    return {"losses": torch.stack(losses), "params": [_local(p) for p in model.parameters()], "sent": _per_step(sent)}


def _per_step(sent: Any) -> dict[str, float]:
    return {kind: n / STEPS for kind, n in sent.items()}


def _converted(compiled: Any) -> int:
    return sum(d.converted for r in amp_fx.records(compiled) if r.fp8 is not None for d in r.fp8.decisions)


def _shard(model: nn.Module) -> nn.Module:
    """FSDP2: the first Linear a unit of its own, then the root, which owns the second Linear
    (as a Llama's root owns its ``lm_head``): ``nn.Sequential``'s loop breaks its graph at the
    sharded unit, so Dynamo skips the root's frame and the second Linear runs outside any graph
    of the root's (amp_fx compiles it as a unit of its own)."""
    from torch.distributed.fsdp import fully_shard

    fully_shard(model[0])
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
    if form in ("torchao", "torchao_ag"):
        model = torchao_float8(model, recipe, fsdp_float8_all_gather=form == "torchao_ag")
        wrapped = DDP(model) if wrapper == "ddp" else _shard(model)
        if form == "torchao_ag":
            from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

            precompute_float8_dynamic_scale_for_fsdp(model)
        return _train(model, wrapped, rank, reference=True, precompute=form == "torchao_ag")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", amp_fx.AmpFxWarning)
        if form == "step":
            inner = DDP(model) if wrapper == "ddp" else _shard(model)
            opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
            step = amp_fx.compile_step(
                inner,
                opt,
                lambda out, y: F.mse_loss(out.float(), y),
                dtype="bf16",
                fp8=recipe,
                backend="aot_eager",
                strict=False,
            )
            with sent_bytes() as sent:
                losses = [step(*_batch(rank, i)).detach().clone() for i in range(STEPS)]
            return {
                "losses": torch.stack(losses),
                "params": [_local(p) for p in model.parameters()],
                "converted": _converted(step._forward),
                "warnings": _shortfalls(caught),
                "sent": _per_step(sent),
            }
        if form == "bf16":  # no fp8: the bytes the fp8 all-gather is compared with
            compiled = amp_fx.compile(_shard(model), dtype="bf16", backend="aot_eager", strict=False)
            return _train(model, compiled, rank, reference=False)
        if form in ("outer_keep", "map_keep"):  # the second Linear kept out of fp8: gathered in fp32
            by_map = form == "map_keep"  # by the per-module low-precision map instead of the policy
            compiled = amp_fx.compile(
                _shard(model),
                dtype="bf16",
                low_precision=amp_fx.LowPrecision(recipe=recipe, modules={"2": None}) if by_map else recipe,
                backend="aot_eager",
                strict=False,
                policy=None if by_map else amp_fx.Policy(keep_out_of_fp8=["2"]),
            )
            out = _train(model, compiled, rank, reference=False)
            return {**out, "converted": _converted(compiled), "warnings": _shortfalls(caught)}
        if wrapper == "ddp" and form in ("inner", "inner_cached"):
            compiled = amp_fx.compile(
                model, dtype="bf16", fp8=recipe, backend="aot_eager", strict=False, weight_cache=form == "inner_cached"
            )
            wrapped = DDP(compiled)
        else:
            inner = DDP(model) if wrapper == "ddp" else _shard(model)
            wrapped = compiled = amp_fx.compile(inner, dtype="bf16", fp8=recipe, backend="aot_eager", strict=False)
        out = _train(model, wrapped, rank, reference=False)
    out["converted"] = _converted(compiled)
    out["warnings"] = _shortfalls(caught)
    return out


def _plain_local(state: dict[str, Any]) -> list[str]:
    """The entries of a sharded state dict that are not a DTensor over a plain local tensor with
    no attributes of its own (the fp8 all-gather's extension lives on the parameter's local
    tensor: it must not travel into a checkpoint)."""
    bad = []
    for key, value in state.items():
        local = value.to_local() if hasattr(value, "to_local") else value
        if not isinstance(value, torch.Tensor) or type(local) is not torch.Tensor or getattr(local, "__dict__", None):
            bad.append(f"{key}: {type(value).__name__} over {type(local).__name__} {sorted(vars(local))}")
    return bad


def dcp_resume(rank: int) -> dict[str, Any]:
    """FSDP2 with the fp8 all-gather (``amp_fx.compile`` of the sharded model), AdamW: the model
    and optimizer state after two steps saved with ``torch.distributed.checkpoint``, then the third
    step; a fresh sharded model loads the checkpoint and takes the third step (counting the bytes it
    all-gathers: still fp8). Also ``torch.save`` of the rank's ``model.state_dict()`` (DTensors)
    loaded with ``weights_only=True``."""
    import io
    import shutil
    import tempfile

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    def build() -> tuple[nn.Module, Any, torch.optim.Optimizer]:
        torch._dynamo.reset()
        model = _shard(make_model())
        compiled = amp_fx.compile(model, dtype="bf16", fp8="tensorwise", backend="aot_eager", strict=False)
        return model, compiled, torch.optim.AdamW(model.parameters(), lr=1e-2)

    def step(compiled: Any, opt: torch.optim.Optimizer, i: int) -> dict[str, Any]:
        loss = F.mse_loss(compiled(_batch(rank, i)[0]).float(), _batch(rank, i)[1])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return {
            "loss": loss.detach(),
            "params": [_local(p) for p in opt.param_groups[0]["params"]],
            "opt": [{k: _local(v) for k, v in s.items()} for s in opt.state.values()],
        }

    where = [tempfile.mkdtemp(prefix="amp_fx_dcp_") if rank == 0 else None]
    dist.broadcast_object_list(where)  # one checkpoint directory, rank 0's
    plain = dist.new_group(backend="gloo")  # DCP's planning gathers objects: the counting backend has no gather
    model, compiled, opt = build()
    for i in range(2):
        step(compiled, opt, i)
    model_state, optim_state = get_state_dict(model, opt)
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    buffer.seek(0)
    torch.load(buffer, weights_only=True)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=where[0], process_group=plain)
    out = {"leaks": _plain_local(model_state) + _plain_local(model.state_dict()), "continued": step(compiled, opt, 2)}
    model, compiled, opt = build()
    model_state, optim_state = get_state_dict(model, opt)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=where[0], process_group=plain)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    with sent_bytes() as sent:
        out["resumed"] = step(compiled, opt, 2)
    out["all_gather"] = sent["all_gather"]
    dist.barrier(group=plain)
    if rank == 0:
        shutil.rmtree(where[0])
    return out


CASES = [
    ("ddp", "inner"),
    ("ddp", "inner_cached"),
    ("ddp", "outer"),
    ("ddp", "step"),
    ("fsdp2", "outer"),
    ("fsdp2", "step"),
]
# The recipe changes the fp8 matmul's scales, not how DDP or FSDP2 wrap, capture and step it: every
# form runs tensorwise (the recipe torchao's fp8 all-gather takes), rowwise once per wrapper.
ROWWISE_CASES = [("ddp", "outer"), ("fsdp2", "outer")]


def run_all(rank: int, world_size: int, recipes: list[str]) -> dict[Any, Any]:
    results: dict[Any, Any] = {}
    for recipe in recipes:
        for wrapper in ("ddp", "fsdp2"):
            results[wrapper, "torchao", recipe] = run(rank, world_size, wrapper, "torchao", recipe)
        if recipe == "tensorwise":  # torchao's fp8 all-gather takes tensorwise weights only
            results["fsdp2", "torchao_ag", recipe] = run(rank, world_size, "fsdp2", "torchao_ag", recipe)
        for wrapper, form in CASES if recipe == "tensorwise" else ROWWISE_CASES:
            results[wrapper, form, recipe] = run(rank, world_size, wrapper, form, recipe)
    results["fsdp2", "bf16", None] = run(rank, world_size, "fsdp2", "bf16", "")
    results["fsdp2", "outer_keep", "tensorwise"] = run(rank, world_size, "fsdp2", "outer_keep", "tensorwise")
    results["fsdp2", "map_keep", "tensorwise"] = run(rank, world_size, "fsdp2", "map_keep", "tensorwise")
    results["reads_weight"] = reads_weight(rank)
    results["shared_weight"] = shared_weight(rank)
    results["root_reads_head"] = root_reads_head(rank)
    results["dcp_resume"] = dcp_resume(rank)
    return results
