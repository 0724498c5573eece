"""lift_weight_casts: turn a graph's casts of fp32 parameters into inputs (for the weight cache).

Assumes: ``gm`` went through ``insert_casts`` (and possibly ``fold_casts``); ``example_inputs``
are the graph's inputs in placeholder order, real parameters being ``nn.Parameter`` objects
(what Dynamo hands a backend).

Rewrites a copy, never ``gm`` itself (inspection tools run the recorded graph on its recorded
inputs). In the copy, every ``aten._to_copy(w, dtype=d)`` of a placeholder ``w`` that is an fp32
``nn.Parameter``, with ``d`` bf16 or fp16 and no other argument, is replaced by new placeholders,
appended after the existing ones:

* a parameter that requires grad is lifted only where its cast is eager autocast's shared cast
  (``meta["amp_fx_cached"]``), and each *use* of the cast (each occurrence among its users'
  inputs) gets an input of its own. The weight cache feeds all of them the one autograd node of
  the forward (:mod:`amp_fx.backend.weight_cache`), so the graph's backward returns one low-precision
  gradient per use and the autograd engine adds them into that node's buffer, as it adds eager
  autocast's uses into its cached cast's. A single input would have the graph add its uses
  first, and (a + b) + c is not a + (b + c) in bf16: not bitwise once a later graph of the same
  forward uses the weight too. The engine adds one node's outputs in input order, so the inputs
  come in eager's order: latest user first (autograd runs nodes in reverse creation order), a
  user's own occurrences in argument order;
* a frozen parameter (``requires_grad=False``) has one cast per use (eager autocast does not
  cache it), all with the same value and no gradient: they become one input.

The fp32 uses of a trainable parameter (an embedding tied to the output projection, as in T5)
are lifted too, one input per occurrence, when the parameter also has a lifted cast in the
graph or occurs twice or more in it. Eager autograd adds ``w``'s gradient contributions into
its ``AccumulateGrad`` buffer one by one, in reverse creation order of the nodes that produce
them: the cast and each fp32 use. A graph that kept its fp32 uses would hand back their sum,
added to the cast's contribution afterwards: T5's shared embedding (encoder and decoder
lookups, then the tied head) gets ``(enc + dec) + head`` where eager computes
``(head + dec) + enc``, not bitwise in fp32. Each such input is fed its own autograd node
(``WeightCache.use``), made in eager's creation order (:attr:`Lifted.created`).

An fp8 matmul of the fp8 pass (``fp8_matmul(x, w, recipe)``, ``w`` a view of an fp32 parameter
with constant arguments: ``aten.t`` of a linear's weight) becomes ``fp8_matmul_cached_weight``,
its weight's four cast tensors (:func:`amp_fx.kernels.fp8_matmul.weight_casts`: data and scale for
the forward GEMM and for the input-gradient GEMM) new inputs, appended first, one set per
(weight, views, recipe) (:attr:`Lifted.fp8` says which part each is). No gradient flows through
them: ``w`` still carries the weight's. A weight operand that is not such a view raises (the
backend then compiles the graph uncached and says so).

Guarantees: values unchanged when the new inputs hold ``w.to(d)`` (``w`` itself for an fp32 use);
``meta["val"]`` of each new placeholder is the cast's (the weight's); the new inputs have the
weight's static sizes (fake tensors of Dynamo's tracing mode under Dynamo); the graph lints.
Returns the copy, the example inputs extended with one example per new input, and a
:class:`Lifted` per new input, in input order.

Example:
    >>> import torch
    >>> w = torch.nn.Parameter(torch.randn(4, 4))
    >>> g = torch.fx.Graph()
    >>> x, p = g.placeholder("x"), g.placeholder("w")
    >>> c = g.call_function(torch.ops.aten._to_copy.default, (p,), {"dtype": torch.bfloat16})
    >>> c.meta.update({meta.CACHED: True, "val": torch.empty(4, 4, dtype=torch.bfloat16)})
    >>> h = g.call_function(torch.ops.aten.mm.default, (x, c))
    >>> _ = g.output(g.call_function(torch.ops.aten.mm.default, (h, c)))
    >>> lifted_gm, inputs, lifted = lift_weight_casts(torch.fx.GraphModule({}, g),
    ...                                               [torch.randn(2, 4), w])
    >>> [(x.weight, x.dtype) for x in lifted], [n.name for n in placeholders(lifted_gm.graph)]
    ([(1, torch.bfloat16), (1, torch.bfloat16)], ['x', 'w', 'w_bf16', 'w_bf16_2'])
    >>> [str(n.args) for n in lifted_gm.graph.nodes if n.op == "call_function"]  # latest user first
    ['(x, w_bf16_2)', '(mm_default, w_bf16)']
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.fx
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import FakeTensorMode

from amp_fx._common.compat import dtensor_type
from amp_fx._common.dtype_names import dtype_name
from amp_fx.fp8 import Fp8Recipe, Nvfp4Options
from amp_fx.kernels.fp8_matmul import fp8_matmul, fp8_matmul_cached_weight, weight_casts
from amp_fx.kernels.nvfp4 import nvfp4_linear_cached_weight, nvfp4_linear_flags
from amp_fx.passes import meta
from amp_fx.passes.fx_edit import CAST_OP, WEIGHT_VIEWS, copy_graph_module, placeholders, walk_views

__all__ = ["Lifted", "Fp8WeightCast", "lift_weight_casts"]

_LOW = (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class Fp8WeightCast:
    """What an input of an fp8 matmul's weight holds (``fp8=`` with ``weight_cache=True``): part
    ``part`` of :func:`amp_fx.kernels.fp8_matmul.weight_casts` of the weight as the matmul reads
    it (the weight with ``views`` applied: ``aten.t`` for a linear's ``[N, K]`` weight)."""

    recipe: Fp8Recipe
    views: tuple[tuple[Any, tuple[Any, ...]], ...]
    """``(ATen view op, its arguments after the tensor)``, applied in order."""
    part: int
    """0, 1: the forward GEMM's cast (data, scale); 2, 3: the input-gradient GEMM's; 4: NVFP4's amax."""
    nvfp4: Nvfp4Options | None = None
    """NVFP4's switches, for an NVFP4 matmul (``weight_2d`` decides its weight's tiles)."""

    def operand(self, weight: torch.Tensor) -> torch.Tensor:
        for op, args in self.views:
            weight = op(weight, *args)
        return weight


class Lifted(NamedTuple):
    """One new input of the lifted graph."""

    weight: int
    """Position of the weight among the graph's inputs."""
    dtype: torch.dtype
    """The copy's dtype; the weight's own dtype for an fp32 use of the weight itself."""
    created: int
    """When eager autograd creates the node this input stands for, relative to the graph's other
    new inputs (ascending; the uses of one cast share its node and its rank)."""
    fp8: Fp8WeightCast | None = None
    """For an input of an fp8 matmul: which of its weight's casts (no gradient flows through it)."""


def _liftable(node: torch.fx.Node, position: dict[torch.fx.Node, int], inputs: Sequence[Any]) -> bool:
    if node.op != "call_function" or node.target is not CAST_OP or len(node.args) != 1:
        return False
    src = node.args[0]
    if (
        not isinstance(src, torch.fx.Node)
        or src not in position
        or set(node.kwargs) != {"dtype"}
        or node.kwargs["dtype"] not in _LOW
    ):
        return False
    weight = inputs[position[src]]
    if not isinstance(weight, torch.nn.Parameter) or weight.dtype != torch.float32:
        return False
    return bool(node.meta.get(meta.CACHED)) if weight.requires_grad else True


def _example(weight: torch.Tensor, dtype: torch.dtype, fake_mode: FakeTensorMode | None) -> torch.Tensor:
    """An input like ``weight.to(dtype)``, with ``weight``'s static sizes.

    Under Dynamo (``fake_mode`` is its tracing mode) the example is a fake tensor of that mode.
    A real tensor Dynamo never saw would be fakified by AOTAutograd with a fresh symbol per size
    and no source; a guard on such a symbol (``infer_size`` of a ``view(b, t, -1, head_dim)`` of
    HF Llama's 32-row ``k_proj`` output: ``Eq(Mod(16*s, 256), 0)``) makes Dynamo's guard builder
    fail (``symbol_to_source[symbol][0]``: IndexError). The weight's sizes are static (Dynamo
    specializes parameters), so the copy's are.
    """
    dtensor = dtensor_type()
    sharded = dtensor is not None and isinstance(weight, dtensor)
    local = weight.to_local() if sharded else weight  # type: ignore[attr-defined]
    with torch.no_grad(), fake_mode if fake_mode is not None else contextlib.nullcontext():
        ex = torch.empty_strided(local.shape, local.stride(), dtype=dtype, device=local.device)
        if sharded:  # a DTensor weight (tensor parallelism): its copy is one, placed as the weight
            assert dtensor is not None  # sharded: the weight is a DTensor
            mesh, placements = weight.device_mesh, weight.placements  # type: ignore[attr-defined]  # a DTensor
            ex = dtensor.from_local(
                ex,
                mesh,
                placements,
                run_check=False,
                shape=weight.shape,
                stride=weight.stride(),
            )
    return ex.requires_grad_(weight.requires_grad)


def _users_in_accumulation_order(casts: Sequence[torch.fx.Node]) -> list[torch.fx.Node]:
    """The users of ``casts`` (one weight's casts to one dtype), latest first: the order in which
    eager autograd adds their gradient contributions into the cast's buffer (it runs nodes in
    reverse creation order)."""
    order = {n: i for i, n in enumerate(casts[0].graph.nodes)}
    return sorted({u: None for c in casts for u in c.users}, key=order.__getitem__, reverse=True)


def _give_each_occurrence_its_input(
    user: torch.fx.Node, casts: Sequence[torch.fx.Node], make_input: Callable[[], torch.fx.Node]
) -> None:
    """Replace each occurrence of ``casts`` among ``user``'s inputs (args, then kwargs) by a new
    input, in order: autograd adds one node's outputs into a buffer in that order."""

    def swap(n: torch.fx.Node) -> torch.fx.Node:
        return make_input() if n in casts else n

    user.args, user.kwargs = torch.fx.node.map_arg((user.args, user.kwargs), swap)


def _direct_uses(
    src: torch.fx.Node, lifted_casts: set[torch.fx.Node], where: dict[torch.fx.Node, int]
) -> list[torch.fx.Node] | None:
    """The users of ``src`` (an fp32 parameter) other than its lifted casts, in graph order, or
    None when one of them must keep ``src`` itself: the output (the graph returns the parameter)
    or an op that mutates an argument (an alias input would take the mutation)."""
    users = sorted((u for u in src.users if u not in lifted_casts), key=where.__getitem__)
    for u in users:
        if u.op != "call_function":
            return None
        schema = getattr(u.target, "_schema", None)
        if schema is None or schema.is_mutable:
            return None
    return users


def _occurrences(user: torch.fx.Node, src: torch.fx.Node) -> int:
    found: list[torch.fx.Node] = []
    torch.fx.node.map_arg((user.args, user.kwargs), lambda n: found.append(n) if n is src else None)
    return len(found)


def lift_weight_casts(
    gm: torch.fx.GraphModule, example_inputs: Sequence[Any]
) -> tuple[torch.fx.GraphModule, list[Any], list[Lifted]]:
    """Lift parameter casts (and, where their order matters, fp32 uses) into inputs, on a copy
    (contract in the module doc)."""
    copy = copy_graph_module(gm)
    graph = copy.graph
    inputs_before = placeholders(graph)
    if not inputs_before:  # no input, so no parameter to cast (a region of Llama's root that makes a mask)
        return gm, list(example_inputs), []
    position = {n: i for i, n in enumerate(inputs_before)}
    where = {n: i for i, n in enumerate(graph.nodes)}
    lifted: list[Lifted] = []
    inputs = list(example_inputs)
    last = inputs_before[-1]
    fake_mode = detect_fake_mode(example_inputs)
    last = _lift_fp8_weight_casts(graph, position, example_inputs, fake_mode, last, lifted, inputs)
    casts = [n for n in graph.nodes if _liftable(n, position, example_inputs)]
    by_weight: dict[tuple[torch.fx.Node, torch.dtype], list[torch.fx.Node]] = {}
    for cast in casts:
        by_weight.setdefault((cast.args[0], cast.kwargs["dtype"]), []).append(cast)
    fp32_uses = _fp32_uses_to_lift(inputs_before, example_inputs, set(casts), {src for src, _ in by_weight}, where)
    if not casts and not fp32_uses and not lifted:
        return gm, list(example_inputs), []
    # eager's creation order: a cast at its first user (before that user's own node), an fp32
    # use at its user, a user's occurrences last argument first (autograd adds one node's
    # outputs in argument order, and runs the later-created of two nodes first)
    events: dict[tuple[Any, ...], None] = {}
    for (src, dtype), same in by_weight.items():
        events[(min(where[u] for c in same for u in c.users), 0, 0, src.name, dtype_name(dtype))] = None
    for src, users in fp32_uses.items():
        for user in users:
            n = _occurrences(user, src)
            for k in range(n):
                events[(where[user], 1, n - 1 - k, src.name, "")] = None
    rank = {event: i for i, event in enumerate(sorted(events))}

    names: dict[str, int] = {}

    def new_input(src: torch.fx.Node, dtype: torch.dtype, val: Any, created: int) -> torch.fx.Node:
        nonlocal last
        i = position[src]
        own = dtype == example_inputs[i].dtype
        name = f"{src.name}_{'use' if own else dtype_name(dtype)}"
        names[name] = names.get(name, 0) + 1
        with graph.inserting_after(last):  # a placeholder's name is its argument's: unique
            ph = graph.placeholder(name if names[name] == 1 else f"{name}_{names[name]}")
        ph.meta["val"] = val
        ph.meta[meta.WEIGHT_USE if own else meta.WEIGHT_CACHE] = True
        last = ph
        lifted.append(Lifted(i, dtype, created))
        inputs.append(_example(example_inputs[i], dtype, fake_mode))
        return ph

    for (src, dtype), same in by_weight.items():
        first = min(where[u] for c in same for u in c.users)
        make_input = functools.partial(
            new_input, src, dtype, same[0].meta.get("val"), rank[(first, 0, 0, src.name, dtype_name(dtype))]
        )
        if not inputs[position[src]].requires_grad:
            frozen = make_input()
            for cast in same:
                cast.replace_all_uses_with(frozen)
        else:
            for user in _users_in_accumulation_order(same):
                _give_each_occurrence_its_input(user, same, make_input)
        for cast in same:
            graph.erase_node(cast)
    for src, users in fp32_uses.items():
        dtype = example_inputs[position[src]].dtype
        for user in users:
            n = _occurrences(user, src)
            created = iter([rank[(where[user], 1, n - 1 - k, src.name, "")] for k in range(n)])

            def next_input(
                src: torch.fx.Node = src, dtype: torch.dtype = dtype, created: Iterator[int] = created
            ) -> torch.fx.Node:
                return new_input(src, dtype, src.meta.get("val"), next(created))

            _give_each_occurrence_its_input(user, [src], next_input)
    graph.lint()
    copy.recompile()
    return copy, inputs, lifted


_FP8_PARTS = ("w8", "w8_scale", "w8_grad", "w8_grad_scale", "w8_amax")
_UNCACHED: dict[Callable[..., Any], Callable[..., Any]] = {
    fp8_matmul: fp8_matmul_cached_weight,
    nvfp4_linear_flags: nvfp4_linear_cached_weight,
}
"""Each low-precision matmul the lifting pass rewrites, and its cached-weight twin (the same
arguments, the weight's casts inserted after ``w``)."""


def _constant(a: Any) -> bool:
    return isinstance(a, int) or (isinstance(a, (list, tuple)) and all(isinstance(b, int) for b in a))


def _weight_operand(
    node: Any, position: dict[torch.fx.Node, int], inputs: Sequence[Any]
) -> tuple[torch.fx.Node, tuple[tuple[Any, tuple[Any, ...]], ...]] | None:
    """The fp32 parameter placeholder an fp8 matmul's weight operand is a view of, and the views
    (each an ATen view op whose other arguments are constants), or None."""
    node, views = walk_views(
        node, WEIGHT_VIEWS, stop=lambda v: bool(v.kwargs) or not all(_constant(a) for a in v.args[1:])
    )
    if not isinstance(node, torch.fx.Node) or node not in position:
        return None
    weight = inputs[position[node]]
    if not isinstance(weight, torch.nn.Parameter) or weight.dtype != torch.float32:
        return None
    return node, tuple((v.target, tuple(v.args[1:])) for v in reversed(views))


def _lift_fp8_weight_casts(
    graph: torch.fx.Graph,
    position: dict[torch.fx.Node, int],
    example_inputs: Sequence[Any],
    fake_mode: FakeTensorMode | None,
    last: torch.fx.Node,
    lifted: list[Lifted],
    inputs: list[Any],
) -> torch.fx.Node:
    """Each fp8 matmul (``fp8_matmul(x, w, recipe)`` of the fp8 pass) becomes
    ``fp8_matmul_cached_weight(x, w, *casts, recipe)``, its weight's four cast tensors new
    inputs (appended after ``last``; one set per (weight, views, recipe), shared by the matmuls
    that read the same operand). Raises if a weight operand is not a constant view of an fp32
    parameter (the backend then compiles the graph uncached and says so)."""
    shared: dict[tuple[Any, ...], list[torch.fx.Node]] = {}
    for node in [n for n in graph.nodes if n.op == "call_function" and n.target in _UNCACHED]:
        x, w, *rest = node.args
        nvfp4 = Nvfp4Options(*rest) if node.target is nvfp4_linear_flags else None
        recipe = Fp8Recipe.NVFP4 if nvfp4 is not None else rest[0]
        found = _weight_operand(w, position, example_inputs)
        if found is None:
            raise ValueError(
                f"the weight operand of fp8 matmul {node.name} ({w}) is not a view of an fp32 "
                f"parameter with constant arguments: its fp8 casts cannot be cached"
            )
        src, views = found
        key = (src, views, recipe, nvfp4)
        if key not in shared:
            weight = _example(example_inputs[position[src]], torch.float32, fake_mode).detach()
            with torch.no_grad(), fake_mode if fake_mode is not None else contextlib.nullcontext():
                examples = weight_casts(Fp8WeightCast(recipe, views, 0).operand(weight), recipe, nvfp4)
            vals = weight_casts(w.meta["val"], recipe, nvfp4) if "val" in w.meta else examples
            new = []
            for part, (example, val) in enumerate(zip(examples, vals, strict=True)):
                with graph.inserting_after(last):
                    ph = graph.placeholder(f"{src.name}_{_FP8_PARTS[part]}_{len(shared)}")
                ph.meta["val"] = val
                ph.meta[meta.WEIGHT_CACHE] = True
                last = ph
                lifted.append(Lifted(position[src], example.dtype, -1, Fp8WeightCast(recipe, views, part, nvfp4)))
                inputs.append(example)
                new.append(ph)
            shared[key] = new
        node.target = _UNCACHED[node.target]
        node.args = (x, w, *shared[key], *rest)
    return last


def _fp32_uses_to_lift(
    placeholders: Sequence[torch.fx.Node],
    example_inputs: Sequence[Any],
    lifted_casts: set[torch.fx.Node],
    cast: set[torch.fx.Node],
    where: dict[torch.fx.Node, int],
) -> dict[torch.fx.Node, list[torch.fx.Node]]:
    """For each trainable fp32 parameter whose gradient contributions the graph would otherwise
    sum out of eager's order (it has a lifted cast here, or two or more fp32 occurrences), its
    fp32 users in graph order."""
    out = {}
    for src, weight in zip(placeholders, example_inputs, strict=True):
        if not (isinstance(weight, torch.nn.Parameter) and weight.dtype == torch.float32 and weight.requires_grad):
            continue
        users = _direct_uses(src, lifted_casts, where)
        if not users:
            continue
        if src in cast or sum(_occurrences(u, src) for u in users) >= 2:
            out[src] = users
    return out
