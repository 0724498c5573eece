"""amp_fx as torchtitan's mixed precision: torchtitan's Llama 3 debugmodel under its own
``parallelize_llama`` on 2 gloo ranks, bitwise with eager autocast (tests/_dist_titan_cases.py).

Before the fixes in ``amp_fx/_dist/capture.py`` the tp cases failed: amp_fx's FSDP2 unit capture
called ``type(module).forward`` and skipped the per-instance forward torchtitan installs for TP
redistribution ("TorchRuntimeError ... rms_norm": a plain tensor beside a DTensor weight); with
that called, the units' shared compiled forward turned dynamic (automatic dynamic shapes across
units of different signatures) and amp_fx could not fakify a DTensor with symbolic sizes.
torchtitan always applies ``fully_shard`` (a no-op all-gather at dp_shard=1), so tp=2 alone runs
through the unit capture too.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("torchtitan", reason="needs torchtitan (pip install amp_fx[torchtitan]; torch >= 2.12)")

from _dist_titan_cases import CASES, titan_all  # noqa: E402

from amp_fx.testing import assert_bitwise  # noqa: E402
from amp_fx.testing.distributed import run_ranks  # noqa: E402

pytestmark = [
    pytest.mark.skipif(not (torch.distributed.is_available() and torch.distributed.is_gloo_available()),
                       reason="needs torch.distributed with gloo"),
    pytest.mark.slow,
]


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return run_ranks(titan_all)


def _name(case: tuple) -> str:
    return " ".join(case)


@pytest.mark.parametrize("case", [c for c in CASES if c[2] == "amp_fx"], ids=_name)
def test_torchtitan_parallelize_llama_bitwise_with_eager_autocast(ranks, case):
    """Losses, scales, every rank's local gradients at the 3rd step and parameters after it, bit
    for bit; no amp_fx warning (a fallback to torch.compile + autocast would warn)."""
    layout, dtype, _ = case
    for rank, res in enumerate(ranks):
        got, want = res[case], res[(layout, dtype, "eager")]
        what = f"rank {rank}, {_name(case)}"
        assert "error" not in want, f"{what}: eager reference: {want.get('error')}"
        assert "error" not in got, f"{what}: {got.get('error')}"
        assert got["amp_fx_warnings"] == [], what
        assert_bitwise(got["losses"], want["losses"], f"{what}: losses")
        assert_bitwise(got["scales"], want["scales"], f"{what}: scales")
        assert set(got["grads"]) == set(want["grads"]), what
        for name in want["grads"]:
            assert_bitwise(got["grads"][name], want["grads"][name], f"{what}: grad {name}")
            assert_bitwise(got["params"][name], want["params"][name], f"{what}: {name}")


def test_torchtitan_cases_train(ranks):
    """The comparison is not vacuous: the loss moves over the 3 steps, every parameter has a
    gradient, and the tp ranks hold different shards."""
    for res in ranks:
        for case in CASES:
            assert "error" not in res[case], f"{_name(case)}: {res[case].get('error')}"
            losses = res[case]["losses"]
            assert losses[0] != losses[-1], _name(case)
    tp0, tp1 = ranks[0][("tp", "bf16", "amp_fx")], ranks[1][("tp", "bf16", "amp_fx")]
    name = "layers.0.attention.wo.weight" if "layers.0.attention.wo.weight" in tp0["grads"] else next(
        n for n in tp0["grads"] if n.endswith("wo.weight"))
    assert not torch.equal(tp0["params"][name], tp1["params"][name])
