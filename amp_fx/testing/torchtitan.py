"""torchtitan's Llama 3 ``debugmodel`` on the CPU, for the tests and the benchmark (imports torchtitan).

torchtitan 0.3.0 runs its models and ``parallelize_llama`` on the CPU programmatically, as its own
CPU unit tests do; :func:`cpu_debugmodel` makes the same adjustments, each for a reason:

* ``device_type`` is "cpu" in ``torchtitan.tools.utils``, ``distributed.parallel_dims`` and
  ``distributed.utils`` (torchtitan picks "cuda" when it finds no accelerator);
* every layer's attention is ``ScaledDotProductAttention`` (FlexAttention has no CPU backward);
* the llama3 sharding config is set directly (``set_llama3_sharding_config``;
  ``Config.update_from_config`` imports the trainer, and with it tensorboard);
* ``spmd_backend="partial_dtensor"`` (0.3.0's default, "spmd_types", fails with torch 2.13's
  ``fully_shard`` beyond one rank: it targets a nightly torch), set globally as the Trainer does
  (``set_spmd_backend``: the MoE token dispatcher reads it at run time);
* FSDP2's gradient reduction is a plain SUM: torchtitan sets the divide factor to 1.0 (its
  trainer scales by the global token count), which makes FSDP2 use PREMUL_SUM, which gloo lacks;
* torchtitan's float8 converter is let through its hardware check (``has_cuda_capability``
  answers True in ``components.quantization.float8``): it refuses anything older than an SM89 GPU
  unless ``emulate=True``, which replaces the recipe by torchao's emulated tensorwise one, while
  torchao's ``Float8Linear`` runs the real ``torch._scaled_mm`` on the CPU (rowwise included).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = [
    "TITAN_VOCAB",
    "cpu_debugmodel",
    "cpu_qwen3_moe",
    "low_precision_experts",
    "parallel_dims",
    "stand_in_for_trainer_extras",
    "trainer_config_fields",
]

TITAN_VOCAB = 2048  # the debugmodel's vocabulary


def _cpu_device_type() -> None:
    import torchtitan.distributed.parallel_dims as parallel_dims_module
    import torchtitan.distributed.utils as dist_utils
    import torchtitan.tools.utils as tools_utils

    for module in (tools_utils, parallel_dims_module, dist_utils):
        module.device_type = "cpu"


def _float8_on_cpu() -> None:
    import torchtitan.components.quantization.float8 as float8

    float8.has_cuda_capability = lambda major, minor: True  # module docstring


def parallel_dims(*, tp: int = 1, dp_shard: int = 1, ep: int = 1) -> tuple[Any, Any]:
    """torchtitan's ``(ParallelismConfig, ParallelDims)`` for ``tp`` x ``dp_shard`` over the default
    group; ``ep`` experts' ranks borrowed from ``dp_shard`` x ``tp`` (torchtitan's sparse mesh
    ``efsdp`` x ``ep``, ``efsdp = dp_shard * tp / ep``)."""
    _cpu_device_type()
    import torchtitan.distributed.utils as dist_utils
    from torchtitan.config import ParallelismConfig
    from torchtitan.distributed import ParallelDims

    config = ParallelismConfig(
        tensor_parallel_degree=tp,
        data_parallel_shard_degree=dp_shard,
        expert_parallel_degree=ep,
        spmd_backend="partial_dtensor",
    )
    dist_utils.set_spmd_backend(config.spmd_backend)  # what torchtitan's Trainer does; the dispatcher reads it
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    return config, ParallelDims.from_config(config, world)


def cpu_debugmodel(
    *,
    tp: int = 1,
    dp_shard: int = 1,
    n_layers: int = 2,
    param_dtype: str = "float32",
    parallelize_fn: Callable[..., torch.nn.Module] | None = None,
    seed: int = 0,
    model_dtype: torch.dtype = torch.float32,
    float8_recipe: str | None = None,
) -> torch.nn.Module:
    """torchtitan's Llama 3 debugmodel (dim 256, 16 heads, vocabulary 2048) with ``n_layers`` layers,
    built on meta, parallelized by ``parallelize_fn`` (default: torchtitan's ``parallelize_llama``)
    with ``training.mixed_precision_param=param_dtype``, then materialized on the CPU and
    initialized with torch's generator seeded by ``seed`` (the same weights on every rank).

    ``float8_recipe``: the model config first converted by torchtitan's own
    ``Float8LinearConverter`` with that recipe ("rowwise", "rowwise_with_gw_hp"), as
    ``model_registry(..., converters=[...])`` does: every ``Linear`` becomes torchao's
    ``Float8Linear``."""
    from torchtitan.models.common import ScaledDotProductAttention
    from torchtitan.models.llama3 import llama3_configs, parallelize_llama
    from torchtitan.models.llama3.sharding import set_llama3_sharding_config

    parallelism, dims = parallel_dims(tp=tp, dp_shard=dp_shard)
    config = llama3_configs["debugmodel"](attn_backend="flex")
    config.layers = config.layers[:n_layers]
    for layer in config.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    if float8_recipe is not None:
        from torchtitan.components.quantization import Float8LinearConverter

        _float8_on_cpu()
        config = Float8LinearConverter.Config(recipe_name=float8_recipe).build().convert(config)
    set_llama3_sharding_config(config, enable_sp=parallelism.enable_sequence_parallel)
    parallelize_fn = parallelize_llama if parallelize_fn is None else parallelize_fn
    return _built(
        config, parallelize_fn, parallelism, dims, param_dtype=param_dtype, seed=seed, model_dtype=model_dtype
    )


def cpu_qwen3_moe(
    *,
    ep: int = 1,
    dp_shard: int = 1,
    n_layers: int = 2,
    param_dtype: str = "float32",
    parallelize_fn: Callable[..., torch.nn.Module] | None = None,
    seed: int = 0,
    unsharded: bool = False,
) -> torch.nn.Module:
    """torchtitan's Qwen3 ``debugmodel_moe`` (dim 256, 64 experts of hidden 768, top 8, vocabulary
    2048) with ``n_layers`` layers and SDPA attention, under ``parallelize_fn`` (default:
    torchtitan's ``parallelize_qwen3``) with expert parallelism ``ep`` over ``dp_shard`` ranks
    (``set_qwen3_sharding_config(enable_ep=ep > 1)``); built, materialized and initialized as
    :func:`cpu_debugmodel`. Its ``AllToAllTokenDispatcher`` runs on gloo; its ``GroupedExperts``
    cast their weights themselves (``w.bfloat16()``) before ``torch._grouped_mm``.

    ``unsharded``: no ``ParallelDims`` and no parallelize function, the whole model on this rank
    (a reference beside the parallel one on a rank of a larger world). Parallel: each rank's shards
    initialized from ``seed + rank``: DTensor's random init on a CPU mesh draws every rank's shard
    from the same generator state, which made rank 1's 32 experts (and the router's rows for them)
    copies of rank 0's, with equal gradients."""
    from torchtitan.models.common import ScaledDotProductAttention
    from torchtitan.models.qwen3 import parallelize_qwen3, qwen3_configs
    from torchtitan.models.qwen3.sharding import set_qwen3_sharding_config

    config = qwen3_configs["debugmodel_moe"](attn_backend="flex")
    config.layers = config.layers[:n_layers]
    for layer in config.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    if unsharded:
        return _built(config, lambda model, **_: model, None, None, param_dtype=param_dtype, seed=seed)
    parallelism, dims = parallel_dims(dp_shard=dp_shard, ep=ep)
    set_qwen3_sharding_config(config, enable_sp=parallelism.enable_sequence_parallel, enable_ep=ep > 1)
    parallelize_fn = parallelize_qwen3 if parallelize_fn is None else parallelize_fn
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    return _built(config, parallelize_fn, parallelism, dims, param_dtype=param_dtype, seed=seed + rank)


