"""fp8 in eager mode, for :func:`amp_fx.advise`: the matmuls the fp8 pass converts, converted as it does.

:class:`Fp8Eager` is a ``TorchFunctionMode`` for one eager forward under ``torch.autocast``. It
sees each ``F.linear`` (``nn.Linear``), ``torch.addmm`` (transformers' ``Conv1D``), ``torch.mm``
and ``matmul``/``@`` whose right operand is a 2-D parameter or a view of one, and applies
:mod:`amp_fx.passes.fp8_matmuls`'s rules to it (autocast on; not inside a module kept out of fp8;
``K``, ``N`` and, when the weight-gradient GEMM is fp8, ``M`` multiples of 16). A matmul that
passes runs as the pass rewrites it: :func:`~amp_fx.kernels.fp8_matmul.fp8_matmul` on the input
cast to the autocast dtype and the fp32 weight as ``[K, N]``, autocast off, then the bias cast to
the output's dtype and added. So the forward and backward are those of
``amp_fx.compile(model, backend="aot_eager", fp8=...)`` (``tests/test_advise_fp8.py`` checks it
bit for bit), with module hooks still firing.

Each converted call is recorded (:class:`Fp8Call`): its module, shape, FLOPs and the error fp8
adds to the forward GEMM: ``||fp8 - hp|| / ||hp||`` with ``hp`` the same product of the same
(autocast-dtype) input and fp32 weight in fp32.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from amp_fx.fp8 import Fp8Config
from amp_fx.kernels.fp8_matmul import RECIPES, fp8_matmul
from amp_fx.passes.fp8_matmuls import ALIGNMENT

__all__: list[str] = []

F = torch.nn.functional
_LINEAR = (F.linear,)
_ADDMM = (torch.addmm, torch.Tensor.addmm)
_MM = (torch.mm, torch.Tensor.mm, torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__)
_OPS = {**{f: "aten.linear" for f in _LINEAR}, **{f: "aten.addmm" for f in _ADDMM},
        torch.mm: "aten.mm", torch.Tensor.mm: "aten.mm", torch.matmul: "aten.matmul",
        torch.Tensor.matmul: "aten.matmul", torch.Tensor.__matmul__: "aten.matmul"}


@dataclass(frozen=True)
class Fp8Call:
    """One matmul the eager run converted to fp8."""

    module: str
    """The innermost module running ("" for the root's own code)."""
    op: str
    shape: tuple[int, int, int]
    """(M, K, N) of the forward GEMM."""
    error: float
    """Normwise relative error fp8 adds to the forward GEMM (see the module doc)."""

    @property
    def flops(self) -> int:
        m, k, n = self.shape
        return 2 * m * k * n


def _is_weight(t: Any) -> bool:
    """A 2-D parameter or a view of one (``w.t()``, ``w.T``), as the pass's weight operand."""
    if not isinstance(t, torch.Tensor) or t.dim() != 2 or not t.is_floating_point():
        return False
    return isinstance(t, torch.nn.Parameter) or isinstance(t._base, torch.nn.Parameter)


class Fp8Eager(TorchFunctionMode):
    """Run the matmuls the fp8 pass converts in fp8 (module doc). ``stack`` is the running module
    path, innermost last (the caller's module hooks keep it); ``keep`` the module names kept out
    of fp8. ``calls`` lists what ran in fp8."""

    def __init__(self, config: Fp8Config, dtype: torch.dtype, device_type: str, stack: list[str],
                 keep: Sequence[str] = (), *, measure: bool = True) -> None:
        super().__init__()
        self.recipe = config.recipe
        self.dtype = dtype
        self.device_type = device_type
        self.stack = stack
        self.keep = tuple(keep)
        self.measure = measure
        self.calls: list[Fp8Call] = []
        self._fp8_grad_weight = RECIPES[self.recipe].input_for_grad_weight.dtype is not None

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        op = _OPS.get(func)
        if op is not None:
            match = self._match(func, args, kwargs)
            if match is not None:
                return self._run(op, *match)
        return func(*args, **kwargs)

    def _match(self, func: Any, args: Any, kwargs: dict[str, Any]
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None:
        """(x, w as [K, N], bias) for a matmul the pass converts, else None."""
        if not torch.is_autocast_enabled(self.device_type) or torch.get_autocast_dtype(self.device_type) != self.dtype:
            return None
        innermost = self.stack[-1] if self.stack else ""
        if any(k == "" or innermost == k or innermost.startswith(k + ".") for k in self.keep):
            return None
        if func in _LINEAR:
            x, w = args[0], args[1]
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            if not _is_weight(w):
                return None
            w = w.t()
        elif func in _ADDMM:
            scaled = kwargs.get("beta", 1) != 1 or kwargs.get("alpha", 1) != 1
            if scaled or len(args) != 3 or kwargs.keys() - {"beta", "alpha"}:
                return None
            bias, x, w = args
            if not _is_weight(w) or not isinstance(bias, torch.Tensor) or bias.dim() > 1:
                return None
        else:
            if len(args) != 2 or kwargs:
                return None
            x, w = args
            bias = None
            if not _is_weight(w):
                return None
        if not isinstance(x, torch.Tensor) or x.dim() < 2 or not x.is_floating_point() or x.dtype == torch.float64:
            return None
        m, k, n = math.prod(x.shape[:-1]), x.shape[-1], w.shape[1]
        if k % ALIGNMENT or n % ALIGNMENT or (self._fp8_grad_weight and m % ALIGNMENT):
            return None
        return x, w, bias

    def _run(self, op: str, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        with torch.autocast(self.device_type, enabled=False):
            x_low = x.to(self.dtype)
            out = fp8_matmul(x_low, w, self.recipe)
            num = den = 0.0
            if self.measure:
                with torch.no_grad():
                    hp = torch.matmul(x_low.detach().float(), w.detach().float())
                    num = float((out.detach().float() - hp).norm())
                    den = float(hp.norm())
            if bias is not None:
                out = out + bias.to(out.dtype)
        error = num / den if den > 0 else (0.0 if num == 0 else math.inf)
        shape = (math.prod(x.shape[:-1]), x.shape[-1], w.shape[1])
        self.calls.append(Fp8Call(self.stack[-1] if self.stack else "", op, shape, error))
        return out
