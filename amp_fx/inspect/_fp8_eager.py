"""fp8 in eager mode, for :func:`amp_fx.advise`: the matmuls the fp8 pass converts, converted as it does.

:class:`Fp8Eager` is a ``TorchFunctionMode`` for one eager forward under ``torch.autocast``. It
sees each ``F.linear`` (``nn.Linear``), ``torch.addmm`` (transformers' ``Conv1D``), ``torch.mm``
and ``matmul``/``@`` whose right operand is a 2-D parameter or a view of one, and applies
:mod:`amp_fx.passes.fp8_matmuls`'s rules to it (autocast on; not inside a module kept out of fp8;
any size: the fp8 matmul pads what ``_scaled_mm`` needs). A matmul that
passes runs as the pass rewrites it: :func:`~amp_fx.kernels.fp8_matmul.fp8_matmul` on the input
cast to the autocast dtype and the fp32 weight as ``[K, N]``, autocast off, then the bias cast to
the output's dtype and added. So the forward and backward are those of
``amp_fx.compile(model, backend="aot_eager", fp8=...)`` (``tests/inspect/test_advise_fp8.py`` checks it
bit for bit), with module hooks still firing.

Each converted call is recorded (:class:`Fp8Call`): its module, shape, FLOPs and the error fp8
adds to the forward GEMM: ``||fp8 - hp|| / ||hp||`` with ``hp`` the same product of the same
(autocast-dtype) input and fp32 weight in fp32.

Grouped expert GEMMs (``torch._grouped_mm``, which ``F.grouped_mm`` calls, and transformers'
``grouped_mm_fallback``: :data:`~amp_fx.policy.GROUPED_MM_OPS`) run in fp8 only inside the modules
named in ``grouped`` (for :func:`amp_fx.compare`: the modules whose grouped GEMMs the pass
converted, read from its decisions), as the pass rewrites them (:func:`grouped_gemm`); they are
not recorded in ``calls``.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from amp_fx.fp8 import Fp8Config, Fp8Recipe, Nvfp4Options
from amp_fx.inspect._probe import module_hooks
from amp_fx.kernels.fp8_grouped_mm import fp8_grouped_mm, grouped_mm_operands
from amp_fx.kernels.fp8_matmul import fp8_matmul
from amp_fx.kernels.mxfp8_matmul import mxfp8_grouped_mm
from amp_fx.kernels.nvfp4 import nvfp4_grouped_mm, nvfp4_matmul
from amp_fx.low_precision import recipe_for
from amp_fx.policy import GROUPED_MM_OPS, ModuleSelector, module_matches

__all__: list[str] = []

F = torch.nn.functional
_OPS = {
    F.linear: "aten.linear",
    torch.addmm: "aten.addmm",
    torch.Tensor.addmm: "aten.addmm",
    torch.mm: "aten.mm",
    torch.Tensor.mm: "aten.mm",
    torch.matmul: "aten.matmul",
    torch.Tensor.matmul: "aten.matmul",
    torch.Tensor.__matmul__: "aten.matmul",
}
"""The torch functions the eager mode looks at, by the ATen op the fp8 pass sees for each."""


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


def _gemm(
    x: torch.Tensor, w: torch.Tensor, recipe: Any, dtype: torch.dtype, device_type: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """The fp8 GEMM as the pass rewrites a matmul: ``x`` in the autocast dtype, ``w`` as
    ``[K, N]`` as it is, autocast off. Returns (result, the input in the autocast dtype)."""
    with torch.autocast(device_type, enabled=False):
        x_low = x.to(dtype)
        if isinstance(recipe, Nvfp4Options):
            return nvfp4_matmul(x_low, w, options=recipe), x_low
        return fp8_matmul(x_low, w, recipe), x_low


def _kernel_recipe(config: Fp8Config) -> Fp8Recipe | Nvfp4Options:
    """What the kernels take: the recipe, or NVFP4's switches (which say it is NVFP4)."""
    if config.recipe is Fp8Recipe.NVFP4:
        return config.nvfp4_switches
    assert config.recipe is not None, "one matmul's config names its recipe"
    return config.recipe


def _add_bias(out: torch.Tensor, bias: torch.Tensor | None, device_type: str) -> torch.Tensor:
    """torchao's Float8Linear: the bias in the output's dtype, added after the GEMM."""
    if bias is None:
        return out
    with torch.autocast(device_type, enabled=False):
        return out + bias.to(out.dtype)


