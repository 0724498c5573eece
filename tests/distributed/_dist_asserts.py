"""Assertions shared by tests/distributed/test_distributed_*.py on what ``_dist_cases`` returned per
rank, and :func:`model_state`, which the ranks take for :func:`assert_same_state`."""

from __future__ import annotations

from typing import Any

import torch

from amp_fx._common.compat import fsdp_param_groups, local_tensor
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


def model_state(model: torch.nn.Module) -> dict[str, Any]:
    """What a tool lent the model must leave as it was, on this rank: each registered parameter (the
    object's id and type: FSDP2 registers its sharded DTensor or its unsharded tensor; its local
    values), its gradient (None, or the object's id and local values), each buffer (id, values),
    and each FSDP2 parameter group's sharding state (``SHARDED``, ``UNSHARDED``)."""
    out: dict[str, Any] = {}
    for name, p in model.named_parameters():
        out[f"param {name}"] = (id(p), type(p).__name__, local_tensor(p).detach().clone())
        g = p.grad
        out[f"grad {name}"] = None if g is None else (id(g), local_tensor(g).clone())
    for name, b in model.named_buffers():
        out[f"buffer {name}"] = (id(b), b.clone())
    for name, m in model.named_modules():
        for i, group in enumerate(fsdp_param_groups(m)):
            out[f"fsdp {name or 'root'} {i}"] = group._sharded_state.name
    return out


def assert_same_state(got: dict[str, Any], want: dict[str, Any], what: str) -> None:
    """:func:`model_state` of the same model twice: the same objects, tensors equal bit for bit."""
    assert got.keys() == want.keys(), what
    for key, value in want.items():
        other = got[key]
        if isinstance(value, tuple):
            assert isinstance(other, tuple) and other[:-1] == value[:-1], f"{what}: {key}"
            assert_bitwise(other[-1], value[-1], f"{what}: {key}")
        else:
            assert other == value, f"{what}: {key}: {other} != {value}"
