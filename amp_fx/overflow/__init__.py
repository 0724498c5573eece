"""Why was a step skipped? Overflow provenance kept on the device (issue 21).

Three records, all device tensors updated without a host read, and a scheduler:

* ``watch.py``, :class:`ForwardWatch`: with ``watch_nonfinite=True``, each rewritten graph returns
  the position of its first op whose low-precision output held an inf/NaN
  (``amp_fx.passes.watch_nonfinite``); the watch keeps the first such op since it was last taken,
  across graphs and micro-batches.
* ``record.py``, ``SkipRecord``: kept by ``amp_fx.GradScaler`` (and so by ``compile_step``). At
  each ``update()`` it counts the step and, where the step was skipped, keeps its index, the
  per-gradient flags of the fused unscale kernel and the forward watch's first op. It owns its
  wiring: one way to attach a model and its watch, one way to close a step.
* ``report.py``, :class:`OverflowReport` and :class:`FirstOp`: what ``overflow_report()`` returns
  after its one host read.
* ``schedule.py``, :func:`skip_aware`: an LR scheduler that stands still on skipped steps
  without a read.
"""

from amp_fx.overflow.record import SkipRecord as SkipRecord
from amp_fx.overflow.report import FirstOp, OverflowReport
from amp_fx.overflow.schedule import skip_aware
from amp_fx.overflow.watch import GRAPH_STRIDE as GRAPH_STRIDE
from amp_fx.overflow.watch import ForwardWatch as ForwardWatch

__all__ = ["OverflowReport", "FirstOp", "skip_aware"]

_GRAPH_STRIDE = GRAPH_STRIDE  # the name tests/overflow/test_overflow.py imports
