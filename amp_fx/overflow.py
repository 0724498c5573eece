"""Why was a step skipped? Overflow provenance kept on the device (issue 21).

Three records, all device tensors updated without a host read:

* :class:`ForwardWatch`: with ``watch_nonfinite=True``, each rewritten graph returns the position
  of its first op whose low-precision output held an inf/NaN (``amp_fx.passes.watch_nonfinite``);
  the watch keeps the first such op since it was last taken, across graphs and micro-batches.
* :class:`SkipRecord`: kept by ``amp_fx.GradScaler`` (and so by ``compile_step``). At each
  ``update()`` it counts the step and, where the step was skipped, keeps its index, the
  per-gradient flags of the fused unscale kernel and the forward watch's first op.
* :class:`OverflowReport`: what ``overflow_report()`` returns after its one host read.

And :func:`skip_aware`, which makes an LR scheduler stand still on skipped steps without a read.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from amp_fx._common.unwrap import layers, unwrap_compiled
from amp_fx.passes.watch_nonfinite import NONE, WatchedOp

__all__ = ["OverflowReport", "FirstOp", "skip_aware"]

# A forward record is graph index * _GRAPH_STRIDE + position in that graph's watched ops.
_GRAPH_STRIDE = 1 << 24


@dataclass(frozen=True)
class FirstOp:
    """The first op (in graph order, in the first graph that ran it) whose output was non-finite."""

    module: str
    """Module path under the root module ("" for code of the root itself)."""
    op: str
    """ATen op, e.g. ``aten.mm``."""
    dtype: str
    """Output dtype (``fp16``/``bf16``)."""
    graph: int
    """Index of the captured graph (``amp_fx_records``) that holds it."""
    node: str
    """The node's name in that rewritten graph."""
    rank: int | None = None
    """Under DDP/FSDP2: the (global) rank whose forward it was, the lowest one if several; else None."""

    def __str__(self) -> str:
        where = f" on rank {self.rank}" if self.rank is not None else ""
        return f"{self.module or '<root>'} ({self.op}, {self.dtype}){where}"


@dataclass(frozen=True)
class OverflowReport:
    """The most recent skipped step, as read by ``overflow_report()``."""

    step: int
    """Index of the skipped optimizer step: how many ``update()`` calls (compiled steps) came before it."""
    gradients: tuple[str, ...]
    """Names (under the root module) of the parameters whose gradients held an inf/NaN."""
    first_op: FirstOp | None
    """The first non-finite low-precision forward output, or None (forward clean, or not watched)."""
    skipped: int
    """Skipped steps so far (the scaler's running count)."""

    def __str__(self) -> str:
        where = f"first inf at {self.first_op}" if self.first_op is not None else "forward finite or not watched"
        names = ", ".join(self.gradients[:3]) + (", ..." if len(self.gradients) > 3 else "")
        grads = f"{len(self.gradients)} gradients non-finite ({names})" if self.gradients else "no gradient non-finite"
        return f"step {self.step} skipped: {where}; {grads}"


