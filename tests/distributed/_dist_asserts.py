"""Assertions shared by tests/distributed/test_distributed_*.py on what ``_dist_cases`` returned per rank."""

from __future__ import annotations

from typing import Any

import torch

from amp_fx.testing import assert_bitwise


def assert_same_run(
    got: dict[str, Any],
    want: dict[str, Any],
    what: str,
    keys: tuple[str, ...] = ("losses", "scales", "norms", "params"),
) -> None:
    """Losses, scales, clipping norms and the rank's parameters (its shards, under FSDP2)
    equal bit for bit (NaN payloads included); ``keys`` the reference has."""
    for key in keys:
        if key in want:
            assert_bitwise(got[key], want[key], f"{what}: {key}")


def skipped_steps(result: dict[str, Any]) -> list[int]:
    """Steps after which the scale backed off (an overflow: the step was skipped)."""
    scales = torch.cat([torch.tensor([2.0**16]), result["scales"]])
    return [i for i in range(len(result["scales"])) if scales[i + 1] < scales[i]]
