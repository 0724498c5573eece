"""fp8_matmuls: run every matmul with a parameter operand as an fp8 matmul (``amp_fx.compile(..., fp8=...)``).

Assumes the graph of ``insert_casts``: ATen ops with ``meta["val"]`` true, ``meta["amp_fx_decision"]``
on every op, inserted casts marked ``meta["amp_fx_cast"]``, and placeholders marked
``meta["amp_fx_parameter"]`` (the name of the ``nn.Parameter`` it is, None for other inputs).

Which ops: ``aten.linear(x, w, b)`` (``nn.Linear``, ``F.linear``), ``aten.addmm(b, x, w)``
(transformers' ``Conv1D``), ``aten.mm(x, w)`` and ``aten.matmul(x, w)`` (``x @ w``), where the
weight operand ``w`` is a parameter or a view of one (``w.t()``, ``w.T``, ``w.view(...)``, ``w[e]``
of a 3-D parameter), seen through the cast ``insert_casts`` gave it, the model's own float casts
(``w.bfloat16()``) and a DTensor parameter's ``to_local()`` (torchtitan's experts under expert
parallelism), and the grouped expert GEMMs
of mixture-of-experts layers (``aten._grouped_mm(x, w, offs)``, ``w`` a view of an ``[E, K, N]``
parameter; transformers' ``grouped_mm_fallback`` becomes one where ``insert_casts`` moved it to
the autocast dtype, which the pipeline asks for whenever ``fp8=`` is on and
``Policy(autocast_experts=...)`` is unset). Each is *considered*:
converted, or left in ``dtype`` with the reason recorded. A matmul stays in ``dtype`` when

* the policy runs it in fp32 (``keep_fp32``, a model's ``torch.autocast(enabled=False)``) or its
  input is not bf16/fp16;
* its module is kept out of fp8 by ``Policy(keep_out_of_fp8=...)``, or in ``dtype`` by a
  per-module map (:class:`~amp_fx.low_precision.LowPrecision` mapping it to None);
* the parameter is the left operand, or the weight is 3-D (batched matmul, ``bmm``).

Each matmul runs in the recipe :func:`amp_fx.low_precision.recipe_for` gives it: the config's one
recipe, or with a per-module map (:class:`~amp_fx.low_precision.LowPrecision`) the recipe of the
most specific selector matching one of its enclosing modules (the selector naming the deepest
module; at the same depth a name or block beats a type, then the later entry wins), else the
map's default recipe. Its :class:`Fp8Decision` records the recipe and the selector.

Any size converts: where a dimension of one of its fp8 GEMMs is not a multiple of 16 (which
``torch._scaled_mm`` needs on a GPU), the fp8 matmul pads it with zeros and slices the result
(:func:`amp_fx.kernels.fp8_padding.padding` says what, and what it costs; the decision carries it).

A converted grouped GEMM becomes :func:`amp_fx.kernels.fp8_grouped_mm.fp8_grouped_mm` on the input
as cast, the weight's views rebuilt on the fp32 parameter, and the offsets (per-group numerics:
that module's docstring). A converted matmul becomes :func:`amp_fx.kernels.fp8_matmul.fp8_matmul` on the input as
``insert_casts`` cast it (the autocast dtype) and the *fp32* weight, transposed to ``[K, N]``
(torchao scales the master weight, with no bf16 round trip), plus ``aten.add`` of the bias cast to
the output's dtype (torchao's ``Float8Linear`` adds it after the GEMM). Casts left without users
are removed. The call stays a Python call in the graph: AOTAutograd traces through it (see that
module's docstring for why).

Guarantees: ``meta["val"]`` set on every new node (the converted matmul's value has the original
node's dtype and shape); every considered matmul carries ``meta["amp_fx_fp8"]`` (an
:class:`Fp8Decision`: converted or not, and why), on the fp8 call where it was converted and on
the matmul node where it was not; new nodes keep the matmul's ``nn_module_stack``; no new
aliasing (the fp8 call returns a fresh tensor); the graph lints.

Example:
    >>> import torch
    >>> from torch._subclasses.fake_tensor import FakeTensorMode
    >>> from amp_fx.passes.capture import capture
    >>> from amp_fx.fp8 import Fp8Config
    >>> from amp_fx.passes import meta
    >>> from amp_fx.passes.fx_edit import placeholders
    >>> from amp_fx.passes.insert_casts import insert_casts
    >>> from amp_fx.policy import Policy
    >>> with FakeTensorMode() as mode:
    ...     x, w = torch.empty(32, 64), torch.nn.Parameter(torch.empty(16, 64))
    ...     gm = capture(torch.nn.functional.linear, [x, w], policy=Policy(), device_type="cpu",
    ...                  dtype=torch.bfloat16, leaf_flags=[False, True])
    ...     gm, _ = insert_casts(gm, policy=Policy(), device_type="cpu", dtype=torch.bfloat16,
    ...                          fake_mode=mode)
    ...     x_node, w_node = placeholders(gm.graph)
    ...     x_node.meta[meta.PARAMETER], w_node.meta[meta.PARAMETER] = None, "w"
    ...     gm, record = fp8_matmuls(gm, config=Fp8Config("tensorwise"), policy=Policy(),
    ...                              fake_mode=mode)
    >>> [(d.op, d.shape, d.converted) for d in record.decisions]
    [('aten.linear', (32, 64, 16), True)]
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import is_concrete_int

from amp_fx._common.dtype_names import dtype_name
from amp_fx._common.op_names import op_label
from amp_fx.fp8 import Fp8Config, Fp8Recipe
from amp_fx.kernels.blockwise_fp8 import BLOCK as BW_BLOCK
from amp_fx.kernels.fp8_activation_gather import fp8_gather_input
from amp_fx.kernels.fp8_grouped_mm import fp8_grouped_mm, grouped_mm_operands
from amp_fx.kernels.fp8_matmul import fp8_matmul
from amp_fx.kernels.fp8_padding import Fp8Padding, padding
from amp_fx.kernels.fp8_recipes import ALIGNMENT, RECIPES, check_rowwise_support
from amp_fx.kernels.fp8_weight import holds_fp8_weight
from amp_fx.kernels.mxfp8_matmul import BLOCK as MX_BLOCK
from amp_fx.kernels.mxfp8_matmul import mxfp8_grouped_mm
from amp_fx.kernels.nvfp4 import BLOCK as NV_BLOCK
from amp_fx.kernels.nvfp4 import nvfp4_grouped_mm, nvfp4_linear_flags
from amp_fx.low_precision import recipe_for, recipes
from amp_fx.passes import meta
from amp_fx.passes.capture import dtensor_method, module_stack
from amp_fx.passes.fx_edit import (
    CAST_OP,
    WEIGHT_VIEWS,
    add_node,
    arg_node,
    innermost_module,
    is_cast,
    is_inserted_cast,
    mark_cast,
    placeholders,
    uncast,
    walk_views,
)
from amp_fx.passes.fx_edit import val as _val
from amp_fx.policy import GROUPED_MM_OPS, CastClass, Decision, Policy, module_matches

__all__ = ["fp8_matmuls", "Fp8Decision", "Fp8Record", "ALIGNMENT", "MATMULS"]

aten = torch.ops.aten

MATMULS = {
    aten.linear.default: "aten.linear",
    aten.addmm.default: "aten.addmm",
    aten.mm.default: "aten.mm",
    aten.matmul.default: "aten.matmul",
    aten.bmm.default: "aten.bmm",
    aten.baddbmm.default: "aten.baddbmm",
}
"""The ops the pass considers (bmm/baddbmm are recorded as not convertible), besides the grouped
expert GEMMs (:data:`~amp_fx.policy.GROUPED_MM_OPS`)."""

_GROUPED_MM = aten._grouped_mm.default


def _grouped(target: object) -> bool:
    """A grouped expert GEMM (``aten._grouped_mm``, transformers' ``grouped_mm_fallback``)."""
    return isinstance(target, torch._ops.OpOverload) and target.name() in GROUPED_MM_OPS


_LOW = (torch.bfloat16, torch.float16)
_BLOCK_SCALED = frozenset({Fp8Recipe.MXFP8, Fp8Recipe.BLOCKWISE, Fp8Recipe.NVFP4})
"""Recipes with a scale per block along each GEMM's inner dimension: a contraction dimension
sharded across ranks splits their blocks (and NVFP4's per-tensor amax) between ranks."""


@dataclass(frozen=True)
class Fp8Decision:
    """Why one matmul runs in fp8 or not: ``meta["amp_fx_fp8"]``."""

    converted: bool
    reason: str
    op: str
    """The ATen op the model called (``aten.linear``, ``aten.addmm``, ...)."""
    weight: str
    """The parameter operand's name (``fc1.weight``), or its graph input's where unknown."""
    module: str
    """The innermost module under the compiled root ("" for the root's own code)."""
    shape: tuple[int | str, int | str, int | str] | None = None
    """(M, K, N) of the forward GEMM (a symbolic size as text), where known."""
    recipe: Fp8Recipe | None = None
    """The recipe the matmul runs with, where converted."""
    padding: Fp8Padding | None = None
    """Where converted with a size that is not a multiple of 16: what its fp8 GEMMs pad and what
    that costs (None where nothing is padded, or a size is symbolic: then it pads at run time
    where needed)."""
    selector: str | None = None
    """The entry of a per-module map (``LowPrecision.modules``) that chose the recipe (or kept the
    matmul in ``dtype``), as text (``'lm_head'``, ``Blocks(first=1, ...)``, ``Linear``); None
    where the default recipe applied or the map was not consulted."""
    left_out: bool = False
    """True where the matmul stays in ``dtype`` for a reason the user did not ask for (its
    operands' form: a batched or left-hand weight, a weight computed from a parameter): reported
    once (``strict=True`` raises), where a matmul kept by the policy, the model's own
    ``torch.autocast``, or a sharding rule reported on its own is not."""

    @property
    def flops(self) -> int:
        """The multiply-adds times two of the forward GEMM (0 where a size is symbolic)."""
        if self.shape is None:
            return 0
        m, k, n = self.shape
        if not (isinstance(m, int) and isinstance(k, int) and isinstance(n, int)):
            return 0
        return 2 * m * k * n


@dataclass
class Fp8Record:
    """What fp8_matmuls did to one graph."""

    recipe: Fp8Recipe | None
    """The config's default recipe (None: a per-module map's modules only; each decision's
    ``recipe`` is the one it runs with)."""
    decisions: list[Fp8Decision] = field(default_factory=list)
    """Every matmul considered, in graph order."""
    fp8_weight_reads: list[str] = field(default_factory=list)
    """Uses of a weight FSDP2 gathered in fp8 (an :class:`~amp_fx.kernels.fp8_weight.Fp8Weight`
    input, ``amp_fx/_dist/fp8_gather.py``) other than as an fp8 matmul's weight: ``"<weight> by
    <op> in <module>"``. Such a use reads the fp8 weight's ``data / scale``."""

    sharded_contractions: list[str] = field(default_factory=list)
    """The matmuls kept out of a rowwise recipe because their contraction dimension is sharded
    across ranks (a ``RowwiseParallel`` linear's input is ``Shard(-1)``): ``"<module> (<placements>)"``.
    DTensor has no sharding rule for a ``_scaled_mm`` with rowwise scales there; it would gather
    the fp8 operands (over gloo, which has no float8, it fails: "Invalid scalar type")."""

    gathered_activations: list[str] = field(default_factory=list)
    """The converted matmuls whose input DTensor all-gathers before the cast (sequence
    parallelism's ``Shard`` to ``Replicate`` redistribute): ``"<module> (<from> to <to>)"``. The
    gather moves the input's dtype (what eager autocast moves), not e4m3 as torchao's
    ``Float8ColwiseParallel`` does."""

    @property
    def converted(self) -> list[Fp8Decision]:
        return [d for d in self.decisions if d.converted]

    @property
    def recipes(self) -> tuple[Fp8Recipe, ...]:
        """The recipes the converted matmuls run with, in graph order (the default recipe where none is)."""
        found = tuple(dict.fromkeys(d.recipe for d in self.converted if d.recipe is not None))
        return found or ((self.recipe,) if self.recipe is not None else ())

    @property
    def recipes_text(self) -> str:
        """The recipes as a table names them: ``tensorwise``, ``mxfp8 + rowwise``."""
        return " + ".join(r.value for r in self.recipes) or "none"

    @property
    def kept(self) -> list[Fp8Decision]:
        return [d for d in self.decisions if not d.converted]


@dataclass(frozen=True)
class _Match:
    """A matmul with a parameter on the right: its operands as the fp8 matmul takes them."""

    x: torch.fx.Node
    """The input, as insert_casts cast it."""
    weight_kn: torch.fx.Node | None
    """The weight as ``[K, N]`` (uncast); None for ``aten.linear``, whose ``[N, K]`` weight is
    transposed by a new ``aten.t`` node."""
    weight: torch.fx.Node
    """The weight operand as the model passed it, uncast: the parameter placeholder or a view of it
    (``F.linear(x, w.t())`` passes a view, whose shape, not the parameter's, is ``[N, K]``)."""
    bias: torch.fx.Node | None
    offs: torch.fx.Node | None = None
    """A grouped GEMM's group ends (its weight is ``[E, K, N]``)."""


def _model_cast(node: torch.fx.Node) -> bool:
    """A cast the model wrote itself between two floating dtypes on one device (``w.bfloat16()``,
    ``w.to(dtype)``, as torchtitan's ``GroupedExperts`` casts its expert weights): a value the
    model computes from the parameter with no other change, so the matmul still multiplies by
    that parameter."""
    if not is_cast(node) or is_inserted_cast(node) or set(node.kwargs) - {"dtype"}:
        return False
    source = node.args[0]
    if not isinstance(source, torch.fx.Node):
        return False
    before, after = _val(source), _val(node)
    return (
        isinstance(before, torch.Tensor)
        and isinstance(after, torch.Tensor)
        and before.dtype.is_floating_point
        and after.dtype.is_floating_point
    )


def _local_shard(node: torch.fx.Node) -> bool:
    """``w.to_local()`` of a DTensor parameter (torchtitan's ``GroupedExperts`` under expert
    parallelism: ``self.w1_EFD.to_local()``, then its own cast): this rank's shard of the parameter,
    the values the model multiplies by here, with no change (its gradient flows back to the
    parameter's local shard)."""
    return node.op == "call_function" and node.target is dtensor_method and node.args[:1] == ("to_local",)


def _weight_source(node: object) -> object:
    """Up from a matmul's operand through the views of :data:`WEIGHT_VIEWS`, amp_fx's casts, the
    model's own float casts (:func:`_model_cast`) and a DTensor parameter's ``to_local``
    (:func:`_local_shard`): the value they start from."""
    while True:
        node, _ = walk_views(node, WEIGHT_VIEWS, through_casts=True)
        if not isinstance(node, torch.fx.Node):
            return node
        if _model_cast(node):
            node = node.args[0]
        elif _local_shard(node):
            node = node.args[1]
        else:
            return node


def _parameter(node: object) -> torch.fx.Node | None:
    """The parameter placeholder ``node`` is (a view of), through insert_casts' casts and the
    model's own float casts (the model's cast stays where the model put it: the fp8 GEMM scales
    the value the model multiplies by, as eager does)."""
    node = _weight_source(node)
    if isinstance(node, torch.fx.Node) and node.op == "placeholder" and node.meta.get(meta.PARAMETER):
        return node
    return None


def _computed_from_parameter(node: object) -> tuple[torch.fx.Node, str] | None:
    """``(parameter, op)`` where a matmul's operand is computed from one parameter by ops that read
    no other tensor (``w * mask_scalar``, ``w.abs()``, a weight norm of one input), through views
    and casts; ``op`` the first such op up from the operand. None where the operand is no such
    value (an activation reads other graph inputs). Such a matmul is a layer's matmul that fp8
    leaves out: it is recorded and reported, never skipped in silence."""
    first = None
    node = _weight_source(node)
    while isinstance(node, torch.fx.Node) and node.op == "call_function":
        inputs = node.all_input_nodes
        if len(inputs) != 1:
            return None
        first = first or node
        node = _weight_source(inputs[0])
    if (
        first is not None
        and isinstance(node, torch.fx.Node)
        and node.op == "placeholder"
        and node.meta.get(meta.PARAMETER)
    ):
        return node, op_label(first.target)
    return None


def _optional_node(arg: object) -> torch.fx.Node | None:
    """A matmul's optional tensor operand (a bias): a node, or None."""
    if arg is None or isinstance(arg, torch.fx.Node):
        return arg
    raise TypeError(f"amp_fx: a matmul's bias is {arg!r}, neither a tensor nor None")


def _text(d: object) -> int | str:
    """A size as an int, or as text where it is symbolic (never ``int()`` of a symbol: that would
    specialise it)."""
    return int(d) if isinstance(d, (int, torch.SymInt)) and is_concrete_int(d) else str(d)


class _Fp8Rewriter:
    def __init__(self, gm: torch.fx.GraphModule, config: Fp8Config, policy: Policy, fake_mode: FakeTensorMode) -> None:
        self.gm = gm
        self.graph = gm.graph
        self.config = config
        self.policy = policy
        self.fake_mode = fake_mode
        self.record = Fp8Record(config.recipe)
        nv = config.nvfp4_switches
        self.nvfp4_flags: tuple[bool, bool, bool] = (nv.rht, nv.stochastic_rounding, nv.weight_2d)
        """NVFP4's switches as :func:`~amp_fx.kernels.nvfp4.nvfp4_linear_flags` takes them (constants
        FX writes back as code, as it cannot write a dataclass)."""
        self.gathered: list[tuple[str, torch.fx.Node]] = []
        """(``"<module> (<from> to <to>)"``, the input node) of each converted matmul whose input
        is all-gathered: reported unless :meth:`gather_in_fp8` moves the gather after the cast."""

    def run(self) -> Fp8Record:
        for node in list(self.graph.nodes):
            if node.op == "call_function" and (node.target in MATMULS or _grouped(node.target)):
                self.visit(node)
        moved = self.gather_in_fp8()
        self.record.gathered_activations = [text for text, x in self.gathered if x not in moved]
        self.record.fp8_weight_reads = _fp8_weight_reads(self.graph)
        self.graph.lint()
        self.gm.recompile()
        return self.record

    def visit(self, node: torch.fx.Node) -> None:
        op = op_label(node.target)
        stack = module_stack(node)
        module = innermost_module(node)
        weight = next((p for p in map(_parameter, node.args) if p is not None), None)
        if weight is None:
            computed = next((c for c in map(_computed_from_parameter, node.args) if c is not None), None)
            if computed is None:
                return  # no operand is a parameter's value: not a matmul of a layer, never fp8
            weight, by = computed
            match, why = (
                None,
                (
                    f"its operand is computed from the parameter by {by} (only views and casts of a "
                    f"parameter are fp8 weights); compute the weight outside the model, or keep the "
                    f"module out of fp8 with Policy(keep_out_of_fp8=...)"
                ),
            )
        else:
            match, why = self.match(node)
        shape = self.shape(match) if match is not None else None
        recipe, selector = recipe_for(self.config, stack)

        def decide(
            converted: bool,
            reason: str,
            pad: Fp8Padding | None = None,
            *,
            by_map: bool = False,
            left_out: bool = False,
        ) -> Fp8Decision:
            name = weight.meta.get(meta.PARAMETER) or weight.name
            d = Fp8Decision(
                converted,
                reason,
                op,
                name,
                module,
                shape,
                recipe if converted else None,
                pad,
                selector if converted or by_map else None,
                left_out=left_out,
            )
            self.record.decisions.append(d)
            return d

        decision: Decision | None = node.meta.get(meta.DECISION)
        if decision is not None and decision.kept_module is not None:
            node.meta[meta.FP8] = decide(False, f"not fp8: {decision.reason}")
            return
        excluded = self.excluded(stack)
        if excluded is not None:
            node.meta[meta.FP8] = decide(
                False, f"not fp8: module {excluded[0] or '<root>'} kept out of fp8 by policy ({excluded[1]})"
            )
            return
        if recipe is None:
            node.meta[meta.FP8] = decide(
                False,
                f"not fp8: kept in {dtype_name(_val(node).dtype)} by the low-precision map "
                f"({selector or 'its default: no recipe'})",
                by_map=True,
            )
            return
        if match is None:
            # a grouped GEMM insert_casts left unlowered was left so by the policy
            # (autocast_experts=False) or the dtype, each reported by the experts' own note
            unlowered = _grouped(node.target) and node.target is not _GROUPED_MM
            node.meta[meta.FP8] = decide(False, f"not fp8: {why}", left_out=not unlowered)
            return
        x_dtype = _val(match.x).dtype
        low = decision is None or decision.cast_class is CastClass.LOWER_PRECISION_FP
        if not low or x_dtype not in _LOW:
            why = f" ({decision.reason})" if decision is not None else ""
            node.meta[meta.FP8] = decide(
                False, f"not fp8: the matmul runs in {dtype_name(x_dtype)}, not in the autocast dtype{why}"
            )
            return
        # scales along K: per row (rowwise), per block of 32 (mxfp8), 128 (blockwise) or 16 (nvfp4)
        blocked = RECIPES[recipe].rowwise or recipe in _BLOCK_SCALED
        sharded = _sharded_contraction(match.x) if blocked else None
        if sharded is not None:
            self.record.sharded_contractions.append(f"{module or 'the root'} ({sharded})")
            node.meta[meta.FP8] = decide(
                False,
                f"not fp8: {recipe.value} scales on a contraction dimension sharded across ranks "
                f"({sharded}): DTensor has no sharding rule for a {recipe.value}-scaled GEMM there; "
                f"fp8='tensorwise' converts it",
            )
            return
        if recipe is Fp8Recipe.NVFP4 and any(_placements(n) is not None for n in (match.x, match.weight)):
            node.meta[meta.FP8] = decide(
                False,
                "not fp8: nvfp4 takes no DTensor operand (tensor parallelism): its emulated GEMM "
                "unpacks e2m1 codes through a lookup table DTensor has no rule for; "
                "low_precision='blockwise' or 'tensorwise' converts it, or keep the module out "
                "(Policy(keep_out_of_fp8=[module]))",
                left_out=True,
            )
            return
        pad = self.padding(shape, recipe) if match.offs is None else None
        reason = self.converted_reason(recipe)
        if match.offs is not None and recipe is Fp8Recipe.BLOCKWISE:
            reason += (
                f"; grouped: each expert's weight in its own {BW_BLOCK}x{BW_BLOCK} tiles, the weight "
                f"gradient's operands per {BW_BLOCK} rows of each group (as torchao pads each group)"
            )
        elif match.offs is not None and recipe is Fp8Recipe.NVFP4:
            reason += (
                "; grouped: each expert's GEMMs on its group's rows, with its own tensor scales (as "
                "TransformerEngine's GroupedLinear), emulated as one masked GEMM per expert"
            )
        elif match.offs is not None:
            reason += (
                f"; grouped: each expert's GEMMs on its group's rows, scaled per group as an "
                f"nn.Linear per expert under torchao (sizes not multiples of {ALIGNMENT} padded "
                f"per group)"
            )
        elif pad is not None and recipe is Fp8Recipe.MXFP8:
            reason += f"; padded to multiples of {MX_BLOCK} (its scale blocks): {pad.text}"
        elif pad is not None and recipe is Fp8Recipe.BLOCKWISE:
            reason += f"; padded to multiples of {BW_BLOCK} (its scale blocks): {pad.text}"
        elif pad is not None and recipe is Fp8Recipe.NVFP4:
            reason += f"; padded to multiples of {NV_BLOCK} (its scale blocks): {pad.text}"
        elif pad is not None:
            reason += f"; padded to multiples of {ALIGNMENT} for torch._scaled_mm: {pad.text}"
        elif shape is not None and not all(isinstance(d, int) for d in shape):
            reason += f"; a symbolic size: padded at run time where not a multiple of {ALIGNMENT}"
        self.convert(node, match, decide(True, reason, pad))
        gathered = _gathered_activation(match.x)
        if gathered is not None:
            self.gathered.append((f"{module or 'the root'} ({gathered})", match.x))

    def gather_in_fp8(self) -> set[torch.fx.Node]:
        """Each gathering ``redistribute`` read only by tensorwise fp8 matmuls (directly where it
        is in the autocast dtype already, or each through its own cast to it) becomes
        :func:`fp8_gather_input` on its source: the shards cast to e4m3, the bytes gathered (module
        docstring of :mod:`amp_fx.kernels.fp8_activation_gather`), and each matmul
        ``fp8_matmul(carrier, w, recipe, x_fp8=(data, scale, dtype))``. Returns the matmuls' former
        inputs (the casts, or the redistribute) it replaced."""
        if Fp8Recipe.TENSORWISE not in recipes(self.config):
            return set()
        moved: set[torch.fx.Node] = set()
        for redistribute in dict.fromkeys(x.args[0] if is_inserted_cast(x) else x for _, x in self.gathered):
            assert isinstance(redistribute, torch.fx.Node)
            found = _fp8_readers(redistribute) if _gathers(redistribute) else None
            if found is None:
                continue
            readers, dtype = found
            source = redistribute.args[1]
            stack = redistribute.meta.get("nn_module_stack", {})
            note = Decision(
                CastClass.NONE,
                f"fp8: the input cast to e4m3 on each rank's shard (one scale: the whole tensor's amax) "
                f"and all-gathered in fp8, 1 byte per element, where eager autocast gathers "
                f"{dtype_name(_val(source).dtype)} and casts after (bitwise: the same cast of the same values)",
            )
            with self.graph.inserting_before(redistribute):
                gather = self.call(
                    fp8_gather_input,
                    (source, tuple(_val(redistribute).placements), dtype, Fp8Recipe.TENSORWISE),
                    stack,
                    note,
                )
                carrier, data, scale = (self.call(operator.getitem, (gather, i), stack, note) for i in range(3))
            for x, matmuls in readers.items():
                for mm in matmuls:
                    mm.args = (carrier, *mm.args[1:])
                    mm.kwargs = {**mm.kwargs, "x_fp8": (data, scale, dtype)}
                moved.add(x)
                if x is not redistribute:
                    self.graph.erase_node(x)
            for dead in list(redistribute.users):
                self.graph.erase_node(dead)
            self.graph.erase_node(redistribute)
        return moved

    def match(self, node: torch.fx.Node) -> tuple[_Match | None, str]:
        """The operands of a matmul whose right operand is a 2-D parameter, or why not."""
        target, args = node.target, node.args
        if _grouped(target):
            return self.match_grouped(node)
        if target in (aten.bmm.default, aten.baddbmm.default):
            return None, (
                "a batched matmul (aten.bmm): _scaled_mm takes 2-D operands, so a 3-D "
                "weight stays in the autocast dtype"
            )
        if target is aten.linear.default:
            x, w = arg_node(node, 0), arg_node(node, 1)
            bias = _optional_node(args[2] if len(args) > 2 else node.kwargs.get("bias"))
            weight = _parameter(w)
            if weight is None:
                return None, "the parameter is the input of F.linear, not its weight"
            if _val(w).dim() != 2:
                return None, "the weight is not 2-D"
            return _Match(x, None, uncast(w), bias), ""
        if target is aten.addmm.default:
            if node.kwargs.get("beta", 1) != 1 or node.kwargs.get("alpha", 1) != 1 or len(args) > 3:
                return None, "addmm with beta or alpha other than 1"
            bias, x, w = arg_node(node, 0), arg_node(node, 1), arg_node(node, 2)
        else:
            x, w = arg_node(node, 0), arg_node(node, 1)
            bias = None
        weight = _parameter(w)
        if weight is None:
            return None, "the parameter is the left operand (w @ x); fp8 takes it on the right (x @ w)"
        if _val(w).dim() != 2:
            return None, f"the weight operand is {_val(w).dim()}-D; _scaled_mm takes 2-D operands"
        if _val(x).dim() < 2:
            return None, "the input is 1-D"
        if bias is not None and _val(bias).dim() > 1:
            return None, "addmm with a 2-D bias"
        return _Match(x, uncast(w), weight, bias), ""

    def match_grouped(self, node: torch.fx.Node) -> tuple[_Match | None, str]:
        """``grouped_mm(x [M, K], w [E, K, N], offs)`` with ``w`` a view of a parameter, or why not."""
        if node.target is not _GROUPED_MM:
            return None, (
                f"{op_label(node.target)} was not moved to the autocast dtype "
                f"(only aten._grouped_mm on autocast-dtype operands runs in fp8)"
            )
        operands = grouped_mm_operands(node.args, node.kwargs)
        if _parameter(node.args[1]) is None:
            return None, "the parameter is not the grouped GEMM's right operand"
        if operands is None:
            return None, "a grouped GEMM without offsets, or with a bias or out_dtype"
        x, w, offs = operands
        if _val(x).dim() != 2 or _val(w).dim() != 3:
            return None, "a grouped GEMM whose operands are not [M, K] and [E, K, N]"
        return _Match(x, None, w, None, offs), ""

    def shape(self, match: _Match) -> tuple[int | str, int | str, int | str]:
        xv = _val(match.x)
        if match.offs is not None:  # [M, K] x [E, K, N]: each row meets one expert
            return _text(xv.shape[0]), _text(xv.shape[1]), _text(_val(match.weight).shape[-1])
        k = xv.shape[-1]
        n = _val(match.weight_kn).shape[1] if match.weight_kn is not None else _val(match.weight).shape[0]
        m = math.prod(xv.shape[:-1])
        return _text(m), _text(k), _text(n)

    def padding(self, shape: tuple[int | str, int | str, int | str] | None, recipe: Fp8Recipe) -> Fp8Padding | None:
        """What the fp8 matmul pads at these sizes (None where nothing, or a size is symbolic)."""
        assert shape is not None
        m, k, n = shape
        if not (isinstance(m, int) and isinstance(k, int) and isinstance(n, int)):
            return None
        return padding(m, k, n, recipe)

    def excluded(self, stack: Sequence[tuple[str, type]]) -> tuple[str, str] | None:
        for path, mtype in stack:
            for sel in self.policy.keep_out_of_fp8:
                if module_matches(sel, path, mtype):
                    return path, sel if isinstance(sel, str) else sel.__name__
        return None

    def converted_reason(self, recipe: Fp8Recipe) -> str:
        c = RECIPES[recipe]
        if recipe is Fp8Recipe.BLOCKWISE:
            return (
                f"fp8 blockwise: out = x (e4m3, fp32 scale per 1x{BW_BLOCK} along K) @ w (e4m3, fp32 scale "
                f"per {BW_BLOCK}x{BW_BLOCK} tile of the fp32 weight); grad_x: grad (1x{BW_BLOCK} along N) @ "
                f"w (the same tiles); grad_w: x ({BW_BLOCK}x1 along M) @ grad ({BW_BLOCK}x1 along M)"
            )
        if recipe is Fp8Recipe.NVFP4:
            rht, sr, w2d = self.nvfp4_flags
            return (
                f"nvfp4: x, w and grad in e2m1 with an e4m3 scale per {NV_BLOCK} elements along each "
                f"GEMM's inner dimension and an fp32 scale per tensor, from their bf16 values; w per "
                f"{'16x16 tile' if w2d else '1x16 block'}; grad rounded "
                f"{'stochastically' if sr else 'to nearest even'}; grad_w's operands "
                f"{'through' if rht else 'without'} the random Hadamard transform"
            )
        if recipe is Fp8Recipe.MXFP8:
            return (
                f"fp8 mxfp8: x, w and grad in e4m3 with an e8m0 scale per {MX_BLOCK} elements along "
                f"each GEMM's inner dimension (out, grad_x, grad_w), from their bf16 values"
            )
        return (
            f"fp8 {recipe.value}: out = x ({c.input.label}) @ w ({c.weight.label}); "
            f"grad_x: grad ({c.grad_output.label}) @ w ({c.weight_for_grad_input.label}); "
            f"grad_w: x ({c.input_for_grad_weight.label}) @ grad "
            f"({c.grad_output_for_grad_weight.label})"
        )

    def convert(self, node: torch.fx.Node, match: _Match, decision: Fp8Decision) -> None:
        stack = node.meta.get("nn_module_stack", {})
        note = Decision(CastClass.NONE, decision.reason)
        recipe = decision.recipe
        assert recipe is not None, "a converted matmul's decision names its recipe"
        with self.graph.inserting_before(node):
            if match.offs is not None:
                if recipe is Fp8Recipe.MXFP8:  # scales the bf16 operands, as torchao's MX recipe
                    out = self.call(mxfp8_grouped_mm, (match.x, match.weight, match.offs), stack, note)
                elif recipe is Fp8Recipe.NVFP4:  # scales the bf16 operands, as TE's NVFP4 recipe
                    args = (match.x, match.weight, match.offs, *self.nvfp4_flags)
                    out = self.call(nvfp4_grouped_mm, args, stack, note)
                else:
                    out = self.call(
                        fp8_grouped_mm,
                        (match.x, self.fp32_view(match.weight, stack), match.offs, recipe),
                        stack,
                        note,
                    )
                out.meta[meta.FP8] = decision
                out.meta[meta.FP8_OF] = node.name
                inputs = node.all_input_nodes
                node.replace_all_uses_with(out)
                self.graph.erase_node(node)
                _erase_unused_casts(self.graph, inputs)
                return
            w = match.weight_kn
            if w is None:
                w = self.call(
                    aten.t.default, (match.weight,), stack, Decision(CastClass.NONE, self.weight_note(recipe))
                )
            if recipe is Fp8Recipe.NVFP4:
                out = self.call(nvfp4_linear_flags, (match.x, w, *self.nvfp4_flags), stack, note)
            else:
                out = self.call(fp8_matmul, (match.x, w, recipe), stack, note)
            out.meta[meta.FP8] = decision
            if match.bias is not None:
                # torchao's Float8Linear: output + bias.to(output.dtype), after the GEMM.
                bias, out_dtype = match.bias, _val(out).dtype
                if _val(bias).dtype != out_dtype:
                    bias = mark_cast(
                        self.call(CAST_OP, (uncast(bias),), stack, note, {"dtype": out_dtype}), decision.reason
                    )
                out = self.call(
                    aten.add.Tensor,
                    (out, bias),
                    stack,
                    Decision(
                        CastClass.NONE,
                        f"fp8: the bias, in {dtype_name(out_dtype)}, added after the fp8 "
                        f"GEMM (as torchao's Float8Linear adds it)",
                    ),
                )
        out.meta[meta.FP8_OF] = node.name
        inputs = node.all_input_nodes
        node.replace_all_uses_with(out)
        self.graph.erase_node(node)
        _erase_unused_casts(self.graph, inputs)

    def weight_note(self, recipe: Fp8Recipe) -> str:
        if recipe is Fp8Recipe.NVFP4:
            return "fp8: the weight as [K, N]; nvfp4 scales its bf16 cast (as TransformerEngine's bf16 weights)"
        if recipe is Fp8Recipe.MXFP8:
            return (
                "fp8: the weight as [K, N]; mxfp8 scales its bf16 cast (as torchao's MXFP8 linear takes bf16 operands)"
            )
        return (
            "fp8: the weight as [K, N], in fp32 (the master weight is scaled, with no round trip "
            "through the autocast dtype)"
        )

    def fp32_view(self, w: torch.fx.Node, stack: dict[str, object]) -> torch.fx.Node:
        """``w`` (views of a parameter's cast, or casts of its views) rebuilt on the fp32 parameter:
        the fp8 GEMMs scale the master weight, as torchao does."""
        node, views = walk_views(w, WEIGHT_VIEWS, through_casts=True)
        for view in reversed(views):
            node = self.call(
                view.target,
                (node, *view.args[1:]),
                stack,
                Decision(
                    CastClass.NONE,
                    "fp8: a view of the fp32 master weight (its fp8 casts scale it, with no "
                    "round trip through the autocast dtype)",
                ),
                dict(view.kwargs),
            )
        return node

    def call(
        self,
        target: object,
        args: tuple[object, ...],
        stack: dict[str, object],
        decision: Decision,
        kwargs: dict[str, object] | None = None,
    ) -> torch.fx.Node:
        with torch.no_grad():
            return add_node(self.graph, target, args, kwargs, fake_mode=self.fake_mode, stack=stack, decision=decision)


# value-preserving steps between a redistribute and the matmul: insert_casts' cast, views, detach
_PASS_THROUGH = {
    aten._to_copy.default,
    aten.detach.default,
    aten.view.default,
    aten.reshape.default,
    aten.alias.default,
}


def _placements(node: torch.fx.Node) -> Any:
    """The DTensor placements of ``node``'s value; None for a plain tensor."""
    return getattr(_val(node), "placements", None)


def _sharded_contraction(x: torch.fx.Node) -> str | None:
    """The placements of ``x`` where ``x`` is a DTensor sharded on its last dimension (the
    matmul's contraction dimension, as a ``RowwiseParallel`` linear's input is); None otherwise."""
    placements = _placements(x)
    ndim = _val(x).dim()
    if placements is None:
        return None
    if any(p.is_shard() and p.dim % ndim == ndim - 1 for p in placements):
        return f"input placements {tuple(placements)}"
    return None


def _moved_placements(node: torch.fx.Node) -> tuple[Any, Any] | None:
    """``(before, after)``: the placements a DTensor ``redistribute`` node moves its source from and
    to; None for any other node (or where either is unknown)."""
    if not (node.op == "call_function" and node.target is dtensor_method and node.args[0] == "redistribute"):
        return None
    source = node.args[1]
    before = getattr(source.meta.get("val"), "placements", None) if isinstance(source, torch.fx.Node) else None
    after = getattr(node.meta.get("val"), "placements", None)
    return None if before is None or after is None else (before, after)


def _gathers(node: torch.fx.Node) -> bool:
    """``node`` is DTensor's ``redistribute`` of a DTensor, gathering some ``Shard`` to ``Replicate``."""
    moved = _moved_placements(node)
    return moved is not None and any(b.is_shard() and a.is_replicate() for b, a in zip(*moved))


def _fp8_readers(
    redistribute: torch.fx.Node,
) -> tuple[dict[torch.fx.Node, list[torch.fx.Node]], torch.dtype] | None:
    """``({input: fp8 matmuls reading it}, their input dtype)`` where every reader of
    ``redistribute`` is an fp8 matmul taking it as its input, directly or through a cast of its
    own, all in one dtype (a dead ``detach`` aside); None otherwise (another op needs the
    gathered values)."""
    readers: dict[torch.fx.Node, list[torch.fx.Node]] = {}
    dtypes = set()
    for user in redistribute.users:
        if user.target is aten.detach.default and not user.users:
            continue
        if _reads_as_input(user, redistribute):
            readers.setdefault(redistribute, []).append(user)
            dtypes.add(_val(redistribute).dtype)
        elif is_inserted_cast(user) and user.users and all(_reads_as_input(m, user) for m in user.users):
            readers[user] = list(user.users)
            dtypes.add(user.kwargs.get("dtype"))
        else:
            return None
    return (readers, dtypes.pop()) if readers and len(dtypes) == 1 else None


def _reads_as_input(node: torch.fx.Node, x: torch.fx.Node) -> bool:
    """``node`` is a tensorwise fp8 matmul taking ``x`` as its input only."""
    return (
        node.target is fp8_matmul
        and node.args[0] is x
        and x not in node.args[1:]
        and node.args[2] in (Fp8Recipe.TENSORWISE,)
        and node.kwargs.get("x_fp8") is None
    )


def _gathered_activation(x: torch.fx.Node) -> str | None:
    """``"<from> to <to>"`` where ``x`` is, through casts and views, a DTensor ``redistribute``
    that gathers a sharded input (some ``Shard`` placement becomes ``Replicate``); None otherwise."""
    node: Any = x
    while isinstance(node, torch.fx.Node) and node.op == "call_function":
        if node.target in _PASS_THROUGH:
            node = node.args[0]
            continue
        moved = _moved_placements(node)
        if moved is None:
            return None
        if _gathers(node):
            return f"{moved[0]} to {moved[1]}"
        node = node.args[1]  # a redistribute that gathers nothing (a ColwiseParallel input already Replicate)
    return None


def _fp8_weight_reads(graph: torch.fx.Graph) -> list[str]:
    """The uses of each :class:`Fp8Weight` input other than (through views) an fp8 matmul's weight."""
    reads = []
    for node in placeholders(graph):
        if not holds_fp8_weight(node.meta.get("val")):
            continue
        todo = [(node, user) for user in node.users]
        while todo:
            source, user = todo.pop()
            if user.op == "call_function" and user.target in WEIGHT_VIEWS:
                todo += [(user, u) for u in user.users]
            elif not (user.target is fp8_matmul and user.args[1] is source and user.args[0] is not source):
                module = innermost_module(user)
                reads.append(f"{node.meta.get(meta.PARAMETER) or node.name} by {user.target} in {module or 'the root'}")
    return reads


def _erase_unused_casts(graph: torch.fx.Graph, nodes: Sequence[torch.fx.Node]) -> None:
    """Erase the casts insert_casts inserted that the rewrite left without users (the weight's
    bf16 cast, unless another op still reads it), and the views of the weight they read."""
    todo = list(nodes)
    while todo:
        node = todo.pop()
        if node.users or node.op != "call_function":
            continue
        if is_inserted_cast(node) or node.target in WEIGHT_VIEWS:
            todo.extend(node.all_input_nodes)
            graph.erase_node(node)


def fp8_matmuls(
    gm: torch.fx.GraphModule, *, config: Fp8Config, policy: Policy, fake_mode: FakeTensorMode, device_type: str = "cpu"
) -> tuple[torch.fx.GraphModule, Fp8Record]:
    """Rewrite ``gm`` in place (contract in the module doc); returns it and what was done.

    Raises AmpFxError for a rowwise recipe on a device whose ``torch._scaled_mm`` takes no
    rowwise scales (torch 2.11's CPU kernel), before anything is rewritten."""
    for recipe in recipes(config):
        check_rowwise_support(recipe, device_type, "amp_fx")
    return gm, _Fp8Rewriter(gm, config, policy, fake_mode).run()
