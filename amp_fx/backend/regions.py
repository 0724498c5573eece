"""Compiled regions: each repeated block of a model captured, rewritten and compiled once.

A transformer is one block class repeated N times; compiled as one graph, its first step grows
with N (capture, amp_fx's passes and inductor all see every block). Compiled in regions, the
model's call runs eagerly (``module.__call__``) and each *unit* is compiled: every block found by
:func:`repeated_blocks`, the root's stateful modules outside the blocks (embeddings, final norm,
head: :func:`outside_modules`), and the root's own forward. The blocks of one class share one
compiled function (one code object: :func:`amp_fx._dist.capture.unit_call`, the rule amp_fx
already applies to FSDP2's units), so with Dynamo's ``inline_inbuilt_nn_modules`` (on by default
since torch 2.5) the second block's call hits the first block's cache entry: its parameters are
graph inputs, not constants. Capture, the passes and the downstream compile run once per block
class, not once per block (``tests/backend/test_regions.py::test_blocks_compiled_once``).

What stays as it was:

* the policy per module: a block whose policy differs from its siblings' (``keep_fp32`` or
  ``keep_out_of_fp8`` naming it or a module inside it) is a group of its own
  (:func:`block_groups`), so the graph its group shares was decided for names that the policy
  treats alike;
* module names: a shared graph is named after the block that compiled it (``model.layers.0``);
  the overflow watch renames its ops for the block that runs it (``model.layers.4``), by the
  running unit (``amp_fx._common.running_unit``);
* values: the code between the units runs as eager autocast does (the ambient autocast of the
  call), and each unit's graph as amp_fx compiles it, bitwise with eager autocast under
  ``aot_eager`` (``tests/backend/test_regions.py``, ``tests/models/test_real_models.py``).

Where regions are not used (``amp_fx.compile(regions=...)``): models under DDP/FSDP2 (their units
already are the blocks), functions, and models without a repeated block.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

from amp_fx._common.progress import progress_log
from amp_fx._common.report import Reporter
from amp_fx.policy import Policy

__all__ = ["Regions", "repeated_blocks", "outside_modules", "block_groups", "find_regions", "check_gradient_layout"]

_CONTAINERS = (torch.nn.ModuleList, torch.nn.Sequential)


def _owns_state(module: torch.nn.Module) -> bool:
    return any(True for _ in module.parameters()) or any(True for _ in module.buffers())


def _is_block(module: torch.nn.Module) -> bool:
    """A module worth a region: it holds state and has submodules (a repeated ``nn.Linear`` of an
    ``nn.Sequential`` MLP is one op, not a block: a region around it would only cut fusion)."""
    return _owns_state(module) and any(True for _ in module.children())


def _hinted_classes(model: torch.nn.Module) -> set[str]:
    """The block classes the model's library names: transformers' ``_no_split_modules``,
    diffusers' ``_repeated_blocks``."""
    hinted: set[str] = set()
    for attr in ("_no_split_modules", "_repeated_blocks"):
        found = getattr(model, attr, None)
        if isinstance(found, (list, tuple, set)):
            hinted |= {c for c in found if isinstance(c, str)}
    return hinted


def repeated_blocks(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The repeated blocks of ``model`` by name under it, in ``named_modules`` order: children of a
    ``ModuleList``/``Sequential`` (the root itself may be one) whose class appears at least twice
    there and that are blocks (hold state, have submodules). Where the model's library names its block classes
    (``_no_split_modules``, ``_repeated_blocks``) and one of them repeats, only those classes. The
    search does not look inside a block found (its own repeated sublayers are part of it)."""
    found: list[tuple[str, torch.nn.Module]] = []
    seen: set[int] = set()

    def walk(module: torch.nn.Module, prefix: str) -> None:
        if isinstance(module, _CONTAINERS):
            counts = Counter(type(c) for c in module.children())
            for name, child in module.named_children():
                if id(child) in seen:
                    continue
                seen.add(id(child))
                if counts[type(child)] >= 2 and _is_block(child):
                    found.append((prefix + name, child))
                else:
                    walk(child, f"{prefix}{name}.")
            return
        for name, child in module.named_children():
            if id(child) not in seen:
                seen.add(id(child))
                walk(child, f"{prefix}{name}.")

    walk(model, "")
    hinted = _hinted_classes(model)
    if hinted and any(type(b).__name__ in hinted for _, b in found):
        found = [(n, b) for n, b in found if type(b).__name__ in hinted]
    return found


def outside_modules(model: torch.nn.Module, blocks: Sequence[torch.nn.Module]) -> list[torch.nn.Module]:
    """The largest submodules of ``model`` that hold state and contain no block (a Llama's
    ``embed_tokens``, ``norm``, ``rotary_emb`` and ``lm_head``), compiled as units of their own.

    The root's forward calls the blocks, and each call is a graph break (the block's compiled
    forward is not traced into the root's graph); a break inside a loop (``for block in
    self.blocks``, ``nn.Sequential``) can make Dynamo skip the whole frame, and the root's own
    modules would then run as eager autocast, out of amp_fx's reach (checked: a custom loop over a
    ``ModuleList`` on torch 2.13). Compiled as units, they are captured wherever the root's frame
    runs, as FSDP2's root Linears are (``amp_fx._dist.capture.root_linears``)."""
    inside = {id(b) for b in blocks}
    holds_block: set[int] = set()
    for m in model.modules():
        if any(id(d) in inside for d in m.modules() if d is not m):
            holds_block.add(id(m))
    found: list[torch.nn.Module] = []
    seen: set[int] = set()

    def walk(module: torch.nn.Module) -> None:
        for child in module.children():
            if id(child) in inside or id(child) in seen:
                continue
            seen.add(id(child))
            if id(child) in holds_block:
                walk(child)
            elif _owns_state(child):
                found.append(child)

    walk(model)
    return found


