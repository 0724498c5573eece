"""``numerics="eager"``: inductor configured, for amp_fx's graphs only, to compute what eager autocast computes.

Inductor's defaults differ from eager autocast in three ways (docs/numerics.md lists what was
measured): its CPU reductions accumulate in their own order (norms, softmax, the weight
gradients' sums), its decompositions are not ATen's kernels (``_softmax_backward_data``,
``embedding_dense_backward``, tiny ``mm`` as multiply-and-sum), and fusion keeps low-precision
intermediates in fp32. This mode keeps every op of the joint graph on ATen's own kernel (an extern
call: eager's kernel, eager's strides) except the pointwise ops :func:`fusible` accepts, which
inductor fuses with ``emulate_precision_casts`` (each fused low-precision intermediate rounded as
eager rounds it). The machinery is inductor's own "lite" mode (torch 2.13: ``fallback_by_default``,
``selective_decompose``); amp_fx tags the joint graph's fusible nodes (an inference graph's, which
has no joint graph, in ``inner_compile``) with the ``compile_with_inductor`` annotation lite mode
fuses, and removes any other tag. Where inductor ignores ``emulate_precision_casts`` (a feature
test, :func:`emulates_precision_casts`), nothing is tagged: every op on ATen, said once.

Scope: the config is patched around this graph's ``compile_fx`` only (``config_patches``, and
``torch._functorch.config.patch`` for the tagging pass), so other compiled code in the process
keeps its settings; a marker pass in ``post_grad_custom_post_pass`` (a no-op: post-grad passes are
off in this mode) puts the mode and the fusible set into inductor's cache keys, so an artifact
cached by a default-numerics compile of the same graph is never reused.

    >>> model = amp_fx.compile(torch.nn.Linear(4, 4), dtype="bf16", numerics="eager")  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.fx

from amp_fx._common.downstream import Backend, InductorCompile, resolve_backend
from amp_fx._common.report import Reporter

__all__ = [
    "INDUCTOR_KNOBS",
    "eager_numerics_backend",
    "eager_numerics_compile",
    "emulates_precision_casts",
    "fusible",
    "missing_knobs",
]

log = logging.getLogger(__name__)
log.addHandler(logging.NullHandler())

aten, prims = torch.ops.aten, torch.ops.prims


INDUCTOR_KNOBS: Mapping[str, tuple[object, str]] = {
    # name: (value, why) -- the docs' table (docs/numerics.md) is this mapping.
    "fallback_by_default": (
        True,
        "every op not tagged fusible runs as ATen's kernel: reductions (sum, mean, norms, softmax "
        "and their backwards), matmuls (no tiny-mm decomposition, no templates) keep eager's order",
    ),
    "selective_decompose": (
        True,
        "untagged ops are not decomposed: _softmax_backward_data, embedding_dense_backward, "
        "native_layer_norm, var_mean stay ATen ops",
    ),
    "emulate_precision_casts": (True, "a fused low-precision intermediate is rounded as eager rounds it"),
    "use_pre_grad_passes": (False, "pattern rewrites (inductor's lite mode turns them off)"),
    "use_joint_graph_passes": (False, "joint-graph rewrites and constant folding (lite mode's setting)"),
    "use_post_grad_passes": (
        False,
        "post-grad rewrites: mm decompositions, pattern replacements (lite mode's setting)",
    ),
    "reorder_for_peak_memory": (False, "lite mode's setting"),
    "use_dce": (False, "lite mode's setting"),
    "allow_buffer_reuse": (False, "lite mode's setting"),
}
"""The inductor config this mode patches, each with the reason; lite mode's set plus
``emulate_precision_casts`` (torch 2.13's ``torch._inductor.list_mode_options("lite")``)."""

_REQUIRED = ("fallback_by_default", "selective_decompose")
"""Without these no graph can be made bitwise (torch versions before lite mode). Without a working
``emulate_precision_casts`` (:func:`emulates_precision_casts`) graphs are bitwise unfused."""

_RULE_VERSION = 3
"""Bumped whenever :func:`fusible` changes what it accepts: part of the cache key (:func:`_cache_marker`)."""

_FALLS_BACK_HOPS = ("triton_kernel_wrapper_functional",)
"""Higher-order ops lite mode leaves to their kernel; inductor lowers every other one itself."""


_EXACT_OPS = frozenset(
    getattr(getattr(aten, name), overload)
    for name, overload in [
        *[(op, o) for op in ("add", "sub", "mul") for o in ("Tensor", "Scalar")],
        *[(op, o) for op in ("eq", "ne", "lt", "le", "gt", "ge") for o in ("Tensor", "Scalar")],
        ("neg", "default"),
        ("where", "self"),
        *[(op, "Tensor") for op in ("bitwise_and", "bitwise_or")],
        *[(op, "default") for op in ("bitwise_not", "logical_and", "logical_or", "logical_not")],
    ]
)
"""The pointwise ops inductor fuses: IEEE 754 rounds ``+``, ``-`` and ``*`` exactly (and
comparisons, selections and negation are exact), so inductor's fused value, with each
low-precision result rounded (``emulate_precision_casts``), is ATen's. Left on ATen: every
transcendental (``exp``, ``tanh``, ``erf``, ``sin``, ``rsqrt``, ``pow``...: ATen's vectorized
approximations and inductor's code may differ in the last bit; measured on GPT-2, whose fused
tanh-GELU chain made 22 of 28 gradients differ) and division (inductor may multiply by a
constant's reciprocal). ``aten.clone`` too: fused, inductor picks its output layout itself
and an ATen ``view`` after it fails ('Cannot view a tensor with shape ... and strides ...'),
where eager's ``contiguous()`` gave contiguous strides."""


def fusible(node: torch.fx.Node) -> bool:
    """Whether inductor may fuse this joint-graph node without changing a value: an op of
    :data:`_EXACT_OPS` (all have inductor lowerings) without an inexact scalar, or a dtype-only
    cast (``prims.convert_element_type``, see :func:`_as_convert`)."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return False
    if target is prims.convert_element_type.default:
        return True
    return target in _EXACT_OPS and not _inexact_scalar(node)


_LOW = (torch.bfloat16, torch.float16)


def _inexact_scalar(node: torch.fx.Node) -> bool:
    """A Python float argument of a low-precision op that the low dtype cannot hold exactly
    (``x + 0.3`` on bf16 ``x``). Eager adds the scalar in fp32; fused, inductor does not compute
    the same value (pytorch#136896; measured on ``x + 0.3``), so the op stays on ATen.
    ``x + 0.25`` is fused."""
    args = [*node.args, *node.kwargs.values()]
    low = {
        a.meta["val"].dtype
        for a in args
        if isinstance(a, torch.fx.Node) and isinstance(a.meta.get("val"), torch.Tensor)
    }
    low &= set(_LOW)
    return any(isinstance(a, float) and torch.tensor(a, dtype=dtype).item() != a for a in args for dtype in low)


def _as_convert(node: torch.fx.Node) -> None:
    """``aten._to_copy(x, dtype=d)`` (a cast and nothing else) as ``prims.convert_element_type(x,
    d)``: the op inductor's own decomposition of ``_to_copy`` produces, which it lowers (it has no
    lowering for ``_to_copy``, and a tagged op without one fails: 'both a fallback and a decomp')."""
    if node.target is aten._to_copy.default and len(node.args) == 1 and set(node.kwargs) == {"dtype"}:
        node.target = prims.convert_element_type.default
        node.args, node.kwargs = (node.args[0], node.kwargs["dtype"]), {}


def _tag_fusible(
    gm: torch.fx.GraphModule,
    joint_inputs: Any,
    *,
    then: Callable[..., Any] | None,
    reporter: Reporter,
    fuse: bool = True,
) -> torch.fx.GraphModule:
    """The joint-graph pass (``torch._functorch.config.joint_custom_pass``), and the inference
    graph's: tag each fusible node ``compile_with_inductor`` (none with ``fuse=False``), untag
    every other one, name the higher-order ops inductor will lower itself (not bitwise: said
    once, raised in strict mode)."""
    if then is not None:  # a pass the caller set runs first, as it would without amp_fx
        gm = then(gm, joint_inputs)
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        if isinstance(node.target, torch._ops.HigherOrderOperator) and node.target.name() not in _FALLS_BACK_HOPS:
            _report_lowered(node, reporter)
            continue
        _as_convert(node)
        custom = dict(node.meta.get("custom") or {})
        custom.pop("compile_with_inductor", None)
        if fuse and fusible(node):
            custom["compile_with_inductor"] = "amp_fx numerics=eager"
        node.meta["custom"] = custom
    gm.recompile()
    return gm


def _report_lowered(node: torch.fx.Node, reporter: Reporter) -> None:
    op = node.target.name() if isinstance(node.target, torch._ops.HigherOrderOperator) else str(node.target)
    reporter.did_less(
        ("numerics", "lowered", op),
        f"amp_fx: numerics='eager': inductor lowers the higher-order op {op} (node {node.name}) itself "
        f"(lite mode leaves only ATen ops on their kernels), so this graph may not be bitwise with "
        f"eager autocast. Compile with backend='aot_eager' for eager's numbers on this model.",
    )


def missing_knobs() -> list[str]:
    """The knobs this torch lacks (``torch._inductor.config`` entries, and the functorch joint
    pass). Whether ``emulate_precision_casts`` has an effect where it exists is a feature test
    (:func:`emulates_precision_casts`): torch 2.11's CPU inductor has the knob and ignores it."""
    missing = [name for name in INDUCTOR_KNOBS if not hasattr(torch._inductor.config, name)]
    if not hasattr(torch._functorch.config, "joint_custom_pass"):
        missing.append("torch._functorch.config.joint_custom_pass")
    if not hasattr(torch._inductor.config, "post_grad_custom_post_pass"):
        missing.append("post_grad_custom_post_pass")
    return missing


def _probe(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a * b).float() - 1


@functools.cache
def emulates_precision_casts(device_type: str, *, emulate: bool = True) -> bool:
    """Whether inductor on ``device_type``, with ``emulate_precision_casts=emulate``, rounds a
    fused bf16 intermediate as eager does: ``(a * b).float() - 1`` with ``a = b = 1 + 2**-7`` in
    bf16 is ``2**-6`` in eager (``a * b`` rounded to bf16) and ``2**-6 + 2**-14`` when the product
    stays fp32. Compiled and run once per device type and process (seconds, cold; inductor's
    cache serves later processes); ``emulate=False`` is the negative twin the tests check."""
    from torch._inductor.compile_fx import compile_fx
    from torch.fx.experimental.proxy_tensor import make_fx

    a = torch.full((8,), 1 + 2**-7, dtype=torch.bfloat16, device=device_type)
    patches = {"emulate_precision_casts": emulate} if hasattr(torch._inductor.config, "emulate_precision_casts") else {}
    # outside any compile this graph's compile may be nested in: its own tracing context
    with torch._guards.tracing(None), torch._C._DisableAutocast():
        compiled: Any = compile_fx(make_fx(_probe)(a, a), [a, a], config_patches=patches)
        out = compiled(a, a)
    out = out[0] if isinstance(out, (list, tuple)) else out
    return torch.equal(out, _probe(a, a))


def _fusion_exact(example_inputs: Any, reporter: Reporter) -> bool:
    """Whether this graph's pointwise ops may be fused: only where inductor rounds fused
    low-precision intermediates (:func:`emulates_precision_casts`); where it does not, said once
    per device type naming the knob (strict: raised), and every op runs on ATen."""
    device_type = next((x.device.type for x in example_inputs if isinstance(x, torch.Tensor)), "cpu")
    if emulates_precision_casts(device_type):
        return True
    reporter.did_less(
        ("numerics", "emulate_precision_casts", device_type),
        f"amp_fx: numerics='eager': torch {torch.__version__}'s {device_type} inductor ignores "
        f"emulate_precision_casts (a fused bf16 product stays fp32: checked on (a * b).float() - 1), "
        f"so amp_fx fuses no op in this mode on {device_type}: every op runs as ATen's kernel "
        f"(bitwise with eager autocast, slower than fused). A torch whose inductor honours the knob "
        f"(2.13 on the CPU) fuses the exactly-rounded pointwise ops.",
    )
    return False


@functools.cache
def _cache_marker() -> Any:
    """A no-op post-grad pass whose ``uuid`` names this mode and its fusible rule: inductor's FX and
    AOTAutograd cache keys include it, so a default-numerics artifact is never reused here."""
    from torch._inductor.custom_graph_pass import CustomGraphPass

    class _EagerNumericsKey(CustomGraphPass):
        def __call__(self, graph: torch.fx.Graph) -> None:  # post-grad passes are off in this mode
            return None

        def uuid(self) -> str:
            rule = repr((_RULE_VERSION, sorted(INDUCTOR_KNOBS), sorted(map(str, _EXACT_OPS))))
            return "amp_fx numerics=eager " + hashlib.sha256(rule.encode()).hexdigest()[:16]

    return _EagerNumericsKey()


def eager_numerics_compile(inductor_config: Mapping[str, Any], reporter: Reporter) -> InductorCompile | None:
    """``compile_fx`` with this mode's config, for one compiled model or step, with
    ``compile_fx``'s calling convention (``inner_compile=``: what
    :func:`~amp_fx._common.downstream.with_backward_compile` wraps to announce the backward).

    The fusible nodes are tagged on the joint graph (training) and on the inference graph (no
    backward: AOTAutograd makes no joint graph), the latter in ``inner_compile``. On a torch without
    lite mode's knobs (:data:`_REQUIRED`) no graph can be made bitwise under inductor: amp_fx says
    so once naming the knobs (strict: raises) and returns None (the caller compiles with
    ``aot_eager``, whose numbers are eager's). Without the joint pass hook training graphs run
    every op on ATen (bitwise, unfused): logged."""
    missing = missing_knobs()
    if any(name in missing for name in _REQUIRED):
        reporter.did_less(
            ("numerics", "knobs"),
            f"amp_fx: numerics='eager': torch {torch.__version__}'s inductor has no {', '.join(missing)}; "
            f"amp_fx compiles with backend 'aot_eager' instead (eager's numbers, no fusion). "
            f"torch 2.13 has every knob this mode needs.",
        )
        return None
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner

    overridden = sorted(k for k, v in inductor_config.items() if k in INDUCTOR_KNOBS and v != INDUCTOR_KNOBS[k][0])
    if overridden:
        reporter.did_less(
            ("numerics", "options", tuple(overridden)),
            f"amp_fx: numerics='eager' sets inductor's {', '.join(overridden)} itself "
            f"({', '.join(f'{k}={INDUCTOR_KNOBS[k][0]}' for k in overridden)}); the values passed in "
            f"options= are not used. Drop them, or pass numerics='default' to configure inductor yourself.",
        )
    patches = {**inductor_config, **{name: value for name, (value, _) in INDUCTOR_KNOBS.items() if name not in missing}}
    if "post_grad_custom_post_pass" not in missing:
        patches["post_grad_custom_post_pass"] = _cache_marker()
    joint = "torch._functorch.config.joint_custom_pass" not in missing
    if not joint:
        log.info(
            "numerics='eager': torch %s has no joint_custom_pass: training graphs run every op on ATen, unfused",
            torch.__version__,
        )

    def compile_eager_numerics(
        gm: torch.fx.GraphModule, example_inputs: list[Any], *, inner_compile: Callable[..., Any] = compile_fx_inner
    ) -> Callable[..., Any]:
        fuse = _fusion_exact(example_inputs, reporter)

        def inner(graph: torch.fx.GraphModule, inputs: Any, **kwargs: Any) -> Any:
            if kwargs.get("is_inference"):  # no joint graph was made: tagged here
                graph = _tag_fusible(graph, inputs, then=None, reporter=reporter, fuse=fuse)
            return inner_compile(graph, inputs, **kwargs)

        joint_pass = torch._functorch.config.joint_custom_pass if joint else None
        tag = functools.partial(_tag_fusible, then=joint_pass, reporter=reporter, fuse=fuse)
        with torch._functorch.config.patch(joint_custom_pass=tag) if joint else contextlib.nullcontext():
            # compile_fx is typed with the union of what its export modes return
            return compile_fx(gm, example_inputs, inner_compile=inner, config_patches=patches)  # type: ignore[return-value]

    return compile_eager_numerics


def eager_numerics_backend(inductor_config: Mapping[str, Any], reporter: Reporter) -> Backend:
    """:func:`eager_numerics_compile` as a plain backend: ``aot_eager`` where it returns None."""
    compile_graph = eager_numerics_compile(inductor_config, reporter)
    return compile_graph if compile_graph is not None else resolve_backend("aot_eager")
