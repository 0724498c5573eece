"""The device types amp_fx has an autocast policy for: one record each, and the one rule that picks
the autocast device of a call or a graph.

Adding a device type (XPU, MPS) is one :class:`AutocastDevice` here, plus its op table in
``amp_fx/policy.py`` (``DEFAULT_TABLES``, checked against the dispatcher by ``tests/policy/test_policy.py``).

    >>> import torch
    >>> autocast_device_type([torch.ones(1)])
    'cpu'
    >>> DEVICES["cuda"].dispatch_key
    'AutocastCUDA'
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

import torch

__all__ = ["AutocastDevice", "DEVICES", "autocast_device_type", "check_supported"]


@dataclass(frozen=True)
class AutocastDevice:
    """One device type eager autocast (and so amp_fx) handles."""

    type: str
    """``torch.device(...).type``."""
    dispatch_key: str
    """The dispatch key of eager autocast's kernels for it (its op table, ``amp_fx.policy.DEFAULT_TABLES``,
    is checked against this key's registrations)."""


DEVICES: Mapping[str, AutocastDevice] = MappingProxyType(
    {
        "cpu": AutocastDevice("cpu", "AutocastCPU"),
        "cuda": AutocastDevice("cuda", "AutocastCUDA"),
    }
)
"""Every device type amp_fx has a policy for, keyed by device type."""


def check_supported(device_type: str, what: str, *, plural: bool = False) -> None:
    """Raise ValueError naming ``what`` (a tensor's name, "the model's tensors") on a device type
    with no autocast policy."""
    if device_type not in DEVICES:
        raise ValueError(
            f"amp_fx: {what} {'are' if plural else 'is'} on device {device_type}, "
            f"which amp_fx has no autocast policy for; supported device types are "
            f"{_supported()}"
        )


def _supported() -> str:
    return " and ".join(repr(d) for d in DEVICES)


def autocast_device_type(tensors: Iterable[object], default: str = "cpu") -> str:
    """The autocast device of a call or graph: an accelerator among the tensors' devices wins over
    the CPU (as a CUDA model with a CPU index tensor autocasts on CUDA); ``default`` if no tensor.
    Raises ValueError for a device type with no policy."""
    found = [t for t in tensors if isinstance(t, torch.Tensor)]
    if found and all(t.is_cpu for t in found):  # first, and without t.device (6x is_cpu's cost):
        return "cpu"  # a compiled model's every call on cpu inputs asks
    types = {t.device.type for t in found}
    unsupported = sorted(types - set(DEVICES))
    if unsupported:
        raise ValueError(
            f"amp_fx: the model's tensors are on {unsupported}, a device amp_fx has no "
            f"autocast policy for; supported device types are {_supported()}"
        )
    accelerators = sorted(types - {"cpu"})
    if accelerators:
        return accelerators[0]
    return "cpu" if types else default
