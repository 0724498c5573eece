"""The driver of a compiled step: :func:`compile_step` (what it checks) and :class:`CompiledStep`.

One call of a ``CompiledStep`` is one micro-batch: the compiled forward and loss
(``amp_fx.step.forward``), the scaled backward (AOTAutograd's compiled backward graph, gradients
accumulating into ``.grad`` as in eager), and at the end of an accumulation window the optimizer
step: eagerly through the scaler while warming up or once a hyperparameter other than ``lr`` is
scheduled, else the compiled finish (``amp_fx.step.finish``), after following what changed in the
optimizer since the last step (``amp_fx.step.follow``). Python between the pieces reads no tensor
value.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch

from amp_fx._common.downstream import Backend
from amp_fx._common.report import Reporter
from amp_fx._common.suggest import did_you_mean
from amp_fx._common.targets import check_target
from amp_fx._dist.capture import distributed_units
from amp_fx._dist.step import check_distributed_step
from amp_fx.backend.weight_cache import StepWriter, weight_cache_off_for_fsdp2
from amp_fx.inspect.precision import PrecisionReport, step_report
from amp_fx.low_precision import LowPrecisionLike, one_option
from amp_fx.monitor.config import Fp8Monitor
from amp_fx.monitor.state import MonitorState
from amp_fx.options import Numerics, Options
from amp_fx.overflow.report import STEP_WATCH_HINT, OverflowReport
from amp_fx.policy import Policy
from amp_fx.scaler import GradScaler, ScalerMode, StepMode, rules
from amp_fx.scaler.snapshot import unique_params
from amp_fx.step.finish import Finish, GradNorm
from amp_fx.step.follow import OptimizerFollower, check_params
from amp_fx.step.forward import ForwardLoss, LossFn, compile_forward, module_prefixes
from amp_fx.step.lowprec import LowPrecisionAdam, TrainState, unsupported
from amp_fx.step.shards import StepShards

__all__ = ["CompiledStep", "compile_step"]


@dataclass(frozen=True)
class _Config:
    dtype: torch.dtype
    accumulate: int
    max_grad_norm: float | None
    grad_norm: GradNorm
    n_inputs: int
    train_state: TrainState | None = None

    def __post_init__(self) -> None:
        if self.train_state is not None and self.dtype != torch.bfloat16:
            raise ValueError(
                f"amp_fx.compile_step: train_state={self.train_state.value!r} trains bf16 "
                f"parameters; pass dtype='bf16' (got {self.dtype})"
            )
        if isinstance(self.accumulate, bool) or not isinstance(self.accumulate, int) or self.accumulate < 1:
            raise ValueError(f"amp_fx.compile_step: accumulate must be an int >= 1, got {self.accumulate!r}")
        if self.max_grad_norm is not None and not (0.0 < float(self.max_grad_norm) < float("inf")):
            raise ValueError(
                f"amp_fx.compile_step: max_grad_norm must be positive and finite, got {self.max_grad_norm!r}"
            )
        if not isinstance(self.grad_norm, GradNorm):
            raise TypeError(f"amp_fx.compile_step: grad_norm must be a GradNorm, got {self.grad_norm!r}")
        if isinstance(self.n_inputs, bool) or not isinstance(self.n_inputs, int) or self.n_inputs < 1:
            raise ValueError(f"amp_fx.compile_step: n_inputs must be an int >= 1, got {self.n_inputs!r}")


class CompiledStep:
    """The callable :func:`compile_step` returns: ``step(*inputs, *targets) -> loss``.

    Attributes read without a host sync: ``last_step_skipped`` (0-dim bool tensor),
    ``skipped_steps`` (0-dim int64 tensor), ``scale`` (0-dim float32 tensor).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        loss_fn: LossFn,
        *,
        config: _Config,
        scaler: GradScaler,
        options: Options,
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.config = config
        self.scaler = scaler
        self.options = options
        self._micro_step = 0
        self._loss_dtype: torch.dtype | None = None
        self._report = Reporter(options.strict)
        self._fused = bool(getattr(optimizer, "_step_supports_amp_scaling", False))
        shards = StepShards(model)  # FSDP2: the finish works on the local shards
        # amp_fx/step/lowprec.py: bf16 parameters and moments, our Adam step in place of the
        # optimizer's (which then never runs its fused kernel); before the forward compiles
        self._lowprec = self._low_precision(model, optimizer, config.train_state)
        if self._lowprec is not None:
            self._fused = False
            if options.weight_cache:
                assert config.train_state is not None  # _low_precision returns None without one
                self._report.did_less(
                    "weight_cache:train_state",
                    (
                        f"amp_fx.compile_step(weight_cache=True, train_state={config.train_state.value!r}): "
                        "the parameters are bf16 already, so there is nothing to cache; the cache is off. "
                        "Drop weight_cache=True."
                    ),
                )
                options = options.replace(weight_cache=False)
        self._follow = OptimizerFollower(
            model,
            optimizer,
            self._report,
            fused=self._fused,
            fsdp2=shards.enabled,
            replaced_step=self._lowprec is not None,
        )
        if options.weight_cache and weight_cache_off_for_fsdp2(model, self._report, "amp_fx.compile_step"):
            options = options.replace(weight_cache=False)
        forward_loss = ForwardLoss(
            loss_fn, config.n_inputs, config.accumulate, multiply_scale=scaler.mode is ScalerMode.DYNAMIC
        )
        self._forward = compile_forward(model, forward_loss, options, micro_step=lambda: self._micro_step)
        # amp_fx/overflow: the scaler's skip record names this model's parameters and forward ops.
        # DDP/FSDP2 with the watch: every rank's forward record is combined at each update (FSDP2:
        # in the found-inf all-reduce of the finish; DDP: one small all-reduce of its own).
        record = scaler.skip_record
        record.attach(
            model,
            watch=getattr(self._forward, "amp_fx_watch", None),
            prefixes=module_prefixes(model),
            how_to_watch=STEP_WATCH_HINT,
        )
        # amp_fx/backend/weight_cache.py: the low-precision copies are written with the update (under
        # DDP too: every rank updates its whole replica of each weight)
        cache = getattr(self._forward, "amp_fx_weight_cache", None)
        params = self._follow.params
        self._finish = Finish(
            optimizer,
            params,
            record,
            fused=self._fused,
            max_grad_norm=config.max_grad_norm,
            grad_norm=config.grad_norm,
            writer=None if cache is None else StepWriter(cache, params),
            shards=shards,
            # numerics="eager": inductor's lite mode cannot lower the optimizer graph's mutating
            # custom ops (auto_functionalized_v2 of amp_fx.unscale_check_): ATen's kernels through
            # aot_eager, eager's numbers bit for bit (unfused; its progress line names aot_eager).
            backend="aot_eager" if options.numerics is Numerics.EAGER else options.backend,
            step_fn=None if self._lowprec is None else self._lowprec.step,
        )
        self._finish_backend = self._finish.backend

    def _low_precision(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, mode: TrainState | None
    ) -> LowPrecisionAdam | None:
        """The bf16 training state asked for, its parameters and state turned to bf16; None when
        not asked, or reported (strict: raised) when it cannot be honoured."""
        if mode is None:
            return None
        reason = unsupported(optimizer)
        if reason is None and distributed_units(model) is not None:
            reason = (
                "a DDP or FSDP2 model (their gradient buckets and shards are laid out for the "
                "parameters' dtype before compile_step could change it)"
            )
        if reason is not None:
            self._report.did_less(
                ("train_state", mode),
                (
                    f"amp_fx.compile_step(train_state={mode.value!r}) cannot replace the optimizer step of "
                    f"{reason}; the parameters and optimizer state keep their dtype and the optimizer steps "
                    "as it is. Use torch.optim.AdamW or Adam (amsgrad, maximize and differentiable off) on a "
                    "model that is not wrapped, or drop train_state."
                ),
            )
            return None
        lowprec = LowPrecisionAdam(mode)
        lowprec.prepare(optimizer)
        return lowprec

    # ------------------------------------------------------------------ public state
    @property
    def scale(self) -> torch.Tensor:
        """The current loss scale (0-dim float32 on the device; 1.0 in check-only mode)."""
        return self._scale_state()[0].scale

    @property
    def last_step_skipped(self) -> torch.Tensor:
        """0-dim bool tensor: whether the last optimizer step was skipped (non-finite gradients)."""
        return self.scaler.last_step_skipped

    @property
    def skipped_steps(self) -> torch.Tensor:
        """0-dim int64 tensor: optimizer steps skipped so far."""
        return self.scaler.skipped_steps

    @property
    def last_skipped_step(self) -> torch.Tensor:
        """0-dim int64 tensor: the index of the most recent skipped step (-1: none); no sync."""
        return self.scaler.last_skipped_step

    @property
    def amp_fx_monitor(self) -> MonitorState | None:
        """The fp8 monitor's state (``monitor=``; read with ``amp_fx.fp8_stats(step)``), else None."""
        return getattr(self._forward, "amp_fx_monitor", None)

    def overflow_report(self) -> OverflowReport | None:
        """Why the most recent skipped step was skipped (``amp_fx.GradScaler.overflow_report``): its
        index, the parameters whose gradients held an inf/NaN and, with ``watch_nonfinite=True``,
        the first forward op whose low-precision output did. None if no step was skipped since the
        last report. The one host read; the step itself reads nothing.

        Under DDP and FSDP2 the report is the same on every rank (the flags and the forward record
        are combined across ranks on the device during the step), so it may be read on one rank only."""
        return self.scaler.overflow_report()

    @property
    def micro_step(self) -> int:
        """Micro-batches accumulated in the current window (0 right after an optimizer step)."""
        return self._micro_step

    @property
    def graphs_compiled(self) -> int:
        """Graphs compiled so far: forward+loss graphs plus finish graphs (recompiles included)."""
        return len(self._forward.amp_fx_records) + self._finish.backend.graphs  # type: ignore[attr-defined]  # set by _compile

    def state_dict(self) -> dict[str, Any]:
        """The scaler's state (interchangeable with ``torch.amp.GradScaler.state_dict()``).

        Save it with the model's and the optimizer's state at a window boundary
        (``micro_step == 0``); gradients of a half-accumulated window are not saved.
        """
        if self._micro_step != 0:
            raise RuntimeError(
                f"amp_fx: CompiledStep.state_dict() in the middle of an accumulation window "
                f"({self._micro_step}/{self.config.accumulate} micro-batches); save at a "
                "window boundary"
            )
        return self.scaler.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a scaler state from :meth:`state_dict` or from ``torch.amp.GradScaler``."""
        self.scaler.load_state_dict(state_dict)

    def precision_report(self, loss: torch.Tensor | torch.dtype | None = None) -> PrecisionReport:
        """:func:`amp_fx.precision_report` of this step: its model, optimizer, scaler, dtype and weight
        cache, and the loss of its last call (or ``loss``). Each silent downgrade warns once per step
        (``strict``: raises)."""
        return step_report(
            self,
            getattr(self._forward, "amp_fx_weight_cache", None),
            self._loss_dtype if loss is None else loss,
            self._report,
            None if self._lowprec is None else self._lowprec.mode.value,
        )

    # ------------------------------------------------------------------ the step
    def __call__(self, *batch: Any, **model_kwargs: Any) -> torch.Tensor:
        n = self.config.n_inputs
        if len(batch) < n and not model_kwargs:
            raise TypeError(
                f"amp_fx: step() takes the model's {n} input(s) then the loss targets, got {len(batch)} argument(s)"
            )
        self._follow.check_requires_grad()
        scale = self._scale_state()[0].scale
        loss, scaled = self._forward(scale, *batch, **model_kwargs)
        self._loss_dtype = loss.dtype
        scaled.backward()
        self._micro_step += 1
        if self._micro_step == self.config.accumulate:
            self._micro_step = 0
            self._optimizer_step()
        return loss

    def _scale_state(self) -> tuple[rules.ScaleState, rules.ScaleRule]:
        """The scaler's device state (created on the parameters' device) and update rule."""
        return self.scaler.loss_scale_state(self._follow.params[0].device)

    def _optimizer_step(self) -> None:
        """The end of a window: follow the optimizer, then step eagerly (warm-up, a scheduled
        hyperparameter) or through the compiled finish; zero the gradients."""
        follow = self._follow
        if follow.follow_param_groups():
            if self._lowprec is not None:
                self._lowprec.prepare(self.optimizer)  # the new parameters: bf16, with state
            self._finish.set_params(follow.params)
        follow.follow_hyperparameters()
        if follow.needs_warm_up():
            self._eager_finish(warm_up=True)
        elif follow.eager_optimizer:
            self._eager_finish(warm_up=False)
        else:
            self._finish.step(self._scale_state(), follow, self._report)
        self.optimizer.zero_grad()

    def _eager_finish(self, *, warm_up: bool) -> None:
        """amp_fx.GradScaler's eager path: the warm-up step (may read found_inf on the host), and
        the optimizer step once a hyperparameter other than lr is scheduled (masked, no sync)."""
        scaler, opt = self.scaler, self.optimizer
        if self.config.max_grad_norm is not None:
            scaler.unscale_(opt)
            self._finish.shards.clip_(self._follow.params, self.config.max_grad_norm)
        with contextlib.nullcontext() if self._lowprec is None else self._lowprec.as_optimizer_step(opt):
            scaler.step(opt)
        scaler.update()
        if warm_up:
            skipped = bool(scaler.last_step_skipped)  # a host read, during warm-up only
            self._follow.warmed_up = not skipped
            if scaler.step_mode is StepMode.MASKED:  # a HOST_SYNC scaler counted its own read
                scaler.skip_record.host_saw(skipped)


def _default_scaler(dtype: torch.dtype, device: torch.device, strict: bool | None) -> GradScaler:
    if dtype == torch.bfloat16:
        return GradScaler(device.type, mode=ScalerMode.CHECK_ONLY, step_mode=StepMode.MASKED, strict=strict)
    return GradScaler(device.type, step_mode=StepMode.MASKED, strict=strict)


def _named_mistakes(fn: Callable[..., CompiledStep]) -> Callable[..., CompiledStep]:
    """``compile_step`` with its unexpected keyword arguments named: a scaler option (``init_scale``,
    ``growth_interval``, ...) is pointed at ``scaler=GradScaler(...)``; anything else gets a
    did-you-mean among ``compile_step``'s own options. The signature is unchanged (``wraps``)."""
    signature = inspect.signature(fn)

    @functools.wraps(fn)
    def checked(*args: Any, **kwargs: Any) -> CompiledStep:
        unknown = [k for k in kwargs if k not in signature.parameters]
        if unknown:
            model = args[0] if args else kwargs.get("model")
            raise TypeError(_unexpected_keyword(unknown[0], kwargs[unknown[0]], list(signature.parameters), model))
        return fn(*args, **kwargs)

    return checked


