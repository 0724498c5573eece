"""Fused gradient unscale + inf/NaN check (+ squared L2 norm) as torch custom ops.

Ops (namespace ``amp_fx``), traceable by ``torch.compile`` without a graph break thanks to their
fake implementations:

- ``torch.ops.amp_fx.unscale_check_(Tensor(a!)[] grads, Tensor(b!) found_inf, Tensor inv_scale,
  Tensor(c!)? flags) -> ()``: in place, the semantics of
  ``torch._amp_foreach_non_finite_check_and_unscale_``; with ``flags`` (fp32 ``[len(grads)]``)
  also which gradients held an inf/NaN, recorded in the same pass.
- ``torch.ops.amp_fx.unscale_check_norm_(...) -> Tensor``: the same, and returns the fp32 0-dim
  sum of squares of the unscaled gradients (values as stored in their dtype, upcast to fp32),
  so ``clip_grad_norm_``'s total norm is its square root with no second read of the gradients.

The ops take one device and one dtype; the Python functions ``unscale_check_`` and
``unscale_check_norm_`` accept any mix of dtypes, group them and call the op once per group.

Dispatch (``_use_triton``): the Triton kernel of ``triton_unscale`` runs on CUDA tensors, and on
CPU tensors only when triton was imported with ``TRITON_INTERPRET=1`` (the interpreter, for
tests). Otherwise CPU tensors take ``cpu_unscale``, built on torch's CPU kernels, and CUDA
tensors under the interpreter (which cannot read GPU memory) or without triton take torch's CUDA
kernels.

Example::

    >>> import torch
    >>> from amp_fx.kernels import unscale_check_norm_
    >>> grads = [torch.tensor([2.0, 4.0]), torch.tensor([float("inf")])]
    >>> found_inf, inv_scale = torch.zeros(()), torch.tensor(0.5)
    >>> sum_sq = unscale_check_norm_(grads, found_inf, inv_scale)
    >>> grads[0], found_inf
    (tensor([1., 2.]), tensor(1.))
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch

from amp_fx.kernels import cpu_unscale

try:
    from amp_fx.kernels import triton_unscale
except ImportError:  # no triton wheel for this platform (macOS, Windows; see pyproject.toml)
    triton_unscale = None  # type: ignore[assignment]  # the module or None; callers check

__all__ = ["unscale_check_", "unscale_check_norm_"]

logger = logging.getLogger(__name__)

_SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _use_triton(device: torch.device) -> bool:
    """Whether tensors on ``device`` go through the Triton kernel.

    True for CUDA when the kernel is compiled, and for CPU when it is interpreted
    (``TRITON_INTERPRET=1`` set before triton was imported). Everything else takes torch's own
    kernels, which have the same semantics bit for bit (and so does everything where triton is
    not installed).
    """
    if triton_unscale is None:
        return False
    if triton_unscale.is_interpreted():
        return device.type == "cpu"
    return device.type == "cuda"


def _check_flags(flags: torch.Tensor | None, n: int, device: torch.device) -> None:
    if flags is None:
        return
    if flags.dtype != torch.float32 or flags.shape != (n,) or flags.device != device:
        raise ValueError(
            f"flags must be a float32 tensor of shape ({n},) (one per gradient) on {device}, got "
            f"{flags.dtype} with shape {tuple(flags.shape)} on {flags.device}"
        )


def _check_dense(i: int, g: torch.Tensor) -> None:
    if g.layout != torch.strided:
        raise ValueError(
            f"grads[{i}] has layout {g.layout}; only dense gradients are supported "
            "(for a sparse gradient pass grad.coalesce()._values(), as GradScaler does)"
        )


def _check_group(
    grads: Sequence[torch.Tensor],
    found_inf: torch.Tensor,
    inv_scale: torch.Tensor,
    flags: torch.Tensor | None = None,
) -> None:
    """Validate the op's inputs; errors name the offending tensor and what was expected."""
    for name, t in (("found_inf", found_inf), ("inv_scale", inv_scale)):
        if t.dtype != torch.float32 or t.numel() != 1:
            raise ValueError(f"{name} must be a 1-element float32 tensor, got {t.dtype} with shape {tuple(t.shape)}")
    device = found_inf.device
    if inv_scale.device != device:
        raise ValueError(f"inv_scale is on {inv_scale.device} but found_inf is on {device}")
    _check_flags(flags, len(grads), device)
    dtype = grads[0].dtype if grads else None
    for i, g in enumerate(grads):
        _check_dense(i, g)
        if g.device != device:
            raise ValueError(
                f"grads[{i}] is on {g.device} but found_inf is on {device}; call once per "
                "device with that device's found_inf and inv_scale"
            )
        if g.dtype != dtype:
            raise ValueError(f"grads[{i}] is {g.dtype} but grads[0] is {dtype}; one dtype per call")
        if g.dtype not in _SUPPORTED_DTYPES:
            raise ValueError(f"grads[{i}] is {g.dtype}; supported: {_SUPPORTED_DTYPES}")
        if torch._debug_has_internal_overlap(g) == 1:
            raise ValueError(
                f"grads[{i}] has elements that share memory (e.g. an expanded tensor); "
                "unscaling it in place would scale them more than once: clone() it first"
            )


