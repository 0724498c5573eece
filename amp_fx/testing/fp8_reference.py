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

__all__ = [
    "cpu_autocast_torchao",
    "torchao_float8",
    "torchao_mxfp8",
    "torchao_missing",
    "linear_twin",
    "expert_linears",
    "reference_grouped_mm",
    "GemmFlops",
    "count_gemm_flops",
]


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


def torchao_float8(
    model: torch.nn.Module,
    recipe: str,
    module_filter_fn: Callable[[torch.nn.Module, str], bool] | None = None,
    *,
    pad_inner_dim: bool = False,
    fsdp_float8_all_gather: bool = False,
) -> torch.nn.Module:
    """A copy of ``model`` with its ``nn.Linear`` swapped by torchao's ``convert_to_float8_training``
    (``pad_inner_dim``: torchao's option that zero-pads each GEMM's inner dimension to a multiple
    of 16, the reference for amp_fx's padding; ``fsdp_float8_all_gather``: its
    ``enable_fsdp_float8_all_gather``, FSDP2 gathering the weights in fp8, the reference for
    amp_fx's: then call ``torchao.float8.precompute_float8_dynamic_scale_for_fsdp(model)`` after
    each optimizer step, as torchao's recipe says)."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = dataclasses.replace(
        Float8LinearConfig.from_recipe_name(recipe),
        pad_inner_dim=pad_inner_dim,
        enable_fsdp_float8_all_gather=fsdp_float8_all_gather,
    )
    return convert_to_float8_training(copy.deepcopy(model), module_filter_fn=module_filter_fn, config=config)


class _TorchaoMXFP8Linear(torch.nn.Module):
    """torchao's ``MXFP8Linear`` (``KernelPreference.EMULATED``, ``ScaleCalculationMode.RCEIL``) on
    autocast's operands: its ``_to_mxfp8_then_scaled_mm`` on the input and the weight cast to the
    autocast dtype (torchao's MX linear takes bf16 operands, as FSDP2's bf16 parameters give them;
    its module would scale the fp32 ones under CPU autocast and multiply in fp32), autocast off
    inside as in amp_fx's graph, then the bias in the output's dtype (``MXFP8Linear.forward``).
    The weight and bias are the linear's own parameters.

    ``pad``: torchao asserts that M, K and N are multiples of 32; with ``pad`` the operands (the
    input flattened to 2-D) are zero-padded to multiples of 32 first and the result sliced, the
    reference for amp_fx's padding (a zero never raises a block's amax; ``tests/fp8/test_mxfp8.py``'s
    kernel test checks this on one GEMM)."""

    def __init__(self, linear: torch.nn.Linear, pad: bool = False) -> None:
        super().__init__()
        self.weight, self.bias = linear.weight, linear.bias
        self.pad = pad

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torchao.prototype.moe_training.mxfp8_linear import _to_mxfp8_then_scaled_mm
        from torchao.prototype.mx_formats.config import ScaleCalculationMode
        from torchao.quantization.quantize_.common.kernel_preference import KernelPreference

        device = x.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype
        with torch.autocast(device, enabled=False):
            a, w = x.to(dtype), self.weight.to(dtype)
            if self.pad:
                shape, a = a.shape, a.reshape(-1, a.shape[-1])
                (m, k), n = a.shape, w.shape[0]
                up = [-(-d // 32) * 32 - d for d in (m, k, n)]
                a = torch.nn.functional.pad(a, (0, up[1], 0, up[0]))
                w = torch.nn.functional.pad(w, (0, up[1], 0, up[2]))
            out = _to_mxfp8_then_scaled_mm(a, w, KernelPreference.EMULATED, ScaleCalculationMode.RCEIL)
            if self.pad:
                out = out[:m, :n].reshape(*shape[:-1], n)
            return out if self.bias is None else out + self.bias.to(out.dtype)


def torchao_mxfp8(
    model: torch.nn.Module, module_filter_fn: Callable[[torch.nn.Module, str], bool] | None = None, *, pad: bool = False
) -> torch.nn.Module:
    """A copy of ``model`` with every ``nn.Linear`` (those ``module_filter_fn(module, name)``
    accepts, if given, as torchao's conversions take it) running torchao 0.18's emulated MXFP8
    training linear (:class:`_TorchaoMXFP8Linear`; ``pad``: on operands zero-padded to multiples
    of 32), under the same names: the reference for ``fp8="mxfp8"``. Run it under
    ``torch.autocast``. (torchao's own conversion, ``quantize_(model, MXFP8TrainingOpConfig)``,
    wraps the fp32 weight, so under CPU autocast it would scale fp32 operands; and its
    ``F.linear`` override drops the bias.)"""
    ref = copy.deepcopy(model)
    for name, module in list(ref.named_modules()):
        if type(module) is torch.nn.Linear and (module_filter_fn is None or module_filter_fn(module, name)):
            parent, _, child = name.rpartition(".")
            setattr(ref.get_submodule(parent), child, _TorchaoMXFP8Linear(module, pad=pad))
    return ref


def reference_grouped_mm(recipe: str) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    """``(A [M, K], B_t [E, K, N], offs) -> out``: the grouped expert GEMM ``recipe`` runs, in eager,
    on the operands as the model made them (bf16: torchtitan's ``GroupedExperts`` casts both).
    ``"mxfp8"``: torchao's own ``_to_mxfp8_then_scaled_grouped_mm(..., KernelPreference.EMULATED)``;
    the others: amp_fx's grouped kernel for the recipe (``fp8_grouped_mm``, held bitwise with
    torchao's per-expert ``Float8Linear`` in tests/fp8/test_fp8_experts.py; ``nvfp4_grouped_mm``
    with TransformerEngine's default switches, held to TE's reference in tests/fp8/test_nvfp4.py).
    Autocast is off inside, as in a compiled graph (which has no ambient autocast): the
    operands are in low precision already, and the recipe's kernels cast what they mean to."""
    from amp_fx.fp8 import Fp8Config, Fp8Recipe

    which = Fp8Recipe(recipe)
    if which is Fp8Recipe.MXFP8:
        from torchao.prototype.moe_training.mxfp8_grouped_mm import _to_mxfp8_then_scaled_grouped_mm
        from torchao.quantization.quantize_.common.kernel_preference import KernelPreference

        def grouped(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
            # torchao's weight gradient blocks the tokens by 32 over the whole A and asserts that
            # M is a multiple of 32 (torchtitan's MXFP8 converter pads each group with its
            # TorchAOTokenDispatcher, whose index kernel is Triton-only). Zero rows after the last
            # group change no block's amax and add nothing to any sum: the values torchao would
            # give, and how amp_fx's kernel pads (``_pad_tokens``).
            m = a.shape[0]
            padded = torch.nn.functional.pad(a, (0, 0, 0, -m % 32))
            out = _to_mxfp8_then_scaled_grouped_mm(padded, b, offs, kernel_preference=KernelPreference.EMULATED)
            return out[:m]
    elif which is Fp8Recipe.NVFP4:
        from amp_fx.kernels.nvfp4 import nvfp4_grouped_mm

        nv = Fp8Config(which).nvfp4_switches

        def grouped(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
            return nvfp4_grouped_mm(a, b, offs, nv.rht, nv.stochastic_rounding, nv.weight_2d)
    else:
        from amp_fx.kernels.fp8_grouped_mm import fp8_grouped_mm

        def grouped(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
            return fp8_grouped_mm(a, b, offs, which)

    def without_autocast(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        with torch.autocast(a.device.type, enabled=False):
            return grouped(a, b, offs)

    return without_autocast


def expert_linears(weights: torch.Tensor) -> torch.nn.ModuleList:
    """One bias-free ``nn.Linear`` per expert of ``weights`` (``[E, out, in]``, ``nn.Linear``'s
    layout; pass a transposed view for ``[E, in, out]``), each holding a copy of its expert's
    weight: the twin torchao can convert of experts held as one 3-D parameter."""
    linears = [torch.nn.Linear(w.shape[1], w.shape[0], bias=False) for w in weights]
    with torch.no_grad():
        for linear, w in zip(linears, weights, strict=True):
            linear.weight.copy_(w)
    return torch.nn.ModuleList(linears)


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


_GEMMS = frozenset(
    {
        "aten::mm",
        "aten::addmm",
        "aten::bmm",
        "aten::baddbmm",
        "aten::_scaled_mm",
        "aten::_grouped_mm",
        "aten::_scaled_grouped_mm",
    }
)
"""The GEMMs counted. The grouped ones (mixture-of-experts layers) count ``2 M K N``: each row of
``[M, K]`` meets one expert's ``[K, N]`` (the weight-gradient form, ``[K, M] x [M, N]`` grouped
along ``M``, the same). transformers' ``grouped_mm_fallback`` and amp_fx's
``amp_fx::scaled_grouped_mm`` on the CPU are loops of ``mm``/``_scaled_mm``, counted as those."""
_SCALED_MM = "aten::_scaled_mm"
_LOW_DTYPES = frozenset({"c10::BFloat16", "c10::Half"})
"""The profiler's names of the 16-bit float dtypes (a raw event's ``dtypes()``)."""
_FP8_GEMMS = frozenset({_SCALED_MM, "aten::_scaled_grouped_mm"})
_PAD = "aten::constant_pad_nd"


@dataclass
class GemmFlops:
    """GEMM FLOPs (2 M K N per GEMM) of the ops that ran, fp8 and not, and the GEMMs by kind.

    A ``_scaled_mm`` on zero-padded operands counts at its unpadded sizes in ``fp8``; what the
    padding adds is in ``padding``."""

    fp8: int = 0
    other: int = 0
    low: int = 0
    """Of ``other``: the FLOPs of GEMMs on 16-bit operands (bf16, fp16): the autocast dtype."""
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

    @property
    def low_share(self) -> float:
        """The share of GEMM FLOPs in low precision: fp8, bf16 or fp16."""
        return (self.fp8 + self.low) / self.total if self.total else 0.0


@dataclass(eq=False)
class _Op:
    """One profiler range of the kinds the counter reads, with its nesting among those kept."""

    name: str
    start: int
    end: int
    thread: int
    shapes: list[list[int]]
    args: list[Any]
    dtypes: list[str]
    parent: _Op | None = None
    children: list[_Op] = field(default_factory=list)


def _ops(prof: Any) -> list[_Op]:
    """The GEMMs, the pads and torch.compile's own ranges that ran, in start order, nested by
    time on their thread. Read from the profiler's raw events: ``prof.events()`` builds an object
    and a tree for every event (about 0.6 ms each: 11 s for an eager torchao T5 step of 18,000
    events), where the counter needs a few hundred."""
    ops = []
    for e in prof.profiler.kineto_results.events():
        name = e.name()
        if name in _GEMMS or name == _PAD or _compiling(name):
            ops.append(
                _Op(name, e.start_ns(), e.end_ns(), e.start_thread_id(), e.shapes(), e.concrete_inputs(), e.dtypes())
            )
    ops.sort(key=lambda o: (o.thread, o.start, -o.end))
    open_: list[_Op] = []
    for op in ops:
        while open_ and (open_[-1].thread != op.thread or open_[-1].end < op.end):
            open_.pop()
        if open_:
            op.parent = open_[-1]
            open_[-1].children.append(op)
        open_.append(op)
    ops.sort(key=lambda o: o.start)
    return ops


def _padded_from(op: _Op) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """(padded shape, shape) of a 2-D ``constant_pad_nd`` that pads at the end with zeros
    (``F.pad(t, (0, right, 0, bottom))``, torchao's ``pad_tensor_for_matmul`` and amp_fx's)."""
    shapes, args = op.shapes, op.args
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


def _ancestors(op: _Op) -> Iterator[_Op]:
    parent = op.parent
    while parent is not None:
        yield parent
        parent = parent.parent


def _compiling(name: str) -> bool:
    """A profiler range of torch.compile's own work (Dynamo's timers, AOTAutograd's tracing)."""
    return name.endswith("(dynamo_timed)") or name in ("bytecode_tracing", "backend_compile")


def _descendants(op: _Op) -> Iterator[_Op]:
    for child in op.children:
        yield child
        yield from _descendants(child)


@contextlib.contextmanager
def count_gemm_flops() -> Iterator[GemmFlops]:
    """Count the GEMM FLOPs of the mm/addmm/bmm/baddbmm/_scaled_mm calls (and the grouped GEMMs of
    mixture-of-experts layers, :data:`_GEMMS`) that run inside (forward
    and backward, eager or compiled), seen by the profiler at the dispatcher, as
    :class:`~amp_fx.testing.step_reference.HostSyncCounter` sees host reads (a
    ``TorchDispatchMode`` would stop Dynamo from running compiled code).

    GEMMs run on fake tensors while torch.compile traces (a recompile inside the window) do not
    count. Only the outermost GEMM of a nest counts: ``_scaled_mm``'s CPU kernel calls ``aten::mm``, and
    torchao's tensor subclass receives ``aten::mm`` and runs ``_scaled_mm`` inside it. A GEMM is
    fp8 when it is, or contains, a ``_scaled_mm`` (or ``_scaled_grouped_mm``). Fused attention (CPU
    sdpa runs as one op) is not counted: none of its operands is a parameter, so no recipe puts it in fp8.

    Padding: a ``_scaled_mm`` whose ``mat2`` is the result of a zero pad (``aten::constant_pad_nd``
    since the previous ``_scaled_mm``; amp_fx's and torchao's ``pad_inner_dim`` padding) counts at
    its unpadded sizes, the rest in ``padding``. Where the pad is not an op of its own (fused by
    inductor) or torch records no pad amounts (``concrete_inputs``), it counts padded.
    """
    flops = GemmFlops()
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        yield flops
    events = [
        e
        for e in _ops(prof)
        if (e.name in _GEMMS or e.name == _PAD) and not any(_compiling(a.name) for a in _ancestors(e))
    ]
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
            (rows, inner), mat2 = event.shapes[0], event.shapes[1]
            flops.unaligned += bool(inner % 16 or mat2[0] % 16 or mat2[1] % 16)
            shape = pads.get(tuple(mat2))  # whatever is padded, mat2 is (its rows or its columns)
            if shape is not None:
                unpadded[id(event)] = 2 * rows * shape[0] * shape[1]
            pads.clear()
    for event in events:
        if event.name == _PAD or any(a.name in _GEMMS for a in _ancestors(event)):
            continue  # inside another GEMM
        n = _gemm_flops(event.name, event.shapes)
        scaled = [e for e in (event, *_descendants(event)) if e.name in _FP8_GEMMS]
        fp8 = bool(scaled)
        if scaled and id(scaled[0]) in unpadded:
            flops.padding += _gemm_flops(_SCALED_MM, scaled[0].shapes) - unpadded[id(scaled[0])]
            flops.padded += 1
            n = unpadded[id(scaled[0])]
        if fp8:
            flops.fp8 += n
        else:
            flops.other += n
            dtypes = event.dtypes
            operand = 1 if event.name in ("aten::addmm", "aten::baddbmm") else 0
            if len(dtypes) > operand and dtypes[operand] in _LOW_DTYPES:
                flops.low += n
        key = "fp8" if fp8 else event.name.removeprefix("aten::")
        flops.calls[key] = flops.calls.get(key, 0) + 1
