"""The Triton kernel itself, run on CPU through the Triton interpreter, against torch bit for bit.

The interpreter must be chosen before triton is imported, and this pytest process may already
have imported triton compiled for GPUs (torch._inductor does). So one subprocess
(``_interp_worker.py``, started with ``TRITON_INTERPRET=1``) runs the kernel on every case and
saves inputs and outputs; the tests here compare them with torch's fused unscale.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from amp_fx.kernels import triton_unscale
from tests.kernels._unscale_cases import Case, all_cases, launch_sizes
from tests.kernels._unscale_checks import assert_same_as_torch, assert_sum_sq_close, reference_flags, sum_sq_rtol

_REPO = Path(__file__).resolve().parents[2]
_CASES = all_cases()
_VARIANTS = ("op_check", "op_norm", "small_check", "small_norm")


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Results of ``_interp_worker.py``: the kernel interpreted on every case and variant."""
    out = tmp_path_factory.mktemp("triton_interp") / "results.pt"
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(_REPO), env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("_interp_worker.py")), str(out)],
        cwd=_REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, f"interpreter worker failed:\n{proc.stdout}\n{proc.stderr}"
    return torch.load(out, weights_only=False)


def test_worker_ran_the_interpreted_triton_kernel(interpreted: dict[str, Any]) -> None:
    assert interpreted["is_interpreted"], "the worker's kernel was not the interpreter's"
    assert interpreted["use_triton_cpu"], "_use_triton(cpu) was False under TRITON_INTERPRET=1"


@pytest.mark.parametrize("variant", _VARIANTS)
@pytest.mark.parametrize("case", _CASES, ids=lambda c: c.name)
def test_triton_matches_torch(interpreted: dict[str, Any], case: Case, variant: str) -> None:
    result = interpreted["cases"][(case.name, variant)]
    # The worker must have unscaled the tensors it was given (same strides), not copies.
    assert result["strides"] == [g.stride() for g in case.grads()]
    expected = assert_same_as_torch(
        result["inputs"],
        result["outputs"],
        result["found_inf"],
        case.found_inf_start,
        case.inv_scale,
    )
    if variant.endswith("norm"):
        assert_sum_sq_close(result["sum_sq"], expected, rtol=sum_sq_rtol(*launch_sizes(variant)))
    else:
        assert result["sum_sq"] is None


@pytest.mark.parametrize("variant", ["op_flags", "small_norm_flags"])
@pytest.mark.parametrize("case", _CASES, ids=lambda c: c.name)
def test_triton_per_tensor_flags(interpreted: dict[str, Any], case: Case, variant: str) -> None:
    """The per-tensor flags (issue 21) are torch's check applied to each gradient on its own, and
    recording them changes nothing else: values, found_inf and the norm stay torch's."""
    result = interpreted["cases"][(case.name, variant)]
    expected = assert_same_as_torch(
        result["inputs"], result["outputs"], result["found_inf"], case.found_inf_start, case.inv_scale
    )
    torch.testing.assert_close(result["flags"], reference_flags(result["inputs"]), rtol=0, atol=0)
    if variant.endswith("norm_flags"):
        assert_sum_sq_close(result["sum_sq"], expected, rtol=sum_sq_rtol(*launch_sizes(variant)))


@pytest.mark.parametrize("elem", ["fp32", "fp16", "bf16"])
def test_kernel_compiles_for_gpu_with_vector_accesses(elem: str) -> None:
    """The same kernel compiles for an H100 (sm_90, no GPU needed) with 16-byte accesses.

    The interpreter accepts things the compiler rejects, and the compiler silently falls back
    to 4-byte accesses (a third of the bandwidth on a GPU) when it cannot prove alignment: the
    ALIGNED hint and the unmasked full tiles are what give ``ld.global.v4``/``st.global.v4``.
    """
    import re

    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if triton_unscale.is_interpreted():
        pytest.skip("TRITON_INTERPRET=1 in this process: the kernel object is the interpreter's")
    source = ASTSource(
        triton_unscale._unscale_check_kernel,
        signature={
            "table_ptr": "*i64",
            "found_inf_ptr": "*fp32",
            "inv_scale_ptr": "*fp32",
            "partial_ptr": "*fp32",
            "flags_ptr": "*fp32",
            "ELEM": "constexpr",
            "BLOCK": "constexpr",
            "SPAN": "constexpr",
            "COMPUTE_NORM": "constexpr",
            "ALIGNED": "constexpr",
            "HAS_FLAGS": "constexpr",
        },
        constexprs={
            "ELEM": getattr(tl, {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}[elem]),
            "BLOCK": triton_unscale.BLOCK,
            "SPAN": triton_unscale.CHUNK,
            "COMPUTE_NORM": True,
            "ALIGNED": True,
            "HAS_FLAGS": True,
        },
    )
    ptx = triton.compile(source, target=GPUTarget("cuda", 90, 32)).asm["ptx"]
    assert re.search(r"ld\.global(\.\w+)*\.v4", ptx), "no 16-byte vector loads"
    assert re.search(r"st\.global(\.\w+)*\.v4", ptx), "no 16-byte vector stores"


