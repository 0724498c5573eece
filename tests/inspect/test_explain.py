"""amp_fx.explain: per-node dtypes match the rewritten graph and the values it really computes."""

from __future__ import annotations

import contextlib
import functools
import re
import shutil

import pytest
import torch
import torch.fx

import amp_fx
from amp_fx.inspect import _graphviz
from amp_fx.testing.zoo import ZOO
from tests.inspect._inspect_models import (
    SPLIT_CASES,
    AutocastMask,
    BNNet,
    BreakInside,
    RoundTrip,
    TwoLayer,
    seeded,
    split_case,
    split_weights_noted,
    split_weights_reported,
)

EXPLAIN_ZOO = [
    "mlp",
    "cnn_bn",
    "mha_block",
    "sdpa_block",
    "rmsnorm",
    "graph_break",
    "graph_break_branch",
    "classifier_loss",
    "tied_embedding",
]


# torch's fake kernel gives batch norm's saved mean/invstd the input's dtype (bf16/fp16); the CPU
# kernel keeps them fp32. Those outputs feed only the backward.
KNOWN_META_MISMATCH = "(aten.native_batch_norm): meta "


def _meta_dtype(n: torch.fx.Node) -> torch.dtype | None:
    from amp_fx.inspect._probe import value_dtype

    return value_dtype(n.meta.get("val")) if n.op != "output" else None


def _runtime_dtype_backend(seen: dict[int, dict[str, torch.dtype | None]]):
    """A downstream backend written here: runs each graph node by node and records the dtype of
    every value (the reference explain is checked against)."""

    def backend(gm: torch.fx.GraphModule, example_inputs):
        index = len(seen)
        seen[index] = {}

        class Recorder(torch.fx.Interpreter):
            def run_node(self, n):
                out = super().run_node(n)
                t = (
                    out
                    if isinstance(out, torch.Tensor)
                    else next(
                        (
                            x
                            for x in (out if isinstance(out, (tuple, list)) else ())
                            if isinstance(x, torch.Tensor) and x.is_floating_point()
                        ),
                        None,
                    )
                )
                if n.op != "output":
                    seen[index][n.name] = t.dtype if isinstance(t, torch.Tensor) else None
                return out

        return lambda *args: Recorder(gm).run(*args)

    return backend


@pytest.mark.slow_cases
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("name", EXPLAIN_ZOO)
def test_node_dtypes_match_rewritten_graph_and_runtime(name, dtype):
    model, inputs, _ = ZOO[name].build()
    ex = amp_fx.explain(model, *inputs, dtype=dtype)  # none of EXPLAIN_ZOO needs dynamo_config
    assert ex.records, "explain captured no graph"
    assert len(ex.records) == 1 + ZOO[name].graph_breaks

    seen: dict[int, dict[str, torch.dtype | None]] = {}
    model2, inputs2, _ = ZOO[name].build()
    split = ZOO[name].split_params  # reported by amp_fx (an error in strict mode), not under test here
    compiled = amp_fx.compile(
        model2, dtype=dtype, backend=_runtime_dtype_backend(seen), strict=False if split else None
    )
    with pytest.warns(amp_fx.AmpFxWarning, match="both sides of a graph break") if split else contextlib.nullcontext():
        compiled(*inputs2)
    from_records = amp_fx.Explanation.from_records(amp_fx.records(compiled))
    assert len(seen) == len(ex.records)
    for r in ex.records:
        shown = ex.dtypes(r.index)
        # the same model compiled on its own and run node by node by the backend above
        runtime = seen[r.index]
        assert {k: shown[k] for k in runtime} == runtime
        assert ex.runtime_dtypes(r.index) == {k: shown[k] for k in ex.runtime_dtypes(r.index)}
        # without inputs (from the records), explain shows the graph's meta["val"] dtypes; they
        # agree with run time except where a fake kernel disagrees with the real one (listed)
        meta = from_records.dtypes(r.index)
        assert meta == {n.name: _meta_dtype(n) for n in r.rewritten.graph.nodes}
        differ = {k for k in runtime if meta[k] != runtime[k]}
        listed = {m.split(" ")[0] for m in ex.meta_mismatches(r.index)}
        assert differ == listed
        assert all(KNOWN_META_MISMATCH in m for m in ex.meta_mismatches(r.index))


