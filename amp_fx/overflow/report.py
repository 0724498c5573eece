"""What ``overflow_report()`` returns after its one host read: :class:`OverflowReport`, and the
first non-finite forward op it names, :class:`FirstOp`."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["FirstOp", "OverflowReport"]


@dataclass(frozen=True)
class FirstOp:
    """The first op (in graph order, in the first graph that ran it) whose output was non-finite."""

    module: str
    """Module path under the root module ("" for code of the root itself)."""
    op: str
    """ATen op, e.g. ``aten.mm``."""
    dtype: str
    """Output dtype (``fp16``/``bf16``)."""
    graph: int
    """Index of the captured graph (``amp_fx_records``) that holds it."""
    node: str
    """The node's name in that rewritten graph."""
    rank: int | None = None
    """Under DDP/FSDP2: the (global) rank whose forward it was, the lowest one if several; else None."""

    def __str__(self) -> str:
        where = f" on rank {self.rank}" if self.rank is not None else ""
        return f"{self.module or '<root>'} ({self.op}, {self.dtype}){where}"


@dataclass(frozen=True)
class OverflowReport:
    """The most recent skipped step, as read by ``overflow_report()``."""

    step: int
    """Index of the skipped optimizer step: how many ``update()`` calls (compiled steps) came before it."""
    gradients: tuple[str, ...]
    """Names (under the root module) of the parameters whose gradients held an inf/NaN."""
    first_op: FirstOp | None
    """The first non-finite low-precision forward output, or None (forward clean, or not watched)."""
    skipped: int
    """Skipped steps so far (the scaler's running count)."""

    def __str__(self) -> str:
        where = f"first inf at {self.first_op}" if self.first_op is not None else "forward finite or not watched"
        names = ", ".join(self.gradients[:3]) + (", ..." if len(self.gradients) > 3 else "")
        grads = f"{len(self.gradients)} gradients non-finite ({names})" if self.gradients else "no gradient non-finite"
        return f"step {self.step} skipped: {where}; {grads}"
