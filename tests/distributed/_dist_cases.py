"""What each rank runs for tests/distributed/test_distributed_*.py (imported by the spawned ranks by name).

Every function here is ``fn(rank, world_size, ...) -> dict`` for ``amp_fx._dist.testing.run_ranks``
and returns tensors; the comparisons (bitwise against the eager reference, equal across ranks)
happen in the test process, so a failure is an ordinary pytest assertion.

One training recipe, run by the reference (eager DDP or FSDP2 + ``torch.autocast`` + torch's
scaler) and by amp_fx (compiled model + ``amp_fx.GradScaler``) alike: SGD with momentum, MSE
loss in fp32, ``growth_interval=2`` so the scale grows as well as backs off, and overflows
planted at fixed steps (see ``_plant_batch`` and ``_plant_grad``).
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import amp_fx
from tests.distributed._dist_asserts import model_state
from tests.overflow._overflow_cases import overflow_summary

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
STEPS = 8
# (step, rank) pairs whose batch gets a non-finite element, so only that rank's local loss
# and gradients are non-finite before the gradients are reduced.
INF_BATCH = {(2, 1): math.inf, (5, 0): math.nan}
# (step, rank): an inf written into one element of the rank's *local shard* of the first
# layer's weight gradient, after backward. With sharded gradients no other rank sees it.
INF_GRAD = {(3, 0)}


class TwoLayer(nn.Module):
    """A user-defined module (Dynamo starts frames in it)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


def make_model(kind: str) -> nn.Module:
    """The same initial weights on every rank and in every run."""
    torch.manual_seed(0)
    if kind == "seq":  # torch.nn classes only: Dynamo starts no frame in them
        return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    return TwoLayer()


