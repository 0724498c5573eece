"""``Fp8Monitor``: when to compute the per-GEMM quantization statistics (issue 64).

    >>> Fp8Monitor(every=100).logs(0), Fp8Monitor(every=100).logs(1), Fp8Monitor(every=100).logs(200)
    (True, False, True)
    >>> [s for s in range(8) if Fp8Monitor(every=2, start=3, end=7).logs(s)]
    [3, 5]

A step is one call of the compiled model (or of the compiled step). The schedule is read on the
host, from a step counter the compiled model keeps: on a logging step the graphs that compute the
statistics run, on the others the plain graphs, compiled once each (no recompile per step, no
host read of the device). TransformerEngine's debug features use the same schedule
(``freq``, ``start_step``, ``end_step``).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Fp8Monitor"]


@dataclass(frozen=True)
class Fp8Monitor:
    """Compute each converted GEMM's quantization statistics on steps ``start, start + every, ...``
    before ``end`` (None: no end). Pass it as ``amp_fx.compile(..., monitor=Fp8Monitor(...))`` with
    a ``low_precision=`` recipe; read with :func:`amp_fx.fp8_stats`."""

    every: int = 100
    start: int = 0
    end: int | None = None

    def __post_init__(self) -> None:
        for name in ("every", "start"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(f"amp_fx: Fp8Monitor({name}=...) must be an int, got {value!r}")
        if self.every < 1:
            raise ValueError(f"amp_fx: Fp8Monitor(every={self.every}) must be at least 1 (every Nth step)")
        if self.start < 0:
            raise ValueError(f"amp_fx: Fp8Monitor(start={self.start}) must be a step number, 0 or more")
        if self.end is not None and (not isinstance(self.end, int) or isinstance(self.end, bool)):
            raise TypeError(f"amp_fx: Fp8Monitor(end=...) must be an int or None, got {self.end!r}")
        if self.end is not None and self.end <= self.start:
            raise ValueError(
                f"amp_fx: Fp8Monitor(start={self.start}, end={self.end}) selects no step (the window is "
                f"[start, end)); pass monitor=None to turn the monitor off"
            )

    def logs(self, step: int) -> bool:
        """Whether step ``step`` (0 for the first call) computes the statistics."""
        if step < self.start or (self.end is not None and step >= self.end):
            return False
        return (step - self.start) % self.every == 0