# ``flags`` has no default in the ops' schemas: torch 2.11's custom-op ADInplaceOrView kernel
# indexes the mutated arguments in the call's positional args without filling in defaults, and the
# dispatcher drops a trailing argument equal to its default (IndexError on flags=None). Callers
# always pass it, None included.
def _unscale_check_impl(
    grads: list[torch.Tensor],
    found_inf: torch.Tensor,
    inv_scale: torch.Tensor,
    flags: torch.Tensor | None,
) -> None:
    _check_group(grads, found_inf, inv_scale, flags)
    if not grads:
        return
    if _use_triton(found_inf.device):
        triton_unscale.launch_unscale_check(grads, found_inf, inv_scale, compute_norm=False, flags=flags)
    elif found_inf.device.type == "cpu":
        cpu_unscale.cpu_unscale_check_(grads, found_inf, inv_scale, flags)
    else:
        _torch_unscale_check_(grads, found_inf, inv_scale, flags)


def _torch_unscale_check_(
    grads: list[torch.Tensor], found_inf: torch.Tensor, inv_scale: torch.Tensor, flags: torch.Tensor | None
) -> None:
    """torch's kernel on another device (a GPU under the Triton interpreter)."""
    if flags is None:
        torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)
    else:
        cpu_unscale.torch_unscale_check_per_tensor_(grads, found_inf, inv_scale, flags)


_unscale_check_op = torch.library.custom_op("amp_fx::unscale_check_", mutates_args=("grads", "found_inf", "flags"))(
    _unscale_check_impl
)


@_unscale_check_op.register_fake
def _(grads: list[torch.Tensor], found_inf: torch.Tensor, inv_scale: torch.Tensor, flags: torch.Tensor | None) -> None:
    # Validate here too: a meta/fake argument sends the call here, never to the real kernel.
    _check_group(grads, found_inf, inv_scale, flags)


def _unscale_check_norm_impl(
    grads: list[torch.Tensor],
    found_inf: torch.Tensor,
    inv_scale: torch.Tensor,
    flags: torch.Tensor | None,
) -> torch.Tensor:
    _check_group(grads, found_inf, inv_scale, flags)
    device = found_inf.device
    if _use_triton(device):
        sum_sq = triton_unscale.launch_unscale_check(grads, found_inf, inv_scale, compute_norm=True, flags=flags)
        assert sum_sq is not None  # compute_norm=True always returns a tensor
        return sum_sq
    if device.type == "cpu":
        return cpu_unscale.cpu_unscale_check_norm_(grads, found_inf, inv_scale, flags)
    # A GPU under the Triton interpreter, or another device: torch's kernels, two passes.
    _torch_unscale_check_(grads, found_inf, inv_scale, flags)
    if not grads:
        return torch.zeros((), dtype=torch.float32, device=device)
    norms = torch._foreach_norm(grads, 2, dtype=torch.float32)
    return torch.stack(norms).to(torch.float64).square().sum().to(torch.float32)


_unscale_check_norm_op = torch.library.custom_op(
    "amp_fx::unscale_check_norm_", mutates_args=("grads", "found_inf", "flags")
)(_unscale_check_norm_impl)


def _eager_cpu(found_inf: torch.Tensor) -> bool:
    """Call the implementation directly, skipping the custom-op dispatcher (about 5% of a 64M-
    element unscale on this CPU). Only for the CPU path outside tracing: it is made of torch's
    own in-place ops, which bump version counters themselves; Triton writes need the op's bump."""
    return not torch.compiler.is_compiling() and not _use_triton(found_inf.device)


@_unscale_check_norm_op.register_fake
def _(
    grads: list[torch.Tensor], found_inf: torch.Tensor, inv_scale: torch.Tensor, flags: torch.Tensor | None
) -> torch.Tensor:
    _check_group(grads, found_inf, inv_scale, flags)
    return found_inf.new_empty(())


def _grouped_calls(
    op: Callable[..., Any],
    grads: Sequence[torch.Tensor],
    found_inf: torch.Tensor,
    inv_scale: torch.Tensor,
    flags: torch.Tensor | None,
    segments: Sequence[int] | None = None,
) -> list[tuple[int, Any]]:
    """``op`` once per (device, dtype, segment) group, each result with its segment (0 without
    ``segments``); ``flags`` (one per gradient, in ``grads`` order) handed over whole for one
    group, else per group and scattered back into place."""
    groups = _groups(grads, found_inf, segments)
    _check_flags(flags, len(grads), found_inf.device)
    if flags is None or len(groups) <= 1:
        return [(key[2], op(group, found_inf, inv_scale, flags)) for key, (group, _) in groups.items()]
    results = []
    for key, (group, indices) in groups.items():
        own = torch.zeros(len(group), dtype=torch.float32, device=found_inf.device)
        results.append((key[2], op(group, found_inf, inv_scale, own)))
        where = torch.tensor(indices, dtype=torch.int64, device=flags.device)
        flags.index_copy_(0, where, torch.maximum(flags.index_select(0, where), own))
    return results


