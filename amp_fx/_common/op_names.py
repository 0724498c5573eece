"""How amp_fx spells an op. Lookups (the op tables, ``Policy(op_classes=...)``) use torch's
dispatcher name, ``op.name()``: ``aten::mm``, ``aten::conv2d.padding``. Text for users (reasons,
tables, reports) uses :func:`op_label`: ``aten.mm``, ``aten.conv2d.padding``.

    >>> op_label(torch.ops.aten.conv2d.padding), op_label(torch.ops.aten.mm.default, packet=True)
    ('aten.conv2d.padding', 'aten.mm')
"""

from __future__ import annotations

import torch

__all__ = ["op_label", "label_of"]


def label_of(name: str) -> str:
    """The label of a dispatcher name: ``aten.mm`` for ``aten::mm``."""
    return name.replace("::", ".")


def op_label(target: object, *, packet: bool = False) -> str:
    """An op as users read it: ``aten.mm`` (a default overload), ``aten.conv2d.padding``. With
    ``packet``, an ATen op without its overload (``aten.mm`` for ``aten.mm.out`` too) and another
    namespace's op by its full name (``transformers.grouped_mm_fallback.default``). A Python
    function (an fp8 matmul the passes call) by its name."""
    if isinstance(target, torch._ops.OpOverload):
        if not packet:
            return label_of(target.name())
        return f"aten.{target.__name__.split('.')[0]}" if target.namespace == "aten" else str(target)
    return getattr(target, "__name__", str(target))
