"""The ``watch_backward`` pass: the forward watch's device record, for AOTAutograd's backward graph
(``amp_fx.compile(..., watch_nonfinite=True)`` with ``backend="aot_eager"`` or ``"inductor"``).

In fp16 training most skipped steps come from the backward: the scaled loss gradient overflows a
low-precision op (the first steps at a too-high scale, a layer whose gradients grow). The forward
watch (``amp_fx.passes.watch_nonfinite``) cannot see them: AOTAutograd builds the backward graph
from the rewritten forward graph after the backend's pipeline has run. This pass runs on that
backward graph, where the downstream backend compiles it (:func:`watching_downstream` hands the
downstream compile a backward compiler that runs the pass first), with the same rule as the
forward: the first node, in graph order, whose fp16/bf16 output holds an inf/NaN that its inputs do
not explain, recorded on the device as one more int64 output that is stripped before AOTAutograd
sees the gradients. No host read.

Assumes AOTAutograd's backward graph: every node's ``meta["val"]`` is true; the backward nodes
carry ``meta["custom"]["amp_fx_node"]``, the rewritten forward node they differentiate
(:func:`stamp_forward_nodes` writes it on the forward graph before the downstream compile;
AOTAutograd copies ``custom`` onto the nodes it traces for that node, backward included), with
``meta["fwd_nn_module_stack"]`` as a fallback for the module. Inputs are the values the forward saved
(an inf/NaN there is explained, as a forward value) and the incoming gradients (``tangents_*``).

What it records, in this order:

* each floating incoming gradient, checked first (``any(~isfinite(tangent))``): an inf/NaN made
  after the compiled graph (the loss, a cast of the output in eager code) enters the backward
  there, before any op of it could create one. It is named by the forward op whose output it is
  the gradient of (``incoming=True``);
* each watched backward node, named by its own op (``aten.mm``), the forward op it differentiates
  (``grad_of``, ``aten.linear``) and that op's module. Nodes the partitioner recomputes from the
  forward (``partitioner_tag == "is_forward"``) are not watched again: the forward watch saw them.

Guarantees: as the forward pass (values unchanged, no new aliasing, ``meta["val"]`` on every new
node, the graph lints); the backward's outputs as AOTAutograd sees them are unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.fx
from torch._guards import detect_fake_mode

from amp_fx._common.downstream import BACKWARD_BACKENDS, BackwardCompile, with_backward_compile
from amp_fx._common.dtype_names import dtype_name
from amp_fx._common.op_names import op_label
from amp_fx.passes import meta
from amp_fx.passes.capture import module_path
from amp_fx.passes.fx_edit import innermost_module, placeholders
from amp_fx.passes.watch_nonfinite import WatchedOp, WatchRecord, append_first_origin

__all__ = ["watch_backward", "stamp_forward_nodes", "watching_downstream", "FORWARD_NODE", "WATCHABLE"]

FORWARD_NODE = meta.FORWARD_NODE
"""The key in a node's ``meta["custom"]`` that names the rewritten forward node it comes from."""

WATCHABLE = BACKWARD_BACKENDS
"""The downstream backends whose backward graph the pass can reach (named as torch.compile names
them). ``eager`` runs the graph's ops through eager autograd: there is no backward graph."""


def stamp_forward_nodes(gm: torch.fx.GraphModule) -> None:
    """Write each op node's name into its ``meta["custom"]`` (kept beside the user's own entries),
    so that the nodes AOTAutograd traces from it, in the forward and the backward, name it."""
    for node in gm.graph.nodes:
        if node.op == "call_function":
            node.meta["custom"] = {**(node.meta.get("custom") or {}), FORWARD_NODE: node.name}


