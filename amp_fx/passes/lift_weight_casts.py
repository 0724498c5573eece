"""lift_weight_casts: turn a graph's casts of fp32 parameters into inputs (for the weight cache).

Assumes: ``gm`` went through ``insert_casts`` (and possibly ``fold_casts``); ``example_inputs``
are the graph's inputs in placeholder order, real parameters being ``nn.Parameter`` objects
(what Dynamo hands a backend).

Rewrites a copy, never ``gm`` itself (inspection tools run the recorded graph on its recorded
inputs). In the copy, every ``aten._to_copy(w, dtype=d)`` of a placeholder ``w`` that is an fp32
``nn.Parameter``, with ``d`` bf16 or fp16 and no other argument, is replaced by one new
placeholder per (w, d), appended after the existing ones:

* a parameter that requires grad is lifted only where its cast is eager autocast's shared cast
  (``meta["amp_fx_cached"]``): the uses' gradients then add up in the lifted input, in the low
  dtype, as they did on the shared cast;
* a frozen parameter (``requires_grad=False``) has one cast per use (eager autocast does not
  cache it), all with the same value and no gradient: they become one input.

Guarantees: values unchanged when the new inputs hold ``w.to(d)``; ``meta["val"]`` of each new
placeholder is the cast's; the graph lints. Returns the copy, the example inputs extended with
one example per new input, and the (position of w, d, number of uses) of each new input, in
order.

Example:
    >>> import torch
    >>> w = torch.nn.Parameter(torch.randn(3, 4))
    >>> g = torch.fx.Graph()
    >>> x, p = g.placeholder("x"), g.placeholder("w")
    >>> c = g.call_function(torch.ops.aten._to_copy.default, (p,), {"dtype": torch.bfloat16})
    >>> c.meta.update(amp_fx_cached=True, val=torch.empty(3, 4, dtype=torch.bfloat16))
    >>> _ = g.output(g.call_function(torch.ops.aten.mm.default, (x, c)))
    >>> lifted_gm, inputs, lifted = lift_weight_casts(torch.fx.GraphModule({}, g),
    ...                                               [torch.randn(2, 3), w])
    >>> lifted, [n.name for n in lifted_gm.graph.nodes if n.op == "placeholder"]
    ([(1, torch.bfloat16, 1)], ['x', 'w', 'w_bf16'])
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.fx

from amp_fx._dtype_names import dtype_name

__all__ = ["lift_weight_casts"]

_CAST = torch.ops.aten._to_copy.default
_LOW = (torch.bfloat16, torch.float16)


def _liftable(node: torch.fx.Node, position: dict[torch.fx.Node, int], inputs: Sequence[Any]) -> bool:
    if node.op != "call_function" or node.target is not _CAST or len(node.args) != 1:
        return False
    src = node.args[0]
    if src not in position or set(node.kwargs) != {"dtype"} or node.kwargs["dtype"] not in _LOW:
        return False
    weight = inputs[position[src]]
    if not isinstance(weight, torch.nn.Parameter) or weight.dtype != torch.float32:
        return False
    return bool(node.meta.get("amp_fx_cached")) if weight.requires_grad else True


def _example(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An input like ``weight.to(dtype)``, made in the same (fake or real) mode as ``weight``."""
    with torch.no_grad():
        ex = torch.empty_strided(weight.shape, weight.stride(), dtype=dtype, device=weight.device)
    return ex.requires_grad_(weight.requires_grad)


def lift_weight_casts(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]
                      ) -> tuple[torch.fx.GraphModule, list[Any], list[tuple[int, torch.dtype, int]]]:
    """Lift parameter casts into inputs, on a copy (contract in the module doc)."""
    graph = torch.fx.Graph()
    out = graph.graph_copy(gm.graph, {})
    graph.output(out)
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    position = {n: i for i, n in enumerate(placeholders)}
    casts = [n for n in graph.nodes if _liftable(n, position, example_inputs)]
    if not casts:
        return gm, list(example_inputs), []
    new_inputs: dict[tuple[torch.fx.Node, torch.dtype], torch.fx.Node] = {}
    lifted: list[tuple[int, torch.dtype]] = []
    inputs = list(example_inputs)
    for cast in casts:
        key = (cast.args[0], cast.kwargs["dtype"])
        if key not in new_inputs:
            with graph.inserting_after(placeholders[-1] if not new_inputs else list(new_inputs.values())[-1]):
                ph = graph.placeholder(f"{cast.args[0].name}_{dtype_name(key[1])}")
            ph.meta["val"] = cast.meta.get("val")
            ph.meta["amp_fx_weight_cache"] = True
            new_inputs[key] = ph
            i = position[cast.args[0]]
            lifted.append((i, key[1]))
            inputs.append(_example(example_inputs[i], key[1]))
        cast.replace_all_uses_with(new_inputs[key])
        graph.erase_node(cast)
    graph.lint()
    uses = [len(new_inputs[(placeholders[i], d)].users) for i, d in lifted]
    return torch.fx.GraphModule(gm, graph), inputs, [(i, d, n) for (i, d), n in zip(lifted, uses)]
