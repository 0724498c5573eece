"""The traced finish of a compiled step: once per accumulation window, one full graph.

``torch.compile(fullgraph=True)`` of :meth:`Finish._finish_impl`: the fused unscale + non-finite
check (``torch.ops.amp_fx.unscale_check_`` or ``unscale_check_norm_``), the clip coefficient and
its multiply, the optimizer step skipped on the device, the scale update
(``torch.ops.amp_fx.update_scale_``) and the scaler's skip record (``amp_fx.overflow``).

* Optimizers without ``_step_supports_amp_scaling`` step inside the graph, masked
  (:meth:`Finish._masked_step`): the parameters and state tensors are copied, the optimizer's step
  function is traced (the ``torch.optim`` step wrapper itself is skipped: it inserts
  ``torch._dynamo.graph_break()`` around the step; its hooks are run by the step instead,
  ``amp_fx.step.follow``), and ``where(found_inf, old, new)`` puts back the old values on a
  non-finite step.
* ``fused=True`` optimizers cannot be traced (torch wraps ``_fused_adam`` & co. in
  ``torch.compiler.disable``), and need not be: their single fused kernel takes
  ``grad_scale``/``found_inf`` and skips on the device. The graph computes the flags and
  ``optimizer.step()`` runs right after it (:meth:`Finish.step`), exactly as
  ``torch.amp.GradScaler.step`` calls it.

The loss-scale rules (inverse scale and its guard, scale update, masked restore) are
``amp_fx.scaler.rules`` and ``amp_fx.scaler.snapshot``: the functions ``GradScaler`` calls.
"""

from __future__ import annotations

import contextlib
import enum
import inspect
import time
from collections.abc import Callable
from typing import Any

import torch

from amp_fx._common import compat as _compat
from amp_fx._common.downstream import Backend, backend_name, resolve_backend
from amp_fx._common.fresh_code import fresh_callable
from amp_fx._common.progress import progress_log, timed
from amp_fx._common.report import Reporter
from amp_fx.backend.weight_cache import StepWriter
from amp_fx.kernels.unscale import unscale_check_, unscale_check_norm_
from amp_fx.overflow.record import SkipRecord
from amp_fx.scaler import rules
from amp_fx.scaler.snapshot import copy_state, restore_where_
from amp_fx.step.follow import OptimizerFollower, group_values
from amp_fx.step.shards import StepShards, amp_flags

__all__ = ["Finish", "GradNorm", "raw_step"]


class GradNorm(enum.Enum):
    """How the total gradient norm for clipping is computed.

    * ``TORCH`` (the default): ``clip_grad_norm_``'s own formula (``_foreach_norm``, then the
      norm of the norms) after the fused unscale: bit for bit torch's clipping, so the step is
      bit for bit the eager recipe (``unscale_`` + ``clip_grad_norm_``).
    * ``FUSED`` (opt-in, faster): ``torch.ops.amp_fx.unscale_check_norm_`` returns the sum of
      squares in the same pass that unscales (one read of the gradients fewer: 16 instead of 20
      bytes per fp32 element with the clip multiply). What it gives up: the sum is accumulated
      in fp32 with partial sums in fp64, in another order than ``clip_grad_norm_``, so the norm,
      and with it every clipped step, can differ from the eager recipe in the last bits (a few
      fp32 ulps per step; ``tests/step/test_step.py`` pins 2^-20 relative to the parameters' movement).
      On sharded models the local sums are combined across ranks: one sum on FSDP2's default
      layout, else one per set of mesh dimensions the gradients are sharded on, so a replicated
      gradient counts once (``amp_fx._dist.step.LocalShards.global_sum``).
    """

    FUSED = "fused"
    TORCH = "torch"


def raw_step(optimizer: torch.optim.Optimizer) -> Callable[[torch.optim.Optimizer], Any]:
    """The optimizer's step function without torch's wrappers (hooks, graph breaks, no_grad)."""
    return inspect.unwrap(type(optimizer).step)


