"""The fp8 monitor's state on a compiled model: the step counter and each graph's buffers.

One :class:`MonitorState` per compiled model (shared by its backend's siblings). Each call of the
compiled model (or step) is one step: :meth:`MonitorState.begin_call` reads the schedule on the
host and says whether this call logs. Each monitored graph has a :class:`GraphStats`: its GEMMs
and two preallocated float64 buffers, ``fwd`` (the forward operands' rows, written by the
compiled forward) and ``sink`` (whose ``.grad`` the compiled backward fills with the output
gradients' rows). :meth:`MonitorState.choose` gives the callable Dynamo runs for a graph: the
monitored graph on logging steps (with the two buffers appended to its inputs), the plain one
otherwise. Nothing here reads the device; :mod:`amp_fx.monitor.report` does, when asked.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from amp_fx.fp8 import Fp8Config
from amp_fx.kernels.monitor_tap import STAT_NAMES
from amp_fx.monitor.config import Fp8Monitor
from amp_fx.passes.monitor_fp8 import MonitoredGemm

__all__ = ["MonitorState", "GraphStats"]


@dataclass
class GraphStats:
    """One monitored graph's GEMMs and buffers."""

    index: int
    gemms: list[MonitoredGemm]
    fwd: torch.Tensor
    """float64 ``[G, 2, F]``: the input's and weight's rows of each GEMM, from the last logging step."""
    sink: torch.Tensor
    """float64 ``[G, F]`` leaf; ``sink.grad``: the output gradients' rows of the last logging
    step's backward (None until one ran)."""
    logged_step: int | None = None
    """The last step whose forward ran this graph's monitored version (None: none yet)."""

    @classmethod
    def allocate(cls, index: int, gemms: list[MonitoredGemm], device: torch.device) -> GraphStats:
        shape = (len(gemms), len(STAT_NAMES))
        fwd = torch.full((shape[0], 2, shape[1]), float("nan"), dtype=torch.float64, device=device)
        sink = torch.zeros(shape, dtype=torch.float64, device=device, requires_grad=True)
        return cls(index, gemms, fwd, sink)


@dataclass
class MonitorState:
    """The schedule's position and every monitored graph's buffers (see the module docstring)."""

    config: Fp8Monitor
    low_precision: Fp8Config | None = None
    """The compile's ``low_precision=`` (what :meth:`amp_fx.Fp8Stats.suggest` starts from)."""
    step: int = 0
    """The number of calls so far (the next call is step ``step``)."""
    logging: bool = False
    """Whether the call in progress (step ``step - 1``) computes the statistics."""
    graphs: dict[int, GraphStats] = field(default_factory=dict)
    uncovered: list[str] = field(default_factory=list)

    def begin_call(self) -> None:
        """A call of the compiled model starts: one step, logging or not (a host-side counter)."""
        self.logging = self.config.logs(self.step)
        self.step += 1

    def choose(self, plain: Callable[..., Any], monitored: Callable[..., Any], graph: GraphStats) -> Callable[..., Any]:
        """The callable Dynamo runs for ``graph``: ``monitored`` (its buffers appended to the
        inputs) on logging steps, ``plain`` otherwise; called as the backend's run wrapper calls a
        compiled graph (``compiled(*args)``, amp_fx/backend/compiler.py)."""

        def run(*args: Any) -> Any:
            if not self.logging:
                return plain(*args)
            graph.logged_step = self.step - 1
            graph.sink.grad = None  # this step's backward writes it afresh (host-side: no device read)
            return monitored(*args, graph.fwd, graph.sink)

        run._boxed_call = getattr(plain, "_boxed_call", False)  # type: ignore[attr-defined]  # as the run wrapper
        return run