def _operands(op: str, args: Sequence[Any], kwargs: dict[str, Any]) -> tuple[Any, Any, Any]:
    """(input, weight operand as passed, bias) of a matmul ``op`` (``aten.linear``: ``(input, weight,
    bias=None)``, positional or by keyword; ``aten.addmm``: ``(bias, x, w)``; ``mm``/``matmul``:
    ``(x, w)``), called as a torch function or as its ATen op."""
    if op == "aten.linear":
        named = dict(zip(("input", "weight", "bias"), args), **kwargs)
        return named.get("input"), named.get("weight"), named.get("bias")
    if op == "aten.addmm":
        return args[1], args[2], args[0]
    return args[0], args[1], None


def _as_kn(op: str, w: torch.Tensor) -> torch.Tensor:
    """The weight operand as ``[K, N]``: a linear's ``[N, K]`` weight transposed."""
    return w.t() if op == "aten.linear" else w


def _grouped_name(func: Any) -> str | None:
    """The :data:`~amp_fx.policy.GROUPED_MM_OPS` name of a grouped expert GEMM called as a torch
    function (``torch._grouped_mm``, ``torch.ops.transformers.grouped_mm_fallback``) or captured as
    an ATen op overload; None for anything else."""
    if func is torch._grouped_mm:
        return "aten::_grouped_mm"
    name = getattr(func, "_qualified_op_name", None)  # an OpOverloadPacket
    if name is None and isinstance(func, torch._ops.OpOverload):
        name = func.name()
    return name if name in GROUPED_MM_OPS else None


def grouped_gemm(
    x: torch.Tensor,
    w: torch.Tensor,
    offs: torch.Tensor,
    recipe: Fp8Recipe | Nvfp4Options,
    dtype: torch.dtype,
    device_type: str,
) -> torch.Tensor:
    """A grouped expert GEMM as the pass rewrites it: ``x`` in the autocast dtype, autocast off,
    then :func:`~amp_fx.kernels.mxfp8_matmul.mxfp8_grouped_mm` (which scales the bf16 casts of
    both operands) or :func:`~amp_fx.kernels.fp8_grouped_mm.fp8_grouped_mm` on the fp32 weight."""
    with torch.autocast(device_type, enabled=False):
        x_low = x.to(dtype)
        if isinstance(recipe, Nvfp4Options):
            return nvfp4_grouped_mm(x_low, w, offs, recipe.rht, recipe.stochastic_rounding, recipe.weight_2d)
        if recipe is Fp8Recipe.MXFP8:
            return mxfp8_grouped_mm(x_low, w, offs)
        return fp8_grouped_mm(x_low, w, offs, recipe)


def fp8_aten(
    target: Any, args: Sequence[Any], kwargs: dict[str, Any], config: Fp8Config, dtype: torch.dtype, device_type: str
) -> torch.Tensor:
    """A captured ATen matmul (``aten.linear``, ``aten.addmm``, ``aten.mm``, ``aten.matmul``) or
    grouped expert GEMM (``aten._grouped_mm``, ``transformers.grouped_mm_fallback``) that the pass
    converted, computed as the pass rewrote it, on its original (uncast) operands."""
    if _grouped_name(target) is not None:
        operands = grouped_mm_operands(args, kwargs)
        assert operands is not None, f"the pass converted {target} with operands it does not take"
        return grouped_gemm(*operands, _kernel_recipe(config), dtype, device_type)
    op = f"aten.{target._overloadpacket.__name__}"
    x, w, bias = _operands(op, args, kwargs)
    out, _ = _gemm(x, _as_kn(op, w), _kernel_recipe(config), dtype, device_type)
    return _add_bias(out, bias, device_type)


def module_stack(model: torch.nn.Module, stack: list[str]) -> AbstractContextManager[None]:
    """Module hooks that keep ``stack`` as the running module path, innermost last."""

    def post(name: str, out: Any) -> None:
        if name in stack:
            del stack[len(stack) - 1 - stack[::-1].index(name)]

    return module_hooks(model, lambda name, args, kwargs: stack.append(name), post)


