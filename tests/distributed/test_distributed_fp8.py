"""fp8 training under DDP and FSDP2: 2 gloo ranks on 127.0.0.1, bitwise with torchao's eager run.

Reference: torchao 0.18's ``convert_to_float8_training`` on the same model, wrapped the same way
(``DDP(model)``; FSDP2's ``fully_shard`` on the first Linear and at the root, which owns the
second, all-gathering fp32 weights),
under ``torch.autocast("cpu", bf16)`` with torchao's autocast branch pointed at the CPU
(``amp_fx.testing.fp8_reference``). amp_fx: ``DDP(amp_fx.compile(m, fp8=...))`` (also with
``weight_cache=True``: the fp8 weight casts once per step), ``amp_fx.compile(DDP(m), fp8=...)``,
``amp_fx.compile`` of the FSDP2-sharded model, and ``compile_step`` of each wrapped model,
backend aot_eager. 4 SGD steps, each rank its own batch: every loss on every rank and every
parameter (FSDP2: each rank's shard) bitwise, both fp8
matmuls converted, nothing reported. All cases run in one spawn (tests/distributed/_dist_fp8_cases.py).

FSDP2's fp8 all-gather (amp_fx/_dist/fp8_gather.py): amp_fx's FSDP2 runs are also bitwise with
torchao's ``enable_fsdp_float8_all_gather=True`` run, and gather as many bytes as it does.
"""

from __future__ import annotations

import pytest
import torch

from amp_fx.kernels.fp8_support import rowwise_scales_missing
from amp_fx.testing import assert_bitwise
from amp_fx.testing.distributed import run_ranks
from amp_fx.testing.fp8_reference import torchao_missing
from amp_fx.testing.memory import COUNTING_BACKEND
from tests.distributed._dist_fp8_cases import CASES, ROWWISE_CASES, run_all

pytestmark = [
    pytest.mark.skipif(
        not (torch.distributed.is_available() and torch.distributed.is_gloo_available()),
        reason="needs torch.distributed with gloo",
    ),
    pytest.mark.skipif(torchao_missing() is not None, reason=str(torchao_missing())),
    pytest.mark.slow,  # one spawn of 2 gloo ranks runs every case of this file
]

# torch 2.11's CPU _scaled_mm takes per-tensor scales only: rowwise cannot run there (tests/fp8/)
RECIPES = ["tensorwise"] + (["rowwise"] if rowwise_scales_missing("cpu") is None else [])


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return run_ranks(run_all, RECIPES, backend=COUNTING_BACKEND)


@pytest.mark.parametrize(
    ("wrapper", "form", "recipe"),
    [(w, f, r) for r in RECIPES for w, f in (CASES if r == "tensorwise" else ROWWISE_CASES)],
)
def test_fp8_distributed_bitwise_with_torchao(ranks: list[dict], wrapper: str, form: str, recipe: str) -> None:
    for rank, results in enumerate(ranks):
        ours, ref = results[wrapper, form, recipe], results[wrapper, "torchao", recipe]
        assert_bitwise(ours["losses"], ref["losses"], f"rank {rank}: losses")
        assert_bitwise(ours["params"], ref["params"], f"rank {rank}: params")
        assert ours["converted"] == 2, f"rank {rank}: {ours['converted']} matmuls in fp8, expected both"
        assert not ours["warnings"], ours["warnings"]
        if wrapper == "fsdp2" and recipe == "tensorwise":  # torchao gathering its weights in fp8
            ag = results["fsdp2", "torchao_ag", recipe]
            assert_bitwise(ours["losses"], ag["losses"], f"rank {rank}: losses, torchao's fp8 all-gather")
            assert_bitwise(ours["params"], ag["params"], f"rank {rank}: params, torchao's fp8 all-gather")


# Elements all-gathered per step, whole model (each rank hands FSDP2 its half): the first Linear's
# weight and bias in the forward and again in the backward, the root's (the second Linear's) once:
# FSDP2 keeps the root gathered from the forward to the backward.
GATHERED = {"0.weight": 2 * 2048, "0.bias": 2 * 64, "2.weight": 2048, "2.bias": 32}


def _gathered_bytes(fp8: set[str]) -> int:
    return sum(n * (1 if name in fp8 else 4) for name, n in GATHERED.items())


