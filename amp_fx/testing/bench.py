"""What every benchmark computes and prints: percentiles of its timings, the machine and versions."""

from __future__ import annotations

import gc
import os
import platform

import torch

__all__ = ["machine_lines", "percentile", "release", "sync", "token_batches"]


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile, ``q`` in [0, 1]: numpy's default method, so ``q=0.5`` is the
    median (``statistics.median``) that the tables put beside it. Nearest rank, rounded, is not:
    ``round`` goes to the even rank on ties, so p50 of 4 values would be the 3rd and p90 of 6 the
    5th, not a point between two samples."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"percentile: q={q} is not in [0, 1]")
    ordered = sorted(values)
    position = q * (len(ordered) - 1)
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def machine_lines() -> list[str]:
    """Versions, machine and load, printed above every table."""
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:  # platforms without a triton wheel (pyproject.toml's marker)
        triton_version = "not installed"
    return [
        (f"torch {torch.__version__}, triton {triton_version}, python {platform.python_version()}"),
        (
            f"{platform.platform()}, {platform.processor() or platform.machine()}, "
            f"{os.cpu_count()} CPUs, torch threads {torch.get_num_threads()}, "
            f"load average {os.getloadavg()[0]:.1f} (other processes skew every variant alike)"
        ),
    ]


def sync(device: str) -> None:
    """Wait for the device's queued work (CUDA), so that a host timer brackets it; nothing elsewhere."""
    if device == "cuda":
        torch.cuda.synchronize()


def release(device: str) -> None:
    """What the previous variant left (its compiled graphs, cycles holding its model) freed, so
    that the next variant's peak memory is its own."""
    torch._dynamo.reset()
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def token_batches(n: int, vocab: int, batch: int, seq: int, device: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``n`` language-model batches (token ids, next-token targets) of ``batch`` x ``seq`` tokens,
    the same for every variant of a run (a fixed seed)."""
    gen = torch.Generator().manual_seed(0)
    ids = [torch.randint(0, vocab, (batch, seq + 1), generator=gen) for _ in range(n)]
    return [(t[:, :-1].to(device), t[:, 1:].to(device)) for t in ids]
