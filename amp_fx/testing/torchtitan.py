"""torchtitan's Llama 3 ``debugmodel`` on the CPU, for the tests and the benchmark (imports torchtitan).

torchtitan 0.3.0 runs its models and ``parallelize_llama`` on the CPU programmatically, as its own
CPU unit tests do; :func:`cpu_debugmodel` makes the same adjustments, each for a reason:

* ``device_type`` is "cpu" in ``torchtitan.tools.utils``, ``distributed.parallel_dims`` and
  ``distributed.utils`` (torchtitan picks "cuda" when it finds no accelerator);
* every layer's attention is ``ScaledDotProductAttention`` (FlexAttention has no CPU backward);
* the llama3 sharding config is set directly (``set_llama3_sharding_config``;
  ``Config.update_from_config`` imports the trainer, and with it tensorboard);
* ``spmd_backend="partial_dtensor"`` (0.3.0's default, "spmd_types", fails with torch 2.13's
  ``fully_shard`` beyond one rank: it targets a nightly torch);
* FSDP2's gradient reduction is a plain SUM: torchtitan sets the divide factor to 1.0 (its
  trainer scales by the global token count), which makes FSDP2 use PREMUL_SUM, which gloo lacks.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["TITAN_VOCAB", "cpu_debugmodel", "parallel_dims", "trainer_config_fields"]

TITAN_VOCAB = 2048  # the debugmodel's vocabulary


def _cpu_device_type() -> None:
    import torchtitan.distributed.parallel_dims as parallel_dims_module
    import torchtitan.distributed.utils as dist_utils
    import torchtitan.tools.utils as tools_utils

    for module in (tools_utils, parallel_dims_module, dist_utils):
        module.device_type = "cpu"


def parallel_dims(*, tp: int = 1, dp_shard: int = 1) -> tuple[Any, Any]:
    """torchtitan's ``(ParallelismConfig, ParallelDims)`` for ``tp`` x ``dp_shard`` over the default group."""
    _cpu_device_type()
    from torchtitan.config import ParallelismConfig
    from torchtitan.distributed import ParallelDims

    config = ParallelismConfig(tensor_parallel_degree=tp, data_parallel_shard_degree=dp_shard,
                               spmd_backend="partial_dtensor")
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    return config, ParallelDims.from_config(config, world)


def cpu_debugmodel(*, tp: int = 1, dp_shard: int = 1, n_layers: int = 2, param_dtype: str = "float32",
                   parallelize_fn: Callable[..., torch.nn.Module] | None = None, seed: int = 0,
                   model_dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """torchtitan's Llama 3 debugmodel (dim 256, 16 heads, vocabulary 2048) with ``n_layers`` layers,
    built on meta, parallelized by ``parallelize_fn`` (default: torchtitan's ``parallelize_llama``)
    with ``training.mixed_precision_param=param_dtype``, then materialized on the CPU and
    initialized with torch's generator seeded by ``seed`` (the same weights on every rank)."""
    from torch.distributed.fsdp import FSDPModule
    from torchtitan.config import CompileConfig, TrainingConfig
    from torchtitan.models.common import ScaledDotProductAttention
    from torchtitan.models.llama3 import llama3_configs, parallelize_llama
    from torchtitan.models.llama3.sharding import set_llama3_sharding_config

    parallelism, dims = parallel_dims(tp=tp, dp_shard=dp_shard)
    config = llama3_configs["debugmodel"](attn_backend="flex")
    config.layers = config.layers[:n_layers]
    for layer in config.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    set_llama3_sharding_config(config, enable_sp=parallelism.enable_sequence_parallel)
    with torch.device("meta"):
        model = config.build()
    parallelize_fn = parallelize_llama if parallelize_fn is None else parallelize_fn
    model = parallelize_fn(model, parallel_dims=dims, training=TrainingConfig(mixed_precision_param=param_dtype),
                           parallelism=parallelism, compile_config=CompileConfig(), ac_config=None,
                           dump_folder="")
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM (module docstring)
    model.to_empty(device="cpu")
    torch.manual_seed(seed)
    with torch.no_grad():
        model.init_states(buffer_device=None)  # type: ignore[operator]  # torchtitan's model; parallelize_fn returns it as nn.Module
    if model_dtype != torch.float32:
        model.to(model_dtype)
    return model


def trainer_config_fields() -> Any:
    """The fields of torchtitan's ``Trainer.Config`` that ``with_amp_fx`` reads and writes, as
    ``llama3_debugmodel()`` sets them: the debugmodel's spec (``parallelize_fn=parallelize_llama``),
    a ``ChunkedLossWrapper`` loss and compile of the model and loss. ``Trainer.Config`` itself
    imports the trainer, and with it tensorboard, which the extra does not install."""
    from types import SimpleNamespace

    from torchtitan.components.loss import ChunkedLossWrapper
    from torchtitan.config import CompileConfig
    from torchtitan.models.llama3 import model_registry

    return SimpleNamespace(model_spec=model_registry("debugmodel"), loss=ChunkedLossWrapper.Config(),
                           compile=CompileConfig(enable=True, components=["model", "loss"]))
