"""fp8 training under DDP and FSDP2: 2 gloo ranks on 127.0.0.1, bitwise with torchao's eager run.

Reference: torchao 0.18's ``convert_to_float8_training`` on the same model, wrapped the same way
(``DDP(model)``; FSDP2's ``fully_shard`` per Linear and at the root, all-gathering fp32 weights),
under ``torch.autocast("cpu", bf16)`` with torchao's autocast branch pointed at the CPU
(``amp_fx.testing.fp8_reference``). amp_fx: ``DDP(amp_fx.compile(m, fp8=...))`` (also with
``weight_cache=True``: the fp8 weight casts once per step), ``amp_fx.compile(DDP(m), fp8=...)``,
``amp_fx.compile`` of the FSDP2-sharded model, and ``compile_step`` of each wrapped model,
backend aot_eager. 4 SGD steps, each rank its own batch: every loss on every rank and every
parameter (FSDP2: each rank's shard) bitwise, both fp8
matmuls converted, nothing reported. All cases run in one spawn (tests/_dist_fp8_cases.py).
"""

from __future__ import annotations

import pytest
import torch
from _dist_fp8_cases import CASES, run_all

from amp_fx.kernels.fp8_matmul import rowwise_scales_missing
from amp_fx.testing import assert_bitwise
from amp_fx.testing.distributed import run_ranks
from amp_fx.testing.fp8_reference import torchao_missing

pytestmark = [
    pytest.mark.skipif(not (torch.distributed.is_available() and torch.distributed.is_gloo_available()),
                       reason="needs torch.distributed with gloo"),
    pytest.mark.skipif(torchao_missing() is not None, reason=str(torchao_missing())),
    pytest.mark.slow,  # one spawn of 2 gloo ranks runs every case of this file
]

# torch 2.11's CPU _scaled_mm takes per-tensor scales only: rowwise cannot run there (tests/test_fp8.py)
RECIPES = ["tensorwise"] + (["rowwise"] if rowwise_scales_missing("cpu") is None else [])


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return run_ranks(run_all, RECIPES)


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize(("wrapper", "form"), CASES)
def test_fp8_distributed_bitwise_with_torchao(ranks: list[dict], wrapper: str, form: str, recipe: str) -> None:
    for rank, results in enumerate(ranks):
        ours, ref = results[wrapper, form, recipe], results[wrapper, "torchao", recipe]
        assert_bitwise(ours["losses"], ref["losses"], f"rank {rank}: losses")
        assert_bitwise(ours["params"], ref["params"], f"rank {rank}: params")
        assert ours["converted"] == 2, f"rank {rank}: {ours['converted']} matmuls in fp8, expected both"
        assert not ours["warnings"], ours["warnings"]


def test_ranks_saw_different_batches(ranks: list[dict]) -> None:
    """The runs are distributed ones: the ranks' losses differ (each its own batch), so the
    gradient all-reduce (or reduce-scatter) is what keeps the parameters equal."""
    key = ("ddp", "torchao", RECIPES[0])
    assert not torch.equal(ranks[0][key]["losses"], ranks[1][key]["losses"])
    assert_bitwise(ranks[0][key]["params"], ranks[1][key]["params"], "DDP keeps the ranks' parameters equal")
