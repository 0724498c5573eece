"""Helpers shared by the benchmarks: machine description, percentiles, the tests' zoo."""

from __future__ import annotations

import os
import platform
import sys
from pathlib import Path

import torch

__all__ = ["import_zoo", "machine_lines", "percentile"]


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile, ``q`` in [0, 1]."""
    ordered = sorted(values)
    position = q * (len(ordered) - 1)
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def machine_lines() -> list[str]:
    """Versions and machine, printed above every table."""
    import triton

    return [
        (f"torch {torch.__version__}, triton {triton.__version__}, "
         f"python {platform.python_version()}"),
        (f"{platform.platform()}, {platform.processor() or platform.machine()}, "
         f"{os.cpu_count()} CPUs, torch threads {torch.get_num_threads()}"),
    ]


def import_zoo():
    """The tests' model zoo, so benchmarks and tests build the same models."""
    root = Path(__file__).resolve().parent.parent
    if str(root / "tests") not in sys.path:
        sys.path.insert(0, str(root / "tests"))
    import zoo

    return zoo
