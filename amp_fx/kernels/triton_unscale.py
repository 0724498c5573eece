"""The fused unscale + non-finite check (+ squared L2 norm) Triton kernel and its launcher.

One launch handles every gradient of one (device, dtype) group in a single pass over memory:
each element is read once, checked for inf/NaN, multiplied by the inverse scale in fp32, cast
back to the gradient dtype and written once; optionally its square (from the value as stored)
is accumulated in fp32 so gradient clipping needs no second read.

The gradients are described to the kernel by a *chunk table* built on the host (and kept on
the device for the next call with the same gradients), like the chunk lists of PyTorch's
``multi_tensor_apply``: every tensor is cut into chunks of at
most ``chunk`` elements and each chunk becomes one row ``(address of its first element, number
of elements)`` and one Triton program. Addresses and counts are int64, so tensors with more than
2^31 elements are fine; the per-program offsets are < ``chunk`` and fit in int32.

Bytes moved on a GPU (docs/loss-scaling.md)
-------------------------------------------
Per gradient element the kernel reads the element once and writes it once in its own dtype: 8
bytes for fp32, 4 bytes for fp16/bf16. The rest is negligible: a 24-byte table row per chunk of
65536 elements (0.005 % of the fp32 gradient bytes), one 4-byte inverse-scale load per program,
one 4-byte partial sum per program with ``compute_norm`` and 4-byte flag stores (the step's flag
and, with ``flags``, the tensor's) only in programs that saw an inf/NaN. That is exactly the
traffic of an in-place ``torch._foreach_mul_``, the memory ceiling, so the kernel should reach
the ceiling's bandwidth up to launch and tail effects (0.95 of it or better for 64M elements is
the target). Full tiles use 16-byte vector loads and stores, which
``test_kernel_compiles_for_gpu_with_vector_accesses`` checks in the PTX; the loop is otherwise a
handful of ALU instructions per element, far below what an H100 issues per byte of HBM. The path
it replaces, ``unscale_`` followed by ``clip_grad_norm_``, moves 20 bytes per fp32 element
(unscale read + write, norm read, clip-multiply read + write) and so is predicted at 8/20 = 0.4
of the ceiling before its extra launches; the fused kernel with the norm is predicted 2.5x
faster than it (1.5x faster than ``unscale_`` + a norm pass without the clip multiply, 12
bytes). These are predictions from the byte count: no GPU was available to measure them.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

__all__ = ["BLOCK", "CHUNK", "NUM_WARPS", "is_interpreted", "launch_unscale_check"]

# Each program handles one chunk of up to CHUNK elements, in a loop over tiles of BLOCK.
# CHUNK = 65536 is the chunk size of torch's multi_tensor_apply: it makes the table small
# (1024 rows = 16 KiB for 64M elements) while 64M elements still give 1024 programs, about
# 7.8 per SM on a 132-SM H100, enough to fill every SM in a single wave.
CHUNK = 65536
# BLOCK = 1024 with 4 warps (128 threads) gives each thread 8 consecutive elements per tile:
# two 16-byte loads for fp32, one for fp16/bf16, the widest vector access, and 4 KiB of fp32 in
# flight per program per tile. Larger tiles only add registers for a memory-bound loop.
BLOCK = 1024
NUM_WARPS = 4


def is_interpreted() -> bool:
    """True if the kernel in this module was built by the Triton interpreter.

    The interpreter runs the kernel on CPU tensors through numpy; ``triton.jit`` picks it when
    ``TRITON_INTERPRET=1`` is set as this module is imported (set it before importing triton:
    triton reads parts of its configuration once). The kernel object's type is the record. An
    interpreted kernel cannot read GPU memory, and a compiled one cannot read CPU memory.
    """
    return type(_unscale_check_kernel).__name__ == "InterpretedFunction"


_TORCH_TO_TL: dict[torch.dtype, tl.dtype] = {
    torch.float32: tl.float32,
    torch.float16: tl.float16,
    torch.bfloat16: tl.bfloat16,
}


@triton.jit
def _fp32_to_bf16_rtne(x):
    """Round fp32 to bf16, nearest-even, NaN kept NaN: bitwise what torch's CPU/CUDA casts give.

    Done with integer bit operations instead of ``x.to(tl.bfloat16)`` because the Triton
    interpreter (3.7) truncates that cast instead of rounding; on a GPU this costs a few integer
    instructions per element of a memory-bound loop. Adding 0x7FFF plus the lowest kept bit and
    shifting by 16 rounds to nearest-even and carries into the exponent (so overflow gives inf);
    NaN must be special-cased because a NaN with a small payload would carry into inf.
    """
    bits = x.to(tl.uint32, bitcast=True)
    rounded = (bits + (((bits >> 16) & 1) + 0x7FFF)) >> 16
    rounded = tl.where(x != x, (bits >> 16) | 0x0040, rounded)
    return rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _bf16_to_fp32(x):
    """Exact: the bf16 bits are the top half of the fp32 bits (no interpreter cast involved)."""
    return (x.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)


@triton.jit
def _unscale_tile(
    ptr,
    offsets,
    mask,
    inv_scale,
    nonfinite,
    sum_sq,
    ELEM: tl.constexpr,
    COMPUTE_NORM: tl.constexpr,
    MASKED: tl.constexpr,
):
    """One tile of ``_unscale_check_kernel``; returns the updated (nonfinite, sum_sq) lanes.

    Full tiles run unmasked: a mask built from a length loaded from memory has unknown
    divisibility, which stops Triton from emitting 16-byte vector loads and stores.
    """
    if MASKED:
        x = tl.load(ptr + offsets, mask=mask, other=0.0)
    else:
        x = tl.load(ptr + offsets)
    if ELEM == tl.bfloat16:
        xf = _bf16_to_fp32(x)
    else:
        xf = x.to(tl.float32)
    # Check the value *before* the multiply, like torch: at inv_scale == inf (scale 0) a
    # finite x gives inf or NaN that must not be flagged.
    nonfinite |= ((xf != xf) | (tl.abs(xf) == float("inf"))).to(tl.int32)
    yf = tl.where(inv_scale == 1.0, xf, xf * inv_scale)
    if ELEM == tl.bfloat16:
        y = _fp32_to_bf16_rtne(yf)
    else:
        y = yf.to(ELEM)
    if MASKED:
        tl.store(ptr + offsets, y, mask=mask)
    else:
        tl.store(ptr + offsets, y)
    if COMPUTE_NORM:
        if ELEM == tl.bfloat16:
            ys = _bf16_to_fp32(y)
        else:
            ys = y.to(tl.float32)
        square = ys * ys
        if MASKED:
            # Masked lanes hold 0 * inv_scale, which is NaN when inv_scale is inf.
            square = tl.where(mask, square, 0.0)
        sum_sq += square
    return nonfinite, sum_sq


@triton.jit
def _unscale_check_kernel(
    table_ptr,
    found_inf_ptr,
    inv_scale_ptr,
    partial_ptr,
    flags_ptr,
    ELEM: tl.constexpr,
    BLOCK: tl.constexpr,
    SPAN: tl.constexpr,
    COMPUTE_NORM: tl.constexpr,
    ALIGNED: tl.constexpr,
    HAS_FLAGS: tl.constexpr,
):
    """Unscale one chunk in place, flag inf/NaN, and optionally sum the squares of the result.

    Pointers:
        table_ptr: int64 [n_chunks, 3], contiguous. Row ``pid`` is (byte address of the chunk's
            first element, number of elements in the chunk, 1 <= n <= chunk, index of the
            chunk's tensor in the caller's list); rows are written by ``_chunk_table_host``.
        found_inf_ptr: fp32 [] (0-dim). Raised to 1.0 (``atomic_max``) if any element of the
            chunk is inf or NaN *before* the multiply; not written otherwise.
        inv_scale_ptr: fp32 [] (0-dim). The inverse loss scale, read on the device.
        partial_ptr: fp32 [n_chunks]. With COMPUTE_NORM, program ``pid`` writes the fp32 sum of
            the squares of its chunk's unscaled values as stored (after the cast back to ELEM).
            Unused otherwise (any tensor may be passed).
        flags_ptr: fp32 [n_tensors]. With HAS_FLAGS, element ``i`` is raised to 1.0
            (``atomic_max``) by every program of tensor ``i`` that saw an inf/NaN: the per-tensor
            record of the same check, in the same pass. Unused otherwise.

    ELEM is the gradients' dtype (tl.float32, tl.float16 or tl.bfloat16). SPAN bounds the
    tile loop: a power of two, at least BLOCK, and at least the longest chunk in the table. ALIGNED promises that
    every chunk address is a multiple of 16 bytes, which lets full tiles use 16-byte vector
    accesses (checked on the host; an address loaded from memory has no known alignment).

    Every element x becomes ``ELEM(float(x) * inv_scale)``, or ``x`` unchanged when inv_scale
    is exactly 1.0, as in ``torch._amp_foreach_non_finite_check_and_unscale_``.
    """
    pid = tl.program_id(0)
    address = tl.load(table_ptr + 3 * pid)
    # n <= chunk, so int32 index math (cheaper than int64 on a GPU) cannot overflow.
    n = tl.load(table_ptr + 3 * pid + 1).to(tl.int32)
    ptr = address.to(tl.pointer_type(ELEM))
    if ALIGNED:
        ptr = tl.multiple_of(ptr, 16)
    inv_scale = tl.load(inv_scale_ptr)
    nonfinite = tl.zeros([BLOCK], dtype=tl.int32)
    sum_sq = tl.zeros([BLOCK], dtype=tl.float32)
    # The loop bounds are constexpr and the chunk's length only picks the branch: a bound
    # loaded from memory would be fine compiled, but Triton 3.6's interpreter cannot turn it
    # into a Python int under numpy >= 2.4 (its __index__ calls int() on a 1-element array).
    # A program past its chunk's end runs only the two comparisons, a few cycles per tile.
    for start in range(0, SPAN, BLOCK):
        offsets = start + tl.arange(0, BLOCK)
        if start + BLOCK <= n:
            nonfinite, sum_sq = _unscale_tile(
                ptr, offsets, offsets < n, inv_scale, nonfinite, sum_sq, ELEM, COMPUTE_NORM, False
            )
        elif start < n:
            nonfinite, sum_sq = _unscale_tile(
                ptr, offsets, offsets < n, inv_scale, nonfinite, sum_sq, ELEM, COMPUTE_NORM, True
            )
    if tl.max(nonfinite, axis=0) > 0:
        tl.atomic_max(found_inf_ptr, 1.0)
        if HAS_FLAGS:
            tl.atomic_max(flags_ptr + tl.load(table_ptr + 3 * pid + 2), 1.0)
    if COMPUTE_NORM:
        tl.store(partial_ptr + pid, tl.sum(sum_sq, axis=0))


def _is_dense_block(t: torch.Tensor) -> bool:
    """True if ``t``'s elements fill exactly ``t.numel()`` consecutive slots from ``data_ptr``.

    Holds for contiguous tensors and for any permutation of one (channels_last, a transpose):
    strides are then a permutation of contiguous strides, element 0 is the lowest address, and
    an elementwise kernel may treat the memory as a flat array.
    """
    dims = sorted((s, n) for s, n in zip(t.stride(), t.shape) if n != 1)
    expected = 1
    for stride, size in dims:
        if stride != expected:
            return False
        expected *= size
    return True


def _chunk_table_host(
    addresses: list[int], numels: list[int], owners: list[int], element_size: int, chunk: int
) -> torch.Tensor:
    """The int64 [n_chunks, 3] table (chunk address, chunk length, tensor index), on the host."""
    addresses_t = torch.tensor(addresses, dtype=torch.int64)
    owners_t = torch.tensor(owners, dtype=torch.int64)
    numels_t = torch.tensor(numels, dtype=torch.int64)
    counts = [(n + chunk - 1) // chunk for n in numels]
    chunks_per_tensor = torch.tensor(counts, dtype=torch.int64)
    # output_size given: without it repeat_interleave reads the sum of its repeats with item()
    # (a CPU read, but one per table built: seen as a host read in every step on an H200).
    owner = torch.repeat_interleave(torch.arange(len(addresses)), chunks_per_tensor, output_size=sum(counts))
    first_chunk = torch.cumsum(chunks_per_tensor, 0) - chunks_per_tensor
    index_in_tensor = torch.arange(owner.numel(), dtype=torch.int64) - first_chunk[owner]
    start = index_in_tensor * chunk
    return torch.stack(
        [
            addresses_t[owner] + start * element_size,
            torch.clamp(numels_t[owner] - start, max=chunk),
            owners_t[owner],
        ],
        dim=1,
    )


@dataclass(frozen=True, slots=True)
class _Plan:
    """What a launch needs besides its scalars: a function of the gradients' addresses, sizes and
    dtype alone (and of block and chunk), so a plan found by those is right even for new tensors at
    old addresses."""

    table: torch.Tensor
    """int64 [n_chunks, 3] on the gradients' device (``_chunk_table_host``'s rows)."""
    host: torch.Tensor
    """The table's host copy, pinned on CUDA: a copy queued while a CUDA graph was captured
    re-reads that buffer at every replay, so it must stay intact as long as the plan lives."""
    span: int
    aligned: bool


# Plans by (device, dtype, block, chunk, addresses, numels) of the caller's gradients when they are
# all contiguous (the steady state of a training step: after the first step no table is built,
# no copy queued and no gradient inspected beyond its address and size), or by the same of the
# dense blocks handed to the kernel, with their owners, otherwise. Entries made during a CUDA
# graph capture are never evicted (their host copies must stay intact, see ``_Plan.host``).
_PLANS: OrderedDict[tuple[object, ...], _Plan] = OrderedDict()
_CAPTURED_PLANS: dict[tuple[object, ...], _Plan] = {}
_MAX_PLANS = 64


# Unbound, so that ``map`` calls them without building a bound method per gradient.
_IS_CONTIGUOUS = torch.Tensor.is_contiguous
_DATA_PTR = torch.Tensor.data_ptr
_NUMEL = torch.Tensor.numel


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _cached_plan(key: tuple[object, ...]) -> _Plan | None:
    plan = _CAPTURED_PLANS.get(key)
    if plan is not None:
        return plan
    plan = _PLANS.get(key)
    if plan is not None:
        _PLANS.move_to_end(key)
    return plan


def _new_plan(
    key: tuple[object, ...], flat: list[torch.Tensor], owners: list[int], block: int, chunk: int, device: torch.device
) -> _Plan:
    """Build the plan of dense-block tensors ``flat`` (``owners[i]``: ``flat[i]``'s index in the
    caller's list) and keep it under ``key``."""
    host = _chunk_table_host(
        [t.data_ptr() for t in flat], [t.numel() for t in flat], owners, flat[0].element_size(), chunk
    )
    if device.type == "cpu":
        table = host
    else:
        host = host.pin_memory()
        # Pinned + non_blocking: the copy is queued on the current stream without a host sync.
        table = host.to(device, non_blocking=True)
    plan = _Plan(table, host, _span(flat, block, chunk), all(t.data_ptr() % 16 == 0 for t in flat))
    if _capturing():
        _CAPTURED_PLANS[key] = plan
    else:
        _PLANS[key] = plan
        if len(_PLANS) > _MAX_PLANS:
            _PLANS.popitem(last=False)
    return plan


def _plan(
    grads: list[torch.Tensor], block: int, chunk: int, device: torch.device
) -> tuple[_Plan | None, list[tuple[torch.Tensor, torch.Tensor]]]:
    """The launch plan of ``grads`` (None when every gradient is empty) and the copies to write
    back after the launch (gradients whose memory is not one dense block, processed in a
    contiguous buffer).

    The fast path is three C calls per gradient and one dict lookup: the host-side work that runs
    at every step while the device waits for the launch (bench/bench_unscale.py's host-time row).
    ``map`` over the unbound methods, not a comprehension of bound calls: 52 against 71 us for 256
    gradients on the 2-core CPU.
    """
    dtype = grads[0].dtype
    if all(map(_IS_CONTIGUOUS, grads)):
        key: tuple[object, ...] = (device, dtype, block, chunk, tuple(map(_DATA_PTR, grads)), tuple(map(_NUMEL, grads)))
        plan = _cached_plan(key)
        if plan is not None:
            return plan, []
        owners = [i for i, g in enumerate(grads) if g.numel()]
        if not owners:
            return None, []
        return _new_plan(key, [grads[i] for i in owners], owners, block, chunk, device), []
    owners = []
    copies: list[tuple[torch.Tensor, torch.Tensor]] = []
    flat: list[torch.Tensor] = []
    for i, g in enumerate(grads):
        if g.numel() == 0:
            continue
        owners.append(i)
        if g.is_contiguous() or _is_dense_block(g):
            flat.append(g)
        else:
            buffer = g.contiguous()
            copies.append((g, buffer))
            flat.append(buffer)
    if not flat:
        return None, []
    key = (
        device,
        dtype,
        block,
        chunk,
        tuple(t.data_ptr() for t in flat),
        tuple(t.numel() for t in flat),
        tuple(owners),
    )
    return _cached_plan(key) or _new_plan(key, flat, owners, block, chunk, device), copies


def _span(flat: list[torch.Tensor], block: int, chunk: int) -> int:
    """The kernel's SPAN: the longest chunk rounded up to a power of two (and to ``block``).

    Rounding keeps the number of compiled variants at log2(chunk / block) + 1 (7 by default)
    while a list of small tensors loops over one tile instead of chunk / block = 64.
    """
    longest = min(chunk, max(t.numel() for t in flat))
    return max(block, 1 << (longest - 1).bit_length())


def launch_unscale_check(
    grads: list[torch.Tensor],
    found_inf: torch.Tensor,
    inv_scale: torch.Tensor,
    *,
    compute_norm: bool,
    flags: torch.Tensor | None = None,
    block: int = BLOCK,
    chunk: int = CHUNK,
) -> torch.Tensor | None:
    """Run the fused kernel once over ``grads`` (one device, one dtype) in place.

    Args:
        grads: dense strided tensors, all of one dtype (fp32, fp16 or bf16) on ``found_inf``'s
            device. Tensors whose memory is not one dense block (slices with gaps) are copied
            to a contiguous buffer, processed, and copied back.
        found_inf: fp32 0-dim tensor; set to 1.0 if any element is inf/NaN before unscaling.
        inv_scale: fp32 0-dim tensor on the same device.
        compute_norm: also return the sum of squares of the unscaled gradients.
        flags: optional fp32 [len(grads)] tensor on the same device: ``flags[i]`` is raised to
            1.0 if ``grads[i]`` holds an inf/NaN (before unscaling), in the same pass; never
            cleared.
        block, chunk: tile and chunk sizes (powers of two, ``chunk`` a multiple of ``block``);
            tests shrink them to put block and chunk boundaries inside small tensors.

    Returns:
        With ``compute_norm``, an fp32 0-dim tensor: the sum over programs of their fp32
        partial sums, added in fp64 (deterministic, unlike float atomics) and rounded to fp32.
        Otherwise None. Empty input gives 0.0 / None without a launch.
    """
    if block & (block - 1) or chunk % block:
        raise ValueError(f"block={block} must be a power of two dividing chunk={chunk}")
    device = found_inf.device
    plan, copies = _plan(grads, block, chunk, device) if grads else (None, [])
    if plan is None:
        return torch.zeros((), dtype=torch.float32, device=device) if compute_norm else None
    n_chunks = plan.table.shape[0]
    partials = torch.empty(n_chunks, dtype=torch.float32, device=device) if compute_norm else found_inf
    _unscale_check_kernel[(n_chunks,)](
        plan.table,
        found_inf,
        inv_scale,
        partials,
        found_inf if flags is None else flags,
        ELEM=_TORCH_TO_TL[grads[0].dtype],
        BLOCK=block,
        SPAN=plan.span,
        COMPUTE_NORM=compute_norm,
        ALIGNED=plan.aligned,
        HAS_FLAGS=flags is not None,
        num_warps=NUM_WARPS,
    )
    for g, buffer in copies:
        g.copy_(buffer)
    if not compute_norm:
        return None
    return partials.sum(dtype=torch.float64).to(torch.float32)
