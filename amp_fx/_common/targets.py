"""What every entry point accepts as the thing to compile or inspect, and its error otherwise."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["check_target"]


def check_target(obj: Any, tool: str, *, module_only: bool = False) -> None:
    """Raise ``TypeError`` naming the problem unless ``obj`` is a module instance (or, unless
    ``module_only``, a callable): a class is the common slip (``amp_fx.compile(nn.Linear)``), and
    a string or other value is named by its type, not reported as a model that fails to run."""
    wanted = "an nn.Module" if module_only else "an nn.Module or a callable"
    if isinstance(obj, type):
        raise TypeError(
            f"{tool} expects a model (an nn.Module instance), got the class {obj.__qualname__} "
            f"itself: build the model first (model = {obj.__qualname__}(...)) and pass it"
        )
    if isinstance(obj, torch.nn.Module) or (not module_only and callable(obj)):
        return
    raise TypeError(f"{tool} expects {wanted}, got {type(obj).__name__} ({_short(obj)})")


def _short(obj: Any) -> str:
    text = repr(obj)
    return text if len(text) <= 60 else text[:57] + "..."
