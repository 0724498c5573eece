"""amp_fx.explain: what the passes did to each captured graph, node by node.

Everything shown is read from the records the passes leave (``GraphRecord``: the captured graph
before the passes, the rewritten graph, ``meta.DECISION`` on each op,
``meta.CAST`` on inserted casts, ``meta.FOLDED`` on nodes that absorbed
folded casts). Two things are computed here: the "without amp" dtypes of the before view (the
captured graph run on fake tensors without autocast), and, when explain ran the model, the dtypes
each value has at run time (the rewritten graph run on the inputs it was called with), which are
shown instead of ``meta["val"]``'s where the two differ, with a note.

    >>> import torch, amp_fx
    >>> ex = amp_fx.explain(torch.nn.Linear(4, 4), torch.randn(2, 4), dtype="bf16")
    >>> print(ex.summary())          # doctest: +SKIP
    >>> ex.to_svg("linear.svg")      # doctest: +SKIP
"""

from __future__ import annotations

import math
import operator
import textwrap
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.fx
from tabulate import tabulate
from torch._guards import detect_fake_mode

from amp_fx._common.compat import local_tensor
from amp_fx._common.dtype_names import dtype_name
from amp_fx._common.op_names import op_label
from amp_fx._common.report import did_less
from amp_fx.backend.audit import fp32_experts_text, slow_fp8_text
from amp_fx.errors import GraphvizNotFound
from amp_fx.inspect._graphviz import build_dot, write_svg
from amp_fx.inspect._probe import (
    ValueInterpreter,
    clone_inputs,
    describe_value,
    input_labels,
    leaf_flags,
    module_of,
    numel_or_none,
    tensors_of,
    value_dtype,
)
from amp_fx.inspect._runner import (
    Call,
    lent,
    run_amp,
    run_eager_checked,
    split_weight_note,
    weights_split_by_graph_breaks,
)
from amp_fx.low_precision import LowPrecisionLike, one_option
from amp_fx.passes import meta
from amp_fx.passes.fp8_matmuls import Fp8Decision
from amp_fx.passes.fx_edit import is_cast, is_inserted_cast, placeholders
from amp_fx.passes.pipeline import GraphRecord
from amp_fx.policy import CastClass, Policy, resolve_dtype

__all__ = ["explain", "Explanation", "NodeInfo", "GraphvizNotFound"]


@dataclass(frozen=True)
class NodeInfo:
    """One node of an explained graph."""

    graph: int
    name: str
    """The FX node name (the same in the captured and rewritten graphs for op nodes)."""
    kind: str
    """``input``, ``op`` (an ATen op of your program), ``cast`` (inserted by amp_fx or written by
    you), ``getitem`` (an element of a multi-output op), ``constant`` or ``output``."""
    op: str
    args: str
    value: str
    """dtype and shape, e.g. ``bf16[2, 8]``."""
    dtype: torch.dtype | None
    module: str
    """The innermost module the node came from (qualified path), empty for the top level."""
    module_type: str
    rule: str
    """What decided the node's dtype (the passes' recorded reason, e.g. ``lower precision fp:
    aten.linear (default cpu table)``)."""
    cast: str | None = None
    """``"inserted"`` for a cast amp_fx inserted, ``"user"`` for one in your code."""
    cached: bool = False
    """An inserted cast of a leaf weight shared by all its uses (eager autocast's cast cache)."""
    folded: tuple[str, ...] = ()
    """Fold rules whose removed casts this node absorbed."""
    label: str = ""
    """For inputs: what you call it (``fc1.weight``, ``x``)."""
    autocast_dtype: torch.dtype | None = None
    """The dtype eager autocast gives this value, where capture recorded it."""

    @property
    def dtype_name(self) -> str:
        return dtype_name(self.dtype)


def _eligible_dtypes(node: torch.fx.Node) -> list[torch.dtype]:
    out = []
    for a in node.all_input_nodes:
        v = a.meta.get("val")
        if isinstance(v, torch.Tensor) and v.is_floating_point() and v.dtype not in out:
            out.append(v.dtype)
    return out


