"""Per-op dtype parity with eager autocast, over the op lists torch tests its own autocast with.

Every entry of ``torch.testing._internal.autocast_test_lists`` (``AutocastCPUTestLists`` for the
CPU policy, ``AutocastTestLists`` on fake CUDA tensors for the CUDA policy) runs for bf16 and fp16
under eager autocast, which is the reference, and through amp_fx's capture + insert_casts on the
same inputs. Output dtypes and shapes must match exactly; on CPU the values must match bit for bit.
Where eager raises, amp_fx must raise too (AmpFxError where eager autocast bans the op).

Each entry is called the ways torch's own harness calls it (``_run_autocast_outofplace``): through
its module (torch, torch._C._nn, torch._C._linalg) and, where ``torch.Tensor`` has the name, as a
Tensor method.
"""

from __future__ import annotations

import collections
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

from amp_fx.passes import meta
from tests.policy._oracle import DTYPES, Call, check, load_autocast_test_lists, run_amp_fx, run_eager

_lists = load_autocast_test_lists()

_SHORT = {torch.bfloat16: "bf16", torch.float16: "fp16"}

# Lists whose CPU entries carry one argument tuple for bf16 and another for fp16.
_CPU_PER_DTYPE_ARGS = {"torch_expect_builtin_promote", "methods_expect_builtin_promote", "torch_need_autocast_promote"}

_LIST_MODULES = {
    "torch_expect_builtin_promote": torch,
    "methods_expect_builtin_promote": None,
    "torch_16": torch,
    "torch_fp16": torch,
    "torch_fp32": torch,
    "torch_need_autocast_promote": torch,
    "nn_16": torch._C._nn,
    "nn_fp16": torch._C._nn,
    "nn_fp32": torch._C._nn,
    "linalg_fp16": torch._C._linalg,
    "methods_fp16": None,
    "methods_fp32": None,
    "banned": None,  # banned entries name their module
}

# Entries that may not run without real CUDA even under FakeTensorMode: their fake-CUDA kernels
# reach for the CUDA runtime (cuDNN, or the fused RNN cell kernel) instead of a meta kernel. Which
# of them do depends on the torch version, so it is a feature test (_lacks_real_cuda): an entry
# that runs on fake tensors with the installed torch is checked like any other (gru_cell and
# grid_sampler on 2.15), one that fails for lack of CUDA is skipped with torch's own message.
_NEEDS_REAL_CUDA = {
    (
        "torch_fp16",
        "cudnn_convolution",
        None,
    ): "aten::cudnn_convolution has no meta kernel: under FakeTensorMode it asserts 'Torch not "
    "compiled with CUDA enabled' (2.11, 2.13) or finds no NVIDIA driver (2.15)",
    (
        "torch_fp16",
        "cudnn_convolution_transpose",
        None,
    ): "aten::cudnn_convolution_transpose has no meta kernel: under FakeTensorMode it asserts "
    "'Torch not compiled with CUDA enabled' (2.11, 2.13) or finds no NVIDIA driver (2.15)",
    (
        "torch_fp16",
        "gru_cell",
        None,
    ): "aten::gru_cell on CUDA dispatches to _thnn_fused_gru_cell, which under FakeTensorMode "
    "asserts 'Torch not compiled with CUDA enabled' (2.11, 2.13; it runs on 2.15)",
    (
        "torch_need_autocast_promote",
        "grid_sampler",
        torch.float16,
    ): "aten::grid_sampler on fp32 CUDA inputs picks cudnn_grid_sampler after checking for "
    "cuDNN, which raises 'PyTorch is not linked with support for cuda devices' without CUDA "
    "(2.11, 2.13; it runs on 2.15. Under bf16 autocast eager refuses the fp16+fp32 mix first, "
    "and that case runs)",
}
# What torch says when an op needs the real CUDA runtime.
_NO_CUDA_MESSAGES = ("CUDA", "cuda", "NVIDIA driver")