class ForwardWatch:
    """The forward record shared by a compiled model's graphs (its backend and siblings)."""

    def __init__(self) -> None:
        self.ops: dict[int, list[WatchedOp]] = {}
        self.first: torch.Tensor | None = None
        """int64 0-dim: the first non-finite op since the last :meth:`take`, or -1."""

    def add_graph(self, index: int, ops: Sequence[WatchedOp]) -> None:
        if len(ops) >= _GRAPH_STRIDE:
            raise ValueError(f"amp_fx: graph {index} has {len(ops)} watched ops, more than {_GRAPH_STRIDE}")
        self.ops[index] = list(ops)

    def ran(self, index: int, position: torch.Tensor) -> None:
        """A graph ran; ``position`` is its in-graph record (-1 when its outputs were finite)."""
        code = torch.where(position == NONE, NONE, position + index * _GRAPH_STRIDE)
        if self.first is None:
            self.first = code.clone()
            return
        self.first.copy_(torch.where(self.first == NONE, code, self.first))

    def peek(self, device: torch.device) -> torch.Tensor:
        """The record so far (a copy; -1 before any run), without a fresh start."""
        if self.first is None:
            return torch.full((), NONE, dtype=torch.int64, device=device)
        return self.first.clone()

    def take(self) -> torch.Tensor | None:
        """The record since the last take (a copy), and a fresh start; None before any run."""
        if self.first is None:
            return None
        taken = self.first.clone()
        self.first.fill_(NONE)
        return taken

    def describe(self, code: int, rank: int | None = None) -> FirstOp | None:
        """The op a record names; ``rank``: the rank whose forward it was (a record combined across
        ranks names an op of that rank's graphs, the same as this rank's unless one recompiled)."""
        if code == NONE:
            return None
        graph, position = divmod(code, _GRAPH_STRIDE)
        ops = self.ops.get(graph, [])
        if position >= len(ops):
            return FirstOp(module="<unknown>", op=f"<op {position} of graph {graph}, not compiled on this rank>",
                           dtype="?", graph=graph, node="", rank=rank)
        op = ops[position]
        return FirstOp(module=op.module, op=op.op, dtype=op.dtype, graph=graph, node=op.node, rank=rank)


_WRAPPER_PREFIXES = ("module.",)


def root_names(model: torch.nn.Module) -> tuple[torch.nn.Module, dict[int, str]]:
    """The user's root module under DDP, ``torch.compile`` and ``amp_fx.compile`` wrappers, and
    its parameter names by ``id``: the same names on every rank. A parameter shared by several
    modules (a tied embedding and head) is named as ``named_parameters()`` names it: by its first
    path."""
    root = unwrap_compiled(model, ddp=True)
    assert isinstance(root, torch.nn.Module)
    return root, {id(p): n for n, p in root.named_parameters()}


def strip_wrappers(path: str, prefixes: Sequence[str]) -> str:
    """A module path recorded under a wrapper (``module.`` of DDP), as a name under the root: each
    prefix removed once, in order (a model's own submodule named ``model`` keeps its name)."""
    for prefix in prefixes:
        if path.startswith(prefix):
            path = path[len(prefix):]
        elif path == prefix[:-1]:
            path = ""
    return path


def forward_watch(model: object) -> ForwardWatch | None:
    """The :class:`ForwardWatch` of a model compiled with ``watch_nonfinite=True`` (under DDP and
    ``torch.compile`` wrappers too), else None."""
    for layer in layers(model, any_module_attr=True):
        watch = getattr(layer, "amp_fx_watch", None)
        if isinstance(watch, ForwardWatch):
            return watch
    return None