class Fp8Eager(TorchFunctionMode):
    """Run the matmuls the fp8 pass converts in fp8 (module doc). ``stack`` is the running module
    path, innermost last (the caller's module hooks keep it); ``keep`` the modules kept out of fp8
    (names, or types with ``root``, the model the paths are under, as ``Policy.keep_out_of_fp8``
    selects them). ``calls`` lists the matmuls that ran in fp8. ``grouped``: the module paths whose
    grouped expert GEMMs run in fp8 (module doc)."""

    def __init__(
        self,
        config: Fp8Config,
        dtype: torch.dtype,
        device_type: str,
        stack: list[str],
        keep: Sequence[ModuleSelector] = (),
        *,
        measure: bool = True,
        root: torch.nn.Module | None = None,
        grouped: frozenset[str] = frozenset(),
    ) -> None:
        super().__init__()
        self.config = config
        self.dtype = dtype
        self.device_type = device_type
        self.stack = stack
        self.keep = tuple(keep)
        self.root = root
        self.measure = measure
        self.grouped = grouped
        self.calls: list[Fp8Call] = []
        self.in_gemm = False
        """Inside a recipe's GEMM kernel now (a FLOP counter attributes its matmuls to it: the
        emulated recipes run ``torch.mm``, not ``_scaled_mm``)."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        op = _OPS.get(func)
        if op is not None:
            match = self._match(op, args, kwargs)
            recipe = self._recipe() if match is not None else None
            if match is not None and recipe is not None:
                return self._run(op, *match, recipe)
        elif self.grouped and _grouped_name(func) is not None:
            operands = self._match_grouped(args, kwargs)
            recipe = self._recipe() if operands is not None else None
            if operands is not None and recipe is not None:
                with self._gemm():
                    return grouped_gemm(*operands, recipe, self.dtype, self.device_type)
        return func(*args, **kwargs)

    @contextlib.contextmanager
    def _gemm(self) -> Iterator[None]:
        self.in_gemm = True
        try:
            yield
        finally:
            self.in_gemm = False

    def _match_grouped(self, args: Any, kwargs: dict[str, Any]) -> tuple[Any, Any, Any] | None:
        """(x, w, offs) of a grouped expert GEMM in a module of ``grouped``, autocast on, else None."""
        if not torch.is_autocast_enabled(self.device_type) or torch.get_autocast_dtype(self.device_type) != self.dtype:
            return None
        if (self.stack[-1] if self.stack else "") not in self.grouped:
            return None
        return grouped_mm_operands(args, kwargs)

    def _match(
        self, op: str, args: Any, kwargs: dict[str, Any]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None:
        """(x, w as [K, N], bias) for a matmul the pass converts, else None."""
        if not torch.is_autocast_enabled(self.device_type) or torch.get_autocast_dtype(self.device_type) != self.dtype:
            return None
        if self._kept():
            return None
        if op == "aten.addmm":
            scaled = kwargs.get("beta", 1) != 1 or kwargs.get("alpha", 1) != 1
            if scaled or len(args) != 3 or kwargs.keys() - {"beta", "alpha"}:
                return None
        elif op != "aten.linear" and (len(args) != 2 or kwargs):
            return None
        x, w, bias = _operands(op, args, kwargs)
        if not _is_weight(w):
            return None
        if op == "aten.addmm" and (not isinstance(bias, torch.Tensor) or bias.dim() > 1):
            return None
        w = _as_kn(op, w)
        if not isinstance(x, torch.Tensor) or x.dim() < 2 or not x.is_floating_point() or x.dtype == torch.float64:
            return None
        return x, w, bias

    def _kept(self) -> bool:
        """The running module is kept out of fp8: it or a module around it is selected by ``keep``."""
        if not self.keep:
            return False
        if "" in self.keep:
            return True
        innermost = self.stack[-1] if self.stack else ""
        if self.root is None:
            return any(isinstance(k, str) and module_matches(k, innermost, object) for k in self.keep)
        return any(
            module_matches(k, path, type(self.root.get_submodule(path))) for path in self.stack for k in self.keep
        )

    def _recipe(self) -> Fp8Recipe | Nvfp4Options | None:
        """The recipe of a matmul in the running module (:func:`amp_fx.low_precision.recipe_for`,
        as the pass chooses it), None for ``dtype``."""
        root = self.root
        stack = [(p, type(root.get_submodule(p)) if root is not None else object) for p in self.stack]
        recipe = recipe_for(self.config, stack)[0]
        if recipe is Fp8Recipe.NVFP4:  # the NVFP4 kernels take the recipe's switches (TE's defaults in a map)
            return self.config.nvfp4_switches
        return recipe

    def _run(
        self, op: str, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, recipe: Fp8Recipe | Nvfp4Options
    ) -> torch.Tensor:
        with self._gemm():
            out, x_low = _gemm(x, w, recipe, self.dtype, self.device_type)
        num = den = 0.0
        if self.measure:
            with torch.no_grad():
                hp = torch.matmul(x_low.detach().float(), w.detach().float())
                num = float((out.detach().float() - hp).norm())
                den = float(hp.norm())
        out = _add_bias(out, bias, self.device_type)
        error = num / den if den > 0 else (0.0 if num == 0 else math.inf)
        shape = (math.prod(x.shape[:-1]), x.shape[-1], w.shape[1])
        self.calls.append(Fp8Call(self.stack[-1] if self.stack else "", op, shape, error))
        return out
