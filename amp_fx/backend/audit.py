"""What a compiled model was asked against what it did: policy entries that matched no op, and
calls that captured no graph (with the fix for a wrapper Dynamo does not compile through).
Reported through the compiled model's :class:`~amp_fx._common.report.Reporter`.
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType

import torch

from amp_fx._common.dtype_names import dtype_name
from amp_fx._common.report import Reporter
from amp_fx._dist.capture import FSDP1_ALTERNATIVE, is_fsdp1, unsharded_class_name
from amp_fx.backend.splits import noted_by_caller
from amp_fx.fp8 import Fp8Config, Fp8Recipe
from amp_fx.kernels.blockwise_fp8 import blockwise_kernels_missing
from amp_fx.kernels.fp8_support import fp8_tensor_cores_missing
from amp_fx.kernels.mxfp8_matmul import mx_kernels_missing
from amp_fx.kernels.nvfp4 import fp4_kernels_missing
from amp_fx.low_precision import LowPrecision, label, recipe_text, recipes
from amp_fx.passes import meta
from amp_fx.passes.capture import autocast_hop, autocast_region, module_stack
from amp_fx.passes.fp8_matmuls import Fp8Decision
from amp_fx.passes.pipeline import GraphRecord
from amp_fx.policy import GROUPED_MM_OPS, CastClass, Policy, module_matches

__all__ = [
    "fp32_experts_text",
    "slow_fp8_text",
    "report_no_graph",
    "report_root_outside_graphs",
    "report_unused_policy",
    "wrapper_fix",
]


def report_unused_policy(
    records: Sequence[GraphRecord],
    policy: Policy,
    reporter: Reporter,
    *,
    fp8: Fp8Config | None = None,
    outside: Sequence[tuple[str, type]] = (),
) -> None:
    """Report each policy entry that decided no op of the graphs captured so far, and an fp8
    request honoured nowhere.

    A ``keep_fp32`` entry matches an op inside a module it selects; an ``op_classes`` entry
    matches an op it names; ``autocast_experts`` matches a grouped expert GEMM. Mixture-of-experts
    layers whose grouped GEMMs run in fp32 because no autocast table lists them are reported too,
    unless ``autocast_experts`` decides them (:func:`fp32_experts_text`). ``outside``: the
    modules (name, type) that ran outside every graph, already reported
    (:func:`report_root_outside_graphs`): a ``keep_fp32`` entry selecting one of them is told
    so, not told to name a module that runs ops. Called after a compiled model's first call.
    """
    nodes = [n for r in records for n in r.captured.graph.nodes if n.op == "call_function"]
    whole = {n: kind for n in nodes if (kind := _kept_whole(n)) is not None}
    stacks = {module_stack(n) for n in nodes}
    ops = {n.target.name() for n in nodes if isinstance(n.target, torch._ops.OpOverload)}
    for sel in policy.keep_fp32:
        label = repr(sel) if isinstance(sel, str) else sel.__name__
        inside = [
            kind
            for n, kind in whole.items()
            if any(module_matches(sel, path, mtype) for path, mtype in module_stack(n))
        ]
        if inside:
            reporter.did_less(
                ("keep_fp32 kept whole", label),
                (
                    f"amp_fx: Policy(keep_fp32=...) entry {label} selects ops inside "
                    f"{' and '.join(dict.fromkeys(inside))}, which amp_fx keeps whole: eager autocast casts "
                    f"the ops inside, so they are not kept in fp32. To keep them in fp32, run that code under "
                    f"torch.autocast(device_type, enabled=False) with fp32 inputs."
                ),
            )
        if any(module_matches(sel, path, mtype) for stack in stacks for path, mtype in stack):
            continue
        skipped = [path for path, mtype in outside if module_matches(sel, path, mtype)]
        reporter.did_less(
            ("keep_fp32", label),
            (
                f"amp_fx: Policy(keep_fp32=...) entry {label} selects {', '.join(skipped[:4])}, which ran "
                f"outside every captured graph (Dynamo skipped the frame that runs it: the report "
                f"above about the root's frame says why and how to fix it), so nothing was kept in fp32 for it; with "
                f"that fixed, the entry applies."
                if skipped
                else f"amp_fx: Policy(keep_fp32=...) entry {label} matched no op in the graphs captured "
                f"on the first call: no op ran inside such a module, so nothing was kept in fp32 "
                f"for it. Name a module that runs ops (names are under the module passed to "
                f"amp_fx.compile, as in its named_modules()), or drop the entry."
            ),
        )
    _report_fp8(records, policy, reporter, fp8, stacks)
    _report_experts(records, policy, reporter)
    _report_rnn_cells(nodes, reporter)
    kinds = list(dict.fromkeys(whole.values()))
    unseen = (
        f", outside {' and '.join(kinds)}, whose ops amp_fx keeps whole and eager autocast casts: "
        f"an entry does not reach them"
        if kinds
        else ""
    )
    for label, op_names, cls in policy.op_entries:
        if ops.intersection(op_names) or _unobservable(op_names, cls):
            continue
        reporter.did_less(
            ("op_classes", label),
            (
                f"amp_fx: Policy(op_classes=...) entry {label!r} -> CastClass.{cls.name} matched no "
                f"op in the graphs captured on the first call (the model does not call "
                f"{', '.join(op_names)}{unseen}), so it changed nothing. Check the op name and overload "
                f"(amp_fx.explain lists the ops of each graph), or drop the entry."
            ),
        )


def _report_rnn_cells(nodes: Sequence[torch.fx.Node], reporter: Reporter) -> None:
    """RNN modules captured where eager runs cuDNN's fused RNN: their cells run instead
    (``amp_fx.passes.capture._rnn_without_cudnn``), close to eager autocast but not bit for bit.
    ``nodes``: the call_function nodes of the captured graphs."""
    rnns = [
        path or "<root>"
        for n in nodes
        if meta.RNN_CELLS in n.meta
        for path, mtype in module_stack(n)
        if issubclass(mtype, torch.nn.RNNBase)
    ]
    if not rnns:
        return
    names = list(dict.fromkeys(rnns))
    reporter.did_less(
        ("rnn cells", tuple(names)),
        (
            f"amp_fx: {', '.join(names)} ({'an RNN module' if len(names) == 1 else 'RNN modules'}) run on CUDA "
            f"as torch's decomposition into cells (linears and pointwise ops, what torch.compile traces), "
            f"not as eager's cuDNN RNN, which cannot be captured: within rounding of eager autocast, not bit "
            f"for bit, and slower than cuDNN. To keep cuDNN, leave torch._dynamo.config.allow_rnn False (its "
            f"default): Dynamo then runs the RNN outside the graph, under eager autocast."
        ),
    )


def _kept_whole(node: torch.fx.Node) -> str | None:
    """What ``node`` keeps whole, where it is a region whose ops amp_fx does not see (eager
    autocast casts them, amp_fx/passes/capture.py): a functorch transform's region or a
    higher-order op; None for any other node."""
    if node.target is autocast_region:
        return "a functorch transform (torch.vmap, torch.func.grad, jvp)"
    if node.target is autocast_hop:
        return f"the higher-order op {node.args[2]}"
    return None


def _report_fp8(
    records: Sequence[GraphRecord],
    policy: Policy,
    reporter: Reporter,
    fp8: Fp8Config | None,
    stacks: set[tuple[tuple[str, type], ...]],
) -> None:
    """fp8 asked for and honoured nowhere in the graphs of the first call (each matmul's
    reason is in ``amp_fx.explain``); ``keep_out_of_fp8`` entries that matched no module, or
    that cannot matter because fp8 is off."""
    for sel in policy.keep_out_of_fp8:
        label = repr(sel) if isinstance(sel, str) else sel.__name__
        if fp8 is None:
            reporter.did_less(
                ("keep_out_of_fp8", "fp8 off"),
                (
                    f"amp_fx: Policy(keep_out_of_fp8=...) entry {label} changes nothing: fp8 is off. "
                    f"Pass fp8='tensorwise' (or another recipe) to train in fp8, or drop the entry."
                ),
            )
        elif not any(module_matches(sel, path, mtype) for stack in stacks for path, mtype in stack):
            reporter.did_less(
                ("keep_out_of_fp8", label),
                (
                    f"amp_fx: Policy(keep_out_of_fp8=...) entry {label} matched no op in the graphs "
                    f"captured on the first call, so no matmul was kept out of fp8 for it. Name a "
                    f"module that runs matmuls (names are under the module passed to amp_fx.compile, "
                    f"as in its named_modules()), or drop the entry."
                ),
            )
    if fp8 is None or not records or noted_by_caller():
        return
    decisions = [d for r in records if r.fp8 is not None for d in r.fp8.decisions]
    _report_unused_map(fp8, decisions, reporter)
    if any(d.converted for d in decisions):
        slow = slow_fp8_text(records)
        if slow is not None:
            reporter.notice(("fp8", "slow kernel"), slow)
        left = [d for d in decisions if d.left_out]
        if left:
            shown = "; ".join(
                f"{d.module or '<root>'} ({d.op}, {d.weight}): {d.reason.removeprefix('not fp8: ')}" for d in left[:4]
            )
            reporter.did_less(
                ("fp8", "left out"),
                (
                    f"amp_fx: {len(left)} matmul(s) with a parameter operand stay in {dtype_name(records[0].dtype)} "
                    f"under low_precision={recipe_text(fp8)}: {shown}{'; ...' if len(left) > 4 else ''}. "
                    f"amp_fx.explain(model, x, low_precision=...) lists each; Policy(keep_out_of_fp8=[module]) "
                    f"keeps them out on purpose and silences this; strict=True makes this an error."
                ),
            )
        sharded = [s for r in records if r.fp8 is not None for s in r.fp8.sharded_contractions]
        if sharded:
            reporter.did_less(
                ("fp8", "sharded contraction"),
                (
                    f"amp_fx: {len(sharded)} matmul(s) stay in {dtype_name(records[0].dtype)} under "
                    f"low_precision={recipe_text(fp8)}: their contraction dimension is sharded across ranks "
                    f"({'; '.join(sharded[:4])}), where DTensor has no sharding rule for a GEMM scaled per row "
                    f"or per block along it (tensor parallelism's RowwiseParallel). fp8='tensorwise' converts "
                    f"them; "
                    f"strict=True makes this an error."
                ),
            )
        gathered = [g for r in records if r.fp8 is not None for g in r.fp8.gathered_activations]
        if gathered:
            if Fp8Recipe.TENSORWISE in recipes(fp8):
                why = (
                    "another op reads the gathered input too (a matmul kept out of fp8, or not a matmul), "
                    "and needs it in high precision"
                )
            else:
                why = (
                    f"low_precision={recipe_text(fp8)} scales the input in rows or blocks, and the weight gradient's "
                    f"GEMM along the other dimension, which needs the gathered input; fp8='tensorwise' gathers e4m3"
                )
            reporter.did_less(
                ("fp8", "activation all-gather"),
                (
                    f"amp_fx: the input of {len(gathered)} fp8 matmul(s) is all-gathered before its fp8 cast "
                    f"({'; '.join(gathered[:4])}): sequence parallelism's all-gather moves the activation in its "
                    f"own dtype, as eager autocast does, not in fp8 (1 byte per element) as amp_fx does where "
                    f"it can: {why}. The values are the same, the bytes 2-4x; strict=True makes this an error."
                ),
            )
        return
    if not decisions:
        found = (
            "no graph of the first call has a matmul with a parameter operand "
            "(nn.Linear, F.linear, Conv1D's addmm, x @ W)"
        )
    else:
        reasons = Counter(d.reason.removeprefix("not fp8: ").split(";")[0] for d in decisions)
        found = f"none of its {len(decisions)} matmuls with a parameter operand can run in fp8: " + "; ".join(
            f"{n} x {why}" for why, n in reasons.most_common(3)
        )
    reporter.did_less(
        ("fp8", "nothing converted"),
        (
            f"amp_fx: low_precision={recipe_text(fp8)} was asked, but {found}. Everything runs in "
            f"{dtype_name(records[0].dtype)}. amp_fx.explain(model, x, fp8=...) gives each matmul's reason."
        ),
    )


def _report_unused_map(fp8: Fp8Config, decisions: Sequence[Fp8Decision], reporter: Reporter) -> None:
    """Each entry of a per-module map (``LowPrecision.modules``) that chose the recipe of no
    matmul in the graphs of the first call (a name not the model's is reported at compile time)."""
    if not isinstance(fp8, LowPrecision):
        return
    used = {d.selector for d in decisions}
    for sel, recipe in fp8.modules.items():
        if label(sel) in used:
            continue
        reporter.did_less(
            ("low_precision map", label(sel)),
            (
                f"amp_fx: low_precision's map entry {label(sel)} -> {recipe.value if recipe else None!r} decided "
                f"no matmul with a parameter operand in the graphs captured on the first call (no such matmul "
                f"runs inside the modules it selects, or a more specific entry decides them). Name a module that "
                f"runs matmuls (as in the model's named_modules(); amp_fx.explain lists each matmul's module "
                f"and recipe), or drop the entry."
            ),
        )


def slow_fp8_text(records: Sequence[GraphRecord]) -> str | None:
    """The note that the converted matmuls have no fast kernel on the graphs' device, or None.

    One rule for every recipe: where the kernel computes the recipe's numerics but slower than
    bf16 (MXFP8 emulated in bf16 without Blackwell's MX kernels, blockwise in fp32 without
    Hopper's blockwise GEMM; tensorwise and rowwise through
    the CPU's reference ``torch._scaled_mm``), amp_fx says so once, as a notice: nothing asked is
    left undone, so strict mode does not refuse it (and CPU runs of fp8 stay possible there)."""
    converted = {(d.recipe, r.device_type) for r in records if r.fp8 is not None for d in r.fp8.converted if d.recipe}
    for recipe, device_type in sorted(converted, key=lambda c: (c[0].value, c[1])):
        kernels_missing, consequence = _SLOW_KERNELS[recipe]
        if (missing := kernels_missing(device_type)) is not None:
            return f"amp_fx: fp8={recipe.value!r} {consequence.format(missing=missing)}"
    return None


_FP8_REFERENCE_KERNEL = (
    fp8_tensor_cores_missing,
    "runs without fp8 tensor cores here: {missing}. The recipe's numerics, slower than bf16 (for "
    "developing and testing fp8 on this machine); fp8 is fast on GPUs with compute capability 8.9+ "
    "(L4, L40S, H100, H200, B200). Here dtype='bf16' alone trains faster.",
)
_SLOW_KERNELS: Mapping[Fp8Recipe, tuple[Callable[[str], str | None], str]] = MappingProxyType(
    {
        Fp8Recipe.TENSORWISE: _FP8_REFERENCE_KERNEL,
        Fp8Recipe.ROWWISE: _FP8_REFERENCE_KERNEL,
        Fp8Recipe.ROWWISE_WITH_GW_HP: _FP8_REFERENCE_KERNEL,
        Fp8Recipe.MXFP8: (
            mx_kernels_missing,
            "runs emulated here: {missing}. Each MXFP8 GEMM is dequantized to bf16 and multiplied in "
            "bf16 (torchao's KernelPreference.EMULATED): MXFP8's numerics, slower than bf16. Train on "
            "a B200/GB200 for MXFP8 kernels; on an H100/H200 use fp8='rowwise' or 'tensorwise' for fp8 speed.",
        ),
        Fp8Recipe.BLOCKWISE: (
            blockwise_kernels_missing,
            "runs emulated here: {missing}. Each blockwise GEMM's operands are quantized as the recipe "
            "says, dequantized to fp32 and multiplied in fp32: the recipe's quantization, slower than "
            "bf16. Train on an H100/H200 for its fp8 GEMMs.",
        ),
        Fp8Recipe.NVFP4: (
            fp4_kernels_missing,
            "runs emulated here: {missing}. Each NVFP4 GEMM is dequantized to fp32 (e2m1 times its e4m3 "
            "block scale, exact) and multiplied in fp32, then scaled by the tensor scales (as "
            "TransformerEngine's reference GEMM): NVFP4's numerics, slower than bf16. Train on a "
            "B200/GB200 for fp4 tensor cores.",
        ),
    }
)
"""Each recipe's kernel check (None where its fast GEMM runs on a device type, else why not) and
what :func:`slow_fp8_text` says where it is missing (``{missing}``: the check's reason)."""


def _report_experts(records: Sequence[GraphRecord], policy: Policy, reporter: Reporter) -> None:
    fp32 = fp32_experts_text(records, policy)
    if fp32 is not None and not noted_by_caller():  # explain shows it as a note
        reporter.did_less(("autocast_experts", "fp32"), fp32)
    left = [
        e
        for r in records
        for e in r.inserted.experts
        if policy.autocast_experts and not e.lowered and e.dtype == torch.float32 and r.dtype != torch.bfloat16
    ]
    if left:
        reporter.did_less(
            ("autocast_experts", "not bf16"),
            (
                f"amp_fx: Policy(autocast_experts=True) runs grouped expert GEMMs in bf16 only (torch compiles "
                f"aten._grouped_mm for bf16 operands only), but dtype is {dtype_name(records[0].dtype)}: the experts "
                f"{', '.join(dict.fromkeys(e.module for e in left))} stay in float32. Compile with dtype='bf16' to "
                f"run them in bf16."
            ),
        )
    if policy.autocast_experts is not None and records and not any(r.inserted.experts for r in records):
        reporter.did_less(
            ("autocast_experts", "unused"),
            (
                f"amp_fx: Policy(autocast_experts={policy.autocast_experts}) matched no grouped expert GEMM "
                f"({', '.join(GROUPED_MM_OPS)}) in the graphs captured on the first call, so it changed "
                f"nothing. Experts written as one nn.Linear each are linears, which autocast already runs "
                f"in the low dtype; drop the entry."
            ),
        )


def fp32_experts_text(records: Sequence[GraphRecord], policy: Policy | None) -> str | None:
    """What to say about mixture-of-experts layers whose grouped GEMMs run in float32 because no
    autocast table lists their op (:data:`~amp_fx.policy.GROUPED_MM_OPS`), and the switch that
    moves them; None when there are none, or when the policy decides them (``autocast_experts``
    set, or an ``op_classes`` entry). The compiled model's warning and ``explain``'s note."""
    policy = policy if policy is not None else Policy()
    if policy.autocast_experts is not None:
        return None
    found = [
        e
        for r in records
        if r.fallback is None
        for e in r.inserted.experts
        if e.dtype == torch.float32 and not e.lowered and e.op.replace(".", "::", 1) not in policy.op_classes
    ]
    if not found:
        return None
    modules = list(dict.fromkeys(e.module or "<root>" for e in found))
    shown = ", ".join(modules[:6]) + (f" and {len(modules) - 6} more" if len(modules) > 6 else "")
    ops = ", ".join(dict.fromkeys(e.op for e in found))
    low = dtype_name(records[0].dtype)
    return (
        f"amp_fx: the mixture-of-experts layers {shown} run their grouped expert GEMMs ({ops}) in "
        f"float32: no autocast table lists the op, so eager torch.autocast, torch.compile and amp_fx "
        f"(bitwise with eager autocast) all run the experts in their weights' dtype. Pass "
        f"policy=amp_fx.Policy(autocast_experts=True) to run them in {low}, each as one "
        f"aten._grouped_mm (no host sync), or Policy(autocast_experts=False) to keep them in float32 "
        f"without this warning."
    )


def report_no_graph(reporter: Reporter, target: object) -> None:
    """Report a call of a compiled model or function that captured and ran no graph."""
    what = (
        type(target).__name__ if isinstance(target, torch.nn.Module) else getattr(target, "__qualname__", repr(target))
    )
    fix = wrapper_fix(target) or (
        "Dynamo skipped or gave up on every frame of the call (TORCH_LOGS=graph_breaks,"
        "recompiles says why); compile the module that does the work, or run it under "
        "torch.autocast if it cannot be compiled."
    )
    reporter.did_less(
        ("no_graph",),
        (
            f"amp_fx.compile({what}): this call captured and ran no graph, so it ran as eager "
            f"autocast (the same values, nothing compiled). {fix}"
        ),
    )


def report_root_outside_graphs(
    records: Sequence[GraphRecord],
    root: torch.nn.Module,
    own: Sequence[str],
    reporter: Reporter,
    *,
    in_regions: bool = False,
) -> list[tuple[str, type]]:
    """Report the FSDP2 root's own modules (``own``: :func:`amp_fx._dist.capture.root_state_modules`)
    that no op of the graphs captured so far ran inside: Dynamo skipped the frame that runs them
    (a graph break inside the loop over the sharded blocks), so they ran as eager autocast, where
    the Policy does not reach. ``in_regions``: the units are the model's compiled regions
    (``amp_fx/backend/regions.py``; each block call breaks the graph alike), and the fix is
    worded for them. Called after the first call that ran graphs. Returns those modules and every
    module under them, (name, type), for :func:`report_unused_policy`."""
    nodes = [n for r in records for n in r.captured.graph.nodes if n.op == "call_function"]
    stacks = [module_stack(n) for n in nodes]
    inside = {path for stack in stacks for path, _ in stack}
    missing = [name for name in own if (name not in inside if name else all(stacks))]
    if not missing:
        return []
    shown = ", ".join(name or "<root> (its own parameters and buffers)" for name in missing[:6]) + (
        f" and {len(missing) - 6} more" if len(missing) > 6 else ""
    )
    if in_regions:
        reporter.did_less(
            ("regions_root_frame",),
            (
                f"amp_fx.compile({type(root).__name__}) in compiled regions: the first call's captured graphs ran "
                f"no op of {shown}, of the root outside its repeated blocks and the modules compiled as units. "
                f"The root's forward calls the blocks, each call breaks Dynamo's graph (each block is compiled on "
                f"its own), and a break inside a loop (for block in self.blocks) makes Dynamo skip the whole "
                f"frame: those ops ran outside every compiled graph, as eager autocast (eager autocast's values, "
                f"not compiled; amp_fx's Policy does not apply to them). Fix: move the loop over the blocks into "
                f"a method of its own (def run_blocks(self, x): for block in self.blocks: x = block(x); return x), "
                f"so that Dynamo skips only that method's frame, or compile with regions=False (the whole model "
                f"as one graph)."
            ),
        )
    else:
        _report_fsdp2_root_frame(root, missing, shown, reporter)
    return [(path, type(m)) for name in missing for path, m in root.get_submodule(name).named_modules(prefix=name)]


def _report_fsdp2_root_frame(root: torch.nn.Module, missing: Sequence[str], shown: str, reporter: Reporter) -> None:
    reporter.did_less(
        ("fsdp2_root_frame",),
        (
            f"amp_fx.compile({unsharded_class_name(root)}) under FSDP2: the first call's captured graphs ran no op of "
            f"{shown}, of the root outside its fully_shard-ed units. The root's forward calls those units, each call "
            f"breaks Dynamo's graph (FSDP2's hooks are not traced), and a break inside a loop (for block in "
            f"self.blocks, nn.Sequential) makes Dynamo skip the whole frame: the root's frame (or that of the module "
            f"between the root and the units that loops over them) ran without a graph. Those ops ran as eager "
            f"autocast: their values are eager autocast's, but amp_fx's Policy (keep_fp32, op_classes) does not apply "
            f"to them and fp8 does not reach them. Fix: move the loop over the units into a method of its own "
            f"(def run_blocks(self, x): for block in self.blocks: x = block(x); return x), so that Dynamo skips only "
            f"that method's frame and captures the rest of forward; or, where forward cannot change (nn.Sequential, a "
            f"library model), fully_shard those modules too, before fully_shard(model), so that amp_fx compiles each "
            f"as a unit of its own. A module that forward never calls is named too (no graph can show that it ran): "
            f"fully_shard it or drop it.{_tied_fix(root, missing)}"
        ),
    )


def _tied_fix(root: torch.nn.Module, names: Sequence[str]) -> str:
    """For each of ``names`` (modules of ``root``) that shares a parameter with a module outside it
    (tied embeddings: GPT-2's ``wte`` and ``lm_head``), the ``fully_shard`` call that takes both:
    FSDP2 refuses to shard one of them alone ("use fully_shard([module_a, module_b])")."""
    holders: dict[int, list[str]] = {}
    for path, module in root.named_modules(remove_duplicate=False):
        for _, p in module.named_parameters(recurse=False, remove_duplicate=False):
            holders.setdefault(id(p), []).append(path)
    fixes, said = [], set()
    for name in filter(None, names):
        mine = {id(p) for p in root.get_submodule(name).parameters()}
        partners = sorted(
            {
                path
                for key in mine
                for path in holders.get(key, [])
                if path and path != name and not path.startswith(name + ".")
            }
        )
        if partners and name not in said:  # a pair both named: one call for both
            said.update(partners)
            units = ", ".join(f"model.{path}" for path in [name, *partners])
            fixes.append(
                f" {name} shares a parameter with {', '.join(partners)} (tied "
                f"weights), and FSDP2 takes tied parameters in one unit: fully_shard([{units}])."
            )
    return "".join(fixes)


def wrapper_fix(target: object) -> str | None:
    """What to do instead when ``target`` is a distributed wrapper Dynamo does not compile through."""
    try:
        from torch.nn.parallel import DistributedDataParallel
    except ImportError:  # pragma: no cover - torch built without distributed
        return None
    if isinstance(target, DistributedDataParallel):
        return (
            "Dynamo captures nothing through this DistributedDataParallel wrapper; compile "
            "the model inside it instead: DDP(amp_fx.compile(model))."
        )
    if isinstance(target, torch.nn.Module) and (
        is_fsdp1(target) or any(getattr(p, "_fsdp_flattened", False) for p in target.parameters())
    ):
        # FSDP1 around the model, or the model inside FSDP1 (its parameters are views of
        # FSDP1's FlatParameter, marked _fsdp_flattened).
        return (
            f"{type(target).__name__} is sharded by FullyShardedDataParallel (FSDP1), whose flat "
            f"parameters and hooks Dynamo does not capture; it trains as eager FSDP1 under autocast. "
            f"To compile it, {FSDP1_ALTERNATIVE}."
        )
    fsdp_types: list[type] = []
    try:
        from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

        fsdp_types = [FSDPModule, FullyShardedDataParallel]
    except ImportError:  # pragma: no cover
        pass
    if fsdp_types and isinstance(target, tuple(fsdp_types)):
        return (
            f"Dynamo captured no graph of this FSDP2-sharded {type(target).__name__}: it trained as "
            "eager FSDP2 under autocast. amp_fx compiles an FSDP2 model unit by unit, sharded first: "
            "fully_shard each block, then the root, then amp_fx.compile(model) (docs/distributed.md); "
            "TORCH_LOGS=graph_breaks,recompiles says why Dynamo skipped the units' frames."
        )
    return None


def _unobservable(op_names: Sequence[str], cls: CastClass) -> bool:
    """An entry that moves composite ops to NONE lets them decompose: the op itself never appears."""
    registered = _composite_ops()
    return cls is CastClass.NONE and all(n in registered for n in op_names)


@functools.cache
def _composite_ops() -> frozenset[str]:
    return frozenset(torch._C._dispatch_get_registrations_for_dispatch_key("CompositeImplicitAutograd"))
