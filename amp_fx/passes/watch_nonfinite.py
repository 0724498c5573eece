"""The ``watch_nonfinite`` pass: a device-side record of the first op that *creates* an inf or NaN
in a low-precision output from finite data (``amp_fx.compile(..., watch_nonfinite=True)``, issue 21).

Assumes the rewritten pre-dispatch ATen graph of ``insert_casts``/``fold_casts``: every node's
``meta["val"]`` is true and ``nn_module_stack`` names modules under the compiled root.

The watched nodes are, in graph order, those whose value is a tensor of the low-precision dtype
(fp16/bf16) made by a computing op (not a view, not an in-place op), except ops given an inf/NaN
number (``masked_fill(x, m, -inf)``, ``where(c, x, -inf)``, ``full(s, -inf)``): a mask made on
purpose is never an overflow. For each, the pass adds a flag "this op is an origin":

* pointwise ops (ATen's ``pointwise`` tag, plus ``_to_copy``, ``where``/``masked_fill`` with a
  scalar, ``fill``/``*_like``), per element: ``any(~isfinite(out) & ~explained)``, where
  ``explained`` ORs ``~isfinite(input)`` over the floating tensor inputs, broadcast to the output.
  An -inf added from a mask is explained there; a finite fp32 weight whose fp16 cast overflows
  (``_to_copy``) is an origin;
* other ops (mm, softmax, cat, reductions, ...): ``any(~isfinite(out))`` and no floating tensor
  input holds an inf/NaN. "Holds" is built once per value (a view that shows all of its base's
  elements shares its base's) and rebuilt after an in-place op that may have changed it.

The caller's data is the exception: an inf/NaN in a batch is the cause of a skipped step though no
op created it. A value derived from a graph input that is data (``data_inputs``: the batch, not a
parameter or buffer; through unwatched ops such as an fp32 layer norm, views and in-place updates,
up to the first watched op that reads it) explains only its -inf elements (a caller's additive
mask); its +inf and NaN are named at the first watched op that reads them.

Each check sits right after the node it checks, so it reads the value before a later in-place op
(``att.masked_fill_(m, -inf)``) changes it. The flags are stacked into one small bool tensor and
the graph gets one more output, an int64 0-dim tensor: the position of the first flagged node in
:attr:`WatchRecord.ops`, or -1. The backend strips that output before the caller sees the result
(``amp_fx.overflow.ForwardWatch``). With inductor the checks fuse into the kernels that produce or
read the values where those kernels are its own (pointwise, reductions); after an extern kernel
(mm, conv) they read its output once more.

Guarantees: the values the graph computed are unchanged (the checks only read; no node is
replaced), no new aliasing (the new output is a fresh tensor), ``meta["val"]`` set on every new
node, and the graph lints.

Example (the backend runs the pass; its record names the watched ops)::

    >>> model = amp_fx.compile(torch.nn.Linear(4, 4), dtype="fp16", backend="aot_eager",
    ...                        watch_nonfinite=True)
    >>> _ = model(torch.randn(2, 4))
    >>> model.amp_fx_records[0].watched.ops[0].op
    'aten.linear'
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx

from amp_fx._common.compat import dtensor_type
from amp_fx._common.dtype_names import dtype_name
from amp_fx._common.op_names import op_label
from amp_fx.kernels.fp8_matmul import fp8_matmul
from amp_fx.passes.capture import dtensor_method
from amp_fx.passes.fx_edit import CAST_OP, FULL_VIEWS, aliases_input, innermost_module, placeholders, walk_views

__all__ = ["WatchedOp", "WatchRecord", "watch_nonfinite", "append_first_origin", "NONE"]

aten = torch.ops.aten

NONE = -1
"""The recorded position when no watched output held an inf/NaN."""


@dataclass(frozen=True)
class WatchedOp:
    """One watched node: where it is and what it computes."""

    module: str
    """The innermost module under the compiled root ("" for the root's own code)."""
    op: str
    """The ATen op, e.g. ``aten.mm`` (a multi-output op's name for each of its outputs)."""
    dtype: str
    """The output dtype's short name (``fp16``, ``bf16``)."""
    node: str
    """The FX node's name in the rewritten graph (for a backward op: in AOTAutograd's backward graph)."""
    grad_of: str | None = None
    """A backward op (``amp_fx.passes.watch_backward``): the forward op it differentiates
    (``aten.linear``; "" where unknown); None for a forward op."""
    incoming: bool = False
    """A backward graph's incoming gradient (not an op): the gradient of the graph output that
    ``op`` computed in the forward, as it entered the compiled backward."""


@dataclass
class WatchRecord:
    """What the pass did to one graph: the watched nodes, in graph order."""

    ops: list[WatchedOp] = field(default_factory=list)


def _computing_op(node: torch.fx.Node) -> object | None:
    """The op that computed ``node``'s value, or None if ``node`` only aliases or mutates."""
    target = node.target
    if target is operator.getitem:  # one output of a multi-output op
        parent = node.args[0]
        return _computing_op(parent) if isinstance(parent, torch.fx.Node) else None
    if target is fp8_matmul:  # fp8=: the fp8 matmul pass's call, a fresh value like the matmul it replaced
        return target
    if not isinstance(target, torch._ops.OpOverload):
        return None
    if aliases_input(target) or target._schema.is_mutable:
        return None
    return target


def _watched(node: torch.fx.Node, dtype: torch.dtype) -> object | None:
    if node.op != "call_function":
        return None
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor) or val.dtype != dtype:
        return None
    return _computing_op(node)


