"""``amp_fx.compile_step``: a whole mixed-precision training step, compiled, with no host sync.

    step = amp_fx.compile_step(model, optimizer, torch.nn.functional.cross_entropy, dtype="fp16")
    for x, y in loader:
        loss = step(x, y)          # forward, loss, scaled backward, unscale/check/clip, step, update

One call of the returned :class:`CompiledStep` runs three compiled pieces, stitched by Python
that reads no tensor value:

1. **forward + loss** (``amp_fx.compile`` of ``loss_fn(model(*inputs), *targets)``, so the
   loss is computed under the same autocast policy as the model, as in torch's AMP recipe),
   returning the loss and the loss multiplied by the scale. AOTAutograd compiles its backward.
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
backward in the same graph; they were not measured for this version. The pieces here are each
a full graph (``fullgraph=True``, so a break is an error, not a silent fallback); what matters
for CUDA graphs and throughput is that nothing between them reads the device, which this module
guarantees and ``tests/test_step.py`` proves with the profiler.

Warm-up: until every parameter of the optimizer has optimizer state (normally the first step),
the finish runs eagerly through ``amp_fx.GradScaler`` (``unscale_``, ``clip_grad_norm_``,
``step``, ``update``) which may read found_inf once on the host: a first step that creates
state cannot be undone on the device (torch's fused SGD would even leave its momentum buffers
uninitialised). From then on no step reads a device value on the host.
"""

from __future__ import annotations

import enum
import inspect
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch._dynamo

import amp_fx.kernels.scale_update  # noqa: F401  (registers torch.ops.amp_fx.update_scale_)
from amp_fx._dist.step import distributed_forward, refuse_distributed_step
from amp_fx.backend import Backend
from amp_fx.compile import compile as amp_compile
from amp_fx.kernels.unscale import unscale_check_, unscale_check_norm_
from amp_fx.policy import Policy, resolve_dtype
from amp_fx.scaler import GradScaler, ScalerMode, StepMode

__all__ = ["compile_step", "CompiledStep", "GradNorm"]

logger = logging.getLogger(__name__)

LossFn = Callable[..., torch.Tensor]


