"""The device record of a scaler's most recent skipped step, and its wiring.

:class:`SkipRecord` is kept by ``amp_fx.GradScaler`` (and so by ``compile_step``, whose finish
traces the same calls into its graph). At each step it counts the step and, where the step was
skipped, keeps its index, the per-gradient flags of the fused unscale kernel and the forward
watch's first op, all on the device; :meth:`SkipRecord.report` reads them when asked.

Both users go through the same three doors:

* :meth:`SkipRecord.attach`: what the record reports on (parameter names under the root module,
  the forward watch, the wrapper prefixes of its module paths, the ranks whose forward records are
  combined). ``GradScaler.watch(model)`` and ``compile_step`` call it; a scaler that was told
  nothing calls :meth:`SkipRecord.attach_found` at its first unscale, which attaches the model
  compiled with ``watch_nonfinite=True`` that holds the optimizer's parameters, if there is one.
* :meth:`SkipRecord.take_first_op`: the forward watch's record since the last step.
* :meth:`SkipRecord.close_`: the end of a step: the forward record combined across ranks
  (unless the found-inf all-reduce already carried it), then recorded.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Sequence
from typing import Any

import torch

from amp_fx._common.report import warn
from amp_fx._common.unwrap import unwrap_compiled
from amp_fx._dist.found_inf import combine_first_op, ranks_of
from amp_fx.overflow.report import WATCH_HINT, OverflowReport
from amp_fx.overflow.watch import ForwardWatch, compiled_models, watched_models
from amp_fx.passes.watch_nonfinite import NONE

__all__ = ["SkipRecord", "root_names", "strip_wrappers", "SKIPS_IN_A_ROW_WARNING"]

_WRAPPER_PREFIXES = ("module.",)

SKIPS_IN_A_ROW_WARNING = 10
"""Skipped steps in a row after which the scaler warns, asked or not: ten back-offs divide the
scale by 1,024 (torch's default ``backoff_factor`` of 0.5) with no step taken. A fresh run from
torch's ``init_scale`` of 2**16 skips a few steps at most; ten is a scale set far too high, or
gradients that are non-finite at any scale."""


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
            path = path[len(prefix) :]
        elif path == prefix[:-1]:
            path = ""
    return path


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
        self.scales: torch.Tensor | None = None  # fp32 [2]: its scale, and the scale its update left
        self.run: torch.Tensor | None = None  # int64: skipped steps in a row, up to the last update
        self.run_at: torch.Tensor | None = None  # int64: the run the last skipped step ended
        self._host_run = 0  # host_saw: skipped steps in a row, as seen on the host
        self.names: dict[int, str] = {}
        self.prefixes: tuple[str, ...] = _WRAPPER_PREFIXES
        self.watch: ForwardWatch | None = None
        self.how_to_watch = WATCH_HINT
        """The call that would watch the forward, for a report that names no op for want of a watch."""
        # DDP/FSDP2 (amp_fx._dist.found_inf.ranks_of): the ranks whose forward records are combined
        # at each update (every rank then names the op), or None on one process.
        self.group: Any = None
        self.attached = False
        """Whether :meth:`attach` was called, or :meth:`attach_found` has looked (it looks once)."""
        self.unattached: str | None = None
        """Why :meth:`attach_found` attached nothing though a watched model is alive (several of
        them hold the parameters, or none does); None otherwise."""

    # ------------------------------------------------------------------ wiring
    def attach(
        self,
        model: torch.nn.Module,
        *,
        watch: ForwardWatch | None,
        prefixes: tuple[str, ...] = _WRAPPER_PREFIXES,
        how_to_watch: str = WATCH_HINT,
    ) -> None:
        """Report on ``model``: gradients named as its root module names its parameters (through
        DDP, ``torch.compile`` and ``amp_fx.compile`` wrappers), the first forward op from ``watch``
        (None: not watched), its module path stripped of ``prefixes`` (the wrappers the forward was
        recorded under). With a watch, the forward records of the ranks that train ``model``
        together (``ranks_of``: DDP's group, or FSDP2's mesh) are combined at each step: every such
        rank must attach, or the others wait for it. ``how_to_watch``: the call a report without a
        watch points at."""
        self.names = root_names(model)[1]
        self.how_to_watch = how_to_watch
        self.watch = watch
        self.prefixes = prefixes
        self.group = ranks_of(model) if watch is not None else None
        self.attached, self.unattached = True, None

    def attach_found(self, optimizer: torch.optim.Optimizer) -> None:
        """Without :meth:`attach`: attach the model compiled with ``watch_nonfinite=True`` whose
        parameters ``optimizer`` holds, once, as ``attach`` would for it (under DDP, the DDP module
        its forward ran in). Several such models, or watched models that all hold other
        parameters: nothing is attached, and :attr:`unattached` says why.

        The outcome depends on the compiled modules alive and the optimizer's parameters only, so
        every rank of a distributed run decides alike (and joins the same collectives)."""
        if self.attached:
            return
        self.attached = True
        models = watched_models()
        ids = {id(p) for group in optimizer.param_groups for p in group["params"]}
        if not models:  # nothing was asked to be watched: the gradients named after the compiled model
            self._name_after_compiled(ids)
            return
        holding = [(m, w) for m, w in models if any(id(p) in ids for p in m.parameters())]
        if len({id(w) for _, w in holding}) == 1:
            model, watch = holding[0]
            ddp = watch.ddp
            self.attach(ddp if ddp is not None else model, watch=watch)
            return
        if not holding:
            self._name_after_compiled(ids)
        kinds = ", ".join(type(m).__name__ for m, _ in (holding or models))
        self.unattached = (
            f"the optimizer's parameters belong to {len(holding)} models compiled with watch_nonfinite=True "
            f"({kinds}), so the scaler cannot tell whose forward to name"
            if holding
            else f"{len(models)} model(s) compiled with watch_nonfinite=True ({kinds}) hold none of the "
            "optimizer's parameters"
        )

    def _name_after_compiled(self, ids: set[int]) -> None:
        """Name the gradients after the one module compiled by ``amp_fx.compile`` that holds
        parameters of ``ids`` (no watch, so nothing is combined across ranks); by position where
        none or several do (``<parameter N>``: the scaler cannot know the names)."""
        holding = [m for m in compiled_models() if any(id(p) in ids for p in m.parameters())]
        if len(holding) == 1:
            self.names = root_names(holding[0])[1]

    # ------------------------------------------------------------------ device state
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
        self.scales = torch.full((2,), float("nan"), dtype=torch.float32, device=device)
        self.run = torch.zeros((), dtype=torch.int64, device=device)
        self.run_at = torch.zeros((), dtype=torch.int64, device=device)

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

    # ------------------------------------------------------------------ a step
    def take_first_op(self, device: torch.device) -> torch.Tensor | None:
        """The forward watch's record since the last step (int64 0-dim; -1 if the watch has not run),
        and a fresh start for the next; None without a watch."""
        if self.watch is None:
            return None
        taken = self.watch.take()
        return torch.full((), NONE, dtype=torch.int64, device=device) if taken is None else taken

    def close_(
        self,
        found_inf: torch.Tensor,
        flags: torch.Tensor,
        first_op: torch.Tensor | None,
        combined: tuple[torch.Tensor, torch.Tensor] | None = None,
        scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        """The end of one step: ``first_op`` (:meth:`take_first_op`) combined across the ranks of
        :attr:`group` in one all-reduce, unless ``combined`` already holds (record, rank) from the
        found-inf all-reduce (FSDP2), then :meth:`record_`. Functional collectives and in-place
        device ops only: it runs eagerly in ``GradScaler.update`` and traced in ``compile_step``'s
        finish alike."""
        rank = None
        if combined is not None:
            first_op, rank = combined
        elif first_op is not None and self.group is not None:
            first_op, rank = combine_first_op(first_op, self.group, found_inf.device)
        self.record_(found_inf, flags, first_op, rank, scales)

    def record_(
        self,
        found_inf: torch.Tensor,
        flags: torch.Tensor,
        first_op: torch.Tensor | None,
        first_rank: torch.Tensor | None = None,
        scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        """One ``update()``: where ``found_inf``, keep this step's index, flags and forward record
        (``first_rank``: the rank it came from, when combined across ranks) and ``scales`` (the
        scale the step ran at, and the one its update left). In-place device ops only, so the same
        code runs eagerly and in ``compile_step``'s graph."""
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
        assert self.scales is not None and self.run is not None and self.run_at is not None
        if scales is not None:
            now = torch.stack([s.reshape(()).to(self.scales) for s in scales])
            self.scales.copy_(torch.where(skipped, now, self.scales))
        self.run.copy_(torch.where(skipped, self.run + 1, torch.zeros_like(self.run)))
        self.run_at.copy_(torch.where(skipped, self.run, self.run_at))

    def host_saw(self, skipped: bool) -> None:
        """Whether this step was skipped, as read on the host by a caller that reads it anyway
        (torch's ``StepMode.HOST_SYNC`` step; ``compile_step``'s warm-up), once per step. Warns
        once a run of skipped steps reaches :data:`SKIPS_IN_A_ROW_WARNING`, whether or not
        ``overflow_report()`` is called. It adds no read: the sync-free paths (``StepMode.MASKED``,
        ``compile_step`` after its warm-up) are not seen, and their reports give the run instead."""
        self._host_run = self._host_run + 1 if skipped else 0
        if self._host_run == SKIPS_IN_A_ROW_WARNING:
            warn(
                f"amp_fx: {SKIPS_IN_A_ROW_WARNING} optimizer steps in a row were skipped (their gradients held "
                f"an inf or NaN), so the model has not trained for {SKIPS_IN_A_ROW_WARNING} steps. "
                f"overflow_report() (of the scaler or the compiled step) says why, with the scale at the "
                f"skipped step. Every gradient non-finite from the first steps on means init_scale is too "
                f"large; one layer named every time means that layer overflows at any scale "
                f"(docs/overflow.md).",
                UserWarning,
            )

    def report(self, skipped_steps: torch.Tensor) -> OverflowReport | None:
        """The one host read: None if no step was skipped since the last report."""
        if self.pending is None:
            return None
        assert self.step is not None and self.flags is not None and self.first_op is not None
        assert self.first_rank is not None
        assert self.scales is not None and self.run_at is not None
        values = torch.stack(
            [
                self.pending.to(torch.int64),
                self.step,
                self.first_op,
                self.first_rank,
                skipped_steps.to(self.step),
                self.run_at,
            ]
        ).tolist()
        pending, step, first_code, first_rank, skipped, in_a_row = values
        flags = self.flags.tolist()
        scale, scale_after = (None if v != v else v for v in self.scales.tolist())  # nan: not recorded
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
            first = dataclasses.replace(first, module=strip_wrappers(first.module, self.prefixes))
        watched = self.watch.watched if self.watch is not None else ()
        unwatched = self.watch.backward_unwatched if self.watch is not None else ""
        return OverflowReport(
            step=step,
            gradients=tuple(names),
            first_op=first,
            skipped=skipped,
            watched=watched,
            backward_unwatched=unwatched,
            scale=scale,
            scale_after=scale_after,
            in_a_row=in_a_row,
            every_gradient=bool(flags) and all(flags),
            checked=len(flags),
            how_to_watch=self.how_to_watch,
        )
