"""The gloo ranks of the distributed tests on a machine with a GPU (amp_fx.testing.run_ranks).

On an H200 (bench/results/2026-11-27-h200, run 5) the FSDP2 real-model test, which passes on the
CPU machines with the same torch and transformers, failed: ``fully_shard`` without ``mesh=``
builds its mesh on the accelerator, so both gloo ranks' parameters went to ``cuda:0`` while their
inputs and references stayed on the CPU. ``run_ranks`` now starts its ranks with no CUDA device
visible.
"""

from __future__ import annotations

import torch

from amp_fx.testing.distributed import run_ranks
from tests.cuda._gpu import GPU_TIER

pytestmark = GPU_TIER


def _fsdp2_default_device(rank: int, world_size: int) -> tuple[str, int]:
    from torch.distributed.fsdp import fully_shard

    model = fully_shard(torch.nn.Linear(4, 4))
    return next(model.parameters()).device.type, torch.cuda.device_count()


def test_gloo_ranks_see_no_gpu_and_fsdp2_shards_on_the_cpu() -> None:
    assert torch.cuda.device_count() > 0  # the tier's machine: the parent sees the GPU
    assert run_ranks(_fsdp2_default_device) == [("cpu", 0), ("cpu", 0)]
    assert torch.cuda.device_count() > 0  # and still does
