"""torchtitan with amp_fx's mixed precision (``pip install amp_fx[torchtitan]``; imports torchtitan).

torchtitan (0.3.0) has no autocast: its precision is FSDP2's ``MixedPrecisionPolicy``
(``training.mixed_precision_param``, default bfloat16), so norms and attention softmax run in
bf16, and a run without FSDP gets no mixed precision at all. amp_fx adds autocast's per-op
policy, bitwise with eager ``torch.autocast``, to torchtitan's own parallelization. In a config
module passed to torchtitan with ``--module``::

    from amp_fx.integrations.torchtitan import AmpFxTitanConfig, with_amp_fx
    from torchtitan.models.llama3.config_registry import llama3_8b

    def llama3_8b_amp_fx():
        config = llama3_8b()
        config.training.mixed_precision_param = "float32"  # autocast semantics (docs/torchtitan.md)
        return with_amp_fx(config, AmpFxTitanConfig(dtype="bf16"))

:func:`with_amp_fx` swaps the model's ``parallelize_fn`` for :func:`amp_fx_parallelize`'s: torchtitan's
own parallelization (TP, activation checkpointing, FSDP2), then ``amp_fx.compile(model, inplace=True)``
in place of torchtitan's per-block ``torch.compile``. It also takes ``lm_head`` back into the
model's forward: torchtitan's ``ChunkedLossWrapper`` calls it from the loss, outside the model,
where amp_fx does not see it (it would run in fp32). Programmatic training loops call
:func:`amp_fx_parallelize` themselves; fp16 there takes ``amp_fx.GradScaler`` (torchtitan's
``Trainer`` has no loss scaling, so :func:`with_amp_fx` refuses fp16).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

try:
    from torchtitan.components.loss import ChunkedLossWrapper
except ImportError as e:  # pragma: no cover - exercised where torchtitan is missing
    raise ImportError("amp_fx.integrations.torchtitan needs torchtitan: pip install amp_fx[torchtitan]") from e

from amp_fx._common.report import Reporter
from amp_fx.backend.inplace import compile_inplace_at_first_call
from amp_fx.fp8 import Fp8Like
from amp_fx.low_precision import LowPrecision, one_option
from amp_fx.options import Options
from amp_fx.policy import Policy

if TYPE_CHECKING:
    from torchtitan.trainer import Trainer

__all__ = ["AmpFxTitanConfig", "amp_fx_parallelize", "with_amp_fx"]

_PARAM_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
_PP_REFUSED = (
    "pipeline parallelism (parallelism.pipeline_parallel_degree > 1) is not supported by this "
    "integration yet; compile each stage with amp_fx.compile and use "
    "amp_fx.GradScaler(process_group=...) (docs/distributed.md)"
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class AmpFxTitanConfig:
    """What amp_fx does to a torchtitan model.

    Attributes:
        dtype: "bf16" or "fp16" (fp16 needs a loss scaler: ``amp_fx.GradScaler``).
        fp8: amp_fx's fp8 training recipe or None; bf16 only. ``"rowwise"`` and
            ``"rowwise_with_gw_hp"`` are the ``recipe_name`` values of torchtitan's
            ``Float8LinearConverter`` and give its numerics bit for bit (tests/integrations/test_torchtitan_fp8.py),
            used instead of it on the unconverted model; amp_fx also has ``"tensorwise"`` (which
            torchtitan 0.3.0 dropped) and ``"mxfp8"``.
        low_precision: the newer spelling of ``fp8`` (the same values; give one). One recipe: amp_fx
            compiles each TransformerBlock on its own here, so a per-module map
            (``amp_fx.LowPrecision``), whose names are the whole model's, is a TypeError.
        backend: the torch.compile backend amp_fx hands its graphs to.
        policy: overrides of autocast's op tables (``amp_fx.Policy``).
        strict: raise where amp_fx would warn that it did less than asked.
    """

    dtype: str = "bf16"
    fp8: Fp8Like = None
    low_precision: Fp8Like = None
    backend: str = "inductor"
    policy: Policy | None = None
    strict: bool | None = None

    def __post_init__(self) -> None:
        options = self.options()  # validates dtype, backend, fp8, policy, strict
        if isinstance(options.fp8, LowPrecision) and options.fp8.modules:
            raise TypeError(
                "AmpFxTitanConfig takes one low-precision recipe: amp_fx compiles each TransformerBlock on "
                f"its own, so a per-module map's names do not apply; got {options.fp8!r}"
            )
        if options.fp8 is not None and options.dtype != torch.bfloat16:
            raise ValueError(
                f"AmpFxTitanConfig: low_precision={options.fp8.recipe.value!r} trains with bf16 around the fp8 "
                f"matmuls; got dtype={self.dtype!r}"
            )

    def options(self) -> Options:
        fp8 = one_option(self.fp8, self.low_precision, "AmpFxTitanConfig")
        return Options(dtype=self.dtype, policy=self.policy, backend=self.backend, strict=self.strict, fp8=fp8)


def amp_fx_parallelize(
    parallelize_fn: Callable[..., torch.nn.Module], config: AmpFxTitanConfig
) -> Callable[..., torch.nn.Module]:
    """A torchtitan ``parallelize_fn`` that runs ``parallelize_fn`` (e.g. ``parallelize_llama``),
    then compiles the model in place with amp_fx.

    Takes and returns what torchtitan's parallelize functions do (the model, on the meta device
    as torchtitan builds it, and keyword-only ``parallel_dims``, ``training``, ``compile_config``,
    ...). torchtitan's own ``torch.compile`` of the blocks is turned off (amp_fx compiles the
    model; said once if it was on). The compiled call is built at the first forward, after
    torchtitan's ``to_empty`` and ``init_weights``, so it sees the parameters' real device.

    Raises ValueError where FSDP2 would store the parameters in a low-precision dtype other than
    ``config.dtype`` (``training.mixed_precision_param="bfloat16"`` with fp16), and for pipeline
    parallelism, which this integration has not been checked with.
    """
    if not isinstance(config, AmpFxTitanConfig):
        raise TypeError(f"amp_fx_parallelize: config must be an AmpFxTitanConfig, got {type(config).__name__}")
    options = config.options()
    reporter = Reporter(config.strict)

    @functools.wraps(parallelize_fn)
    def parallelize(
        model: torch.nn.Module, *, parallel_dims: Any, training: Any, compile_config: Any, **kwargs: Any
    ) -> torch.nn.Module:
        if parallel_dims.pp_enabled:
            raise ValueError(f"amp_fx_parallelize: {_PP_REFUSED}")
        param_dtype = _PARAM_DTYPES.get(training.mixed_precision_param)
        if param_dtype not in (torch.float32, options.dtype):
            raise ValueError(
                f"amp_fx_parallelize: training.mixed_precision_param={training.mixed_precision_param!r} "
                f"rounds every weight to it in FSDP2's all-gather, and amp_fx's dtype is {options.dtype}: "
                f"use mixed_precision_param='float32' (autocast semantics) or an amp_fx dtype of "
                f"{training.mixed_precision_param}"
            )
        if compile_config.enable and "model" in compile_config.components:
            reporter.did_less(
                "torchtitan-compile",
                (
                    "amp_fx_parallelize: torchtitan's compile of the model (compile.enable with 'model' in "
                    "compile.components) is replaced by amp_fx's compile of the whole model; set "
                    "compile.enable=False to silence this"
                ),
            )
            compile_config = dataclasses.replace(
                compile_config, components=[c for c in compile_config.components if c != "model"]
            )
        model = parallelize_fn(
            model, parallel_dims=parallel_dims, training=training, compile_config=compile_config, **kwargs
        )
        compile_inplace_at_first_call(model, options)  # built at the first call (module docstring)
        model.register_forward_pre_hook(functools.partial(_check_lm_head, reporter=reporter))
        return model

    return parallelize


def _check_lm_head(model: torch.nn.Module, args: Any, *, reporter: Reporter) -> None:
    if getattr(model, "_skip_lm_head", False) and getattr(model, "lm_head", None) is not None:
        reporter.did_less(
            "torchtitan-lm-head",
            (
                f"amp_fx: {type(model).__name__}.lm_head runs outside the model's forward (torchtitan's "
                "ChunkedLossWrapper calls it from the loss), where amp_fx does not compile it: it runs in "
                "fp32, not as autocast would. Use amp_fx.integrations.torchtitan.with_amp_fx, which keeps "
                "lm_head in the model, or a loss that takes the model's logits"
            ),
        )


def with_amp_fx(trainer_config: Trainer.Config, config: AmpFxTitanConfig | None = None) -> Trainer.Config:
    """``trainer_config`` (a torchtitan ``Trainer.Config``, modified in place and returned) training
    with amp_fx: the model spec's ``parallelize_fn`` wrapped by :func:`amp_fx_parallelize`,
    torchtitan's model compile off, and a ``ChunkedLossWrapper`` loss replaced by its inner loss,
    so that ``lm_head`` runs inside the model's compiled forward (the whole logits tensor is then
    materialized, as with torchtitan's plain loss).

    Raises ValueError for fp16: torchtitan's ``Trainer`` has no loss scaling, and fp16 gradients
    without it underflow; train fp16 in a loop of your own with :func:`amp_fx_parallelize` and
    ``amp_fx.GradScaler``. Raises ValueError for pipeline parallelism (as :func:`amp_fx_parallelize`
    does at parallelization, which also catches a degree set on the command line), and for a model
    spec that torchtitan's float8 converter already converted (``Float8Linear``): amp_fx's fp8 is
    ``AmpFxTitanConfig(fp8=...)`` on the unconverted model, bitwise with that converter's recipes.
    """
    config = AmpFxTitanConfig() if config is None else config
    if config.options().dtype == torch.float16:
        raise ValueError(
            "with_amp_fx: fp16 needs loss scaling, which torchtitan's Trainer does not do; use "
            "dtype='bf16', or amp_fx_parallelize with amp_fx.GradScaler in your own loop"
        )
    parallelism = getattr(trainer_config, "parallelism", None)
    if parallelism is not None and parallelism.pipeline_parallel_degree > 1:
        raise ValueError(f"with_amp_fx: {_PP_REFUSED}")
    spec = trainer_config.model_spec
    converted = _float8_linears(spec.model)
    if converted:
        raise ValueError(
            f"with_amp_fx: torchtitan's float8 converter already made {len(converted)} Linear layers "
            f"Float8Linear ({converted[0]}, ...); amp_fx's fp8 replaces it: build the model spec without "
            f"Float8LinearConverter and pass AmpFxTitanConfig(fp8='rowwise') (or its other recipes)"
        )
    spec.parallelize_fn = amp_fx_parallelize(spec.parallelize_fn, config)
    trainer_config.compile.components = [c for c in trainer_config.compile.components if c != "model"]
    if isinstance(trainer_config.loss, ChunkedLossWrapper.Config):
        trainer_config.loss = trainer_config.loss.loss_fn
    return trainer_config


def _float8_linears(model_config: Any) -> list[str]:
    """The names of the Linear configs torchtitan's ``Float8LinearConverter`` swapped."""
    from torchtitan.components.quantization.float8 import Float8Linear
    from torchtitan.models.common.linear import Linear

    if Float8Linear is None or not hasattr(model_config, "traverse"):  # torchao missing: nothing converted
        return []
    return [
        fqn for fqn, linear, _, _ in model_config.traverse(Linear.Config) if isinstance(linear, Float8Linear.Config)
    ]