# The optimizers whose own step, with every hyperparameter a Python number, passes only numbers
# as add_'s alpha and addcmul_/addcdiv_'s value (checked by tests/step/test_step.py, bit for bit, on
# 2.11, 2.13 and 2.15). Not Adagrad: its lr divided by a step-dependent term is a tensor when traced
# (turning the rewrite off would read it on the host each step); not Adam, AdamW, Adamax, NAdam,
# RAdam, ASGD: their step-counter arithmetic in fp32 differs anyway (docs/compiled-step.md, "Limitations").
_EAGER_ROUNDING_STEPS = tuple(
    inspect.unwrap(cls.step) for cls in (torch.optim.SGD, torch.optim.RMSprop, torch.optim.Adadelta)
)


def _step_as_eager(optimizer: torch.optim.Optimizer) -> contextlib.AbstractContextManager[None]:
    """Trace the optimizer's ``add_(g, alpha=a)``, ``addcmul_``/``addcdiv_(.., value=a)`` as eager
    computes them, one rounding each.

    Dynamo rewrites them into a multiply and an add (two roundings where eager's kernel rounds
    once: ``amp_fx._common.compat.dynamo_decomposes_number_scalars``), so SGD (2.11), RMSprop and Adadelta
    drifted from the eager recipe in the last bits. Only for the steps of ``_EAGER_ROUNDING_STEPS``
    with every hyperparameter a Python number: a scheduled lr is a tensor inside the step
    (``OptimizerFollower.lrs_as_tensors``), which Dynamo traces without a host read only through
    that rewrite; it then stays within the scheduler test's tolerance.
    """
    own_step = raw_step(optimizer) in _EAGER_ROUNDING_STEPS
    numbers = not any(isinstance(v, torch.Tensor) for g in group_values(optimizer) for v in g.values())
    return _compat.number_scalars_as_eager() if own_step and numbers else contextlib.nullcontext()


def _steps_to_device_(optimizer: torch.optim.Optimizer) -> None:
    """Move the step counters that ``capturable=False`` optimizers keep on the CPU (Adam, AdamW...)
    to their parameter's device, as Dynamo does when it traces an optimizer step
    (``OptimizerVariable.move_step_if_cpu``), but before the finish snapshots the state.

    Left on the CPU beside CUDA parameters, the traced step mixed devices (the snapshot copied the
    CPU counters, Dynamo then moved the live ones), and inductor's finish, which compiled a C++
    kernel for them, crashed the process (a segmentation fault, seen on an H200 with torch 2.11
    and ``Adam(foreach)``). The traced step does its step-counter arithmetic in tensors
    on the device either way; an eager ``optimizer.step()`` later reads such a counter with
    ``item()``, as it does after ``torch.compile``.
    """
    for p, state in optimizer.state.items():
        step = state.get("step") if isinstance(p, torch.Tensor) and p.device.type != "cpu" else None
        if isinstance(step, torch.Tensor) and step.device.type == "cpu":
            state["step"] = step.to(p.device)


class _CountingBackend:
    """A torch.compile backend that delegates and counts the graphs it compiles."""

    def __init__(self, backend: str | Backend, label: str) -> None:
        self._backend = backend
        self._inner: Backend = resolve_backend(backend)
        self.graphs = 0
        self.label = label
        self._since: float | None = None

    def _what(self) -> str:
        return f"the optimizer step ({self.label}, graph {self.graphs}, backend {backend_name(self._backend)})"

    def announce(self) -> None:
        """The first compiled step is starting: say so before Dynamo traces the optimizer step (on
        a 2-layer Llama with AdamW, tens of seconds before this backend is called), and time the
        compile line from here."""
        progress_log.info("amp_fx: compile_step: compiling %s ...", self._what())
        self._since = time.perf_counter()

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        what, since, self._since = self._what(), self._since, None
        self.graphs += 1
        with timed(f"amp_fx: compile_step: compiled {what}", since=since):
            return self._inner(gm, example_inputs)


