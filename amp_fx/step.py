"""``amp_fx.compile_step``: a whole mixed-precision training step, compiled, with no host sync.

    step = amp_fx.compile_step(model, optimizer, torch.nn.functional.cross_entropy, dtype="fp16")
    for x, y in loader:
        loss = step(x, y)          # forward, loss, scaled backward, unscale/check/clip, step, update

One call of the returned :class:`CompiledStep` runs three compiled pieces, stitched by Python
that reads no tensor value:

1. **forward + loss** (``amp_fx.compile`` of ``loss_fn(model(*inputs), *targets)``, so the
   loss is computed under the same autocast policy as the model, as in torch's AMP recipe),
   returning the loss and the loss multiplied by the scale. AOTAutograd compiles its backward.
   Keyword arguments of ``step`` go to the model. Graph breaks are allowed here (a logger call
   in a Hugging Face forward): each piece is compiled and rewritten.
2. **backward**: ``scaled_loss.backward()`` runs AOTAutograd's compiled backward graph; the
   gradients accumulate into ``.grad`` as in eager.
3. **finish** (``torch.compile(fullgraph=True)``, once per accumulation window): the fused
   unscale + non-finite check (``torch.ops.amp_fx.unscale_check_`` or ``unscale_check_norm_``),
   the clip coefficient and its multiply, the optimizer step skipped on the device, and the
   scale update (``torch.ops.amp_fx.update_scale_``).

   * Optimizers without ``_step_supports_amp_scaling`` step inside the graph, masked: the
     parameters and state tensors are copied, the optimizer's step function is traced (the
     ``torch.optim`` step wrapper itself is skipped: it inserts ``torch._dynamo.graph_break()``
     around the step; its hooks are run by :class:`CompiledStep` instead), and
     ``where(found_inf, old, new)`` puts back the old values on a non-finite step.
   * ``fused=True`` optimizers cannot be traced (torch wraps ``_fused_adam`` & co. in
     ``torch.compiler.disable``), and need not be: their single fused kernel takes
     ``grad_scale``/``found_inf`` and skips on the device. The graph computes the flags and
     ``optimizer.step()`` runs right after it, exactly as ``torch.amp.GradScaler.step`` calls it.

Why three pieces and not one graph: Dynamo graph-breaks on ``Tensor.backward()`` (torch 2.13:
"Unsupported Tensor.backward() call ... when trace_autograd_ops is off"), ``torch.optim``'s step
wrapper calls ``torch._dynamo.graph_break()`` and fused optimizers are ``compiler.disable``-d, so
``torch.compile`` of the whole recipe breaks 7 times (bench/bench_step.py prints the list).
Compiled autograd and the experimental ``torch._dynamo.config.trace_autograd_ops`` could put the
backward in the same graph; they were not measured for this version. The finish is a full
graph (``fullgraph=True``, so a break is an error, not a silent fallback); what matters
for CUDA graphs and throughput is that nothing between them reads the device, which this module
guarantees and ``tests/test_step.py`` proves with the profiler.

Warm-up: until every parameter of the optimizer has optimizer state (normally the first step),
the finish runs eagerly through ``amp_fx.GradScaler`` (``unscale_``, ``clip_grad_norm_``,
``step``, ``update``) which may read found_inf once on the host: a first step that creates
state cannot be undone on the device (torch's fused SGD would even leave its momentum buffers
uninitialised). From then on no step reads a device value on the host. The finish also runs
eagerly (masked by the scaler, still sync-free) once a hyperparameter other than ``lr`` changes
between steps (see ``CompiledStep._follow_hyperparameters``).

The loss-scale rules the finish applies (inverse scale and its guard, scale update, masked
restore) are ``amp_fx.scaler.rules`` and ``amp_fx.scaler.snapshot``: the same functions
``GradScaler`` calls. Each step compiles its own copy of its code objects, so it owns its
Dynamo cache entries.
"""

from __future__ import annotations

import contextlib
import enum
import inspect
import logging
import types
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch._dynamo

from amp_fx._common import compat as _compat
from amp_fx._common.downstream import Backend, resolve_backend
from amp_fx._common.report import Reporter
from amp_fx._dist.found_inf import combine_first_op, ranks_of
from amp_fx._dist.step import LocalShards, check_distributed_step, distributed_forward, is_fsdp2
from amp_fx.backend.weight_cache import StepWriter
from amp_fx.compile import compile_with, weight_cache_off_for_fsdp2
from amp_fx.fp8 import Fp8Like
from amp_fx.kernels.unscale import unscale_check_, unscale_check_norm_
from amp_fx.options import Options
from amp_fx.overflow import OverflowReport, root_names
from amp_fx.policy import Policy
from amp_fx.scaler import GradScaler, ScalerMode, StepMode, rules
from amp_fx.scaler.snapshot import copy_state, restore_where_, same_value, unique_params

