"""Dynamo's input metadata, carried from Dynamo's graph onto the graph amp_fx hands downstream.

AOTAutograd reads three things off the ``GraphModule`` a backend gives it
(``_try_get_metadata_from_dynamo`` in ``torch/_functorch/_aot_autograd/frontend_utils.py``):
``meta["dynamo_compile_id"]``, the ``_param_name_to_source`` attribute and each placeholder's
``_dynamo_source``; where one is missing, it takes the graph for one Dynamo did not capture and
marks no input static. The graph amp_fx compiles is a new one (capture traces Dynamo's graph into
ATen ops), so it had none of them, and that changed what the downstream backend does with the
parameters, which are graph inputs since Dynamo inlines ``nn.Module``\\ s:

* the min-cut partitioner counts a parameter saved for the backward as free only if it is static
  (``torch._functorch.config.treat_parameters_as_free_to_save``); otherwise it saves whatever is
  smaller than the fp32 weight. With ``fp8=``, that was every weight's fp8 cast, one byte per
  parameter held from the forward to the backward, where torchao (and torch.compile) save the
  weight itself and cast it again in the backward;
* inductor's CUDA graphs (``mode="reduce-overhead"``) copy every non-static input into the graph's
  buffers at each replay: every parameter, every step.

:func:`carry_dynamo_inputs` copies them, as ``torch._dynamo.backends.distributed`` does for the
subgraphs DDPOptimizer splits off: the placeholders amp_fx's graph shares with Dynamo's come first
and in the same order (capture keeps them; the weight cache appends its inputs after them), and
an input amp_fx added gets no source and stays non-static.
"""

from __future__ import annotations

import logging

import torch.fx
from torch._dynamo.source import ConstantSource
from torch._guards import Source

__all__ = ["carry_dynamo_inputs"]

log = logging.getLogger(__name__)

_SOURCE = "_dynamo_source"
_STATIC = "tensor_dict"  # node.meta["tensor_dict"]["_dynamo_static_input_type"] marks a static input


def carry_dynamo_inputs(dynamo_gm: torch.fx.GraphModule, gm: torch.fx.GraphModule) -> None:
    """Give ``gm`` (a graph traced from ``dynamo_gm``, its placeholders first and in order) Dynamo's
    input metadata: the compile id, the parameter sources, and each shared placeholder's source and
    static mark. Leaves ``gm`` alone where ``dynamo_gm`` has none to give (not captured by Dynamo)
    or where the two do not line up: AOTAutograd then treats ``gm`` as it did before."""
    if gm is dynamo_gm or "dynamo_compile_id" not in dynamo_gm.meta:
        return
    theirs = list(dynamo_gm.graph.find_nodes(op="placeholder"))
    ours = list(gm.graph.find_nodes(op="placeholder"))
    if len(ours) < len(theirs) or not all(hasattr(n, _SOURCE) for n in theirs):
        return
    param_sources = getattr(dynamo_gm, "_param_name_to_source", None)
    if param_sources is None:
        return
    param_sources = _with_constant_sources(gm, param_sources)
    if param_sources is None:
        return
    for node, dynamo_node in zip(ours, theirs, strict=False):
        setattr(node, _SOURCE, getattr(dynamo_node, _SOURCE))
        if _STATIC in dynamo_node.meta:
            node.meta[_STATIC] = dynamo_node.meta[_STATIC]
    for node in ours[len(theirs) :]:
        setattr(node, _SOURCE, None)
    setattr(gm, "_param_name_to_source", param_sources)  # Dynamo's attribute, not declared on GraphModule
    gm.meta["dynamo_compile_id"] = dynamo_gm.meta["dynamo_compile_id"]


def _with_constant_sources(gm: torch.fx.GraphModule, param_sources: dict[str, Source]) -> dict[str, Source] | None:
    """``param_sources`` with a source for each of ``gm``'s own buffers that has none, or None.

    AOTAutograd lifts ``gm``'s own parameters and buffers as inputs and asserts a Dynamo source for
    each (it keys its duplicate-input guards and the static marks on them). Capture makes a buffer
    of each tensor constant the model creates while traced (``_tensor_constant0``: GPT-2's
    attention builds several, at every shape), which Dynamo never saw: each gets a
    ``ConstantSource`` of its own name, so the graph is still handed over as Dynamo's (before,
    every GPT-2 graph was left on AOTAutograd's plain path, whose partitioner saved each weight's
    fp8 cast for the backward). A constant is never an input of the frame, so no guard needs it;
    where a source would be needed for a guard (one tensor under two names, which AOTAutograd
    deduplicates with a guard on both sources) or an own parameter has none, None: the graph is
    left as it was, and the debug log names it."""
    owned = [*gm.named_parameters(remove_duplicate=False), *gm.named_buffers(remove_duplicate=False)]
    buffers = {name for name, _ in gm.named_buffers(remove_duplicate=False)}
    missing = [name for name, _ in owned if name not in param_sources]
    if not missing:
        return param_sources
    shared = len({id(t) for _, t in owned}) < len(owned)
    if shared or any(name not in buffers for name in missing):
        log.debug(
            "carry_dynamo_inputs: %s have no Dynamo source (%s): the graph is handed over as a "
            "graph Dynamo did not capture",
            missing,
            "a tensor under two names" if shared else "parameters",
        )
        return None
    return {**param_sources, **{name: ConstantSource(f"amp_fx.{name}") for name in missing}}
