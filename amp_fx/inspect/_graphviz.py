"""DOT text for an explained graph, and SVG through Graphviz's ``dot`` when it is installed.

No Python dependency: the DOT text is written here, and ``dot`` is called as a program. Without it
the ``.dot`` file is still written and :class:`GraphvizNotFound` says how to get the picture.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

from amp_fx.errors import GraphvizNotFound

__all__: list[str] = []


class DotNode(Protocol):
    """What a picture shows of a node (``explanation.NodeInfo`` has these fields); a protocol so
    that this module needs nothing from the tools that draw with it. Read-only, as a frozen
    dataclass's fields are."""

    @property
    def name(self) -> str: ...
    @property
    def kind(self) -> str: ...
    @property
    def op(self) -> str: ...
    @property
    def value(self) -> str: ...
    @property
    def module(self) -> str: ...
    @property
    def rule(self) -> str: ...
    @property
    def cast(self) -> str | None: ...
    @property
    def cached(self) -> bool: ...
    @property
    def folded(self) -> tuple[str, ...]: ...
    @property
    def label(self) -> str: ...
    @property
    def dtype_name(self) -> str: ...


# Fill colour per dtype name: a ColorBrewer qualitative palette, fp32 cool, lower precision warm.
DTYPE_COLORS = {
    "fp32": "#9ecae1",
    "bf16": "#fdae6b",
    "fp16": "#fb6a4a",
    "fp64": "#bcbddc",
    "bool": "#e5e5e5",
    "-": "#ffffff",
}
INT_COLOR = "#d9d9d9"
INSERTED_CAST_BORDER = "#d62728"
USER_CAST_BORDER = "#555555"


def _q(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def _color(dtype_name: str) -> str:
    if dtype_name in DTYPE_COLORS:
        return DTYPE_COLORS[dtype_name]
    return INT_COLOR


def build_dot(graphs: Sequence[tuple[int, Sequence[DotNode], Sequence[tuple[str, str]]]], *, title: str) -> str:
    """One cluster per graph; ``graphs`` holds (index, nodes, edges as (src name, dst name))."""
    lines = [
        "digraph amp_fx {",
        f"  label={_q(title)}; labelloc=t; fontname=Helvetica;",
        "  rankdir=TB; node [fontname=Helvetica, fontsize=10, style=filled];",
        '  edge [color="#777777", arrowsize=0.6];',
    ]
    used = set()
    for index, nodes, edges in graphs:
        lines.append(f"  subgraph cluster_{index} {{")
        lines.append(f'    label={_q(f"graph {index}")}; style=rounded; color="#999999";')
        for n in nodes:
            used.add(n.dtype_name)
            attrs = {"fillcolor": _color(n.dtype_name), "shape": "box"}
            label = [n.name if n.kind != "input" else n.label, n.value]
            if n.kind == "input":
                attrs["shape"] = "ellipse"
            elif n.kind == "output":
                attrs["shape"] = "plaintext"
                attrs["fillcolor"] = "#ffffff"
                label = ["output"]
            else:
                label.insert(1, n.op)
                if n.module:
                    label.append(n.module)
            if n.cast == "inserted":
                attrs.update(shape="box", color=INSERTED_CAST_BORDER, penwidth="3", style="filled,bold")
                label.insert(0, "CAST (amp_fx" + (", cached)" if n.cached else ")"))
            elif n.cast == "user":
                attrs.update(color=USER_CAST_BORDER, penwidth="2", style="filled,dashed")
                label.insert(0, "cast (your code)")
            if n.folded:
                attrs["peripheries"] = "2"
                label.append("folded: " + ", ".join(n.folded))
            attrs["label"] = "\n".join(label)
            attrs["tooltip"] = n.rule
            body = ", ".join(f"{k}={_q(v)}" for k, v in attrs.items())
            lines.append(f"    {_q(f'g{index}_{n.name}')} [{body}];")
        for src, dst in edges:
            lines.append(f"    {_q(f'g{index}_{src}')} -> {_q(f'g{index}_{dst}')};")
        lines.append("  }")
    lines.append("  subgraph cluster_legend {")
    lines.append('    label="legend"; style=dashed; color="#bbbbbb";')
    for name in sorted(used - {"-"}):
        lines.append(f"    {_q('legend_' + name)} [label={_q(name)}, shape=box, fillcolor={_q(_color(name))}];")
    lines.append(
        f'    legend_cast [label="cast inserted by amp_fx", shape=box, '
        f'fillcolor="#ffffff", color="{INSERTED_CAST_BORDER}", penwidth=3];'
    )
    lines.append("  }")
    lines.append("}")
    return "\n".join(lines) + "\n"


def write_svg(dot_text: str, path: str | Path) -> Path:
    """Render ``dot_text`` to ``path`` with Graphviz; without it, write ``path`` with suffix .dot
    and raise :class:`GraphvizNotFound`."""
    svg = Path(path)
    dot_file = svg.with_suffix(".dot")
    dot_file.write_text(dot_text)
    exe = shutil.which("dot")
    if exe is None:
        raise GraphvizNotFound(dot_file, svg)
    result = subprocess.run([exe, "-Tsvg", str(dot_file), "-o", str(svg)], capture_output=True, text=True, timeout=120)
    if result.returncode != 0:
        raise RuntimeError(f"amp_fx: `dot -Tsvg {dot_file}` failed: {result.stderr.strip()}")
    return svg
