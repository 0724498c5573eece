"""torchao's float8 training as the reference for amp_fx's fp8 tests and bench, and a GEMM-FLOP
counter that tells fp8 GEMMs from the others by the ops that ran.

torchao is a test reference only (the ``test`` extra pins it; amp_fx never imports it).

One CPU artifact, handled here: torchao's ``Float8Linear.forward`` copies autocast's rule for
``F.linear`` by casting its input to the autocast dtype, but reads CUDA's autocast state
(``torch.is_autocast_enabled()``, ``torch.get_autocast_gpu_dtype()``). Under CPU autocast it
therefore scales the fp32 input, where on a GPU it scales the bf16 one. amp_fx follows the GPU
numerics (the input in ``dtype``, as autocast's rule for linear implies), so the reference is
torchao with that one branch pointed at the CPU's autocast state: :func:`cpu_autocast_torchao`
swaps the ``torch`` name of ``torchao.float8.float8_linear`` for a module that answers those two
calls for the CPU and forwards everything else to torch. Nothing else of torchao changes.

    >>> ref = torchao_float8(torch.nn.Linear(16, 16), "tensorwise")   # doctest: +SKIP
    >>> with cpu_autocast_torchao(), torch.autocast("cpu", torch.bfloat16):   # doctest: +SKIP
    ...     out = ref(torch.randn(16, 16))
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

__all__ = ["cpu_autocast_torchao", "torchao_float8", "torchao_missing", "linear_twin", "GemmFlops",
           "count_gemm_flops"]


def torchao_missing() -> str | None:
    """None if torchao's float8 training imports here, else why not."""
    try:
        import torchao.float8  # noqa: F401
    except Exception as e:  # noqa: BLE001
        return f"torchao does not import: {type(e).__name__}: {str(e)[:160]} (pip install torchao==0.18.0)"
    return None


class _CpuAutocastTorch(types.ModuleType):
    """``torch`` for torchao's float8_linear, its CUDA autocast queries answered for the CPU."""

    def __init__(self) -> None:
        super().__init__("torch")

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)

    @staticmethod
    def is_autocast_enabled(device_type: str | None = None) -> bool:
        return torch.is_autocast_enabled("cpu" if device_type is None else device_type)

    @staticmethod
    def get_autocast_gpu_dtype() -> torch.dtype:
        return torch.get_autocast_dtype("cpu")


_CPU_AUTOCAST_TORCH = _CpuAutocastTorch()
"""One object for every use: Dynamo guards on the identity of the global torchao's forward reads,
so a new one per call would recompile torchao + torch.compile at every call."""


@contextlib.contextmanager
def cpu_autocast_torchao() -> Iterator[None]:
    """Inside: torchao's ``Float8Linear`` casts its input under CPU autocast, as it does under
    CUDA autocast (see the module docstring)."""
    import torchao.float8.float8_linear as float8_linear

    original = float8_linear.torch
    float8_linear.torch = _CPU_AUTOCAST_TORCH
    try:
        yield
    finally:
        float8_linear.torch = original


def torchao_float8(model: torch.nn.Module, recipe: str,
                   module_filter_fn: Callable[[torch.nn.Module, str], bool] | None = None, *,
                   pad_inner_dim: bool = False, fsdp_float8_all_gather: bool = False) -> torch.nn.Module:
    """A copy of ``model`` with its ``nn.Linear`` swapped by torchao's ``convert_to_float8_training``
    (``pad_inner_dim``: torchao's option that zero-pads each GEMM's inner dimension to a multiple
    of 16, the reference for amp_fx's padding; ``fsdp_float8_all_gather``: its
    ``enable_fsdp_float8_all_gather``, FSDP2 gathering the weights in fp8, the reference for
    amp_fx's: then call ``torchao.float8.precompute_float8_dynamic_scale_for_fsdp(model)`` after
    each optimizer step, as torchao's recipe says)."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), pad_inner_dim=pad_inner_dim,
                                 enable_fsdp_float8_all_gather=fsdp_float8_all_gather)
    return convert_to_float8_training(copy.deepcopy(model), module_filter_fn=module_filter_fn, config=config)


def linear_twin(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``model`` with every transformers ``Conv1D`` (``addmm(bias, x, W)``, W as
    ``[in, out]``: GPT-2's attention and MLP) replaced by the ``nn.Linear`` that computes the same
    (its weight ``W.T``), under the same name: the model torchao can convert, to compare amp_fx's
    fp8 on the original against. Gradients of a twin's weight are the transposes of the original's."""
    twin = copy.deepcopy(model)
    for name, module in list(twin.named_modules()):
        if type(module).__name__ != "Conv1D" or not hasattr(module, "nf"):
            continue
        linear = torch.nn.Linear(module.weight.shape[0], module.weight.shape[1], bias=module.bias is not None)
        with torch.no_grad():
            linear.weight.copy_(module.weight.t())
            if module.bias is not None:
                linear.bias.copy_(module.bias)
        parent, _, child = name.rpartition(".")
        setattr(twin.get_submodule(parent), child, linear)
    return twin


_GEMMS = frozenset({"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_scaled_mm"})
_SCALED_MM = "aten::_scaled_mm"
_PAD = "aten::constant_pad_nd"