def _groups(
    grads: Sequence[torch.Tensor], found_inf: torch.Tensor, segments: Sequence[int] | None = None
) -> dict[tuple[torch.device, torch.dtype, int], tuple[list[torch.Tensor], list[int]]]:
    """Grads grouped by (device, dtype, segment), in first-seen order, with their indices in
    ``grads``; sparse and foreign devices fail."""
    if segments is not None and (len(segments) != len(grads) or any(s < 0 for s in segments)):
        raise ValueError(f"segments must be one non-negative int per gradient ({len(grads)}), got {list(segments)}")
    groups: dict[tuple[torch.device, torch.dtype, int], tuple[list[torch.Tensor], list[int]]] = {}
    for i, g in enumerate(grads):
        if not isinstance(g, torch.Tensor):
            raise TypeError(f"grads[{i}] is a {type(g).__name__}, expected a torch.Tensor")
        _check_dense(i, g)
        if g.device != found_inf.device:
            raise ValueError(
                f"grads[{i}] is on {g.device} but found_inf is on {found_inf.device}; "
                "mixed devices are not supported: call once per device"
            )
        group, indices = groups.setdefault((g.device, g.dtype, 0 if segments is None else segments[i]), ([], []))
        group.append(g)
        indices.append(i)
    return groups


def unscale_check_(
    grads: Sequence[torch.Tensor],
    found_inf: torch.Tensor,
    inv_scale: torch.Tensor,
    *,
    flags: torch.Tensor | None = None,
) -> None:
    """Multiply every gradient by ``inv_scale`` in place; set ``found_inf`` to 1.0 on inf/NaN.

    Contract: bitwise the semantics of ``torch._amp_foreach_non_finite_check_and_unscale_``
    (values checked *before* the multiply, multiply in fp32, rounded back to the gradient
    dtype) for dense fp32/fp16/bf16 gradients of any strides on one device. ``found_inf`` and
    ``inv_scale`` are 1-element fp32 tensors on that device, read and written there with no host
    sync; ``found_inf`` is only ever raised to 1.0, never cleared. One kernel launch per dtype;
    an empty list is a no-op. ``flags``: an optional fp32 tensor of shape ``[len(grads)]`` on that
    device; ``flags[i]`` is raised to 1.0 (never cleared) if ``grads[i]`` held an inf/NaN,
    recorded by the same kernel in the same pass.

    Raises:
        ValueError: a sparse gradient, a gradient on another device than ``found_inf``, an
            unsupported dtype, or an ill-formed ``found_inf``/``inv_scale``.
    """
    op = _unscale_check_impl if _eager_cpu(found_inf) else torch.ops.amp_fx.unscale_check_
    _grouped_calls(op, grads, found_inf, inv_scale, flags)


def unscale_check_norm_(
    grads: Sequence[torch.Tensor],
    found_inf: torch.Tensor,
    inv_scale: torch.Tensor,
    *,
    flags: torch.Tensor | None = None,
    segments: Sequence[int] | None = None,
) -> torch.Tensor:
    """``unscale_check_`` that also returns the sum of squares of the unscaled gradients.

    Returns:
        An fp32 0-dim tensor on ``found_inf``'s device: the sum over all elements of
        ``float(g)**2`` for the unscaled values as stored in each gradient's dtype, accumulated
        in fp32 (partial sums combined in fp64). ``sqrt`` of it is the total norm that
        ``clip_grad_norm_`` would compute after ``unscale_``. 0.0 for an empty list; inf/NaN when
        a gradient is non-finite, or when squares overflow fp32 (|g| > 1.8e19). ``flags``: as in
        ``unscale_check_``.

        With ``segments`` (one non-negative int per gradient), one such sum per segment, in the
        same single pass over the gradients (one launch per dtype and segment): an fp32 tensor of
        shape ``[max(segments) + 1]`` whose entry ``s`` sums the gradients ``i`` with
        ``segments[i] == s`` (0.0 where none does). Gradients sharded over different sets of ranks
        need separate sums before their all-reduces (``amp_fx._dist.step.LocalShards.global_sum``).
    """
    op = _unscale_check_norm_impl if _eager_cpu(found_inf) else torch.ops.amp_fx.unscale_check_norm_
    totals: dict[int, torch.Tensor] = {}
    for segment, sum_sq in _grouped_calls(op, grads, found_inf, inv_scale, flags, segments):
        totals[segment] = sum_sq if segment not in totals else totals[segment] + sum_sq
    if segments is not None:
        zero = torch.zeros((), dtype=torch.float32, device=found_inf.device)
        count = max(segments, default=-1) + 1
        if count == 0:
            return zero.new_zeros(0)
        return torch.stack([totals.get(s, zero) for s in range(count)])
    if not totals:
        return torch.zeros((), dtype=torch.float32, device=found_inf.device)
    return totals[0]
