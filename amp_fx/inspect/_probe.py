"""Helpers on values and graph nodes shared by the inspection tools (explain, compare,
find_nonfinite): flatten outputs, describe and range tensors, name a node's op, module and inputs,
re-run a recorded graph. How the model is run lives in :mod:`amp_fx.inspect._runner`.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.fx
from torch.utils._pytree import tree_flatten

from amp_fx._common.dtype_names import dtype_name
from amp_fx.passes import meta
from amp_fx.passes.capture import MODULE_STATE_SOURCES as _ROOTS
from amp_fx.passes.capture import source_text
from amp_fx.passes.fx_edit import placeholders
from amp_fx.passes.pipeline import GraphRecord

__all__: list[str] = []


def tensors_of(value: Any) -> list[torch.Tensor]:
    """The tensors in a (possibly nested) value, in pytree order; a DTensor (tensor parallelism) as
    this rank's local tensor: the inspection tools compare and check each rank's shard (torch's
    comparisons and masks on a DTensor would dispatch collectives, and some, ``nonzero``, have no
    sharding rule)."""
    return [
        t.to_local() if hasattr(t, "to_local") and hasattr(t, "placements") else t
        for t in tree_flatten(value)[0]
        if isinstance(t, torch.Tensor)
    ]


def value_dtype(value: Any) -> torch.dtype | None:
    """The dtype that describes a value: its first floating tensor's, else its first tensor's."""
    ts = tensors_of(value)
    for t in ts:
        if t.is_floating_point():
            return t.dtype
    return ts[0].dtype if ts else None


def describe_value(value: Any) -> str:
    """``bf16[2, 8]`` for a tensor, a tuple of those for a tuple, ``-`` for no tensor."""
    if isinstance(value, torch.Tensor):
        return f"{dtype_name(value.dtype)}[{', '.join(_dim(s) for s in value.shape)}]"
    if isinstance(value, (tuple, list)):
        inner = [describe_value(v) for v in value]
        return "(" + ", ".join(inner) + ")"
    if value is None:
        return "-"
    return type(value).__name__


def _dim(s: Any) -> str:
    return str(s) if isinstance(s, int) else f"{s}"


def numel_or_none(t: torch.Tensor) -> int | None:
    try:
        return int(t.numel())
    except Exception:  # an unbacked or symbolic size: no number to report
        return None


def clone_tensor(t: torch.Tensor, *, to: torch.dtype | None = None, requires_grad: bool = False) -> torch.Tensor:
    """A fresh leaf with ``t``'s values: floating values converted ``to`` a dtype when given;
    requiring grad when asked and the dtype can."""
    c = t.detach().clone()
    if to is not None and c.is_floating_point():
        c = c.to(to)
    return c.requires_grad_(requires_grad and (c.is_floating_point() or c.is_complex()))


def clone_inputs(
    inputs: Sequence[Any], leaf_flags: Sequence[bool] | None = None, *, to: torch.dtype | None = None
) -> list[Any]:
    """Fresh copies of recorded graph inputs; leaves that required grad become fresh leaves again
    (eager autocast's cast cache applies to them), floating tensors optionally converted ``to``."""
    return [
        clone_tensor(a, to=to, requires_grad=leaf_flags is not None and leaf_flags[i])
        if isinstance(a, torch.Tensor)
        else a
        for i, a in enumerate(inputs)
    ]


def leaf_flags(record: GraphRecord) -> list[bool]:
    return [bool(n.meta.get(meta.LEAF, False)) for n in placeholders(record.captured.graph)]


class ValueInterpreter(torch.fx.Interpreter):
    """Runs a graph and keeps every node's value (``env`` after :meth:`run`)."""

    def __init__(self, gm: torch.fx.GraphModule) -> None:
        super().__init__(gm, garbage_collect_values=False)


def input_labels(record: GraphRecord, forward: Callable[..., Any] | None = None) -> dict[str, str]:
    """Placeholder name in the ATen graphs -> what the user calls it (``fc1.weight``, ``x``), read
    from Dynamo's source names. ``forward`` (the model's forward, or the function) names the
    positional arguments Dynamo only numbers (``L['args'][0]`` when it enters through
    ``nn.Module.__call__``, as for ``nn.Sequential`` and ``nn.Linear``).

    Names are relative to the frame Dynamo compiled; the inspection tools name inputs by
    identity instead where they ran the model (:meth:`~amp_fx.inspect._runner.AmpRun.labels`).
    """
    dyn = placeholders(record.dynamo_graph.graph)
    ours = placeholders(record.captured.graph)
    positional = _positional_names(forward)
    return {mine.name: source_label(theirs, positional) for mine, theirs in zip(ours, dyn)}


def _positional_names(forward: Callable[..., Any] | None) -> list[str]:
    if forward is None:
        return []
    try:
        params = inspect.signature(forward).parameters.values()
    except (TypeError, ValueError):
        return []
    return [
        p.name for p in params if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    ]


def source_label(node: torch.fx.Node, positional: Sequence[str] = ()) -> str:
    """What the user calls a graph input, from Dynamo's source name (see :func:`input_labels`)."""
    from amp_fx.passes.capture import module_path

    text = source_text(node)
    if not text:
        return node.name
    if text.startswith(_ROOTS):
        path = module_path(text)
        parts = [p for p in path.split(".") if p not in ("_parameters", "_buffers")]
        return ".".join(parts) or node.name
    m = re.fullmatch(r"L\['args'\]\[(\d+)\](.*)", text)
    if m is not None:
        i = int(m.group(1))
        return (positional[i] if i < len(positional) else f"args[{i}]") + m.group(2)
    m = re.fullmatch(r"L\['kwargs'\]\['([^']*)'\](.*)", text)
    if m is not None:
        return m.group(1) + m.group(2)
    m = re.fullmatch(r"L\['([^']*)'\](.*)", text)
    if m is not None:
        return m.group(1) + m.group(2)
    return text


def tensor_range(t: torch.Tensor) -> dict[str, Any]:
    """min and max of |t| over its finite entries, and counts of inf and NaN (host syncs: this is
    a debugging tool)."""
    if not t.is_floating_point() or t.numel() == 0:
        return {"dtype": t.dtype, "shape": tuple(t.shape), "min_abs": None, "max_abs": None, "n_inf": 0, "n_nan": 0}
    d = t.detach().double().abs()
    finite = torch.isfinite(d)
    n_nan = int(torch.isnan(d).sum())
    n_inf = int(torch.isinf(d).sum())
    vals = d[finite]
    return {
        "dtype": t.dtype,
        "shape": tuple(t.shape),
        "min_abs": float(vals.min()) if vals.numel() else None,
        "max_abs": float(vals.max()) if vals.numel() else None,
        "n_inf": n_inf,
        "n_nan": n_nan,
    }


def all_finite(value: Any) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in tensors_of(value) if t.is_floating_point() or t.is_complex())