# Entries of torch's lists that torch's own harness never runs, or that fake tensors cannot run.
_NOT_RUNNABLE = {
    (
        "cuda",
        "torch_fp16",
        "einsum",
    ): "the entry ('einsum', 'bkhd,bqhd->bqkh', (mat0, mat1)) is malformed (2-d operands for a "
    "4-d equation, equation in the args slot) and torch's test_cuda never runs it (the third "
    "element lands in the skip-on-ROCm slot); einsum is covered in test_decomposed_op",
    (
        "cuda",
        "torch_expect_builtin_promote",
        "equal",
    ): "torch.equal returns a Python bool computed from the data, which fake CUDA tensors do "
    "not have (DataDependentOutputException)",
}


# Known amp_fx bugs (reported; strict, so a fix shows up as XPASS and the mark must go).
_NESTED_AUTOCAST = (
    "amp_fx divergence: aten::_trilinear (what F.bilinear becomes on CPU, where bilinear is not "
    "autocast) calls at::bmm from inside its CPU kernel, and eager autocast casts that nested bmm "
    "to the lower dtype; amp_fx sees only _trilinear and keeps it fp32 (dtypes agree, values not)"
)
_XFAIL = {
    ("cpu", "decomposed", "F.bilinear"): _NESTED_AUTOCAST,
}


def _marks(table: str, list_name: str, op: str) -> list[pytest.MarkDecorator]:
    reason = _XFAIL.get((table, list_name, op))
    return [] if reason is None else [pytest.mark.xfail(strict=True, reason=reason)]


@dataclass(frozen=True)
class Entry:
    table: str
    list_name: str
    op: str
    occurrence: int
    via: str
    """"module": ``getattr(module, op)(*args)``; "Tensor": ``getattr(args[0], op)(*args[1:])``."""
    module: Any
    raw: tuple[Any, ...]

    def call(self, dtype: torch.dtype) -> Call:
        rest = self.raw[1:]
        if self.table == "cpu" and self.list_name in _CPU_PER_DTYPE_ARGS:
            args = rest[0] if dtype is torch.bfloat16 else rest[1]
            rest = rest[2:]
        else:
            args, rest = rest[0], rest[1:]
        kwargs = next((r for r in rest if isinstance(r, dict)), {})
        if self.via == "Tensor":
            return Call(lambda first, *more, **kw: getattr(first, self.op)(*more, **kw), tuple(args), dict(kwargs))
        return Call(getattr(self.module, self.op), tuple(args), dict(kwargs))


def _make_cpu_lists() -> Any:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return _lists.AutocastCPUTestLists("cpu")


def _make_cuda_lists() -> tuple[Any, FakeTensorMode]:
    mode = FakeTensorMode()
    with mode:
        return _lists.AutocastTestLists(torch.device("cuda")), mode


_CPU_LISTS = _make_cpu_lists()
_CUDA_LISTS, _CUDA_MODE = _make_cuda_lists()

_CPU_LIST_NAMES = (
    "torch_16",
    "torch_fp32",
    "nn_16",
    "nn_fp32",
    "torch_need_autocast_promote",
    "torch_expect_builtin_promote",
    "methods_expect_builtin_promote",
)
_CUDA_LIST_NAMES = (
    "torch_fp16",
    "torch_fp32",
    "nn_fp16",
    "nn_fp32",
    "linalg_fp16",
    "methods_fp16",
    "methods_fp32",
    "torch_need_autocast_promote",
    "torch_expect_builtin_promote",
    "methods_expect_builtin_promote",
    "banned",
)


def _entries(table: str, lists: Any, names: tuple[str, ...]) -> Iterator[Entry]:
    for list_name in names:
        seen: collections.Counter[str] = collections.Counter()
        for raw in getattr(lists, list_name):
            op = raw[0]
            occurrence = seen[op]
            seen[op] += 1
            module = raw[2] if list_name == "banned" else _LIST_MODULES[list_name]
            vias = []
            if module is not None and hasattr(module, op):
                vias.append("module")
            if hasattr(torch.Tensor, op):
                vias.append("Tensor")
            assert vias, f"{table} {list_name} {op}: found neither on {module} nor on Tensor"
            for via in vias:
                yield Entry(table, list_name, op, occurrence, via, module, raw)


