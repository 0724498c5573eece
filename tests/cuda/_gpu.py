"""What the GPU tier's test files share: the ``cuda`` mark and the skip without CUDA.

Every test under tests/cuda/ carries ``GPU_TIER``: it is selected by ``pytest -m cuda`` and skips
with the reason where CUDA is not available, as on the project's CPU machines, where the files are
still imported (and linted) by the ordinary suite. The helpers, references and tolerances are the
CPU tests' own, imported from their modules (``tests.backend._parity``, ``tests.step._step_cases``,
``tests.kernels._unscale_*``) and ``amp_fx.testing``.
"""

from __future__ import annotations

import pytest
import torch

GPU_TIER = [
    pytest.mark.cuda,
    pytest.mark.skipif(
        not torch.cuda.is_available(),
        reason="no CUDA device: the GPU tier runs on a machine with one "
        "(`python -m pytest -m cuda tests`, docs/contributing.md, 'The GPU tier')",
    ),
]
