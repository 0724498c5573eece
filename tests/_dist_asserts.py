"""Assertions shared by tests/test_distributed_*.py on what ``_dist_cases`` returned per rank."""

from __future__ import annotations

from typing import Any

import torch


def assert_bitwise(got: dict[str, Any], want: dict[str, Any], what: str) -> None:
    """Losses, scales and the rank's parameters (its shards, under FSDP2) equal bit for bit."""
    for key in ("losses", "scales"):
        torch.testing.assert_close(got[key], want[key], rtol=0, atol=0, equal_nan=True,
                                   msg=lambda m, k=key: f"{what}: {k} differ: {m}")
    for i, (g, w) in enumerate(zip(got["params"], want["params"], strict=True)):
        torch.testing.assert_close(g, w, rtol=0, atol=0,
                                   msg=lambda m, i=i: f"{what}: parameter {i} differs: {m}")


def skipped_steps(result: dict[str, Any]) -> list[int]:
    """Steps after which the scale backed off (an overflow: the step was skipped)."""
    scales = torch.cat([torch.tensor([2.0**16]), result["scales"]])
    return [i for i in range(len(result["scales"])) if scales[i + 1] < scales[i]]