class SkipRecord:
    """A scaler's device record of its most recent skipped step (see the module docstring)."""

    def __init__(self) -> None:
        self.params: list[weakref.ref[torch.Tensor]] = []
        self._index: dict[int, int] = {}
        self.device: torch.device | None = None
        self.updates: torch.Tensor | None = None  # int64: update() calls so far
        self.step: torch.Tensor | None = None  # int64: index of the last skipped step, -1
        self.pending: torch.Tensor | None = None  # bool: a skip since the last report
        self.flags: torch.Tensor | None = None  # fp32 [len(params)]: its non-finite gradients
        self.first_op: torch.Tensor | None = None  # int64: its forward record, -1
        self.first_rank: torch.Tensor | None = None  # int64: the rank whose forward that was, -1
        self.names: dict[int, str] = {}
        self.prefixes: tuple[str, ...] = _WRAPPER_PREFIXES
        self.watch: ForwardWatch | None = None
        # DDP/FSDP2 (amp_fx._dist.found_inf.ranks_of): the ranks whose forward records are combined
        # at each update (every rank then names the op), or None on one process.
        self.group: Any = None

    def init(self, device: torch.device) -> None:
        if self.device is not None:
            return
        self.device = device
        self.updates = torch.zeros((), dtype=torch.int64, device=device)
        self.step = torch.full((), NONE, dtype=torch.int64, device=device)
        self.pending = torch.zeros((), dtype=torch.bool, device=device)
        self.flags = torch.zeros(len(self.params), dtype=torch.float32, device=device)
        self.first_op = torch.full((), NONE, dtype=torch.int64, device=device)
        self.first_rank = torch.full((), NONE, dtype=torch.int64, device=device)

    def register(self, params: Sequence[torch.Tensor]) -> list[int]:
        """Slots of ``params`` in :attr:`flags` (new parameters get new, zeroed slots)."""
        new = [p for p in params if id(p) not in self._index]
        for p in new:
            self._index[id(p)] = len(self.params)
            self.params.append(weakref.ref(p))
        if new and self.flags is not None:
            self.flags = torch.cat([self.flags, self.flags.new_zeros(len(new))])
        return [self._index[id(p)] for p in params]

    def step_flags(self, groups: Sequence[tuple[Sequence[torch.Tensor], torch.Tensor]]) -> torch.Tensor:
        """This step's flags in slot order, from (params, flags) pairs of the unscale calls."""
        assert self.flags is not None
        n = self.flags.numel()
        if len(groups) == 1:
            slots = self.register(groups[0][0])
            if slots == list(range(n)):
                return groups[0][1].to(self.flags.device)
        out = self.flags.new_zeros(n)
        for params, flags in groups:
            where = torch.tensor(self.register(params), dtype=torch.int64, device=out.device)
            if out.numel() != self.flags.numel():  # register grew the record
                out = torch.cat([out, out.new_zeros(self.flags.numel() - out.numel())])
            out.index_copy_(0, where, torch.maximum(out.index_select(0, where), flags.to(out.device)))
        return out

    def record_(self, found_inf: torch.Tensor, flags: torch.Tensor, first_op: torch.Tensor | None,
                first_rank: torch.Tensor | None = None) -> None:
        """One ``update()``: where ``found_inf``, keep this step's index, flags and forward record
        (``first_rank``: the rank it came from, when combined across ranks). In-place device ops
        only, so the same code runs eagerly and in ``compile_step``'s graph."""
        assert self.updates is not None and self.step is not None and self.flags is not None
        assert self.pending is not None and self.first_op is not None and self.first_rank is not None
        skipped = found_inf.reshape(()).to(self.device) != 0
        self.step.copy_(torch.where(skipped, self.updates, self.step))
        self.flags.copy_(torch.where(skipped, flags, self.flags))
        code = torch.full_like(self.first_op, NONE) if first_op is None else first_op.to(self.device)
        self.first_op.copy_(torch.where(skipped, code, self.first_op))
        rank = torch.full_like(self.first_rank, NONE) if first_rank is None else first_rank.to(self.device)
        self.first_rank.copy_(torch.where(skipped, rank, self.first_rank))
        self.pending.logical_or_(skipped)
        self.updates.add_(1)

    def report(self, skipped_steps: torch.Tensor) -> OverflowReport | None:
        """The one host read: None if no step was skipped since the last report."""
        if self.pending is None:
            return None
        assert self.step is not None and self.flags is not None and self.first_op is not None
        assert self.first_rank is not None
        values = torch.stack([self.pending.to(torch.int64), self.step, self.first_op, self.first_rank,
                              skipped_steps.to(self.step)]).tolist()
        pending, step, first_code, first_rank, skipped = values
        flags = self.flags.tolist()
        if not pending:
            return None
        self.pending.fill_(False)
        names = []
        for slot, bad in enumerate(flags):
            if not bad:
                continue
            p = self.params[slot]()
            name = self.names.get(id(p)) if p is not None else None
            names.append(name if name is not None else f"<parameter {slot}>")
        rank = None if first_rank == NONE else first_rank
        first = self.watch.describe(first_code, rank) if self.watch is not None else None
        if first is not None:
            first = FirstOp(module=strip_wrappers(first.module, self.prefixes), op=first.op, dtype=first.dtype,
                            graph=first.graph, node=first.node, rank=first.rank)
        return OverflowReport(step=step, gradients=tuple(names), first_op=first, skipped=skipped)


# ---------------------------------------------------------------------------------------------
# skip-aware LR scheduling

