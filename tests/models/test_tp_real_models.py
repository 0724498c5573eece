"""The real-model tier under tensor parallelism: transformers' Llama on 2 gloo ranks, made
tensor-parallel by transformers itself (``from_pretrained(..., distributed_config=
DistributedConfig(tp_size=2))``) and by torch's ``parallelize_module`` on the plan transformers'
config states; all runs in one spawn (tests/distributed/_dist_tp_real_cases.py):

* ``amp_fx.compile`` (bf16, strict): losses and each rank's parameter shards bitwise with eager
  ``torch.autocast`` on the same tensor-parallel model, 3 SGD steps, both ways;
* ``amp_fx.compile_step`` (fp16, ``amp_fx.GradScaler``, strict): bitwise with eager autocast and
  ``amp_fx.GradScaler`` (bitwise with torch's on one device, tests/scaler/test_scaler.py). torch's own
  scalers cannot be the reference here: the norm weights are plain tensors beside DTensor
  gradients, and ``GradScaler``/``ShardedGradScaler`` refuse the mix ("got mixed torch.Tensor and
  DTensor");
* ``fp8="tensorwise"`` (strict): every matmul with a parameter converted, the DTensor-sharded
  projections included. Its numbers are not compared: the row-parallel layers add two partial sums
  each rounded to bf16 where the unsharded run rounds once, and torchao's float8 TP styles scale
  the fp32 input that amp_fx (as autocast) first casts to bf16; tests/distributed/test_distributed_tp.py proves
  fp8 under TP bitwise on a model where both scale the same values.
"""

from __future__ import annotations

import pytest
import torch

from amp_fx.testing import assert_bitwise
from amp_fx.testing.distributed import run_ranks
from amp_fx.testing.real_models import REAL_MODELS


def _transformers_tp_missing() -> str | None:
    missing = REAL_MODELS["hf_llama"].missing()
    if missing is not None:
        return missing
    import transformers

    if not hasattr(transformers, "DistributedConfig"):
        return f"transformers {transformers.__version__} has no DistributedConfig (its TP API before 5.18)"
    return None


pytestmark = [
    pytest.mark.models,
    pytest.mark.skipif(_transformers_tp_missing() is not None, reason=str(_transformers_tp_missing())),
    pytest.mark.skipif(
        not (torch.distributed.is_available() and torch.distributed.is_gloo_available()),
        reason="needs torch.distributed with gloo",
    ),
    pytest.mark.primary,
]


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    from tests.distributed._dist_tp_real_cases import tp_real

    return run_ranks(tp_real)


@pytest.mark.parametrize("how", ["hf", "torch", "fp16"])
def test_tensor_parallel_llama_bitwise_with_eager_autocast(ranks, how):
    for rank, res in enumerate(ranks):
        run, reference = res[(how, "amp_fx")], res[(how, "eager")]
        assert run["dtensor_params"] > 0 and run["dtensor_params"] == reference["dtensor_params"]
        assert run["amp_fx_warnings"] == [], f"rank {rank}: {run['amp_fx_warnings']}"
        assert_bitwise(run["losses"], reference["losses"], f"rank {rank}, {how}: losses")
        assert len(run["params"]) == len(reference["params"])
        for i, (p, q) in enumerate(zip(run["params"], reference["params"])):
            assert_bitwise(p, q, f"rank {rank}, {how}: parameter {i}'s shard")


def test_tensor_parallel_llama_weight_cache_bitwise_with_eager_autocast(ranks):
    """``weight_cache=True`` on torch's plan (bf16, strict, 3 SGD steps, one forward per step: each
    step's cast is of the updated weight): losses and each rank's parameter shards bit for bit with
    eager autocast, as without the cache."""
    for rank, res in enumerate(ranks):
        run, reference = res[("torch", "amp_fx_cache")], res[("torch", "eager")]
        assert run["amp_fx_warnings"] == [], f"rank {rank}: {run['amp_fx_warnings']}"
        assert_bitwise(run["losses"], reference["losses"], f"rank {rank}: losses")
        for i, (p, q) in enumerate(zip(run["params"], reference["params"], strict=True)):
            assert_bitwise(p, q, f"rank {rank}: parameter {i}'s shard")


def test_tensor_parallel_llama_watch_names_eager_autocasts_first_overflow(ranks):
    """fp16, ``layers.0.mlp.up_proj``'s weight shard scaled by 1e6 on torch's plan: the non-finite
    watch names the module eager autocast's forward hooks see overflow first, on every rank."""
    for rank, res in enumerate(ranks):
        run = res[("torch", "watch")]
        assert run["eager_first"] == "model.layers.0.mlp.up_proj", f"rank {rank}: {run}"
        assert run["watch_first"] == run["eager_first"], f"rank {rank}: {run}"


def test_tensor_parallel_llama_fp8_converts_every_matmul_with_a_parameter(ranks):
    for rank, res in enumerate(ranks):
        run = res[("fp8", "amp_fx")]
        assert run["amp_fx_warnings"] == [], f"rank {rank}: {run['amp_fx_warnings']}"
        fp8 = run["fp8"]
        # every nn.Linear (the projections, sharded, and the replicated lm_head) in forward
        assert fp8["considered"] >= fp8["linears"] > 0, fp8
        assert fp8["converted"] == fp8["considered"], fp8
        assert torch.isfinite(run["losses"]).all()