class GradNorm(enum.Enum):
    """How the total gradient norm for clipping is computed.

    * ``FUSED``: ``torch.ops.amp_fx.unscale_check_norm_`` returns the sum of squares in the same
      pass that unscales (one read of the gradients fewer). Accumulated in fp32 with partial
      sums in fp64, so it can differ from ``clip_grad_norm_``'s norm in the last bits.
    * ``TORCH``: ``clip_grad_norm_``'s own formula (``_foreach_norm``, then the norm of the
      norms) after the fused unscale: bit for bit torch's clipping.
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


def _unique_params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    seen: set[int] = set()
    params: list[torch.Tensor] = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in seen:
                seen.add(id(p))
                params.append(p)
    return params


class _CountingBackend:
    """A torch.compile backend that delegates and counts the graphs it compiles."""

    def __init__(self, backend: str | Backend) -> None:
        if callable(backend):
            self._inner: Backend = backend
        elif backend == "inductor":
            from torch._inductor.compile_fx import compile_fx

            self._inner = compile_fx
        else:
            self._inner = torch._dynamo.lookup_backend(backend)
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
                 config: _Config, scaler: GradScaler, backend: str | Backend, policy: Policy | None,
                 dynamic: bool | None) -> None:
        self.model = model
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.config = config
        self.scaler = scaler
        self._params = _unique_params(optimizer)
        self._fused = bool(getattr(optimizer, "_step_supports_amp_scaling", False))
        self._raw_step = _raw_step(optimizer)
        self._micro_step = 0
        self._compiled_finishes = 0
        self._forward = distributed_forward(  # DDP: per-unit capture, no_sync within a window
            self, compile_model=lambda m: amp_compile(m, dtype=config.dtype, policy=policy, backend=backend,
                                                      dynamic=dynamic),
        ) or amp_compile(self._forward_loss, dtype=config.dtype, policy=policy,
                         backend=backend, fullgraph=True, dynamic=dynamic)
        self._finish_backend = _CountingBackend(backend)
        self._finish = torch.compile(self._finish_impl, backend=self._finish_backend,
                                     fullgraph=True, dynamic=False)
        self._seen_lrs = self._float_lrs()
        self._warmed_up = False

    # ------------------------------------------------------------------ public state
    @property
    def scale(self) -> torch.Tensor:
        """The current loss scale (0-dim float32 on the device; 1.0 in check-only mode)."""
        self._ensure_scale()
        assert self.scaler._scale is not None
        return self.scaler._scale

    @property
    def last_step_skipped(self) -> torch.Tensor:
        """0-dim bool tensor: whether the last optimizer step was skipped (non-finite gradients)."""
        return self.scaler.last_step_skipped

    @property
    def skipped_steps(self) -> torch.Tensor:
        """0-dim int64 tensor: optimizer steps skipped so far."""
        return self.scaler.skipped_steps

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
    def __call__(self, *batch: Any) -> torch.Tensor:
        n = self.config.n_inputs
        if len(batch) < n:
            raise TypeError(f"amp_fx: step() takes the model's {n} input(s) then the loss targets, got "
                            f"{len(batch)} argument(s)")
        scale = self._ensure_scale(batch)
        loss, scaled = self._forward(scale, *batch)
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0 or not loss.is_floating_point():
            what = (f"a {type(loss).__name__}" if not isinstance(loss, torch.Tensor)
                    else f"a {loss.dtype} tensor of shape {tuple(loss.shape)}")
            raise ValueError(f"amp_fx: loss_fn must return a floating-point scalar (0-dim) tensor, got {what}; "
                             "reduce it (e.g. .mean()) in loss_fn")
        scaled.backward()
        self._micro_step += 1
        if self._micro_step == self.config.accumulate:
            self._micro_step = 0
            self._optimizer_step()
        return loss

    def _ensure_scale(self, batch: Sequence[Any] = ()) -> torch.Tensor:
        if self.scaler._scale is None:
            device = self._params[0].device if self._params else torch.device("cpu")
            self.scaler.scale(torch.zeros((), device=device))  # creates the scaler's device state
        assert self.scaler._scale is not None
        return self.scaler._scale

    def _forward_loss(self, scale: torch.Tensor, *batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        n = self.config.n_inputs
        loss = self.loss_fn(self.model(*batch[:n]), *batch[n:])
        scaled = loss
        if self.config.accumulate > 1:
            scaled = scaled / self.config.accumulate  # torch's recipe: gradients are the window mean
        if self.scaler.mode is ScalerMode.DYNAMIC:
            scaled = scaled * scale
        return loss.detach(), scaled

    def _float_lrs(self) -> list[float | None]:
        return [g["lr"] if isinstance(g.get("lr"), float) else None for g in self.optimizer.param_groups]

    def _wrap_changed_lrs(self) -> None:
        """Turn a float ``lr`` that changed (an LR scheduler) into a 0-dim tensor, once.

        Dynamo specialises the traced step on a float ``lr``, so every new value would recompile
        the optimizer part. A tensor ``lr`` is a graph input and LR schedulers update it in place
        (``fill_``), as torch recommends for compiled optimizers. Constant float learning rates
        are left alone: they keep the eager optimizer's arithmetic (``add_(g, alpha=-lr)``).
        float64 keeps the Python float's value; the optimizer casts it where it is used.
        """
        if self._fused:
            return  # fused optimizers step eagerly: a float lr never recompiles anything
        lrs = self._float_lrs()
        if len(lrs) != len(self._seen_lrs):
            self._seen_lrs = lrs
            return
        for i, (group, now, before) in enumerate(zip(self.optimizer.param_groups, lrs, self._seen_lrs)):
            if now is not None and before is not None and now != before:
                device = group["params"][0].device if group["params"] else torch.device("cpu")
                group["lr"] = torch.tensor(now, dtype=torch.float64, device=device)
                logger.info("amp_fx.compile_step: param_groups[%d]['lr'] changed (%s -> %s); it is now a "
                            "0-dim tensor so that the compiled step does not recompile for each value",
                            i, before, now)
        self._seen_lrs = self._float_lrs()

    def _needs_warm_up(self) -> bool:
        """Until one eager step was taken, while some parameter has no optimizer state.

        An optimizer that keeps no state (SGD without momentum) is warm after one step taken; a
        checkpoint-loaded one is warm from the start.
        """
        if self._warmed_up:
            return False
        state = self.optimizer.state
        return any(p.grad is not None and not state.get(p) for p in self._params)

    def _optimizer_step(self) -> None:
        opt = self.optimizer
        self._wrap_changed_lrs()
        if self._needs_warm_up():
            self._eager_finish()
        else:
            before = self._finish_backend.graphs
            with torch.no_grad():
                self._run_pre_hooks()
                flags = self._finish()
                if self._fused:
                    grad_scale, found_inf = flags
                    opt.grad_scale = grad_scale  # type: ignore[attr-defined]
                    opt.found_inf = found_inf  # type: ignore[attr-defined]
                    try:
                        opt.step()  # its own wrapper runs the hooks
                    finally:
                        del opt.grad_scale  # type: ignore[attr-defined]
                        del opt.found_inf  # type: ignore[attr-defined]
                else:
                    self._run_post_hooks()
            if self._finish_backend.graphs != before:
                self._compiled_finishes += 1
                if self._compiled_finishes > 1:
                    logger.warning("amp_fx.compile_step: the optimizer part recompiled (%d graphs so far); "
                                   "something it guards on changed (param groups, a float hyperparameter, "
                                   "gradients present)", self._finish_backend.graphs)
        opt.zero_grad()

    def _run_pre_hooks(self) -> None:
        if self._fused:
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

    def _eager_finish(self) -> None:
        """The warm-up step: amp_fx.GradScaler's eager path (may read found_inf on the host)."""
        scaler, opt = self.scaler, self.optimizer
        if self.config.max_grad_norm is not None:
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(self._params, self.config.max_grad_norm)
        scaler.step(opt)
        scaler.update()
        self._warmed_up = not bool(scaler.last_step_skipped)  # a host read, during warm-up only

    # ------------------------------------------------------------------ the compiled finish
    def _finish_impl(self) -> tuple[torch.Tensor | None, torch.Tensor] | None:
        scaler = self.scaler
        scale = scaler._scale
        assert scale is not None
        grads = [p.grad for p in self._params if p.grad is not None]
        if scaler._mode is ScalerMode.DYNAMIC:
            # torch's inv_scale; a scale with no finite reciprocal counts as an overflow (see scaler).
            inv_scale = scale.double().reciprocal().float()
            found_inf = (~torch.isfinite(inv_scale)).to(torch.float32)
        else:
            inv_scale = torch.ones((), dtype=torch.float32, device=scale.device)
            found_inf = torch.zeros((), dtype=torch.float32, device=scale.device)
        max_norm = self.config.max_grad_norm
        grad_scale: torch.Tensor | None = None
        if self._fused and max_norm is None:
            # As torch.amp.GradScaler.step: check only, the fused kernel divides by grad_scale.
            unscale_check_(grads, found_inf, torch.ones_like(inv_scale))
            grad_scale = scale.clone()
        elif max_norm is None:
            unscale_check_(grads, found_inf, inv_scale)
        else:
            if self.config.grad_norm is GradNorm.FUSED:
                total_norm = unscale_check_norm_(grads, found_inf, inv_scale).sqrt()
            else:
                unscale_check_(grads, found_inf, inv_scale)
                norms = torch._foreach_norm(grads, 2.0)
                total_norm = torch.linalg.vector_norm(torch.stack(norms), 2.0)
            # clip_grad_norm_'s coefficient, written as it writes it (float / tensor is
            # reciprocal * float), so that with GradNorm.TORCH the bits are the same.
            clip_coef = max_norm / (total_norm + 1e-6)
            torch._foreach_mul_(grads, torch.clamp(clip_coef, max=1.0))
        if not self._fused:
            self._masked_step(found_inf)
        self._update_scale(found_inf)
        if self._fused:
            return grad_scale, found_inf
        return None

    def _masked_step(self, found_inf: torch.Tensor) -> None:
        opt = self.optimizer
        saved_params = [p.detach().clone() for p in self._params]
        saved_state: list[list[tuple[str, torch.Tensor]]] = []
        for p in self._params:
            entry = opt.state.get(p)  # .get: indexing the defaultdict would add entries (and a recompile)
            saved_state.append([] if entry is None else
                               [(k, v.clone()) for k, v in entry.items() if isinstance(v, torch.Tensor)])
        self._raw_step(opt)
        skip = found_inf != 0
        for p, old in zip(self._params, saved_params):
            p.copy_(torch.where(skip, old, p))
        for p, saved in zip(self._params, saved_state):
            if not saved:
                continue
            entry = opt.state[p]
            for k, old in saved:
                entry[k].copy_(torch.where(skip, old, entry[k]))

    def _update_scale(self, found_inf: torch.Tensor) -> None:
        s = self.scaler
        if s._mode is ScalerMode.DYNAMIC:
            torch.ops.amp_fx.update_scale_(
                s._scale, s._growth_tracker, s._hysteresis_tracker, found_inf, s._growth_factor,
                s._backoff_factor, s._growth_interval, s._min_scale, s._max_scale, s._hysteresis,
                s._consecutive_hysteresis)
        s._last_found_inf.copy_(found_inf)
        s._skipped_steps.add_((found_inf != 0).to(torch.int64))