def _unexpected_keyword(name: str, value: Any, ours: list[str], model: object) -> str:
    scaler_options = [
        n for n, p in inspect.signature(GradScaler.__init__).parameters.items() if n not in ("self", "device")
    ]
    said = f"amp_fx.compile_step got an unexpected keyword argument {name!r}"
    if name in scaler_options:
        device = "cuda"
        if isinstance(model, torch.nn.Module):
            first = next(model.parameters(), None)
            device = first.device.type if first is not None else "cpu"
        return (
            f"{said}: it is an option of the loss scaler. Pass a scaler: "
            f"compile_step(..., scaler=amp_fx.GradScaler({device!r}, {name}={value!r}))"
        )
    return (
        f"{said}{did_you_mean(name, ours + scaler_options)}. Its options: {', '.join(ours)}; the loss "
        f"scaler's, passed as scaler=amp_fx.GradScaler(device, ...): {', '.join(scaler_options)}"
    )


@_named_mistakes
def compile_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    loss_fn: LossFn,
    *,
    dtype: str | torch.dtype = "fp16",
    scaler: GradScaler | None = None,
    max_grad_norm: float | None = None,
    grad_norm: GradNorm = GradNorm.TORCH,
    accumulate: int = 1,
    n_inputs: int = 1,
    backend: str | Backend = "inductor",
    policy: Policy | None = None,
    dynamic: bool | None = None,
    strict: bool | None = None,
    weight_cache: bool = False,
    watch_nonfinite: bool = False,
    low_precision: LowPrecisionLike = None,
    fp8: LowPrecisionLike = None,
    train_state: Literal["bf16_sr", "bf16_kahan"] | None = None,
    numerics: str | Numerics = "default",
    monitor: Fp8Monitor | None = None,
) -> CompiledStep:
    """Compile a mixed-precision training step that never reads the device on the host.

    ``step = compile_step(model, optimizer, loss_fn)``; then ``loss = step(*inputs, *targets)``
    computes ``loss = loss_fn(model(*inputs), *targets)`` under amp_fx's autocast policy, runs
    the scaled backward and, once every ``accumulate`` calls, unscales and checks the gradients,
    clips them (``max_grad_norm``), steps the optimizer unless a gradient is inf/NaN, updates the
    scale and zeroes the gradients. It returns the micro-batch's loss (unscaled, undivided, on
    the device, detached).

    Args:
        model: the module to train (its parameters must be the optimizer's).
        optimizer: any ``torch.optim`` optimizer; ``fused=True`` ones skip in their own kernel,
            others step masked inside the compiled graph.
        loss_fn: ``loss_fn(output, *targets) -> 0-dim tensor`` (e.g. ``F.cross_entropy``).
        dtype: "fp16" (default; dynamic loss scaling) or "bf16" (check-only scaler: no scaling,
            non-finite steps are still skipped).
        scaler: an ``amp_fx.GradScaler`` to take the scale, bounds, hysteresis and mode from
            (default: torch's defaults for fp16, ``ScalerMode.CHECK_ONLY`` for bf16).
        max_grad_norm: clip the unscaled gradients to this total L2 norm (``clip_grad_norm_``'s
            rule, on the device).
        grad_norm: how the norm for clipping is computed: ``GradNorm.TORCH`` (default, bitwise
            ``clip_grad_norm_``) or ``GradNorm.FUSED`` (one pass fewer over the gradients, not
            bitwise: see :class:`GradNorm`).
        accumulate: micro-batches per optimizer step. Call ``step`` once per micro-batch; the
            loss is divided by ``accumulate`` before the backward (torch's recipe), the scale is
            fixed within a window, and unscale/check/step/update run at its end.
        n_inputs: how many leading positional arguments of ``step`` go to the model; the rest
            go to ``loss_fn`` after the output.
        backend: "inductor", "aot_eager", "eager" or a torch.compile backend callable, for all
            compiled pieces.
        policy: amp_fx autocast policy overrides.
        dynamic: passed to ``torch.compile`` for the forward (None: Dynamo's automatic dynamic
            shapes; a batch shape that changes recompiles once, then runs dynamic).
        strict: turn each warning that the step did less than asked (an ``AmpFxWarning``: the
            optimizer step running eagerly because a hyperparameter is scheduled, the optimizer
            part recompiling, the forward's policy and graph reports, the default scaler's host
            reads) into an ``AmpFxError``. None: the ``AMP_FX_STRICT`` environment
            variable decides.
        weight_cache: cast each fp32 parameter once per optimizer step, in the same pass that
            updates it (see ``amp_fx.backend.weight_cache``), instead of once per micro-batch.
        watch_nonfinite: record on the device the first forward op whose low-precision output
            holds an inf/NaN, named by :meth:`CompiledStep.overflow_report` (``amp_fx.overflow``).
            Values are unchanged; the gradients' flags are recorded either way.
        low_precision: train the forward's matmuls in a low-precision recipe, as
            :func:`amp_fx.compile`'s ``low_precision=`` (a recipe name, an ``amp_fx.Fp8Recipe``,
            an ``amp_fx.Fp8Config``, or a recipe per module: an ``amp_fx.LowPrecision`` or a dict;
            docs: "fp8 training").
        fp8: the older spelling of ``low_precision`` (the same values); passing both is a TypeError.
        train_state: hold the training state in bf16 (needs ``dtype="bf16"``): the optimizer's
            parameters are turned to bf16 **in place** (``p.data``; the model and optimizer keep
            the same Parameter objects, buffers and other parameters are left alone), the Adam
            moments are bf16, and the step computes Adam's update in fp32 and writes the weights
            back with ``"bf16_sr"`` (stochastic rounding, unbiased: 8 bytes per parameter instead
            of 16) or ``"bf16_kahan"`` (a bf16 Kahan compensation buffer: 10 bytes). For
            ``torch.optim.Adam``/``AdamW`` (not amsgrad, maximize, differentiable) on an unwrapped
            model; otherwise it warns (strict: raises) and trains as without it. See
            ``amp_fx.step.lowprec`` and docs "Memory".
        numerics: ``"eager"``: the forward and backward compiled by inductor with every op on
            ATen's kernel but value-preserving pointwise fusion, bitwise with eager autocast (as
            :func:`amp_fx.compile`'s ``numerics=``); the optimizer graph runs ATen's kernels through
            ``aot_eager`` (eager's numbers bit for bit, unfused: inductor's lite mode cannot lower
            its mutating ops). Needs ``backend="inductor"``.
        monitor: per-GEMM quantization statistics of the low-precision matmuls on the steps an
            ``amp_fx.Fp8Monitor`` selects (one step: one call), as :func:`amp_fx.compile`'s
            ``monitor=``; read with ``amp_fx.fp8_stats(step)``.

    Example:
        >>> model = torch.nn.Linear(4, 2)
        >>> opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
        >>> step = amp_fx.compile_step(model, opt, torch.nn.functional.mse_loss, backend="aot_eager")
        >>> loss = step(torch.randn(8, 4), torch.randn(8, 2))
    """
    options = Options(
        dtype=dtype,
        policy=policy,
        backend=backend,
        strict=strict,
        weight_cache=weight_cache,
        watch_nonfinite=watch_nonfinite,
        torch_compile={"dynamic": dynamic},
        fp8=one_option(fp8, low_precision, "amp_fx.compile_step"),
        numerics=numerics,
        monitor=monitor,
    )
    check_target(model, "amp_fx.compile_step", module_only=True)
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"amp_fx.compile_step: optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}"
        )
    # FSDP1, sharded layouts/optimizers that cannot step on local shards: a clear error
    check_distributed_step(model, optimizer)
    if not callable(loss_fn):
        raise TypeError(f"amp_fx.compile_step: loss_fn must be callable, got {type(loss_fn).__name__}")
    config = _Config(
        dtype=options.dtype,
        accumulate=accumulate,
        max_grad_norm=max_grad_norm,
        grad_norm=grad_norm,
        n_inputs=n_inputs,
        train_state=TrainState.parse(train_state),
    )
    check_params(model, optimizer)
    params = unique_params(optimizer)
    if not params:
        raise ValueError("amp_fx.compile_step: the optimizer has no parameters")
    devices = {p.device for p in params}
    if len(devices) != 1:
        raise ValueError(
            f"amp_fx.compile_step: parameters on several devices {sorted(map(str, devices))} are not supported"
        )
    if scaler is None:
        scaler = _default_scaler(options.dtype, params[0].device, options.strict)
    elif not isinstance(scaler, GradScaler):
        raise TypeError(
            "amp_fx.compile_step: scaler must be an amp_fx GradScaler; to continue from a "
            "torch.amp.GradScaler, load its state: s = amp_fx.scaler.GradScaler('cpu'); "
            "s.load_state_dict(torch_scaler.state_dict())"
        )
    if not scaler.is_enabled():
        raise ValueError(
            "amp_fx.compile_step: the scaler is disabled (e.g. a 'cuda' scaler without CUDA); "
            "pass one for the parameters' device type"
        )
    if any(
        isinstance(v, torch.Tensor) and v.requires_grad
        for g in optimizer.param_groups
        for v in g.values()
        if not isinstance(v, list)
    ):
        raise ValueError("amp_fx.compile_step: differentiable optimizer hyperparameters are not supported")
    return CompiledStep(model, optimizer, loss_fn, config=config, scaler=scaler, options=options)
