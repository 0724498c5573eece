"""What ``overflow_report()`` returns after its one host read: :class:`OverflowReport`, and the
first non-finite forward op it names, :class:`FirstOp`."""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["FirstOp", "OverflowReport", "WATCH_HINT", "STEP_WATCH_HINT", "scale_text"]

WATCH_HINT = "amp_fx.compile(model, ..., watch_nonfinite=True), and scaler.watch(model) if the scaler does not find it"
"""The call that watches a forward trained with ``amp_fx.GradScaler``: the scaler finds a watched
model that holds its optimizer's parameters by itself, ``scaler.watch`` names it where it cannot."""
STEP_WATCH_HINT = "amp_fx.compile_step(..., watch_nonfinite=True)"
"""The same for ``compile_step``, which watches its own forward."""


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
    backward: bool = False
    """Whether it was an op of the backward (AOTAutograd's backward graph of graph ``graph``)."""
    grad_of: str = ""
    """A backward op: the forward op it differentiates (``aten.linear``; "" where unknown). ``module``
    is that op's module."""
    incoming: bool = False
    """A backward record that is no op: the gradient of the output of ``grad_of`` (in ``module``) was
    already non-finite when it entered the compiled backward (made after the graph, by the loss
    say, or the gradient of a non-finite output)."""

    def __str__(self) -> str:
        where = f" on rank {self.rank}" if self.rank is not None else ""
        if self.incoming:
            return (
                f"{self.module or '<root>'} (the gradient of its {self.grad_of or 'output'} output, "
                f"{self.dtype}, entered the compiled backward non-finite){where}"
            )
        if self.backward:
            return f"{self.module or '<root>'} ({self.op}, {self.dtype}, backward of {self.grad_of or '?'}){where}"
        return f"{self.module or '<root>'} ({self.op}, {self.dtype}){where}"


@dataclass(frozen=True)
class OverflowReport:
    """The most recent skipped step, as read by ``overflow_report()``."""

    step: int
    """Index of the skipped optimizer step: how many ``update()`` calls (compiled steps) came before it."""
    gradients: tuple[str, ...]
    """Names (under the root module) of the parameters whose gradients held an inf/NaN."""
    first_op: FirstOp | None
    """The first op whose low-precision output created an inf/NaN, in the forward or (``.backward``)
    the backward, or None (none was created in a watched graph, or nothing was watched)."""
    skipped: int
    """Skipped steps so far (the scaler's running count)."""
    watched: tuple[str, ...] = ()
    """What the watch covered: ``("forward", "backward")``, ``("forward",)`` (the backward could not
    be watched, see ``backward_unwatched``) or ``()`` (no watch)."""
    backward_unwatched: str = ""
    """Why the backward was not watched ("" where it was, or where nothing was)."""
    scale: float | None = None
    """The loss scale the skipped step ran at (None: not recorded, as in a report of an older scaler)."""
    scale_after: float | None = None
    """The scale its update left: backed off (unless ``min_scale`` or hysteresis held it)."""
    in_a_row: int = 1
    """Skipped steps in a row that the skipped step ended (1: the step before it was taken)."""
    every_gradient: bool = False
    """Whether every gradient the scaler checked was non-finite."""
    checked: int = 0
    """How many gradients the scaler checked (0: not recorded)."""
    how_to_watch: str = WATCH_HINT
    """The call that watches the forward of the model this report is about (said when
    :attr:`watched` is empty): ``compile_step(..., watch_nonfinite=True)`` for a compiled step."""

    @property
    def from_scale(self) -> bool:
        """Whether the skip comes from the loss scale rather than a layer: the forward was watched
        and no forward op overflowed, every gradient is non-finite, and the scale is above 1. The
        scaled loss's gradient exceeds the low dtype's range at the first backward op, whichever
        layer that is; a smaller scale fixes it (the scale backs off at each skip, so early steps
        skip until it fits). An unwatched forward is never blamed on the scale: a layer that
        overflows in the forward makes every gradient non-finite too (issue 61)."""
        forward_op = self.first_op is not None and not self.first_op.backward
        return (
            "forward" in self.watched
            and self.every_gradient
            and not forward_op
            and self.scale is not None
            and self.scale > 1.0
        )

    def __str__(self) -> str:
        names = ", ".join(self.gradients[:3]) + (", ..." if len(self.gradients) > 3 else "")
        grads = f"{len(self.gradients)} gradients non-finite ({names})" if self.gradients else "no gradient non-finite"
        where = self._where()
        if self.from_scale:  # after the op, so that a line still starts with where the first inf was
            note = (
                "every gradient non-finite and no forward op overflowed: the loss scale is too large for "
                "these gradients, no layer is at fault (expected in the first steps: the scale backs off "
                "at each skip until they fit; a smaller init_scale skips fewer)"
            )
            where = note if self.first_op is None else f"{where}; {note}"
        scale = ""
        if self.scale is not None:
            scale = f"; scale {scale_text(self.scale)}"
            if self.scale_after is not None and self.scale_after != self.scale:
                scale += f", backed off to {scale_text(self.scale_after)}"
        row = f"; {self.in_a_row} steps skipped in a row" if self.in_a_row > 1 else ""
        return f"step {self.step} skipped: {where}; {grads}{scale}{row}"

    def _where(self) -> str:
        """Where the first inf appeared, or exactly what the record knows when no op is named."""
        if self.first_op is not None:
            return f"first inf {'in the backward ' if self.first_op.backward else ''}at {self.first_op}"
        if not self.watched:
            shows = (
                " (every gradient non-finite: a layer that overflows in the forward gives that as well as a "
                "loss scale too large for the backward)"
                if self.every_gradient
                else f" (the other {self.checked - len(self.gradients)} gradients finite)"
                if self.checked
                else ""
            )
            return (
                f"the forward was not watched, so whether a layer overflowed is not known{shows}; "
                f"to name the layer: {self.how_to_watch}"
            )
        if "backward" not in self.watched:
            return (
                f"no op named: no forward op created an inf/NaN (a -inf mask or an in-place op is not "
                f"named); the backward is not watched ({self.backward_unwatched or 'no backward graph'})"
            )
        return (
            "no op named: no forward or backward op created an inf/NaN (a -inf mask, an in-place op "
            "or code outside the compiled graphs is not named)"
        )


def scale_text(scale: float) -> str:
    """A loss scale as its power of two where it is one (``2**40``), else as a number; the form of
    every scale amp_fx prints (the overflow report, ``advise``)."""
    if scale > 0 and math.isfinite(scale) and math.frexp(scale)[0] == 0.5:
        return f"2**{math.frexp(scale)[1] - 1}"
    return f"{scale:g}"
