"""Code that branches on how it is run takes eager's branch under amp_fx.

torch 2.11's Dynamo traces ``torch.compiler.is_exporting()`` as ``True`` under ``torch.compile``
(2.13 and later read the real flag, pytorch#176499). transformers branches on it: while compiling on
2.11 it never skips the causal mask, so T5, Llama and Mixtral ran another computation than eager
(T5's ``relative_attention_bias`` gradients summed over the batch in another order; Llama's and
Mixtral's with shared key/value heads). amp_fx's own compiles trace the flag's run-time value
(``amp_fx._common.compat.is_exporting_as_eager``); the real-model tier is bitwise on those models
on 2.11 since (tests/models/test_real_models.py, tests/test_weight_cache_hf.py).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch

import amp_fx
from amp_fx._common.compat import dynamo_folds_is_exporting
from amp_fx.testing import assert_bitwise


class _BranchesOnExport(torch.nn.Module):
    """A linear whose output is masked one way under export and another way otherwise, as
    transformers' masks are."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        if torch.compiler.is_exporting():
            return h * 3.0
        return h.relu()


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad for n, p in model.named_parameters()}


def test_branch_on_is_exporting_is_eagers_under_amp_fx() -> None:
    """Output and gradients bitwise eager autocast's, whichever torch: fails on 2.11 without
    is_exporting_as_eager (the graph then scales by 3 instead of the relu)."""
    torch.manual_seed(0)
    model, x = _BranchesOnExport(), torch.randn(4, 8)
    ref = copy.deepcopy(model)
    with torch.autocast("cpu", torch.bfloat16):
        expected = ref(x)
    expected.float().sum().backward()
    compiled = amp_fx.compile(model, dtype="bf16", backend="aot_eager", strict=True)
    out = compiled(x)
    out.float().sum().backward()
    assert compiled.amp_fx_records, "Dynamo captured no graph: eager was compared with eager"
    assert_bitwise(out, expected, "output")
    assert_bitwise(_grads(model), _grads(ref), "grads")


def test_other_compiles_keep_dynamos_answer() -> None:
    """The rewrite is amp_fx's alone: a plain torch.compile in the same process, after an amp_fx
    compile, still traces what its Dynamo traces (the export branch where Dynamo folds the flag)."""
    amp_fx.compile(_BranchesOnExport(), dtype="bf16", backend="aot_eager")(torch.randn(2, 8))
    graphs: list[torch.fx.GraphModule] = []

    def record(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        graphs.append(gm)
        return gm.forward

    torch.compile(_BranchesOnExport(), backend=record)(torch.randn(2, 8))
    targets = {str(n.target) for gm in graphs for n in gm.graph.nodes if n.op == "call_function"}
    took_export_branch = any("mul" in t for t in targets)
    assert took_export_branch == dynamo_folds_is_exporting(), targets
