"""The output of amp_fx's own matmuls, shaped as ``aten.matmul`` shapes its output.

``aten.matmul`` (and ``aten.linear`` without a bias) folds the leading dimensions of its input
into one, runs a 2-D GEMM and unfolds the result with ``aten._unsafe_view``: the output is a
tensor of its own, not a view, to autograd and to AOTAutograd. The fp8 matmuls end in the same
op. Ended in ``reshape`` instead, their output was a view of the GEMM's result: AOTAutograd then
hands a compiled graph's output back as a view (its base returned beside it), and a view is what
the user sees. FSDP2 warns about every view a ``fully_shard``-ed module returns, and rightly: an
in-place op on one (``logits.div_(t)``) drops that module's pre-backward hook.
"""

from __future__ import annotations

import torch

__all__ = ["matmul_output"]


def matmul_output(out: torch.Tensor, shape: tuple[int, ...] | list[int] | torch.Size) -> torch.Tensor:
    """``out`` (a GEMM's result, or a slice of its columns) as ``shape``, not a view of it."""
    return torch.ops.aten._unsafe_view(out, list(shape))
