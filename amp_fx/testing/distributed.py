"""Launch gloo ranks on one machine, for the distributed tests and benchmarks.

``run_ranks(fn, *args)`` starts ``world_size`` processes (``torch.multiprocessing.spawn``), each
joining a gloo process group on 127.0.0.1 at a free port, runs ``fn(rank, world_size, *args)``
and returns what each rank returned (anything ``torch.save`` can write), rank 0 first. An
exception in a rank is raised in the caller with that rank's traceback. ``backend=`` picks another
process-group backend: ``amp_fx.testing.memory.COUNTING_BACKEND`` is gloo with every collective's
bytes counted (``amp_fx.testing.memory.sent_bytes``).

The ranks run on the CPU: they start with no CUDA device visible (``CUDA_VISIBLE_DEVICES=""``).
Where one is, FSDP2's ``fully_shard`` without ``mesh=`` builds its mesh on the accelerator and
moves every rank's parameters onto it: on a machine with one GPU, both gloo ranks' parameters
went to ``cuda:0`` while their inputs stayed on the CPU. ``hide_cuda=False`` leaves the devices
visible, for ranks that put their tensors on them (the GPU tier's context parallelism).
"""

from __future__ import annotations

import contextlib
import os
import socket
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

__all__ = ["free_port", "one_rank", "run_ranks"]


@contextlib.contextmanager
def one_rank() -> Iterator[None]:
    """Inside: a gloo process group of one rank in this process (an in-memory store), for
    single-process tests of DTensor and FSDP2 code; one already initialized is used as it is
    (and left)."""
    import torch.distributed as dist

    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        if created:
            dist.destroy_process_group()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank_main(
    rank: int,
    world_size: int,
    port: int,
    out_dir: str,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    backend: str = "gloo",
) -> None:
    import torch.distributed as dist

    if backend != "gloo":
        import amp_fx.testing.memory  # noqa: F401 - registers the counting backend

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    # One thread per rank: the ranks share the machine's cores with each other.
    torch.set_num_threads(1)
    dist.init_process_group(backend, rank=rank, world_size=world_size)
    try:
        result = fn(rank, world_size, *args)
        torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def run_ranks(
    fn: Callable[..., Any], *args: Any, world_size: int = 2, backend: str = "gloo", hide_cuda: bool = True
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` ranks (gloo by default); their return
    values. ``hide_cuda``: the ranks see no CUDA device (module docstring)."""
    import torch.multiprocessing as mp

    hidden = os.environ.get("CUDA_VISIBLE_DEVICES")
    if hide_cuda:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # the children read it at start (module docstring)
    try:
        with tempfile.TemporaryDirectory() as out_dir:
            mp.spawn(
                _rank_main, args=(world_size, free_port(), out_dir, fn, args, backend), nprocs=world_size, join=True
            )
            return [torch.load(Path(out_dir) / f"rank{r}.pt", weights_only=False) for r in range(world_size)]
    finally:
        if hidden is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = hidden