@pytest.mark.parametrize("form", ["outer", "step", "outer_keep", "map_keep"])
def test_fsdp2_fp8_all_gather_bytes(ranks: list[dict], form: str) -> None:
    """Bytes all-gathered per step (each rank's shards, counted in the process group): the two
    fp8 weights go as 1 byte per element instead of 4, the biases stay fp32 (``GATHERED``):
    6784 / 25216 = 0.269 of the bf16 run's, which gathers fp32 weights. The second Linear is the
    root's own (``_shard``), outside any graph of the root's frame, which Dynamo skips: amp_fx
    compiles it as a unit of its own, so it runs in fp8 and is gathered in fp8, as torchao's
    ``Float8Linear`` is. Exactly torchao's fp8 all-gather's bytes, and (``amp_fx.compile``) its one
    all-reduce of the scales per step (``compile_step`` adds its own: the found-inf flag's).

    Negative twin, "outer_keep": ``Policy(keep_out_of_fp8=["2"])`` keeps the second Linear's
    2048-element weight in fp32 all the way, the all-gather included; "map_keep": the per-module
    low-precision map ``{"2": None}`` does the same, bitwise with "outer_keep"."""
    fp8 = {"0.weight"} if form in ("outer_keep", "map_keep") else {"0.weight", "2.weight"}
    for rank, results in enumerate(ranks):
        ours, ao = results["fsdp2", form, "tensorwise"]["sent"], results["fsdp2", "torchao_ag", "tensorwise"]["sent"]
        bf16 = results["fsdp2", "bf16", None]["sent"]
        assert bf16["all_gather"] == _gathered_bytes(set()) / 2, (rank, bf16)
        assert ours["all_gather"] == _gathered_bytes(fp8) / 2, (rank, ours, bf16)
        if form in ("outer_keep", "map_keep"):
            keep = results["fsdp2", form, "tensorwise"]
            assert keep["converted"] == 1 and not keep["warnings"], keep
        if form == "map_keep":
            policy = results["fsdp2", "outer_keep", "tensorwise"]
            assert_bitwise(keep["losses"], policy["losses"], f"rank {rank}: losses, map against policy")
            assert_bitwise(keep["params"], policy["params"], f"rank {rank}: params, map against policy")
        if form == "outer":
            assert ours["all_gather"] == ao["all_gather"], (rank, ours, ao)
            assert ours["all_reduce"] == ao["all_reduce"], (rank, ours, ao)
        if form == "step":  # the scales' all-reduce (2 fp32 amaxes), then the found-inf one: the flag
            # and one non-finite flag per gradient (4 parameters), int64 (pack_overflow)
            assert ours["all_reduce"] == ao["all_reduce"] + 8 * (1 + 4) == 4 * 2 + 40, (rank, ours, ao)


def test_fsdp2_fp8_all_gather_reports_other_reads(ranks: list[dict]) -> None:
    """A weight gathered in fp8 that the model also reads outside the fp8 matmul (``w.abs()``):
    that read sees the fp8 weight, which amp_fx records and says once, naming the read and the fix."""
    for results in ranks:
        r = results["reads_weight"]
        assert r["reads"] == ["lin.weight by aten.abs.default in the root"], r
        assert len(r["warnings"]) == 1 and "lin.weight by aten.abs.default" in r["warnings"][0], r
        assert "keep_out_of_fp8" in r["warnings"][0], r


def test_fsdp2_fp8_all_gather_reports_eager_reads(ranks: list[dict]) -> None:
    """A root's own Linear, gathered in fp8, whose weight the root's eager frame (skipped by
    Dynamo) also reads: no graph sees that read, the fp8 weight's dispatch does, and it is said
    once, naming the op and the fix."""
    for results in ranks:
        w = results["root_reads_head"]
        assert len(w) == 1 and "a weight by aten.abs.default outside any compiled graph" in w[0], w
        assert "head.weight" in w[0] and "keep_out_of_fp8" in w[0], w


def test_fsdp2_fp8_all_gather_reports_fp32_weight(ranks: list[dict]) -> None:
    """An fp8 matmul's weight FSDP2 must gather in fp32 (shared by two Linears) is said once,
    naming the parameter and why, where it used to be said at debug level only."""
    for results in ranks:
        w = [m for m in results["shared_weight"] if "all-gathers" in m]
        assert len(w) == 1 and "0.weight (shared by several modules) in fp32" in w[0], results["shared_weight"]
        assert "strict=True" in w[0], w


def test_fsdp2_fp8_all_gather_checkpoint_resumes_bitwise_through_dcp(ranks: list[dict]) -> None:
    """``torch.distributed.checkpoint`` of the sharded model and AdamW after two steps (issue 52;
    torchao's fp8 tensor subclasses break such checkpoints, torchtitan #651): every entry a DTensor
    over a plain tensor with none of the extension's attributes, the rank's ``model.state_dict()``
    loads with ``torch.load(weights_only=True)``, and a fresh sharded model that loads the
    checkpoint takes the third step as the run that did not stop (loss, each rank's parameter
    shards and AdamW state bitwise), still gathering its weights in fp8 (``GATHERED``: the step's
    bytes are the fp8 run's)."""
    for rank, results in enumerate(ranks):
        r = results["dcp_resume"]
        assert r["leaks"] == [], (rank, r["leaks"])
        assert_bitwise(r["resumed"], r["continued"], f"rank {rank}: step 3 after loading the checkpoint")
        assert r["all_gather"] == _gathered_bytes({"0.weight", "2.weight"}) / 2, (rank, r["all_gather"])


def test_ranks_saw_different_batches(ranks: list[dict]) -> None:
    """The runs are distributed ones: the ranks' losses differ (each its own batch), so the
    gradient all-reduce (or reduce-scatter) is what keeps the parameters equal."""
    key = ("ddp", "torchao", RECIPES[0])
    assert not torch.equal(ranks[0][key]["losses"], ranks[1][key]["losses"])
    assert_bitwise(ranks[0][key]["params"], ranks[1][key]["params"], "DDP keeps the ranks' parameters equal")
