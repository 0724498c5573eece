"""Capture: turn a graph Dynamo hands us into the ATen-level graph eager autocast would see.

Why a pre-dispatch ATen graph and not Dynamo's torch-level graph: eager autocast decides at the
``Autocast`` dispatch key, which sits above autograd and above the decomposition of
CompositeImplicitAutograd ops. It sees ``aten::linear`` (and casts there), but it never sees
``torch.einsum``: einsum has no autocast kernel, so it decomposes at the autograd key into
``aten::bmm``, which autocast then casts. A torch-level graph would need a hand-written map from
every torch function, method and alias onto those ATen names, and would still miss the
decompositions. Tracing with ``make_fx(pre_dispatch=True)`` records ops at the ``PreDispatch`` key,
above both, and a decomposition table that expands exactly the composite ops the policy does not
claim reproduces what the dispatcher does under autocast: ``linear`` stays ``linear``,
``einsum`` becomes ``bmm``, ``layer_norm`` on CPU becomes ``native_layer_norm``.

Four constructs need more than that, each explained where it is handled: activation-checkpointed
regions are inlined and tagged for recomputation, other higher-order ops (custom
``autograd.Function``s, ``torch.cond``, ``scan``) stay whole and run under eager autocast, so do
the regions of functorch transforms that Dynamo inlines (``torch.vmap``, which
``associative_scan(combine_mode="generic")`` uses, ``torch.func.grad``, ``jvp``), and CPU dropout
takes its mask from ``native_dropout`` so the mask survives AOTAutograd's functionalisation.

Contract of :func:`capture`:
    input: a callable (usually Dynamo's ``GraphModule``) and fake example inputs;
    output: a ``GraphModule`` of ATen ``OpOverload`` calls, traced with eager autocast's dtypes
    (see the comment in :func:`capture`) but holding no autocast cast. Every node has
    ``meta["val"]``; op nodes keep ``meta["nn_module_stack"]`` from Dynamo's nodes; tensor nodes
    have ``meta["amp_fx_autocast_dtype"]`` (the dtype eager autocast gives the value); and
    placeholders have ``meta["amp_fx_leaf"]``, True where the tensor is a leaf that requires grad
    (eager autocast's cast cache applies to exactly those).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any, cast

import torch
import torch.fx
import torch.fx.traceback as fx_traceback
from torch.fx.experimental.proxy_tensor import (
    ProxyTorchDispatchMode,
    PythonKeyTracer,
    disable_proxy_modes_tracing,
    get_proxy_mode,
    make_fx,
    track_tensor_tree,
)
from torch.utils._python_dispatch import autograd_would_have_decomposed
from torch.utils._pytree import tree_flatten, tree_map

from amp_fx._common.compat import current_decomposition_table, dtensor_type
from amp_fx.errors import AmpFxError
from amp_fx.passes import meta
from amp_fx.policy import CastClass, Policy, banned_message, default_class, op_from_name

log = logging.getLogger(__name__)

__all__ = [
    "capture",
    "autocast_hop",
    "autocast_region",
    "dtensor_method",
    "eager_autocast",
    "is_cacheable_leaf",
    "module_path",
    "module_stack",
    "source_name",
    "source_text",
    "data_inputs",
]


def _decompose_like_autograd(op: torch._ops.OpOverload) -> Callable[..., Any]:
    """Run ``op``'s C++ CompositeImplicitAutograd kernel, as eager autograd would.

    Not ``op.decompose``: that prefers a Python kernel registered for the key where there is one
    (torch/_decomp registers several for export), and those can differ from what eager runs.
    ``aten.dropout``'s Python kernel calls ``native_dropout``, whose backward scales the
    gradient by 1/(1-p) in fp32, while eager's C++ kernel multiplies by a mask that holds
    1/(1-p) rounded to the activation's dtype: bf16 gradients then differ.
    """
    key = torch._C.DispatchKey.CompositeImplicitAutograd

    def decomp(*args: Any, **kwargs: Any) -> Any:
        flat, _ = tree_flatten((args, kwargs))
        if not autograd_would_have_decomposed(op, flat):
            return NotImplemented
        return op._op_dk(key, *args, **kwargs)

    return decomp


def _refuse_banned(op: torch._ops.OpOverload, policy: Policy, device_type: str) -> Callable[..., Any]:
    message = banned_message(op.name(), policy, device_type)

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AmpFxError(message)

    return refuse


def _record_without_autocast(op: torch._ops.OpOverload) -> Callable[..., Any]:
    """Record ``op`` as one node, its value computed with eager autocast off.

    For ops the policy moved to another class: eager autocast's kernel for them would apply
    torch's class while tracing (and raise, for a banned op the policy allows).
    """

    def record(*args: Any, **kwargs: Any) -> Any:
        table = current_decomposition_table()
        entry = table.pop(op)  # so that calling op below records it instead of recursing here
        try:
            with torch._C._DisableAutocast():
                return op(*args, **kwargs)
        finally:
            table[op] = entry

    return record


@cache
def _decomposition_table(policy: Policy, device_type: str) -> Mapping[Any, Callable[..., Any]]:
    """Composite ops the policy does not claim, decomposed as autograd would (see module doc).

    Banned ops raise here, while tracing: capture runs under eager autocast, whose kernel for a
    banned op would otherwise raise a bare RuntimeError before the pass can name the problem.
    Ops the policy moved away from torch's class are recorded with autocast off.
    """
    claimed = policy.table(device_type)
    table: dict[Any, Callable[..., Any]] = {}
    # Policy.__post_init__ resolves every key of op_classes to an overload name ("aten::linear")
    for name, cls in cast(Mapping[str, CastClass], policy.op_classes).items():
        if cls is not default_class(name, device_type):
            table[op_from_name(name)] = _record_without_autocast(op_from_name(name))
    for name, cls in claimed.items():
        if cls is CastClass.BANNED:
            table[op_from_name(name)] = _refuse_banned(op_from_name(name), policy, device_type)
    for name in torch._C._dispatch_get_registrations_for_dispatch_key("CompositeImplicitAutograd"):
        if name in claimed or not name.startswith("aten::"):
            continue
        packet_name, _, overload = name[len("aten::") :].partition(".")
        try:
            op = getattr(getattr(torch.ops.aten, packet_name), overload or "default")
        except (AttributeError, RuntimeError):
            continue
        table[op] = _decompose_like_autograd(op)
    if torch.ops.aten.dropout.default in table:
        table[torch.ops.aten.dropout.default] = _dropout_like_eager
    for op in _RNN_OPS:
        if op in table:
            table[op] = _rnn_without_cudnn(op)
    return table


# The RNN ops nn.RNN/LSTM/GRU call (``torch._VF``), CompositeImplicitAutograd in ATen.
_RNN_OPS = tuple(
    getattr(getattr(torch.ops.aten, name), overload)
    for name in ("lstm", "gru", "rnn_tanh", "rnn_relu")
    for overload in ("input", "data")
)


def rnn_runs_cudnn(device_type: str) -> bool:
    """Whether eager runs ``nn.LSTM``/``nn.GRU``/``nn.RNN`` on ``device_type`` through cuDNN's
    fused RNN, which capture cannot record (see :func:`_rnn_without_cudnn`)."""
    return device_type == "cuda" and torch.backends.cudnn.enabled and torch.backends.cudnn.is_available()


def _rnn_without_cudnn(op: torch._ops.OpOverload) -> Callable[..., Any]:
    """An RNN op on a device where eager would take cuDNN's path: torch's Python decomposition
    (its cells as linears and pointwise ops), the kernel ``torch.compile`` itself traces there.

    The C++ kernel cannot be recorded on CUDA: it makes the weights one flat cuDNN buffer
    (``Tensor.set_`` on their storage, ``NotImplementedError: argument of type UntypedStorage``,
    seen on an H200), then calls ``_cudnn_rnn``. The decomposition's ops get autocast's casts like
    any others, as under ``torch.compile`` + autocast; eager autocast's cuDNN kernel differs in
    the last bits, and the backend says so once (``amp_fx.backend.audit``, from the nodes marked
    ``meta.RNN_CELLS``). Elsewhere (CPU) the C++ kernel, as eager runs it.
    """
    cxx = _decompose_like_autograd(op)

    def decomp(*args: Any, **kwargs: Any) -> Any:
        first = args[0] if args else None
        if not (isinstance(first, torch.Tensor) and rnn_runs_cudnn(first.device.type)):
            return cxx(*args, **kwargs)
        graph = _proxy_mode().tracer.graph
        before = set(graph.nodes)
        out = op.decompose(*args, **kwargs)
        for node in graph.nodes:
            if node not in before:
                node.meta[meta.RNN_CELLS] = op.name()
        return out

    return decomp


def _proxy_mode() -> ProxyTorchDispatchMode:
    """The proxy mode of the trace in progress (capture's ``make_fx``, which runs the callers)."""
    mode = get_proxy_mode()
    if mode is None:
        raise RuntimeError("amp_fx: called outside the trace of capture's make_fx (no proxy mode)")
    return mode


def _dropout_like_eager(input: torch.Tensor, p: float, train: bool) -> torch.Tensor:
    """``aten.dropout`` with eager's values and gradients, and a mask that survives tracing.

    On CPU, eager's C++ kernel draws ``noise = empty_like(input).bernoulli_(1 - p)``, divides it
    by ``1 - p`` in the input's dtype and returns ``input * noise``. Recorded as is, AOTAutograd
    functionalises ``bernoulli_`` into ``bernoulli``, whose CPU kernel draws a different mask
    when ``input`` is not contiguous (it is, after attention's transposes). ``native_dropout``
    draws the same mask as eager's ``bernoulli_`` and is traced as one op; taking only its mask
    keeps eager's arithmetic, so the gradient is ``grad * noise`` in the input's dtype, as in eager.
    Devices where eager itself calls ``native_dropout`` (CUDA) and the degenerate cases take the
    C++ kernel.
    """
    if input.device.type != "cpu" or not train or not 0 < p < 1 or input.numel() == 0:
        return _decompose_like_autograd(torch.ops.aten.dropout.default)(input, p, train)
    mask = torch.ops.aten.native_dropout.default(input, p, True)[1]
    noise = mask.to(input.dtype).div_(1 - p)
    return input * noise


# Private in torch; present in 2.13 (proxy_tensor.py). Without it, Functions that change the
# autocast state themselves would be recorded with autocast's dtypes (see _record_opaque).
_without_pre_dispatch_function_mode = getattr(
    torch.fx.experimental.proxy_tensor, "_temp_remove_pre_dispatch_torch_function_mode", contextlib.nullcontext
)

_AC_GRAPH_IDS = itertools.count(1_000_000)  # apart from the ids Dynamo's own tracing hands out


def autocast_hop(device_type: str, dtype: torch.dtype, name: str, *args: Any, **kwargs: Any) -> Any:
    """A higher-order op of Dynamo's graph (``torch.ops.higher_order.<name>``), run under eager
    autocast.

    The main case is a custom ``torch.autograd.Function`` (``autograd_function_apply``): in eager,
    the ops of its forward are autocast like any other op, and its backward runs as written. Kept
    whole in the graph (the passes do not see into it), the op keeps its semantics, backward
    included, and this wrapper gives the ops inside it eager autocast's casts when the downstream
    backend traces or runs it.
    """
    with eager_autocast(device_type, dtype):
        return getattr(torch.ops.higher_order, name)(*args, **kwargs)


def _record_opaque(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Record ``fn(*args, **kwargs)`` as one node of the graph being traced, without tracing into
    it; its example outputs are computed with tracing off."""
    tracer = _proxy_mode().tracer
    if not isinstance(tracer, PythonKeyTracer):  # make_fx's tracer; one appending to a graph has no root
        raise RuntimeError(f"amp_fx: cannot record {fn} as one node under {type(tracer).__name__}")
    # Pre-dispatch tracing also intercepts torch.autocast's enter/exit at the torch-function
    # level (recording them instead of running them); the body of a custom Function decorated
    # with custom_fwd(cast_inputs=...) opens torch.autocast(enabled=False), so with that mode
    # left on, its ops would be computed under autocast and its output recorded in the low
    # dtype while it is fp32 at run time.
    with disable_proxy_modes_tracing(), _without_pre_dispatch_function_mode():
        example_out = fn(*args, **kwargs)
    for a in args:
        if isinstance(a, torch.nn.Module):
            tracer.root.register_module(tracer.get_fresh_qualname("amp_fx_body"), a)
    proxy_args = tree_map(tracer.unwrap_proxy, args)
    proxy_kwargs = tree_map(tracer.unwrap_proxy, kwargs)
    out_proxy = tracer.create_proxy("call_function", fn, proxy_args, proxy_kwargs)
    return track_tensor_tree(example_out, out_proxy, constant=None, tracer=tracer)


def autocast_region(device_type: str, dtype: torch.dtype, body: torch.fx.GraphModule, *args: Any) -> tuple[Any, ...]:
    """A functorch transform's region of Dynamo's graph (``body``, see :func:`_transform_regions`),
    run under eager autocast.

    Eager runs a ``torch.vmap``'d function's ops below the batching layer, each cast by eager
    autocast; the downstream backend does the same when it traces or runs this call (AOTAutograd
    traces through the vmap, as it does for ``torch.compile``), so the region keeps eager
    autocast's values and gradients.
    """
    with eager_autocast(device_type, dtype):
        return tuple(body(*args))


# The calls with which Dynamo opens and closes a functorch transform it inlines (torch 2.13:
# torch.vmap -> _vmap_increment_nesting .. _vmap_decrement_nesting, torch.func.grad/vjp ->
# _grad_*, torch.func.jvp -> _jvp_* and the dual level). Both the predispatch wrappers that
# Dynamo records and the C functions they wrap are listed: versions differ in which they record.
def _transform_calls(*names: str) -> frozenset[Any]:
    found = set()
    for module in (torch._C._functorch, getattr(torch._functorch, "predispatch", None), torch._C):
        for name in names:
            fn = getattr(module, name, None) if module is not None else None
            if fn is not None:
                found.add(fn)
    return frozenset(found)


_TRANSFORM_OPEN = _transform_calls(
    "_vmap_increment_nesting", "_grad_increment_nesting", "_jvp_increment_nesting", "_enter_dual_level"
)
_TRANSFORM_CLOSE = _transform_calls(
    "_vmap_decrement_nesting", "_grad_decrement_nesting", "_jvp_decrement_nesting", "_exit_dual_level"
)


@dataclass(frozen=True)
class _Region:
    """A functorch transform's region of Dynamo's graph, cut out as a graph of its own."""

    body: torch.fx.GraphModule
    inputs: tuple[torch.fx.Node, ...]
    """Nodes before the region whose values it reads, in the order of ``body``'s placeholders."""
    outputs: tuple[torch.fx.Node, ...]
    """Nodes of the region read after it, in the order of ``body``'s outputs."""
    nodes: frozenset[torch.fx.Node]


def _transform_regions(gm: torch.fx.GraphModule) -> dict[torch.fx.Node, _Region]:
    """Each outermost functorch transform region of ``gm``, by its opening node.

    Why not trace into it: pre-dispatch tracing records ops at the PreDispatch key, above
    functorch's batching layer, and records ``_add_batch_dim`` and its kin only under
    ``torch.export``. Traced as is, a vmap'd op would be recorded on the batched tensors as
    constants, cut off from the graph's inputs (AOTAutograd then fails on the first of them:
    "NYI: querying is_contiguous inside of vmap"). The region, from the call that opens the
    transform to the call that closes it (nested transforms included), is the unit eager runs.
    """
    regions: dict[torch.fx.Node, _Region] = {}
    depth, start = 0, None
    members: list[torch.fx.Node] = []
    for node in gm.graph.nodes:
        opens = node.op == "call_function" and node.target in _TRANSFORM_OPEN
        closes = node.op == "call_function" and node.target in _TRANSFORM_CLOSE
        if opens:
            if depth == 0:
                start, members = node, []
            depth += 1
        if depth > 0:
            members.append(node)
        if closes and depth > 0:
            depth -= 1
            if depth == 0 and start is not None:  # set when depth left 0
                regions[start] = _cut_region(gm, members)
    return regions


def _cut_region(gm: torch.fx.GraphModule, members: list[torch.fx.Node]) -> _Region:
    inside = set(members)
    inputs = list(dict.fromkeys(a for n in members for a in n.all_input_nodes if a not in inside))
    outputs = [n for n in members if any(u not in inside for u in n.users)]
    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    for a in inputs:
        env[a] = graph.placeholder(a.name)
        env[a].meta = dict(a.meta)
    for n in members:
        env[n] = graph.node_copy(n, lambda a: env[a])
    graph.output(tuple(env[n] for n in outputs))
    return _Region(torch.fx.GraphModule(gm, graph), tuple(inputs), tuple(outputs), frozenset(inside))


# DTensor's own entry and exit points, as Dynamo records them (torch 2.11-2.15: ``from_local`` as a
# call of ``torch.distributed.tensor._api.from_local``, the rest as methods of the DTensor). Each is
# an autograd.Function (``_FromTorchTensor``, ``_ToTorchTensor``, ``Redistribute``) that makes a new
# DTensor wrapper without dispatching an op, so pre-dispatch tracing would neither see its backward
# nor track the DTensor it returns (the next op on it then fails: "Unable to cast NotImplemented to
# Tensor", proxy_call's answer for a tensor subclass it has no proxy for). Recorded whole, as
# Dynamo's graph has them, they keep their semantics; the ATen ops between them are recorded on the
# DTensors and cast like any others, as eager autocast casts them above DTensor's dispatch.
_DTENSOR_METHODS = frozenset({"to_local", "redistribute", "full_tensor"})


def dtensor_method(name: str, tensor: Any, *args: Any, **kwargs: Any) -> Any:
    """``tensor.<name>(*args, **kwargs)``: a DTensor method of :data:`_DTENSOR_METHODS` as a node of
    the captured graph (a function, since the passes take only functions and ATen ops)."""
    return getattr(tensor, name)(*args, **kwargs)


@cache
def _dtensor_boundary_functions() -> frozenset[Any]:
    dtensor = dtensor_type()
    if dtensor is None:
        return frozenset()
    from torch.distributed.tensor import _api

    # torch 2.13 also has a module-level alias, which Dynamo records; 2.11 records the method
    return frozenset(f for f in (dtensor.from_local, getattr(_api, "from_local", None)) if f is not None)


class _InliningInterpreter(torch.fx.Interpreter):
    """Runs Dynamo's graph, inlining activation-checkpointed regions.

    Pre-dispatch tracing of ``tag_activation_checkpoint`` would keep the region as a subgraph the
    passes cannot see into (and, in torch 2.13, fails outright for plain checkpointing). Inlined,
    its ops are cast like any other; their nodes carry ``meta["recompute"]`` and
    ``meta["ac_graph_id"]``, the tags AOTAutograd's partitioner reads to recompute them in the
    backward instead of saving them, which is what the higher-order op itself would produce.
    A selective-checkpointing policy (``context_fn``) is not reproduced: the whole region is
    marked PREFER_RECOMPUTE (same values, possibly more recomputation).

    Other higher-order ops are kept whole, as :func:`autocast_hop` nodes. Custom
    ``torch.autograd.Function``s must be: pre-dispatch tracing would record only their forward,
    under no_grad, and silently drop their backward. Regions of functorch transforms are kept
    whole too, as :func:`autocast_region` nodes (see :func:`_transform_regions`).
    """

    def __init__(self, gm: torch.fx.GraphModule, device_type: str, dtype: torch.dtype) -> None:
        super().__init__(gm)
        self.device_type = device_type
        self.dtype = dtype
        self.regions = _transform_regions(gm)
        self.in_region = frozenset(n for r in self.regions.values() for n in r.nodes)
        self.region_values: dict[torch.fx.Node, Any] = {}

    def run_node(self, n: torch.fx.Node) -> Any:
        region = self.regions.get(n)
        if region is not None:
            log.info(
                "amp_fx: a functorch transform region (%s) stays whole; its ops are cast by eager autocast",
                getattr(n.target, "__name__", n.target),
            )
            with self._set_current_node(n):
                values = _record_opaque(
                    autocast_region,
                    (self.device_type, self.dtype, region.body, *(self.env[a] for a in region.inputs)),
                    {},
                )
            self.region_values.update(zip(region.outputs, values, strict=True))
        if n in self.in_region:
            return self.region_values.pop(n, None)
        return super().run_node(n)

    def call_function(self, target: Any, args: Any, kwargs: Any) -> Any:
        if target is torch.ops.higher_order.tag_activation_checkpoint:
            from torch.utils.checkpoint import CheckpointPolicy

            body, *inputs = args
            graph_id = next(_AC_GRAPH_IDS)
            for node in body.graph.nodes:
                node.meta["recompute"] = CheckpointPolicy.PREFER_RECOMPUTE
                node.meta["ac_graph_id"] = graph_id
            return _InliningInterpreter(body, self.device_type, self.dtype).run(*inputs)
        if isinstance(target, torch._ops.HigherOrderOperator):
            log.info("amp_fx: %s stays whole; its ops are cast by eager autocast", target.name())
            return _record_opaque(autocast_hop, (self.device_type, self.dtype, target.name(), *args), kwargs)
        if target in _dtensor_boundary_functions():
            return _record_opaque(target, args, kwargs)
        return super().call_function(target, args, kwargs)

    def call_method(self, target: Any, args: Any, kwargs: Any) -> Any:
        dtensor = dtensor_type()
        if dtensor is not None and isinstance(args[0], dtensor) and target in _DTENSOR_METHODS:
            return _record_opaque(dtensor_method, (target, *args), kwargs)
        return super().call_method(target, args, kwargs)


@contextlib.contextmanager
def eager_autocast(device_type: str, dtype: torch.dtype) -> Iterator[None]:
    """Turn on eager autocast's kernels for ``device_type``, fake CUDA tensors included.

    ``torch.autocast("cuda")`` disables itself on a machine without CUDA; the thread-local
    switches underneath it do not, and under FakeTensorMode they apply to fake CUDA tensors.
    """
    was_enabled = torch.is_autocast_enabled(device_type)
    was_dtype = torch.get_autocast_dtype(device_type)
    torch.set_autocast_enabled(device_type, True)
    torch.set_autocast_dtype(device_type, dtype)
    torch.autocast_increment_nesting()
    try:
        yield
    finally:
        if torch.autocast_decrement_nesting() == 0:
            torch.clear_autocast_cache()
        torch.set_autocast_enabled(device_type, was_enabled)
        torch.set_autocast_dtype(device_type, was_dtype)


def capture(
    fn: Callable[..., Any],
    fake_args: Sequence[Any],
    *,
    policy: Policy,
    device_type: str,
    dtype: torch.dtype,
    leaf_flags: Sequence[bool],
) -> torch.fx.GraphModule:
    """Trace ``fn`` on ``fake_args`` into a pre-dispatch ATen graph (contract in the module doc)."""
    decompositions = _decomposition_table(policy, device_type)

    def run(*args: Any) -> Any:
        if isinstance(fn, torch.fx.GraphModule):
            with fx_traceback.preserve_node_meta():
                return _InliningInterpreter(fn, device_type, dtype).run(*args)
        return fn(*args)

    # Ops are recorded at PreDispatch, above the Autocast key, so no cast lands in the graph;
    # but their values are computed below it, with eager autocast on. Code that depends on a
    # dtype (``x.float()`` is a copy only if x is not fp32 already; decompositions that branch
    # on dtype) is therefore traced for the dtypes the tensors will have once casts are in.
    try:
        with eager_autocast(device_type, dtype):
            gm = make_fx(run, pre_dispatch=True, decomposition_table=decompositions)(*fake_args)
    except RuntimeError as e:
        if "at::autocast" not in str(e):
            raise
        raise AmpFxError(f"amp_fx: eager autocast refuses an op of this graph, and so does amp_fx: {e}") from e
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor):
            node.meta[meta.AUTOCAST_DTYPE] = val.dtype
    for node, is_leaf in zip(gm.graph.find_nodes(op="placeholder"), leaf_flags, strict=True):
        node.meta[meta.LEAF] = is_leaf
    return gm


def is_cacheable_leaf(t: object) -> bool:
    """Eager autocast's cast cache condition, minus the dtype test done at cast time."""
    return isinstance(t, torch.Tensor) and t.requires_grad and t.is_leaf and not t._is_view()


_GETATTR = re.compile(r"getattr\((.*), '([^']*)'\)")


def module_path(source: str) -> str:
    """Normalise Dynamo's module source name (``L['self'].layers[0]``) to ``layers.0``.

    Dynamo sometimes names submodules through the instance dict (diffusers' UNet2DModel, torch 2.13:
    ``L['self'].__dict__['_modules']['down_blocks'].0``); that step is dropped, so the path is
    ``down_blocks.0``, as ``named_modules`` names it."""
    while True:
        m = _GETATTR.search(source)
        if m is None:
            break
        source = source[: m.start()] + f"{m.group(1)}.{m.group(2)}" + source[m.end() :]
    source = re.sub(r"^[LG]\['[^']*'\]", "", source)
    source = re.sub(r"\.__dict__\['(_modules|_parameters|_buffers)'\]", r".\1", source)
    source = re.sub(r"\._modules\['([^']*)'\]", r".\1", source)
    source = re.sub(r"\[['\"]?([^'\"\]]*)['\"]?\]", r".\1", source)
    return ".".join(p for p in source.split(".") if p)


MODULE_STATE_SOURCES = ("L['self']", "L['fn']", "G['")
"""Dynamo source prefixes of module state: the frame's module (``self``, or ``fn`` when Dynamo
enters through ``nn.Module.__call__``) and globals."""


def source_text(node: torch.fx.Node) -> str:
    """Dynamo's name for where a graph input comes from (``L['self'].fc._parameters['weight']``);
    empty when it has none."""
    source = getattr(node, "_dynamo_source", None)
    if source is None:
        return ""
    try:
        name = source.name
        return name() if callable(name) else str(name)
    except Exception:  # a source kind without a printable name
        return ""


def source_name(node: torch.fx.Node) -> str:
    """A placeholder's name under the frame's module from its Dynamo source
    (``L['self'].fc._parameters['weight']`` -> ``fc.weight``); the node's name without one."""
    text = source_text(node)
    if not text:
        return node.name
    return ".".join(p for p in module_path(text).split(".") if p not in ("_parameters", "_buffers"))


def data_inputs(
    gm: torch.fx.GraphModule,
    example_inputs: Sequence[Any],
    is_state: Callable[[torch.fx.Node, Any], bool] | None = None,
) -> list[bool]:
    """Per placeholder of a Dynamo graph: True for a floating tensor the caller handed in (``L['x']``,
    ``L['args'][0]``, or a value a frame resumed after a graph break carries over), False for module
    state (parameters, buffers, globals), leaves that require grad, and inputs without a source.

    ``is_state(node, value)``: True for a tensor of the compiled root module, found by identity
    (the backend's): the source's shape alone cannot tell, since a decorator on ``forward`` makes
    the root ``L['args'][0]`` and its buffers ``L['args'][0].rope.inv_freq``."""
    flags = []
    for node, value in zip(gm.graph.find_nodes(op="placeholder"), example_inputs, strict=True):
        text = source_text(node)
        flags.append(
            bool(text)
            and not text.startswith(MODULE_STATE_SOURCES)
            and isinstance(value, torch.Tensor)
            and value.dtype.is_floating_point
            and not is_cacheable_leaf(value)
            and not (is_state is not None and is_state(node, value))
        )
    return flags


def module_stack(node: torch.fx.Node) -> tuple[tuple[str, type], ...]:
    """The node's enclosing modules, outermost first, as (qualified path, type)."""
    stack = node.meta.get("nn_module_stack") or {}
    out = []
    for value in stack.values():
        source, mtype = value[0], value[1]
        if isinstance(mtype, str):  # some torch versions record the type's name only
            continue
        out.append((module_path(source), mtype))
    return tuple(out)
