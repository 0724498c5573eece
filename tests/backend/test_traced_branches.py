"""Code that branches on how it is run takes eager's branch under amp_fx.

torch 2.11's Dynamo traces ``torch.compiler.is_exporting()`` as ``True`` under ``torch.compile``
(2.13 and later read the real flag, pytorch#176499). transformers branches on it: while compiling on
2.11 it never skips the causal mask, so T5, Llama and Mixtral ran another computation than eager
(T5's ``relative_attention_bias`` gradients summed over the batch in another order; Llama's and
Mixtral's with shared key/value heads). amp_fx's own compiles trace the flag's run-time value
(``amp_fx._common.compat.is_exporting_as_eager``); the real-model tier is bitwise on those models
on 2.11 since (tests/models/test_real_models.py, tests/backend/test_weight_cache_hf.py).
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from typing import Any

import pytest
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


# --- the grouped-query report fires only where eager runs another computation -------------------

_GQA_REPORT = "grouped-query attention runs another computation compiled than eager"
_SEQ = 8


class _GqaAttention(torch.nn.Module):
    """transformers' sdpa attention (``sdpa_attention_forward``) with 4 query heads sharing 2
    key/value heads, its mask built by transformers' own ``create_causal_mask`` or
    ``create_sliding_window_causal_mask`` from ``position_ids``, as a decoder layer builds it."""

    def __init__(self, head_dim: int, window: int | None) -> None:
        super().__init__()
        import transformers

        self.config = transformers.Gemma3TextConfig(
            hidden_size=8,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=head_dim,
            sliding_window=window or 4096,
        )
        self.config._attn_implementation = "sdpa"
        self.window, self.head_dim = window, head_dim
        self.num_key_value_groups, self.is_causal = 2, True
        self.q, self.kv = torch.nn.Linear(8, 4 * head_dim), torch.nn.Linear(8, 4 * head_dim)
        # imported here, not in forward: torch 2.11's Dynamo cannot trace an import from transformers
        # (a _LazyModule: "Bad import result"), and skips the whole forward to eager; the mask then
        # reaches the graph of sdpa_attention_forward as an input, not as sdpa_mask's ops
        from transformers import masking_utils
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        self._make_mask = (
            masking_utils.create_causal_mask if window is None else masking_utils.create_sliding_window_causal_mask
        )
        self._attention = sdpa_attention_forward

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        b, t, _ = x.shape
        mask = self._make_mask(
            config=self.config,
            inputs_embeds=x,
            attention_mask=attention_mask,
            past_key_values=None,
            position_ids=torch.arange(t).unsqueeze(0),
        )
        q = self.q(x).view(b, t, 4, self.head_dim).transpose(1, 2)
        k, v = self.kv(x).view(b, t, 4, self.head_dim).transpose(1, 2).chunk(2, dim=1)
        out, _ = self._attention(self, q, k.contiguous(), v.contiguous(), mask)
        return out.float().square().sum()


# (head size, sliding window, padding mask given, whether eager calls sdpa with enable_gqa and no
# mask): sliding windows shorter and longer than the 8 keys, a head size past use_gqa_in_sdpa's
# 256, a padding mask of ones (data: eager's choice depends on its values) beside a plain causal
# mask and beside a short window. Each case that fires has a twin that must not.
_GQA_CASES = {
    "causal": (16, None, False, True),
    "head_size_over_256": (264, None, False, False),
    "window_longer_than_keys": (16, 9, False, True),
    "window_shorter_than_keys": (16, 4, False, False),
    "causal_padding_input": (16, None, True, True),
    "window_shorter_padding_input": (16, 4, True, False),
}


@pytest.mark.parametrize("case", list(_GQA_CASES))
def test_grouped_query_report_fires_exactly_where_eager_calls_sdpa_with_enable_gqa(case: str) -> None:
    """The traced path always repeats k/v under a materialised mask. Eager transformers runs another
    computation exactly where it drops the mask and calls sdpa with ``enable_gqa=True`` (recorded
    here on eager's own sdpa call): the report fires there and nowhere else; where it does not fire,
    strict mode compiles and the gradients are bitwise eager autocast's."""
    pytest.importorskip("transformers")
    head_dim, window, padding, eager_gqa = _GQA_CASES[case]
    torch.manual_seed(0)
    model = _GqaAttention(head_dim, window)
    x = torch.randn(2, _SEQ, 8)
    inputs = {"attention_mask": torch.ones(2, _SEQ, dtype=torch.long)} if padding else {}
    ref = copy.deepcopy(model)
    seen: list[bool] = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(*args: Any, **kwargs: Any) -> torch.Tensor:
        seen.append(bool(kwargs.get("enable_gqa")) and kwargs.get("attn_mask") is None)
        return sdpa(*args, **kwargs)

    with pytest.MonkeyPatch.context() as patch, torch.autocast("cpu", torch.bfloat16):
        patch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
        expected = ref(x, **inputs)
    expected.backward()
    assert seen == [eager_gqa], "the premise: eager transformers' choice for this case"
    differs = seen[0]
    compiled = amp_fx.compile(model, dtype="bf16", backend="aot_eager", strict=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", amp_fx.AmpFxWarning)
        compiled(x, **inputs).backward()
    reported = [w for w in caught if _GQA_REPORT in str(w.message)]
    assert len(reported) == int(differs), (case, differs, [str(w.message)[:100] for w in caught])
    if not differs:
        strict = amp_fx.compile(copy.deepcopy(ref), dtype="bf16", backend="aot_eager", strict=True)
        strict(x, **inputs)  # no AmpFxError
        assert_bitwise(_grads(model), _grads(ref), "grads")
