"""Exact byte counters for the memory bench (``bench/bench_memory.py``) and its tests.

Every count is taken from the tensors and the collectives themselves, not from an estimate:

* :func:`storages` / :func:`unique_bytes`: the storages behind tensors (a tensor subclass such as
  torchao's ``Float8TrainingTensor`` is flattened to the plain tensors it holds), each counted once
  (by its data pointer), at its full ``nbytes`` (a view holds its whole storage).
* :class:`SavedBytes`: the storages autograd saves for the backward while it is active
  (``torch.autograd.graph.saved_tensors_hooks``; AOTAutograd's compiled graphs save through their
  own ``autograd.Function``, so the hooks see what they save too).
* :class:`PeakBytes`: the largest rise of allocated bytes over the start while it is active. CPU:
  the allocator's own records (the profiler's ``[memory]`` events, every allocation and free,
  inductor's buffers included, summed in order). CUDA: ``torch.cuda.max_memory_allocated`` minus
  ``memory_allocated`` at the start.
* :class:`GradBytes`: the gradient storages as they stand after the backward
  (``register_post_accumulate_grad_hook``), for steps that free them before they return.
* :func:`held_bytes`: what lives between steps, by kind: parameters, gradients, optimizer state,
  caches (amp_fx's weight cache: :func:`weight_cache_tensors`).
* :func:`sent_bytes` and the ``amp_fx_counting`` process-group backend (gloo underneath): the
  bytes each rank hands to every collective, by kind, whoever calls it (DDP's C++ reducer,
  FSDP2's hooks). The process group is a Python subclass, which functional collectives (what
  DTensor and compiled graphs call) cannot resolve a backend from: for those,
* :func:`collective_counting_backend`: ``aot_eager`` counting the bytes this rank hands to each
  functional collective of the graphs it compiles (``torch.ops._c10d_functional``), on any group.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterable, Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "COUNTING_BACKEND",
    "GradBytes",
    "PeakBytes",
    "SavedBytes",
    "collective_counting_backend",
    "held_bytes",
    "sent_bytes",
    "storages",
    "unique_bytes",
    "weight_cache_tensors",
]


def storages(t: torch.Tensor) -> list[torch.UntypedStorage]:
    """The untyped storages holding ``t``'s data (those of its inner tensors for a subclass)."""
    if type(t) is not torch.Tensor and type(t) is not torch.nn.Parameter and hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        return [s for name in names for s in storages(getattr(t, name))]
    return [t.untyped_storage()]


def _key(storage: torch.UntypedStorage) -> tuple[str, int]:
    return str(storage.device), storage.data_ptr()


def unique_bytes(tensors: Iterable[torch.Tensor], exclude: Iterable[torch.Tensor] = ()) -> int:
    """Bytes of the distinct storages behind ``tensors``, leaving out those behind ``exclude``."""
    skip = {_key(s) for t in exclude for s in storages(t)}
    seen: dict[tuple[str, int], int] = {}
    for t in tensors:
        for s in storages(t):
            k = _key(s)
            if k not in skip and s.nbytes():
                seen[k] = s.nbytes()
    return sum(seen.values())


class SavedBytes:
    """Storages saved for the backward while active: ``with SavedBytes() as saved: loss = f(x)``,
    then ``saved.bytes()`` (each storage once) or ``saved.bytes(exclude=params)``.

    The tensors are kept until the context exits (as autograd keeps them until the backward), so
    no two distinct saved storages can share an address."""

    def __init__(self) -> None:
        self.tensors: list[torch.Tensor] = []
        self._hooks: Any = None

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        self.tensors.append(t)
        return t

    def __enter__(self) -> SavedBytes:
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._hooks.__exit__(*exc)

    def bytes(self, exclude: Iterable[torch.Tensor] = ()) -> int:
        return unique_bytes(self.tensors, exclude)


