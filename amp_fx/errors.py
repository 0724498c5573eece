"""amp_fx's exception and warning types."""

from __future__ import annotations

from pathlib import Path

__all__ = ["AmpFxError", "AmpFxWarning", "EagerError", "AmpRunError", "GraphvizNotFound"]


class AmpFxError(RuntimeError):
    """An op or input that amp_fx refuses; the message names the op and what to do instead."""


class AmpFxWarning(UserWarning):
    """amp_fx did less than it was asked (ignored a policy entry, captured no graph, fell back).

    Each is emitted once per thing it names; with ``strict=True`` (or ``AMP_FX_STRICT=1`` in the
    environment) it is raised as :class:`AmpFxError` instead.
    """


class EagerError(ValueError):
    """The model (or function) fails on the given inputs without amp_fx (plain fp32 eager).

    Raised by the inspection tools before anything is compiled; the eager error is chained
    (``__cause__``). A ``ValueError``: the inputs or the model are at fault, not amp_fx.
    """


class AmpRunError(RuntimeError):
    """The model runs in plain eager mode but fails when run with mixed precision.

    The message says whether eager ``torch.autocast`` (or plain ``torch.compile`` under it) fails
    the same way, which tells a missing low-precision kernel or a torch.compile problem from an
    amp_fx bug.
    """


class GraphvizNotFound(RuntimeError):
    """Graphviz's ``dot`` program is not on PATH; the DOT file was written instead of the SVG."""

    def __init__(self, dot_path: Path, svg_path: Path) -> None:
        self.dot_path = dot_path
        self.svg_path = svg_path
        super().__init__(
            f"amp_fx: Graphviz's `dot` program is not installed, so no SVG was made; the graph was "
            f"written as DOT to {dot_path}. Install Graphviz (`apt-get install graphviz`, "
            f"`conda install graphviz` or `brew install graphviz`), then run "
            f"`dot -Tsvg {dot_path} -o {svg_path}`, or paste the DOT text into a Graphviz viewer."
        )