def _params(table: str, lists: Any, names: tuple[str, ...]) -> list[Any]:
    entries = list(_entries(table, lists, names))
    counts = collections.Counter((e.list_name, e.op, e.via) for e in entries)
    params = []
    for e in entries:
        op_id = e.op + (f"#{e.occurrence}" if counts[e.list_name, e.op, e.via] > 1 else "")
        op_id += ".Tensor" if e.via == "Tensor" else ""
        for dtype in DTYPES:
            params.append(
                pytest.param(
                    e,
                    dtype,
                    id=f"{e.table}-{e.list_name}-{op_id}-{_SHORT[dtype]}",
                    marks=_marks(e.table, e.list_name, e.op),
                )
            )
    return params


def _needs_real_cuda(e: Entry, dtype: torch.dtype) -> str | None:
    return _NEEDS_REAL_CUDA.get((e.list_name, e.op, None)) or _NEEDS_REAL_CUDA.get((e.list_name, e.op, dtype))


def _lacks_real_cuda(e: Entry, dtype: torch.dtype) -> str | None:
    """The skip reason if ``e`` is a _NEEDS_REAL_CUDA entry that fails on fake CUDA tensors with
    the installed torch for lack of the CUDA runtime; None if it runs (then it is checked)."""
    reason = _needs_real_cuda(e, dtype)
    if reason is None:
        return None
    eager = run_eager(e.call(dtype), "cuda", dtype, _CUDA_MODE)
    if eager.error is None:
        return None
    assert any(m in str(eager.error) for m in _NO_CUDA_MESSAGES), (
        f"{e.list_name} {e.op} ({dtype}) fails on fake CUDA tensors for another reason: {eager.error!r}"
    )
    return f"{reason}; here: {eager.error}"


@pytest.mark.parametrize(("entry", "dtype"), _params("cpu", _CPU_LISTS, _CPU_LIST_NAMES))
def test_cpu_table(entry: Entry, dtype: torch.dtype) -> None:
    check(entry.call(dtype), "cpu", dtype)


@pytest.mark.slow_cases
@pytest.mark.parametrize(("entry", "dtype"), _params("cuda", _CUDA_LISTS, _CUDA_LIST_NAMES))
def test_cuda_table(entry: Entry, dtype: torch.dtype) -> None:
    reason = _NOT_RUNNABLE.get(("cuda", entry.list_name, entry.op)) or _lacks_real_cuda(entry, dtype)
    if reason is not None:
        pytest.skip(reason)
    check(entry.call(dtype), "cuda", dtype, _CUDA_MODE)


@pytest.mark.parametrize("key", sorted(_NEEDS_REAL_CUDA, key=str), ids=lambda k: "-".join(map(str, k)))
def test_needs_real_cuda_entries_run_or_fail_for_lack_of_cuda(key: tuple[str, str, Any]) -> None:
    """Each candidate either runs on fake CUDA tensors (and test_cuda_table checks it) or fails
    with torch's no-CUDA message: no other failure hides behind the list."""
    list_name, op, only = key
    entry = next(e for e in _entries("cuda", _CUDA_LISTS, (list_name,)) if e.op == op)
    for dtype in (only,) if only is not None else DTYPES:
        eager = run_eager(entry.call(dtype), "cuda", dtype, _CUDA_MODE)
        if eager.error is not None:
            assert any(m in str(eager.error) for m in _NO_CUDA_MESSAGES), eager.error


