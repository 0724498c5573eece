"""Baselines for :func:`amp_fx.compile_step`, shared by its tests and its benchmark.

* :func:`eager_amp_step`: torch's AMP recipe, eager ``torch.autocast`` + a GradScaler (what
  ``compile_step`` must reproduce), optionally with ``torch.compile(model)`` as the forward.
* :class:`HostSyncCounter`: counts the ATen calls through which a tensor value reaches the host
  (``.item()``, ``float(t)``, ``bool(t)``...), seen by the profiler, i.e. at the dispatcher: it
  sees them in eager code and in compiled code alike (a ``TorchDispatchMode`` would not: Dynamo
  and AOTAutograd treat an active mode as part of what they trace).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

__all__ = ["eager_amp_step", "HostSyncCounter", "HOST_READ_OPS"]

# Every host read of a tensor value dispatches to one of these (.item() -> _local_scalar_dense;
# bool(t) / `if t:` -> is_nonzero). On CUDA each is a device synchronisation.
HOST_READ_OPS = frozenset({"aten::_local_scalar_dense", "aten::item", "aten::is_nonzero"})


class HostSyncCounter:
    """Context manager counting host reads of tensor values (see module docstring).

    ``count``: host reads made by the code under test (Python or a compiled graph), outermost
    calls only (``aten::item`` calls ``aten::_local_scalar_dense``; that pair counts once);
    ``names`` what they were.

    ``collectives``: gloo/NCCL collectives seen in the same window, by profiler event name
    (``"gloo:all_reduce"``...), for tests and benchmarks that count them per step.

    ``in_cpu_kernels``: reads made *inside* another ATen op's implementation, such as the CPU
    kernel of ``_fused_adam_`` reading its own CPU step counter with ``item<float>()``
    (``in_kernel_names``: each read and the innermost op it was made in). That is a CPU kernel
    reading CPU memory, not a device synchronisation: the CUDA kernel of the same op reads the
    step counter on the device. They are counted apart so that the distinction is visible
    instead of hidden.
    """

    def __init__(self) -> None:
        self.count = 0
        self.names: list[str] = []
        self.in_cpu_kernels = 0
        self.in_kernel_names: list[str] = []  # the op each such read was made in (the innermost)
        self.collectives: Counter[str] = Counter()
        self._prof: profile | None = None

    def __enter__(self) -> HostSyncCounter:
        self._prof = profile(activities=[ProfilerActivity.CPU])
        self._prof.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        assert self._prof is not None
        self._prof.__exit__(*exc)
        # The raw events (name, interval, thread): prof.events() would build an object and a
        # tree for every event, seconds for a training step's thousands of ops.
        assert self._prof.profiler is not None and self._prof.profiler.kineto_results is not None  # after __exit__
        all_events = [
            (e.name(), e.start_ns(), e.end_ns(), e.start_thread_id())
            for e in self._prof.profiler.kineto_results.events()
        ]
        self.collectives.update(name for name, *_ in all_events if name.startswith(("gloo:", "nccl:")))
        kernels = [e for e in all_events if e[0].startswith("aten::") and e[0] not in HOST_READ_OPS]
        events = [e for e in all_events if e[0] in HOST_READ_OPS]
        # An item() contains its _local_scalar_dense: count intervals not nested in another read.
        events.sort(key=lambda e: (e[1], -e[2]))
        outer_end = -1
        for name, start, end, thread in events:
            if start < outer_end:
                continue
            outer_end = end
            around = [
                (k_end - k_start, k_name)
                for k_name, k_start, k_end, k_thread in kernels
                if k_start <= start and end <= k_end and k_thread == thread
            ]
            if around:
                self.in_cpu_kernels += 1
                self.in_kernel_names.append(f"{name} in {min(around)[1]}")
            else:
                self.count += 1
                self.names.append(name)


def eager_amp_step(
    model: Callable[..., torch.Tensor],
    optimizer: torch.optim.Optimizer,
    loss_fn: Callable[..., torch.Tensor],
    scaler: torch.amp.GradScaler,
    *,
    dtype: torch.dtype,
    accumulate: int = 1,
    max_grad_norm: float | None = None,
    params: Sequence[torch.Tensor] | None = None,
) -> Callable[..., torch.Tensor]:
    """torch's AMP recipe as a step function with ``compile_step``'s calling convention.

    Per call: ``with torch.autocast: loss = loss_fn(model(x), *targets) [/ accumulate]``,
    ``scaler.scale(loss).backward()``; every ``accumulate`` calls ``[unscale_, clip_grad_norm_]``,
    ``scaler.step``, ``scaler.update``, ``zero_grad``. Returns the undivided loss, detached.
    Keyword arguments go to the model, as ``compile_step``'s do: ``step(**batch)`` runs
    ``loss_fn(model(**batch))`` (a Hugging Face model given ``labels``, ``loss_fn=lambda o: o.loss``).
    """
    device_type = "cuda" if any(p.is_cuda for g in optimizer.param_groups for p in g["params"]) else "cpu"
    clip_params = list(params) if params is not None else [p for g in optimizer.param_groups for p in g["params"]]
    calls = [0]

    def step(*batch: Any, **model_kwargs: Any) -> torch.Tensor:
        with torch.autocast(device_type, dtype=dtype):
            loss = loss_fn(model(*batch[:1], **model_kwargs), *batch[1:])
            scaled = loss / accumulate if accumulate > 1 else loss
        scaler.scale(scaled).backward()
        calls[0] += 1
        if calls[0] % accumulate == 0:
            if max_grad_norm is not None:
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(clip_params, max_grad_norm)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
        return loss.detach()

    return step