def format_range(r: dict[str, Any]) -> str:
    if r["max_abs"] is None and not (r["n_inf"] or r["n_nan"]):
        return "-"
    lo = "-" if r["min_abs"] is None else f"{r['min_abs']:.3g}"
    hi = "-" if r["max_abs"] is None else f"{r['max_abs']:.3g}"
    bad = []
    if r["n_inf"]:
        bad.append(f"{r['n_inf']} inf")
    if r["n_nan"]:
        bad.append(f"{r['n_nan']} NaN")
    return f"|x| in [{lo}, {hi}]" + (f", {', '.join(bad)}" if bad else ", all finite")


def module_of(node: torch.fx.Node) -> tuple[str, str]:
    """(innermost module path, its type name) of a node; ("", "") outside any submodule."""
    from amp_fx.passes.capture import module_stack

    stack = module_stack(node)
    if not stack:
        return "", ""
    path, mtype = stack[-1]
    return path, mtype.__name__


@contextmanager
def module_hooks(model: torch.nn.Module, on_pre: Callable[..., None], on_post: Callable[..., None]) -> Iterator[None]:
    """Call ``on_pre(name, args, kwargs)`` before and ``on_post(name, output)`` after every module's
    forward (``name`` as ``named_modules()`` gives it), while the context is open."""
    handles = []
    for name, m in model.named_modules():
        handles.append(
            m.register_forward_pre_hook(
                lambda mod, args, kwargs, name=name: on_pre(name, args, kwargs), with_kwargs=True
            )
        )
        handles.append(m.register_forward_hook(lambda mod, args, out, name=name: on_post(name, out)))
    try:
        yield
    finally:
        for h in handles:
            h.remove()