class PeakBytes:
    """``with PeakBytes(device) as peak: ...``; then ``peak.bytes``: the largest number of bytes
    allocated at any point inside beyond what was allocated at its start (see the module docstring).

    CPU: the allocator knows the size of a block only if it was allocated while a profiler
    recorded memory, so a free of an older block is missing from the count (torch warns once:
    "Memory block of unknown size"). Run the step before the measured one under a
    ``PeakBytes`` too, and check ``net``."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self.bytes = 0
        self.net = 0
        """Bytes allocated minus bytes freed inside (0 for a step that leaves memory as it found it)."""
        self._prof: Any = None
        self._start = 0

    def __enter__(self) -> PeakBytes:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self._start = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            from torch.profiler import ProfilerActivity, profile

            self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
            self._prof.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.bytes = torch.cuda.max_memory_allocated(self.device) - self._start
            self.net = torch.cuda.memory_allocated(self.device) - self._start
            return
        self._prof.__exit__(*exc)
        events = [
            e
            for e in self._prof.profiler.kineto_results.events()
            if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU
        ]
        now = peak = 0
        for e in sorted(events, key=lambda e: e.start_ns()):  # stable: ties keep the record order
            now += e.nbytes()
            peak = max(peak, now)
        self.bytes, self.net = peak, now


class GradBytes:
    """``with GradBytes(params) as grads: step(...)``; then ``grads.bytes``: the distinct storages of
    the parameters' ``.grad`` as each stood after its last accumulation inside."""

    def __init__(self, params: Iterable[torch.Tensor]) -> None:
        self.params = [p for p in params if p.requires_grad]
        self._last: dict[int, int] = {}
        self._handles: list[Any] = []
        self.bytes = 0

    def _hook(self, p: torch.Tensor) -> None:
        self._last[id(p)] = unique_bytes([p.grad]) if p.grad is not None else 0

    def __enter__(self) -> GradBytes:
        self._handles = [p.register_post_accumulate_grad_hook(self._hook) for p in self.params]
        return self

    def __exit__(self, *exc: object) -> None:
        for h in self._handles:
            h.remove()
        self.bytes = sum(self._last.values())


def weight_cache_tensors(cache: Any) -> list[torch.Tensor]:
    """Every tensor amp_fx's weight cache (``amp_fx.backend.weight_cache.WeightCache``) holds:
    low-precision copies and fp8 casts (data and scales)."""
    return [] if cache is None else cache.tensors()


def held_bytes(
    params: Iterable[torch.Tensor], optimizer: torch.optim.Optimizer | None = None, caches: Iterable[torch.Tensor] = ()
) -> dict[str, int]:
    """Bytes held by kind, each storage counted once and under the first kind that holds it:
    parameters, gradients (``.grad`` as it stands), optimizer state, caches."""
    params = list(params)
    state: list[torch.Tensor] = []
    if optimizer is not None:
        state = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    grads = [p.grad for p in params if p.grad is not None]
    caches = list(caches)
    out = {"parameters": unique_bytes(params)}
    out["gradients"] = unique_bytes(grads, exclude=params)
    out["optimizer state"] = unique_bytes(state, exclude=params + grads)
    out["caches"] = unique_bytes(caches, exclude=params + grads + state)
    return out


# --- collectives --------------------------------------------------------------------------------

COUNTING_BACKEND = "amp_fx_counting"
"""The name to pass to ``dist.init_process_group`` (or ``run_ranks(..., backend=)``): gloo, with
every collective's input bytes counted in this process (:func:`sent_bytes`)."""

_SENT: Counter[str] = Counter()


def _nbytes(tensors: Any) -> int:
    if isinstance(tensors, torch.Tensor):
        return tensors.numel() * tensors.element_size()
    return sum(_nbytes(t) for t in tensors)


