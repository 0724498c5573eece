"""amp_fx's fp8 on torchtitan's Llama 3 debugmodel against torchtitan's own float8 converter
(``Float8LinearConverter``: torchao's ``Float8Linear`` in every Linear), on 2 gloo ranks with
torchtitan's ``parallelize_llama`` at dp_shard 2 and tp 2 (tests/integrations/_dist_titan_cases.py's ``FP8_CASES``).

A file of its own: its spawn is the slowest of the torchtitan tests (the CPU's ``_scaled_mm``
reference kernel), and under ``-n 2`` it runs beside tests/integrations/test_torchtitan.py's spawns, not after
them.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("torchtitan", reason="needs torchtitan (pip install amp_fx[torchtitan]; torch >= 2.12)")

from amp_fx.testing import assert_bitwise  # noqa: E402
from amp_fx.testing.distributed import run_ranks  # noqa: E402
from amp_fx.testing.fp8_reference import torchao_missing  # noqa: E402
from tests.integrations._dist_titan_cases import FP8_CASES, titan_fp8  # noqa: E402

pytestmark = [
    pytest.mark.skipif(
        not (torch.distributed.is_available() and torch.distributed.is_gloo_available()),
        reason="needs torch.distributed with gloo",
    ),
    pytest.mark.skipif(torchao_missing() is not None, reason=f"torchtitan's float8 converter: {torchao_missing()}"),
    pytest.mark.slow,
]


@pytest.fixture(scope="module")
def fp8_ranks() -> list[dict]:
    return run_ranks(titan_fp8)


@pytest.mark.parametrize("case", FP8_CASES, ids=" ".join)
def test_fp8_bitwise_with_torchtitans_float8_converter(fp8_ranks, case):
    """amp_fx's fp8 on dp_shard 2 and tp 2 against torchtitan's own ``Float8LinearConverter`` (torchao's
    ``Float8Linear`` in every Linear) on the same model, mesh, weights and tokens: losses, every
    rank's local gradients at the 2nd AdamW step and the parameters after it, bit for bit. Both
    scale the same values (the bf16 operands) with the same recipe, so nothing less is right."""
    layout, recipe, param_dtype = case
    for rank, res in enumerate(fp8_ranks):
        got, want = res[(*case, "amp_fx")], res[(*case, "torchtitan")]
        what = f"rank {rank}, {layout}, {recipe}, mixed_precision_param={param_dtype}"
        assert "error" not in want, f"{what}: torchtitan's float8: {want.get('error')}"
        assert "error" not in got, f"{what}: {got.get('error')}"
        assert want["linear_types"] == ["FSDPFloat8Linear", "Float8Linear"], want["linear_types"]  # converted
        assert got["linear_types"] == ["FSDPLinear", "Linear"], got["linear_types"]
        # no fallback, no matmul left out of fp8, no report: on tp, the outputs of torchtitan's
        # SequenceParallel norms are cast to e4m3 per shard and all-gathered in fp8 (before, amp_fx
        # reported "all-gathered before its fp8 cast" there)
        assert got["amp_fx_warnings"] == [], got["amp_fx_warnings"]
        assert_bitwise(got["losses"], want["losses"], f"{what}: losses")
        assert set(got["grads"]) == set(want["grads"]), what
        for name in want["grads"]:
            assert_bitwise(got["grads"][name], want["grads"][name], f"{what}: grad {name}")
            assert_bitwise(got["params"][name], want["params"][name], f"{what}: {name}")
    losses = [res[(*case, "amp_fx")]["losses"] for res in fp8_ranks]
    assert torch.equal(losses[0], losses[1]) == (layout == "tp")  # dp: each rank its own tokens
