"""A small fp16 model with an overflow planted in one named module at one known step (issue 21),
shared by tests/overflow/test_overflow.py and its DDP case (run in gloo ranks).

``layers.1.mlp.down_proj`` multiplies its fp32 weight by a buffer ``gain`` before the layer: 1.0
(exact, the layer is a plain Linear) except at the planted step, where it is 1e6 and the weight's
fp16 cast (|w| * 1e6 > 65504) and the layer's output hold inf. Nothing else overflows there. The
loss adds an auxiliary head on the input (``aux``), whose gradients stay finite when the main loss
is inf: the non-finite gradients are a strict subset of the parameters.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

PLANTED_MODULE = "layers.1.mlp.down_proj"
PLANTED_STEP = 3
STEPS = 5
WIDTH = 16
# 2^10, not torch's 2^16: at 2^16 this model's scaled fp16 gradients overflow by themselves at
# step 0, a real skip that is not the planted one.
INIT_SCALE = 2.0**10


class DownProj(nn.Linear):
    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__(d_in, d_out)
        self.register_buffer("gain", torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight * self.gain, self.bias)


class Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up_proj = nn.Linear(WIDTH, 2 * WIDTH)
        self.down_proj = DownProj(2 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.gelu(self.up_proj(x)))


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.mlp = Mlp()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


class PlantedNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Layer() for _ in range(3)])
        self.head = nn.Linear(WIDTH, 4)
        self.aux = nn.Linear(WIDTH, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = x
        for layer in self.layers:
            h = layer(h)
        return self.head(h), self.aux(x)


def make_model(seed: int = 0) -> PlantedNet:
    torch.manual_seed(seed)
    return PlantedNet()


def make_scaler() -> Any:
    import amp_fx

    return amp_fx.GradScaler("cpu", init_scale=INIT_SCALE, step_mode=amp_fx.StepMode.MASKED)


def loss_fn(out: tuple[torch.Tensor, torch.Tensor], y: torch.Tensor) -> torch.Tensor:
    main, aux = out
    return F.mse_loss(main.float(), y) + aux.float().pow(2).mean()


def batches(n: int = STEPS, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, WIDTH, generator=gen), torch.randn(8, 4, generator=gen)) for _ in range(n)]


def plant(model: nn.Module, step: int, planted: int | None = PLANTED_STEP) -> None:
    """Set the gain of the planted module for ``step`` (1e6 at ``planted``, else 1.0)."""
    root = model
    while not isinstance(root, PlantedNet):
        root = getattr(root, "module", None) or getattr(root, "original_module", None) or root._orig_mod
    root.layers[1].mlp.down_proj.gain.fill_(1e6 if step == planted else 1.0)


def eager_nonfinite_gradients(planted: int = PLANTED_STEP) -> list[str]:
    """The reference: eager ``torch.autocast`` + ``torch.amp.GradScaler``, the names of the parameters
    whose scaled gradients hold an inf/NaN at the planted step."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE)
    for i, (x, y) in enumerate(batches()):
        plant(model, i, planted)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = loss_fn(model(x), y)
        scaler.scale(loss).backward()
        if i == planted:
            return [n for n, p in model.named_parameters() if not torch.isfinite(p.grad).all()]
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    raise AssertionError("the planted step was not reached")