def watch_backward(
    gm: torch.fx.GraphModule, *, dtype: torch.dtype, forward: torch.fx.GraphModule | None = None
) -> tuple[torch.fx.GraphModule, WatchRecord]:
    """Append the first-origin record to the backward graph ``gm`` (see the module docstring).

    ``forward``: the rewritten forward graph (stamped by :func:`stamp_forward_nodes`), to name
    the forward op and module of each backward node.

    Example (``dtype`` fp16; the record's last entry is the first Linear's backward ``mm``)::

        >>> model = amp_fx.compile(torch.nn.Linear(4, 4), dtype="fp16", backend="aot_eager",
        ...                        watch_nonfinite=True)
        >>> model(torch.randn(2, 4)).float().sum().backward()
        >>> [(o.op, o.grad_of) for o in model.amp_fx_watch.ops[model.amp_fx_watch.backward_key(0)]][-1]
        ('aten.mm', 'aten.linear')
    """
    forward_nodes = {n.name: n for n in forward.graph.nodes} if forward is not None else {}

    def source(node: torch.fx.Node) -> tuple[str, str]:
        """(module, forward op) of the forward node ``node`` was traced for."""
        name = (node.meta.get("custom") or {}).get(FORWARD_NODE)
        fwd = forward_nodes.get(name) if isinstance(name, str) else None
        if fwd is not None:
            return innermost_module(fwd), op_label(fwd.target, packet=True)
        stack = node.meta.get("fwd_nn_module_stack") or node.meta.get("nn_module_stack") or {}
        paths = [v[0] for v in stack.values() if isinstance(v, tuple) and isinstance(v[0], str)]
        return (module_path(paths[-1]) if paths else "", "")

    def describe(node: torch.fx.Node, op: object, dtype: torch.dtype) -> WatchedOp | None:
        if node.meta.get("partitioner_tag") == "is_forward":
            return None  # recomputed from the forward: the forward watch saw this value
        module, grad_of = source(node)
        return WatchedOp(
            module=module, op=op_label(op, packet=True), dtype=dtype_name(dtype), node=node.name, grad_of=grad_of
        )

    entering = []
    for node in placeholders(gm.graph):
        val = node.meta.get("val")
        if not _is_tangent(node) or not isinstance(val, torch.Tensor):
            continue
        if not val.dtype.is_floating_point:
            continue
        user = next((u for u in node.users if (u.meta.get("custom") or {}).get(FORWARD_NODE)), None)
        module, of = source(user) if user is not None else ("", "")
        entering.append(
            (
                node,
                WatchedOp(module=module, op=of, dtype=dtype_name(val.dtype), node=node.name, grad_of=of, incoming=True),
            )
        )
    vals = [n.meta.get("val") for n in placeholders(gm.graph)]
    fake_mode = detect_fake_mode(vals)
    with fake_mode if fake_mode is not None else torch._subclasses.FakeTensorMode(allow_non_fake_inputs=True):
        return append_first_origin(gm, dtype=dtype, data=set(), describe=describe, entering=entering, lowered=True)


def _is_tangent(node: torch.fx.Node) -> bool:
    """AOTAutograd names the backward graph's incoming gradients ``tangents_1``, ``tangents_2``, ..."""
    return isinstance(node.target, str) and node.target.startswith("tangents")


Downstream = Callable[[torch.fx.GraphModule, list[Any]], Callable[..., Any]]
OnBackward = Callable[[WatchRecord], Callable[[torch.Tensor], None]]
"""Called once the backward graph is watched, with its record; returns what each run calls with
its position (int64, -1: none)."""


def watching_downstream(
    backend: str,
    *,
    inductor_config: Mapping[str, Any] | None,
    dtype: torch.dtype,
    forward: torch.fx.GraphModule,
    on_backward: OnBackward,
    around: BackwardCompile | None = None,
) -> Downstream | None:
    """The downstream compile of ``backend`` with the pass on its backward graph, or None where
    the backend has no backward graph amp_fx can reach (``eager``, another name, a callable):
    :func:`amp_fx._common.downstream.with_backward_compile`, with AOTAutograd's cache off for this
    compile, since its entries hold the compiled backward without the wrapper that strips the
    record (inductor's own FX graph cache, keyed on the watched graph, still serves). ``around``:
    what compiles the watched backward graph in turn (the progress lines' timing), if anything."""
    stamp_forward_nodes(forward)

    def watched(gm: torch.fx.GraphModule, example_inputs: Any, compile_graph: Downstream) -> Callable[..., Any]:
        gm, record = watch_backward(gm, dtype=dtype, forward=forward)
        ran = on_backward(record)
        if around is not None:
            return _strip_record(around(gm, example_inputs, compile_graph), ran)
        return _strip_record(compile_graph(gm, example_inputs), ran)

    return with_backward_compile(backend, inductor_config=inductor_config, around=watched, autograd_cache=False)


def _strip_record(compiled: Callable[..., Any], ran: Callable[[torch.Tensor], None]) -> Callable[..., Any]:
    """``compiled`` (boxed: called with one list of arguments, as AOTAutograd calls a backward),
    with its last output, the record, handed to ``ran`` and removed."""

    boxed = getattr(compiled, "_boxed_call", False)

    def run(args: list[Any]) -> Any:
        out = compiled(args) if boxed else compiled(*args)
        ran(out[-1])
        return type(out)(out[:-1]) if isinstance(out, tuple) else list(out[:-1])

    run._boxed_call = True  # type: ignore[attr-defined]
    return run
