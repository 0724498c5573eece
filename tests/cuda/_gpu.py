"""What the GPU tier's test files share: the ``cuda`` mark, the skip without CUDA, the helpers' path.

Every test under tests/cuda/ carries ``GPU_TIER``: it is selected by ``pytest -m cuda`` and skips
with the reason where CUDA is not available, as on the project's CPU machines, where the files are
still imported (and linted) by the ordinary suite.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

TESTS = Path(__file__).resolve().parents[1]
# Besides amp_fx.testing, these tests reuse helpers that live beside the CPU tests:
# tests/test_*.py and tests/kernels/_unscale_*.py.
for _path in (TESTS, TESTS / "kernels"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

GPU_TIER = [
    pytest.mark.cuda,
    pytest.mark.skipif(
        not torch.cuda.is_available(),
        reason="no CUDA device: the GPU tier runs on a machine with one "
               "(`python -m pytest -m cuda tests`, README 'GPU tier')"),
]
