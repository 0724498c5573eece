"""The "used on both sides of a graph break" report under DDP: 2 gloo ranks on 127.0.0.1.

Dynamo's DDPOptimizer cuts each captured graph at DDP's bucket boundaries and compiles the
pieces one by one, on fake tensors, under one compile id. A weight used in two pieces (or on both
sides of a graph break) is cast by each, so its gradient contributions add up in fp32 instead of
bf16: not bitwise with eager DDP + autocast. amp_fx must say so (an AmpFxError in strict mode)
for ``amp_fx.compile(DDP(m))``, ``DDP(amp_fx.compile(m))`` and ``compile_step(DDP(m))``, and
must not when ``weight_cache=True`` shares one cast (bitwise) or no weight is used twice.
Cases: ``_dist_split_report_cases.split_report_all`` (one spawn).
"""

from __future__ import annotations

import pytest
import torch

from amp_fx.testing.distributed import run_ranks
from tests.distributed._dist_asserts import assert_same_run
from tests.distributed._dist_split_report_cases import FORMS

# slow: one spawn of 2 gloo ranks runs every case of this file (tests/distributed/test_distributed_ddp.py is
# the distributed file of the inner loop)
pytestmark = [
    pytest.mark.skipif(
        not (torch.distributed.is_available() and torch.distributed.is_gloo_available()),
        reason="needs torch.distributed with gloo",
    ),
    pytest.mark.slow,
]

SPLIT = "is used in two of the graphs Dynamo's DDPOptimizer splits"
BREAK = "is used on both sides of a graph break"


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    from tests.distributed._dist_split_report_cases import split_report_all

    return run_ranks(split_report_all)


@pytest.mark.parametrize("form", FORMS)
def test_weight_in_two_ddp_pieces_is_reported_and_not_bitwise(ranks, form):
    """fc is used twice in one frame and DDPOptimizer puts the uses in two pieces: its weight and
    bias are reported (named under the compiled root), and the run leaves eager's trajectory in
    fc's gradients only."""
    prefix = "" if form == "inner" else "module."  # names under the module given to amp_fx
    for rank, res in enumerate(ranks):
        got, want = res[("buckets", form, False)], res[("eager", "buckets")]
        assert got["graphs"] >= 3, "DDPOptimizer did not split the graph: the case tests nothing"
        reported = sorted(w.split(" ")[1] for w in got["warnings"] if SPLIT in w)
        assert reported == [f"{prefix}fc.bias", f"{prefix}fc.weight"], got["warnings"]
        assert len(got["warnings"]) == 2, got["warnings"]
        fc_weight, fc_bias, *others = got["params"]
        assert not torch.equal(fc_weight, want["params"][0]), f"rank {rank}: fc.weight bitwise"
        assert not torch.equal(fc_bias, want["params"][1]), f"rank {rank}: fc.bias bitwise"
        assert_same_run({"params": others}, {"params": want["params"][2:]}, f"rank {rank}, {form}")


def test_weight_in_two_ddp_pieces_is_an_error_in_strict_mode(ranks):
    for res in ranks:
        error = res[("buckets", "outer", "strict")].get("error", "")
        assert "module.fc." in error and SPLIT in error and "weight_cache=True" in error, error


@pytest.mark.parametrize("form", FORMS)
def test_weight_cache_shares_the_cast_across_ddp_pieces_bitwise_and_unreported(ranks, form):
    """Positive twin: with weight_cache=True every piece reads one cast per weight; strict, so a
    report would have stopped the run; bitwise with eager."""
    for rank, res in enumerate(ranks):
        got = res[("buckets", form, True)]
        assert "error" not in got and got["warnings"] == []
        assert got["graphs"] >= 3
        assert_same_run(got, res[("eager", "buckets")], f"rank {rank}, {form}", keys=("losses", "scales", "params"))


def test_weight_across_a_graph_break_under_ddp_is_reported(ranks):
    """A weight on both sides of a graph break, each side split again by DDPOptimizer: the
    pieces hand fake tensors, yet the weight is found and reported as split by the break."""
    for rank, res in enumerate(ranks):
        got, want = res[("break", "outer", False)], res[("eager", "break")]
        assert got["graphs"] >= 3
        assert any(w.startswith("amp_fx: module.fc.weight " + BREAK) for w in got["warnings"]), got["warnings"]
        assert not torch.equal(got["params"][0], want["params"][0]), f"rank {rank}: fc.weight bitwise"


@pytest.mark.parametrize("form", FORMS)
def test_no_report_for_ddp_pieces_without_a_shared_weight(ranks, form):
    """Negative twin: a model that uses each weight once, split into pieces (fake tensors, one
    compile id), strict and without the cache: nothing reported, bitwise with eager."""
    for rank, res in enumerate(ranks):
        got = res[("plain", form, False)]
        assert "error" not in got, got["error"]
        assert got["graphs"] >= 2
        assert_same_run(got, res[("eager", "plain")], f"rank {rank}, {form}", keys=("losses", "scales", "params"))