def _rule(node: torch.fx.Node, labels: dict[str, str]) -> str:
    if node.op == "placeholder":
        return f"graph input {labels.get(node.name, node.name)}"
    if node.op == "get_attr":
        return "constant captured from your code"
    if node.op == "output":
        return "graph output"
    if is_inserted_cast(node):
        why = node.meta.get(meta.CAST_REASON, "?")
        shared = (
            "; cached: one cast of this weight for all its uses, as autocast's cast cache"
            if node.meta.get(meta.CACHED)
            else ""
        )
        return f"inserted for {why}{shared}"
    if node.target is operator.getitem:
        return f"element {node.args[1]} of {node.all_input_nodes[0].name}"  # args[0], the one node
    if node.target is torch.amp.autocast_mode._enter_autocast:
        return f"autocast on for {node.next.name} alone: it runs its own autocast kernel"
    if node.target is torch.amp.autocast_mode._exit_autocast:
        return f"autocast off after {node.prev.name}"
    fp8 = node.meta.get(meta.FP8)
    decision = node.meta.get(meta.DECISION)
    if fp8 is not None:
        return fp8.reason if fp8.converted or decision is None else f"{decision.reason}; {fp8.reason}"
    out = dtype_name(value_dtype(node.meta.get("val")))
    if decision is None:
        return "python op (not a tensor op)" if node.op == "call_function" else ""
    if is_cast(node) and decision.cast_class is CastClass.NONE:
        to = node.kwargs.get("dtype")
        return f"cast in your code (to {dtype_name(to if isinstance(to, torch.dtype) else None)}); not autocast"
    reason = decision.reason
    if decision.cast_class is CastClass.NONE and "not autocast" in reason:
        ins = _eligible_dtypes(node)
        if not ins:
            if value_dtype(node.meta.get("val")) is None:
                return reason
            return f"{reason}; no floating input: {out} from its arguments"
        if len(ins) == 1:
            return f"{reason} ({dtype_name(ins[0])})"
        return f"{reason} ({', '.join(dtype_name(d) for d in ins)}) and gives {out}"
    if decision.cast_class is CastClass.PROMOTE:
        return f"{reason}: widest input gives {out}"
    return reason


def _autocast_dtype(node: torch.fx.Node) -> torch.dtype | None:
    """The dtype capture recorded for eager autocast; for a multi-output op, its first output's."""
    if meta.AUTOCAST_DTYPE in node.meta:
        return node.meta[meta.AUTOCAST_DTYPE]
    first = next((u for u in node.users if u.target is operator.getitem and u.args[1] == 0), None)
    return None if first is None else first.meta.get(meta.AUTOCAST_DTYPE)


def _args_text(node: torch.fx.Node, limit: int = 70) -> str:
    def fmt(a: Any) -> str:
        if isinstance(a, torch.fx.Node):
            return a.name
        if isinstance(a, (list, tuple)):
            inner = ", ".join(fmt(x) for x in a)
            return f"[{inner}]"
        if isinstance(a, torch.dtype):
            return dtype_name(a)
        return repr(a)

    parts = [fmt(a) for a in node.args] + [f"{k}={fmt(v)}" for k, v in node.kwargs.items()]
    text = ", ".join(parts)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _node_info(
    index: int,
    node: torch.fx.Node,
    labels: dict[str, str],
    val: Any = None,
    *,
    use_meta: bool = True,
    where: tuple[str, str] | None = None,
) -> NodeInfo:
    if use_meta:
        val = node.meta.get("val")
    path, mtype = module_of(node) if where is None else where
    kind = {"placeholder": "input", "get_attr": "constant", "output": "output"}.get(node.op, "op")
    cast = None
    if is_cast(node):
        kind = "cast"
        cast = "inserted" if is_inserted_cast(node) else "user"
    elif node.target is operator.getitem:
        kind = "getitem"
    op = {"input": "input", "output": "output", "constant": "get_attr"}.get(kind) or op_label(node.target)
    return NodeInfo(
        graph=index,
        name=node.name,
        kind=kind,
        op=op,
        args="" if node.op in ("placeholder", "get_attr") else _args_text(node),
        value=describe_value(val) if node.op != "output" else "",
        dtype=value_dtype(val),
        module=path,
        module_type=mtype,
        rule=_rule(node, labels),
        cast=cast,
        cached=bool(node.meta.get(meta.CACHED, False)),
        folded=tuple(node.meta.get(meta.FOLDED, ())),
        label=labels.get(node.name, ""),
        autocast_dtype=node.meta.get(meta.AUTOCAST_DTYPE),
    )


