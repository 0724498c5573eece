"""What differs between the supported torch versions (2.11 to 2.15), each found by a feature test.

Every difference amp_fx depends on is tested here, once, by what the installed torch does rather
than by its version string; each function says which versions take which branch (as measured on
2.11.0, 2.13.0 and 2.15.0; 2.12 and 2.14 lie between and are not run by CI).
"""

from __future__ import annotations

from functools import cache

import torch

__all__ = ["autocast_registrations"]


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