def run_scaler(
    model: nn.Module, compiled: Any, scaler: Any, planted: int | None = PLANTED_STEP, steps: int = STEPS
) -> list[Any]:
    """``steps`` steps of the GradScaler recipe around ``compiled``; the report after each."""
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    reports = []
    for i, (x, y) in enumerate(batches(steps)):
        plant(model, i, planted)
        loss = loss_fn(compiled(x), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        reports.append(scaler.overflow_report())
    return reports


def run_step(
    step: Any, model: nn.Module, planted: int | None = PLANTED_STEP, steps: int = STEPS, first: int = 0
) -> list[Any]:
    """``steps`` compiled steps; the report after each."""
    reports = []
    for i, (x, y) in enumerate(batches(first + steps)[first:], start=first):
        plant(model, i, planted)
        step(x, y)
        reports.append(step.overflow_report())
    return reports


def dist_overflow_run(rank: int, world_size: int) -> dict[str, Any]:
    """One spawn of 2 gloo ranks for the DDP and FSDP2 cases (``ddp_overflow_run``,
    ``fsdp_overflow_run``), each from a fresh Dynamo state."""
    out = {"ddp": ddp_overflow_run(rank, world_size)}
    torch._dynamo.reset()
    out["fsdp2"] = fsdp_overflow_run(rank, world_size)
    return out


def fsdp_overflow_run(rank: int, world_size: int) -> dict[str, Any]:
    """FSDP2 (``fully_shard`` on each layer and the root) on 2 gloo ranks, the overflow planted on
    rank 0 only: ``amp_fx.compile(sharded model, watch_nonfinite=True)`` + ``amp_fx.GradScaler``,
    aot_eager; planted, then clean. Each rank holds a shard of every gradient: its unscale kernel
    flags its own shards, and the flags are combined in the found-inf all-reduce. Planted again
    without ``scaler.watch`` (the scaler finds the model itself). The root's own ``head`` and
    ``aux`` run in its frame, which Dynamo skips (the loop over the sharded layers breaks its
    graph), so they run as eager autocast, unwatched: amp_fx says so (``warnings``, the
    AmpFxWarnings of each run; compiled with strict=False for that one)."""
    import warnings

    from torch.distributed.fsdp import fully_shard

    import amp_fx

    out: dict[str, Any] = {"warnings": []}
    planted_here = PLANTED_STEP if rank == 0 else None
    for name, planted in (("planted", planted_here), ("clean", None), ("planted_unwatched", planted_here)):
        model = make_model()
        for layer in model.layers:
            fully_shard(layer)
        fully_shard(model)
        compiled = amp_fx.compile(model, dtype="fp16", backend="aot_eager", watch_nonfinite=True, strict=False)
        scaler = make_scaler()
        if name != "planted_unwatched":  # without watch(): the scaler finds the model itself
            scaler.watch(compiled)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", amp_fx.AmpFxWarning)
            out[name] = [overflow_summary(r) for r in run_scaler(model, compiled, scaler, planted)]
        out["warnings"].append([str(w.message) for w in caught if issubclass(w.category, amp_fx.AmpFxWarning)])
    return out


def ddp_overflow_run(rank: int, world_size: int) -> dict[str, Any]:
    """DDP on 2 gloo ranks, the overflow planted on rank 0 only: ``DDP(amp_fx.compile(model))`` +
    ``amp_fx.GradScaler`` (with ``scaler.watch`` and without) and ``compile_step(DDP(model))``, all
    watched, aot_eager."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    import amp_fx

    out: dict[str, Any] = {}
    planted = PLANTED_STEP if rank == 0 else None
    model = make_model()
    # broadcast_buffers=False: DDP would otherwise copy rank 0's planted gain to rank 1 in the forward
    ddp = DDP(amp_fx.compile(model, dtype="fp16", backend="aot_eager", watch_nonfinite=True), broadcast_buffers=False)
    scaler = make_scaler()
    scaler.watch(ddp)
    out["scaler"] = [overflow_summary(r) for r in run_scaler(model, ddp, scaler, planted)]
    # the same without watch(): the scaler finds the compiled model, and the DDP module it ran in
    model = make_model()
    ddp = DDP(amp_fx.compile(model, dtype="fp16", backend="aot_eager", watch_nonfinite=True), broadcast_buffers=False)
    out["scaler_unwatched"] = [overflow_summary(r) for r in run_scaler(model, ddp, make_scaler(), planted)]
    from amp_fx.testing import HostSyncCounter

    for watched in (True, False):
        torch._dynamo.reset()
        model = make_model()
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        step = amp_fx.compile_step(
            DDP(model, broadcast_buffers=False),
            opt,
            loss_fn,
            backend="aot_eager",
            watch_nonfinite=watched,
            scaler=make_scaler(),
        )
        reports = run_step(step, model, planted if watched else None, steps=STEPS if watched else 2)
        if watched:
            out["step"] = [overflow_summary(r) for r in reports]
        # Clean steps after the warm-up: host reads and gloo all-reduces inside step() (the
        # report is read outside).
        reads, all_reduces = 0, []
        for i, (x, y) in enumerate(batches(STEPS + 3)[STEPS:], start=STEPS):
            plant(model, i, None)
            with HostSyncCounter() as counter:
                step(x, y)
            reads += counter.count
            all_reduces.append(counter.collectives["gloo:all_reduce"])
        out["step_host_reads", watched] = reads
        out["step_all_reduces", watched] = all_reduces
    return out


def overflow_summary(report: Any) -> Any:
    """An ``OverflowReport`` as plain data for the test process (None stays None)."""
    if report is None:
        return None
    first = report.first_op
    return {
        "step": report.step,
        "gradients": list(report.gradients),
        "str": str(report),
        "first_op": None if first is None else (first.module, first.op, first.rank),
    }