def _fp32_values(record: GraphRecord) -> tuple[dict[str, Any] | None, str]:
    """The captured graph's values as your program computes them without any autocast: the graph
    run on fake tensors (its ``meta["val"]`` holds eager autocast's dtypes, see capture); or
    None and why not."""
    vals = [n.meta.get("val") for n in placeholders(record.captured.graph)]
    mode = detect_fake_mode([v for v in vals if isinstance(v, torch.Tensor)])
    if mode is None:
        return None, "its inputs carry no fake tensors"
    interp = ValueInterpreter(record.captured)
    try:
        with mode, torch.no_grad():
            interp.run(*vals)
    except Exception as e:  # e.g. data-dependent shapes, or a dtype read under autocast
        text = str(e).strip()
        return None, f"{type(e).__name__}: {text.splitlines()[0] if text else ''}"
    return {n.name: v for n, v in interp.env.items()}, ""


def cast_bytes(gm: torch.fx.GraphModule) -> int | None:
    """Bytes the casts of ``gm`` read and write per call: numel * (src + dst itemsize) each; of a
    DTensor (tensor parallelism), its local shard's, which is what this rank casts.

    None when a size is symbolic (dynamic shapes) and so has no number.
    """
    total = 0
    for n in gm.graph.nodes:
        if not is_cast(n):
            continue
        src, dst = local_tensor(n.args[0].meta.get("val")), local_tensor(n.meta.get("val"))
        if not isinstance(src, torch.Tensor) or not isinstance(dst, torch.Tensor):
            continue
        numel = numel_or_none(dst)
        if numel is None:
            return None
        total += numel * (src.element_size() + dst.element_size())
    return total


def _bytes_text(n: int | None) -> str:
    if n is None:
        return "symbolic"
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def _op_nodes(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload)]


