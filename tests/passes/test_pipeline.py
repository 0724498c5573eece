"""The pipeline is declared once (``amp_fx.passes.pipeline.PIPELINE``), documented once (the table in
``amp_fx/passes/README.md``), and each stage's preconditions are checked in strict mode."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from amp_fx import Options
from amp_fx.passes import pipeline
from amp_fx.passes.pipeline import PIPELINE, StageFailure, run_pipeline

README = Path(pipeline.__file__).with_name("README.md")


def test_the_readme_table_lists_the_stages_in_order():
    rows = re.findall(r"^\| `(\w+)` \| `passes/(\w+)\.py` \|", README.read_text(), re.MULTILINE)
    assert [name for name, _ in rows] == [s.name for s in PIPELINE]
    assert all(Path(pipeline.__file__).with_name(f"{file}.py").exists() for _, file in rows)


@pytest.mark.parametrize(
    "option, stage",
    [
        ("fold", "fold_casts"),
        ("watch_nonfinite", "watch_nonfinite"),
        ("weight_cache", "lift_weight_casts"),
        ("fp8", "fp8_matmuls"),
    ],
)
def test_each_optional_stage_follows_its_option(option, stage):
    by_name = {s.name: s for s in PIPELINE}
    default = Options()
    flipped = default.replace(**{option: "tensorwise" if option == "fp8" else not getattr(default, option)})
    assert by_name[stage].enabled(default) != by_name[stage].enabled(flipped)
    assert all(s.enabled(default) == s.enabled(flipped) for s in PIPELINE if s.name != stage)


def _dynamo_graph() -> tuple[torch.fx.GraphModule, list[torch.Tensor]]:
    graphs = []

    def keep(gm, inputs):
        graphs.append((gm, list(inputs)))
        return gm.forward

    torch._dynamo.reset()
    fn = torch.compile(lambda x, w: torch.nn.functional.linear(x, w).relu(), backend=keep)
    fn(torch.randn(2, 4), torch.randn(3, 4))
    return graphs[0]


def test_a_stage_whose_preconditions_fail_is_named_in_strict_mode():
    """insert_casts run on Dynamo's graph (capture skipped). Without the check it would run and
    decide nothing (Dynamo's torch-level calls are not ATen ops; the graph comes back unchanged):
    strict mode names the stage and what is missing instead."""
    gm, inputs = _dynamo_graph()
    # a StageFailure: in amp_fx.compile, the backend falls back to torch.compile for that graph
    with pytest.raises(
        StageFailure,
        match=r"insert_casts failed on graph 0 \(passes run before it: none\): "
        r"AssertionError: precondition aten_graph does not hold",
    ):
        run_pipeline(Options(strict=True, backend="eager"), gm, inputs, stages=PIPELINE[1:])
    work = run_pipeline(Options(strict=False, backend="eager"), gm, inputs, stages=PIPELINE[1:])
    assert work.inserted.casts_inserted == 0  # what the check is there for: a silent no-op


def test_the_whole_pipeline_passes_its_own_checks():
    gm, inputs = _dynamo_graph()
    work = run_pipeline(Options(strict=True, backend="eager", watch_nonfinite=True), gm, inputs)
    record = work.record(torch.bfloat16)
    assert set(record.pass_seconds) == {s.name for s in PIPELINE}
    assert record.pass_seconds["lift_weight_casts"] == 0.0  # weight_cache off: not run
    assert record.inserted.casts_inserted == 2 and record.watched is not None