_SUPPORTED_SCHEDULERS = ("LambdaLR", "StepLR", "MultiStepLR", "CosineAnnealingLR", "LinearLR", "OneCycleLR",
                         "ExponentialLR", "ConstantLR", "MultiplicativeLR")


class _SkipAwareScheduler:
    """An LR scheduler that stands still on skipped steps, with no host read.

    Each ``step()`` computes the scheduler's next lr for every param group as if it advanced
    (``get_lr`` at ``last_epoch + 1``) and its current lr, both as device tensors, then sets the
    group's lr, a 0-dim float32 device tensor, to ``where(skipped, current, next)``. The epoch
    counter advances only where the step was not skipped: it lives on the device too
    (:attr:`epoch`), and the scheduler's own ``last_epoch`` (a Python int) counts calls.
    """

    def __init__(self, scheduler: Any, skipped: Any) -> None:
        self.scheduler = scheduler
        self._skipped = skipped
        opt = scheduler.optimizer
        device = _param_device(opt)
        self._device = device
        # A closed form in the epoch for each supported scheduler, as a function of a device epoch.
        self._lr_at = _closed_form(scheduler)
        self.epoch = torch.full((), scheduler.last_epoch, dtype=torch.float64, device=device)
        for group in opt.param_groups:
            lr = group["lr"]
            group["lr"] = (lr.detach().to(device=device, dtype=torch.float32) if isinstance(lr, torch.Tensor)
                           else torch.tensor(float(lr), dtype=torch.float32, device=device))

    def step(self) -> None:
        skipped = self._skipped().reshape(()).to(self._device)
        self.epoch.copy_(torch.where(skipped, self.epoch, self.epoch + 1))
        for i, (group, base) in enumerate(zip(self.scheduler.optimizer.param_groups, self.scheduler.base_lrs,
                                              strict=True)):
            group["lr"].copy_(self._lr_at(self.epoch, i, base).to(torch.float32))
        self.scheduler.last_epoch += 1

    def get_last_lr(self) -> list[torch.Tensor]:
        return [g["lr"] for g in self.scheduler.optimizer.param_groups]

    def state_dict(self) -> dict[str, Any]:
        return {"scheduler": self.scheduler.state_dict(), "epoch": self.epoch.clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state["scheduler"])
        self.epoch.copy_(state["epoch"])


def _param_device(opt: torch.optim.Optimizer) -> torch.device:
    for group in opt.param_groups:
        for p in group["params"]:
            return p.device
    return torch.device("cpu")


def _closed_form(s: Any) -> Any:
    """lr(epoch, base_lr) in device ops, for the schedulers whose lr is a closed form of the epoch."""
    name = type(s).__name__
    lr_sched = torch.optim.lr_scheduler
    if isinstance(s, lr_sched.LambdaLR):
        # The user's lambda is called with the device epoch (a float64 0-dim tensor): arithmetic
        # lambdas (``lambda e: 0.95 ** e``, ``lambda e: torch.clamp(e / 100, max=1)``) work; one
        # that branches on the value in Python (``min(1, e / 100)``) would read it on the host.
        lambdas = s.lr_lambdas
        return lambda e, i, base: base * torch.as_tensor(lambdas[i](e), dtype=torch.float64, device=e.device)
    if isinstance(s, lr_sched.StepLR):
        return lambda e, i, base: base * s.gamma ** torch.div(e, s.step_size, rounding_mode="floor")
    if isinstance(s, lr_sched.ExponentialLR):
        return lambda e, i, base: base * s.gamma ** e
    if isinstance(s, lr_sched.CosineAnnealingLR):
        return lambda e, i, base: s.eta_min + (base - s.eta_min) * (1 + torch.cos(math.pi * e / s.T_max)) / 2
    if isinstance(s, lr_sched.LinearLR):
        def linear(e: torch.Tensor, i: int, base: float) -> torch.Tensor:
            frac = torch.clamp(e, max=s.total_iters) / s.total_iters
            return base * (s.start_factor + (s.end_factor - s.start_factor) * frac)
        return linear
    if isinstance(s, lr_sched.ConstantLR):
        return lambda e, i, base: base * torch.where(e < s.total_iters, s.factor, 1.0)
    if isinstance(s, lr_sched.MultiStepLR):
        milestones = sorted(s.milestones.elements())
        def multistep(e: torch.Tensor, i: int, base: float) -> torch.Tensor:
            passed = sum((e >= m).to(torch.float64) for m in milestones)
            return base * s.gamma ** passed
        return multistep
    if isinstance(s, lr_sched.OneCycleLR):
        if s.cycle_momentum:
            raise TypeError("amp_fx.skip_aware: OneCycleLR with cycle_momentum=True also schedules momentum, "
                            "which skip_aware does not hold back; pass cycle_momentum=False")
        return _one_cycle(s)
    raise TypeError(f"amp_fx.skip_aware: {name} is not supported; supported: {', '.join(_SUPPORTED_SCHEDULERS)} "
                    "(schedulers whose lr is a closed form of the epoch). For others, read "
                    "scaler.last_step_skipped yourself (a host read) before scheduler.step()")


