"""The node-metadata keys amp_fx writes on FX nodes: one home, with who writes and who reads each.

Passes record their decisions on the nodes they touch (decisions are recorded where they are
made: ``amp_fx/passes/README.md``, "Invariants every pass keeps"), and the inspection tools read
those records instead of recomputing them. Use these names, never the raw strings.

=====================  ==============================  ==========================================
key                    written by                      read by
=====================  ==============================  ==========================================
``AUTOCAST_DTYPE``     capture, every tensor node:     insert_casts (``autocast_mismatches``),
                       the dtype eager autocast gives  inspection tools
                       the value
``LEAF``               capture, every placeholder:     insert_casts (which casts are shared, as
                       a leaf tensor that requires     eager autocast's cast cache shares them),
                       grad                            the probes of find_nonfinite
``DECISION``           insert_casts, every ATen op:    explain, compare, find_nonfinite
                       :class:`amp_fx.policy.Decision`
``CAST``               insert_casts, every cast it     insert_casts (not re-decided), explain,
                       inserts: ``CAST_INSERTED``      find_nonfinite
``CAST_REASON``        insert_casts, every cast it     explain
                       inserts: the decision's reason
``CACHED``             insert_casts, every cast it     ``backend/splits.py``'s
                       inserts: shared by all uses     ``leaves_cast_with_shared_cast`` (a weight
                       of a leaf (cast cache)          split by a graph break: reported by the
                                                       backend, named by the inspection tools);
                                                       lift_weight_casts (which casts to lift)
``FOLDED``             fold_casts, the node that       explain, the graph drawing
                       stands for folded casts: rule
                       names, in order
``PARAMETER``          the backend, every placeholder  fp8_matmuls (which matmuls have a weight,
                       of a graph: the name of the     and its name)
                       ``nn.Parameter`` it is, or None
``FP8``                fp8_matmuls, every matmul with  explain, the backend's fp8 report, the
                       a parameter operand:            GEMM-FLOP counts of the fp8 tests and bench
                       :class:`~amp_fx.passes.
                       fp8_matmuls.Fp8Decision` (on
                       the fp8 call where converted,
                       on the matmul where not)
``FP8_OF``             fp8_matmuls, the node that      compare (which captured op it stands for)
                       replaced a converted matmul
                       (the fp8 call, or the bias add
                       after it): the matmul's name
``RNN_CELLS``          capture, the nodes of an RNN    the backend's audit (the RNNs that run
                       op captured as its cells: the   without cuDNN here, reported)
                       RNN op's name
``WEIGHT_CACHE``       lift_weight_casts, each new     the weight-cache tests (which inputs the
                       input that takes a weight's     cache fills)
                       cached low-precision copy
``WEIGHT_USE``         lift_weight_casts, each new     the weight-cache tests
                       input that takes one fp32 use
                       of a weight (a node of its own)
``FORWARD_NODE``       watch_backward's                watch_backward (which forward node a
                       ``stamp_forward_nodes``, in     backward node differentiates)
                       ``meta["custom"]`` of every op
                       (AOTAutograd copies it to the
                       nodes it traces): the op's name
=====================  ==============================  ==========================================

Keys torch itself writes and amp_fx keeps true: ``val`` (a fake tensor; insert_casts recomputes
it wherever dtypes change), ``nn_module_stack`` (the backend rewrites its paths to names under the
compiled root), ``recompute``/``ac_graph_id`` (activation checkpointing, set by capture).
"""

from __future__ import annotations

__all__ = [
    "AUTOCAST_DTYPE",
    "LEAF",
    "DECISION",
    "CAST",
    "CAST_INSERTED",
    "CAST_REASON",
    "CACHED",
    "FOLDED",
    "PARAMETER",
    "FP8",
    "FP8_OF",
    "RNN_CELLS",
    "WEIGHT_CACHE",
    "WEIGHT_USE",
    "FORWARD_NODE",
]

AUTOCAST_DTYPE = "amp_fx_autocast_dtype"
LEAF = "amp_fx_leaf"
DECISION = "amp_fx_decision"
CAST = "amp_fx_cast"
CAST_INSERTED = "inserted"
"""The value of ``CAST`` on casts amp_fx inserted (casts the model wrote itself have no ``CAST``)."""
CAST_REASON = "amp_fx_cast_reason"
CACHED = "amp_fx_cached"
FOLDED = "amp_fx_folded"
PARAMETER = "amp_fx_parameter"
FP8 = "amp_fx_fp8"
FP8_OF = "amp_fx_fp8_of"
RNN_CELLS = "amp_fx_rnn_cells"
"""Set (to the RNN op's name) on the nodes of an RNN op captured as torch's decomposition into
cells, where eager would run cuDNN's RNN (``amp_fx.passes.capture._rnn_without_cudnn``)."""
WEIGHT_CACHE = "amp_fx_weight_cache"
"""True on an input of a lifted graph that takes a weight's cached low-precision copy
(``amp_fx.passes.lift_weight_casts``)."""
WEIGHT_USE = "amp_fx_weight_use"
"""True on an input of a lifted graph that takes one fp32 use of a weight, through a node of its
own (``amp_fx.passes.lift_weight_casts``)."""
FORWARD_NODE = "amp_fx_node"
"""The key in a node's ``meta["custom"]`` that names the rewritten forward node it comes from
(``amp_fx.passes.watch_backward``)."""