class Explanation:
    """What amp_fx did to every graph of a model: per-node dtypes, rules, casts; tables; a picture.

    Build one with :func:`explain`, or from a compiled model's records with :meth:`from_records`.
    ``str(explanation)`` gives the summary table, then, per graph, the before/after table and the
    rewritten graph node by node.
    """

    def __init__(
        self,
        records: Sequence[GraphRecord],
        *,
        notes: Sequence[str] = (),
        inputs: Sequence[list[Any] | None] | None = None,
        policy: Policy | None = None,
        labels: Sequence[dict[str, str]] | None = None,
        module_of: Callable[[GraphRecord, torch.fx.Node], tuple[str, str]] | None = None,
    ) -> None:
        self.records = list(records)
        self._where = module_of
        self._labels = list(labels) if labels is not None else [input_labels(r) for r in self.records]
        self.notes = list(notes)
        self.policy = policy
        self._fp32_cache: dict[int, dict[str, Any] | None] = {}
        self._runtime_cache: dict[int, dict[str, Any] | None] = {}
        self._inputs = list(inputs) if inputs is not None else [None] * len(self.records)
        self.notes += [
            f"graph {r.index}: {r.fallback_text}; its ops are not shown" for r in self.records if r.fallback is not None
        ]
        if not self.records or not any(_op_nodes(r.captured) for r in self.records):
            self.notes.append(
                "no ops were captured: torch.compile found no tensor operations to put in a graph "
                "(the function does nothing, or only returns its inputs), so amp_fx had nothing to "
                "rewrite"
            )
        elif not any(
            t is not None and t.is_floating_point()
            for r in self.records
            for n in _op_nodes(r.captured)
            for t in [_first_tensor(n)]
        ):
            self.notes.append(
                "no floating-point ops: the graphs compute only on integers or booleans, so amp_fx inserted no casts"
            )
        experts = fp32_experts_text(self.records, policy)
        if experts is not None:
            self.notes.append(experts.removeprefix("amp_fx: "))
        slow = slow_fp8_text(self.records)
        if slow is not None:
            self.notes.append(slow.removeprefix("amp_fx: "))
        fp8 = [r.fp8 for r in self.records if r.fp8 is not None]
        if fp8 and not any(d.converted for f in fp8 for d in f.decisions):
            self.notes.append(
                f"fp8={fp8[0].recipes_text!r}, but no matmul runs in fp8: "
                + (
                    "none has a parameter operand"
                    if not any(f.decisions for f in fp8)
                    else "each one's reason is in the fp8 table below"
                )
            )

    @classmethod
    def from_records(cls, records: Sequence[GraphRecord]) -> Explanation:
        """Explain the records of a model returned by :func:`amp_fx.compile` after it has run
        (``compiled.amp_fx_records`` or ``amp_fx.records(compiled)``)."""
        return cls(records)

    # --- data ------------------------------------------------------------------------------

    def nodes(self, graph: int | None = None, *, before: bool = False) -> list[NodeInfo]:
        """Every node of one graph (or of all graphs), in graph order; ``before=True`` for the
        captured graph as it was before the passes."""
        out = []
        for r in self.records if graph is None else [self.records[graph]]:
            if r.fallback is not None:  # Dynamo's graph, not amp_fx's: nothing was decided
                continue
            labels = self._labels[r.index]
            if not before:
                run = self._runtime(r.index)
                out += [
                    _node_info(r.index, n, labels, where=self._module(r, n))
                    if run is None or n.name not in run
                    else _node_info(r.index, n, labels, run[n.name], use_meta=False, where=self._module(r, n))
                    for n in r.rewritten.graph.nodes
                ]
                continue
            vals = self._fp32(r)
            out += [
                _node_info(r.index, n, labels, (vals or {}).get(n.name), use_meta=False, where=self._module(r, n))
                for n in r.captured.graph.nodes
            ]
        return out

    def _module(self, record: GraphRecord, node: torch.fx.Node) -> tuple[str, str]:
        return module_of(node) if self._where is None else self._where(record, node)

    def _fp32(self, record: GraphRecord) -> dict[str, Any] | None:
        if record.fallback is not None:
            return None
        if record.index not in self._fp32_cache:
            values, why = _fp32_values(record)
            self._fp32_cache[record.index] = values
            if values is None:
                message = (
                    f"amp_fx.explain: graph {record.index}'s dtypes without amp are not "
                    f"shown (the 'without amp' column and before=True): the captured graph "
                    f"does not run without autocast ({why}); typically a dtype your code "
                    "read under autocast is fixed in the graph. The rewritten graph is "
                    "explained in full"
                )
                self.notes.append(message.removeprefix("amp_fx.explain: "))
                did_less(("explain", "no fp32 view", why), message)
        return self._fp32_cache[record.index]

    def dtypes(self, graph: int, *, before: bool = False) -> dict[str, torch.dtype | None]:
        """Node name -> the dtype explain shows for it."""
        return {n.name: n.dtype for n in self.nodes(graph, before=before)}

    def runtime_dtypes(self, graph: int) -> dict[str, torch.dtype | None]:
        """Node name -> the dtype the node's value really has when the rewritten graph runs on the
        inputs it was called with (available when built by :func:`explain` with inputs)."""
        run = self._runtime(graph)
        if run is None:
            raise ValueError(
                "amp_fx: this Explanation has no recorded inputs for graph "
                f"{graph}; build it with amp_fx.explain(model, *inputs)"
            )
        return {name: value_dtype(v) for name, v in run.items()}

    def meta_mismatches(self, graph: int) -> list[str]:
        """Nodes whose recorded ``meta["val"]`` dtype differs from the dtype they have at run time
        (a fake-tensor kernel that disagrees with the real one); empty without recorded inputs."""
        run = self._runtime(graph)
        if run is None:
            return []
        out = []
        for n in self.records[graph].rewritten.graph.nodes:
            if n.name in run and "val" in n.meta:
                meta, real = value_dtype(n.meta["val"]), value_dtype(run[n.name])
                if meta != real:
                    op = op_label((n.args[0] if n.target is operator.getitem else n).target)
                    out.append(f"{n.name} ({op}): meta {dtype_name(meta)}, runs as {dtype_name(real)}")
        return out

    def _runtime(self, graph: int) -> dict[str, Any] | None:
        """The rewritten graph run on its recorded inputs: node name -> value (cached)."""
        if graph in self._runtime_cache:
            return self._runtime_cache[graph]
        inputs = self._inputs[graph]
        values = None
        if inputs is not None and self.records[graph].fallback is None:
            r = self.records[graph]
            interp = ValueInterpreter(r.rewritten)
            with torch.random.fork_rng(devices=[]), torch.no_grad():
                interp.run(*clone_inputs(inputs, leaf_flags(r)))
            values = {n.name: v for n, v in interp.env.items() if n.op != "output"}
        self._runtime_cache[graph] = values
        return values

    def cast_bytes(self, graph: int) -> int | None:
        """Bytes the casts in the rewritten graph read plus write per call."""
        return cast_bytes(self.records[graph].rewritten)

    # --- tables ----------------------------------------------------------------------------

    def summary_rows(self) -> list[dict[str, Any]]:
        rows = []
        for r in self.records:
            ops = [n for n in _op_nodes(r.rewritten) if not is_cast(n)]
            per_dtype = Counter(dtype_name(value_dtype(n.meta.get("val"))) for n in ops)
            rows.append(
                {
                    "graph": r.index,
                    "device": r.device_type,
                    "dtype": dtype_name(r.dtype),
                    "ops": len(ops),
                    "ops per dtype": ", ".join(f"{k} {v}" for k, v in sorted(per_dtype.items())) or "-",
                    "casts inserted": r.inserted.casts_inserted,
                    "leaf casts shared": r.inserted.casts_shared,
                    "casts folded": ", ".join(f"{k} {v}" for k, v in sorted(r.folded.by_rule.items())) or "0",
                    "casts left": r.casts,
                    "cast bytes/call": _bytes_text(cast_bytes(r.rewritten)),
                }
            )
            if any(r.fp8 is not None for r in self.records):
                padded = 0 if r.fp8 is None else sum(d.padding is not None for d in r.fp8.converted)
                share = None if r.fp8 is None else _fp8_flop_share(r.fp8.decisions)
                rows[-1]["fp8 matmuls"] = (
                    "-"
                    if r.fp8 is None
                    else (
                        f"{len(r.fp8.converted)} of {len(r.fp8.decisions)} ({r.fp8.recipes_text})"
                        + (f", {padded} padded" if padded else "")
                        + (f", {share:.2f} of their FLOPs" if share is not None else "")
                    )
                )
        return rows

    def module_rows(self, *, max_rows: int = 12) -> list[dict[str, Any]]:
        """The ops rolled up by module, at the deepest module depth (up to 3) that gives at most
        ``max_rows`` rows: ops per dtype, casts amp_fx inserted there and, with fp8, the share of
        the FLOPs of its matmuls with a parameter operand that run in fp8."""
        ops = [
            (r, n) for r in self.records if r.fallback is None for n in self.nodes(r.index) if n.kind in ("op", "cast")
        ]
        fp8 = [(r.index, d) for r in self.records if r.fp8 is not None for d in r.fp8.decisions]
        for depth in (3, 2, 1):

            def key(path: str, depth: int = depth) -> str:
                return ".".join(path.split(".")[:depth]) if path else "<root>"

            groups = list(dict.fromkeys(key(n.module) for _, n in ops))
            if len(groups) <= max_rows:
                break
        rows = []
        for group in groups:
            mine = [n for _, n in ops if key(n.module) == group]
            dtypes = Counter(n.dtype_name for n in mine if n.kind == "op")
            row: dict[str, Any] = {
                "module": group,
                "ops": sum(n.kind == "op" for n in mine),
                "ops per dtype": ", ".join(f"{k} {v}" for k, v in sorted(dtypes.items())) or "-",
                "casts inserted": sum(n.cast == "inserted" for n in mine),
            }
            if fp8:
                share = _fp8_flop_share([d for _, d in fp8 if key(d.module) == group])
                row["fp8 share of matmul FLOPs"] = "-" if share is None else f"{share:.2f}"
            rows.append(row)
        return rows

    def fp8_decisions(self, graph: int | None = None) -> list[Fp8Decision]:
        """Every matmul with a parameter operand that the fp8 pass considered (``fp8=`` on), in
        graph order: converted or not, and why (:class:`~amp_fx.passes.fp8_matmuls.Fp8Decision`)."""
        return [
            d
            for r in (self.records if graph is None else [self.records[graph]])
            if r.fp8 is not None
            for d in r.fp8.decisions
        ]

    def fp8_text(self, graph: int) -> str:
        """The fp8 pass's decision for each matmul of one graph: which run in fp8, with the
        recipe and the scale granularity of each operand, what is padded to ``_scaled_mm``'s
        multiples of 16 and what that costs (FLOPs and bytes, a fraction of the unpadded GEMMs'),
        and why the others stay in dtype."""
        r = self.records[graph]
        if r.fp8 is None:
            return f"graph {graph}: fp8 off"
        reasons: dict[str, int] = {}
        rows = [
            [
                d.weight,
                d.module,
                d.op,
                "x".join(map(str, d.shape)) if d.shape else "?",
                d.recipe.value if d.recipe is not None else dtype_name(r.dtype),
                d.selector or "",
                _reference(d.reason, reasons),
            ]
            for d in r.fp8.decisions
        ]
        return (
            f"graph {graph}: matmuls with a parameter operand (fp8={r.fp8.recipes_text}; shape M x K x N)\n"
            + tabulate(rows, headers=["weight", "module", "op", "shape", "runs in", "chosen by", "why"])
            + "".join(f"\n[{k}] {why}" for why, k in reasons.items())
        )

    def summary(self) -> str:
        """One row per graph: ops per dtype, casts inserted, folded by rule, left, bytes moved."""
        for r in self.records:
            self._fp32(r)  # its notes belong here
        lines = []
        if self.records:
            lines.append(tabulate(self.summary_rows(), headers="keys"))
            lines.append(_SUMMARY_LEGEND)
        lines += [f"note: {n}" for n in self.notes]
        lines += [f"note: graph {r.index}: {r.fallback_text}" for r in self.records if r.fallback is not None]
        for r in self.records:
            bad = self.meta_mismatches(r.index)
            if bad:
                lines.append(
                    f"note: graph {r.index}: shown with the dtypes measured at run time; "
                    f"the graph's fake-tensor metadata differs for {'; '.join(bad)}"
                )
        return "\n".join(lines)

    def graph_text(self, graph: int, *, before: bool = False) -> str:
        """The graph as a table: node, op and arguments, value (dtype[shape]), module, what decided
        its dtype. Inserted casts are marked ``+cast``, your casts ``cast``, nodes that absorbed
        folded casts ``folded(rule)``. A reason longer than a short phrase is written once, under
        the table, and referenced by its number in each row."""
        rows = []
        reasons: dict[str, int] = {}
        for n in self.nodes(graph, before=before):
            if n.kind == "output":
                continue
            mark = {"inserted": "+cast", "user": "cast"}.get(n.cast or "", "")
            if n.folded:
                mark = (mark + " " if mark else "") + f"folded({','.join(n.folded)})"
            what = n.label if n.kind == "input" else f"{n.op}({n.args})"
            module = f"{n.module} ({n.module_type})" if n.module else ""
            rows.append([mark, n.name, what, n.value, module, _reference(n.rule, reasons)])
        r = self.records[graph]
        title = f"graph {graph} {'before' if before else 'after'} the passes ({r.device_type}, {dtype_name(r.dtype)})"
        legend = "".join(f"\n[{k}] {why}" for why, k in reasons.items())
        return title + "\n" + tabulate(rows, headers=["", "node", "op", "value", "module", "dtype decided by"]) + legend

    def before_after(self, graph: int) -> str:
        """Each op of your program: its dtype before and after the passes, and the casts put on
        its inputs."""
        r = self.records[graph]
        if r.fallback is not None:
            return f"graph {graph}: {r.fallback_text}"
        after = {n.name: n for n in r.rewritten.graph.nodes}
        labels = self._labels[graph]
        fp32 = self._fp32(r) or {}
        # a matmul the fp8 pass converted is a new node that names the one it replaces
        fp8_of = {m.meta[meta.FP8_OF]: m for m in r.rewritten.graph.nodes if meta.FP8_OF in m.meta}
        rows = []
        for n in r.captured.graph.nodes:
            if n.op != "call_function" or n.target is operator.getitem:
                continue
            new = after.get(n.name)
            before_dt = dtype_name(value_dtype(fp32.get(n.name))) if fp32 else "?"
            eager = dtype_name(_autocast_dtype(n))
            if new is None:
                converted = fp8_of.get(n.name)
                # the decision is on the fp8 call (under the bias's add, where the matmul had one)
                decision = next(
                    (
                        c.meta[meta.FP8]
                        for c in ([converted, *converted.all_input_nodes] if converted else [])
                        if meta.FP8 in c.meta
                    ),
                    None,
                )
                if converted is not None and decision is not None and decision.recipe is not None:
                    out = dtype_name(value_dtype(converted.meta.get("val")))
                    shown = f"fp8 {decision.recipe.value} -> {out}"
                else:
                    shown = "(folded away)"
                rows.append([n.name, op_label(n.target), self._module(r, n)[0], before_dt, eager, shown, ""])
                continue
            casts = []
            for a in new.all_input_nodes:
                if is_cast(a) and is_inserted_cast(a):
                    src = a.args[0]
                    casts.append(f"{labels.get(src.name, src.name)}->{dtype_name(value_dtype(a.meta.get('val')))}")
            path, _ = self._module(r, n)
            rows.append(
                [
                    n.name,
                    op_label(n.target),
                    path,
                    before_dt,
                    eager,
                    dtype_name(value_dtype(new.meta.get("val"))),
                    ", ".join(casts),
                ]
            )
        return f"graph {graph}: before -> after\n" + tabulate(
            rows, headers=["node", "op", "module", "without amp", "eager autocast", "amp_fx", "casts on inputs"]
        )

    def __str__(self) -> str:
        """The summary: one row per graph, its legend and notes, and the ops rolled up by module.
        The node-by-node detail is :meth:`table`."""
        parts = [
            f"amp_fx.explain: {len(self.records)} graph(s)"
            + (f", {dtype_name(self.records[0].dtype)}" if self.records else ""),
            self.summary(),
        ]
        rows = self.module_rows()
        if rows:
            parts += ["", "by module", tabulate(rows, headers="keys")]
        if self.records:
            parts += [
                "",
                "Every op, its dtype and why, the casts on its inputs and each matmul's fp8 decision: "
                "print(report.table()) (amp-fx explain --table).",
            ]
        return "\n".join(parts)

    def table(self, graph: int | None = None) -> str:
        """The node-by-node detail of each graph (or of ``graph``): each op of your program before
        and after the passes with the casts on its inputs (:meth:`before_after`), the rewritten
        graph with what decided each dtype (:meth:`graph_text`) and, with fp8, each matmul's
        decision (:meth:`fp8_text`)."""
        parts: list[str] = []
        for r in self.records if graph is None else [self.records[graph]]:
            parts += ["", self.before_after(r.index)]
            if r.fallback is not None:
                continue
            parts += ["", self.graph_text(r.index)]
            if r.fp8 is not None:
                parts += ["", self.fp8_text(r.index)]
        return "\n".join(parts).lstrip("\n")

    def __repr__(self) -> str:
        return f"<amp_fx.Explanation of {len(self.records)} graph(s)>"

    # --- picture ---------------------------------------------------------------------------

    def to_dot(self, path: str | Path | None = None, *, before: bool = False) -> str:
        """The graphs as Graphviz DOT text, nodes coloured by dtype and inserted casts outlined in
        red; written to ``path`` when given."""
        graphs = []
        for r in self.records:
            gm = r.captured if before else r.rewritten
            nodes = self.nodes(r.index, before=before)
            edges = [(a.name, n.name) for n in gm.graph.nodes for a in n.all_input_nodes]
            graphs.append((r.index, nodes, edges))
        title = "amp_fx " + ("before the passes" if before else "after the passes")
        if self.records:
            title += f" ({dtype_name(self.records[0].dtype)})"
        text = build_dot(graphs, title=title)
        if path is not None:
            Path(path).write_text(text)
        return text

    def to_svg(self, path: str | Path, *, before: bool = False) -> Path:
        """Render the picture to ``path`` with Graphviz's ``dot``. Without Graphviz, writes the DOT
        next to it (``path`` with suffix ``.dot``) and raises :class:`GraphvizNotFound`, whose
        message says how to install Graphviz and make the SVG."""
        return write_svg(self.to_dot(before=before), path)


