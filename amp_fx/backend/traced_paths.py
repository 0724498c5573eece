"""Model code that runs another computation when traced than when it runs eagerly.

Some libraries branch on being traced, or on data a graph cannot read without a guard. The
compiled model is then not the computation eager autocast runs, and no cast policy makes it
bitwise. amp_fx cannot change such code; it finds the known cases in Dynamo's graph and says so
once per compiled model, as for any parity amp_fx cannot give (an ``AmpFxWarning``; an
``AmpFxError`` in strict mode). docs/parity.md, "Models that branch on being compiled", has the
table.

A report must name a difference, not a code path: each case is a predicate over the graph that
holds only where eager's computation is another one.

Known case: transformers' grouped-query attention under sdpa. Traced, transformers cannot read
``position_ids`` to rule out packed sequences, nor the padding mask to see that nothing is padded,
so it builds a mask (``masking_utils.sdpa_mask``); with a mask, sdpa is called without
``enable_gqa`` and key/value heads are repeated in the low dtype (``repeat_kv`` in
``integrations/sdpa_attention.py``). Eager drops the mask only where it is the plain causal
pattern (``_ignore_causal_mask_sdpa``), and then calls sdpa with ``enable_gqa=True`` if the head
size allows (``use_gqa_in_sdpa``): the k/v gradients are summed over the shared heads in another
order. Where the mask is more than causal (a sliding window shorter than the keys, as in Gemma 3;
padding), eager builds it too and both run the same ops: no report.
"""

from __future__ import annotations

import operator
import re
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch.fx import Node

from amp_fx._common.report import Reporter

__all__ = ["report_traced_paths"]

_FRAME = re.compile(r'File "([^"]+)", line \d+, in (\w+)')
_SDPA = torch._C._nn.scaled_dot_product_attention  # torch.nn.functional's is the same object
# use_gqa_in_sdpa (transformers/integrations/sdpa_attention.py): on CPU and CUDA, enable_gqa only
# without a mask and where key and value heads have one size of at most 256.
_GQA_MAX_HEAD_DIM = 256


def _traced_from(node: Node, file: str, function: str) -> bool:
    """Whether ``node`` was traced inside ``function`` of transformers' ``file`` (any frame)."""
    trace = node.meta.get("stack_trace") or ""
    return any(
        path.replace("\\", "/").endswith("transformers/" + file) and fn == function
        for path, fn in _FRAME.findall(trace)
    )


def _arg(node: Node, index: int, name: str) -> object:
    return node.kwargs[name] if name in node.kwargs else node.args[index] if len(node.args) > index else None


def _repeated_kv_sdpa(gm: torch.fx.GraphModule) -> Iterator[tuple[Node, Node]]:
    """(sdpa call, its mask) for each sdpa call whose keys were repeated by ``repeat_kv`` and
    whose mask was built by ``sdpa_mask``: the traced path."""
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target is not _SDPA:
            continue
        key, mask = _arg(node, 1, "key"), _arg(node, 3, "attn_mask")
        if (
            isinstance(key, Node)
            and isinstance(mask, Node)
            and _traced_from(key, "integrations/sdpa_attention.py", "repeat_kv")
            and _built_by(mask, "masking_utils.py", "sdpa_mask")
        ):
            yield node, mask


def _built_by(node: Node, file: str, function: str) -> bool:
    """Whether ``node`` or a node it is computed from was traced inside ``function``."""
    seen: set[Node] = set()
    stack = [node]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        if _traced_from(n, file, function):
            return True
        seen.add(n)
        stack.extend(n.all_input_nodes)
    return False


@dataclass(frozen=True)
class _Folded:
    """What a boolean mask node is known to be without the graph's inputs: its value (``exact``),
    or a mask that allows at least every pair it allows (an upper bound: the factors of an ``and``
    that do not depend on data, such as a sliding window beside a padding mask)."""

    value: torch.Tensor
    exact: bool


# Ops that keep a boolean upper bound an upper bound: they move, broadcast or reshape elements.
_MONOTONE_METHODS = frozenset({"to", "expand", "reshape", "view", "contiguous", "bool"})
_AND = (operator.and_, torch.logical_and, torch.bitwise_and)


def _run(n: Node, args: tuple, kwargs: dict) -> object:
    if n.op == "call_method":
        assert isinstance(n.target, str)  # a call_method node's target is the method's name
        return getattr(args[0], n.target)(*args[1:], **kwargs)
    assert callable(n.target)  # and a call_function node's the function
    return n.target(*args, **kwargs)


def _fold_node(n: Node, known: dict[Node, _Folded | None]) -> _Folded | None:
    """``n`` folded from its inputs' folds (in ``known``): exact if all of them are, an upper
    bound through ``and`` and element-moving ops on a boolean mask, else None."""
    inputs = [known[i] for i in n.all_input_nodes]
    args, kwargs = torch.fx.node.map_arg((n.args, n.kwargs), lambda i: f.value if (f := known[i]) else None)
    if all(f is not None and f.exact for f in inputs):
        out = _run(n, args, kwargs)
        return _Folded(out, exact=True) if isinstance(out, torch.Tensor) else None
    example = n.meta.get("example_value")
    if not isinstance(example, torch.Tensor) or example.dtype != torch.bool:
        return None
    if n.op == "call_function" and n.target in _AND:
        bounds = [a for a in args[:2] if isinstance(a, torch.Tensor)]
        if not bounds:
            return None
        bound = bounds[0] if len(bounds) == 1 else bounds[0] & bounds[1]
        return _Folded(bound.expand(example.shape), exact=False)
    first, rest = n.args[0], [known[i] for i in n.all_input_nodes if i is not n.args[0]]
    if (
        n.op == "call_method"
        and n.target in _MONOTONE_METHODS
        and isinstance(first, Node)
        and known[first] is not None
        and all(f is not None and f.exact for f in rest)
    ):
        out = _run(n, args, kwargs)
        if isinstance(out, torch.Tensor) and out.dtype == torch.bool:
            return _Folded(out, exact=False)
    return None


