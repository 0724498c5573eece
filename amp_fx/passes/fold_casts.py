"""fold_casts: remove casts that change no value, forward or backward.

Assumes: ``meta["val"]`` on every node (as after :mod:`amp_fx.passes.insert_casts`).

Guarantees: every fold is value-preserving for the forward *and* for the gradients autograd will
derive from the graph, so outputs and ``.grad`` are bitwise those of the unfolded graph. Each rule
is a named predicate on one cast node:

* ``noop_cast``: ``_to_copy(x, dtype=x.dtype)`` is ``x``. Not applied when ``x`` is a graph input
  or the cast is a graph output (the copy keeps the output from aliasing an input) or either is
  mutated in place.
* ``exact_round_trip``: ``x(a) -> _to_copy(b) -> _to_copy(a)`` is ``x`` when every value of ``a``
  is exactly representable in ``b`` (``b`` covers ``a``'s eps, max and tiny: bf16->fp32->bf16,
  fp16->fp32->fp16). fp32->bf16->fp32 rounds and never folds.
* ``widen_then_cast``: ``x(a) -> _to_copy(b) -> _to_copy(c)`` is ``_to_copy(x, c)`` when ``b``
  covers ``a``: the first cast is exact, so both paths round the same real number once.

The two chain rules fire only when the middle cast has this cast as its *only* user. With other
users, bypassing the middle would make this branch's gradient add up with theirs in ``a`` instead
of in ``b`` (e.g. in bf16 instead of fp32), which changes the gradient. The same reason keeps
duplicate casts of one tensor apart (no CSE): eager autocast casts activations once per use.

Folded casts are recorded on the surviving node as ``meta[meta.FOLDED]`` (rule names).

Example:
    >>> import torch
    >>> from torch.fx.experimental.proxy_tensor import make_fx
    >>> cast = torch.ops.aten._to_copy.default
    >>> f = lambda x: cast(cast(x * 2, dtype=torch.float32), dtype=torch.bfloat16) + 1
    >>> gm, record = fold_casts(make_fx(f)(torch.ones(3, dtype=torch.bfloat16)))
    >>> dict(record.by_rule)
    {'exact_round_trip': 1}
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.fx

from amp_fx.passes import meta
from amp_fx.passes.fx_edit import arg_node, is_cast

__all__ = ["fold_casts", "FoldRecord", "RULES", "is_pure_cast", "covers"]


@dataclass
class FoldRecord:
    """Casts folded in one graph, by rule."""

    by_rule: Counter[str] = field(default_factory=Counter)

    @property
    def total(self) -> int:
        return sum(self.by_rule.values())


def covers(wide: torch.dtype, narrow: torch.dtype) -> bool:
    """True when every value of float dtype ``narrow`` is exactly representable in ``wide``.

    The wider type needs at least the narrower one's precision (eps), range (max) and smallest
    normal (tiny); then its subnormals are covered too, since they sit below ``narrow.tiny``
    with no more significant bits than ``narrow``'s significand.
    """
    if not (wide.is_floating_point and narrow.is_floating_point):
        return False
    w, n = torch.finfo(wide), torch.finfo(narrow)
    return w.eps <= n.eps and w.max >= n.max and w.tiny <= n.tiny


def is_pure_cast(node: torch.fx.Node) -> bool:
    """A ``_to_copy`` that changes only the dtype (same device and layout, default format)."""
    if not is_cast(node):
        return False
    src = node.args[0].meta.get("val") if isinstance(node.args[0], torch.fx.Node) else None
    out = node.meta.get("val")
    if not isinstance(src, torch.Tensor) or not isinstance(out, torch.Tensor):
        return False
    extra = {k: v for k, v in node.kwargs.items() if k != "dtype" and v is not None}
    allowed = {
        "layout": src.layout,
        "device": src.device,
        "pin_memory": False,
        "non_blocking": False,
        "memory_format": torch.preserve_format,
    }
    return all(k in allowed and v == allowed[k] for k, v in extra.items()) and out.layout == src.layout


def _dtype(node: torch.fx.Node) -> torch.dtype:
    return node.meta["val"].dtype


def _mutated(node: torch.fx.Node) -> bool:
    for user in node.users:
        if isinstance(user.target, torch._ops.OpOverload) and user.target._schema.is_mutable:
            return True
    return False


def _is_output(node: torch.fx.Node) -> bool:
    return any(u.op == "output" for u in node.users)


def noop_cast(node: torch.fx.Node) -> torch.fx.Node | None:
    """Rule ``noop_cast``: returns the node to use instead, or None."""
    src = arg_node(node)  # a pure cast's input is a node (is_pure_cast)
    if _dtype(node) != _dtype(src) or src.op == "placeholder" or _is_output(node):
        return None
    if _mutated(node) or _mutated(src):
        return None
    return src


def _chain(node: torch.fx.Node) -> tuple[torch.fx.Node, torch.fx.Node] | None:
    mid = arg_node(node)  # the rules see only pure casts, whose input is a node
    if not is_pure_cast(mid) or len(mid.users) != 1:
        return None
    src = arg_node(mid)
    if not covers(_dtype(mid), _dtype(src)):
        return None
    return mid, src


def exact_round_trip(node: torch.fx.Node) -> torch.fx.Node | None:
    """Rule ``exact_round_trip``: returns the node to use instead, or None."""
    chain = _chain(node)
    if chain is None:
        return None
    _, src = chain
    if _dtype(src) != _dtype(node) or _is_output(node) and src.op == "placeholder":
        return None
    return src


def widen_then_cast(node: torch.fx.Node) -> torch.fx.Node | None:
    """Rule ``widen_then_cast``: rewires the cast to skip the exact middle cast; returns it."""
    chain = _chain(node)
    if chain is None:
        return None
    _, src = chain
    if _dtype(src) == _dtype(node):
        return None
    node.args = (src,) + tuple(node.args[1:])
    return node


RULES: dict[str, Callable[[torch.fx.Node], torch.fx.Node | None]] = {
    "noop_cast": noop_cast,
    "exact_round_trip": exact_round_trip,
    "widen_then_cast": widen_then_cast,
}


def fold_casts(gm: torch.fx.GraphModule) -> tuple[torch.fx.GraphModule, FoldRecord]:
    """Apply :data:`RULES` until none fires; returns ``gm`` (rewritten in place) and the record."""
    record = FoldRecord()
    changed = True
    while changed:
        changed = False
        for node in list(gm.graph.nodes):
            if not is_pure_cast(node) or node.graph is not gm.graph:
                continue
            for name, rule in RULES.items():
                replacement = rule(node)
                if replacement is None:
                    continue
                record.by_rule[name] += 1
                folded = [*node.meta.get(meta.FOLDED, ()), name]
                if replacement is not node:
                    replacement.meta[meta.FOLDED] = [*replacement.meta.get(meta.FOLDED, ()), *folded]
                    node.replace_all_uses_with(replacement)
                    gm.graph.erase_node(node)
                else:
                    node.meta[meta.FOLDED] = folded
                changed = True
                break
        for node in reversed(list(gm.graph.nodes)):
            if is_pure_cast(node) and not node.users:
                gm.graph.erase_node(node)  # middles of folded chains; casts have no side effects
    gm.graph.lint()
    gm.recompile()
    return gm, record
