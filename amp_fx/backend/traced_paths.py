"""Model code that runs another computation when traced than when it runs eagerly.

Some libraries branch on being traced, or on data a graph cannot read without a guard. The
compiled model is then not the computation eager autocast runs, and no cast policy makes it
bitwise. amp_fx cannot change such code; it finds the known cases in Dynamo's graph (by the
functions its nodes were traced from: ``node.meta["stack_trace"]``) and says so once per compiled
model, as for any parity amp_fx cannot give (an ``AmpFxWarning``; an ``AmpFxError`` in strict
mode). docs/parity.md, "Models that branch on being compiled", has the table.

Known case: transformers' grouped-query attention under sdpa. Traced, transformers cannot read
``position_ids`` to rule out packed sequences, nor the padding mask to see that nothing is padded,
so it builds a causal mask (``masking_utils.sdpa_mask``); with a mask, sdpa is called without
``enable_gqa`` and key/value heads are repeated in the low dtype (``repeat_kv`` in
``integrations/sdpa_attention.py``). Eager, with no padded token and no packing, passes no mask
and calls sdpa with ``enable_gqa=True``: the k/v gradients are summed over the shared heads in
another order. With padding, eager builds the mask too, and both agree.
"""

from __future__ import annotations

import re

import torch

from amp_fx._common.report import Reporter

__all__ = ["report_traced_paths"]

_FRAME = re.compile(r'File "([^"]+)", line \d+, in (\w+)')


def _frames(gm: torch.fx.GraphModule) -> set[tuple[str, str]]:
    """(file, function) of every frame the graph's nodes were traced from."""
    found: set[tuple[str, str]] = set()
    for node in gm.graph.nodes:
        trace = node.meta.get("stack_trace")
        if trace:
            found.update((path.replace("\\", "/"), fn) for path, fn in _FRAME.findall(trace))
    return found


def _gqa_with_traced_mask(frames: set[tuple[str, str]]) -> bool:
    functions = {(path.rsplit("transformers/", 1)[-1], fn) for path, fn in frames if "transformers/" in path}
    return (("masking_utils.py", "sdpa_mask") in functions
            and ("integrations/sdpa_attention.py", "repeat_kv") in functions)


def report_traced_paths(gm: torch.fx.GraphModule, reporter: Reporter) -> None:
    """Report, once per owner, each known traced path in Dynamo's graph ``gm``."""
    if _gqa_with_traced_mask(_frames(gm)):
        reporter.did_less(("traced_path", "transformers_gqa_sdpa"), (
            "amp_fx: this model's grouped-query attention runs another computation compiled than eager: "
            "traced, transformers cannot check position_ids for packed sequences or the padding mask, so it "
            "builds a causal mask and repeats the key/value heads in the low dtype (repeat_kv) before sdpa; "
            "eager, with no padded or packed token, passes no mask and calls sdpa with enable_gqa=True. The "
            "k/v projections' gradients then differ from eager autocast's in the last bits (plain torch.compile "
            "under autocast alike; amp_fx is bitwise with it). Training is unaffected beyond that; for "
            "bitwise parity, attn_implementation='eager' takes one path in both (slower). docs/parity.md, "
            "'Models that branch on being compiled', has the details."))