def _fold(node: Node) -> _Folded | None:
    """``node`` folded without the graph's inputs (see :class:`_Folded`), or None where nothing is
    known. Evaluates the few small ops that build it (``arange`` of static sizes, comparisons)."""
    order: list[Node] = []
    seen: set[Node] = set()
    stack = [node]
    while stack:  # the nodes ``node`` is computed from, inputs before users
        n = stack[-1]
        pending = [i for i in n.all_input_nodes if i not in seen]
        if pending:
            stack.extend(pending)
            continue
        stack.pop()
        if n not in seen:
            seen.add(n)
            order.append(n)
    known: dict[Node, _Folded | None] = {}
    # the model's random numbers must not move: a random op among the folded ones draws from a fork
    cuda = range(torch.cuda.device_count()) if torch.cuda.is_initialized() else []
    with torch._subclasses.fake_tensor.unset_fake_temporarily(), torch.no_grad(), torch.random.fork_rng(devices=cuda):
        for n in order:
            if n.op not in ("call_function", "call_method"):
                known[n] = None  # a graph input or a module's state: data
                continue
            try:
                known[n] = _fold_node(n, known)
            except Exception:  # noqa: BLE001 (an op that does not run outside the trace: nothing known)
                known[n] = None
    return known[node]


def _may_be_plain_causal(mask: _Folded) -> bool:
    """Whether a boolean (batch, heads, q, kv) mask may let query i see exactly the keys j <= i,
    with as many queries as keys or one query (seeing all): where ``_ignore_causal_mask_sdpa``
    drops it. An exact mask must equal that pattern; an upper bound must allow all of it."""
    value = mask.value
    if value.dtype != torch.bool or value.dim() != 4:
        return False
    q, kv = value.shape[-2:]
    if q not in (1, kv):
        return False
    causal = torch.ones(q, kv, dtype=torch.bool, device=value.device).tril(kv - q).expand_as(value)
    return bool(torch.equal(value, causal) if mask.exact else (value | ~causal).all())


def _eager_drops_mask(mask: Node) -> bool:
    """Whether eager transformers, on some inputs this graph runs for, passes no mask where the
    trace passes ``mask``: the mask is (or, beside data such as a padding mask, may be) the plain
    causal pattern. A sliding window shorter than the keys rules it out whatever the data: eager
    builds that mask too (``local_attention_size``)."""
    folded = _fold(mask)
    return folded is None or _may_be_plain_causal(folded)


def _eager_may_enable_gqa(sdpa: Node) -> bool:
    """Whether eager transformers, given no mask, calls this sdpa with ``enable_gqa=True``: key
    and value heads of one size, at most 256 (``use_gqa_in_sdpa`` on CPU and CUDA)."""
    key, value = (_arg(sdpa, i, name) for i, name in ((1, "key"), (2, "value")))
    key, value = (n.meta.get("example_value") if isinstance(n, Node) else None for n in (key, value))
    return key is not None and value is not None and key.shape[-1] == value.shape[-1] <= _GQA_MAX_HEAD_DIM


def _gqa_differs(gm: torch.fx.GraphModule) -> bool:
    """The named predicate of the grouped-query case: some sdpa call repeats k/v under a traced
    mask where eager would call it with ``enable_gqa`` and no mask."""
    drops: dict[Node, bool] = {}  # one mask feeds every layer of its kind: fold it once
    for sdpa, mask in _repeated_kv_sdpa(gm):
        if not _eager_may_enable_gqa(sdpa):
            continue
        if mask not in drops:
            drops[mask] = _eager_drops_mask(mask)
        if drops[mask]:
            return True
    return False


def report_traced_paths(gm: torch.fx.GraphModule, reporter: Reporter) -> None:
    """Report, once per owner, each known traced path in Dynamo's graph ``gm`` that computes
    something else than eager."""
    if _gqa_differs(gm):
        reporter.did_less(
            ("traced_path", "transformers_gqa_sdpa"),
            (
                "amp_fx: this model's grouped-query attention runs another computation compiled than eager: "
                "traced, transformers cannot check position_ids for packed sequences or the padding mask, so it "
                "builds a causal mask and repeats the key/value heads in the low dtype (repeat_kv) before sdpa; "
                "eager, with no padded or packed token, passes no mask and calls sdpa with enable_gqa=True. The "
                "k/v projections' gradients then differ from eager autocast's in the last bits (plain torch.compile "
                "under autocast alike; amp_fx is bitwise with it). Training is unaffected beyond that; for "
                "bitwise parity, attn_implementation='eager' takes one path in both (slower). docs/parity.md, "
                "'Models that branch on being compiled', has the details."
            ),
        )