def _policy_signature(name: str, policy: Policy) -> tuple[tuple[str, str], ...]:
    """What the policy says by name about block ``name`` and the modules inside it, with names
    relative to the block: equal for two blocks the policy treats alike."""
    said = []
    for field in ("keep_fp32", "keep_out_of_fp8"):
        for entry in getattr(policy, field):
            if not isinstance(entry, str):
                continue  # a class: the same for every block of one class
            if entry == name:
                said.append((field, ""))
            elif entry.startswith(name + "."):
                said.append((field, entry[len(name) + 1 :]))
    return tuple(sorted(said))


@dataclass(frozen=True)
class _Group:
    cls: type
    signature: tuple[tuple[str, str], ...]


def block_groups(blocks: Sequence[tuple[str, torch.nn.Module]], policy: Policy) -> dict[int, tuple[object, str]]:
    """Each block's group (by ``id``) and its name for Dynamo's code object: blocks of one class
    that the policy treats alike share a group; a block the policy singles out (``keep_fp32`` on
    ``layers.3``) gets a group of its own, named ``<Class>_<n>``."""
    groups: dict[_Group, str] = {}
    out: dict[int, tuple[object, str]] = {}
    for name, block in blocks:
        group = _Group(type(block), _policy_signature(name, policy))
        if group not in groups:
            same_class = sum(1 for g in groups if g.cls is group.cls)
            groups[group] = type(block).__name__ + (f"_{same_class}" if same_class else "")
        out[id(block)] = (group, groups[group])
    return out


@dataclass(frozen=True)
class Regions:
    """A model's compiled regions: its repeated blocks by name and their groups, and the units
    compiled around them (the root first, then the outside modules)."""

    blocks: tuple[tuple[str, torch.nn.Module], ...]
    groups: dict[int, tuple[object, str]]
    outside: tuple[torch.nn.Module, ...]

    def units(self, root: torch.nn.Module) -> list[torch.nn.Module]:
        return [root, *(b for _, b in self.blocks), *self.outside]

    def group_of(self, unit: torch.nn.Module) -> tuple[object, str]:
        """The group of a unit: a block's from :func:`block_groups`; any other unit its own
        (by identity: two outside modules of one class are not assumed alike)."""
        found = self.groups.get(id(unit))
        return found if found is not None else (id(unit), f"{type(unit).__name__}_{id(unit):x}")

    def describe(self) -> list[str]:
        """One line per group: ``LlamaDecoderLayer: compiled once, reused by 31 blocks``."""
        count: Counter[str] = Counter(name for _, name in self.groups.values())
        first: dict[str, str] = {}
        for name, block in self.blocks:
            first.setdefault(self.groups[id(block)][1], name)
        lines = []
        for group, n in count.items():
            reuse = f"reused by {n - 1} block{'s' if n != 2 else ''}" if n > 1 else "a block of its own (policy)"
            lines.append(f"{group} ({first[group]}): compiled once, {reuse}")
        return lines


def _convolutions(blocks: Sequence[tuple[str, torch.nn.Module]]) -> list[str]:
    return [
        f"{name}.{sub}" if sub else name
        for name, block in blocks
        for sub, m in block.named_modules()
        if isinstance(m, torch.nn.modules.conv._ConvNd)
    ]


