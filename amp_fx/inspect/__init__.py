"""The inspection tools: what amp_fx did (explain), against eager autocast (compare), where inf/NaN
first appears (find_nonfinite).

    explanation.py  amp_fx.explain, Explanation: per-node dtypes, rules, casts; tables; picture
    comparison.py   amp_fx.compare, CompareReport: op by op against eager torch.autocast
    advice/         amp_fx.advise, Advice: which modules to keep in fp32, measured and verified; one
                    file per phase (measure, verify, search, cost, fp8 sizing, training, report)
    nonfinite.py    amp_fx.find_nonfinite, NonfiniteReport: first inf/NaN and a policy that fixes it
    precision.py    amp_fx.precision_report, PrecisionReport: the dtype and bytes per parameter of each
                    part of a training setup, and its silent downgrades (no graph: read from the tensors)
    _runner.py      the one runner: eager check, private copies, compile with a recorder, diagnose
    _probe.py       helpers on values and graph nodes shared by the three tools
    _graphviz.py    DOT text and SVG for explain
    _flow.py        for advise: which module ran each low-precision op, and which produced each value

A new view of a captured graph goes next to the others here: run the model through
:func:`~amp_fx.inspect._runner.run_amp`, read the ``GraphRecord`` s it returns.
"""

from amp_fx.inspect.advice import Advice, advise
from amp_fx.inspect.comparison import CompareReport, compare
from amp_fx.inspect.explanation import Explanation, explain
from amp_fx.inspect.nonfinite import NonfiniteReport, find_nonfinite
from amp_fx.inspect.precision import PrecisionReport, precision_report

__all__ = [
    "explain",
    "Explanation",
    "compare",
    "CompareReport",
    "find_nonfinite",
    "NonfiniteReport",
    "advise",
    "Advice",
    "precision_report",
    "PrecisionReport",
]
