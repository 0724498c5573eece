"""insert_casts: apply the autocast policy to a captured ATen graph by inserting explicit casts.

Assumes (what :func:`amp_fx.passes.capture.capture` guarantees): every ``call_function`` node targets an
ATen ``OpOverload`` or a Python callable such as ``operator.getitem``; every node has
``meta["val"]``; placeholders carry ``meta["amp_fx_leaf"]``. The pipeline checks these in strict
mode or with DEBUG logging (``passes/pipeline.py``: ``Stage.requires``).

Guarantees:
    * for each op the policy classifies, the op receives exactly the inputs eager autocast would
      give it: the same ``aten._to_copy(x, dtype=...)`` casts on the same eligible tensors
      (floating point, not float64, on the autocast device), ``dtype=float32`` set on
      ``FP32_SET_OPT_DTYPE`` ops, the dtype-taking overload for ``FP32_APPEND_DTYPE`` ops;
    * a lower-precision cast of an fp32 leaf that requires grad is shared by all its uses, as
      eager autocast's cast cache does, so the uses' gradients add up before the cast back to
      fp32 (``Policy(cast_cache=False)`` turns this off); every other cast is per use;
    * ``torch.autocast`` regions the model opens itself are followed: no cast under
      ``enabled=False``, the region's dtype inside a nested region; their enter/exit calls are
      removed, since the casts they imply are now explicit;
    * an op outside torch's tables with an Autocast kernel of its own (``CastClass.OWN_KERNEL``:
      torchvision's ``roi_align``, ``nms``, ...) gets no cast: it is enclosed in a one-op
      ``torch.autocast`` region (``_enter_autocast``/``_exit_autocast`` nodes, with the dtype in
      force there), so the downstream backend runs that kernel as eager autocast does;
    * a grouped expert GEMM that ``Policy(autocast_experts=True)`` decides (:data:`GROUPED_MM_OPS`)
      runs as one ``aten._grouped_mm`` on operands cast to the autocast dtype: transformers'
      ``grouped_mm_fallback`` node (a per-expert loop behind ``offs.tolist()``, a host sync) is
      retargeted to ``aten._grouped_mm`` (offsets cast to int32, which its kernels take); a
      weight operand that is a transpose/permute of an fp32 parameter is cast before the view
      (the same values and gradients: a view moves elements, it never rounds), so the cast is the
      parameter's shared leaf cast, which the weight cache lifts. Every grouped GEMM's module
      path is recorded (:attr:`InsertRecord.experts`);
    * float64 and non-floating tensors are never cast; casts already in the graph are kept;
      ops that mutate or alias an input are never given a cast copy of that input;
    * ``meta["val"]`` is recomputed in graph order, so every value's recorded dtype is the one it
      has at run time; each op node gets ``meta["amp_fx_decision"]`` (its cast class and the rule
      that chose it) and each inserted cast ``meta["amp_fx_cast"] = "inserted"``,
      ``meta["amp_fx_cast_reason"]`` (the reason of the decision that asked for it) and
      ``meta["amp_fx_cached"]`` (True where the cast is the shared cast of a leaf); values whose
      dtype differs from the one eager autocast gives them are listed in the record (keys:
      :mod:`amp_fx.passes.meta`);
    * the graph lints.

Example (what the pipeline's first two stages do for each Dynamo graph):
    >>> import torch
    >>> from torch._subclasses.fake_tensor import FakeTensorMode
    >>> from amp_fx.passes.capture import capture
    >>> from amp_fx.policy import Policy
    >>> with FakeTensorMode() as mode:
    ...     x, w = torch.empty(2, 4), torch.empty(3, 4)
    ...     gm = capture(torch.nn.functional.linear, [x, w], policy=Policy(), device_type="cpu",
    ...                  dtype=torch.bfloat16, leaf_flags=[False, False])
    ...     gm, record = insert_casts(gm, policy=Policy(), device_type="cpu",
    ...                               dtype=torch.bfloat16, fake_mode=mode)
    >>> linear = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.linear.default)
    >>> record.casts_inserted, linear.meta["val"].dtype, linear.meta["amp_fx_decision"].reason
    (2, torch.bfloat16, 'lower precision fp: aten.linear (default cpu table)')
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx
from torch._dispatch.python import enable_python_dispatcher
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import statically_known_true
from torch.utils._pytree import tree_map

from amp_fx._common.devices import autocast_device_type
from amp_fx._common.dtype_names import dtype_name
from amp_fx._common.op_names import op_label
from amp_fx.errors import AmpFxError
from amp_fx.passes import meta
from amp_fx.passes.capture import eager_autocast, module_stack
from amp_fx.passes.fx_edit import CAST_OP, LAYOUT_VIEWS, add_node, innermost_module, mark_cast, walk_views
from amp_fx.passes.fx_edit import val as _val
from amp_fx.policy import (
    APPEND_DTYPE_REDISPATCH,
    GROUPED_MM_OPS,
    CastClass,
    Decision,
    Policy,
    banned_message,
    default_class,
    op_from_name,
)

__all__ = ["insert_casts", "InsertRecord", "ExpertGemm", "AmpFxError", "graph_device_type"]

_GROUPED_MM = torch.ops.aten._grouped_mm.default
_ENTER = torch.amp.autocast_mode._enter_autocast
_EXIT = torch.amp.autocast_mode._exit_autocast


@dataclass
class InsertRecord:
    """What insert_casts did to one graph."""

    casts_inserted: int = 0
    casts_shared: int = 0
    """Uses served by an existing cached leaf cast (eager autocast's cast cache)."""
    ops_by_class: Counter[str] = field(default_factory=Counter)
    dtype_args_set: int = 0
    autocast_mismatches: list[str] = field(default_factory=list)
    """Nodes whose dtype after the pass differs from eager autocast's (expected only where the
    policy departs from torch's tables)."""
    experts: list[ExpertGemm] = field(default_factory=list)
    """Every grouped expert GEMM of the graph (:data:`GROUPED_MM_OPS`), in graph order."""


@dataclass(frozen=True)
class ExpertGemm:
    """One grouped expert GEMM as insert_casts left it."""

    node: str
    op: str
    """The op the model called ("aten._grouped_mm", "transformers.grouped_mm_fallback")."""
    module: str
    """The innermost module it runs in (qualified path; empty at the top level)."""
    dtype: torch.dtype | None
    """The dtype it computes in (its first operand's), None where that is not floating point."""
    lowered: bool
    """Whether ``Policy(autocast_experts=True)`` moved it to the autocast dtype."""


def _eligible(val: Any, device_type: str) -> bool:
    """at::autocast::is_eligible: defined, floating point, not float64, on the autocast device."""
    return (
        isinstance(val, torch.Tensor)
        and val.is_floating_point()
        and val.dtype is not torch.float64
        and val.device.type == device_type
    )


def _touches_alias(op: torch._ops.OpOverload) -> bool:
    return any(a.alias_info is not None for a in op._schema.arguments)


class _CastInserter:
    def __init__(
        self, gm: torch.fx.GraphModule, policy: Policy, device_type: str, dtype: torch.dtype, fake_mode: FakeTensorMode
    ) -> None:
        self.gm = gm
        self.graph = gm.graph
        self.policy = policy
        self.device_type = device_type
        self.lower = dtype
        # (enabled, dtype) of the torch.autocast regions the model opens itself, innermost last.
        self.regions: list[tuple[bool, torch.dtype]] = [(True, dtype)]
        self.fake_mode = fake_mode
        self.cache: dict[tuple[torch.fx.Node, torch.dtype], torch.fx.Node] = {}
        self.record = InsertRecord()

    def cast(self, arg: torch.fx.Node, to: torch.dtype, before: torch.fx.Node, why: str) -> torch.fx.Node:
        """at::autocast::cached_cast for one tensor-valued node (eligibility checked by caller)."""
        val = _val(arg)
        cacheable = (
            self.policy.cast_cache
            and to == self.lower
            and val.dtype == torch.float32
            and arg.op == "placeholder"
            and arg.meta.get(meta.LEAF, False)
        )
        if cacheable and (arg, to) in self.cache:
            self.record.casts_shared += 1
            return self.cache[arg, to]
        node = mark_cast(
            add_node(
                self.graph,
                CAST_OP,
                (arg,),
                {"dtype": to},
                fake_mode=self.fake_mode,
                stack=before.meta.get("nn_module_stack", {}),
                before=before,
            ),
            why,
            cached=cacheable,
        )
        self.record.casts_inserted += 1
        if cacheable:
            self.cache[arg, to] = node
        return node

    def cast_args(self, node: torch.fx.Node, to_type_of: Any, why: str, *, through_views: bool = False) -> None:
        """Cast every eligible tensor argument (in lists too) whose dtype differs from the target;
        ``through_views``: a view of a leaf gets the leaf's cast, viewed (:meth:`cast_through_views`)."""

        def visit(a: Any) -> Any:
            if isinstance(a, torch.fx.Node):
                v = _val(a)
                if _eligible(v, self.device_type):
                    to = to_type_of(v)
                    if v.dtype != to:
                        viewed = self.cast_through_views(a, to, node, why) if through_views else None
                        return viewed if viewed is not None else self.cast(a, to, node, why)
            return a

        node.args = tuple(_map_nodes(visit, a) for a in node.args)
        node.kwargs = {k: _map_nodes(visit, v) for k, v in node.kwargs.items()}

    def promote_type(self, node: torch.fx.Node) -> torch.dtype:
        """at::autocast::promote_type: float32 wins over the lower dtype; float64 is ignored."""
        current = self.lower
        for a in node.all_input_nodes:
            v = _val(a)
            if not _eligible(v, self.device_type):
                continue
            if current == torch.float32 or v.dtype == torch.float32:
                current = torch.float32
            elif v.dtype != self.lower:
                raise AmpFxError(
                    f"amp_fx: {node.format_node()} mixes {v.dtype} with {self.lower} autocast; "
                    "eager autocast raises 'Unexpected floating ScalarType in "
                    "at::autocast::prioritize' here too"
                )
        return current

    def apply(self, node: torch.fx.Node, op: torch._ops.OpOverload, decision: Decision) -> None:
        """Carry out ``decision`` on ``node``, a call of ``op``."""
        cls = decision.cast_class
        if cls is CastClass.LOWER_PRECISION_FP and self.policy.lowers_experts(op.name()):
            self.lower_grouped(node, op, decision.reason)
        elif cls is CastClass.LOWER_PRECISION_FP:
            self.cast_args(node, lambda v: self.lower, decision.reason)
        elif cls is CastClass.FP32:
            self.cast_args(node, lambda v: torch.float32, decision.reason)
        elif cls is CastClass.PROMOTE:
            to = self.promote_type(node)
            self.cast_args(node, lambda v: to, decision.reason)
        elif cls is CastClass.FP32_SET_OPT_DTYPE:
            self.set_opt_dtype(node, op)
        elif cls is CastClass.FP32_APPEND_DTYPE:
            self.append_dtype(node, op)
        elif cls is CastClass.OWN_KERNEL:
            self.own_region(node)
        elif cls is CastClass.BANNED:
            raise AmpFxError(f"{banned_message(op.name(), self.policy, self.device_type)} (at {node.format_node()})")

    def lower_grouped(self, node: torch.fx.Node, op: torch._ops.OpOverload, why: str) -> None:
        """A grouped expert GEMM (``node``, a call of ``op``) in the autocast dtype, as one
        ``aten._grouped_mm`` (module doc)."""
        if op is not _GROUPED_MM:  # transformers::grouped_mm_fallback(input, weight, offs)
            schema = op._schema
            given = dict(zip((a.name for a in schema.arguments), node.args, strict=False)) | dict(node.kwargs)
            offs = given["offs"]
            if _val(offs).dtype != torch.int32:
                offs = mark_cast(
                    add_node(
                        self.graph,
                        CAST_OP,
                        (offs,),
                        {"dtype": torch.int32},
                        fake_mode=self.fake_mode,
                        stack=node.meta.get("nn_module_stack", {}),
                        before=node,
                    ),
                    f"{why}: aten._grouped_mm takes int32 offsets",
                )
            node.target = _GROUPED_MM
            node.args, node.kwargs = (given["input"], given["weight"], offs), {}
        self.cast_args(node, lambda v: self.lower, why, through_views=True)

    def cast_through_views(
        self, arg: torch.fx.Node, to: torch.dtype, before: torch.fx.Node, why: str
    ) -> torch.fx.Node | None:
        """``arg``, a chain of layout views of an fp32 leaf, rebuilt on the leaf's (shared) cast;
        None when ``arg`` is not such a chain."""
        src, views = walk_views(arg, LAYOUT_VIEWS, stop=lambda v: any(isinstance(a, torch.fx.Node) for a in v.args[1:]))
        if not views or src.op != "placeholder":
            return None
        node = self.cast(src, to, before, why)
        for view in reversed(views):
            node = add_node(
                self.graph,
                view.target,
                (node, *view.args[1:]),
                dict(view.kwargs),
                fake_mode=self.fake_mode,
                stack=view.meta.get("nn_module_stack", {}),
                before=before,
                decision=Decision(
                    CastClass.NONE, f"view of the cast weight ({why}; cast before the view: the same values)"
                ),
            )
        return node

    def own_region(self, node: torch.fx.Node) -> None:
        """Enclose ``node`` in a ``torch.autocast`` region of its own, so that the op's Autocast
        kernel runs when the downstream backend runs (or traces) the graph, as in eager."""
        stack = node.meta.get("nn_module_stack", {})
        with self.graph.inserting_before(node):
            enter = self.graph.call_function(_ENTER, (self.device_type, self.lower, True, None))
        with self.graph.inserting_after(node):
            leave = self.graph.call_function(_EXIT, (enter,))
        for n in (enter, leave):
            n.meta["nn_module_stack"] = stack

    def set_opt_dtype(self, node: torch.fx.Node, op: torch._ops.OpOverload) -> None:
        if not node.args or not _eligible(_val(node.args[0]), self.device_type):
            return
        schema = op._schema
        index, arg = next((i, a) for i, a in enumerate(schema.arguments) if a.name == "dtype")
        given = node.kwargs.get("dtype") if arg.kwarg_only or index >= len(node.args) else node.args[index]
        if given is None:
            if not arg.kwarg_only and index < len(node.args):
                args = list(node.args)
                args[index] = torch.float32
                node.args = tuple(args)
            else:
                node.kwargs = {**node.kwargs, "dtype": torch.float32}
            self.record.dtype_args_set += 1

    def append_dtype(self, node: torch.fx.Node, op: torch._ops.OpOverload) -> None:
        target = op_from_name(APPEND_DTYPE_REDISPATCH[op.name()])
        schema = op._schema
        args = list(node.args)
        for a in schema.arguments[len(args) :]:
            args.append(node.kwargs.get(a.name, a.default_value))
        first = _val(node.args[0])
        out = torch.float32 if _eligible(first, self.device_type) else first.dtype
        node.target = target
        node.args = tuple(args)
        node.kwargs = {"dtype": out}
        self.record.dtype_args_set += 1

    def value(self, arg: Any) -> Any:
        """An argument's run-time stand-in: its fake value, or the submodule a get_attr names."""
        if isinstance(arg, torch.fx.Node) and arg.op == "get_attr" and isinstance(arg.target, str):
            return getattr(self.gm, arg.target)  # a get_attr's target is always the attribute's name
        return _val(arg)

    def refresh_val(self, node: torch.fx.Node) -> None:
        """Recompute meta["val"] from the (possibly recast) inputs, as the op will run."""
        args = tree_map(self.value, node.args)
        kwargs = tree_map(self.value, node.kwargs)
        region = eager_autocast(self.device_type, self.lower) if _own_kernel(node) else contextlib.nullcontext()
        # Under the Python dispatcher, as capture's make_fx computed the value first: composite ops
        # (aten.linear, aten.matmul) then run their Python decompositions, which take symbolic
        # sizes. Without it they run torch's C++ kernels, and torch 2.11's matmul calls numel() on
        # a 3-d input with a symbolic batch ("Cannot call numel() on tensor with symbolic sizes",
        # at a bias-free linear once Dynamo recompiles with dynamic shapes); 2.13's does not.
        target = node.target
        if isinstance(target, str):  # only call_function nodes are visited; their target is callable
            raise TypeError(f"amp_fx: cannot recompute the value of {node.format_node()}")
        with self.fake_mode, region, enable_python_dispatcher():
            node.meta["val"] = val = target(*args, **kwargs)
        expected = node.meta.get(meta.AUTOCAST_DTYPE)
        if expected is not None and isinstance(val, torch.Tensor) and val.dtype != expected:
            self.record.autocast_mismatches.append(
                f"{node.name}: {dtype_name(val.dtype)} (eager autocast: {dtype_name(expected)})"
            )

    def enter_region(self, node: torch.fx.Node) -> None:
        """A ``torch.autocast`` region the model opens: (device_type, dtype, enabled, cache)."""
        device_type, dtype, enabled = node.args[:3]
        enabled_now, dtype_now = self.regions[-1]
        if device_type == self.device_type:
            self.regions.append((bool(enabled), dtype if isinstance(dtype, torch.dtype) else dtype_now))
        else:
            self.regions.append((enabled_now, dtype_now))
        self.lower = self.regions[-1][1]

    def exit_region(self) -> None:
        self.regions.pop()
        self.lower = self.regions[-1][1]

    def run(self) -> InsertRecord:
        region_nodes = []
        # Values whose metadata differs from what capture recorded. Capture computed every value
        # with eager autocast on, so only three kinds of node can change: ops eager autocast
        # handles itself (its kernel cast internally, the policy may not), ops this pass rewrote,
        # and their dependents. Re-propagating only those saves most of the fake-tensor work.
        changed: set[torch.fx.Node] = set()
        for node in list(self.graph.nodes):
            if node.op != "call_function":
                continue
            if node.target is _ENTER:
                self.enter_region(node)
                region_nodes.append(node)
                continue
            if node.target is _EXIT:
                self.exit_region()
                region_nodes.append(node)
                continue
            # an unexpected exception propagates as it is: the pipeline's StageFailure names this
            # node (read off the traceback) and the graph falls back (amp_fx/passes/pipeline.py)
            self.visit(node, changed)
        # The regions' casts are explicit now; left in, the downstream backend would apply
        # autocast inside them a second time.
        for node in reversed(region_nodes):
            self.graph.erase_node(node)
        self.graph.lint()
        self.gm.recompile()
        return self.record

    def visit(self, node: torch.fx.Node, changed: set[torch.fx.Node]) -> None:
        """Decide and apply one op's casts; re-propagate its value if it can have changed."""
        call = (node.target, node.args, dict(node.kwargs))
        if isinstance(op := node.target, torch._ops.OpOverload):
            decision = self.decide(node, op)
            node.meta[meta.DECISION] = decision
            self.record.ops_by_class[decision.cast_class.value] += 1
            self.apply(node, op, decision)
        rewritten = call != (node.target, node.args, dict(node.kwargs))
        if isinstance(call[0], torch._ops.OpOverload) and call[0].name() in GROUPED_MM_OPS:
            self.record_expert(node, call[0])
        autocast_op = (
            isinstance(call[0], torch._ops.OpOverload)
            and default_class(call[0].name(), self.device_type) is not CastClass.NONE
        )
        inputs_changed = any(a in changed for a in node.all_input_nodes)
        if _own_kernel(node) and not rewritten and not inputs_changed and len(self.regions) == 1:
            # Capture computed this value under the same autocast state; recomputing it would give
            # an op with a data-dependent size (nms) a fresh unbacked size of its own.
            return
        if rewritten or autocast_op or inputs_changed:
            before = node.meta.get("val")
            self.refresh_val(node)
            if not _same_meta(before, node.meta["val"]):
                changed.add(node)

    def record_expert(self, node: torch.fx.Node, called: torch._ops.OpOverload) -> None:
        first = _val(node.args[0]) if node.args else None
        self.record.experts.append(
            ExpertGemm(
                node=node.name,
                op=op_label(called),
                module=innermost_module(node),
                dtype=first.dtype if isinstance(first, torch.Tensor) and first.is_floating_point() else None,
                lowered=node.target is _GROUPED_MM
                and self.policy.lowers_experts(called.name())
                and node.meta[meta.DECISION].cast_class is CastClass.LOWER_PRECISION_FP,
            )
        )

    def decide(self, node: torch.fx.Node, op: torch._ops.OpOverload) -> Decision:
        """The decision for ``node``, a call of ``op``."""
        if node.meta.get(meta.CAST) == meta.CAST_INSERTED:
            return Decision(CastClass.NONE, "cast inserted by amp_fx")
        enabled, dtype = self.regions[-1]
        if not enabled:
            return Decision(CastClass.NONE, "not autocast: torch.autocast(enabled=False) in the model covers this op")
        decision = self.policy.classify(op, self.device_type, module_stack(node))
        if self.policy.lowers_experts(op.name()) and self.lower != torch.bfloat16:
            # torch's meta kernel of aten._grouped_mm (what compiles it) takes bf16 operands only
            return Decision(
                CastClass.NONE,
                f"not autocast: {op_label(op)} stays in its "
                f"inputs' dtypes: Policy(autocast_experts=True) runs grouped "
                f"GEMMs in bf16 only (aten._grouped_mm compiles for bf16 only), "
                f"not {dtype_name(self.lower)}",
            )
        if len(self.regions) > 1 and decision.cast_class is not CastClass.NONE:
            decision = dataclasses.replace(
                decision, reason=f"{decision.reason}, in the model's torch.autocast region ({dtype_name(dtype)})"
            )
        if decision.kept_module is not None:
            # A kept module runs its compute in fp32; views and in-place ops keep their inputs,
            # since a cast copy would break aliasing (a mutation would land on the copy).
            if _touches_alias(op) or not any(_eligible(_val(a), self.device_type) for a in node.all_input_nodes):
                return Decision(
                    CastClass.NONE, decision.reason + "; view/in-place op left as is", kept_module=decision.kept_module
                )
        return decision


def _own_kernel(node: torch.fx.Node) -> bool:
    """Whether the pass decided ``node`` runs its own Autocast kernel (``CastClass.OWN_KERNEL``)."""
    decision = node.meta.get(meta.DECISION)
    return decision is not None and decision.cast_class is CastClass.OWN_KERNEL


def _same_meta(a: Any, b: Any) -> bool:
    """Same dtype, shape and strides for every tensor in two (possibly nested) values."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.dtype == b.dtype and _same_sizes(a.shape, b.shape) and _same_sizes(a.stride(), b.stride())
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same_meta(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and not isinstance(a, torch.Tensor)


def _same_sizes(a: Sequence[Any], b: Sequence[Any]) -> bool:
    """Equal sizes, without guarding: two data-dependent sizes (two unbacked symbols, as an op
    like nms gives each time its value is recomputed) count as different."""
    return len(a) == len(b) and all(statically_known_true(x == y) for x, y in zip(a, b))


def _map_nodes(fn: Any, a: Any) -> Any:
    if isinstance(a, (list, tuple)):
        return type(a)(_map_nodes(fn, x) for x in a)
    return fn(a)


def insert_casts(
    gm: torch.fx.GraphModule,
    *,
    policy: Policy,
    device_type: str,
    dtype: torch.dtype,
    fake_mode: FakeTensorMode,
) -> tuple[torch.fx.GraphModule, InsertRecord]:
    """Rewrite ``gm`` in place (contract in the module doc); returns it and what was done."""
    return gm, _CastInserter(gm, policy, device_type, dtype, fake_mode).run()


def graph_device_type(vals: Sequence[Any]) -> str:
    """The autocast device type for a graph (the rule in :func:`amp_fx._common.devices.autocast_device_type`)."""
    return autocast_device_type(vals)
