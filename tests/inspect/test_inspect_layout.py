"""The inspection tools' structure: one runner, one backend resolver, one dtype spelling, public
exceptions, and no import cycle between the tools' modules."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import torch

import amp_fx
from amp_fx._common import downstream as _backends
from amp_fx.inspect import _runner
from tests.inspect._inspect_models import TwoLayer, seeded

PACKAGE = Path(amp_fx.__file__).resolve().parent


def _sources() -> dict[str, str]:
    return {str(p.relative_to(PACKAGE)): p.read_text() for p in PACKAGE.rglob("*.py")}


def _imports(path: Path) -> set[str]:
    """amp_fx modules a file imports at module level (TYPE_CHECKING blocks included)."""
    out = set()
    for node in ast.parse(path.read_text()).body:
        body = node.body if isinstance(node, ast.If) else [node]
        for n in body:
            if isinstance(n, ast.ImportFrom) and n.module and n.module.startswith("amp_fx"):
                out.add(n.module)
            elif isinstance(n, ast.Import):
                out |= {a.name for a in n.names if a.name.startswith("amp_fx")}
    return out


def test_no_import_cycle_among_the_inspection_modules():
    modules = {f"amp_fx.inspect.{p.stem}": p for p in (PACKAGE / "inspect").glob("*.py") if p.stem != "__init__"}
    graph = {m: {i for i in _imports(p) if i in modules} for m, p in modules.items()}

    def reaches(start: str, goal: str, seen: set[str]) -> bool:
        return any(n == goal or (n not in seen and reaches(n, goal, seen | {n})) for n in graph[start])

    cycles = [m for m in graph if reaches(m, m, {m})]
    assert not cycles, graph
    assert "amp_fx.inspect.explanation" not in _imports(PACKAGE / "inspect" / "_graphviz.py")


@pytest.mark.parametrize(
    "pattern, home, scope",
    [
        (r"def _?is_cast\(", "passes/fx_edit.py", ""),  # the graph-editing toolbox (issue 53)
        (r"^_?SEED\s*=", "inspect/_runner.py", "inspect/"),  # the seed the tools run the model from
        (r"lookup_backend\(", "_common/downstream.py", ""),
        (r"_SHORT\s*=|replace\(\s*[\"']torch\.[\"']", "_common/dtype_names.py", ""),
        (r"def run_eager_checked\(|def private_copy\(|def amp_failure\(", "inspect/_runner.py", ""),
    ],
)
def test_one_home_for_each_rule(pattern, home, scope):
    found = sorted(
        f for f, text in _sources().items() if f.startswith(scope) and re.search(pattern, text, re.MULTILINE)
    )
    assert found == [home]


def test_public_exceptions_are_the_ones_raised(tmp_path, monkeypatch):
    model, _ = seeded(TwoLayer, 2, 4)
    with pytest.raises(amp_fx.EagerError, match="inputs do not match the model"):
        amp_fx.explain(model, torch.randn(2, 5))
    assert issubclass(amp_fx.EagerError, ValueError)
    assert issubclass(amp_fx.AmpRunError, RuntimeError)
    from amp_fx.inspect import _graphviz

    monkeypatch.setattr(_graphviz.shutil, "which", lambda name: None)
    ex = amp_fx.explain(model, torch.randn(2, 4))
    with pytest.raises(amp_fx.GraphvizNotFound):
        ex.to_svg(tmp_path / "g.svg")
    for name in ("EagerError", "AmpRunError", "GraphvizNotFound"):
        assert name in amp_fx.__all__
        assert getattr(amp_fx, name).__module__ == "amp_fx.errors"


def test_one_backend_resolver(monkeypatch):
    """amp_fx.compile's backend and the tools' recorder both ask _backends.resolve_backend."""
    asked = []
    real = _backends.resolve_backend

    def spy(backend, **kwargs):
        asked.append(backend)
        return real(backend, **kwargs)

    monkeypatch.setattr(_backends, "resolve_backend", spy)
    import amp_fx.backend.compiler as backend_module

    monkeypatch.setattr(backend_module, "resolve_backend", spy)
    monkeypatch.setattr(_runner, "resolve_backend", spy)
    model, x = seeded(TwoLayer, 2, 4)
    amp_fx.compare(model, x, backend="aot_eager", grads=False)
    assert "aot_eager" in asked  # the recorder's downstream
    assert any(callable(b) and isinstance(b, _runner.InputRecorder) for b in asked)


def test_one_dtype_spelling_in_records():
    model, x = seeded(TwoLayer, 2, 4)
    compiled = amp_fx.compile(model, dtype="bf16", backend="eager")
    compiled(x)
    text = compiled.amp_fx_summary()
    assert " bf16 " in text and "bfloat16" not in text