def low_precision_experts(model: torch.nn.Module, recipe: str) -> int:
    """Every torchtitan ``GroupedExperts`` of ``model`` (in place) running ``recipe``'s grouped GEMM
    through torchtitan's own seam (``GroupedExperts._grouped_mm``, "overridable seam for
    low-precision variants", which its MXFP8 converter swaps): the eager reference for amp_fx's
    low-precision experts, on the operands as the model makes them (its own ``w.bfloat16()``,
    after ``to_local()`` under expert parallelism). The grouped GEMM is
    :func:`amp_fx.testing.fp8_reference.reference_grouped_mm`. Returns how many were swapped."""
    from torchtitan.models.common.moe import GroupedExperts

    from amp_fx.testing.fp8_reference import reference_grouped_mm

    grouped = reference_grouped_mm(recipe)
    swapped = 0
    for module in model.modules():
        if isinstance(module, GroupedExperts):
            module._grouped_mm = lambda *, A, B_t, offs: grouped(A, B_t, offs)
            swapped += 1
    return swapped


def _built(
    config: Any,
    parallelize_fn: Callable[..., torch.nn.Module],
    parallelism: Any,
    dims: Any,
    *,
    param_dtype: str,
    seed: int,
    model_dtype: torch.dtype = torch.float32,
) -> torch.nn.Module:
    """``config`` built on meta, parallelized, materialized on the CPU, initialized from ``seed``."""
    from torch.distributed.fsdp import FSDPModule
    from torchtitan.config import CompileConfig, TrainingConfig

    with torch.device("meta"):
        model = config.build()
    model = parallelize_fn(
        model,
        parallel_dims=dims,
        training=TrainingConfig(mixed_precision_param=param_dtype),
        parallelism=parallelism,
        compile_config=CompileConfig(),
        ac_config=None,
        dump_folder="",
    )
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

    return SimpleNamespace(
        model_spec=model_registry("debugmodel"),
        loss=ChunkedLossWrapper.Config(),
        compile=CompileConfig(enable=True, components=["model", "loss"]),
    )


def stand_in_for_trainer_extras() -> list[str]:
    """Make torchtitan's config registries importable without what its ``Trainer`` alone needs:
    stand-ins (in ``sys.modules``) for ``torch.utils.tensorboard`` (its metrics' ``SummaryWriter``)
    and ``datasets`` (its data loaders), each only where the real one does not import; the names
    stood in for. ``--module``/``--config`` parsing (``torchtitan.config.manager.ConfigManager``)
    imports ``torchtitan.trainer`` through every registry and uses neither. For a process of its
    own (a subprocess): the stand-ins stay in ``sys.modules``."""
    import importlib
    import importlib.machinery
    import sys
    import types

    class _Unavailable:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            raise RuntimeError(
                "a stand-in (amp_fx.testing.torchtitan.stand_in_for_trainer_extras): pip install tensorboard datasets"
            )

    stand_ins = {
        "torch.utils.tensorboard": {"SummaryWriter": _Unavailable},
        "datasets": {"Dataset": _Unavailable, "load_dataset": _Unavailable},
        "datasets.distributed": {"split_dataset_by_node": _Unavailable},
    }
    made = []
    for name, attrs in stand_ins.items():
        try:
            importlib.import_module(name)
            continue
        except ImportError:
            pass
        module = types.ModuleType(name)
        module.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
        module.__path__ = []
        module.__dict__.update(attrs)
        sys.modules[name] = module
        made.append(name)
    return made
