"""The architecture, executable: the import graph of ``amp_fx/`` against the layers that
``docs/contributing.md`` draws (its "Layers" table is read here, so the page and the check cannot
drift apart).

Every ``import`` of an amp_fx module counts, at module level or inside a function: an import made
lazily to dodge a cycle is still a dependency. A module may import modules of its own layer or of
lower layers, never of a higher one; there is no cycle among modules; no module imports another
module's private (underscore) name; nothing in the library imports ``amp_fx.testing``.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "amp_fx"
CONTRIBUTING = ROOT / "docs" / "contributing.md"


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _owner(name: str) -> str:
    """The most specific module of ``MODULES`` that ``name`` (a module or a name in one) is in."""
    while name not in MODULES:
        name = name.rpartition(".")[0]
    return name


def _imports(path: Path) -> list[tuple[str, str | None, int]]:
    """(module imported, name imported from it or None, line) for every amp_fx import in ``path``."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(a.name, None, node.lineno) for a in node.names if a.name.split(".")[0] == "amp_fx"]
        elif (
            isinstance(node, ast.ImportFrom)
            and node.level == 0
            and node.module
            and node.module.split(".")[0] == "amp_fx"
        ):
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                out.append((sub, None, node.lineno) if sub in MODULES else (node.module, a.name, node.lineno))
    return out


def _graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {m: set() for m in MODULES}
    for module, path in MODULES.items():
        for imported, _, _ in _imports(path):
            target = _owner(imported)
            if target != module:
                graph[module].add(target)
    return graph


def _layers() -> list[tuple[int, list[str]]]:
    """The rows of the "Layers" table in docs/contributing.md: (layer, module prefixes)."""
    text = CONTRIBUTING.read_text()
    section = text.split("## Layers", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        match = re.match(r"\|\s*(\d+)\s*\|([^|]*)\|", line)
        if match:
            rows.append((int(match.group(1)), re.findall(r"`(amp_fx[\w.]*)`", match.group(2))))
    return rows


def _layer_of(module: str, rows: list[tuple[int, list[str]]]) -> int | None:
    """The layer of the longest prefix that names ``module`` or a package above it."""
    best: tuple[int, int] | None = None
    for layer, prefixes in rows:
        for prefix in prefixes:
            if module == prefix or module.startswith(prefix + "."):
                if best is None or len(prefix) > best[0]:
                    best = (len(prefix), layer)
    return None if best is None else best[1]


def test_the_layers_table_is_there_and_names_real_modules():
    rows = _layers()
    assert len(rows) >= 5, "docs/contributing.md has no '## Layers' table"
    named = [p for _, prefixes in rows for p in prefixes]
    assert len(named) == len(set(named)), "a module is in two layers"
    assert not [p for p in named if p not in MODULES], "the table names modules that do not exist"


def test_every_library_module_has_a_layer():
    rows = _layers()
    missing = sorted(m for m in MODULES if not m.startswith("amp_fx.testing") and _layer_of(m, rows) is None)
    assert not missing, f"add these to the Layers table of docs/contributing.md: {missing}"


def _upward_imports(graph: dict[str, set[str]], rows: list[tuple[int, list[str]]]) -> list[str]:
    wrong = []
    for module, targets in graph.items():
        if module.startswith("amp_fx.testing"):
            continue  # tests' and benches' helpers: they may use any layer
        mine = _layer_of(module, rows)
        for target in targets:
            if target.startswith("amp_fx.testing"):
                wrong.append(f"{module} imports {target} (the library never imports amp_fx.testing)")
            elif (theirs := _layer_of(target, rows)) is not None and mine is not None and theirs > mine:
                wrong.append(f"{module} (layer {mine}) imports {target} (layer {theirs})")
    return sorted(wrong)


def _cycles(graph: dict[str, set[str]]) -> list[str]:
    cycles = []
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for target in sorted(graph[module]):
            if state.get(target) == 1:
                cycles.append(" -> ".join(path[path.index(target) :] + [target]))
            elif target not in state:
                visit(target, [*path, target])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    return cycles


def test_no_import_against_the_layering():
    assert not (wrong := _upward_imports(_graph(), _layers())), "\n".join(wrong)


def test_no_import_cycle():
    assert not (cycles := _cycles(_graph())), "\n".join(cycles)


@pytest.mark.parametrize(
    "module, target",
    [
        ("amp_fx.policy", "amp_fx.step"),  # a table importing the training step
        ("amp_fx.passes.insert_casts", "amp_fx.api"),  # a pass importing the public face
        ("amp_fx.backend.compiler", "amp_fx.testing.zoo"),  # the library importing test helpers
    ],
)
def test_the_checks_catch_an_upward_import_and_the_cycle_it_makes(module, target):
    graph = {m: set(t) for m, t in _graph().items()}
    graph[module].add(target)
    assert any(line.startswith(f"{module} ") for line in _upward_imports(graph, _layers()))
    if not target.startswith("amp_fx.testing"):  # the step and compile reach policy and passes
        assert any(module in c and target in c for c in _cycles(graph))


def test_no_private_name_imported_across_modules():
    wrong = []
    for module, path in MODULES.items():
        for imported, name, line in _imports(path):
            if name is not None and name.startswith("_") and not name.startswith("__") and _owner(imported) != module:
                wrong.append(f"{path.relative_to(ROOT)}:{line} imports {name} from {imported}")
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize(
    "attribute, owner",
    [
        ("_amp_fx_backend", "amp_fx/backend/wrapper.py"),  # a compiled module's backend: backend_of
        ("_amp_fx_inplace", "amp_fx/backend/inplace.py"),  # the call of compile(inplace=True)
        ("_skip_record", "amp_fx/scaler/grad_scaler.py"),  # the scaler's overflow record
    ],
)
def test_private_state_is_read_by_its_owner_only(attribute, owner):
    readers = sorted(
        str(p.relative_to(ROOT))
        for p in MODULES.values()
        if re.search(rf"\.{attribute}\b|[\"']{attribute}[\"']", p.read_text())
    )
    assert readers in ([], [owner]), readers
