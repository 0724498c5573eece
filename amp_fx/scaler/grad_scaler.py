"""``amp_fx.GradScaler``: a drop-in for ``torch.amp.GradScaler`` that can step without a host sync.

With its defaults the scaler is ``torch.amp.GradScaler``, bit for bit: the same lazily created
0-dim float32 scale and int32 growth tracker, the same ``inv_scale``
(``scale.double().reciprocal().float()``), the same per-optimizer state machine and error
messages, the same update rule (``torch.ops.amp_fx.update_scale_``, bitwise
``torch._amp_update_scale_``) and a ``state_dict`` that loads into torch's scaler and back.
It subclasses ``torch.amp.GradScaler`` so that ``isinstance`` checks in training libraries
still pass; every method is reimplemented here.

What it adds, each opt-in through a keyword-only argument:

* ``step_mode=StepMode.MASKED``: ``step()`` never reads the found-inf flag on the host. The
  optimizer always steps, then parameters and optimizer state are put back on the device
  where the step was non-finite. Optimizers that take ``grad_scale``/``found_inf`` themselves
  (``fused=True`` Adam, AdamW, SGD, Adagrad) get the flags, exactly as torch gives them.
* ``min_scale``, ``max_scale``: bounds on the dynamic scale.
* ``hysteresis`` (and ``consecutive_hysteresis``): overflows tolerated before a back-off, as
  in Megatron-LM and DeepSpeed.
* ``mode=ScalerMode.CHECK_ONLY``: no scaling (for bf16), only skipping of non-finite steps.

Always on (it only differs from torch where torch corrupts the parameters): a scale whose
reciprocal is not finite (0 after about 166 back-offs from 2**16, or a float32 denormal)
counts as an overflow, so the step is skipped instead of turning ``0 * inf`` into NaN.

Device-side statistics: ``skipped_steps`` and ``last_step_skipped`` are 0-dim tensors, read
without a sync until the caller reads them. Overflow provenance (``amp_fx.overflow``): the fused
unscale also flags each non-finite gradient; ``update()`` keeps the most recent skipped step's
index and flags (and, after ``watch(model)`` of a model compiled with ``watch_nonfinite=True``, its
first non-finite forward op) on the device; ``overflow_report()`` reads them when asked. Without
``watch()``, the first ``unscale_`` looks for the model compiled with ``watch_nonfinite=True`` that
holds the optimizer's parameters and watches it (``amp_fx.overflow.SkipRecord.attach_found``).
"""

from __future__ import annotations

import enum
import inspect
import logging
import math
import weakref
from collections import abc, defaultdict
from collections.abc import Iterable
from typing import Any, cast, overload

import torch
from torch.amp.grad_scaler import OptState, _MultiDeviceReplicator, _refresh_per_optimizer_state

from amp_fx._common.report import Reporter, warn
from amp_fx._dist.found_inf import ShardedGrads
from amp_fx.kernels.fallback import unscale_check_any_dtype_
from amp_fx.overflow.record import SkipRecord
from amp_fx.overflow.report import OverflowReport
from amp_fx.overflow.watch import forward_watch
from amp_fx.scaler import rules
from amp_fx.scaler.snapshot import STATE_CREATED, Snapshot, creates_state

__all__ = ["GradScaler", "ScalerMode", "StepMode"]

logger = logging.getLogger(__name__)

# Extra state_dict entries live under this one key: torch's load_state_dict reads only the
# five keys it writes, so a state_dict of ours loads into torch's scaler unchanged.
_STATE_KEY = "amp_fx"


class ScalerMode(enum.Enum):
    """What the scaler does to the loss.

    * ``DYNAMIC``: multiply the loss by a scale that backs off on overflow and grows after
      ``growth_interval`` clean steps (torch's behaviour; what fp16 needs).
    * ``CHECK_ONLY``: the scale is 1.0 forever; the scaler only checks gradients and skips
      non-finite steps (bf16 and fp32 need no scaling). ``scale()`` returns its input,
      gradients are not multiplied, fp16 gradients are accepted, growth and back-off settings
      are ignored.
    """

    DYNAMIC = "dynamic"
    CHECK_ONLY = "check_only"


class StepMode(enum.Enum):
    """How ``step()`` skips a non-finite step for optimizers that cannot skip on their own.

    * ``HOST_SYNC``: read the found-inf flag on the host (``.item()``) and skip
      ``optimizer.step()`` (torch's behaviour).
    * ``MASKED``: always call ``optimizer.step()``, having copied the parameters and the
      optimizer's tensor state beforehand, then select ``where(found_inf, old, new)`` in place
      on the device. No host sync. Memory: one extra copy of every parameter of the optimizer
      and of every tensor in its state, held during ``step()`` (for Adam, 3x the parameter
      bytes: params, exp_avg, exp_avg_sq); time: one extra read and write of each.
      Gradients are not restored (torch does not touch them either), step hooks run.

      What cannot be selected on the device falls back to reading the flag on the host for
      that step, and then undoes the step completely: state the optimizer creates (its first
      step, once; debug log), non-tensor state or param-group entries it changes (a Python
      int step counter; warned once per optimizer), and state tensors on the CPU while the
      flag is on an accelerator (non-capturable Adam's step counter: use capturable=True).

    Either way, optimizers with ``_step_supports_amp_scaling`` (``fused=True``) receive
    ``grad_scale``/``found_inf`` and skip on the device themselves. Until such an optimizer
    has taken one step through the scaler (and while it has no state), the flag is read on
    the host and an overflowing step is not called at all: torch's fused SGD would otherwise
    keep an uninitialised momentum buffer from a skipped first step.
    """

    HOST_SYNC = "host_sync"
    MASKED = "masked"