def _batch(rank: int, step: int, micro: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    x = torch.randn(4, 8, generator=g)
    y = torch.randn(4, 4, generator=g)
    bad = INF_BATCH.get((step, rank))
    if bad is not None and micro == 0:  # with accumulation: inside the no-sync part of the window
        x[0, 0] = bad
    return x, y


def _plant_grad(model: nn.Module, rank: int, step: int) -> None:
    if (step, rank) not in INF_GRAD:
        return
    grad = next(model.parameters()).grad
    local = grad._local_tensor if hasattr(grad, "_local_tensor") else grad
    with torch.no_grad():
        local.view(-1)[0] = math.inf


def _scale_of(scaler: Any) -> torch.Tensor:
    return scaler._scale.detach().clone().reshape(())


def _local(t: torch.Tensor) -> torch.Tensor:
    return (t.to_local() if hasattr(t, "to_local") else t).detach().clone()


def _train(
    model: nn.Module,
    forward: Callable[[torch.Tensor], torch.Tensor],
    scaler: Any,
    rank: int,
    autocast_dtype: torch.dtype | None,
    *,
    plant_grads: bool,
    accumulate: int = 1,
    no_sync: Callable[[], Any] | None = None,
    clip: float | None = None,
    opt: Any = None,
    steps: range = range(STEPS),
    on_window: Callable[[int], None] | None = None,
    on_grads: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    """Optimizer steps ``steps`` of ``accumulate`` micro-batches each; all but the last
    micro-batch of a window run under ``no_sync()`` (DDP's no_sync, FSDP2's
    set_requires_gradient_sync). ``opt``: SGD with momentum unless given. ``on_window(step)``
    runs after each window's update, ``on_grads(step)`` before its unscale (gradients planted)."""
    opt = opt if opt is not None else _sgd(model)
    losses, scales, norms = [], [], []
    movement = _Movement(model)
    for step in steps:
        for micro in range(accumulate):
            x, y = _batch(rank, step, micro)
            sync = micro == accumulate - 1
            ctx = contextlib.nullcontext() if sync or no_sync is None else no_sync()
            with ctx:
                if autocast_dtype is None:
                    loss = F.mse_loss(forward(x).float(), y)
                else:
                    with torch.autocast("cpu", dtype=autocast_dtype):
                        loss = F.mse_loss(forward(x).float(), y)
                scaler.scale(loss / accumulate).backward()
            losses.append(loss.detach().clone())
        if plant_grads:
            _plant_grad(model, rank, step)
        if on_grads is not None:
            on_grads(step)
        if clip is not None:
            scaler.unscale_(opt)
            norms.append(_local(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        scales.append(_scale_of(scaler))
        movement.update()
        if on_window is not None:
            on_window(step)
    out = {
        "losses": torch.stack(losses),
        "scales": torch.stack(scales),
        "params": [_local(p) for p in model.parameters()],
        "moved": movement.total,
    }
    if norms:
        out["norms"] = torch.stack(norms)
    return out


class _Movement:
    """Per parameter (its local shard), the sum over steps of each step's |update|: what a
    tolerance relative to the parameters' movement is measured against."""

    def __init__(self, model: nn.Module) -> None:
        self._model = model
        self._last = [_local(p) for p in model.parameters()]
        self.total = [torch.zeros_like(t) for t in self._last]

    def update(self) -> None:
        now = [_local(p) for p in self._model.parameters()]
        for total, before, after in zip(self.total, self._last, now):
            total += (after - before).abs()
        self._last = now


def _sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def _linears_captured(compiled: Any) -> int:
    return sum(
        1 for r in amp_fx.records(compiled) for n in r.captured.graph.nodes if n.target is torch.ops.aten.linear.default
    )


RECIPES = {
    "plain": {},
    # Two micro-batches per step (the first under no-sync), clipping to a global norm of 0.5
    # (the finite norms of these runs lie between 0.49 and 0.95: most steps are clipped).
    "accum_clip": {"accumulate": 2, "clip": 0.5},
}


# ----------------------------------------------------------------------------------------- DDP
def ddp_run(rank: int, world_size: int, dtype: str, kind: str, form: str, recipe: str = "plain") -> dict[str, Any]:
    """``form``: "eager" (DDP + autocast + torch.amp.GradScaler), "inner" (DDP(amp_fx.compile(m))),
    "outer" (amp_fx.compile(DDP(m))); both amp_fx forms with amp_fx.GradScaler."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    low = DTYPES[dtype]
    model = make_model(kind)
    options = RECIPES[recipe]
    if form == "eager":
        ddp = DDP(model)
        out = _train(
            model,
            ddp,
            torch.amp.GradScaler("cpu", growth_interval=2),
            rank,
            low,
            plant_grads=False,
            no_sync=ddp.no_sync,
            **options,
        )
        out["linears"] = 0
        return out
    if form == "inner":
        compiled = amp_fx.compile(model, dtype=dtype, backend="aot_eager")
        wrapped: Any = DDP(compiled)
    else:
        wrapped = compiled = amp_fx.compile(DDP(model), dtype=dtype, backend="aot_eager")
    collectives = _CountAllReduce()
    scaler = amp_fx.GradScaler("cpu", growth_interval=2)
    with collectives.in_scaler(scaler):
        out = _train(model, wrapped, scaler, rank, None, plant_grads=False, no_sync=wrapped.no_sync, **options)
    out["linears"] = _linears_captured(compiled)
    out["scaler_collectives"] = collectives.count
    return out


# ---------------------------------------------------------------------------------------- FSDP2
def _shard(model: nn.Module, mp_policy: Any = None) -> nn.Module:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    kwargs = {"mp_policy": mp_policy or MixedPrecisionPolicy()}
    for m in model.modules():
        if isinstance(m, nn.Linear):
            fully_shard(m, **kwargs)
    fully_shard(model, **kwargs)
    return model


def _fsdp_no_sync(model: Any) -> Callable[[], Any]:
    """FSDP2's equivalent of DDP's no_sync: no reduce-scatter of the gradients."""

    @contextlib.contextmanager
    def no_sync() -> Any:
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)

    return no_sync


def fsdp_run(
    rank: int,
    world_size: int,
    dtype: str,
    kind: str,
    form: str,
    param_dtype: str | None = None,
    recipe: str = "plain",
    optimizer: str = "sgd",
    watch: bool = False,
) -> dict[str, Any]:
    """``form``: "eager" (FSDP2 + autocast + ShardedGradScaler) or "amp_fx"
    (amp_fx.compile of the sharded model + amp_fx.GradScaler). ``param_dtype``: FSDP2's
    MixedPrecisionPolicy(param_dtype=...), with reduce_dtype float32. ``optimizer``: a key
    of ``_OPTIMIZERS``. ``watch``: amp_fx.compile(..., watch_nonfinite=True)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    low = DTYPES[dtype]
    mp = (
        None
        if param_dtype is None
        else MixedPrecisionPolicy(param_dtype=DTYPES[param_dtype], reduce_dtype=torch.float32)
    )
    model = _shard(make_model(kind), mp)
    options = RECIPES[recipe]
    if form == "eager":
        nonfinite: list[list[str]] = []
        out = _train(
            model,
            model,
            ShardedGradScaler("cpu", growth_interval=2),
            rank,
            low,
            plant_grads=True,
            no_sync=_fsdp_no_sync(model),
            opt=_OPTIMIZERS[optimizer](model),
            on_grads=lambda step: nonfinite.append(_nonfinite_full_gradients(model)),
            **options,
        )
        out["linears"] = 0
        out["nonfinite"] = nonfinite
        return out
    compiled = amp_fx.compile(model, dtype=dtype, backend="aot_eager", watch_nonfinite=watch)
    collectives = _CountAllReduce()
    scaler = amp_fx.GradScaler("cpu", growth_interval=2)
    scaler.watch(compiled)  # overflow_report() names the parameters
    reports: list[Any] = []
    with collectives.in_scaler(scaler):
        out = _train(
            model,
            compiled,
            scaler,
            rank,
            None,
            plant_grads=True,
            no_sync=_fsdp_no_sync(model),
            on_window=lambda step: reports.append(overflow_summary(scaler.overflow_report())),
            **options,
        )
    out["linears"] = _linears_captured(compiled)
    out["scaler_collectives"] = collectives.count
    out["overflow_reports"] = reports
    return out


def _nonfinite_full_gradients(model: nn.Module) -> list[str]:
    """The reference for overflow_report()'s gradients: the names of the parameters whose full
    (gathered: a collective) gradient holds an inf/NaN."""
    return [
        n
        for n, p in model.named_parameters()
        if p.grad is not None
        and not torch.isfinite(p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).all()
    ]


def fsdp_resume(rank: int, world_size: int, checkpoint_dir: str) -> dict[str, Any]:
    """amp_fx on FSDP2, fp16: 8 steps straight, against 4 steps, a torch.distributed.checkpoint
    save (model and optimizer as sharded state dicts, the scaler's state as an object), a fresh
    model/optimizer/scaler loading it, and 4 more steps. Overflows as in the other runs."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    def build() -> tuple[nn.Module, Any, torch.optim.Optimizer, Any]:
        model = _shard(make_model("seq"))
        compiled = amp_fx.compile(model, dtype="fp16", backend="aot_eager")
        return model, compiled, _sgd(model), amp_fx.GradScaler("cpu", growth_interval=2)

    def run(parts: tuple[Any, ...], steps: range) -> dict[str, Any]:
        model, compiled, opt, scaler = parts
        return _train(model, compiled, scaler, rank, None, plant_grads=True, opt=opt, steps=steps)

    straight = run(build(), range(STEPS))
    first = build()
    head = run(first, range(STEPS // 2))
    model_sd, optim_sd = get_state_dict(first[0], first[2])
    dcp.save({"model": model_sd, "optim": optim_sd, "scaler": first[3].state_dict()}, checkpoint_id=checkpoint_dir)
    second = build()
    model_sd, optim_sd = get_state_dict(second[0], second[2])
    state = {"model": model_sd, "optim": optim_sd, "scaler": second[3].state_dict()}
    dcp.load(state, checkpoint_id=checkpoint_dir)
    set_state_dict(second[0], second[2], model_state_dict=state["model"], optim_state_dict=state["optim"])
    second[3].load_state_dict(state["scaler"])
    tail = run(second, range(STEPS // 2, STEPS))
    resumed = {
        "losses": torch.cat([head["losses"], tail["losses"]]),
        "scales": torch.cat([head["scales"], tail["scales"]]),
        "params": tail["params"],
    }
    return {"straight": straight, "resumed": resumed}


def ddp_step_run(rank: int, world_size: int, recipe: str) -> dict[str, Any]:
    """``amp_fx.compile_step(DDP(model), ...)``, fp16, the same recipe as ``ddp_run``'s eager form
    (accumulation windows under no_sync, clipping with clip_grad_norm_'s formula). Counts host
    reads and newly compiled graphs from step 2 on (step 0 is the eager warm-up)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = make_model("seq")
    options = RECIPES[recipe]
    accumulate = options.get("accumulate", 1)
    scaler = amp_fx.GradScaler("cpu", growth_interval=2, step_mode=amp_fx.StepMode.MASKED)
    step = amp_fx.compile_step(
        DDP(model),
        _sgd(model),
        lambda out, y: F.mse_loss(out.float(), y),
        dtype="fp16",
        scaler=scaler,
        max_grad_norm=options.get("clip"),
        grad_norm=amp_fx.GradNorm.TORCH,
        accumulate=accumulate,
        backend="aot_eager",
    )
    return {
        **_run_steps(step, scaler, rank, accumulate),
        "params": [_local(p) for p in model.parameters()],
        "linears": _linears_captured(step._forward),
    }


def _run_steps(
    step: Any, scaler: Any, rank: int, accumulate: int, on_step: Callable[[int, Any], None] | None = None
) -> dict[str, Any]:
    """``STEPS`` optimizer steps of a compile_step (``accumulate`` micro-batches each): the losses
    and scales, and the host reads and newly compiled graphs from step 2 on (step 0 is the eager
    warm-up). ``on_step(i, counter)`` runs after each step with its HostSyncCounter."""
    from amp_fx.testing import HostSyncCounter

    losses, scales, host_reads, graphs_after_warm_up = [], [], 0, 0
    for i in range(STEPS):
        counter = HostSyncCounter()
        graphs = step.graphs_compiled
        with counter:
            for micro in range(accumulate):
                losses.append(step(*_batch(rank, i, micro)).detach().clone())
        if i >= 2:
            host_reads += counter.count
            graphs_after_warm_up += step.graphs_compiled - graphs
        scales.append(_scale_of(scaler))
        if on_step is not None:
            on_step(i, counter)
    return {
        "losses": torch.stack(losses),
        "scales": torch.stack(scales),
        "host_reads": host_reads,
        "graphs_after_warm_up": graphs_after_warm_up,
    }


def fsdp_step_run(
    rank: int, world_size: int, dtype: str, recipe: str = "plain", optimizer: str = "sgd"
) -> dict[str, Any]:
    """``amp_fx.compile_step`` on the FSDP2 model (per-Linear and root), the same recipe as
    ``fsdp_run``'s eager form: overflows in one rank's batch, the inf planted in rank 0's
    gradient shard (by an optimizer pre-hook: after the backward, before the finish, where the
    eager recipe plants it before ``unscale_``), accumulation windows with
    ``set_requires_gradient_sync(False)`` on the first micro-batch, global-norm clipping. Counts
    host reads, newly compiled graphs and gloo all-reduces per step from step 2 on (step 0 is
    the eager warm-up)."""
    model = _shard(make_model("seq"))
    options = RECIPES[recipe]
    accumulate = options.get("accumulate", 1)
    opt = _OPTIMIZERS[optimizer](model)
    at = {"step": 0}
    opt.register_step_pre_hook(lambda *_: _plant_grad(model, rank, at["step"]))
    scaler = amp_fx.GradScaler("cpu", growth_interval=2, step_mode=amp_fx.StepMode.MASKED)
    # watch_nonfinite: the forward record rides in the found-inf all-reduce (counted below)
    step = amp_fx.compile_step(
        model,
        opt,
        lambda out, y: F.mse_loss(out.float(), y),
        dtype=dtype,
        scaler=scaler,
        max_grad_norm=options.get("clip"),
        grad_norm=amp_fx.GradNorm.TORCH,
        accumulate=accumulate,
        backend="aot_eager",
        watch_nonfinite=True,
    )
    all_reduces: list[int] = []
    movement = _Movement(model)
    reports: list[Any] = []

    def on_step(i: int, counter: Any) -> None:
        at["step"] = i + 1  # the step the planting pre-hook sees next
        if i >= 2:
            all_reduces.append(counter.collectives["gloo:all_reduce"])
        movement.update()
        with warnings.catch_warnings():  # the one host read, outside the counted step
            warnings.simplefilter("error", amp_fx.AmpFxWarning)
            reports.append(overflow_summary(step.overflow_report()))

    run = _run_steps(step, scaler, rank, accumulate, on_step)
    return {
        **run,
        "params": [_local(p) for p in model.parameters()],
        "all_reduces": all_reduces,
        "moved": movement.total,
        "linears": _linears_captured(step._forward),
        "overflow_reports": reports,
    }


_OPTIMIZERS: dict[str, Callable[[nn.Module], torch.optim.Optimizer]] = {
    "sgd": lambda model: _sgd(model),
    "adamw": lambda model: torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1),
    "adamw_fused": lambda model: torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, fused=True),
}


def keep_fp32_names_report(wrap: Callable[[nn.Module], nn.Module], name: str) -> dict[str, Any]:
    """Policy.keep_fp32 given by name under the root the user passed (the DDP/FSDP2 model): the
    named module runs in fp32 (its output dtype), and nothing is reported; the same model
    without the entry (negative twin) gives a low-precision output."""
    import warnings

    from amp_fx import AmpFxWarning

    out: dict[str, Any] = {}
    x = torch.randn(2, 8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        kept = amp_fx.compile(wrap(make_model("seq")), backend="aot_eager", policy=amp_fx.Policy(keep_fp32=(name,)))
        out["kept_dtype"] = kept(x).dtype
        plain = amp_fx.compile(wrap(make_model("seq")), backend="aot_eager")
        out["plain_dtype"] = plain(x).dtype
    out["warnings"] = [str(w.message) for w in caught if issubclass(w.category, AmpFxWarning)]
    return out


def fsdp_own_all_reduces(accumulate: int = 1, clip: float | None = None) -> int:
    """gloo all-reduces FSDP2 itself makes in one accumulation window of the eager recipe
    without a scaler or clipping (on gloo it reduces gradients with all-reduces): the baseline
    the step's own collectives are counted against."""
    from amp_fx.testing import HostSyncCounter

    model = _shard(make_model("seq"))
    no_sync = _fsdp_no_sync(model)
    for window in range(2):  # the first window: FSDP2's lazy initialisation
        with HostSyncCounter() as counter:
            for micro in range(accumulate):
                with contextlib.nullcontext() if micro == accumulate - 1 else no_sync():
                    model(torch.randn(4, 8)).sum().backward()
        model.zero_grad(set_to_none=True)
    return counter.collectives["gloo:all_reduce"]


def compile_step_errors() -> dict[str, str]:
    """compile_step's refusal on FSDP2 of an optimizer that is not elementwise."""
    out = {}
    for name, make_opt in (("lbfgs", lambda ps: torch.optim.LBFGS(ps)),):
        model = _shard(make_model("seq"))
        try:
            amp_fx.compile_step(model, make_opt(model.parameters()), F.mse_loss, dtype="fp16", backend="aot_eager")
            out[name] = ""
        except NotImplementedError as e:
            out[name] = str(e)
    return out


class _CountAllReduce:
    """Counts all-reduce calls (``dist.all_reduce`` and the functional collectives') made inside
    the scaler's methods (unscale_, step, update)."""

    def __init__(self) -> None:
        self.count = 0

    def in_scaler(self, scaler: Any) -> Any:
        import contextlib

        from torch.distributed import _functional_collectives as funcol

        counter = self
        real, real_funcol = dist.all_reduce, funcol.all_reduce

        def counting(*args: Any, **kwargs: Any) -> Any:
            counter.count += 1
            return real(*args, **kwargs)

        def counting_funcol(*args: Any, **kwargs: Any) -> Any:
            counter.count += 1
            return real_funcol(*args, **kwargs)

        def wrap(method: Callable[..., Any]) -> Callable[..., Any]:
            def inner(*args: Any, **kwargs: Any) -> Any:
                dist.all_reduce, funcol.all_reduce = counting, counting_funcol
                try:
                    return method(*args, **kwargs)
                finally:
                    dist.all_reduce, funcol.all_reduce = real, real_funcol

            return inner

        @contextlib.contextmanager
        def ctx() -> Any:
            for name in ("unscale_", "step", "update"):
                setattr(scaler, name, wrap(getattr(scaler, name)))
            yield

        return ctx()


# --------------------------------------------------------------------------- one spawn per file
# Starting ranks costs seconds (imports, process group); each test file spawns once and runs
# every case in it, keyed by its parameters. torch._dynamo.reset() between cases: every case
# compiles from scratch, as in a fresh process.
def ddp_all(rank: int, world_size: int) -> dict[Any, Any]:
    results: dict[Any, Any] = {}
    for dtype in DTYPES:
        for kind, form in (("seq", "eager"), ("seq", "inner"), ("seq", "outer"), ("custom", "outer")):
            torch._dynamo.reset()
            results[(dtype, kind, form)] = ddp_run(rank, world_size, dtype, kind, form)
    results[("fp16", "seq", "eager", "plain")] = results[("fp16", "seq", "eager")]
    for form in ("eager", "inner", "outer"):
        torch._dynamo.reset()
        results[("fp16", "seq", form, "accum_clip")] = ddp_run(
            rank, world_size, "fp16", "seq", form, recipe="accum_clip"
        )
    for recipe in RECIPES:
        torch._dynamo.reset()
        results[("fp16", "seq", "step", recipe)] = ddp_step_run(rank, world_size, recipe)
    from torch.nn.parallel import DistributedDataParallel as DDP

    results["keep_fp32_names"] = keep_fp32_names_report(DDP, "module.2")
    # The form the warning names: names relative to the compiled module apply.
    inner = DDP(amp_fx.compile(make_model("seq"), backend="aot_eager", policy=amp_fx.Policy(keep_fp32=("2",))))
    results["inner_keep_fp32_dtype"] = inner(torch.randn(2, 8)).dtype
    results["precision_report"] = ddp_precision_reports()
    return results


class _BatchNormNet(nn.Module):
    """Linear, BatchNorm (running stats: buffers a forward in training mode updates), ReLU, Linear;
    a user-defined root, so the root's own ops (relu, ``b``) run in a captured frame."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(8, 16)
        self.bn = nn.BatchNorm1d(16)
        self.b = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.bn(self.a(x))))


def _explain_rows(explained: Any) -> list[tuple[Any, ...]]:
    """(kind, op, module, dtype, the rule that decided it, cast) of each row."""
    return [(n.kind, n.op, n.module, n.dtype_name, n.rule, n.cast) for n in explained.nodes()]


def fsdp_inspection(rank: int) -> dict[str, Any]:
    """explain and compare (bf16) on an FSDP2 model (``a`` and ``bn`` sharded, then the root, which
    holds ``b``), lent to them, and explain on the unsharded model with the same weights; the sharded model's
    :func:`model_state` before and after each tool. explain runs after a training forward and
    backward (gradients present, every group sharded; its forward leaves the root unsharded),
    compare after a forward under no_grad (the root unsharded; its backward reshards it). advise
    and ``compare(fp8=...)`` refuse the model. find_nonfinite (fp16, an input that overflows
    ``a``) on it and on the unsharded model. The negative twin: the state after one more eager
    forward and backward, what the tools' runs do without the loan."""
    from torch.distributed.fsdp import fully_shard

    model = _BatchNormNet()
    fully_shard(model.a)
    fully_shard(model.bn)
    fully_shard(model)  # holds b: the root's group, left unsharded by a forward without backward
    x, y = _batch(rank, 0)
    F.mse_loss(model(x), y).backward()
    before = model_state(model)
    torch._dynamo.reset()
    explained = amp_fx.explain(model, x, dtype="bf16")
    after_explain = model_state(model)
    with torch.no_grad():
        model(x)
    before_compare = model_state(model)
    compared = amp_fx.compare(model, x, dtype="bf16")
    out: dict[str, Any] = {
        "explain_rows": _explain_rows(explained),
        "whole_explain_rows": _explain_rows(amp_fx.explain(_BatchNormNet(), x, dtype="bf16")),
        "compare_ok": compared.ok,
        "compare_exact": compared.exact,
        "compare_ops": [(o.op, o.module, o.eager_dtype, o.amp_dtype, o.agree) for o in compared.ops],
        "compare_values": [(v.name, v.agree) for v in (*compared.outputs, *compared.grads)],
        "compare_notes": compared.notes,
        "states": {"explain": (before, after_explain), "compare": (before_compare, model_state(model))},
    }
    before = model_state(model)
    errors = {}
    for tool, run in (
        ("advise", lambda: amp_fx.advise(model, x, loss_fn=lambda o: o.float().pow(2).mean())),
        ("compare_fp8", lambda: amp_fx.compare(model, x, dtype="bf16", fp8="tensorwise")),
    ):
        try:
            run()
        except TypeError as e:
            errors[tool] = str(e)
    out["refused"] = errors
    out["states"]["refused"] = (before, model_state(model))
    big = x * 1e5  # a's fp16 output passes 65504
    before = model_state(model)
    found = amp_fx.find_nonfinite(model, big, dtype="fp16", verify=False)
    out["states"]["find_nonfinite"] = (before, model_state(model))
    whole = amp_fx.find_nonfinite(_BatchNormNet(), big, dtype="fp16", verify=False)
    out["nonfinite"] = [(r.found, r.module_path, r.suggestion_code) for r in (found, whole)]
    F.mse_loss(model(x), y).backward()
    out["states"]["eager step"] = (before, model_state(model))
    return out


def fsdp_all(rank: int, world_size: int, checkpoint_dir: str) -> dict[Any, Any]:
    results: dict[Any, Any] = {}
    for dtype in DTYPES:
        for kind, form in (("seq", "eager"), ("seq", "amp_fx"), ("custom", "amp_fx")):
            torch._dynamo.reset()
            results[(dtype, kind, form)] = fsdp_run(rank, world_size, dtype, kind, form)
    # amp_fx.GradScaler with the forward watched: the record rides in the found-inf all-reduce.
    for dtype in DTYPES:
        torch._dynamo.reset()
        results[(dtype, "seq", "amp_fx", "watched")] = fsdp_run(rank, world_size, dtype, "seq", "amp_fx", watch=True)
    # FSDP2's MixedPrecisionPolicy with param_dtype equal to the compute dtype.
    for dtype in DTYPES:
        for form in ("eager", "amp_fx"):
            torch._dynamo.reset()
            results[(dtype, "seq", form, "param_dtype")] = fsdp_run(
                rank, world_size, dtype, "seq", form, param_dtype=dtype
            )
    results["mismatch_error"] = _mismatched_param_dtype_error()
    for form in ("eager", "amp_fx"):
        torch._dynamo.reset()
        results[("fp16", "seq", form, "accum_clip")] = fsdp_run(
            rank, world_size, "fp16", "seq", form, recipe="accum_clip"
        )
    # compile_step on the FSDP2 model, against the eager runs above (and one with AdamW).
    for dtype in DTYPES:
        torch._dynamo.reset()
        results[(dtype, "seq", "step", "plain")] = fsdp_step_run(rank, world_size, dtype)
    torch._dynamo.reset()
    results[("fp16", "seq", "step", "accum_clip")] = fsdp_step_run(rank, world_size, "fp16", "accum_clip")
    torch._dynamo.reset()
    results[("fp16", "seq", "eager", "adamw")] = fsdp_run(rank, world_size, "fp16", "seq", "eager", optimizer="adamw")
    results[("fp16", "seq", "step", "adamw")] = fsdp_step_run(rank, world_size, "fp16", optimizer="adamw")
    torch._dynamo.reset()
    results[("fp16", "seq", "eager", "adamw_fused")] = fsdp_run(
        rank, world_size, "fp16", "seq", "eager", optimizer="adamw_fused"
    )
    results[("fp16", "seq", "step", "adamw_fused")] = fsdp_step_run(rank, world_size, "fp16", optimizer="adamw_fused")
    results["fsdp_all_reduces"] = {recipe: fsdp_own_all_reduces(**RECIPES[recipe]) for recipe in RECIPES}
    results["compile_step_errors"] = compile_step_errors()
    torch._dynamo.reset()
    results["fsdp1"] = fsdp1_reports(rank, world_size)
    results["keep_fp32_names"] = keep_fp32_names_report(_shard, "2")
    results["precision_report"] = fsdp_precision_reports()
    results["root_frame"] = root_frame_reports()
    results["inspection"] = fsdp_inspection(rank)
    torch._dynamo.reset()
    results["resume"] = fsdp_resume(rank, world_size, checkpoint_dir)
    # The negative twin: without combining the flag across ranks, the inf planted in rank 0's
    # shard is seen by rank 0 only.
    from amp_fx._dist import found_inf

    torch._dynamo.reset()
    real = found_inf.ShardedGrads.combine_found_inf_
    found_inf.ShardedGrads.combine_found_inf_ = lambda self, per_device, scale, grad_flags=None, first_op=None: None
    try:
        results[("fp16", "seq", "amp_fx", "no_combine")] = fsdp_run(rank, world_size, "fp16", "seq", "amp_fx")
    finally:
        found_inf.ShardedGrads.combine_found_inf_ = real
    return results


def fsdp1_reports(rank: int, world_size: int) -> dict[str, Any]:
    """FSDP1 (``FullyShardedDataParallel``, on CPU with ``device_id=cpu``): what amp_fx says for
    ``amp_fx.compile(FSDP1(m))`` (at compile time; the call then runs as eager FSDP1 + autocast:
    its output against that reference), in strict mode (the suite's default; the warning cases
    pass strict=False), for ``FSDP1(amp_fx.compile(m))`` (at the
    first call) and for ``compile_step(FSDP1(m))``."""
    import warnings

    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP1

    from amp_fx import AmpFxError, AmpFxWarning

    def fsdp1(module: nn.Module) -> nn.Module:
        return FSDP1(module, device_id=torch.device("cpu"))

    def amp_warnings(caught: list[warnings.WarningMessage]) -> list[str]:
        return [str(w.message) for w in caught if issubclass(w.category, AmpFxWarning)]

    out: dict[str, Any] = {}
    x = torch.randn(2, 8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        outer = amp_fx.compile(fsdp1(make_model("seq")), dtype="bf16", backend="aot_eager", strict=False)
        out["outer_at_compile"] = amp_warnings(caught)
        out["outer_out"] = outer(x).detach()
    reference = fsdp1(make_model("seq"))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out["eager_out"] = reference(x).detach()
    try:
        amp_fx.compile(fsdp1(make_model("seq")), backend="aot_eager", strict=True)
        out["strict"] = ""
    except AmpFxError as e:
        out["strict"] = str(e)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        inner = fsdp1(amp_fx.compile(make_model("seq"), dtype="bf16", backend="aot_eager", strict=False))
        inner(x)
        out["inner_at_call"] = amp_warnings(caught)
    model = fsdp1(make_model("seq"))
    try:
        amp_fx.compile_step(model, torch.optim.SGD(model.parameters(), lr=0.1), F.mse_loss, backend="aot_eager")
        out["step"] = ""
    except NotImplementedError as e:
        out["step"] = str(e)
    return out


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.lin(x))


class LoopRoot(nn.Module):
    """An FSDP2 root with modules of its own around a loop over its sharded blocks: the graph
    break at each block's call falls inside the loop, so Dynamo skips the whole frame."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 8)
        self.blocks = nn.ModuleList([_Block(), _Block()])
        self.norm = nn.LayerNorm(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.norm(x)


class MethodRoot(LoopRoot):
    """The fix the report names: the loop in a method of its own (only its frame is skipped)."""

    def run_blocks(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.run_blocks(self.inp(x)))


class _LoopBody(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 8, bias=False)
        self.blocks = nn.ModuleList([_Block(), _Block()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return x


class TiedRoot(nn.Module):
    """GPT-2's shape: the loop (and the embedding, ``body.inp``) one module down, the head outside
    it with the embedding's weight (tied). Dynamo skips ``body``'s frame and captures the head."""

    def __init__(self) -> None:
        super().__init__()
        self.body = _LoopBody()
        self.head = nn.Linear(8, 8, bias=False)
        self.head.weight = self.body.inp.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def root_frame_reports() -> dict[str, Any]:
    """amp_fx.compile of FSDP2 roots whose own modules (``inp``, ``norm``) run around the sharded
    blocks. ``LoopRoot`` loops over them, so Dynamo skips its frame: strict mode raises after the
    first call, which ran the blocks' graphs; the same compiled model, its reporter then made
    lenient, warns once over two calls, and its output is eager FSDP2 + autocast's, bit for bit.
    A ``keep_fp32`` entry naming ``norm`` there is told that it ran outside every graph (not
    to name a module that runs ops). Not reported, in strict mode: the fixes the report names,
    ``MethodRoot`` (its frame is captured: ``keep_fp32=("norm",)`` then applies) and ``LoopRoot``
    with ``inp`` and ``norm`` sharded too."""
    from torch.distributed.fsdp import fully_shard

    def sharded(cls: type[nn.Module], own_units: bool = False) -> nn.Module:
        torch.manual_seed(0)
        model = cls()
        for block in model.blocks:
            fully_shard(block)
        if own_units:
            fully_shard(model.inp)
            fully_shard(model.norm)
        return fully_shard(model)

    def strict_run(model: nn.Module, **kwargs: Any) -> tuple[str, Any, Any]:
        """The strict error of the first call ("" for none), the compiled model, the output."""
        torch._dynamo.reset()
        compiled = amp_fx.compile(model, dtype="bf16", backend="aot_eager", strict=True, **kwargs)
        try:
            return "", compiled, compiled(x)
        except amp_fx.AmpFxError as e:
            return str(e), compiled, None

    out: dict[str, Any] = {}
    x = torch.randn(4, 8)
    out["loop_strict"], compiled, _ = strict_run(sharded(LoopRoot))
    compiled._amp_fx_backend.reporter.strict = False  # the same graphs, the report as a warning
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out["loop_out"] = compiled(x).detach()
        compiled(x)
    out["loop_warnings"] = [str(w.message) for w in caught if issubclass(w.category, amp_fx.AmpFxWarning)]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out["eager_out"] = sharded(LoopRoot)(x).detach()
    torch._dynamo.reset()
    kept_root = amp_fx.compile(
        sharded(LoopRoot), dtype="bf16", backend="aot_eager", strict=False, policy=amp_fx.Policy(keep_fp32=("norm",))
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        kept_root(x)
    out["loop_keep_warnings"] = [str(w.message) for w in caught if issubclass(w.category, amp_fx.AmpFxWarning)]
    out["method_strict"], _, kept = strict_run(sharded(MethodRoot), policy=amp_fx.Policy(keep_fp32=("norm",)))
    out["method_kept_dtype"] = None if kept is None else kept.dtype
    out["own_units_strict"] = strict_run(sharded(LoopRoot, own_units=True))[0]

    # tied weights: the report names the one fully_shard call FSDP2 takes for both, which works
    def tied_root(fixed: bool) -> nn.Module:
        torch.manual_seed(0)
        model = TiedRoot()
        if fixed:
            fully_shard([model.body.inp, model.head])
        for block in model.body.blocks:
            fully_shard(block)
        return fully_shard(model)

    out["tied_strict"] = strict_run(tied_root(False))[0]
    out["tied_fixed_strict"] = strict_run(tied_root(True))[0]
    return out


def _mismatched_param_dtype_error() -> str:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    model = _shard(make_model("seq"), MixedPrecisionPolicy(param_dtype=torch.float16))
    try:
        amp_fx.compile(model, dtype="bf16", backend="aot_eager")
    except ValueError as e:
        return str(e)
    return ""


# ------------------------------------------------------------------------ amp_fx.precision_report
@contextlib.contextmanager
def _wire_dtypes(names: tuple[str, ...]) -> Any:
    """The dtype of every tensor handed to the ``torch.distributed`` functions ``names`` inside
    (those of them this torch has), by function name."""
    seen: dict[str, list[torch.dtype]] = {name: [] for name in names}
    real = {name: getattr(dist, name) for name in names if hasattr(dist, name)}

    def spy(name: str) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
            seen[name].append(tensors[-1].dtype)  # the input (all_gather/reduce_scatter: output first)
            return real[name](*args, **kwargs)

        return call

    for name in real:
        setattr(dist, name, spy(name))
    try:
        yield seen
    finally:
        for name, fn in real.items():
            setattr(dist, name, fn)


def _precision_rows(report: Any) -> dict[str, tuple[torch.dtype, ...]]:
    return {row.part: row.dtypes for row in report.rows}


def ddp_precision_reports() -> dict[str, Any]:
    """amp_fx.precision_report(DDP(model), dtype="bf16") without a comm hook and with torch's
    fp16_compress_hook (bf16_compress_hook needs NCCL), against the dtype DDP put on the wire in
    one backward: the hook's ``dist.all_reduce`` (recorded), or without a hook the gradients' own
    (the bucket's)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    out: dict[str, Any] = {}
    for name, hook in (("none", None), ("fp16_compress", default_hooks.fp16_compress_hook)):
        model = DDP(make_model("seq"))
        if hook is not None:
            model.register_comm_hook(None, hook)
        with _wire_dtypes(("all_reduce",)) as seen:
            model(torch.randn(2, 8)).sum().backward()
        report = amp_fx.precision_report(model, dtype="bf16")
        wrapped = amp_fx.precision_report(amp_fx.compile(model, dtype="bf16", backend="aot_eager"))
        out[name] = {
            "reported": _precision_rows(report)["all_reduce (DDP gradients)"],
            "wrapped": _precision_rows(wrapped)["all_reduce (DDP gradients)"],
            "hook_sent": sorted(set(seen["all_reduce"]), key=str),
            "grad_dtypes": sorted({p.grad.dtype for p in model.parameters()}, key=str),
            "downgrades": sorted(d.value for d in report.downgrades),
        }
    return out


def fsdp_precision_reports() -> dict[str, Any]:
    """amp_fx.precision_report on FSDP2 with MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)
    on the first Linear's fully_shard and, on the root's (holding the last Linear), the same policy
    ("same") or one without reduce_dtype ("root_without_reduce_dtype", the planted downgrade):
    the reported gather/reduce dtypes against those FSDP2 sent in one forward and backward."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    out: dict[str, Any] = {}
    no_reduce = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    for name, root_mp in (("same", mp), ("root_without_reduce_dtype", no_reduce)):
        model = make_model("seq")
        fully_shard(model[0], mp_policy=mp)
        fully_shard(model, mp_policy=root_mp)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            report = amp_fx.precision_report(model, strict=False)
        try:
            amp_fx.precision_report(model, strict=True)
            strict = ""
        except amp_fx.AmpFxError as e:
            strict = str(e)
        with _wire_dtypes(
            ("all_gather_single", "reduce_scatter_single", "all_gather_into_tensor", "reduce_scatter_tensor")
        ) as seen:
            model(torch.randn(2, 8)).float().sum().backward()
        rows = _precision_rows(report)
        gathered = seen["all_gather_single"] + seen["all_gather_into_tensor"]
        reduced = seen["reduce_scatter_single"] + seen["reduce_scatter_tensor"]
        out[name] = {
            "gather": rows["all_gather (FSDP2 parameters)"],
            "reduce": rows["reduce_scatter (FSDP2 gradients)"],
            "gather_sent": sorted(set(gathered), key=str),
            "reduce_sent": sorted(set(reduced), key=str),
            "compute": report.compute_dtype,
            "warnings": [str(w.message) for w in caught if issubclass(w.category, amp_fx.AmpFxWarning)],
            "strict": strict,
        }
    return out