def test_chunk_table_is_built_without_reading_a_tensor() -> None:
    """The launcher builds its chunk table on the host whenever the gradients' addresses change
    (every step where backward allocates new gradients): it must read no tensor value there.
    ``repeat_interleave`` without ``output_size`` read the sum of its repeats with ``item()``: two
    host reads per step in the GPU tier's sync-free step test (H200). The table itself against
    one built in plain Python."""
    from amp_fx.testing.step_reference import HostSyncCounter

    addresses, numels, owners, element_size, chunk = [4096, 65536, 1 << 20], [5, 1000, 64], [2, 0, 1], 4, 64
    with HostSyncCounter() as syncs:
        table = triton_unscale._chunk_table_host(addresses, numels, owners, element_size, chunk)
    assert (syncs.count, syncs.in_cpu_kernels) == (0, 0), syncs.names + syncs.in_kernel_names
    expected = [
        [a + start * element_size, min(chunk, n - start), o]
        for a, n, o in zip(addresses, numels, owners)
        for start in range(0, n, chunk)
    ]
    assert table.tolist() == expected


class _RecordingKernel:
    """Stands in for the compiled kernel: records each launch's chunk table and SPAN."""

    def __init__(self) -> None:
        self.launches: list[tuple[torch.Tensor, int]] = []

    def __getitem__(self, grid: tuple[int]) -> Any:
        def launch(table: torch.Tensor, *args: Any, SPAN: int, **kwargs: Any) -> None:  # noqa: N803
            assert grid == (table.shape[0],)
            self.launches.append((table, SPAN))

        return launch


def _rows(grads: list[torch.Tensor], chunk: int) -> list[list[int]]:
    return [
        [g.data_ptr() + start * g.element_size(), min(chunk, g.numel() - start), i]
        for i, g in enumerate(grads)
        for start in range(0, g.numel(), chunk)
    ]


def test_launch_plan_is_reused_while_addresses_hold_and_rebuilt_when_one_changes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The launcher keeps its chunk table between calls (no table built, no copy queued in the
    steady state of a step). The table holds addresses, so it must be rebuilt whenever a gradient
    moves (a new allocation), changes size, or is read at the same address in another dtype (the
    chunks' byte offsets change). Each launch's table against one built from the gradients it was
    given, in plain Python."""
    kernel = _RecordingKernel()
    monkeypatch.setattr(triton_unscale, "_unscale_check_kernel", kernel)
    monkeypatch.setattr(triton_unscale, "_PLANS", type(triton_unscale._PLANS)())
    found_inf, inv_scale = torch.zeros(()), torch.tensor(0.5)
    chunk = block = 64
    storage = torch.zeros(4096)  # fp32 and bf16 views of it: one address, two dtypes
    grads = [storage[:100], torch.zeros(64), torch.zeros(0), torch.zeros(200)]

    def launch(gs: list[torch.Tensor]) -> tuple[torch.Tensor, int]:
        triton_unscale.launch_unscale_check(gs, found_inf, inv_scale, compute_norm=False, block=block, chunk=chunk)
        table, span = kernel.launches[-1]
        assert table.tolist() == _rows(gs, chunk)
        return table, span

    first, _ = launch(grads)
    again, _ = launch(list(grads))  # a new list of the same tensors: the same plan
    assert again is first
    moved = [grads[0], torch.zeros(64), grads[2], grads[3]]  # one gradient reallocated
    assert moved[1].data_ptr() != grads[1].data_ptr()
    assert launch(moved)[0] is not first
    resized = [storage[:90], *grads[1:]]  # the same address, fewer elements
    assert launch(resized)[0] is not first
    bf16 = [storage.view(torch.bfloat16)[:100]]  # the first gradient's address and size, read as bf16
    assert bf16[0].data_ptr() == grads[0].data_ptr()
    table, _ = launch(bf16)
    assert table[:, 0].tolist() == [storage.data_ptr(), storage.data_ptr() + 64 * 2]
    fp32, _ = launch([storage[:100]])  # fp32 at that address again: 4-byte offsets
    assert fp32[:, 0].tolist() == [storage.data_ptr(), storage.data_ptr() + 64 * 4]
    # the transposed (dense, not contiguous) path finds its plan too
    t = torch.zeros(16, 8).t()
    assert launch([t])[0] is launch([t])[0]