# Ops that reach autocast only after CompositeImplicitAutograd decomposition (einsum and tensordot
# become bmm/mm on CPU), ops with mixed input dtypes, and float64 (never cast). Each builder makes
# the call's inputs on ``device``; ``low`` is the autocast dtype of the case.
def _randn(*shape: int, device: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(shape, device=device, dtype=dtype)


_DECOMPOSED = {
    "einsum": lambda d, low: Call(torch.einsum, ("bij,bjk->bik", _randn(2, 3, 4, device=d), _randn(2, 4, 5, device=d))),
    "einsum_4d": lambda d, low: Call(
        torch.einsum, ("bkhd,bqhd->bqkh", _randn(2, 3, 4, 5, device=d), _randn(2, 6, 4, 5, device=d))
    ),
    "tensordot": lambda d, low: Call(
        torch.tensordot, (_randn(3, 4, 5, device=d), _randn(4, 5, 6, device=d)), {"dims": 2}
    ),
    "inner": lambda d, low: Call(torch.inner, (_randn(3, 4, device=d), _randn(5, 4, device=d))),
    "matmul_3d_2d": lambda d, low: Call(torch.matmul, (_randn(2, 3, 4, device=d), _randn(4, 5, device=d))),
    "F.linear": lambda d, low: Call(F.linear, (_randn(3, 4, device=d), _randn(5, 4, device=d), _randn(5, device=d))),
    "F.bilinear": lambda d, low: Call(
        F.bilinear, (_randn(3, 4, device=d), _randn(3, 5, device=d), _randn(2, 4, 5, device=d), _randn(2, device=d))
    ),
    "F.layer_norm_low_input": lambda d, low: Call(
        F.layer_norm, (_randn(3, 8, device=d, dtype=low), (8,), _randn(8, device=d), _randn(8, device=d))
    ),
    "F.layer_norm_fp32": lambda d, low: Call(F.layer_norm, (_randn(3, 8, device=d), (8,))),
    "F.softmax_low_input": lambda d, low: Call(F.softmax, (_randn(3, 8, device=d, dtype=low),), {"dim": -1}),
    "F.softmax_explicit_dtype": lambda d, low: Call(
        F.softmax, (_randn(3, 8, device=d, dtype=low),), {"dim": -1, "dtype": low}
    ),
    "F.log_softmax_low_input": lambda d, low: Call(F.log_softmax, (_randn(3, 8, device=d, dtype=low),), {"dim": 1}),
    "F.group_norm": lambda d, low: Call(
        F.group_norm, (_randn(2, 4, 3, device=d, dtype=low), 2, _randn(4, device=d), _randn(4, device=d))
    ),
    "F.cosine_similarity": lambda d, low: Call(
        F.cosine_similarity, (_randn(3, 8, device=d, dtype=low), _randn(3, 8, device=d, dtype=low))
    ),
    "cdist_low_input": lambda d, low: Call(
        torch.cdist, (_randn(3, 4, device=d, dtype=low), _randn(5, 4, device=d, dtype=low))
    ),
    "cdist_fp32": lambda d, low: Call(torch.cdist, (_randn(3, 4, device=d), _randn(5, 4, device=d))),
    "cat_low_fp32": lambda d, low: Call(torch.cat, ([_randn(2, device=d, dtype=low), _randn(3, device=d)],)),
    "cat_fp32_low": lambda d, low: Call(torch.cat, ([_randn(3, device=d), _randn(2, device=d, dtype=low)],)),
    "cat_bf16_fp16": lambda d, low: Call(
        torch.cat, ([_randn(2, device=d, dtype=torch.bfloat16), _randn(2, device=d, dtype=torch.float16)],)
    ),
    "cat_fp64_low": lambda d, low: Call(
        torch.cat, ([_randn(2, device=d, dtype=torch.float64), _randn(2, device=d, dtype=low)],)
    ),
    "stack_low_fp32": lambda d, low: Call(torch.stack, ([_randn(2, device=d, dtype=low), _randn(2, device=d)],)),
    "mm_fp64": lambda d, low: Call(
        torch.mm, (_randn(3, 4, device=d, dtype=torch.float64), _randn(4, 5, device=d, dtype=torch.float64))
    ),
    "index_copy_fp32_low": lambda d, low: Call(
        torch.index_copy, (_randn(4, 3, device=d), 0, torch.tensor([0, 2], device=d), _randn(2, 3, device=d, dtype=low))
    ),
    "sum_low_input": lambda d, low: Call(torch.sum, (_randn(3, 4, device=d, dtype=low),), {"dim": 1}),
    "norm_low_input": lambda d, low: Call(torch.norm, (_randn(3, 4, device=d, dtype=low),), {"p": 2, "dim": 1}),
    "F.scaled_dot_product_attention": lambda d, low: Call(
        F.scaled_dot_product_attention,
        (_randn(1, 2, 4, 8, device=d), _randn(1, 2, 4, 8, device=d), _randn(1, 2, 4, 8, device=d)),
    ),
}


@pytest.mark.parametrize(
    ("table", "name", "dtype"),
    [
        pytest.param(table, name, dtype, id=f"{table}-{name}-{_SHORT[dtype]}", marks=_marks(table, "decomposed", name))
        for table in ("cpu", "cuda")
        for name in sorted(_DECOMPOSED)
        for dtype in DTYPES
    ],
)
def test_decomposed_op(table: str, name: str, dtype: torch.dtype) -> None:
    build = _DECOMPOSED[name]
    if table == "cpu":
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            call = build("cpu", dtype)
        check(call, "cpu", dtype)
    else:
        with _CUDA_MODE:
            call = build("cuda", dtype)
        check(call, "cuda", dtype, _CUDA_MODE)


@pytest.mark.parametrize(
    ("fn", "args", "expected"),
    [
        pytest.param(torch.einsum, ("bij,bjk->bik", (2, 3, 4), (2, 4, 5)), "aten::bmm", id="einsum-bmm"),
        pytest.param(torch.tensordot, ((3, 4, 5), (4, 5, 6)), "aten::mm", id="tensordot-mm"),
    ],
)
def test_cpu_cast_lands_on_the_decomposed_op(fn: Any, args: tuple[Any, ...], expected: str) -> None:
    """On CPU einsum/tensordot have no autocast kernel: the cast is decided at the bmm/mm."""
    call_args = tuple(torch.randn(a) if isinstance(a, tuple) else a for a in args)
    amp = run_amp_fx(Call(fn, call_args), "cpu", torch.bfloat16)
    assert amp.error is None, amp.error
    decided = {n.target.name(): n.meta[meta.DECISION].reason for n in amp.graph.graph.nodes if meta.DECISION in n.meta}
    assert expected in decided, decided
    assert "default cpu table" in decided[expected], decided[expected]
    assert "aten::einsum" not in decided and "aten::tensordot" not in decided, decided


@pytest.mark.parametrize("dtype", DTYPES, ids=_SHORT.get)
def test_policy_can_move_a_banned_op(dtype: torch.dtype) -> None:
    """Policy(op_classes={binary_cross_entropy: FP32}) runs it as eager runs it on fp32 inputs."""
    from amp_fx import CastClass, Policy
    from amp_fx.passes.capture import capture
    from amp_fx.passes.insert_casts import insert_casts

    policy = Policy(op_classes={"aten::binary_cross_entropy": CastClass.FP32})
    with _CUDA_MODE:
        x = torch.rand(8, 8, device="cuda", dtype=dtype)
        y = torch.rand(8, 8, device="cuda")
        reference = F.binary_cross_entropy(x.float(), y.float())
        gm = capture(
            F.binary_cross_entropy, [x, y], policy=policy, device_type="cuda", dtype=dtype, leaf_flags=[False, False]
        )
        gm, _ = insert_casts(gm, policy=policy, device_type="cuda", dtype=dtype, fake_mode=_CUDA_MODE)
        out = gm(x, y)
    assert (out.dtype, out.shape) == (reference.dtype, reference.shape)


# --- the tables follow the installed torch (2.11 to 2.15) -----------------------------------------


@pytest.mark.parametrize("device_type", ["cpu", "cuda"])
def test_entries_the_installed_torch_lacks_are_declared_version_dependent(device_type: str) -> None:
    """DEFAULT_TABLES keeps the listed entries the installed torch registers. Any listed entry it
    does not register must be one VERSION_DEPENDENT names (with the versions that have it), so a
    torch that silently drops an op from autocast fails here instead of shrinking the table."""
    from amp_fx.policy import DEFAULT_TABLES, LISTED_TABLES, VERSION_DEPENDENT

    dropped = set(LISTED_TABLES[device_type]) - set(DEFAULT_TABLES[device_type])
    undeclared = sorted(op for op in dropped if (device_type, op) not in VERSION_DEPENDENT)
    assert not undeclared, (
        f"torch {torch.__version__} does not register {undeclared} at Autocast{device_type.upper()}; "
        "if that is a new torch's change, add them to amp_fx.policy.VERSION_DEPENDENT"
    )
    for name, cls in DEFAULT_TABLES[device_type].items():
        assert LISTED_TABLES[device_type][name] is cls, name


def test_version_dependent_names_only_listed_entries() -> None:
    from amp_fx.policy import LISTED_TABLES, VERSION_DEPENDENT

    stale = sorted(key for key in VERSION_DEPENDENT if key[1] not in LISTED_TABLES[key[0]])
    assert not stale, f"VERSION_DEPENDENT names entries no table lists: {stale}"