_SUMMARY_LEGEND = textwrap.fill(
    "(casts inserted: the casts amp_fx added; leaf casts shared: weight casts one cast serves for every "
    "use, as eager autocast's cast cache; casts folded: removed because they changed no value, by rule; "
    "casts left: the casts in the graph that runs, amp_fx's that were not folded plus your own)",
    100,
)

_INLINE_REASON = 40
"""Reasons up to this many characters stay in the row; longer ones (a policy's 200-character
explanation) are written once under the table and referenced by number."""


def _reference(reason: str, reasons: dict[str, int]) -> str:
    if len(reason) <= _INLINE_REASON:
        return reason
    return f"[{reasons.setdefault(reason, len(reasons) + 1)}]"


def _fp8_flop_share(decisions: Sequence[Fp8Decision]) -> float | None:
    """The share of the FLOPs of these matmuls (2 M K N each, unpadded) that run in fp8; None
    where there is none or a shape is unknown (or symbolic)."""
    flops = [(f, d.converted) for d in decisions if (f := _flops(d)) is not None]
    total = sum(f for f, _ in flops)
    if not flops or len(flops) != len(decisions) or total == 0:
        return None
    return sum(f for f, converted in flops if converted) / total


def _flops(d: Fp8Decision) -> int | None:
    """2 M K N, None where the shape is unknown or symbolic."""
    dims = [v for v in d.shape or () if isinstance(v, int)]
    return 2 * math.prod(dims) if d.shape and len(dims) == len(d.shape) else None