def _not_shown_safe(blocks: Sequence[tuple[str, torch.nn.Module]], policy: Policy, fp8: object) -> str | None:
    """Why ``regions=None`` compiles these blocks as one graph, or None where regions are shown safe."""
    convolutions = _convolutions(blocks)
    if convolutions:
        return (
            f"its repeated blocks hold convolutions ({convolutions[0]}), where compiled regions are not bitwise "
            f"with eager autocast (channels-last block outputs, docs/regions.md)"
        )
    if fp8 is not None or policy.op_classes:
        # Code of the root's forward that Dynamo skips runs as eager autocast, out of their reach
        # (a tied head written as F.linear(h, self.emb.weight) after the loop over the blocks).
        what = "low_precision (fp8)" if fp8 is not None else "Policy(op_classes=...)"
        return f"{what} acts on single ops, and code around compiled regions that Dynamo skips is out of its reach"
    return None


def find_regions(
    model: torch.nn.Module, policy: Policy, *, proven_only: bool = False, label: str = "", fp8: object = None
) -> Regions | None:
    """The regions of ``model``, or None where it has no repeated block. ``proven_only``
    (``amp_fx.compile(regions=None)``): None too where a block holds a convolution: in regions,
    transformers' ConvNext and diffusers' UNets differ from eager autocast by a rounding step in
    some gradients (1 ulp of fp32 or bf16; tests/models ``test_compile_bitwise`` under
    ``regions=True``). ConvNext's cause: its blocks' outputs are channels last and their gradients
    arrive contiguous, and AOTAutograd restrides them to the output's layout before the region's
    backward (:func:`check_gradient_layout`, which says so wherever it happens; the UNets' cause is
    not confirmed). Convolutional models are where such layouts are the rule, so they compile as
    one graph, and the progress lines say so. With ``fp8`` or ``Policy.op_classes`` too (their reach
    into code of the root's forward that Dynamo skips is not checked)."""
    blocks = repeated_blocks(model)
    if not blocks:
        return None
    why = _not_shown_safe(blocks, policy, fp8) if proven_only else None
    if why is not None:
        progress_log.info(
            "amp_fx: %s: compiled as one graph: %s; amp_fx.compile(regions=True) compiles its blocks once", label, why
        )
        return None
    groups = block_groups(blocks, policy)
    return Regions(tuple(blocks), groups, tuple(outside_modules(model, [b for _, b in blocks])))


def _same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors of one shape lay out their elements alike (the strides of dimensions
    longer than 1 equal): a reduction over either reads them in the same order."""
    return all(x == y for x, y, n in zip(a.stride(), b.stride(), a.shape) if n > 1)


def check_gradient_layout(name: str, out: Any, reporter: Reporter) -> None:
    """Watch the first backward through a region's output ``out`` (unit ``name``): where the
    gradient arrives laid out unlike the output (ConvNext's channels-last block output, whose
    gradient arrives contiguous from the pooling's backward), AOTAutograd restrides it to the
    output's layout before the region's backward (it traced that backward for the output's
    strides), while eager autocast's backward reads it as it arrived: reductions in the block's
    backward (a layer-scale parameter's gradient) then sum in another order, 1 ulp off eager
    autocast (measured: transformers' ConvNext, tests/backend/test_regions.py). Said once, with
    the fix; a model whose block outputs and gradients share a layout (transformers' decoders) is
    unaffected. The root (``name`` empty) is not watched: its output's gradient is the user's, and
    the whole-graph compile lays it out alike."""
    if not name:
        return
    for t in tree_flatten(out)[0]:
        if not (isinstance(t, torch.Tensor) and t.requires_grad and t.dim() > 1):
            continue

        def hook(grad: torch.Tensor, t: torch.Tensor = t) -> None:
            # An expanded gradient (stride 0: a .sum() loss's) is copied dense before any graph's
            # backward, the whole-graph compile's at the model's output alike: not a difference.
            overlaps = torch._debug_has_internal_overlap(grad) == 1
            if grad.shape == t.shape and not overlaps and not _same_layout(grad, t):
                reporter.did_less(
                    ("regions gradient layout",),
                    (
                        f"amp_fx: in compiled regions, the gradient reaching the output of {name} (shape "
                        f"{tuple(t.shape)}, strides {t.stride()}) arrives with strides {grad.stride()}: "
                        f"AOTAutograd lays it out as the output before the region's backward, eager autocast "
                        f"reads it as it arrives, so gradients in the block can differ from eager autocast's "
                        f"by a rounding step (reductions sum in another order). amp_fx.compile(regions=False) "
                        f"compiles the whole model as one graph, bitwise with eager autocast under aot_eager."
                    ),
                )

        t.register_hook(hook)


def log_regions(label: str, regions: Regions) -> None:
    """The progress lines (``amp_fx.progress``): which block classes are compiled once, and how
    many blocks reuse each."""
    for line in regions.describe():
        progress_log.info("amp_fx: %s: %s", label, line)
