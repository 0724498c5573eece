"""Where a compiled run of amp_fx's graph first leaves the same graph run op by op (compare's half for
inductor: a fusion difference named at its op).

compare's op-by-op part runs amp_fx's rewritten graph with an ``fx.Interpreter``: ATen's kernels,
one op at a time, whatever the downstream backend. Under inductor the values that matter are the
fused kernels'. This module compiles the rewritten graph with every op's output kept as a graph
output (one compile per graph and backend, run without grad on the graph's recorded inputs) and
names the first op, in graph order, whose compiled value is not bitwise the op-by-op value. Each op
is computed by the backend's own code with its fusion: inductor computes an op from its inputs'
in-register values, so keeping an output does not round away the excess precision of the fused run.
It does not see the backward (the end-to-end gradients do).

    >>> first_compiled_divergence(record, inputs, flags, backend)  # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx

__all__ = ["CompiledDivergence", "every_op_as_output", "first_compiled_divergence"]


@dataclass(frozen=True)
class CompiledDivergence:
    """One compiled run (``run``: the backend and its numerics) against the same graphs op by op:
    the first op whose value differs (``node`` None: none does)."""

    run: str
    graph: int | None = None
    node: str | None = None
    op: str = ""
    module: str = ""
    error: str = ""
    """max |compiled - op by op| (relative), as compare's tables print it."""
    not_compiled: tuple[int, ...] = ()
    """Graphs whose every-op compile failed (compare's notes say why): not checked."""

    def __str__(self) -> str:
        unchecked = f" (graphs {', '.join(map(str, self.not_compiled))} not checked: see the notes)"
        unchecked = unchecked if self.not_compiled else ""
        if self.node is None:
            return f"{self.run}: every op checked bitwise with the op-by-op run{unchecked}"
        where = f"{self.node} ({self.op}{', module ' + self.module if self.module else ''})"
        return f"{self.run}: first op that differs: graph {self.graph}, node {where}, max abs diff {self.error}"


def every_op_as_output(gm: torch.fx.GraphModule, nodes: list[torch.fx.Node]) -> torch.fx.GraphModule:
    """A copy of ``gm`` whose outputs are ``nodes`` (a tuple, in the order given); ``gm`` is unchanged."""
    graph = torch.fx.Graph()
    copied: dict[torch.fx.Node, torch.fx.Node] = {}
    graph.graph_copy(gm.graph, copied)
    graph.output(tuple(copied[n] for n in nodes))
    graph.eliminate_dead_code()
    return torch.fx.GraphModule(gm, graph)


def first_compiled_divergence(
    gm: torch.fx.GraphModule,
    inputs: list[Any],
    op_by_op: Mapping[str, Any],
    backend: Callable[[torch.fx.GraphModule, list[Any]], Callable[..., Any]],
    # inductor's compile_fx (default or numerics="eager"); an AOTAutograd backend's boxed callable
    # would need its inputs as one list
    *,
    same: Callable[[Any, Any], bool],
) -> tuple[torch.fx.Node, Any] | None:
    """The first op of ``gm`` (graph order) whose value compiled by ``backend`` is not ``same`` as
    its value in ``op_by_op`` (node name to value, compare's interpreter run), with the compiled
    value; None when every tensor-valued op agrees. ``inputs`` are used as given (pass copies)."""
    nodes = [
        n
        for n in gm.graph.nodes
        if n.op == "call_function" and isinstance(op_by_op.get(n.name), torch.Tensor) and n.name in op_by_op
    ]
    if not nodes:
        return None
    with torch.no_grad(), torch._C._DisableAutocast():
        compiled = backend(every_op_as_output(gm, nodes), list(inputs))
        out = compiled(*inputs)  # compile_fx's callable, called outside Dynamo: unboxed
    for node, value in zip(nodes, out, strict=True):
        if not same(value, op_by_op[node.name]):
            return node, value
    return None