__all__ = ["compile_step", "CompiledStep", "GradNorm"]

logger = logging.getLogger(__name__)

LossFn = Callable[..., torch.Tensor]


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
      fp32 ulps per step; ``tests/test_step.py`` pins 2^-20 relative to the parameters' movement).
    """

    FUSED = "fused"
    TORCH = "torch"


@dataclass(frozen=True)
class _Config:
    dtype: torch.dtype
    accumulate: int
    max_grad_norm: float | None
    grad_norm: GradNorm
    n_inputs: int

    def __post_init__(self) -> None:
        if isinstance(self.accumulate, bool) or not isinstance(self.accumulate, int) or self.accumulate < 1:
            raise ValueError(f"amp_fx.compile_step: accumulate must be an int >= 1, got {self.accumulate!r}")
        if self.max_grad_norm is not None and not (0.0 < float(self.max_grad_norm) < float("inf")):
            raise ValueError(
                f"amp_fx.compile_step: max_grad_norm must be positive and finite, got {self.max_grad_norm!r}")
        if not isinstance(self.grad_norm, GradNorm):
            raise TypeError(f"amp_fx.compile_step: grad_norm must be a GradNorm, got {self.grad_norm!r}")
        if isinstance(self.n_inputs, bool) or not isinstance(self.n_inputs, int) or self.n_inputs < 1:
            raise ValueError(f"amp_fx.compile_step: n_inputs must be an int >= 1, got {self.n_inputs!r}")


def _raw_step(optimizer: torch.optim.Optimizer) -> Callable[[torch.optim.Optimizer], Any]:
    """The optimizer's step function without torch's wrappers (hooks, graph breaks, no_grad)."""
    return inspect.unwrap(type(optimizer).step)


# The optimizers whose own step, with every hyperparameter a Python number, passes only numbers
# as add_'s alpha and addcmul_/addcdiv_'s value (checked by tests/test_step.py, bit for bit, on
# 2.11, 2.13 and 2.15). Not Adagrad: its lr divided by a step-dependent term is a tensor when traced
# (turning the rewrite off would read it on the host each step); not Adam, AdamW, Adamax, NAdam,
# RAdam, ASGD: their step-counter arithmetic in fp32 differs anyway (docs/compiled-step.md, "Limitations").
_EAGER_ROUNDING_STEPS = tuple(inspect.unwrap(cls.step) for cls in
                              (torch.optim.SGD, torch.optim.RMSprop, torch.optim.Adadelta))


def _step_as_eager(optimizer: torch.optim.Optimizer) -> contextlib.AbstractContextManager[None]:
    """Trace the optimizer's ``add_(g, alpha=a)``, ``addcmul_``/``addcdiv_(.., value=a)`` as eager
    computes them, one rounding each.

    Dynamo rewrites them into a multiply and an add (two roundings where eager's kernel rounds
    once: ``amp_fx._common.compat.dynamo_decomposes_number_scalars``), so SGD (2.11), RMSprop and Adadelta
    drifted from the eager recipe in the last bits. Only for the steps of ``_EAGER_ROUNDING_STEPS``
    with every hyperparameter a Python number: a scheduled lr is a tensor inside the step
    (``_lrs_as_tensors``), which Dynamo traces without a host read only through that rewrite; it
    then stays within the scheduler test's tolerance.
    """
    own_step = _raw_step(optimizer) in _EAGER_ROUNDING_STEPS
    numbers = not any(isinstance(v, torch.Tensor) for g in _group_values(optimizer) for v in g.values())
    return _compat.number_scalars_as_eager() if own_step and numbers else contextlib.nullcontext()


def _own_code(method: Callable[..., Any]) -> Callable[..., Any]:
    """``method`` bound to a function with its own copy of the code object.

    Dynamo keeps its cache entries (at most ``recompile_limit``, 8) per code object. Compiling the
    bound methods of ``CompiledStep`` directly would make every step in the process share one
    code object, so the 9th step would hit the limit; a copied code object gives each step its
    own entries.
    """
    fn = method.__func__  # type: ignore[attr-defined]
    own = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__,
                             fn.__closure__)
    own.__kwdefaults__ = fn.__kwdefaults__
    own.__qualname__ = fn.__qualname__
    return types.MethodType(own, method.__self__)  # type: ignore[attr-defined]


class _CountingBackend:
    """A torch.compile backend that delegates and counts the graphs it compiles."""

    def __init__(self, backend: str | Backend) -> None:
        self._inner: Backend = resolve_backend(backend)
        self.graphs = 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        self.graphs += 1
        return self._inner(gm, example_inputs)


class CompiledStep:
    """The callable :func:`compile_step` returns: ``step(*inputs, *targets) -> loss``.

    Attributes read without a host sync: ``last_step_skipped`` (0-dim bool tensor),
    ``skipped_steps`` (0-dim int64 tensor), ``scale`` (0-dim float32 tensor).
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, loss_fn: LossFn, *,
                 config: _Config, scaler: GradScaler, options: Options) -> None:
        self.model = model
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.config = config
        self.scaler = scaler
        self._params = unique_params(optimizer)
        self._fused = bool(getattr(optimizer, "_step_supports_amp_scaling", False))
        self._raw_step = _raw_step(optimizer)
        self._micro_step = 0
        self.options = options
        self._report = Reporter(options.strict)
        # A recompile of the finish that amp_fx caused itself (the first compile, an lr that
        # became a tensor) is expected; any other is reported.
        self._expect_recompile = True
        # Not fullgraph: a graph break in the model (e.g. a logger call in a Hugging Face model)
        # splits the forward into graphs, each rewritten, with no host sync between them.
        if options.weight_cache and weight_cache_off_for_fsdp2(model, self._report, "amp_fx.compile_step"):
            options = options.replace(weight_cache=False)
        self._forward = distributed_forward(  # DDP/FSDP2: per-unit capture, no grad sync within a window
            self, compile_model=lambda m: compile_with(m, options),
        ) or compile_with(_own_code(self._forward_loss), options)
        # amp_fx/backend/weight_cache.py: the low-precision copies are written with the update (under
        # DDP too: every rank updates its whole replica of each weight)
        cache = getattr(self._forward, "amp_fx_weight_cache", None)
        self._lowp_writer = None if cache is None else StepWriter(cache, self._params)
        # amp_fx/overflow.py: the scaler's skip record names this model's parameters and forward ops
        # (the forward's module paths start with "model." (the compiled function's self.model), under
        # DDP with "module.", and under FSDP2 (the model compiled itself) with nothing).
        record = scaler._skip_record
        record.names = root_names(model)[1]
        record.watch = getattr(self._forward, "amp_fx_watch", None)
        record.prefixes = (("module.",) if isinstance(model, torch.nn.parallel.DistributedDataParallel)
                           else () if is_fsdp2(model) else ("model.",))
        # DDP/FSDP2 with the watch: every rank's forward record is combined at each update (FSDP2:
        # in the found-inf all-reduce of the finish; DDP: one small all-reduce of its own).
        record.group = ranks_of(model) if record.watch is not None else None
        self._slots = record.register(self._params)
        self._finish_backend = _CountingBackend(options.backend)
        self._finish = torch.compile(_own_code(self._finish_impl), backend=self._finish_backend,
                                     fullgraph=True, dynamic=False)
        self._seen_groups = _group_values(optimizer)
        # Per param_group index: the device tensor that carries a scheduled float lr into the
        # compiled finish (filled from the float before each step).
        self._lr_tensors: dict[int, torch.Tensor] = {}
        # A hyperparameter other than lr changed between steps: the optimizer steps eagerly.
        self._eager_optimizer = False
        self._warmed_up = False
        # FSDP2: the finish works on the local shards (built after the warm-up created the state).
        self._fsdp2 = is_fsdp2(model)
        self._sharded: LocalShards | None = None
        # torch 2.11: the parameters' requires_grad as the forward last saw it (_check_requires_grad)
        self._requires_grad: list[bool] | None = None

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
        return len(self._forward.amp_fx_records) + self._finish_backend.graphs

    def state_dict(self) -> dict[str, Any]:
        """The scaler's state (interchangeable with ``torch.amp.GradScaler.state_dict()``).

        Save it with the model's and the optimizer's state at a window boundary
        (``micro_step == 0``); gradients of a half-accumulated window are not saved.
        """
        if self._micro_step != 0:
            raise RuntimeError(f"amp_fx: CompiledStep.state_dict() in the middle of an accumulation window "
                               f"({self._micro_step}/{self.config.accumulate} micro-batches); save at a "
                               "window boundary")
        return self.scaler.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a scaler state from :meth:`state_dict` or from ``torch.amp.GradScaler``."""
        self.scaler.load_state_dict(state_dict)

    # ------------------------------------------------------------------ the step
    def __call__(self, *batch: Any, **model_kwargs: Any) -> torch.Tensor:
        n = self.config.n_inputs
        if len(batch) < n and not model_kwargs:
            raise TypeError(f"amp_fx: step() takes the model's {n} input(s) then the loss targets, got "
                            f"{len(batch)} argument(s)")
        self._check_requires_grad()
        scale = self._scale_state()[0].scale
        loss, scaled = self._forward(scale, *batch, **model_kwargs)
        scaled.backward()
        self._micro_step += 1
        if self._micro_step == self.config.accumulate:
            self._micro_step = 0
            self._optimizer_step()
        return loss

    def _scale_state(self) -> tuple[rules.ScaleState, rules.ScaleRule]:
        """The scaler's device state (created on the parameters' device) and update rule."""
        return self.scaler.loss_scale_state(self._params[0].device)

    def _forward_loss(self, scale: torch.Tensor, *batch: Any, **model_kwargs: Any
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        n = self.config.n_inputs
        loss = self.loss_fn(self.model(*batch[:n], **model_kwargs), *batch[n:])
        _check_loss(loss)  # before the loss is used: a None loss must not reach the tracer's ops
        scaled = loss
        if self.config.accumulate > 1:
            scaled = scaled / self.config.accumulate  # torch's recipe: gradients are the window mean
        if self.scaler.mode is ScalerMode.DYNAMIC:
            scaled = scaled * scale
        return loss.detach(), scaled

    def _follow_hyperparameters(self) -> None:
        """React to hyperparameters that changed since the last step (an LR or momentum scheduler).

        Dynamo specialises the traced optimizer step on every float hyperparameter it reads, so
        each new value would recompile the finish (and, past Dynamo's recompile limit, fail).
        * A float ``lr`` that changed is carried into the compiled finish as a 0-dim float32
          device tensor from then on (every torch optimizer takes a tensor lr, as torch
          recommends for compiled optimizers; float32 because the kernels round a Python lr to
          it anyway, and a float64 lr makes the traced non-fused Adam read it on the host),
          filled from the float before each step; the param_group keeps the user's float.
          Constant float learning rates are left alone: they keep the eager optimizer's
          arithmetic (``add_(g, alpha=-lr)``).
        * Any other hyperparameter that changed (OneCycleLR's ``betas``/``momentum``) cannot be
          a tensor in every optimizer (SGD branches on ``momentum != 0``; foreach Adam refuses a
          tensor beta1), so the optimizer step then runs eagerly, masked by the scaler.
        Fused optimizers step eagerly anyway: nothing to do for them.
        """
        now = _group_values(self.optimizer)
        before, self._seen_groups = self._seen_groups, now
        if self._fused or len(now) != len(before):
            return
        for i, (after_g, before_g) in enumerate(zip(now, before)):
            for key, value in after_g.items():
                if key not in before_g or same_value(before_g[key], value):
                    continue
                if key == "lr" and isinstance(value, float):
                    if i not in self._lr_tensors:
                        group = self.optimizer.param_groups[i]
                        device = group["params"][0].device if group["params"] else self._params[0].device
                        self._lr_tensors[i] = torch.zeros((), dtype=torch.float32, device=device)
                        self._expect_recompile = True
                        logger.info("amp_fx.compile_step: param_groups[%d]['lr'] changed (%s -> %s); the "
                                    "compiled step takes it as a device tensor from now on, so that it "
                                    "does not recompile for each value", i, before_g[key], value)
                elif key == "lr" and isinstance(value, torch.Tensor) and value.dim() == 0:
                    # amp_fx.skip_aware: the lr became a device tensor, updated in place from now on
                    self._expect_recompile = True
                elif not self._eager_optimizer:
                    self._eager_optimizer = True
                    self._report.did_less(
                        "hyperparameter changed",
                        f"amp_fx.compile_step: param_groups[{i}][{key!r}] changed between steps "
                        f"({before_g[key]!r} -> {value!r}), e.g. by a scheduler (OneCycleLR's "
                        f"cycle_momentum); the compiled graph would recompile for every value, so the "
                        f"{type(self.optimizer).__name__} step now runs eagerly (masked by the scaler: "
                        "no host sync, bitwise the eager recipe). To keep it compiled, keep "
                        f"{key!r} constant (e.g. OneCycleLR(..., cycle_momentum=False)) or use a "
                        "fused=True optimizer.", stacklevel=5)

    @contextlib.contextmanager
    def _lrs_as_tensors(self) -> Iterator[None]:
        """Inside: scheduled float lrs are their device tensors; after: the user's floats again."""
        groups = self.optimizer.param_groups
        floats = {i: groups[i]["lr"] for i in self._lr_tensors}
        try:
            for i, t in self._lr_tensors.items():
                t.fill_(floats[i])  # a host-to-device write of a Python float: no sync
                groups[i]["lr"] = t
            yield
        finally:
            for i, lr in floats.items():
                groups[i]["lr"] = lr

    def _needs_warm_up(self) -> bool:
        """Until one eager step was taken, while some parameter has no optimizer state.

        An optimizer that keeps no state (SGD without momentum) is warm after one step taken; a
        checkpoint-loaded one is warm from the start.
        """
        if self._warmed_up:
            return False
        state = self.optimizer.state
        return any(p.grad is not None and not state.get(p) for p in self._params)

    def _check_requires_grad(self) -> None:
        """Report a parameter whose ``requires_grad`` changed where Dynamo would not recompile.

        torch 2.11's Dynamo guards no parameter's ``requires_grad`` (plain ``torch.compile``
        alike, ``amp_fx._common.compat.dynamo_guards_param_requires_grad``): a layer unfrozen after the
        first step would keep getting no gradient. Checked on the host before each micro-batch,
        only on such versions; reported once per change (strict mode: an error).
        """
        if _compat.dynamo_guards_param_requires_grad():
            return
        named = list(self.model.named_parameters())
        now = [p.requires_grad for _, p in named]
        before, self._requires_grad = self._requires_grad, now
        if before is None or len(before) != len(now) or before == now:
            return
        changed = [name for (name, _), a, b in zip(named, before, now) if a != b]
        more = f" and {len(changed) - 5} more" if len(changed) > 5 else ""
        self._report.did_less(("requires_grad changed", tuple(changed)), (
            f"amp_fx.compile_step: requires_grad changed for {changed[:5]}{more} since the step "
            f"compiled its forward, and Dynamo on this torch ({torch.__version__}) does not recompile "
            "for that (torch 2.11 guards no parameter's requires_grad; plain torch.compile alike): "
            "those parameters would keep their old gradient behaviour (an unfrozen layer gets no "
            "gradient). After changing requires_grad, call torch._dynamo.reset() and build a new "
            "compile_step (same model, optimizer and scaler), or use torch >= 2.13."), stacklevel=4)

    def _follow_param_groups(self) -> None:
        """Take on parameters the optimizer gained or lost since the last step.

        ``optimizer.add_param_group`` between steps (progressive unfreezing) would otherwise leave
        the new parameters' gradients out of the unscale and the check while the traced step
        updates them: scaled gradients applied as they are. So the step's parameter list, the
        weight cache's writer and the FSDP2 local view are rebuilt, the finish recompiles once
        (expected, not reported), and the next step warms up eagerly while the new parameters have
        no optimizer state, as the first one did. A host-side comparison of object identities.
        """
        params = unique_params(self.optimizer)
        if len(params) == len(self._params) and all(a is b for a, b in zip(params, self._params)):
            return
        _check_params(self.model, self.optimizer)
        check_distributed_step(self.model, self.optimizer)
        logger.info("amp_fx.compile_step: the optimizer's parameters changed (%d -> %d); the step "
                    "follows them and recompiles its optimizer part once", len(self._params), len(params))
        self._params = params
        self._slots = self.scaler._skip_record.register(params)  # amp_fx/overflow.py: new params, new slots
        self._seen_groups = _group_values(self.optimizer)
        if self._lowp_writer is not None:
            self._lowp_writer = StepWriter(self._lowp_writer.cache, params)
        self._sharded = None
        self._warmed_up = False
        self._expect_recompile = True

    def _optimizer_step(self) -> None:
        opt = self.optimizer
        self._follow_param_groups()
        self._follow_hyperparameters()
        if self._needs_warm_up():
            self._eager_finish(warm_up=True)
        elif self._eager_optimizer:
            self._eager_finish(warm_up=False)
        else:
            before = self._finish_backend.graphs
            writer = self._lowp_writer
            with torch.no_grad():
                self._run_pre_hooks()
                if writer is not None:
                    writer.before_finish()
                with self._lrs_as_tensors(), _step_as_eager(opt):  # (sees the lrs as tensors)
                    sharded = self._local_shards()
                    try:
                        flags = self._finish(*self._scale_state())
                        if sharded is not None and self._fused:
                            self._fused_step_on_shards(sharded, *flags)
                    finally:
                        if sharded is not None:
                            sharded.after_finish()
                if writer is not None:
                    writer.after_finish()
                if self._fused and sharded is not None:
                    self._run_post_hooks()
                elif self._fused:
                    grad_scale, found_inf = flags
                    opt.grad_scale = grad_scale  # type: ignore[attr-defined]
                    opt.found_inf = found_inf  # type: ignore[attr-defined]
                    try:
                        opt.step()  # its own wrapper runs the hooks
                    finally:
                        del opt.grad_scale  # type: ignore[attr-defined]
                        del opt.found_inf  # type: ignore[attr-defined]
                    if writer is not None:
                        writer.after_fused_step()
                else:
                    self._run_post_hooks()
                    if writer is not None:
                        writer.after_hooks()
            if self._finish_backend.graphs != before and not self._expect_recompile:
                self._report.did_less(
                    "finish recompiled",
                    f"amp_fx.compile_step: the optimizer part recompiled ({self._finish_backend.graphs} graphs so "
                    "far): something it guards on changed between steps (the param groups, a hyperparameter "
                    "set to a new object, which parameters have gradients). Each recompile costs compile "
                    "time, and Dynamo stops compiling after 8; keep them fixed between steps.", stacklevel=4)
            self._expect_recompile = False
        opt.zero_grad()

    def _local_shards(self) -> LocalShards | None:
        """FSDP2: the local view, pointed at this step's gradients and state; else None."""
        if not self._fsdp2:
            return None
        if self._sharded is None:
            self._sharded = LocalShards(self.optimizer, self._params)
        self._sharded.before_finish()
        return self._sharded

    def _fused_step_on_shards(self, sharded: LocalShards, grad_scale: torch.Tensor | None,
                              found_inf: torch.Tensor) -> None:
        """A fused optimizer's kernel on the local shards, skipped on the device where found_inf
        (the flag already combined across ranks); its hooks run around it, on the user's optimizer."""
        view = sharded.optimizer
        view.grad_scale = grad_scale  # type: ignore[attr-defined]
        view.found_inf = found_inf  # type: ignore[attr-defined]
        try:
            self._raw_step(view)
        finally:
            del view.grad_scale  # type: ignore[attr-defined]
            del view.found_inf  # type: ignore[attr-defined]

    def _run_pre_hooks(self) -> None:
        if self._fused and not self._fsdp2:
            return  # optimizer.step() runs them
        from torch.optim.optimizer import _global_optimizer_pre_hooks

        opt = self.optimizer
        for hook in (*_global_optimizer_pre_hooks.values(), *opt._optimizer_step_pre_hooks.values()):
            if hook(opt, (), {}) is not None:
                raise RuntimeError("amp_fx.compile_step: optimizer step pre-hooks that change the step's "
                                   "arguments are not supported")

    def _run_post_hooks(self) -> None:
        from torch.optim.optimizer import _global_optimizer_post_hooks

        opt = self.optimizer
        opt._opt_called = True  # type: ignore[attr-defined]  (what an LR scheduler's wrapper records)
        for hook in (*opt._optimizer_step_post_hooks.values(), *_global_optimizer_post_hooks.values()):
            hook(opt, (), {})

    def _eager_finish(self, *, warm_up: bool) -> None:
        """amp_fx.GradScaler's eager path: the warm-up step (may read found_inf on the host), and
        the optimizer step once a hyperparameter other than lr is scheduled (masked, no sync)."""
        scaler, opt = self.scaler, self.optimizer
        if self.config.max_grad_norm is not None:
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(self._params, self.config.max_grad_norm)
        scaler.step(opt)
        scaler.update()
        if warm_up:
            self._warmed_up = not bool(scaler.last_step_skipped)  # a host read, during warm-up only

    # ------------------------------------------------------------------ the compiled finish
    def _finish_impl(self, state: rules.ScaleState, rule: rules.ScaleRule
                     ) -> tuple[torch.Tensor | None, torch.Tensor] | None:
        inv_scale, found_inf = rules.inv_scale_and_guard(state.scale, dynamic=rule.dynamic)
        sharded = self._sharded  # FSDP2: local shards, the flag and the norm combined across ranks
        params = self._params if sharded is None else sharded.params
        present = [i for i, p in enumerate(params) if p.grad is not None]
        grads = [params[i].grad for i in present]
        # amp_fx/overflow.py: which gradients held an inf/NaN, from the same kernel pass, and the
        # forward watch's first op; FSDP2 combines both across ranks in the found-inf all-reduce.
        flags = torch.zeros(len(grads), dtype=torch.float32, device=inv_scale.device)
        record = self.scaler._skip_record
        first_op = record.watch.take() if record.watch is not None else None
        first: tuple[torch.Tensor, torch.Tensor] | None = None
        max_norm = self.config.max_grad_norm
        fused_norm = max_norm is not None and self.config.grad_norm is GradNorm.FUSED
        grad_scale: torch.Tensor | None = None
        if self._fused and max_norm is None:
            # As torch.amp.GradScaler.step: check only, the fused kernel divides by grad_scale.
            unscale_check_(grads, found_inf, torch.ones_like(inv_scale), flags=flags)
            grad_scale = state.scale.clone()
        elif fused_norm:
            sum_sq = unscale_check_norm_(grads, found_inf, inv_scale, flags=flags)
        else:
            unscale_check_(grads, found_inf, inv_scale, flags=flags)
        if sharded is not None:  # one all-reduce: the flag, the gradients' flags, the forward record
            if first_op is None and record.watch is not None:  # the watch has not run: this rank joins
                first_op = torch.full((), -1, dtype=torch.int64, device=inv_scale.device)
            found_inf, flags, first = sharded.combine_found_inf(found_inf, flags, first_op)
        elif record.watch is not None and record.group is not None:  # DDP: one small all-reduce
            first = combine_first_op(first_op, record.group, inv_scale.device)
        if max_norm is not None:
            if fused_norm:
                total_norm = (sum_sq if sharded is None else sharded.global_sum(sum_sq)).sqrt()
            else:
                norms = torch._foreach_norm(grads, 2.0)
                total_norm = (torch.linalg.vector_norm(torch.stack(norms), 2.0) if sharded is None
                              else sharded.global_norm(norms))
            # clip_grad_norm_'s coefficient, written as it writes it (float / tensor is
            # reciprocal * float), so that with GradNorm.TORCH the bits are the same.
            clip_coef = max_norm / (total_norm + 1e-6)
            torch._foreach_mul_(grads, torch.clamp(clip_coef, max=1.0))
        if not self._fused:
            self._masked_step(found_inf)
            if self._lowp_writer is not None:
                self._lowp_writer.in_finish()  # the low-precision copies, in the update's pass
        rules.update_scale_(state, rule, found_inf)
        rules.record_step_(state, found_inf)
        self._record_skip(found_inf, present, flags, first_op if first is None else first[0],
                          None if first is None else first[1])
        if self._fused:
            return grad_scale, found_inf
        return None

    def _record_skip(self, found_inf: torch.Tensor, present: list[int], flags: torch.Tensor,
                     first_op: torch.Tensor | None, first_rank: torch.Tensor | None) -> None:
        """The scaler's skip record (amp_fx/overflow.py), traced into the finish: the flags of the
        gradients present, in the record's slots, and the forward watch's first op (and, combined
        across ranks, the rank that saw it)."""
        record = self.scaler._skip_record
        assert record.flags is not None
        n = record.flags.numel()
        slots = [self._slots[i] for i in present]
        if slots == list(range(n)):
            step_flags = flags
        else:
            step_flags = record.flags.new_zeros(n).index_copy(
                0, torch.tensor(slots, dtype=torch.int64, device=record.flags.device), flags)
        record.record_(found_inf, step_flags, first_op, first_rank)

    def _masked_step(self, found_inf: torch.Tensor) -> None:
        """The optimizer's own step function, traced, undone where found_inf (scaler.snapshot).

        FSDP2: the view of the optimizer on the local shards (``LocalShards``)."""
        sharded = self._sharded
        opt, params = (self.optimizer, self._params) if sharded is None else (sharded.optimizer, sharded.params)
        saved_params, saved_state = copy_state(opt, params)
        self._raw_step(opt)
        restore_where_(opt, params, saved_params, saved_state, found_inf)


def _group_values(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """Each param_group's entries but its params (the objects, not copies)."""
    return [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]


def _check_loss(loss: object) -> None:
    """loss_fn's result must be a floating-point 0-dim tensor (checked while tracing: the check
    reads metadata only; a failing one breaks the graph and raises in eager)."""
    if isinstance(loss, torch.Tensor) and loss.dim() == 0 and loss.is_floating_point():
        return
    what = (f"a {type(loss).__name__}" if not isinstance(loss, torch.Tensor)
            else f"a {loss.dtype} tensor of shape {tuple(loss.shape)}")
    hint = (" (a Hugging Face model returns loss=None when no labels are passed)" if loss is None
            else "; reduce it (e.g. .mean()) in loss_fn")
    raise ValueError(f"amp_fx: loss_fn must return a floating-point scalar (0-dim) tensor, got {what}{hint}")


def _default_scaler(dtype: torch.dtype, device: torch.device, strict: bool | None) -> GradScaler:
    if dtype == torch.bfloat16:
        return GradScaler(device.type, mode=ScalerMode.CHECK_ONLY, step_mode=StepMode.MASKED, strict=strict)
    return GradScaler(device.type, step_mode=StepMode.MASKED, strict=strict)


def _check_params(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    model_params = {id(p) for p in model.parameters()}
    foreign = [i for i, p in enumerate(unique_params(optimizer)) if id(p) not in model_params]
    if foreign:
        raise ValueError(f"amp_fx.compile_step: the optimizer holds {len(foreign)} parameter(s) that are not "
                         f"parameters of the model (positions {foreign[:5]} in its param_groups); build the "
                         "optimizer on model.parameters()")
    in_opt = {id(p) for p in unique_params(optimizer)}
    missing = [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in in_opt]
    if missing:
        # The user's own setup, not something amp_fx left undone: a UserWarning, never strict.
        # stacklevel 3: the caller of compile_step.
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        warnings.warn(f"amp_fx.compile_step: trainable parameters not in the optimizer keep accumulating "
                      f"gradients (the step never zeroes them): {missing[:5]}{more}; add them to the "
                      "optimizer or set requires_grad=False", UserWarning, stacklevel=3)


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
    fp8: Fp8Like = None,
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
        fp8: train the forward's matmuls in fp8, as :func:`amp_fx.compile`'s ``fp8=`` (a recipe
            name, an ``amp_fx.Fp8Recipe`` or an ``amp_fx.Fp8Config``; docs: "fp8 training").

    Example:
        >>> model = torch.nn.Linear(4, 2)
        >>> opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
        >>> step = amp_fx.compile_step(model, opt, torch.nn.functional.mse_loss, backend="aot_eager")
        >>> loss = step(torch.randn(8, 4), torch.randn(8, 2))
    """
    options = Options(dtype=dtype, policy=policy, backend=backend, strict=strict, weight_cache=weight_cache,
                      watch_nonfinite=watch_nonfinite, torch_compile={"dynamic": dynamic}, fp8=fp8)
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"amp_fx.compile_step: model must be an nn.Module, got {type(model).__name__}")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"amp_fx.compile_step: optimizer must be a torch.optim.Optimizer, got "
                        f"{type(optimizer).__name__}")
    check_distributed_step(model, optimizer)  # FSDP1, FSDP2 layouts/optimizers: a clear error
    if not callable(loss_fn):
        raise TypeError(f"amp_fx.compile_step: loss_fn must be callable, got {type(loss_fn).__name__}")
    config = _Config(dtype=options.dtype, accumulate=accumulate, max_grad_norm=max_grad_norm, grad_norm=grad_norm,
                     n_inputs=n_inputs)
    _check_params(model, optimizer)
    params = unique_params(optimizer)
    if not params:
        raise ValueError("amp_fx.compile_step: the optimizer has no parameters")
    devices = {p.device for p in params}
    if len(devices) != 1:
        raise ValueError(f"amp_fx.compile_step: parameters on several devices {sorted(map(str, devices))} "
                         "are not supported")
    if scaler is None:
        scaler = _default_scaler(options.dtype, params[0].device, options.strict)
    elif not isinstance(scaler, GradScaler):
        raise TypeError("amp_fx.compile_step: scaler must be an amp_fx GradScaler; to continue from a "
                        "torch.amp.GradScaler, load its state: s = amp_fx.scaler.GradScaler('cpu'); "
                        "s.load_state_dict(torch_scaler.state_dict())")
    if not scaler.is_enabled():
        raise ValueError("amp_fx.compile_step: the scaler is disabled (e.g. a 'cuda' scaler without CUDA); "
                         "pass one for the parameters' device type")
    if any(isinstance(v, torch.Tensor) and v.requires_grad for g in optimizer.param_groups for v in g.values()
           if not isinstance(v, list)):
        raise ValueError("amp_fx.compile_step: differentiable optimizer hyperparameters are not supported")
    return CompiledStep(model, optimizer, loss_fn, config=config, scaler=scaler, options=options)