def test_rules_modules_and_inserted_casts():
    model, x = seeded(TwoLayer, 2, 4)
    ex = amp_fx.explain(model, x, dtype="bf16", policy=amp_fx.Policy(keep_fp32=("fc2",)))
    nodes = {n.name: n for n in ex.nodes(0)}
    linears = [n for n in nodes.values() if n.op == "aten.linear"]
    assert [(n.module, n.dtype) for n in linears] == [("fc1", torch.bfloat16), ("fc2", torch.float32)]
    assert linears[0].rule == "lower precision fp: aten.linear (default cpu table)"
    assert linears[1].rule == "fp32: module fc2 kept by policy (fc2)"
    gelu = next(n for n in nodes.values() if n.op == "aten.gelu")
    assert gelu.rule.startswith("not autocast") and gelu.rule.endswith("(bf16)")
    inserted = [n for n in nodes.values() if n.cast == "inserted"]
    # x, fc1.weight, fc1.bias -> bf16; fc1's output -> fp32 for the kept fc2
    assert len(inserted) == ex.records[0].inserted.casts_inserted == 4
    assert {n.label for n in nodes.values() if n.kind == "input"} == {
        "x",
        "fc1.weight",
        "fc1.bias",
        "fc2.weight",
        "fc2.bias",
    }
    text = ex.table()
    assert "+cast" in text and "kept by policy (fc2)" in text and "fc2 (Linear)" in text


def test_folded_casts_are_marked_and_counted():
    model, x = seeded(RoundTrip, 2, 4)
    ex = amp_fx.explain(model, x, dtype="bf16")
    r = ex.records[0]
    assert r.folded.by_rule  # the bf16 -> fp32 -> bf16 round trip folds
    folded = [n for n in ex.nodes(0) if n.folded]
    assert folded and all(set(n.folded) <= set(r.folded.by_rule) for n in folded)
    row = ex.summary_rows()[0]
    for rule, count in r.folded.by_rule.items():
        assert f"{rule} {count}" in row["casts folded"]
    assert "folded(" in ex.graph_text(0)
    # negative twin: without fold, nothing is marked
    ex2 = amp_fx.explain(model, x, dtype="bf16", fold=False)
    assert not any(n.folded for n in ex2.nodes(0))


def test_cast_bytes_hand_computed():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    ex = amp_fx.explain(model, torch.randn(2, 4), dtype="fp16")
    # casts of x (2*4), weight (4*4), bias (4) from fp32 (4 bytes) to fp16 (2 bytes)
    assert ex.cast_bytes(0) == (8 + 16 + 4) * (4 + 2)
    assert ex.summary_rows()[0]["cast bytes/call"] == "168 B"
    assert ex.summary_rows()[0]["ops per dtype"] == "fp16 1"


def test_before_after_shows_three_dtypes():
    model, x = seeded(TwoLayer, 2, 4)
    text = amp_fx.explain(model, x, dtype="bf16").before_after(0)
    lines = [ln for ln in text.splitlines() if ln.startswith("linear ")]
    assert lines and lines[0].split()[3:6] == ["fp32", "bf16", "bf16"]


def test_from_compiled_model_records():
    model, x = seeded(TwoLayer, 2, 4)
    compiled = amp_fx.compile(model, dtype="bf16", backend="eager")
    with pytest.raises(ValueError, match="has not run yet"):
        amp_fx.explain(compiled)
    compiled(x)
    ex = amp_fx.explain(compiled)
    assert ex.records == amp_fx.records(compiled)
    assert ex.dtypes(0) == amp_fx.Explanation.from_records(compiled.amp_fx_records).dtypes(0)
    # with inputs, the compiled module's dtype and policy are used
    assert amp_fx.explain(compiled, x).dtypes(0) == ex.dtypes(0)


def test_user_model_untouched():
    model, x = seeded(BNNet, 2, 2, 4, 4)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    amp_fx.explain(model, x)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert all(p.grad is None for p in model.parameters())


