"""Advice.to_html: one self-contained page (inline SVG bar charts, no script, no network)."""

from __future__ import annotations

import html
import math
import tempfile
from pathlib import Path
from typing import Any

from amp_fx._common.dtype_names import dtype_name
from amp_fx.inspect.nonfinite import policy_code

__all__ = ["NO_GRAPHVIZ"]

NO_GRAPHVIZ = (
    "The graph is not drawn: Graphviz's dot is not installed (Debian/Ubuntu: apt-get install "
    "graphviz; macOS: brew install graphviz; conda: conda install graphviz). The summary above has "
    "the same counts; explain(...).to_dot() writes the picture's DOT text for any DOT viewer."
)
_BAR_H = 16
_LABEL_W = 260
_CHART_W = 420


def _bar_chart(
    title: str, rows: list[tuple[str, float, str]], *, log_floor: float, mark: float | None, mark_label: str
) -> str:
    """A horizontal bar chart on a log scale from ``log_floor`` to the largest value (at least
    ``mark``); an inf value is drawn full width in red. ``rows``: (label, value, colour)."""
    finite = [v for _, v, _ in rows if math.isfinite(v) and v > 0]
    top = max(finite + ([mark] if mark else []) + [log_floor * 10])
    lo, hi = math.log10(log_floor), math.log10(top * 1.5)

    def x(v: float) -> float:
        if not math.isfinite(v):
            return _CHART_W
        return max(0.0, min(1.0, (math.log10(max(v, log_floor)) - lo) / (hi - lo))) * _CHART_W

    height = _BAR_H * len(rows) + 40
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" class="chart" width="{_LABEL_W + _CHART_W + 80}" '
        f'height="{height}" role="img" aria-label="{html.escape(title)}">',
        f'<text x="0" y="14" font-weight="bold">{html.escape(title)}</text>',
    ]
    for i, (label, v, colour) in enumerate(rows):
        y = 24 + i * _BAR_H
        text = "inf" if math.isinf(v) else ("-" if math.isnan(v) else f"{v:.2g}")
        fill = "#d62728" if not math.isfinite(v) else colour
        parts.append(
            f'<text x="{_LABEL_W - 4}" y="{y + 12}" text-anchor="end" font-size="11">{html.escape(label)}</text>'
        )
        parts.append(
            f'<rect class="bar" x="{_LABEL_W}" y="{y + 2}" width="{x(v) if not math.isnan(v) else 0:.1f}" '
            f'height="{_BAR_H - 4}" fill="{fill}"><title>{html.escape(label)}: {text}</title></rect>'
        )
        parts.append(
            f'<text x="{_LABEL_W + x(v) + 3 if not math.isnan(v) else _LABEL_W + 3:.1f}" '
            f'y="{y + 12}" font-size="10">{text}</text>'
        )
    if mark:
        mx = _LABEL_W + x(mark)
        parts.append(
            f'<line x1="{mx:.1f}" y1="20" x2="{mx:.1f}" y2="{height - 12}" stroke="#333" stroke-dasharray="4 3"/>'
        )
        parts.append(
            f'<text x="{mx:.1f}" y="{height - 2}" font-size="10" text-anchor="middle">{html.escape(mark_label)}</text>'
        )
    parts.append("</svg>")
    return "\n".join(parts)


def _picture(graph: Any) -> str:
    """explain's summary and picture: the SVG inlined where Graphviz is installed, else the DOT."""
    from amp_fx.errors import GraphvizNotFound

    head = f"<h2>graph (amp_fx.explain)</h2><pre>{html.escape(graph.summary())}</pre>"
    with tempfile.TemporaryDirectory() as tmp:
        try:
            svg = graph.to_svg(Path(tmp) / "graph.svg").read_text()
        except GraphvizNotFound:
            return head + f'<p class="note">{html.escape(NO_GRAPHVIZ)}</p>'
    return head + f'<div class="graph">{svg[svg.find("<svg") :]}</div>'


