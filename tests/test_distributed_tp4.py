"""amp_fx on FSDP2 x TP with both dimensions sharded: 4 gloo ranks on a dp 2 x tp 2 mesh.

What only a 2 x 2 mesh shows (tests/test_distributed_tp.py's dp 1 x tp 2 mesh shards nothing over
dp): FSDP2 all-gathers and reduce-scatters each TP shard over dp, the gradients of two different
batches are averaged, and the found-inf flag and the global gradient norm span both dimensions.
The model and the recipe: tests/_dist_tp_cases.py; the cases: tests/_dist_tp4_cases.py. All cases
run in one spawn.
"""

from __future__ import annotations

import pytest
import torch
from _dist_tp4_cases import CASES, WORLD, tp4_all
from _dist_tp_cases import PLANTED_STEP

from amp_fx.testing import assert_bitwise
from amp_fx.testing.distributed import run_ranks
from tests._step_cases import ADAM_TRACED_RTOL

pytestmark = [
    pytest.mark.skipif(not (torch.distributed.is_available() and torch.distributed.is_gloo_available()),
                       reason="needs torch.distributed with gloo"),
    pytest.mark.slow,
]


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return run_ranks(tp4_all, world_size=WORLD)


def _name(case: tuple) -> str:
    return " ".join(case)


@pytest.mark.parametrize("case", [c for c in CASES if c[2] == "amp_fx"], ids=_name)
def test_2x2_compile_bitwise_with_eager_autocast(ranks, case):
    """amp_fx.compile (fp16: amp_fx.GradScaler against ShardedGradScaler): no AmpFxWarning; the
    losses, scales and every rank's local parameter shards after 3 AdamW steps, bit for bit; the
    two dp ranks saw different batches (their losses differ), so the check covers FSDP2's average."""
    layout, dtype, _ = case
    for rank, res in enumerate(ranks):
        got, want = res[case], res[(layout, dtype, "eager")]
        what = f"rank {rank}, {_name(case)}"
        assert got["amp_fx_warnings"] == [], what
        assert_bitwise(got["losses"], want["losses"], f"{what}: losses")
        assert_bitwise(got["scales"], want["scales"], f"{what}: scales")
        for name in want["params"]:
            assert_bitwise(got["params"][name], want["params"][name], f"{what}: {name}")
    assert not torch.equal(ranks[0][case]["losses"], ranks[WORLD - 1][case]["losses"])


@pytest.mark.parametrize("layout", ["fsdp_tp", "hsdp_tp"])
def test_2x2_fp16_every_rank_skips_the_planted_step(ranks, layout):
    """The inf is in rank 0's local shard only; all 4 ranks back off at that step."""
    forms = ("eager", "amp_fx", "step_clip") if layout == "fsdp_tp" else ("eager", "amp_fx")
    for form in forms:
        for rank, res in enumerate(ranks):
            scales = res[(layout, "fp16", form)]["scales"].tolist()
            assert scales[PLANTED_STEP] == scales[PLANTED_STEP - 1] / 2, f"rank {rank}, {form}: {scales}"


def test_2x2_compile_step_with_max_grad_norm_matches_eager_recipe(ranks):
    """compile_step fp16 with ``max_grad_norm`` against ``unscale_`` + the global norm over both
    dimensions clipped by hand (_dist_tp_cases._clip): losses and scales bitwise, the parameters
    within the traced Adam step's rounding (ADAM_TRACED_RTOL of each parameter's movement, the
    2-rank tests' bound: 3 AdamW steps at lr 1e-2, one skipped, move an element by at most 2e-2)."""
    for rank, res in enumerate(ranks):
        got, want = res[("fsdp_tp", "fp16", "step_clip")], res[("fsdp_tp", "fp16", "eager_clip")]
        assert got["amp_fx_warnings"] == [], f"rank {rank}"
        assert_bitwise(got["losses"], want["losses"], f"rank {rank}: losses")
        assert_bitwise(got["scales"], want["scales"], f"rank {rank}: scales")
        for name, e in want["params"].items():
            a = got["params"][name]
            bound = ADAM_TRACED_RTOL * 2 * 1e-2 + 2**-24 * e.abs()
            assert ((a - e).abs() <= bound).all(), f"rank {rank}, {name}: max diff {(a - e).abs().max()}"