def _one_cycle(s: Any) -> Any:
    phases = s._schedule_phases
    anneal = s._anneal_func_type if hasattr(s, "_anneal_func_type") else ("cos" if s.anneal_func.__name__ ==
                                                                           "_annealing_cos" else "linear")

    def interp(start: torch.Tensor, end: torch.Tensor, pct: torch.Tensor) -> torch.Tensor:
        if anneal == "cos":
            return end + (start - end) / 2.0 * (torch.cos(math.pi * pct) + 1)
        return (end - start) * pct + start

    def lr(e: torch.Tensor, i: int, base: float) -> torch.Tensor:
        group = s.optimizer.param_groups[i]
        result = torch.zeros((), dtype=torch.float64, device=e.device)
        start_step = 0.0
        done = torch.zeros((), dtype=torch.bool, device=e.device)
        for i, phase in enumerate(phases):
            end_step = float(phase["end_step"])
            here = ~done & ((e <= end_step) | torch.tensor(i == len(phases) - 1, device=e.device))
            pct = (e - start_step) / (end_step - start_step)
            value = interp(torch.tensor(float(group[phase["start_lr"]]), dtype=torch.float64, device=e.device),
                           torch.tensor(float(group[phase["end_lr"]]), dtype=torch.float64, device=e.device), pct)
            result = torch.where(here, value, result)
            done = done | here
            start_step = end_step
        return result
    return lr


def skip_aware(scheduler: Any, scaler: Any) -> _SkipAwareScheduler:
    """Wrap an LR scheduler so that it does not advance on a step the scaler skipped (no host read).

    ``scaler`` is an ``amp_fx.GradScaler`` or a ``CompiledStep`` (anything with a
    ``last_step_skipped`` 0-dim bool tensor). Call the wrapper's ``step()`` where you called the
    scheduler's, after ``scaler.update()`` (or after the compiled step). The optimizer's lr becomes
    a 0-dim float32 device tensor (every ``torch.optim`` optimizer takes one), set each step to
    ``where(skipped, current lr, next lr)``; the schedule's epoch is a device counter that counts
    only steps that were not skipped (the wrapper's ``epoch``).

    Supported: LambdaLR (lambdas that accept a tensor epoch), StepLR, MultiStepLR, ExponentialLR,
    ConstantLR, LinearLR, CosineAnnealingLR, OneCycleLR: their lr is a closed form of the epoch.
    Others (ReduceLROnPlateau, CyclicLR, SequentialLR, chained) raise TypeError.
    Without the wrapper, schedulers keep torch's behaviour: they advance on skipped steps too.
    """
    if not hasattr(scaler, "last_step_skipped"):
        raise TypeError(f"amp_fx.skip_aware: scaler must be an amp_fx.GradScaler or CompiledStep, got "
                        f"{type(scaler).__name__}")
    return _SkipAwareScheduler(scheduler, lambda: scaler.last_step_skipped)
