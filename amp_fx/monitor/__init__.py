"""The fp8 monitor (issue 64): per-GEMM quantization statistics of the low-precision matmuls,
computed in the compiled graphs on the steps a schedule selects, read when asked.

    model = amp_fx.compile(model, low_precision="rowwise", monitor=amp_fx.Fp8Monitor(every=100))
    ...
    print(amp_fx.fp8_stats(model))

``config.py``: the schedule; ``state.py``: the step counter and buffers a compiled model keeps;
``report.py``: the one read (the pass is ``amp_fx/passes/monitor_fp8.py``, its calls
``amp_fx/kernels/monitor_tap.py``). docs/fp8-monitor.md walks through a case.
"""

from amp_fx.monitor.config import Fp8Monitor
from amp_fx.monitor.report import Fp8Stats, GemmStats, fp8_stats

__all__ = ["Fp8Monitor", "Fp8Stats", "GemmStats", "fp8_stats"]