class _CountingGroup(dist.ProcessGroup):
    """A process group that hands each collective to gloo after adding the bytes of this rank's
    input to ``_SENT[kind]``: ``all_reduce`` and ``broadcast`` the whole tensor, ``all_gather`` this
    rank's shard, ``reduce_scatter`` the whole unsharded input."""

    def __init__(self, inner: Any, rank: int, size: int) -> None:
        super().__init__(rank, size)  # type: ignore[call-arg, arg-type]  # the binding's (rank, size) overload, not in torch's stub
        self._inner = inner

    @property
    def group_name(self) -> str:  # type: ignore[override]  # a str at run time; what functional collectives resolve the group by
        return dist.distributed_c10d._world.pg_names[self]

    @property
    def pg_name(self) -> str:
        return self.group_name

    def getBackendName(self) -> str:  # noqa: N802 - ProcessGroup's method name
        return COUNTING_BACKEND

    def size(self) -> int:
        return self._inner.size()

    def rank(self) -> int:
        return self._inner.rank()

    def _count(self, kind: str, tensors: Any) -> None:
        _SENT[kind] += _nbytes(tensors)

    def allreduce(self, tensors: Any, opts: Any = None) -> Any:  # type: ignore[override]  # a counting wrapper: forwards any of the overloads to gloo
        self._count("all_reduce", tensors)
        return self._inner.allreduce(tensors) if opts is None else self._inner.allreduce(tensors, opts)

    def allreduce_coalesced(self, tensors: Any, opts: Any = None) -> Any:
        self._count("all_reduce", tensors)
        return self._inner.allreduce_coalesced(tensors, opts)

    def broadcast(self, tensors: Any, opts: Any = None) -> Any:  # type: ignore[override]  # a counting wrapper: forwards any of the overloads to gloo
        self._count("broadcast", tensors)
        return self._inner.broadcast(tensors, opts)

    def allgather(self, outputs: Any, inputs: Any, opts: Any = None) -> Any:
        self._count("all_gather", inputs)
        return self._inner.allgather(outputs, inputs, opts)

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:
        self._count("all_gather", input)
        if input.dtype.is_floating_point and input.dtype.itemsize == 1:  # fp8: gloo has no fp8 type; gather the bytes
            output, input = output.view(torch.uint8), input.view(torch.uint8)
        return self._inner._allgather_base(output, input, opts)

    _allgather_base = all_gather_single

    def reduce_scatter(self, outputs: Any, inputs: Any, opts: Any = None) -> Any:  # type: ignore[override]  # a counting wrapper: forwards any of the overloads to gloo
        self._count("reduce_scatter", inputs)
        return self._inner.reduce_scatter(outputs, inputs, opts)

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:
        self._count("reduce_scatter", input)
        return self._inner._reduce_scatter_base(output, input, opts)

    _reduce_scatter_base = reduce_scatter_single  # type: ignore[assignment]  # opts optional, as all_gather_single's

    def barrier(self, opts: Any = None) -> Any:
        return self._inner.barrier(opts)


def _create_counting(store: Any, rank: int, size: int, timeout: timedelta) -> _CountingGroup:
    return _CountingGroup(dist.ProcessGroupGloo(store, rank, size, timeout=timeout), rank, size)


if COUNTING_BACKEND.upper() not in dist.Backend._plugins:
    dist.Backend.register_backend(COUNTING_BACKEND, _create_counting, devices=["cpu"])


@contextlib.contextmanager
def sent_bytes() -> Iterator[Counter[str]]:
    """``with sent_bytes() as sent: ...``; then ``sent["all_reduce"]`` etc.: the bytes this rank
    handed to each kind of collective inside (groups made with the ``amp_fx_counting`` backend)."""
    before = Counter(_SENT)
    out: Counter[str] = Counter()
    try:
        yield out
    finally:
        out.update({k: v - before[k] for k, v in _SENT.items() if v - before[k]})


_FUNCTIONAL_KINDS = {
    "all_gather_into_tensor": "all_gather",
    "all_gather_into_tensor_coalesced": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "all_reduce": "all_reduce",
    "all_reduce_coalesced": "all_reduce",
    "all_to_all_single": "all_to_all",
    "broadcast": "broadcast",
}


def _graph_collectives(gm: torch.fx.GraphModule) -> Counter[str]:
    """The bytes of each functional collective's input in ``gm`` (from ``meta["val"]``), by kind."""
    out: Counter[str] = Counter()
    for node in gm.graph.nodes:
        if node.op == "call_function" and getattr(node.target, "namespace", None) == "_c10d_functional":
            kind = _FUNCTIONAL_KINDS.get(node.target._opname)
            if kind is not None:
                out[kind] += _nbytes(node.args[0].meta["val"])
    return out


def collective_counting_backend(sent: Counter[str]) -> Any:
    """A backend for ``amp_fx.compile(backend=...)``: ``aot_eager`` (the same partitioner and
    runtime, so the same values), with the bytes of this rank's input to each functional collective
    (DTensor's, in the compiled forward and backward graphs) added to ``sent[kind]`` on every run of
    a graph (``all_gather`` this rank's shard, ``reduce_scatter`` the whole unsharded input,
    ``all_reduce`` the tensor). Functional collectives resolve their process group's backend in C++,
    which the ``amp_fx_counting`` group cannot serve (:func:`sent_bytes`), hence counting the graphs."""
    from torch._dynamo.backends.debugging import aot_eager, boxed_nop

    def compiler(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        run, counts = boxed_nop(gm, example_inputs), _graph_collectives(gm)

        def counted(args: Any) -> Any:
            sent.update(counts)
            return run(args)

        counted._boxed_call = True  # type: ignore[attr-defined]  # AOTAutograd's calling convention
        return counted

    def backend(gm: torch.fx.GraphModule, example_inputs: Any, **kwargs: Any) -> Any:
        return aot_eager(gm, example_inputs, fw_compiler=compiler, bw_compiler=compiler, **kwargs)

    return backend
