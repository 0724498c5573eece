"""The graph-editing toolbox of the passes and the inspection tools: one helper per idiom, so a
pass reads as its rule alone (as inductor's ``fx_utils.py`` serves its ``fx_passes/``).

* finding nodes: :func:`placeholders` (``graph.find_nodes``, in graph order);
* copying: :func:`copy_graph_module`, a fresh graph a pass may rewrite while the original stays;
* views: the sets of ATen view ops (:data:`LAYOUT_VIEWS` within :data:`FULL_VIEWS` and
  :data:`WEIGHT_VIEWS`), :func:`walk_views` up through them (:func:`uncast`: through amp_fx's
  casts), and :func:`aliases_input` for any op whose result shares an input's storage;
* reading: :func:`arg_node` (an argument that must be a node), :func:`innermost_module`,
  :func:`val` (an op's name, for users, is :func:`amp_fx._common.op_names.op_label`, which the op
  tables below the passes use too);
* building: :data:`CAST_OP`, :func:`add_node` (a node with ``meta["val"]``, its module and its
  decision), :func:`mark_cast` and :func:`is_inserted_cast` (``meta.CAST``).

    >>> g = torch.fx.Graph()
    >>> w = g.placeholder("w")
    >>> t = g.call_function(torch.ops.aten.t.default, (w,))
    >>> src, passed = walk_views(t, LAYOUT_VIEWS)
    >>> src is w, [n.name for n in passed], [n.name for n in placeholders(g)]
    (True, ['t_default'], ['w'])
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any, overload

import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_map

from amp_fx.passes import meta
from amp_fx.passes.capture import module_stack
from amp_fx.policy import Decision

__all__ = [
    "CAST_OP",
    "LAYOUT_VIEWS",
    "FULL_VIEWS",
    "WEIGHT_VIEWS",
    "placeholders",
    "copy_graph_module",
    "walk_views",
    "uncast",
    "aliases_input",
    "arg_node",
    "innermost_module",
    "val",
    "add_node",
    "mark_cast",
    "is_inserted_cast",
    "is_cast",
]

aten = torch.ops.aten

CAST_OP = aten._to_copy.default
"""The cast amp_fx inserts, and the one eager autocast's casts trace to."""

LAYOUT_VIEWS = frozenset({aten.t.default, aten.transpose.int, aten.permute.default})
"""Views that only reorder a tensor's dimensions: a parameter's cast may move before them (a grouped
expert GEMM's weight, ``insert_casts``)."""

_RESHAPES = frozenset(
    {
        aten.view.default,
        aten._unsafe_view.default,
        aten.reshape.default,
        aten.alias.default,
        aten.expand.default,
        aten.unsqueeze.default,
        aten.squeeze.default,
        aten.squeeze.dim,
    }
)

FULL_VIEWS = LAYOUT_VIEWS | _RESHAPES | {aten.squeeze.dims, aten.detach.default}
"""Views that show every element of their base, so the base's "holds an inf/NaN" is theirs
(``watch_nonfinite``)."""

WEIGHT_VIEWS = LAYOUT_VIEWS | _RESHAPES | {aten.select.int}
"""Views through which a matmul's weight operand is still "a view of a parameter" (``fp8_matmuls``,
``lift_weight_casts``). ``aten.select``: one expert of a mixture whose experts are one 3-D
parameter (``x @ self.w[e]``)."""


def placeholders(graph: torch.fx.Graph) -> list[torch.fx.Node]:
    """The graph's inputs, in order."""
    return list(graph.find_nodes(op="placeholder"))


