"""Context parallelism with amp_fx, on the GPU: torch's ring attention (the recipe torchtitan uses for
SDPA, ``torchtitan.distributed.context_parallel.apply_cp_to_forward``) under amp_fx bf16, bitwise
with eager autocast under the same ring attention.

GPU-only: torch's context-parallel dispatcher has sharding rules for the CUDA SDPA kernels (flash,
efficient, cuDNN) only; on the CPU ``aten._scaled_dot_product_flash_attention_for_cpu`` has none,
and the math backend fails on the causal mask (DESIGN.md; docs/distributed.md, "Context
parallelism"). The recipe: ``_enable_context_parallel_dispatcher()`` once, the sequence of each
input sharded over the cp mesh (``_context_parallel_shard``), and the attention's q, k and v
wrapped as DTensors ``Shard(seq_dim)`` on that mesh around the SDPA call; amp_fx compiles the
model as usual. Two ranks: NCCL where the machine has two GPUs, else gloo with both ranks on the
one GPU (gloo moves CUDA tensors through the host: slow, but the values are the same).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from amp_fx.testing import assert_bitwise
from amp_fx.testing.distributed import run_ranks
from tests.cuda._gpu import GPU_TIER

pytestmark = GPU_TIER

B, S, D, H = 2, 256, 256, 4  # head dim 64: the flash kernel's; S split in 2 chunks of 128
SEQ_DIM = 2  # of q, k, v ([B, H, S, D / H])


class _Attention(nn.Module):
    """One causal self-attention block; ``cp_mesh`` set: q, k and v enter SDPA as DTensors sharded on
    the sequence over it (the ring attention), as torchtitan's ``apply_cp_to_forward`` wraps them."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(D, 3 * D)
        self.out = nn.Linear(D, D)
        self.cp_mesh: Any = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (t.unflatten(-1, (H, D // H)).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        if self.cp_mesh is not None:
            from torch.distributed.tensor import DTensor, Shard

            q, k, v = (DTensor.from_local(t, self.cp_mesh, [Shard(SEQ_DIM)], run_check=False) for t in (q, k, v))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        o = o.to_local() if hasattr(o, "to_local") else o
        return self.out(o.transpose(1, 2).flatten(2))


def _cp_rank(rank: int, world_size: int) -> dict[str, Any]:
    """On this rank's sequence chunk, ring attention: eager autocast bf16 and amp_fx bf16 (their
    outputs and gradients); and the whole sequence without CP under eager autocast, this rank's
    chunk of its output."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental._attention import (  # torchtitan's import path
        _context_parallel_shard,
        _enable_context_parallel_dispatcher,
    )

    import amp_fx

    torch.cuda.set_device(rank % torch.cuda.device_count())
    device = torch.device("cuda", torch.cuda.current_device())
    mesh = init_device_mesh("cuda", (world_size,), mesh_dim_names=("cp",))
    _enable_context_parallel_dispatcher()
    torch.manual_seed(0)
    model = _Attention().to(device)
    x = torch.randn(B, S, D, generator=torch.Generator().manual_seed(1)).to(device)
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        whole = model(x)
    (local_x,) = _context_parallel_shard(mesh, [x], [1])
    model.cp_mesh = mesh
    out: dict[str, Any] = {"whole_chunk": whole.chunk(world_size, dim=1)[rank].float().cpu()}
    for form in ("eager", "amp_fx"):
        model.zero_grad(set_to_none=True)
        if form == "eager":
            with torch.autocast("cuda", dtype=torch.bfloat16):
                y = model(local_x)
        else:
            y = amp_fx.compile(model, dtype="bf16", backend="aot_eager")(local_x)
        y.float().pow(2).mean().backward()
        out[form] = {
            "out": y.detach().float().cpu(),
            "grads": {n: p.grad.detach().cpu() for n, p in model.named_parameters()},
        }
    return out


def test_context_parallel_bf16_bitwise_with_eager_autocast() -> None:
    """amp_fx bf16 through torch's ring attention over 2 ranks against eager autocast through the
    same: each rank's output chunk and its local gradients (before any all-reduce) bit for bit. The
    ring is real: the output matches this chunk of the whole sequence's attention without CP
    within bf16 rounding (rtol 2^-6: one bf16 ulp of the output is 2^-8 relative; the ring merges
    2 partial attentions through their log-sum-exp, then the bf16 out projection rounds again),
    while rank 1's chunk attended to rank 0's keys (without the ring it would differ by O(1))."""
    two_gpus = torch.cuda.device_count() >= 2
    ranks = run_ranks(_cp_rank, backend="nccl" if two_gpus else "gloo", hide_cuda=False)
    for rank, res in enumerate(ranks):
        what = f"rank {rank}"
        assert_bitwise(res["amp_fx"]["out"], res["eager"]["out"], f"{what}: output")
        for name, want in res["eager"]["grads"].items():
            assert_bitwise(res["amp_fx"]["grads"][name], want, f"{what}: grad {name}")
        torch.testing.assert_close(res["eager"]["out"], res["whole_chunk"], rtol=2**-6, atol=2**-6)