@dataclass
class GemmFlops:
    """GEMM FLOPs (2 M K N per GEMM) of the ops that ran, fp8 and not, and the GEMMs by kind.

    A ``_scaled_mm`` on zero-padded operands counts at its unpadded sizes in ``fp8``; what the
    padding adds is in ``padding``."""

    fp8: int = 0
    other: int = 0
    calls: dict[str, int] = field(default_factory=dict)
    padding: int = 0
    """FLOPs of the zeros padded in (not in ``fp8``)."""
    padded: int = 0
    """``_scaled_mm`` calls on padded operands."""
    pads: int = 0
    """2-D zero pads that ran (``F.pad``; the padding of GEMM operands)."""
    unaligned: int = 0
    """``_scaled_mm`` calls with sizes a GPU refuses (``mat1``'s columns or a dimension of ``mat2``
    not a multiple of 16): the CPU kernel runs them, CUDA's raises."""

    @property
    def total(self) -> int:
        return self.fp8 + self.other

    @property
    def fp8_share(self) -> float:
        return self.fp8 / self.total if self.total else 0.0


def _padded_from(event: Any) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """(padded shape, shape) of a 2-D ``constant_pad_nd`` that pads at the end with zeros
    (``F.pad(t, (0, right, 0, bottom))``, torchao's ``pad_tensor_for_matmul`` and amp_fx's)."""
    shapes, args = event.input_shapes, getattr(event, "concrete_inputs", None)
    if not shapes or len(shapes[0]) != 2 or not args or len(args) < 2 or not isinstance(args[1], list):
        return None
    pad = list(args[1]) + [0] * (4 - len(args[1]))
    if pad[0] or pad[2] or (len(args) > 2 and args[2] not in (0, 0.0, None)):
        return None
    rows, cols = shapes[0]
    return (rows + pad[3], cols + pad[1]), (rows, cols)


def _gemm_flops(name: str, shapes: list[list[int]]) -> int:
    a, b = (shapes[1], shapes[2]) if name in ("aten::addmm", "aten::baddbmm") else (shapes[0], shapes[1])
    batch = a[0] if len(a) == 3 else 1
    return 2 * batch * a[-2] * a[-1] * b[-1]


def _ancestors(event: Any) -> Iterator[Any]:
    parent = event.cpu_parent
    while parent is not None:
        yield parent
        parent = parent.cpu_parent


def _compiling(name: str) -> bool:
    """A profiler range of torch.compile's own work (Dynamo's timers, AOTAutograd's tracing)."""
    return name.endswith("(dynamo_timed)") or name in ("bytecode_tracing", "backend_compile")


def _descendants(event: Any) -> Iterator[Any]:
    for child in event.cpu_children:
        yield child
        yield from _descendants(child)


@contextlib.contextmanager
def count_gemm_flops() -> Iterator[GemmFlops]:
    """Count the GEMM FLOPs of the mm/addmm/bmm/baddbmm/_scaled_mm calls that run inside (forward
    and backward, eager or compiled), seen by the profiler at the dispatcher, as
    :class:`~amp_fx.testing.step_reference.HostSyncCounter` sees host reads (a
    ``TorchDispatchMode`` would stop Dynamo from running compiled code).

    GEMMs run on fake tensors while torch.compile traces (a recompile inside the window) do not
    count. Only the outermost GEMM of a nest counts: ``_scaled_mm``'s CPU kernel calls ``aten::mm``, and
    torchao's tensor subclass receives ``aten::mm`` and runs ``_scaled_mm`` inside it. A GEMM is
    fp8 when it is, or contains, a ``_scaled_mm``. Fused attention (CPU sdpa runs as one op) is
    not counted: none of its operands is a parameter, so no recipe puts it in fp8.

    Padding: a ``_scaled_mm`` whose ``mat2`` is the result of a zero pad (``aten::constant_pad_nd``
    since the previous ``_scaled_mm``; amp_fx's and torchao's ``pad_inner_dim`` padding) counts at
    its unpadded sizes, the rest in ``padding``. Where the pad is not an op of its own (fused by
    inductor) or torch records no pad amounts (``concrete_inputs``), it counts padded.
    """
    flops = GemmFlops()
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        yield flops
    events = [e for e in sorted(prof.events(), key=lambda e: e.time_range.start)
              if (e.name in _GEMMS or e.name == _PAD) and not any(_compiling(a.name) for a in _ancestors(e))]
    # run on fake tensors while Dynamo or AOTAutograd traced (a recompile): left out above
    unpadded: dict[int, int] = {}  # id of a _scaled_mm on padded operands -> its unpadded FLOPs
    pads: dict[tuple[int, ...], tuple[int, ...]] = {}  # since the last _scaled_mm: padded shape -> shape
    for event in events:
        if event.name == _PAD:
            padded = _padded_from(event)
            if padded is not None and padded[0] != padded[1]:
                pads[padded[0]] = padded[1]
                flops.pads += 1
        elif event.name == _SCALED_MM:
            (rows, inner), mat2 = event.input_shapes[0], event.input_shapes[1]
            flops.unaligned += bool(inner % 16 or mat2[0] % 16 or mat2[1] % 16)
            shape = pads.get(tuple(mat2))  # whatever is padded, mat2 is (its rows or its columns)
            if shape is not None:
                unpadded[id(event)] = 2 * rows * shape[0] * shape[1]
            pads.clear()
    for event in events:
        if event.name == _PAD or any(a.name in _GEMMS for a in _ancestors(event)):
            continue  # inside another GEMM
        n = _gemm_flops(event.name, event.input_shapes)
        scaled = [e for e in (event, *_descendants(event)) if e.name == _SCALED_MM]
        fp8 = bool(scaled)
        if scaled and id(scaled[0]) in unpadded:
            flops.padding += _gemm_flops(_SCALED_MM, scaled[0].input_shapes) - unpadded[id(scaled[0])]
            flops.padded += 1
            n = unpadded[id(scaled[0])]
        if fp8:
            flops.fp8 += n
        else:
            flops.other += n
        key = "fp8" if fp8 else event.name.removeprefix("aten::")
        flops.calls[key] = flops.calls.get(key, 0) + 1
