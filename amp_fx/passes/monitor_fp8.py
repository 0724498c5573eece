"""The ``monitor_fp8`` pass: a copy of a graph that also computes each converted GEMM's quantization
statistics (``amp_fx.compile(..., monitor=amp_fx.Fp8Monitor(...))``, issue 64).

Assumes the graph of ``fp8_matmuls`` (and the passes after it): each converted matmul is one call of
:func:`~amp_fx.kernels.fp8_matmul.fp8_matmul` or :func:`~amp_fx.kernels.nvfp4.nvfp4_linear_flags`
carrying ``meta["amp_fx_fp8"]`` (its :class:`~amp_fx.passes.fp8_matmuls.Fp8Decision`), with
``meta["val"]`` on every node.

On a copy of the graph (the original is the plain graph, compiled as it is), for the ``i``-th
monitored GEMM:

* its input and weight, as the fp8 call takes them (the input in the autocast dtype, the weight as
  ``[K, N]``), go through :func:`~amp_fx.kernels.monitor_tap.operand_stats`, and the two rows are
  copied into row ``i`` of a new input, ``fwd`` (float64 ``[G, 2, F]``): an input mutation that
  AOTAutograd keeps in the compiled forward (as a BatchNorm's running statistics);
* its output goes through :func:`~amp_fx.kernels.monitor_tap.grad_tap` with a second new input,
  ``sink`` (float64 ``[G, F]``, requires grad): the backward computes the statistics of the
  output's gradient there, in the compiled backward graph, and autograd delivers them as
  ``sink.grad``.

The two inputs come last, after every input of the plain graph; the backend preallocates them
(:class:`amp_fx.monitor.state.GraphStats`) and passes them on logging steps only.

Not covered (listed in :attr:`MonitoredGraph.uncovered`, which the backend reports): the grouped
expert GEMMs, and an fp8 matmul given its input cast beforehand (sequence parallelism's fp8
all-gather), whose high-precision input the graph does not hold.

Guarantees: the values the graph computes are unchanged (the statistics only read; the tap
returns its input as a view), ``meta["val"]`` on every new node, the graph lints; the original
graph is not touched.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensorMode

from amp_fx.fp8 import Fp8Config, Fp8Recipe
from amp_fx.kernels.fp8_grouped_mm import fp8_grouped_mm
from amp_fx.kernels.fp8_matmul import fp8_matmul
from amp_fx.kernels.monitor_tap import STAT_NAMES, grad_tap, operand_stats
from amp_fx.kernels.mxfp8_matmul import mxfp8_grouped_mm
from amp_fx.kernels.nvfp4 import nvfp4_grouped_mm, nvfp4_linear_flags
from amp_fx.passes import meta
from amp_fx.passes.fp8_matmuls import Fp8Decision
from amp_fx.passes.fx_edit import add_node, copy_graph_module, placeholders
from amp_fx.passes.fx_edit import val as _val

__all__ = ["monitor_fp8", "MonitoredGraph", "MonitoredGemm", "OPERANDS"]

aten = torch.ops.aten

OPERANDS = ("input", "weight", "grad_output")
"""A GEMM's operands, in the order of its statistics rows (forward two, then the backward's)."""

_GROUPED = (fp8_grouped_mm, mxfp8_grouped_mm, nvfp4_grouped_mm)


@dataclass(frozen=True)
class MonitoredGemm:
    """One converted GEMM the monitored graph computes statistics for (row ``row`` of its buffers)."""

    row: int
    decision: Fp8Decision
    node: str
    """The fp8 call's node name in the graph."""

    @property
    def name(self) -> str:
        """The GEMM as the report names it: its module, else its weight."""
        return self.decision.module or self.decision.weight


@dataclass
class MonitoredGraph:
    """The copy with the statistics, and what it covers."""

    gm: torch.fx.GraphModule
    gemms: list[MonitoredGemm] = field(default_factory=list)
    uncovered: list[str] = field(default_factory=list)
    """The converted GEMMs without statistics: ``"<module> (<why>)"``."""
    device: torch.device | None = None
    """The device of the GEMMs' operands (where the buffers go)."""


def _operands(node: torch.fx.Node, nvfp4: tuple[bool, bool, bool]) -> tuple[object, ...] | str:
    """``(x, w, recipe, rht, sr, w2d)`` of a converted call, or why it is not covered."""
    if node.target is fp8_matmul:
        if len(node.args) > 3 or node.kwargs:
            return "its input is cast to fp8 before the matmul (fp8 all-gather): the graph holds no bf16 input"
        x, w, recipe = node.args
        return (x, w, recipe, *nvfp4)
    if node.target is nvfp4_linear_flags:
        x, w, *flags = node.args
        return (x, w, Fp8Recipe.NVFP4, *flags)
    return "a grouped expert GEMM: the monitor covers dense GEMMs only"


def monitor_fp8(gm: torch.fx.GraphModule, *, config: Fp8Config, fake_mode: FakeTensorMode) -> MonitoredGraph:
    """The monitored copy of ``gm`` (see the module docstring); ``gm`` is left as it is."""
    copy = copy_graph_module(gm)
    graph = copy.graph
    calls = [n for n in graph.nodes if n.op == "call_function" and isinstance(n.meta.get(meta.FP8), Fp8Decision)]
    calls = [n for n in calls if n.target in (fp8_matmul, nvfp4_linear_flags, *_GROUPED)]
    nv = config.nvfp4_switches
    flags = (nv.rht, nv.stochastic_rounding, nv.weight_2d)
    covered: list[tuple[torch.fx.Node, tuple[object, ...]]] = []
    result = MonitoredGraph(copy)
    for node in calls:
        found = _operands(node, flags)
        decision = node.meta[meta.FP8]
        if isinstance(found, str):
            result.uncovered.append(f"{decision.module or decision.weight} ({found})")
            continue
        covered.append((node, found))
    if not covered:
        return result
    g, f = len(covered), len(STAT_NAMES)
    last = placeholders(graph)[-1]
    with graph.inserting_after(last):
        fwd = graph.placeholder("amp_fx_monitor_fwd")
    with graph.inserting_after(fwd):
        sink = graph.placeholder("amp_fx_monitor_sink")
    device = _val(covered[0][1][0]).device
    with fake_mode:
        fwd.meta["val"] = torch.empty(g, 2, f, dtype=torch.float64, device=device)
        sink.meta["val"] = torch.empty(g, f, dtype=torch.float64, device=device).requires_grad_(True)
    for row, (node, (x, w, recipe, *nvflags)) in enumerate(covered):
        stack = node.meta.get("nn_module_stack", {})
        with graph.inserting_before(node):
            rows = [
                add_node(graph, operand_stats, (hp, recipe, name, *nvflags), fake_mode=fake_mode, stack=stack)
                for hp, name in ((x, "input"), (w, "weight"))
            ]
            both = add_node(graph, aten.stack.default, (rows,), fake_mode=fake_mode, stack=stack)
            slot = add_node(graph, aten.select.int, (fwd, 0, row), fake_mode=fake_mode, stack=stack)
            add_node(graph, aten.copy_.default, (slot, both), fake_mode=fake_mode, stack=stack)
        with graph.inserting_after(node):
            tapped = add_node(graph, grad_tap, (node, sink, row, recipe, *nvflags), fake_mode=fake_mode, stack=stack)
        node.replace_all_uses_with(tapped, delete_user_cb=lambda user: user is not tapped)
        result.gemms.append(MonitoredGemm(row, node.meta[meta.FP8], node.name))
    result.device = device
    graph.lint()
    copy.recompile()
    return result