def _first_tensor(node: torch.fx.Node) -> torch.Tensor | None:
    ts = tensors_of(node.meta.get("val"))
    floats = [t for t in ts if t.is_floating_point()]
    return floats[0] if floats else (ts[0] if ts else None)


def explain(
    model_or_fn: Any,
    *args: Any,
    dtype: str | torch.dtype = "bf16",
    policy: Policy | None = None,
    fold: bool = True,
    low_precision: LowPrecisionLike = None,
    fp8: LowPrecisionLike = None,
    **kwargs: Any,
) -> Explanation:
    """Explain what amp_fx does to ``model_or_fn`` on these inputs.

    With ``low_precision`` (as :func:`amp_fx.compile` takes it, a per-module map included; ``fp8``
    is its older spelling), also which matmuls run in which recipe, with each operand's fp8 dtype
    and scale granularity and the map's entry that chose the recipe, and why the others do not
    (:meth:`Explanation.fp8_text`, :meth:`Explanation.fp8_decisions`).

    Captures the graphs as :func:`amp_fx.compile` does and runs them once, with grad enabled and
    no backward, on a deep copy of the model (your model's parameters and buffers, BatchNorm
    running stats included, are untouched); an FSDP2 model, which refuses deep copies, runs itself
    and is put back as it was (its buffers, gradients and sharding; see docs/distributed.md).
    ``**kwargs`` are passed to the model with ``args``.

    With a model or function returned by :func:`amp_fx.compile` and no inputs, explains the
    graphs it has already captured (its dtype and policy); with inputs, explains its original
    module under its dtype and policy.

    Raises:
        ValueError: the model fails in plain eager mode on these inputs (a shape mismatch, or a
            bug in the model), with the eager error chained; or the compiled model given without
            inputs has not run yet.
    """
    from amp_fx.api import options_of, records
    from amp_fx.backend.wrapper import AmpCompiledModule

    lp = one_option(fp8, low_precision, "amp_fx.explain")

    if not args and not kwargs and hasattr(model_or_fn, "amp_fx_records"):
        recs = list(records(model_or_fn))
        if not recs:
            raise ValueError(
                "amp_fx.explain: this compiled model has not run yet, so nothing was "
                "captured; call it once, or pass example inputs"
            )
        options = options_of(model_or_fn)
        original = getattr(model_or_fn, "original_module", None)
        forward = original.forward if original is not None else getattr(model_or_fn, "__wrapped__", None)
        return Explanation(recs, policy=options.policy, labels=[input_labels(r, forward) for r in recs])
    if isinstance(model_or_fn, AmpCompiledModule):
        options = options_of(model_or_fn)
        dtype, policy, fold, lp = options.dtype, options.policy, options.fold, options.fp8
        model_or_fn = model_or_fn.original_module
    elif hasattr(model_or_fn, "amp_fx_records"):
        raise TypeError(
            "amp_fx.explain: pass the original function (not the one amp_fx.compile "
            "returned) with inputs, or the compiled one without inputs"
        )
    lower = resolve_dtype(dtype)
    call = Call(args, kwargs)
    with lent(model_or_fn, tool="explain"):  # an FSDP2 model: runs on it, put back after
        run_eager_checked(model_or_fn, call, tool="explain")
        run = run_amp(
            model_or_fn, call, tool="explain", dtype=lower, policy=policy, downstream="eager", fold=fold, fp8=lp
        )
    split = weights_split_by_graph_breaks(run)
    return Explanation(
        run.records,
        inputs=[run.recorder.inputs_for(r) for r in run.records],
        notes=[split_weight_note(name, where, lower) for name, where in split.items()],
        policy=policy if policy is not None else Policy(),
        labels=[run.labels(r) for r in run.records],
        module_of=run.module_of,
    )