def copy_graph_module(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A graph module over a copy of ``gm``'s graph (nodes and their ``meta`` dicts new, the metadata
    values and ``gm``'s submodules and attributes shared)."""
    graph = torch.fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    return torch.fx.GraphModule(gm, graph)


@overload
def uncast(node: torch.fx.Node) -> torch.fx.Node: ...
@overload
def uncast(node: object) -> object: ...
def uncast(node: object) -> object:
    """The value before the casts amp_fx inserted (casts the model wrote itself are kept); a node
    for a node (amp_fx casts nodes only)."""
    while (
        isinstance(node, torch.fx.Node)
        and is_inserted_cast(node)
        and node.args
        and isinstance(node.args[0], torch.fx.Node)
    ):
        node = node.args[0]
    return node


@overload
def walk_views(
    node: torch.fx.Node,
    views: Collection[object],
    *,
    through_casts: bool = False,
    stop: Callable[[torch.fx.Node], bool] | None = None,
) -> tuple[torch.fx.Node, list[torch.fx.Node]]: ...
@overload
def walk_views(
    node: object,
    views: Collection[object],
    *,
    through_casts: bool = False,
    stop: Callable[[torch.fx.Node], bool] | None = None,
) -> tuple[object, list[torch.fx.Node]]: ...
def walk_views(
    node: object,
    views: Collection[object],
    *,
    through_casts: bool = False,
    stop: Callable[[torch.fx.Node], bool] | None = None,
) -> tuple[object, list[torch.fx.Node]]:
    """Up from ``node`` through calls of ``views`` (with ``through_casts``, through the casts amp_fx
    inserted too): the value they view (a node where ``node`` is one) and the views passed,
    nearest first. The walk ends at a view whose first argument is not a node, or for which
    ``stop(view)`` is true."""
    passed: list[torch.fx.Node] = []
    if through_casts:
        node = uncast(node)
    while (
        isinstance(node, torch.fx.Node)
        and node.op == "call_function"
        and node.target in views
        and isinstance(node.args[0], torch.fx.Node)
        and not (stop is not None and stop(node))
    ):
        passed.append(node)
        node = uncast(node.args[0]) if through_casts else node.args[0]
    return node, passed


def aliases_input(op: torch._ops.OpOverload) -> bool:
    """Whether ``op``'s result shares an input's storage: a view, or an in-place or out= op's return."""
    return op.is_view or any(r.alias_info is not None for r in op._schema.returns)


def arg_node(node: torch.fx.Node, i: int = 0) -> torch.fx.Node:
    """``node.args[i]`` where the caller knows it is a node (an ATen op's tensor operand, a cast's
    input); raises ``TypeError`` naming ``node`` when it is not."""
    arg = node.args[i]
    if not isinstance(arg, torch.fx.Node):
        raise TypeError(f"argument {i} of {node.format_node()} is {arg!r}, not a graph node")
    return arg


def innermost_module(node: torch.fx.Node) -> str:
    """The qualified path of the innermost module ``node`` runs in ("" for the root's own code)."""
    stack = module_stack(node)
    return stack[-1][0] if stack else ""


def val(arg: Any) -> Any:
    """A node's fake value (``meta["val"]``); any other argument as it is."""
    return arg.meta.get("val") if isinstance(arg, torch.fx.Node) else arg


def add_node(
    graph: torch.fx.Graph,
    target: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any] | None = None,
    *,
    fake_mode: FakeTensorMode,
    stack: dict[str, Any],
    decision: Decision | None = None,
    before: torch.fx.Node | None = None,
) -> torch.fx.Node:
    """A new ``call_function`` node (before ``before``, else where the graph inserts now) with
    ``meta["val"]`` computed from its arguments' values under ``fake_mode`` (in the caller's grad
    mode), ``nn_module_stack`` = ``stack`` and, where given, ``meta.DECISION``."""
    kwargs = kwargs or {}
    if before is None:
        node = graph.call_function(target, args, kwargs)
    else:
        with graph.inserting_before(before):
            node = graph.call_function(target, args, kwargs)
    with fake_mode:
        node.meta["val"] = target(*tree_map(val, args), **tree_map(val, kwargs))
    node.meta["nn_module_stack"] = stack
    if decision is not None:
        node.meta[meta.DECISION] = decision
    return node


def mark_cast(node: torch.fx.Node, reason: str, *, cached: bool = False) -> torch.fx.Node:
    """Mark ``node`` as a cast amp_fx inserted, for ``reason``; ``cached``: the shared cast of a leaf
    (eager autocast's cast cache)."""
    node.meta[meta.CAST] = meta.CAST_INSERTED
    node.meta[meta.CAST_REASON] = reason
    node.meta[meta.CACHED] = cached
    return node


def is_inserted_cast(node: torch.fx.Node) -> bool:
    """A cast amp_fx inserted (:func:`mark_cast`)."""
    return node.meta.get(meta.CAST) == meta.CAST_INSERTED


def is_cast(node: torch.fx.Node) -> bool:
    """A dtype cast (``aten._to_copy``), inserted by amp_fx or written by the user."""
    return node.op == "call_function" and node.target is CAST_OP


def counted_ops(gm: torch.fx.GraphModule) -> int:
    """What "ops" means wherever amp_fx prints a count (the compile progress line, ``explain``'s
    table, ``amp_fx_summary()``): the ATen ops of a graph, casts not counted (they have columns of
    their own), nor ``getitem`` and other Python-level nodes."""
    return sum(
        n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload) and not is_cast(n)
        for n in gm.graph.nodes
    )