class Finish:
    """A compiled step's finish: what its graph reads (the parameters and their slots in the skip
    record, the optimizer, the clip settings, the weight cache's writer, the FSDP2 view) and the
    compiled graph itself (compiled on a code object of its own: its own Dynamo cache entries)."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        params: list[torch.Tensor],
        record: SkipRecord,
        *,
        fused: bool,
        max_grad_norm: float | None,
        grad_norm: GradNorm,
        writer: StepWriter | None,
        shards: StepShards,
        backend: str | Backend,
        step_fn: Callable[[torch.optim.Optimizer], Any] | None = None,
    ) -> None:
        self.optimizer = optimizer
        self.record = record
        self.max_grad_norm = max_grad_norm
        self.grad_norm = grad_norm
        self.fused = fused  # the optimizer skips on the device itself (``_step_supports_amp_scaling``)
        # the optimizer's own step, or the bf16 training state's (amp_fx.step.lowprec)
        self.raw_step = raw_step(optimizer) if step_fn is None else step_fn
        self.shards = shards
        self.writer = writer
        self.params = params
        self.slots = record.register(params)
        self.backend = _CountingBackend(backend, type(optimizer).__name__)
        self.compiled = torch.compile(
            fresh_callable(self._finish_impl), backend=self.backend, fullgraph=True, dynamic=False
        )
        self._steps_placed = False

    def set_params(self, params: list[torch.Tensor]) -> None:
        """The optimizer's parameters changed: new slots in the skip record (new parameters, new
        slots), a new writer for the weight cache, a new FSDP2 view."""
        self.params = params
        self.slots = self.record.register(params)
        self._steps_placed = False
        if self.writer is not None:
            self.writer = StepWriter(self.writer.cache, params)
        self.shards.reset()

    def step(
        self, scale_state: tuple[rules.ScaleState, rules.ScaleRule], follow: OptimizerFollower, report: Reporter
    ) -> None:
        """One compiled optimizer step: the hooks and the weight cache's writer around the graph,
        then a fused optimizer's own step; a recompile the step did not cause is reported."""
        before, writer, opt = self.backend.graphs, self.writer, self.optimizer
        if not self.fused and not self._steps_placed:
            _steps_to_device_(opt)
            self._steps_placed = True
        with torch.no_grad():
            follow.run_pre_hooks()
            if writer is not None:
                writer.before_finish()
            with follow.lrs_as_tensors(), _step_as_eager(opt):  # (sees the lrs as tensors)
                sharded = self.shards.before_finish(opt, self.params)
                try:
                    if self.backend.graphs == 0:
                        self.backend.announce()
                    flags = self.compiled(*scale_state)
                    if sharded is not None and self.fused:
                        self.shards.fused_step(self.raw_step, *flags)
                finally:
                    if sharded is not None:
                        sharded.after_finish()
            if writer is not None:
                writer.after_finish()
            if self.fused and sharded is not None:
                follow.run_post_hooks()
            elif self.fused:
                with amp_flags(opt, *flags):
                    opt.step()  # its own wrapper runs the hooks
                if writer is not None:
                    writer.after_fused_step()
            else:
                follow.run_post_hooks()
                if writer is not None:
                    writer.after_hooks()
        if self.backend.graphs != before and not follow.expect_recompile:
            report.did_less(
                "finish recompiled",
                f"amp_fx.compile_step: the optimizer part recompiled ({self.backend.graphs} graphs so "
                "far): something it guards on changed between steps (the param groups, a hyperparameter "
                "set to a new object, which parameters have gradients). Each recompile costs compile "
                "time, and Dynamo stops compiling after 8; keep them fixed between steps.",
            )
        follow.expect_recompile = False

    # ------------------------------------------------------------------ traced
    def _finish_impl(
        self, state: rules.ScaleState, rule: rules.ScaleRule
    ) -> tuple[torch.Tensor | None, torch.Tensor] | None:
        inv_scale, found_inf = rules.inv_scale_and_guard(state.scale, dynamic=rule.dynamic)
        sharded = self.shards.view  # FSDP2: local shards, the flag and the norm combined across ranks
        params = self.params if sharded is None else sharded.params
        present = [i for i, p in enumerate(params) if p.grad is not None]
        grads: list[torch.Tensor] = [params[i].grad for i in present]  # type: ignore[misc]  # present: not None
        # amp_fx/overflow: which gradients held an inf/NaN, from the same kernel pass, and the
        # forward watch's first op; FSDP2 combines both across ranks in the found-inf all-reduce.
        flags = torch.zeros(len(grads), dtype=torch.float32, device=inv_scale.device)
        first_op = self.record.take_first_op(inv_scale.device)
        combined: tuple[torch.Tensor, torch.Tensor] | None = None
        max_norm = self.max_grad_norm
        fused_norm = max_norm is not None and self.grad_norm is GradNorm.FUSED
        grad_scale: torch.Tensor | None = None
        if self.fused and max_norm is None:
            # As torch.amp.GradScaler.step: check only, the fused kernel divides by grad_scale.
            unscale_check_(grads, found_inf, torch.ones_like(inv_scale), flags=flags)
            grad_scale = state.scale.clone()
        elif fused_norm:  # sharded: one sum per set of groups the gradients are sharded over
            segments = None if sharded is None else sharded.norm_segments(present)
            sum_sq = unscale_check_norm_(grads, found_inf, inv_scale, flags=flags, segments=segments)
        else:
            unscale_check_(grads, found_inf, inv_scale, flags=flags)
        if sharded is not None:  # one all-reduce: the flag, the gradients' flags, the forward record
            found_inf, flags, combined = sharded.combine_found_inf(found_inf, flags, first_op)
        if max_norm is not None:
            if fused_norm:
                total_norm = (sum_sq if sharded is None else sharded.global_sum(sum_sq, present)).sqrt()
            else:
                norms = torch._foreach_norm(grads, 2.0)
                total_norm = (
                    torch.linalg.vector_norm(torch.stack(norms), 2.0)
                    if sharded is None
                    else sharded.global_norm(norms, present)
                )
            # clip_grad_norm_'s coefficient, written as it writes it (float / tensor is
            # reciprocal * float), so that with GradNorm.TORCH the bits are the same.
            clip_coef = max_norm / (total_norm + 1e-6)
            torch._foreach_mul_(grads, torch.clamp(clip_coef, max=1.0))
        if not self.fused:
            self._masked_step(found_inf)
            if self.writer is not None:
                self.writer.in_finish()  # the low-precision copies, in the update's pass
        before = state.scale.clone()  # the scale this step ran at, for the skip record
        rules.update_scale_(state, rule, found_inf)
        rules.record_step_(state, found_inf)
        self._record_skip(found_inf, present, flags, first_op, combined, (before, state.scale))
        if self.fused:
            return grad_scale, found_inf
        return None

    def _record_skip(
        self,
        found_inf: torch.Tensor,
        present: list[int],
        flags: torch.Tensor,
        first_op: torch.Tensor | None,
        combined: tuple[torch.Tensor, torch.Tensor] | None,
        scales: tuple[torch.Tensor, torch.Tensor],
    ) -> None:
        """The scaler's skip record (amp_fx/overflow), traced into the finish: the flags of the
        gradients present, in the record's slots, the forward watch's first op (combined across
        ranks, with the rank that saw it: ``SkipRecord.close_``) and the scale before and after."""
        record = self.record
        assert record.flags is not None
        n = record.flags.numel()
        slots = [self.slots[i] for i in present]
        if slots == list(range(n)):
            step_flags = flags
        else:
            step_flags = record.flags.new_zeros(n).index_copy(
                0, torch.tensor(slots, dtype=torch.int64, device=record.flags.device), flags
            )
        record.close_(found_inf, step_flags, first_op, combined, scales)

    def _masked_step(self, found_inf: torch.Tensor) -> None:
        """The optimizer's own step function, traced, undone where found_inf (scaler.snapshot).

        FSDP2: the view of the optimizer on the local shards (``LocalShards``)."""
        sharded = self.shards.view
        opt, params = (self.optimizer, self.params) if sharded is None else (sharded.optimizer, sharded.params)
        saved_params, saved_state = copy_state(opt, params)
        self.raw_step(opt)
        restore_where_(opt, params, saved_params, saved_state, found_inf)
