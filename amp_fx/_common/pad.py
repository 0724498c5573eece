"""Zero padding of a block-scaled operand to whole blocks: one rule for the block recipes' kernels
(:mod:`amp_fx.kernels.mxfp8_matmul`, :mod:`amp_fx.kernels.blockwise_fp8`, :mod:`amp_fx.kernels.nvfp4`).

    >>> import torch
    >>> pad_to_multiples(torch.ones(3, 5), rows=4, cols=8).shape
    torch.Size([4, 8])
    >>> x = torch.ones(4, 8)
    >>> pad_to_multiples(x, rows=4, cols=8) is x
    True
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["pad_to_multiples"]


def pad_to_multiples(x: torch.Tensor, *, rows: int = 1, cols: int = 1) -> torch.Tensor:
    """``x`` zero-padded at the end of its last two dimensions to multiples of ``rows`` and
    ``cols``; ``x`` itself where they already are (no op added: sizes known while tracing, a
    symbolic size guarded on its remainder). A zero never raises a block's amax, so the real
    blocks keep their scales."""
    pad_rows, pad_cols = -x.shape[-2] % rows, -x.shape[-1] % cols
    return F.pad(x, (0, pad_cols, 0, pad_rows)) if pad_rows or pad_cols else x