def test_empty_graph_and_integer_only():
    ex = amp_fx.explain(lambda x: x, torch.randn(3))
    assert "no ops were captured" in str(ex)
    ex = amp_fx.explain(lambda x: x * 2 + 1, torch.arange(4))
    assert "no floating-point ops" in str(ex)
    assert all(n.cast is None for n in ex.nodes())


def test_bad_inputs_and_failing_model():
    model, _ = seeded(TwoLayer, 2, 4)
    with pytest.raises(ValueError, match="inputs do not match the model.*mat1 and mat2") as info:
        amp_fx.explain(model, torch.randn(2, 5))
    assert isinstance(info.value.__cause__, RuntimeError)

    class Broken(torch.nn.Module):
        def forward(self, x):
            raise KeyError("boom")

    with pytest.raises(ValueError, match="fails in eager mode.*KeyError") as info:
        amp_fx.explain(Broken(), torch.randn(2))
    assert isinstance(info.value.__cause__, KeyError)


def test_dot_and_svg(tmp_path, monkeypatch):
    model, x = seeded(TwoLayer, 2, 4)
    ex = amp_fx.explain(model, x, dtype="bf16")
    dot = ex.to_dot(tmp_path / "g.dot")
    assert dot.startswith("digraph") and (tmp_path / "g.dot").read_text() == dot
    assert _graphviz.DTYPE_COLORS["bf16"] in dot and _graphviz.INSERTED_CAST_BORDER in dot
    assert dot.count("CAST (amp_fx") == ex.records[0].inserted.casts_inserted
    if shutil.which("dot"):
        svg = ex.to_svg(tmp_path / "g.svg")
        assert "<svg" in svg.read_text()
    monkeypatch.setattr(_graphviz.shutil, "which", lambda name: None)
    with pytest.raises(amp_fx.GraphvizNotFound, match="apt-get install graphviz") as info:
        ex.to_svg(tmp_path / "h.svg")
    assert info.value.dot_path.read_text() == dot


def _root_names(model: torch.nn.Module, *args: torch.Tensor) -> set[str]:
    """The reference: the root module's parameter names and its forward's argument names."""
    import inspect

    params = list(inspect.signature(model.forward).parameters)
    return {n for n, _ in model.named_parameters()} | set(params[: len(args)])


@pytest.mark.parametrize(
    "build",
    [
        lambda: torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2)),
        lambda: torch.nn.Linear(4, 2),
        BreakInside.Inner,  # a user module: Dynamo's frame is its forward
    ],
)
def test_inputs_named_as_the_root_module_names_them(build):
    torch.manual_seed(0)
    model = build()
    x = torch.randn(3, 4 if not isinstance(model, BreakInside.Inner) else 8)
    expected = _root_names(model, x)
    ex = amp_fx.explain(model, x, dtype="bf16")
    assert {n.label for n in ex.nodes(0) if n.kind == "input"} == expected
    # a compiled model explained from its records names them alike
    compiled = amp_fx.compile(model, dtype="bf16", backend="eager")
    compiled(x)
    assert {n.label for n in amp_fx.explain(compiled).nodes(0) if n.kind == "input"} == expected


def test_inputs_named_under_the_root_across_a_graph_break_in_a_submodule():
    torch.manual_seed(0)
    model, x = BreakInside(), torch.randn(2, 8)
    ex = amp_fx.explain(model, x, dtype="bf16")
    labels = {n.label for n in ex.nodes(0) if n.kind == "input"}
    assert labels == _root_names(model, x)  # model.a.weight, not a.weight (the frame's names)
    linears = [n.module for n in ex.nodes(0) if n.op == "aten.linear"]
    assert linears == ["model.a", "model.head"]  # modules too, as model.named_modules() has them
    assert all(dict(model.named_modules())[m] is model.model.get_submodule(m.split(".", 1)[1]) for m in linears)


