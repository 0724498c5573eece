"""amp_fx.precision_report: what precision each part of a training setup actually has.

    >>> report = amp_fx.precision_report(model, optimizer, scaler=scaler, loss=loss)  # doctest: +SKIP
    >>> print(report)                                                                 # doctest: +SKIP

One row per part: the master weights (the parameters the optimizer updates), the weights the
forward computes with, the gradients, the optimizer state, amp_fx's weight cache, the loss, the
loss scaling and each collective of DDP or FSDP2, with its dtype(s) and the bytes per parameter it
holds (or puts on the wire), every number read from the tensors themselves.

Silent downgrades are reported once each (an ``AmpFxWarning`` naming the thing and the fix; an
``AmpFxError`` in strict mode): with mixed precision asked for (``amp_fx.compile``'s or
``compile_step``'s ``dtype``, ``dtype=`` here, FSDP2's or DDP's ``param_dtype``),

* master weights in 16 bits (``model.to(torch.bfloat16)`` before ``amp_fx.compile``): every update
  is rounded to bf16, and torch's optimizers create their state in the parameters' dtype;
* optimizer state in 16 bits (AdamW's moments inherit the parameters' dtype);
* a loss-scaling ``GradScaler`` with bf16 (bf16 has fp32's range: the scaling buys nothing);
* fp16 with no loss scaling (small fp16 gradients flush to zero);
* an FSDP2 ``reduce_dtype`` that not every ``fully_shard`` applies (``mp_policy`` is per call: a
  unit given none reduces its gradients in their own dtype).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from tabulate import tabulate

from amp_fx._common.compat import fsdp_param_groups
from amp_fx._common.report import Reporter
from amp_fx._common.unwrap import layers
from amp_fx.api import options_of
from amp_fx.backend.wrapper import AmpCompiledModule, reporter_of
from amp_fx.low_precision import recipes
from amp_fx.options import Options
from amp_fx.policy import resolve_dtype
from amp_fx.scaler import GradScaler, ScalerMode

__all__ = [
    "Downgrade",
    "FsdpUnit",
    "PrecisionReport",
    "PrecisionRow",
    "fsdp2_dtypes",
    "fsdp2_rows",
    "precision_report",
    "report_downgrades",
    "step_report",
]


class Downgrade(enum.Enum):
    """The silent downgrades :func:`precision_report` names (each is reported once per owner)."""

    MASTER_WEIGHTS_16BIT = "master weights in 16 bits"
    OPTIMIZER_STATE_16BIT = "optimizer state in 16 bits"
    SCALER_WITH_BF16 = "a GradScaler with bf16"
    FP16_WITHOUT_SCALING = "fp16 with no loss scaling"
    REDUCE_DTYPE_NOT_APPLIED = "FSDP2 reduce_dtype not applied"


@dataclass(frozen=True)
class PrecisionRow:
    """One part of the setup: its dtype(s) (empty where it has none, or none is known), the bytes
    per parameter it holds or sends (None where it is not per parameter), and how that was found."""

    part: str
    dtypes: tuple[torch.dtype, ...]
    bytes_per_param: float | None
    note: str = ""


@dataclass(frozen=True)
class PrecisionReport:
    """What :func:`precision_report` found. ``str(report)`` is the table, then the downgrades.

    ``params`` counts the parameter elements the bytes are divided by (this rank's shards under
    FSDP2); ``downgrades`` maps each silent downgrade found to its message."""

    compute_dtype: torch.dtype | None
    params: int
    rows: tuple[PrecisionRow, ...]
    downgrades: dict[Downgrade, str]

    def row(self, part: str) -> PrecisionRow:
        """The row whose ``part`` is ``part`` (KeyError if none)."""
        for r in self.rows:
            if r.part == part:
                return r
        raise KeyError(f"amp_fx.PrecisionReport: no row {part!r}; rows: {[r.part for r in self.rows]}")

    def __str__(self) -> str:
        asked = "none asked" if self.compute_dtype is None else _name(self.compute_dtype)
        table = tabulate(
            [
                [
                    r.part,
                    ", ".join(map(_name, r.dtypes)) or "-",
                    "-" if r.bytes_per_param is None else f"{r.bytes_per_param:.2f}",
                    r.note,
                ]
                for r in self.rows
            ],
            headers=["part", "dtype", "B/param", "how"],
        )
        lines = [f"mixed precision: {asked}; {self.params} parameter elements", table]
        lines += [f"downgrade: {message}" for message in self.downgrades.values()]
        return "\n".join(lines)


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (what this rank holds), else ``t``."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def _nbytes(t: torch.Tensor) -> int:
    """Bytes of ``t``'s elements; a tensor subclass (torchao's low-bit optimizer state) by the
    plain tensors it holds."""
    t = _local(t)
    if type(t) not in (torch.Tensor, torch.nn.Parameter) and hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        return sum(_nbytes(getattr(t, n)) for n in names)
    return t.numel() * t.element_size()


def _low(dtype: torch.dtype) -> bool:
    """A floating dtype of 16 bits or fewer."""
    return dtype.is_floating_point and dtype.itemsize <= 2


def _dtypes(tensors: Iterable[torch.Tensor]) -> tuple[torch.dtype, ...]:
    seen: dict[torch.dtype, None] = {}
    for t in tensors:
        seen[t.dtype] = None
    return tuple(seen)


def _unique(tensors: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    seen: dict[int, torch.Tensor] = {}
    for t in tensors:
        seen.setdefault(id(t), t)
    return list(seen.values())


# --- the wrappers around the model -------------------------------------------------------------


@dataclass
class _Setup:
    options: Options | None = None
    reporter: Reporter | None = None
    cache: Any = None
    ddp: Any = None
    module: torch.nn.Module | None = None


def _find(model: torch.nn.Module) -> _Setup:
    """amp_fx's options (and the compiled module's reporter and weight cache), DDP and the innermost
    module, through every wrapper (amp_fx.compile outside or inside DDP, torch.compile)."""
    setup = _Setup()
    for layer in layers(model, ddp=True):
        try:
            options = options_of(layer)
        except TypeError:
            options = None
        if options is not None and setup.options is None:
            setup.options = options
            if isinstance(layer, AmpCompiledModule):
                setup.reporter, setup.cache = reporter_of(layer), layer.amp_fx_weight_cache
        if torch.distributed.is_available() and isinstance(layer, torch.nn.parallel.DistributedDataParallel):
            setup.ddp = layer
        if isinstance(layer, torch.nn.Module):
            setup.module = layer
    return setup


# --- collectives -------------------------------------------------------------------------------

_HOOK_DTYPES = {"fp16_compress": torch.float16, "bf16_compress": torch.bfloat16}


def _ddp_row(ddp: Any, params: Sequence[torch.Tensor], n: int) -> PrecisionRow:
    """DDP's gradient all-reduce: in the gradients' dtype, unless a comm hook or DDP's (private)
    ``mixed_precision`` sets another."""
    part = "all_reduce (DDP gradients)"
    hooks = [getattr(h, "__qualname__", repr(h)) for h, _ in getattr(ddp, "_comm_hooks", [])]
    if not hooks:  # a built-in (C++) hook is known by the name DDP logs
        builtin = str(ddp._get_ddp_logging_data().get("comm_hook", "") or "")
        hooks = [builtin] if builtin else []
    mixed = getattr(ddp, "mixed_precision", None)
    if mixed is not None:
        dtype = mixed.reduce_dtype
        return PrecisionRow(part, (dtype,), float(dtype.itemsize), "DDP(mixed_precision=...).reduce_dtype")
    hook = hooks[-1] if hooks else ""
    dtype = next((d for key, d in _HOOK_DTYPES.items() if key in hook.lower()), None)
    if dtype is not None:
        return PrecisionRow(part, (dtype,), float(dtype.itemsize), f"comm hook {hook}")
    if hook and "allreduce" not in hook.lower():
        return PrecisionRow(part, (), None, f"comm hook {hook}: the dtype on the wire is the hook's")
    grad_dtypes = _param_grad_dtypes(params)
    return PrecisionRow(
        part,
        tuple(dict.fromkeys(grad_dtypes)),
        sum(_local(p).numel() * d.itemsize for p, d in zip(params, grad_dtypes)) / n,
        (f"comm hook {hook}: " if hook else "no comm hook: ") + "in the gradients' dtype",
    )


def _param_grad_dtypes(params: Sequence[torch.Tensor]) -> list[torch.dtype]:
    return [p.grad.dtype if p.grad is not None else p.dtype for p in params]


def fsdp2_dtypes(policy: Any, orig_dtype: torch.dtype) -> tuple[torch.dtype, torch.dtype]:
    """The dtypes FSDP2 all-gathers and reduces a parameter of ``orig_dtype`` in under ``policy``
    (a ``MixedPrecisionPolicy``): torch's ``FSDPParam.init_dtype_attrs`` and ``foreach_reduce``
    (``reduce_dtype or grad_dtype``, the gradient being in the gathered dtype)."""
    param_dtype, reduce_dtype = policy.param_dtype, policy.reduce_dtype
    if reduce_dtype == param_dtype:
        reduce_dtype = None
    if param_dtype == orig_dtype or not orig_dtype.is_floating_point:
        param_dtype = None
    gathered = param_dtype or orig_dtype
    return gathered, reduce_dtype or gathered


@dataclass(frozen=True)
class FsdpUnit:
    """One ``fully_shard`` call: its name (the module's path, "<root>" for the model), its
    ``MixedPrecisionPolicy``, and the (local numel, dtype) of each trainable parameter it manages."""

    name: str
    policy: Any
    params: tuple[tuple[int, torch.dtype], ...]


def fsdp2_rows(units: Sequence[FsdpUnit], n: int) -> tuple[list[PrecisionRow], str | None]:
    """The all-gather and reduce-scatter rows of FSDP2 ``units`` (bytes per element on the wire,
    over ``n`` parameter elements), and the message if a ``reduce_dtype`` set on one unit is not
    what another unit reduces in."""
    gathered: dict[str, torch.dtype] = {}
    reduced: dict[str, torch.dtype] = {}
    gather_bytes = reduce_bytes = 0
    for unit in units:
        for numel, dtype in unit.params:
            g, r = fsdp2_dtypes(unit.policy, dtype)
            gathered[unit.name], reduced[unit.name] = g, r
            gather_bytes += numel * g.itemsize
            reduce_bytes += numel * r.itemsize
    rows = [
        PrecisionRow(
            "all_gather (FSDP2 parameters)",
            tuple(dict.fromkeys(gathered.values())),
            gather_bytes / n if n else None,
            _per_unit(gathered),
        ),
        PrecisionRow(
            "reduce_scatter (FSDP2 gradients)",
            tuple(dict.fromkeys(reduced.values())),
            reduce_bytes / n if n else None,
            _per_unit(reduced),
        ),
    ]
    asked = {u.policy.reduce_dtype for u in units if u.name in reduced and u.policy.reduce_dtype is not None}
    message = None
    if len(asked) == 1:
        want = next(iter(asked))
        missing = [name for name, dtype in reduced.items() if dtype != want]
        if missing:
            names = ", ".join(f"fully_shard({name}) reduces in {_name(reduced[name])}" for name in missing)
            message = (
                f"FSDP2: reduce_dtype={want} is set on some fully_shard calls but not applied to every "
                f"collective: {names} (mp_policy is per fully_shard call; a call without it reduces the "
                f"gradients in their own dtype). Pass the same MixedPrecisionPolicy(..., reduce_dtype={want}) "
                f"to every fully_shard call, the root's included."
            )
    elif len(asked) > 1:
        names = ", ".join(f"fully_shard({name}): {_name(dtype)}" for name, dtype in reduced.items())
        message = (
            f"FSDP2: the fully_shard calls ask for different reduce dtypes ({names}). Pass one "
            f"MixedPrecisionPolicy to every fully_shard call."
        )
    return rows, message


def _per_unit(dtypes: dict[str, torch.dtype]) -> str:
    by_dtype: dict[torch.dtype, list[str]] = {}
    for name, dtype in dtypes.items():
        by_dtype.setdefault(dtype, []).append(name)
    if len(by_dtype) <= 1:
        return f"every fully_shard ({len(dtypes)})"
    return "; ".join(f"{_name(d)}: fully_shard({', '.join(names)})" for d, names in by_dtype.items())


def _fsdp2_units(module: torch.nn.Module) -> list[FsdpUnit]:
    """Every ``fully_shard`` unit of ``module`` with trainable parameters, read from FSDP2's state."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch without distributed
        return []
    units = []
    for name, m in module.named_modules():
        if not isinstance(m, FSDPModule):
            continue
        for group in fsdp_param_groups(m):  # one per mesh its parameters lie on
            params = tuple(
                (_local(p.sharded_param).numel(), p.sharded_param.dtype)
                for p in group.fsdp_params
                if p.sharded_param.requires_grad
            )
            if params:
                units.append(FsdpUnit(name or "<root>", group.mp_policy, params))
    return units


# --- the report --------------------------------------------------------------------------------


def _optimizer_state(optimizer: torch.optim.Optimizer) -> dict[str, list[torch.Tensor]]:
    """The per-parameter state tensors by key (0-dim ones, such as AdamW's ``step``, left out)."""
    out: dict[str, list[torch.Tensor]] = {}
    for state in optimizer.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                out.setdefault(key, []).append(value)
    return out


def _compute_dtype(setup: _Setup, dtype: str | torch.dtype | None) -> torch.dtype | None:
    if dtype is not None:
        return resolve_dtype(dtype)
    if setup.options is not None:
        return setup.options.dtype
    return None


def _build(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    *,
    setup: _Setup,
    compute: torch.dtype | None,
    scaler: Any,
    loss: torch.Tensor | torch.dtype | None,
    compiled_step: bool,
    train_state: str | None = None,
) -> PrecisionReport:
    params = _trained_params(model, optimizer)
    n = sum(_local(p).numel() for p in params)
    units = _fsdp2_units(setup.module or model)
    fsdp_param_dtypes = {u.policy.param_dtype for u in units} - {None}
    if compute is None and len(fsdp_param_dtypes) == 1:
        compute = next(iter(fsdp_param_dtypes))
    mixed = getattr(setup.ddp, "mixed_precision", None)
    if compute is None and mixed is not None:
        compute = mixed.param_dtype
    downgrades: dict[Downgrade, str] = {}
    asked = compute is not None and compute != torch.float32
    master = _dtypes(params)
    rows = [
        _master_row(params, n, bool(units), train_state, compute if asked else None, downgrades),
        _compute_weights_row(setup, compute, master, units, fsdp_param_dtypes),
        _gradients_row(params, n, master, compiled_step),
    ]
    if optimizer is not None:
        rows.append(_optimizer_row(optimizer, n, master, train_state, compute if asked else None, downgrades))
    held = setup.cache.tensors() if setup.cache is not None else []
    rows.append(
        PrecisionRow(
            "caches",
            _dtypes(held),
            sum(_nbytes(t) for t in held) / n,
            "amp_fx's weight cache" if setup.cache is not None else "no weight cache",
        )
    )
    loss_dtype = loss if isinstance(loss, torch.dtype) else getattr(loss, "dtype", None)
    rows.append(
        PrecisionRow(
            "loss",
            () if loss_dtype is None else (loss_dtype,),
            None,
            "pass loss= (the value the loss function returns)" if loss_dtype is None else "",
        )
    )
    rows.append(_scaling_row(scaler, compute, downgrades, compiled_step))
    # collectives
    if setup.ddp is not None:
        rows.append(_ddp_row(setup.ddp, params, n))
    if units:
        fsdp_rows, message = fsdp2_rows(units, n)
        rows += fsdp_rows
        if message is not None:
            downgrades[Downgrade.REDUCE_DTYPE_NOT_APPLIED] = message
    return PrecisionReport(compute, n, tuple(rows), downgrades)


def _trained_params(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> list[torch.Tensor]:
    """The parameters the optimizer updates (without one: those that require grad), each once."""
    if optimizer is not None:
        params = _unique(p for g in optimizer.param_groups for p in g["params"])
    else:
        params = _unique(p for p in model.parameters() if p.requires_grad)
    if not params:
        raise ValueError(
            "amp_fx.precision_report: no trainable parameters (pass the optimizer, or a "
            "model with parameters that require grad)"
        )
    return params


def _master_row(
    params: list[torch.Tensor],
    n: int,
    sharded: bool,
    train_state: str | None,
    asked: torch.dtype | None,
    downgrades: dict[Downgrade, str],
) -> PrecisionRow:
    """The master weights; a downgrade where mixed precision (``asked``) meets 16-bit parameters."""
    low_master = [p for p in params if _low(p.dtype)]
    # compile_step(train_state=...) keeps the parameters and AdamW's moments in bf16 on purpose, with
    # its own rounding of each update (stochastic, or Kahan-compensated): not a downgrade
    if asked is not None and low_master and train_state is None:
        downgrades[Downgrade.MASTER_WEIGHTS_16BIT] = (
            f"mixed precision ({_name(asked)}) was asked for, but {len(low_master)} of {len(params)} "
            f"parameters the optimizer updates are {_name(low_master[0].dtype)}: every update is rounded "
            f"to 16 bits (small updates are lost) and torch's optimizers keep their state in the "
            f"parameters' dtype. Keep the parameters in float32 (drop model.to({low_master[0].dtype}) / "
            f"model.half(); call model.float()): amp_fx casts them for compute."
        )
    return PrecisionRow(
        "master weights",
        _dtypes(params),
        sum(_nbytes(p) for p in params) / n,
        "the parameters the optimizer updates"
        + (" (this rank's shards)" if sharded else "")
        + (f" (bf16 by compile_step(train_state={train_state!r}))" if train_state else ""),
    )


def _compute_weights_row(
    setup: _Setup,
    compute: torch.dtype | None,
    master: tuple[torch.dtype, ...],
    units: Sequence[Any],
    fsdp_param_dtypes: set[torch.dtype],
) -> PrecisionRow:
    fp8 = setup.options.fp8 if setup.options is not None else None
    if units and fsdp_param_dtypes:
        note = "FSDP2 gathers them in MixedPrecisionPolicy.param_dtype"
        weights: tuple[torch.dtype, ...] = tuple(fsdp_param_dtypes)
    elif compute is not None and master == (compute,):
        weights, note = master, "the master weights themselves (already in the compute dtype)"
    elif compute is not None:
        weights = (compute,)
        note = (
            "cast from the master weights once per optimizer step (the weight cache)"
            if setup.cache is not None
            else "cast from the master weights in each forward"
        )
    else:
        weights, note = master, "the master weights themselves (no mixed precision asked)"
    if fp8 is not None:
        weights = (*weights, torch.float8_e4m3fn)
        note += f"; matmul weights in float8_e4m3fn ({' + '.join(r.value for r in recipes(fp8))})"
    return PrecisionRow("compute weights", weights, None, note)


def _gradients_row(
    params: list[torch.Tensor], n: int, master: tuple[torch.dtype, ...], compiled_step: bool
) -> PrecisionRow:
    with_grad = [p for p in params if p.grad is not None]
    grads = [g for p in with_grad if (g := p.grad) is not None]
    if with_grad:
        nbytes: int = sum(_nbytes(g) for g in grads)
        return PrecisionRow(
            "gradients",
            _dtypes(_local(g) for g in grads),
            nbytes / sum(_local(p).numel() for p in with_grad),
            f".grad of {len(with_grad)} of {len(params)} parameters",
        )
    if compiled_step:  # the step clears them after its optimizer step: none between steps
        return PrecisionRow(
            "gradients",
            master,
            sum(_nbytes(p) for p in params) / n,
            "written by each step's backward in the parameters' dtype, cleared after its optimizer step",
        )
    return PrecisionRow(
        "gradients",
        master,
        sum(_nbytes(p) for p in params) / n,
        "no .grad now: autograd accumulates them in the parameters' dtype",
    )


def _optimizer_row(
    optimizer: torch.optim.Optimizer,
    n: int,
    master: tuple[torch.dtype, ...],
    train_state: str | None,
    asked: torch.dtype | None,
    downgrades: dict[Downgrade, str],
) -> PrecisionRow:
    """The optimizer's state; a downgrade where mixed precision (``asked``) meets 16-bit state."""
    state = _optimizer_state(optimizer)
    tensors = [t for ts in state.values() for t in ts]
    if not tensors:
        return PrecisionRow(
            "optimizer state",
            master,
            None,
            f"none yet: {type(optimizer).__name__} creates it at its first step, in each parameter's dtype",
        )
    low_state = [key for key, ts in state.items() if any(_low(t.dtype) for t in ts)]
    if asked is not None and low_state and train_state is None:
        downgrades[Downgrade.OPTIMIZER_STATE_16BIT] = (
            f"mixed precision ({_name(asked)}) was asked for, but {type(optimizer).__name__}'s state "
            f"{', '.join(low_state)} is in 16 bits (torch's optimizers create it in the parameters' "
            f"dtype): updates lose precision (users reported a 3x worse loss with bf16 AdamW state). "
            f"Keep the parameters in float32 and create the optimizer after model.float(), or load "
            f"its state after the parameters are float32."
        )
    note = ", ".join(f"{key}: {', '.join(map(_name, _dtypes(ts)))}" for key, ts in state.items())
    return PrecisionRow(
        "optimizer state",
        _dtypes(tensors),
        sum(_nbytes(t) for t in tensors) / n,
        note + " (0-dim values such as step left out)",
    )


def _scaling_row(
    scaler: Any, compute: torch.dtype | None, downgrades: dict[Downgrade, str], compiled_step: bool
) -> PrecisionRow:
    scaling = (
        scaler is not None
        and scaler.is_enabled()
        and not (isinstance(scaler, GradScaler) and scaler.mode is ScalerMode.CHECK_ONLY)
    )
    if scaler is None:
        note = "no GradScaler given"
    else:
        kind = f"{type(scaler).__module__}.{type(scaler).__qualname__}"
        mode = (f", {scaler.mode.value}" if isinstance(scaler, GradScaler) else "") + (
            "" if scaler.is_enabled() else ", disabled"
        )
        note = f"{kind}{mode}"
    if compute == torch.bfloat16 and scaling:
        downgrades[Downgrade.SCALER_WITH_BF16] = (
            "a loss-scaling GradScaler is used with bf16: bf16 has float32's exponent range, so scaling "
            "saves no gradient from underflow and only adds work (torch's scaler reads the device on the "
            "host every step). Drop the scaler, or use amp_fx.GradScaler(mode=amp_fx.ScalerMode.CHECK_ONLY) "
            "to keep skipping inf/NaN steps" + (" (compile_step's default for bf16)." if compiled_step else ".")
        )
    if compute == torch.float16 and not scaling:
        downgrades[Downgrade.FP16_WITHOUT_SCALING] = (
            "fp16 is used with no loss scaling" + ("" if scaler is None else f" ({note})") + ": fp16 "
            "gradients below 6e-8 flush to zero and above 65504 overflow. Use "
            "amp_fx.GradScaler(device_type) (ScalerMode.DYNAMIC, the default)"
            + (" or pass it as scaler= here." if scaler is None else ".")
        )
    return PrecisionRow("loss scaling", (), None, note + (" (scaling the loss)" if scaling else ""))


def report_downgrades(report: PrecisionReport, reporter: Reporter) -> None:
    """Warn once per downgrade (one error naming them all in strict mode)."""
    if not report.downgrades:
        return
    prefix = "amp_fx.precision_report: "
    if reporter.strict:
        reporter.did_less(
            ("precision",) + tuple(d.value for d in report.downgrades), prefix + "\n".join(report.downgrades.values())
        )
    for kind, message in report.downgrades.items():
        reporter.did_less(("precision", kind.value), prefix + message)


def precision_report(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    scaler: Any = None,
    loss: torch.Tensor | torch.dtype | None = None,
    dtype: str | torch.dtype | None = None,
    strict: bool | None = None,
) -> PrecisionReport:
    """The dtype and bytes per parameter of every part of a training setup, and its silent downgrades.

    Args:
        model: the model as trained: ``amp_fx.compile``'s module, DDP or FSDP2 around or inside it,
            or a plain module.
        optimizer: its optimizer (its parameters are the master weights; its state is read as it
            stands: torch's optimizers create it at their first step).
        scaler: the ``GradScaler`` in use (``torch.amp``'s, FSDP's ``ShardedGradScaler`` or amp_fx's),
            or None for none.
        loss: the loss the step backpropagates (or its dtype).
        dtype: the compute dtype asked for ("bf16", "fp16", a torch dtype); default: the compiled
            model's, else FSDP2's or DDP's ``param_dtype``, else none (no mixed precision asked).
        strict: raise ``AmpFxError`` on a downgrade instead of warning. None: the compiled model's
            setting, else ``AMP_FX_STRICT``.

    Each downgrade found (see :class:`Downgrade`) warns once per compiled model (per call for a
    plain module) with an ``AmpFxWarning`` naming it and the fix. Nothing is run and nothing is
    read from the device but dtypes and sizes.

    Example:
        >>> model = amp_fx.compile(torch.nn.Linear(4, 4), dtype="bf16", backend="aot_eager")
        >>> report = amp_fx.precision_report(model, torch.optim.AdamW(model.parameters()))
        >>> report.row("master weights").dtypes, report.row("master weights").bytes_per_param
        ((torch.float32,), 4.0)
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"amp_fx.precision_report: model must be an nn.Module, got {type(model).__name__}")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"amp_fx.precision_report: optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}"
        )
    setup = _find(model)
    report = _build(
        model,
        optimizer,
        setup=setup,
        compute=_compute_dtype(setup, dtype),
        scaler=scaler,
        loss=loss,
        compiled_step=False,
    )
    reporter = setup.reporter if setup.reporter is not None and strict is None else Reporter(strict)
    report_downgrades(report, reporter)
    return report


def step_report(
    step: Any, cache: Any, loss: torch.Tensor | torch.dtype | None, reporter: Reporter, train_state: str | None = None
) -> PrecisionReport:
    """:meth:`amp_fx.CompiledStep.precision_report`: the step's model, optimizer, scaler, dtype and
    weight cache, reported through the step's own reporter (once per step, its ``strict``).
    ``train_state``: the step's bf16 training state where it applies (its 16-bit parameters and
    moments are then on purpose)."""
    setup = _find(step.model)
    setup.options, setup.cache = step.options, cache
    report = _build(
        step.model,
        step.optimizer,
        setup=setup,
        compute=step.config.dtype,
        scaler=step.scaler,
        loss=loss,
        compiled_step=True,
        train_state=train_state,
    )
    report_downgrades(report, reporter)
    return report
