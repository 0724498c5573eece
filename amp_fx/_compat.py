"""What differs between the supported torch versions (2.11 to 2.15), each found by a feature test.

Every difference amp_fx depends on is tested here, once, by what the installed torch does rather
than by its version string; each function says which versions take which branch (as measured on
2.11.0, 2.13.0 and 2.15.0; 2.12 and 2.14 lie between and are not run by CI).
"""

from __future__ import annotations

from collections.abc import Callable, MutableMapping
from functools import cache
from typing import Any

import torch

__all__ = ["autocast_registrations", "current_decomposition_table"]


@cache
def autocast_registrations(dispatch_key: str) -> frozenset[str]:
    """The ops the installed torch registers a kernel for at ``dispatch_key`` ("AutocastCPU").

    Names as the dispatcher spells them (``"aten::conv2d"``, ``"aten::conv2d.padding"``). This is
    how the default op tables follow the installed torch: torch 2.11 still registers the Dimname
    overloads (``aten::softmax.Dimname`` ...) and not ``aten::rms_norm`` on CUDA, 2.15 adds
    ``aten::linalg_matrix_sqrth`` and drops ``aten::cholesky`` and ``aten::qr`` on CPU, and only
    builds with cuDNN (every standard Linux wheel, not the CPU wheel) register
    ``aten::_cudnn_rnn`` on CUDA.
    """
    return frozenset(torch._C._dispatch_get_registrations_for_dispatch_key(dispatch_key))


def current_decomposition_table() -> MutableMapping[Any, Callable[..., Any]]:
    """The decomposition table of the ``make_fx`` trace running now (the dict itself, mutable).

    2.13 and 2.15 keep it on the active proxy mode (``ProxyTorchDispatchMode.decomposition_table``);
    2.11 keeps it in the module global ``proxy_tensor.CURRENT_DECOMPOSITION_TABLE``, which
    ``make_fx`` points at the table it was given.
    """
    from torch.fx.experimental import proxy_tensor

    table = getattr(proxy_tensor.get_proxy_mode(), "decomposition_table", None)
    if table is None:
        table = proxy_tensor.CURRENT_DECOMPOSITION_TABLE
    return table