def test_missing_without_amp_view_is_said_and_strict_raises(monkeypatch):
    """The 'without amp' dtypes come from the captured graph run without autocast; a mask made
    with dtype=q.dtype under autocast stops it (as in HF T5). explain says so instead of showing
    blanks, and strict mode makes it an error."""
    model, x = seeded(AutocastMask, 2, 4, 8)
    monkeypatch.delenv("AMP_FX_STRICT", raising=False)
    ex = amp_fx.explain(model, x, dtype="bf16")
    with pytest.warns(amp_fx.AmpFxWarning, match="graph 0's dtypes without amp are not shown"):
        text = str(ex)
    assert "note: graph 0's dtypes without amp are not shown" in text
    assert "attn_mask" in text
    # the rewritten graph is still explained: sdpa runs in bf16 as under eager autocast
    sdpa = next(n for n in ex.nodes(0) if n.op == "aten.scaled_dot_product_attention")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        q = model.qkv(x).chunk(3, -1)[0]
    assert sdpa.dtype is q.dtype is torch.bfloat16
    monkeypatch.setenv("AMP_FX_STRICT", "1")
    strict = amp_fx.explain(model, x, dtype="bf16")
    with pytest.raises(amp_fx.AmpFxError, match="dtypes without amp are not shown"):
        str(strict)


@pytest.mark.parametrize("case", SPLIT_CASES)
def test_names_the_weights_a_graph_break_splits(case):
    """explain names each weight cast in two graphs of one call (its gradient then sums in fp32,
    not eager autocast's low dtype): exactly the weights amp_fx's backend reports for the model
    compiled on its own, and none where every weight is on one side of the break."""
    model, inputs = split_case(case)
    expected = split_weights_reported(model, *inputs, dtype="bf16")
    assert bool(expected) == (case != "graph_break_branch")
    ex = amp_fx.explain(model, *inputs, dtype="bf16")
    assert split_weights_noted(ex.notes) == expected
    text = str(ex)
    for name in expected:
        assert f"note: {name} is used in graphs 0, 1 (a graph break between its uses)" in text


def test_printed_explanation_is_a_summary_and_a_rollup_and_the_table_is_asked_for():
    """print(explain(...)) is short: the per-graph summary with "casts left" defined, the ops rolled
    up by module and the fp8 share of matmul FLOPs; every op is in table(), where a long reason is
    written once and referenced by number in its rows."""
    from amp_fx.testing.zoo import transformer_lm

    model, (ids,), _ = transformer_lm(batch=2, seq=8)
    ex = amp_fx.explain(model, ids, dtype="bf16", fp8="tensorwise")
    text = str(ex)
    assert len(text.splitlines()) < 30 and "dtype decided by" not in text, text
    assert "casts left: the casts in the graph that runs" in text
    rollup = text[text.index("by module") :].splitlines()
    assert [line.split()[0] for line in rollup[3:8]] == ["emb", "<root>", "blocks.0", "blocks.1", "norm"], rollup
    assert "9 of 9 (tensorwise), 1.00 of their FLOPs" in text and "fp8 share of matmul FLOPs" in text
    assert "print(report.table())" in text
    table = ex.table()
    assert "dtype decided by" in table and "graph 0: matmuls with a parameter operand" in table
    legend = re.findall(r"^\[(\d+)\] (.+)$", table, flags=re.M)
    reasons = [why for _, why in legend]
    assert legend and all(len(why) > 40 for why in reasons)
    fp8_reason = next(why for why in reasons if why.startswith("fp8 tensorwise: out = x"))
    assert table.count(fp8_reason) == 2  # once under the node table, once under the fp8 one: not per matmul (9)


def _passes_self(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return fn(*args, **kwargs)

    return wrapper


class _DecoratedForward(torch.nn.Module):
    """A decorator on forward (as transformers 5.24 wraps LlamaForCausalLM.forward): Dynamo's
    source then calls the root ``L['args'][0]`` instead of ``L['self']``."""

    def __init__(self):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(16, 16))
        self.head = torch.nn.Linear(16, 16)

    @_passes_self
    def forward(self, x):
        return self.head(self.body(x))


def test_weights_are_named_by_identity_under_a_decorated_forward():
    """The fp8 table's weight column reads the parameter's name under the root (was
    ``0.body.0.weight``: a name read from the source string's shape)."""
    torch.manual_seed(0)
    ex = amp_fx.explain(_DecoratedForward(), torch.randn(16, 16), fp8="tensorwise")
    assert [(d.weight, d.module) for d in ex.fp8_decisions()] == [("body.0.weight", "body.0"), ("head.weight", "head")]