def _default_scaler(dtype: torch.dtype, device: torch.device) -> GradScaler:
    if dtype == torch.bfloat16:
        return GradScaler(device.type, mode=ScalerMode.CHECK_ONLY, step_mode=StepMode.MASKED)
    return GradScaler(device.type, step_mode=StepMode.MASKED)


def _check_params(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    model_params = {id(p) for p in model.parameters()}
    foreign = [i for i, p in enumerate(_unique_params(optimizer)) if id(p) not in model_params]
    if foreign:
        raise ValueError(f"amp_fx.compile_step: the optimizer holds {len(foreign)} parameter(s) that are not "
                         f"parameters of the model (positions {foreign[:5]} in its param_groups); build the "
                         "optimizer on model.parameters()")
    in_opt = {id(p) for p in _unique_params(optimizer)}
    missing = [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in in_opt]
    if missing:
        logger.warning("amp_fx.compile_step: trainable parameters not in the optimizer keep accumulating "
                       "gradients: %s", missing[:5])


def compile_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    loss_fn: LossFn,
    *,
    dtype: str | torch.dtype = "fp16",
    scaler: GradScaler | None = None,
    max_grad_norm: float | None = None,
    grad_norm: GradNorm = GradNorm.FUSED,
    accumulate: int = 1,
    n_inputs: int = 1,
    backend: str | Backend = "inductor",
    policy: Policy | None = None,
    dynamic: bool | None = None,
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
        grad_norm: how the norm for clipping is computed (see :class:`GradNorm`).
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

    Example:
        >>> model = torch.nn.Linear(4, 2)
        >>> opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
        >>> step = amp_fx.compile_step(model, opt, torch.nn.functional.mse_loss, backend="aot_eager")
        >>> loss = step(torch.randn(8, 4), torch.randn(8, 2))
    """
    lower = resolve_dtype(dtype)
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"amp_fx.compile_step: model must be an nn.Module, got {type(model).__name__}")
    refuse_distributed_step(model)  # FSDP2: a clear error instead of Dynamo's
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"amp_fx.compile_step: optimizer must be a torch.optim.Optimizer, got "
                        f"{type(optimizer).__name__}")
    if not callable(loss_fn):
        raise TypeError(f"amp_fx.compile_step: loss_fn must be callable, got {type(loss_fn).__name__}")
    config = _Config(dtype=lower, accumulate=accumulate, max_grad_norm=max_grad_norm, grad_norm=grad_norm,
                     n_inputs=n_inputs)
    _check_params(model, optimizer)
    params = _unique_params(optimizer)
    if not params:
        raise ValueError("amp_fx.compile_step: the optimizer has no parameters")
    devices = {p.device for p in params}
    if len(devices) != 1:
        raise ValueError(f"amp_fx.compile_step: parameters on several devices {sorted(map(str, devices))} "
                         "are not supported")
    if scaler is None:
        scaler = _default_scaler(lower, params[0].device)
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
    return CompiledStep(model, optimizer, loss_fn, config=config, scaler=scaler, backend=backend,
                        policy=policy, dynamic=dynamic)