# Ops that compute each output element from the input elements at the same (broadcast) index,
# besides those ATen tags ``pointwise``: an inf/NaN in an input element explains the output's.
_POINTWISE_EXTRA = frozenset(
    {
        CAST_OP,
        aten.masked_fill.Tensor,
        aten.where.ScalarOther,
        aten.where.ScalarSelf,
        aten.where.Scalar,
        aten.fill.Scalar,
        aten.full_like.default,
        aten.zeros_like.default,
        aten.ones_like.default,
        aten.copy.default,
    }
)


def _is_pointwise(op: object) -> bool:
    return op in _POINTWISE_EXTRA or torch.Tag.pointwise in getattr(op, "tags", ())


def _op_node(node: torch.fx.Node) -> torch.fx.Node:
    """The node that called the op (``node``'s parent for one output of a multi-output op)."""
    if node.target is operator.getitem and isinstance(node.args[0], torch.fx.Node):
        return node.args[0]
    return node


def _float_inputs(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The floating-point tensor inputs of the op that computed ``node`` (each once, in order)."""
    found: dict[torch.fx.Node, None] = {}
    op_node = _op_node(node)
    for arg in op_node.all_input_nodes:
        val = arg.meta.get("val")
        if isinstance(val, torch.Tensor) and (val.dtype.is_floating_point or val.dtype.is_complex):
            found.setdefault(arg)
    return list(found)


def _has_nonfinite_scalar(node: torch.fx.Node) -> bool:
    """A Python number argument that is inf/NaN (``masked_fill(x, m, -inf)``, ``full(s, -inf)``)."""
    leaves = torch.utils._pytree.tree_leaves((_op_node(node).args, _op_node(node).kwargs))
    return any(isinstance(a, float) and not math.isfinite(a) for a in leaves)


def _base(node: torch.fx.Node) -> torch.fx.Node:
    """The node whose storage ``node`` aliases (through views and in-place ops' returns)."""
    while True:  # the graph is acyclic: each step goes to an earlier node
        op_node = _op_node(node)
        target = op_node.target
        if not isinstance(target, torch._ops.OpOverload) or not op_node.args:
            return node
        if not aliases_input(target) or not isinstance(op_node.args[0], torch.fx.Node):
            return node
        node = op_node.args[0]


class _Checks:
    """Builds the check nodes, each right after the node it checks, and reuses "holds an inf/NaN"
    reductions until a mutation may have changed the value they read."""

    def __init__(self, graph: torch.fx.Graph, data: set[torch.fx.Node], lowered: bool = False) -> None:
        self.graph = graph
        self.lowered = lowered
        """Build the checks from ops every backend lowers as they are (``isinf | isnan``, not
        ``isfinite``): for a graph already decomposed for its backend (AOTAutograd's backward
        graph, which inductor compiles without decomposing it again)."""
        self.holds_memo: dict[torch.fx.Node, torch.fx.Node] = {}
        self.data = data
        """Values derived from the caller's data without a watched op in between: their inf/NaN
        is not an intentional mask unless it is -inf (see the module docstring)."""

    def mutated(self, node: torch.fx.Node) -> None:
        """``node`` mutates its inputs: forget the reductions of everything aliasing them."""
        bases = {_base(a) for a in _op_node(node).all_input_nodes}
        for key in [k for k in self.holds_memo if _base(k) in bases]:
            del self.holds_memo[key]

    def checkable(self, value: torch.fx.Node) -> torch.fx.Node:
        """``value``, or its fp32 copy where its dtype has no ``isinf``/``isnan`` kernel (fp8: the
        fp8 matmul's operands, ``fp8=``). Exact: every fp8 value, inf and NaN included, is an fp32 one.
        A DTensor (tensor parallelism) is checked through this rank's local tensor: the flags are
        plain tensors, stacked with the others, and the ranks' records are combined as under FSDP2
        (an inf/NaN in a Partial value's local sum is one in the sum, too)."""
        if _is_dtensor(value):
            value = _call(self.graph, dtensor_method, ("to_local", value))
        val = value.meta.get("val")
        if isinstance(val, torch.Tensor) and val.dtype.is_floating_point and val.dtype.itemsize == 1:
            return _call(self.graph, torch.ops.prims.convert_element_type.default, (value, torch.float32))
        return value

    def nonfinite(self, value: torch.fx.Node) -> torch.fx.Node:
        value = self.checkable(value)
        if self.lowered:
            return _call(
                self.graph,
                aten.logical_or.default,
                (_call(self.graph, aten.isinf.default, (value,)), _call(self.graph, aten.isnan.default, (value,))),
            )
        return _call(self.graph, aten.logical_not.default, (_call(self.graph, aten.isfinite.default, (value,)),))

    def explains(self, value: torch.fx.Node) -> torch.fx.Node:
        """Where an input's element explains an inf/NaN in the output: any inf/NaN, or only -inf
        in a value derived from the caller's data."""
        if value in self.data:
            return _call(self.graph, aten.isneginf.default, (self.checkable(value),))
        return self.nonfinite(value)

    def holds(self, value: torch.fx.Node) -> torch.fx.Node:
        """``any(explains(value))``, built once per value (and its full views)."""
        key = walk_views(value, FULL_VIEWS)[0]  # a view of all its base's elements shares its check
        if key not in self.holds_memo:
            self.holds_memo[key] = _call(self.graph, aten.any.default, (self.explains(key),))
        return self.holds_memo[key]

    def either(self, values: list[torch.fx.Node]) -> torch.fx.Node:
        """``values[0] | values[1] | ...`` (bool tensors, broadcast)."""
        out = values[0]
        for value in values[1:]:
            out = _call(self.graph, aten.logical_or.default, (out, value))
        return out

    def origin(self, node: torch.fx.Node, op: object) -> torch.fx.Node:
        """True where ``node`` holds an inf/NaN that its inputs do not explain."""
        inputs = _float_inputs(node)
        if not inputs:
            return self.holds(node)  # a watched node is never data: any(~isfinite(node))
        if _is_pointwise(op) and not any(_is_dtensor(v) for v in (node, *inputs)):
            # Per element: an inf/NaN at an input's (broadcast) index explains the output's there.
            # (Not on DTensors: their local shards need not broadcast against each other.)
            explained = self.either([self.explains(value) for value in inputs])
            unexplained = _call(
                self.graph,
                aten.logical_and.default,
                (self.nonfinite(node), _call(self.graph, aten.logical_not.default, (explained,))),
            )
            return _call(self.graph, aten.any.default, (unexplained,))
        # Otherwise: the output holds an inf/NaN and no input does.
        any_input = self.either([self.holds(value) for value in inputs])
        return _call(
            self.graph,
            aten.logical_and.default,
            (self.holds(node), _call(self.graph, aten.logical_not.default, (any_input,))),
        )


def watch_nonfinite(
    gm: torch.fx.GraphModule, *, dtype: torch.dtype, data_inputs: Sequence[bool] = ()
) -> tuple[torch.fx.GraphModule, WatchRecord]:
    """Append the first-origin record to ``gm``'s outputs (see the module docstring).

    ``data_inputs``: per placeholder, True where it is data the caller handed in (a batch) rather
    than module state; empty (or of another length) treats none as data."""
    inputs = placeholders(gm.graph)
    data = (
        {n for n, flag in zip(inputs, data_inputs, strict=True) if flag} if len(data_inputs) == len(inputs) else set()
    )
    return append_first_origin(gm, dtype=dtype, data=data, describe=_forward_op)


def _forward_op(node: torch.fx.Node, op: object, dtype: torch.dtype) -> WatchedOp | None:
    return WatchedOp(
        module=innermost_module(node), op=op_label(op, packet=True), dtype=dtype_name(dtype), node=node.name
    )


Describe = Callable[[torch.fx.Node, object, torch.dtype], "WatchedOp | None"]
"""How a pass names a watched node (None: do not watch it)."""


def append_first_origin(
    gm: torch.fx.GraphModule,
    *,
    dtype: torch.dtype,
    data: set[torch.fx.Node],
    describe: Describe,
    entering: Sequence[tuple[torch.fx.Node, WatchedOp]] = (),
    lowered: bool = False,
) -> tuple[torch.fx.GraphModule, WatchRecord]:
    """The pass itself, shared by the forward watch and the backward watch
    (``amp_fx.passes.watch_backward``): checks after every watched node, in graph order, and one
    more output, the position of the first flagged one (-1: none).

    ``data``: values of the caller's data (module docstring); ``describe``: names a watched node;
    ``entering``: graph inputs checked before any op (``any(~isfinite(input))``), each with the
    record that names it, first in the record; ``lowered``: checks made of ops every backend lowers
    as they are (for a graph that is not decomposed again, :class:`_Checks`)."""
    record = WatchRecord()
    graph = gm.graph
    output = next(n for n in reversed(graph.nodes) if n.op == "output")
    checks = _Checks(graph, data, lowered)
    flags: list[torch.fx.Node] = []
    if entering:
        first_op = next(n for n in graph.nodes if n.op != "placeholder")
        with graph.inserting_before(first_op):
            for value, entered in entering:
                record.ops.append(entered)
                flags.append(checks.holds(value))
    for node in list(graph.nodes):
        target = node.target
        op = _watched(node, dtype)
        named = None if op is None or _has_nonfinite_scalar(node) else describe(node, op, dtype)
        if named is None:  # an op given an inf/NaN number (a -inf mask) is no origin
            # Not watched: a value computed from the caller's data stays "data" until a watched
            # op reads it (fp32 ops before the first cast, views, in-place updates).
            if node.op == "call_function" and any(a in data for a in node.all_input_nodes):
                data.add(node)
            if isinstance(target, torch._ops.OpOverload) and target._schema.is_mutable:
                checks.mutated(node)
            continue
        record.ops.append(named)
        # Right after the node: the checks read its value before any later in-place op changes it.
        with graph.inserting_before(node.next):
            flags.append(checks.origin(node, op))
    with graph.inserting_before(output):
        if flags:
            if lowered:
                rows = [_call(graph, aten.unsqueeze.default, (f, 0)) for f in flags]
                stacked = _call(graph, aten.cat.default, (rows,))
                as_int = _call(graph, torch.ops.prims.convert_element_type.default, (stacked, torch.int32))
            else:
                stacked = _call(graph, aten.stack.default, (flags,))
                as_int = _call(graph, CAST_OP, (stacked,), {"dtype": torch.int32})
            # argmax of the flags as int32 is the first flagged position (argmax returns the first
            # maximum); -1 where none is flagged.
            first = _call(graph, aten.argmax.default, (as_int,))
            anyflag = _call(graph, aten.any.default, (stacked,))
            code = _call(graph, aten.where.ScalarOther, (anyflag, first, NONE))
        else:
            code = _call(graph, aten.full.default, ([], NONE), {"dtype": torch.int64, "device": _device(gm)})
    outs = output.args[0]
    output.args = ((*outs, code) if isinstance(outs, (tuple, list)) else (outs, code),)
    graph.lint()
    gm.recompile()
    return gm, record


def _is_dtensor(node: torch.fx.Node) -> bool:
    dtensor = dtensor_type()
    return dtensor is not None and isinstance(node.meta.get("val"), dtensor)


def _call(
    graph: torch.fx.Graph, target: object, args: tuple[Any, ...], kwargs: dict[str, Any] | None = None
) -> torch.fx.Node:
    # target: an ATen op or a prim (callable); typed object as the op tables hold them
    node = graph.call_function(target, args, kwargs or {})  # type: ignore[arg-type]  # see above
    vals = torch.fx.node.map_arg((args, kwargs or {}), lambda n: n.meta["val"])
    node.meta["val"] = target(*vals[0], **vals[1])  # type: ignore[operator]  # callable, as above
    return node


def _device(gm: torch.fx.GraphModule) -> torch.device:
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor):
            return val.device
    return torch.device("cpu")