class GradScaler(torch.amp.GradScaler):
    """Gradient scaler for mixed precision: ``torch.amp.GradScaler`` plus sync-free stepping.

    The positional arguments and every method behave as in ``torch.amp.GradScaler`` (see its
    documentation); with no keyword-only argument given the two scalers produce the same
    scale, growth tracker and parameters bit for bit. The one default difference: a scale
    whose reciprocal is not finite skips the step instead of producing NaN parameters.

    Args:
        device: device type, ``"cuda"`` (default, like torch) or ``"cpu"``. As in torch, a
            ``"cuda"`` scaler on a machine without CUDA disables itself; amp_fx's warning (an error
            in strict mode) names ``GradScaler("cpu")``.
        init_scale: initial scale (``2**16``).
        growth_factor: multiplier after ``growth_interval`` clean steps; must be > 1.
        backoff_factor: multiplier on an overflow; must be < 1.
        growth_interval: clean steps needed to grow the scale.
        enabled: if False, ``scale`` returns its input, ``step`` calls ``optimizer.step()``,
            the other methods do nothing and ``state_dict()`` is ``{}``.
        mode: ``ScalerMode.DYNAMIC`` (torch) or ``ScalerMode.CHECK_ONLY`` (scale fixed at 1).
        step_mode: ``StepMode.HOST_SYNC`` (torch) or ``StepMode.MASKED`` (no host sync).
        min_scale: lower bound for back-offs (``None``: no bound, as in torch).
        max_scale: upper bound for growth (``None``: only the float32 range, as in torch).
        hysteresis: overflows since the last growth before the scale backs off (Megatron-LM's
            definition); 1 (default) backs off on every overflow, as torch does.
        consecutive_hysteresis: refill the hysteresis budget on every clean step, so only
            ``hysteresis`` overflows in a row back off (DeepSpeed's option).
        strict: raise :class:`~amp_fx.errors.AmpFxError` where the scaler would warn that it did
            less than asked (an ``AmpFxWarning``: a ``StepMode.MASKED`` step that has to read
            found_inf on the host). ``None``: the ``AMP_FX_STRICT`` environment variable decides,
            read when the scaler is created.
        process_group: combine the inf/NaN flag over this group's ranks at every unscale (one
            all-reduce, MAX), so that they all skip the same steps and keep the same scale: the
            stages of a pipeline (``torch.distributed.pipelining``), whose gradients are plain
            tensors of different parameters on each rank. ``None`` (default): the flag is
            combined only over the meshes of sharded (DTensor) gradients, as FSDP2 needs.

    Example::

        >>> import torch
        >>> from amp_fx.scaler import GradScaler, StepMode
        >>> model = torch.nn.Linear(4, 2)
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        >>> scaler = GradScaler("cpu", step_mode=StepMode.MASKED, min_scale=1.0)
        >>> loss = model(torch.randn(8, 4)).square().mean()
        >>> scaler.scale(loss).backward()
        >>> scaler.unscale_(opt)  # optional: to clip the unscaled gradients
        >>> norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        >>> scaler.step(opt)
        >>> scaler.update()
        >>> int(scaler.skipped_steps)
        0
    """

    def __init__(
        self,
        device: str = "cuda",
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
        *,
        mode: ScalerMode = ScalerMode.DYNAMIC,
        step_mode: StepMode = StepMode.HOST_SYNC,
        min_scale: float | None = None,
        max_scale: float | None = None,
        hysteresis: int = 1,
        consecutive_hysteresis: bool = False,
        strict: bool | None = None,
        process_group: Any = None,
    ) -> None:
        # torch.amp.GradScaler.__init__ is deliberately not called: it would warn with a stack
        # level pointing into this file. The same attributes are set here instead.
        self._device = device
        self._enabled = enabled
        # Says once per thing that the scaler did less than asked (a masked step that reads the flag
        # on the host, a cuda scaler without CUDA); strict=True, or AMP_FX_STRICT when strict is
        # None, turns that into an error.
        self._report = Reporter(strict)
        if self._device == "cuda" and enabled and torch.cuda.amp.common.amp_definitely_not_available():
            # did less than asked (no scaling), so strict mode refuses it; torch says only "Disabling."
            self._report.did_less(
                "scaler without cuda",
                (
                    "amp_fx.GradScaler: device 'cuda' (the default, as in torch), but CUDA is not available, so "
                    "this scaler is disabled: scale() returns the loss as it is and fp16 gradients can underflow "
                    "to zero. Pass GradScaler('cpu') to scale losses on the CPU, or enabled=False where no "
                    "scaling is meant."
                ),
            )
            self._enabled = False
        if not isinstance(mode, ScalerMode):
            raise TypeError(f"mode must be a ScalerMode, got {mode!r}")
        if not isinstance(step_mode, StepMode):
            raise TypeError(f"step_mode must be a StepMode, got {step_mode!r}")
        if self._enabled:
            # torch raises AssertionError for these two; users may catch that type.
            if growth_factor <= 1.0:
                raise AssertionError("The growth factor must be > 1.0.")
            if backoff_factor >= 1.0:
                raise AssertionError("The backoff factor must be < 1.0.")
        self._mode = mode
        self._step_mode = step_mode
        self._min_scale, self._max_scale = _validate_bounds(min_scale, max_scale, init_scale, mode)
        if isinstance(hysteresis, bool) or not isinstance(hysteresis, int) or hysteresis < 1:
            raise ValueError(f"hysteresis must be an int >= 1, got {hysteresis!r}")
        self._hysteresis = hysteresis
        self._consecutive_hysteresis = bool(consecutive_hysteresis)
        self._process_group = process_group

        self._init_scale = 1.0 if mode is ScalerMode.CHECK_ONLY else init_scale
        self._scale: torch.Tensor | None = None
        self._growth_factor = growth_factor
        self._backoff_factor = backoff_factor
        self._growth_interval = growth_interval
        self._init_growth_tracker = 0
        self._growth_tracker: torch.Tensor | None = None
        self._per_optimizer_states: dict[int, dict[str, Any]] = defaultdict(_refresh_per_optimizer_state)
        # amp_fx's own device state, created next to the scale at the first scale().
        self._init_hysteresis_tracker = hysteresis
        self._hysteresis_tracker: torch.Tensor | None = None
        self._init_skipped_steps = 0
        self._skipped_steps: torch.Tensor | None = None
        self._last_found_inf: torch.Tensor | None = None
        # amp_fx/overflow: the most recent skipped step (index, gradient flags, forward op).
        self._skip_record = SkipRecord()
        # Whether this step's StepMode.HOST_SYNC read saw a skip (None: no read), for update()
        self._host_skipped: bool | None = None
        # Self-scaling optimizers that have taken a real step through this scaler.
        self._stepped_optimizers: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()

    # ---------------------------------------------------------------- configuration
    @property
    def mode(self) -> ScalerMode:
        """The ``ScalerMode`` given to the constructor."""
        return self._mode

    @property
    def step_mode(self) -> StepMode:
        """The ``StepMode`` given to the constructor."""
        return self._step_mode

    @property
    def skipped_steps(self) -> torch.Tensor:
        """0-dim int64 tensor: iterations whose ``update()`` saw a non-finite gradient.

        Lives on the scale's device and is updated without a host sync; reading its value
        (``int(...)``) is the caller's sync. It counts iterations, not optimizers: with several
        optimizers an iteration counts once if any of them found a non-finite gradient.
        """
        if self._skipped_steps is None:
            return torch.tensor(self._init_skipped_steps if self._enabled else 0, dtype=torch.int64)
        return self._skipped_steps.clone()

    @property
    def last_step_skipped(self) -> torch.Tensor:
        """0-dim bool tensor: whether the last ``update()`` saw a non-finite gradient.

        Use it to hold back an LR scheduler on skipped steps without a sync, e.g.
        ``lr_factor = torch.where(scaler.last_step_skipped, 0.0, 1.0)``.
        """
        if self._last_found_inf is None:
            return torch.tensor(False)
        return self._last_found_inf != 0

    # ---------------------------------------------------------------- overflow provenance
    def watch(self, model: torch.nn.Module) -> None:
        """Name gradients and forward ops in :meth:`overflow_report` after ``model``.

        ``model``: the module being trained, as you call it (an ``amp_fx.compile``-d module, under
        DDP or not, or a plain module). Parameters are named as the root module names them (no
        ``module.``/``_orig_mod.`` prefixes), on every rank. If it was compiled with
        ``watch_nonfinite=True``, the report also names the first forward op whose low-precision
        output held an inf/NaN, kept on the device at each ``update()``.

        Under DDP or FSDP2 (with the watch) each ``update()`` combines the ranks' forward records
        in one small all-reduce on the device, so every rank names the op and the rank that saw
        it: call ``watch`` on every rank (a rank that does not would leave the others waiting).

        Without a call, the first ``unscale_`` (or ``step``) watches the model compiled with
        ``watch_nonfinite=True`` whose parameters the optimizer holds, the same way on every rank;
        where several such models hold them, or none does, the report names no forward op and
        says so (once, through an ``AmpFxWarning``).
        """
        self._skip_record.attach(model, watch=forward_watch(model))

    @property
    def skip_record(self) -> SkipRecord:
        """The device record behind :meth:`overflow_report` (``amp_fx.overflow.SkipRecord``), for
        code that steps with this scaler's rules itself (``compile_step``'s finish)."""
        return self._skip_record

    def overflow_report(self) -> OverflowReport | None:
        """Why the most recent skipped step was skipped; None if no step was skipped since the
        last report (or ever). This is a host read (the only one: everything it reports is kept on
        the device); call it when you want to know, e.g. every N steps or when ``skipped_steps``
        grows. ``str()`` of the report is one line:
        ``step 12 skipped: first inf at layers.3.mlp (aten.mm, fp16); 2 gradients non-finite (...)``.
        """
        if not self._enabled or self._skipped_steps is None:
            return None
        record = self._skip_record
        report = record.report(self._skipped_steps)
        if report is not None and record.unattached is not None:
            self._report.did_less(
                ("overflow watch", record.unattached),
                (
                    f"amp_fx.GradScaler.overflow_report(): {record.unattached}; the report names no forward op "
                    "and the gradients by position. Call scaler.watch(model) with the model being trained "
                    "(on every rank)."
                ),
            )
        return report

    @property
    def last_skipped_step(self) -> torch.Tensor:
        """0-dim int64 device tensor: the index of the most recent skipped step (-1: none); no sync."""
        if self._skip_record.step is None:
            return torch.tensor(-1)
        return self._skip_record.step.clone()

    @property
    def last_skip_gradient_flags(self) -> torch.Tensor:
        """fp32 device tensor, one entry per parameter seen (in first-seen order): 1.0 where its
        gradient held an inf/NaN at the most recent skipped step; no sync."""
        if self._skip_record.flags is None:
            return torch.zeros(0)
        return self._skip_record.flags.clone()

    # ---------------------------------------------------------------- lazy state
    def _check_scale_growth_tracker(self, funcname: str) -> tuple[torch.Tensor, torch.Tensor]:
        fix = "This may indicate your script did not use scaler.scale(loss or outputs) earlier in the iteration."
        if self._scale is None:
            raise AssertionError(f"Attempted {funcname} but _scale is None.  " + fix)
        if self._growth_tracker is None:
            raise AssertionError(f"Attempted {funcname} but _growth_tracker is None.  " + fix)
        return (self._scale, self._growth_tracker)

    def _init_without_scale(self, optimizer: torch.optim.Optimizer) -> None:
        """With a ``process_group`` (pipeline stages), a stage that never calls ``scale()`` (only the
        last holds the loss; the scaled gradients reach the others through the backward) starts at
        ``init_scale`` too, on its parameters' device; the combined flag keeps every stage's scale
        equal after that."""
        if self._scale is not None or self._process_group is None:
            return
        devices = [p.device for g in optimizer.param_groups for p in g["params"]]
        self._lazy_init_scale_growth_tracker(devices[0] if devices else torch.device(self._device))

    def _lazy_init_scale_growth_tracker(self, dev: torch.device) -> None:
        if self._growth_tracker is not None:
            raise AssertionError("_growth_tracker initialized before _scale")
        self._scale = torch.full((), self._init_scale, dtype=torch.float32, device=dev)
        self._growth_tracker = torch.full((), self._init_growth_tracker, dtype=torch.int32, device=dev)
        self._hysteresis_tracker = torch.full((), self._init_hysteresis_tracker, dtype=torch.int32, device=dev)
        self._skipped_steps = torch.full((), self._init_skipped_steps, dtype=torch.int64, device=dev)
        self._last_found_inf = torch.zeros((), dtype=torch.float32, device=dev)
        self._skip_record.init(dev)

    def _inv_scale_and_guard(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``inv_scale`` and a found_inf that flags a scale with no finite reciprocal
        (``rules.inv_scale_and_guard``)."""
        assert self._scale is not None
        return rules.inv_scale_and_guard(self._scale, dynamic=self._mode is ScalerMode.DYNAMIC)

    def _rule(self) -> rules.ScaleRule:
        return rules.ScaleRule(
            dynamic=self._mode is ScalerMode.DYNAMIC,
            growth_factor=self._growth_factor,
            backoff_factor=self._backoff_factor,
            growth_interval=self._growth_interval,
            min_scale=self._min_scale,
            max_scale=self._max_scale,
            hysteresis=self._hysteresis,
            consecutive_hysteresis=self._consecutive_hysteresis,
        )

    def loss_scale_state(self, device: torch.device) -> tuple[rules.ScaleState, rules.ScaleRule]:
        """The device state and the update rule, for code that applies ``amp_fx.scaler.rules``
        itself (``compile_step``'s compiled finish). Creates the state on ``device`` if no
        ``scale()`` has yet; the tensors are the scaler's own, updated in place."""
        if not self._enabled:
            raise RuntimeError("amp_fx: loss_scale_state() of a disabled GradScaler")
        if self._scale is None:
            self._lazy_init_scale_growth_tracker(device)
        assert self._scale is not None and self._growth_tracker is not None
        assert self._hysteresis_tracker is not None and self._skipped_steps is not None
        assert self._last_found_inf is not None
        state = rules.ScaleState(
            scale=self._scale,
            growth_tracker=self._growth_tracker,
            hysteresis_tracker=self._hysteresis_tracker,
            skipped_steps=self._skipped_steps,
            last_found_inf=self._last_found_inf,
        )
        return state, self._rule()

    # ---------------------------------------------------------------- scale
    @overload
    def scale(self, outputs: torch.Tensor) -> torch.Tensor: ...

    @overload
    def scale(self, outputs: list[torch.Tensor]) -> list[torch.Tensor]: ...

    @overload
    def scale(self, outputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]: ...

    @overload
    def scale(self, outputs: Iterable[torch.Tensor]) -> Iterable[torch.Tensor]: ...

    def scale(self, outputs: torch.Tensor | Iterable[torch.Tensor]) -> torch.Tensor | Iterable[torch.Tensor]:
        """Multiply a tensor or (nested) iterable of tensors by the scale.

        Returns ``outputs`` unchanged when disabled or in ``ScalerMode.CHECK_ONLY`` (the
        scale state is still created, on the device of the first tensor).
        """
        if not self._enabled:
            return outputs
        multiply = self._mode is ScalerMode.DYNAMIC

        if isinstance(outputs, torch.Tensor):
            if self._scale is None:
                self._lazy_init_scale_growth_tracker(outputs.device)
            assert self._scale is not None
            if not multiply:
                return outputs
            return outputs * self._scale.to(device=outputs.device, non_blocking=True)

        stash: list[_MultiDeviceReplicator] = []

        def apply_scale(val: torch.Tensor | Iterable[torch.Tensor]) -> Any:
            if isinstance(val, torch.Tensor):
                if len(stash) == 0:
                    if self._scale is None:
                        self._lazy_init_scale_growth_tracker(val.device)
                    assert self._scale is not None
                    stash.append(_MultiDeviceReplicator(self._scale))
                return val * stash[0].get(val.device) if multiply else val
            if isinstance(val, abc.Iterable):
                iterable = map(apply_scale, val)
                if isinstance(val, (list, tuple)):
                    return type(val)(iterable)
                return iterable
            raise ValueError("outputs must be a Tensor or an iterable of Tensors")

        return apply_scale(outputs)

    # ---------------------------------------------------------------- unscale
    def _unscale_grads_(
        self,
        optimizer: torch.optim.Optimizer,
        inv_scale: torch.Tensor,
        found_inf: torch.Tensor,
        allow_fp16: bool,
    ) -> dict[torch.device, torch.Tensor]:
        """Check and unscale the optimizer's gradients in place; found_inf per device.

        Same contract as torch's (subclasses such as FSDP's sharded scaler override it):
        ``found_inf`` and ``inv_scale`` are copied to each gradient device, gradients of one
        device go to one kernel call, sparse gradients are handled through ``_values()``.
        """
        per_device_inv_scale = _MultiDeviceReplicator(inv_scale)
        per_device_found_inf = _MultiDeviceReplicator(found_inf)
        per_device_grads: dict[torch.device, list[torch.Tensor]] = defaultdict(list)
        per_device_params: dict[torch.device, list[torch.Tensor]] = defaultdict(list)
        # FSDP2: DTensor grads are unscaled through their local shard; pipeline stages: the flag
        # is combined over the group given to the constructor
        sharded = ShardedGrads(self._process_group)
        self._skip_record.attach_found(optimizer)  # once, unless watch() was called
        with torch.no_grad():
            for group in optimizer.param_groups:
                for param in group["params"]:
                    if not isinstance(param, torch.Tensor):
                        raise AssertionError(  # noqa: TRY004 - torch's type, users may catch it
                            f"expected param to be torch.Tensor, got {type(param).__name__}"
                        )
                    if param.grad is None:
                        continue
                    if (not allow_fp16) and param.grad.dtype == torch.float16:
                        raise ValueError("Attempting to unscale FP16 gradients.")
                    if param.grad.is_sparse:
                        # Coalescing adds values that share an index; for scaled fp16 values
                        # that can overflow, so check the coalesced values (as torch does).
                        if param.grad.dtype is torch.float16:
                            param.grad = param.grad.coalesce()
                        to_unscale = param.grad._values()
                    else:
                        to_unscale = param.grad
                    to_unscale = sharded.local(to_unscale)
                    per_device_grads[to_unscale.device].append(to_unscale)
                    per_device_params[to_unscale.device].append(param)

            grad_flags: list[tuple[list[torch.Tensor], torch.Tensor]] = []
            for device, grads in per_device_grads.items():
                # amp_fx/overflow: which gradients held an inf/NaN, from the same kernel pass
                flags = torch.zeros(len(grads), dtype=torch.float32, device=device)
                unscale_check_any_dtype_(
                    grads, per_device_found_inf.get(device), per_device_inv_scale.get(device), flags
                )
                grad_flags.append((per_device_params[device], flags))
            # Sharded grads: one all-reduce of the flags across ranks; replicated: none. The
            # forward record, when watched, rides in it (update() then needs no collective).
            watch = self._skip_record.watch
            first_op = watch.peek(inv_scale.device) if watch is not None and sharded.is_sharded else None
            combined_first_op = sharded.combine_found_inf_(
                per_device_found_inf._per_device_tensors, inv_scale, [f for _, f in grad_flags], first_op
            )
            state = self._per_optimizer_states[id(optimizer)]
            state["amp_fx_grad_flags"] = grad_flags
            if combined_first_op is not None:
                state["amp_fx_first_op"] = combined_first_op

        return per_device_found_inf._per_device_tensors

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide the optimizer's gradients by the scale, in place, and record non-finite ones.

        Call it at most once per optimizer per ``step()``, after all gradients are
        accumulated, e.g. to clip the unscaled gradients::

            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
            scaler.step(optimizer)
            scaler.update()

        Raises RuntimeError when called twice for one optimizer before ``update()`` or after
        ``step()``, and ValueError for fp16 gradients (except in ``ScalerMode.CHECK_ONLY``,
        which does not change gradients). No host sync.
        """
        if not self._enabled:
            return
        self._init_without_scale(optimizer)
        self._check_scale_growth_tracker("unscale_")
        optimizer_state = self._per_optimizer_states[id(optimizer)]
        if optimizer_state["stage"] is OptState.UNSCALED:
            raise RuntimeError("unscale_() has already been called on this optimizer since the last update().")
        elif optimizer_state["stage"] is OptState.STEPPED:
            raise RuntimeError("unscale_() is being called after step().")

        inv_scale, found_inf = self._inv_scale_and_guard()
        optimizer_state["found_inf_per_device"] = self._unscale_grads_(
            optimizer, inv_scale, found_inf, self._mode is ScalerMode.CHECK_ONLY
        )
        optimizer_state["stage"] = OptState.UNSCALED

    def _check_inf_per_device(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """Check (without unscaling) the gradients of an optimizer that unscales itself."""
        _scale, _ = self._check_scale_growth_tracker("_check_inf_per_device")
        dummy_inv_scale = torch.full((), 1.0, dtype=torch.float32, device=_scale.device)
        _, found_inf = self._inv_scale_and_guard()
        self._per_optimizer_states[id(optimizer)]["found_inf_per_device"] = self._unscale_grads_(
            optimizer, dummy_inv_scale, found_inf, True
        )
        return self._per_optimizer_states[id(optimizer)]["found_inf_per_device"]

    def _found_inf_per_device(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        return self._per_optimizer_states[id(optimizer)]["found_inf_per_device"]

    # ---------------------------------------------------------------- step
    def _maybe_opt_step(
        self,
        optimizer: torch.optim.Optimizer,
        optimizer_state: dict[str, Any],
        *args: Any,
        **kwargs: Any,
    ) -> float | None:
        # StepMode.HOST_SYNC: torch's host-side skip, one sync per device.
        retval: float | None = None
        skipped = bool(sum(v.item() for v in optimizer_state["found_inf_per_device"].values()))
        self._host_skipped = skipped or bool(self._host_skipped)  # for update(): this read, counted once
        if not skipped:
            retval = optimizer.step(*args, **kwargs)
        return retval

    def _masked_opt_step(
        self,
        optimizer: torch.optim.Optimizer,
        optimizer_state: dict[str, Any],
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        assert self._scale is not None
        found_inf = rules.combine_found_inf(list(optimizer_state["found_inf_per_device"].values()), self._scale.device)
        snapshot = Snapshot(optimizer)
        retval = optimizer.step(*args, **kwargs)
        reason = snapshot.needs_host_decision()
        if reason is None and found_inf.device.type != "cpu":
            devices = {p.device for p in snapshot.params}
            for entry in snapshot.state:
                for live, _ in (entry or {}).values():
                    if isinstance(live, torch.Tensor):
                        devices.add(live.device)
            if torch.device("cpu") in devices:
                reason = "a parameter or state tensor is on the CPU (e.g. Adam's step counter without capturable=True)"
        if reason is None:
            snapshot.restore_where(found_inf)
            return retval
        # The step changed something that cannot be selected on the device, so decide on the
        # host this once. Lazily created state (every optimizer's first step) is expected and
        # logged at debug level; anything else would sync on every step, so say so once.
        if reason == STATE_CREATED:
            logger.debug(
                "masked step of %s reads found_inf on the host: %s",
                type(optimizer).__name__,
                reason,
            )
        else:
            self._report.did_less(
                ("masked step host read", id(optimizer)),
                f"amp_fx.GradScaler(step_mode=StepMode.MASKED): the step of "
                f"{type(optimizer).__name__} cannot be undone on the device ({reason}), so it reads "
                "found_inf on the host (a sync) each step. Use a fused=True or capturable=True "
                "optimizer, or keep its state and hyperparameters as device tensors.",
            )
        if found_inf.item():
            snapshot.restore_all()
        return retval

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        """Unscale (unless ``unscale_`` was called) and step the optimizer unless non-finite.

        ``*args``/``**kwargs`` go to ``optimizer.step()``; closures are not supported. Returns
        what ``optimizer.step()`` returned, or None when the step was skipped on the host.
        In ``StepMode.MASKED`` the optimizer always steps (and its return value is returned);
        a non-finite step is then undone on the device. Step hooks run either way.

        Raises RuntimeError if ``step()`` was already called for this optimizer since the last
        ``update()``.
        """
        if not self._enabled:
            return optimizer.step(*args, **kwargs)
        if "closure" in kwargs:
            raise RuntimeError("Closure use is not currently supported if GradScaler is enabled.")
        self._init_without_scale(optimizer)
        self._check_scale_growth_tracker("step")
        optimizer_state = self._per_optimizer_states[id(optimizer)]
        if optimizer_state["stage"] is OptState.STEPPED:
            raise RuntimeError("step() has already been called since the last update().")

        if getattr(optimizer, "_step_supports_amp_scaling", False):
            return self._step_self_scaling(optimizer, optimizer_state, *args, **kwargs)

        if optimizer_state["stage"] is OptState.READY:
            self.unscale_(optimizer)
        if len(optimizer_state["found_inf_per_device"]) == 0:
            raise AssertionError("No inf checks were recorded for this optimizer.")
        if self._step_mode is StepMode.MASKED:
            retval = self._masked_opt_step(optimizer, optimizer_state, *args, **kwargs)
        else:
            retval = self._maybe_opt_step(optimizer, optimizer_state, *args, **kwargs)
        optimizer_state["stage"] = OptState.STEPPED
        return retval

    def _step_self_scaling(
        self,
        optimizer: torch.optim.Optimizer,
        optimizer_state: dict[str, Any],
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        """Optimizers with ``_step_supports_amp_scaling`` unscale and skip on the device.

        Same protocol as torch: a ``grad_scaler`` keyword for legacy optimizers, else the
        ``grad_scale`` and ``found_inf`` attributes, set for the call and deleted after it.
        """
        kwargs_ = kwargs
        has_grad_scaler_kwarg = "grad_scaler" in inspect.signature(optimizer.step).parameters
        if has_grad_scaler_kwarg:
            warn(
                "GradScaler is going to stop passing itself as a keyword argument to the passed "
                "optimizer. In the near future GradScaler registers `grad_scale: Tensor` and "
                "`found_inf: Tensor` to the passed optimizer and let the optimizer use them "
                "directly.",
                FutureWarning,
            )
            kwargs_.update({"grad_scaler": self})
        else:
            if optimizer_state["stage"] is OptState.READY:
                self._check_inf_per_device(optimizer)
            scale = self._get_scale_async()
            if scale is None:
                raise AssertionError("_get_scale_async returned None")
            flags = list(optimizer_state["found_inf_per_device"].values())
            # No gradients, no flags: torch passes found_inf=0 and its update() then raises
            # "No inf checks were recorded prior to update."; so does ours.
            found_inf = (
                rules.combine_found_inf(flags, scale.device)
                if flags
                else torch.zeros((), dtype=torch.float32, device=scale.device)
            )
            # Product of the scales if the user already set optimizer.grad_scale (as torch).
            optimizer.grad_scale = (  # type: ignore[attr-defined]  # what fused optimizers read, as GradScaler sets it
                getattr(optimizer, "grad_scale", None)
                if optimizer_state["stage"] == OptState.UNSCALED
                else scale * getattr(optimizer, "grad_scale", 1)
            )
            optimizer.found_inf = found_inf  # type: ignore[attr-defined]  # what fused optimizers read, as GradScaler sets it
            if self._first_step_needs_host_decision(optimizer) and found_inf.item():
                # torch's fused SGD creates its momentum buffers with empty_like on the first
                # step and its kernel then skips writing them, so a skipped first step leaves
                # uninitialised memory that the next step reads. Not stepping at all is what a
                # skip means; for Adam, AdamW and Adagrad the result is bitwise the same.
                logger.debug("skipping the first step of %s on the host", type(optimizer).__name__)
                optimizer_state["stage"] = OptState.STEPPED
                del optimizer.grad_scale  # type: ignore[attr-defined]  # what fused optimizers read, as GradScaler sets it
                del optimizer.found_inf  # type: ignore[attr-defined]  # what fused optimizers read, as GradScaler sets it
                return None
        retval = optimizer.step(*args, **kwargs_)
        optimizer_state["stage"] = OptState.STEPPED
        self._stepped_optimizers.add(optimizer)
        if not has_grad_scaler_kwarg:
            del optimizer.grad_scale  # type: ignore[attr-defined]  # what fused optimizers read, as GradScaler sets it
            del optimizer.found_inf  # type: ignore[attr-defined]  # what fused optimizers read, as GradScaler sets it
        return retval

    def _first_step_needs_host_decision(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether a self-scaling optimizer may create its state in this step.

        True until the optimizer has stepped once through this scaler and while some
        parameter with a gradient has no state (a checkpoint-loaded optimizer has state, so
        it never pays the one host sync this costs).
        """
        return optimizer not in self._stepped_optimizers and creates_state(optimizer)

    # ---------------------------------------------------------------- update
    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """Update the scale from this iteration's found-inf flags (no host sync).

        Backs off by ``backoff_factor`` (bounded by ``min_scale``, after ``hysteresis``
        overflows) if any optimizer saw a non-finite gradient, grows by ``growth_factor``
        (bounded by ``max_scale``, never to inf) after ``growth_interval`` clean steps. Also
        updates ``skipped_steps`` and ``last_step_skipped``.

        ``new_scale`` (a Python float, or a 1-element tensor of this scaler's device type
        without grad) sets the scale instead, with torch's checks and errors. Not allowed in
        ``ScalerMode.CHECK_ONLY``, whose scale is fixed.
        """
        if not self._enabled:
            return
        _scale, _growth_tracker = self._check_scale_growth_tracker("update")
        state, rule = self.loss_scale_state(_scale.device)
        found_infs = [
            found_inf
            for state in self._per_optimizer_states.values()
            for found_inf in state["found_inf_per_device"].values()
        ]
        found_inf_combined = rules.combine_found_inf(found_infs, _scale.device) if found_infs else None

        before = _scale.clone()  # the scale this step ran at, for the skip record
        if new_scale is not None:
            if self._mode is ScalerMode.CHECK_ONLY:
                raise ValueError("update(new_scale) is not allowed in ScalerMode.CHECK_ONLY: the scale is 1.0.")
            if isinstance(new_scale, float):
                self._scale.fill_(new_scale)  # type: ignore[union-attr]  # set once the scaler has scaled
            else:
                reason = (
                    "new_scale should be a float or a 1-element torch.cuda.FloatTensor or "
                    "torch.FloatTensor with requires_grad=False."
                )
                if new_scale.device.type != self._device:
                    raise AssertionError(reason)
                if new_scale.numel() != 1:
                    raise AssertionError(reason)
                if new_scale.requires_grad is True:
                    raise AssertionError(reason)
                self._scale.copy_(new_scale)  # type: ignore[union-attr]  # set once the scaler has scaled
        else:
            if found_inf_combined is None:
                raise AssertionError("No inf checks were recorded prior to update.")
            rules.update_scale_(state, rule, found_inf_combined)

        if found_inf_combined is not None:
            rules.record_step_(state, found_inf_combined)
            record = self._skip_record
            pairs = [pair for s in self._per_optimizer_states.values() for pair in s.get("amp_fx_grad_flags", ())]
            # FSDP2: every rank's forward record came with the found-inf all-reduce of unscale_
            # (the last optimizer's); DDP (no such collective): close_ all-reduces the record.
            combined = [s["amp_fx_first_op"] for s in self._per_optimizer_states.values() if "amp_fx_first_op" in s]
            assert record.flags is not None
            flags = record.step_flags(pairs) if pairs else record.flags.new_zeros(record.flags.numel())
            record.close_(
                found_inf_combined,
                flags,
                record.take_first_op(_scale.device),
                combined[-1] if combined else None,
                scales=(before, _scale),
            )
            if self._host_skipped is not None:
                record.host_saw(self._host_skipped)
        self._host_skipped = None
        self._per_optimizer_states = defaultdict(_refresh_per_optimizer_state)

    # ---------------------------------------------------------------- getters and setters
    def _get_scale_async(self) -> torch.Tensor | None:
        return self._scale

    def get_scale(self) -> float:
        """The current scale as a Python float (a host sync), 1.0 when disabled."""
        if self._enabled:
            scale = self._get_scale_async()
            return self._init_scale if scale is None else cast(float, scale.item())
        return 1.0

    def get_growth_factor(self) -> float:
        """The scale growth factor."""
        return self._growth_factor

    def set_growth_factor(self, new_factor: float) -> None:
        """Set the scale growth factor (not validated, as in torch)."""
        self._growth_factor = new_factor

    def get_backoff_factor(self) -> float:
        """The scale back-off factor."""
        return self._backoff_factor

    def set_backoff_factor(self, new_factor: float) -> None:
        """Set the scale back-off factor (not validated, as in torch)."""
        self._backoff_factor = new_factor

    def get_growth_interval(self) -> int:
        """The number of clean steps before the scale grows."""
        return self._growth_interval

    def set_growth_interval(self, new_interval: int) -> None:
        """Set the growth interval (not validated, as in torch)."""
        self._growth_interval = new_interval

    def _get_growth_tracker(self) -> int:
        if self._enabled:
            if self._growth_tracker is None:
                return self._init_growth_tracker
            return cast(int, self._growth_tracker.item())
        return 0

    def is_enabled(self) -> bool:
        """Whether this scaler is enabled."""
        return self._enabled

    # ---------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        """The scaler's state: torch's five entries plus ours under the key ``"amp_fx"``.

        ``scale``, ``growth_factor``, ``backoff_factor``, ``growth_interval`` and
        ``_growth_tracker`` are torch's (Python numbers, read with a host sync); ``"amp_fx"``
        holds ``skipped_steps``, ``hysteresis_tracker``, ``min_scale``, ``max_scale``,
        ``hysteresis`` and ``consecutive_hysteresis``. torch's ``load_state_dict`` reads only
        its own keys, so the dict loads into either scaler. ``{}`` when disabled.
        """
        if not self._enabled:
            return {}
        return {
            "scale": self.get_scale(),
            "growth_factor": self._growth_factor,
            "backoff_factor": self._backoff_factor,
            "growth_interval": self._growth_interval,
            "_growth_tracker": self._get_growth_tracker(),
            _STATE_KEY: {
                "skipped_steps": self._read_int(self._skipped_steps, self._init_skipped_steps),
                "hysteresis_tracker": self._read_int(self._hysteresis_tracker, self._init_hysteresis_tracker),
                "min_scale": self._min_scale,
                "max_scale": self._max_scale,
                "hysteresis": self._hysteresis,
                "consecutive_hysteresis": self._consecutive_hysteresis,
            },
        }

    @staticmethod
    def _read_int(t: torch.Tensor | None, default: int) -> int:
        return default if t is None else int(t.item())

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state from ``state_dict()`` of this class or of ``torch.amp.GradScaler``.

        A torch state_dict has no ``"amp_fx"`` entry: the skip counter and the hysteresis
        budget then start afresh and this scaler keeps its own bounds. In
        ``ScalerMode.CHECK_ONLY`` the loaded scale is ignored (the scale stays 1.0).
        """
        if not self._enabled:
            return
        if len(state_dict) == 0:
            raise RuntimeError(
                "The source state dict is empty, possibly because it was saved from a disabled instance of GradScaler."
            )
        if self._mode is ScalerMode.DYNAMIC:
            self._init_scale = cast(float, state_dict["scale"])
            if self._scale is not None:
                self._scale.fill_(state_dict["scale"])
        elif state_dict["scale"] != 1.0:
            logger.info("CHECK_ONLY scaler ignores the loaded scale %s", state_dict["scale"])
        self._growth_factor = cast(float, state_dict["growth_factor"])
        self._backoff_factor = cast(float, state_dict["backoff_factor"])
        self._growth_interval = cast(int, state_dict["growth_interval"])
        self._init_growth_tracker = cast(int, state_dict["_growth_tracker"])
        if self._growth_tracker is not None:
            self._growth_tracker.fill_(state_dict["_growth_tracker"])

        extra = state_dict.get(_STATE_KEY)
        if extra is not None:
            self._min_scale = float(extra["min_scale"])
            self._max_scale = float(extra["max_scale"])
            self._hysteresis = int(extra["hysteresis"])
            self._consecutive_hysteresis = bool(extra["consecutive_hysteresis"])
            skipped, hyst = int(extra["skipped_steps"]), int(extra["hysteresis_tracker"])
        else:
            skipped, hyst = 0, self._hysteresis
        self._init_skipped_steps = skipped
        self._init_hysteresis_tracker = hyst
        if self._skipped_steps is not None:
            self._skipped_steps.fill_(skipped)
        if self._hysteresis_tracker is not None:
            self._hysteresis_tracker.fill_(hyst)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        if self._enabled:
            if len(self._per_optimizer_states) != 0:
                raise AssertionError(
                    "A GradScaler instance may only be pickled at the beginning "
                    "of an iteration, or at the end after scaler.update()."
                )
            # As torch: the tensors are re-created lazily after unpickling.
            state["_init_scale"] = self.get_scale()
            state["_init_growth_tracker"] = self._get_growth_tracker()
            state["_init_skipped_steps"] = self._read_int(self._skipped_steps, self._init_skipped_steps)
            state["_init_hysteresis_tracker"] = self._read_int(self._hysteresis_tracker, self._init_hysteresis_tracker)
            for name in (
                "_scale",
                "_growth_tracker",
                "_hysteresis_tracker",
                "_skipped_steps",
                "_last_found_inf",
            ):
                state[name] = None
        del state["_stepped_optimizers"]  # weak references do not pickle; re-created empty
        state["_skip_record"] = SkipRecord()  # device records and weak references: re-created empty
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        state["_stepped_optimizers"] = weakref.WeakSet()
        state.setdefault("_report", Reporter())  # pickled before the reporter existed
        state.pop("_warned_sync", None)
        state.setdefault("_skip_record", SkipRecord())
        state.setdefault("_host_skipped", None)
        self.__dict__.update(state)


def _validate_bounds(
    min_scale: float | None, max_scale: float | None, init_scale: float, mode: ScalerMode
) -> tuple[float, float]:
    """Bounds as floats (0.0 and inf mean none); errors name the offending value."""
    lo = 0.0 if min_scale is None else float(min_scale)
    hi = math.inf if max_scale is None else float(max_scale)
    if min_scale is not None and not (0.0 < lo < math.inf):
        raise ValueError(f"min_scale must be positive and finite, got {min_scale!r}")
    if min_scale is not None and lo < 1.0 / torch.finfo(torch.float32).max:
        # At such a scale inv_scale is inf, so every step would count as an overflow.
        raise ValueError(f"min_scale must have a finite float32 reciprocal (>= 2.94e-39), got {min_scale!r}")
    if max_scale is not None and not (0.0 < hi <= torch.finfo(torch.float32).max):
        raise ValueError(f"max_scale must be positive and within float32, got {max_scale!r}")
    if lo > hi:
        raise ValueError(f"min_scale ({lo}) must not exceed max_scale ({hi})")
    if mode is ScalerMode.DYNAMIC and not (lo <= init_scale <= hi):
        raise ValueError(f"init_scale ({init_scale}) must lie in [min_scale, max_scale] = [{lo}, {hi}]")
    return lo, hi
