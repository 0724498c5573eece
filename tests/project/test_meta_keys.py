"""The node-metadata register, executable: every ``"amp_fx_..."`` key of an FX node's ``meta`` is
defined in ``amp_fx/passes/meta.py`` and used through its name there, nowhere as a raw string
(the module's docstring says who writes and who reads each key; a key spelled inline is one that
table does not know, and a typo in it reads as "not set" instead of failing).

Read from the source (``ast``) of ``amp_fx/`` and ``tests/``: a string starting with ``amp_fx_``
used as a key of an expression ending in ``.meta`` (``n.meta[...]``, ``n.meta.get(...)``,
``.pop``, ``.setdefault``, ``... in n.meta``, and one level down: ``n.meta["custom"][...]``), and
a module-level name bound to such a string outside the register.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from amp_fx.passes import meta

ROOT = Path(__file__).resolve().parents[2]
REGISTER = ROOT / "amp_fx" / "passes" / "meta.py"
FILES = sorted(p for d in ("amp_fx", "tests") for p in (ROOT / d).rglob("*.py") if p != REGISTER)
# module-level names bound to an "amp_fx_..." string that are not node-metadata keys
NOT_KEYS = {("amp_fx/testing/memory.py", "COUNTING_BACKEND")}  # a backend's name


def _is_meta(expr: ast.expr) -> bool:
    """``<anything>.meta``, or one subscript below it (``n.meta["custom"]``)."""
    if isinstance(expr, ast.Attribute):
        return expr.attr == "meta"
    if isinstance(expr, ast.Subscript):
        return _is_meta(expr.value)
    if isinstance(expr, ast.Call) and isinstance(expr.func, ast.Attribute) and expr.func.attr == "get":
        return _is_meta(expr.func.value)  # n.meta.get("custom", {})
    return False


def _raw(expr: ast.expr | None) -> str | None:
    if isinstance(expr, ast.Constant) and isinstance(expr.value, str) and expr.value.startswith("amp_fx_"):
        return expr.value
    return None


def _raw_keys(path: Path) -> list[str]:
    found = []
    tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree):
        key = None
        if isinstance(node, ast.Subscript) and _is_meta(node.value):
            key = _raw(node.slice)
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in ("get", "pop", "setdefault")
            and _is_meta(node.func.value)
            and node.args
        ):
            key = _raw(node.args[0])
        elif (
            isinstance(node, ast.Compare)
            and any(isinstance(op, (ast.In, ast.NotIn)) for op in node.ops)
            and any(_is_meta(c) for c in node.comparators)
        ):
            key = _raw(node.left)
        if key is not None:
            found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {key!r}")
    rel = str(path.relative_to(ROOT))
    for node in tree.body:
        targets = (
            node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        )
        value = getattr(node, "value", None)
        for t in targets:
            if isinstance(t, ast.Name) and _raw(value) and (rel, t.id) not in NOT_KEYS:
                found.append(f"{rel}:{node.lineno}: {t.id} = {_raw(value)!r} (define it in amp_fx/passes/meta.py)")
    return found


def test_no_raw_node_metadata_key_outside_the_register():
    found = [f for path in FILES for f in _raw_keys(path)]
    assert not found, "node-metadata keys spelled inline; use amp_fx.passes.meta's names:\n" + "\n".join(found)


def test_every_key_of_the_register_is_in_its_table():
    keys = [
        name
        for name in meta.__all__
        if isinstance(getattr(meta, name), str) and getattr(meta, name).startswith("amp_fx_")
    ]
    assert len(set(getattr(meta, k) for k in keys)) == len(keys), "two names for one key"
    missing = [k for k in keys if f"``{k}``" not in (meta.__doc__ or "")]
    assert not missing, f"keys without a row (writer, readers) in amp_fx/passes/meta.py's table: {missing}"


@pytest.mark.parametrize(
    "source",
    [
        'n.meta["amp_fx_decision"]',
        'n.meta.get("amp_fx_cast")',
        '"amp_fx_fp8" in node.meta',
        'n.meta["custom"]["amp_fx_node"]',
        'KEY = "amp_fx_weight_use"',
    ],
)
def test_the_check_finds_each_form(tmp_path, source):
    path = ROOT / "tests" / "_meta_key_probe.py"
    try:
        path.write_text(source + "\n")
        assert len(_raw_keys(path)) == 1
    finally:
        path.unlink()