def _measurements(advice: Any) -> str:
    """advice.table()'s rows as an HTML table (tabulate escapes every cell)."""
    from tabulate import tabulate

    headers, rows, _ = advice._measurement_rows(limit=None)
    return tabulate(rows, headers=headers, tablefmt="html")


def render(advice: Any, graph: Any = None, note: str = "") -> str:
    """The page for an :class:`~amp_fx.inspect.advice.Advice`."""
    low = dtype_name(advice.dtype)
    mods = [s for s in advice.modules if s.name][:60]
    fp8 = advice.fp8 is not None
    kept = set(advice.keep_out_of_fp8 if fp8 else advice.keep_fp32)
    where = "out of fp8" if fp8 else "in fp32"
    title = f"{low}, fp8 {advice.fp8.recipe.value}" if fp8 else low

    def colour(s: Any) -> str:
        return "#ff7f0e" if s.name in kept else ("#9467bd" if s.finding else "#1f77b4")

    eps = 2.0**-7 if low == "bf16" else 2.0**-10
    error_chart = _bar_chart(
        f"output error vs float64 ({low}, default policy)",
        [(s.name, s.output_error, colour(s)) for s in mods],
        log_floor=eps / 64,
        mark=advice.target,
        mark_label=f"target {advice.target:g}",
    )
    headroom_chart = _bar_chart(
        "headroom: max |output| / largest finite value",
        [(s.name, s.headroom, colour(s)) for s in mods],
        log_floor=1e-8,
        mark=1.0,
        mark_label="overflow",
    )
    charts = [error_chart, headroom_chart]
    if advice.grads_measured and any(s.grad_headroom is not None for s in mods):
        charts.append(
            _bar_chart(
                f"gradient headroom at loss scale {advice.loss_scale:g}",
                [(s.name, s.grad_headroom if s.grad_headroom is not None else math.nan, colour(s)) for s in mods],
                log_floor=1e-8,
                mark=1.0,
                mark_label="overflow",
            )
        )
    picture = (f"<p>{html.escape(note)}</p>" if note else "") + ("" if graph is None else _picture(graph))
    cost = advice.cost
    cost_text = (
        f"Cost: {cost.fp8_flop_share:.1%} of matmul/conv/attention FLOPs in fp8 (every eligible "
        f"matmul: {cost.default_fp8_flop_share:.1%})."
        if fp8
        else f"Cost: {cost.fp32_flop_share:.1%} of matmul/conv/attention FLOPs in fp32; casts move "
        f"{cost.cast_bytes} B per forward."
    )
    fp8_part = f"<h2>fp8 matmuls</h2>\n<pre>{html.escape(advice.fp8_table(limit=None))}</pre>" if fp8 else ""
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>amp_fx.advise ({title})</title>
<style>body{{font-family:sans-serif;margin:24px;max-width:1100px}} pre{{background:#f4f4f4;padding:8px;
overflow:auto}} .legend span{{padding:0 8px;margin-right:8px;color:#fff}}
table{{border-collapse:collapse;font-size:13px}} th,td{{border:1px solid #ccc;padding:2px 6px}}
th{{background:#eee}} .note{{background:#fff7e0;padding:8px}}</style></head>
<body>
<h1>amp_fx.advise ({title})</h1>
<p>End-to-end error vs float64: default policy <b>{advice.baseline_error:.3g}</b>, advised <b>{advice.error:.3g}</b>,
target {advice.target:.3g}: <b>{"verified" if advice.verified else "NOT verified"}</b>.
{cost_text}</p>
<p class="legend"><span style="background:#ff7f0e">kept {where}</span><span style="background:#9467bd">finding</span>
<span style="background:#1f77b4">fine</span><span style="background:#d62728">inf</span></p>
{"".join(f"<div>{c}</div>" for c in charts)}
<h2>policy</h2>
<pre>from amp_fx import Policy
policy = {html.escape(policy_code(advice.policy))}</pre>
{"".join(f"<p>kept: {html.escape(str(k))}</p>" for k in advice.kept)}
<h2>measurements</h2>
{_measurements(advice)}
{fp8_part}
{picture}
</body></html>
"""
