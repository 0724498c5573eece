"""advise, the entry point: check the arguments, then the phases in order. The float64 reference
and the default policy's run (measuring), the search when that run is not verified, then the cost,
the training comparison (with ``steps``) and the result (reporting)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import torch

from amp_fx._common.dtype_names import dtype_name
from amp_fx._common.report import did_less
from amp_fx._common.targets import check_target
from amp_fx.fp8 import Fp8Config, Fp8Like
from amp_fx.inspect._runner import Call, refuse_fsdp2, run_eager_checked
from amp_fx.inspect.advice._cost import cost, kept_modules
from amp_fx.inspect.advice._findings import grain
from amp_fx.inspect.advice._fp8_sizing import fp8_matmuls
from amp_fx.inspect.advice._measure import RunResult, policy_run
from amp_fx.inspect.advice._reference import reference
from amp_fx.inspect.advice._report import Advice
from amp_fx.inspect.advice._search import MAX_RUNS, search
from amp_fx.inspect.advice._training import compare_training
from amp_fx.inspect.advice._verify import meets
from amp_fx.kernels.fp8_recipes import check_rowwise_support
from amp_fx.low_precision import LowPrecision, one_option
from amp_fx.policy import Policy, resolve_dtype

__all__: list[str] = []

DEFAULT_TARGETS = {torch.bfloat16: 32 * 2.0**-7, torch.float16: 32 * 2.0**-10}
"""The largest end-to-end error (loss, gradients, outputs; normwise relative to float64) a policy
may leave: 32 units of rounding (eps) of the dtype, 0.25 for bf16 and 0.031 for fp16. Eager
autocast's own error on GPT-2, Llama and BERT (random init, 2 layers x 64) is about 0.75 eps
(tests/inspect/test_advise.py::test_real_model_no_false_alarm), 40 times below, while a hazard (inf/NaN,
a signal lost to cancellation) costs order 1, hundreds of eps."""


def advise(
    model: torch.nn.Module,
    *args: Any,
    dtype: str | torch.dtype = "fp16",
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    target: float | None = None,
    optimizer: Any = None,
    steps: int = 0,
    max_runs: int = MAX_RUNS,
    low_precision: Fp8Like = None,
    fp8: Fp8Like = None,
    strict: bool | None = None,
    **kwargs: Any,
) -> Advice:
    """Advise which modules of ``model`` to keep in fp32 for ``dtype`` training, measured against
    float64 and verified end to end.

    Args:
        model: an ``nn.Module``; never modified (every run uses a deep copy).
        *args: example inputs, positional; ``**kwargs`` go to the model by keyword.
        dtype: "fp16" or "bf16" (and their aliases).
        loss_fn: maps the output to a scalar loss; with it gradients are measured and verified
            too (at GradScaler's initial scale for fp16). Without it, outputs only.
        target: the largest end-to-end error (normwise relative to float64) the advised policy
            may leave; default :data:`DEFAULT_TARGETS` (32 eps of the dtype).
        optimizer: with ``steps``: a ``torch.optim.Optimizer`` (rebuilt from its class and
            defaults on each copy) or a callable ``params -> Optimizer``; trains ``steps`` steps
            on these inputs from the same initial state in fp32, with the default policy and with
            the advised one (fp16 with ``torch.amp.GradScaler``), and reports the loss curves.
        steps: how many training steps (needs ``optimizer`` and ``loss_fn``).
        max_runs: end-to-end policy runs the search may make after the default policy's.
        fp8: a recipe (as :func:`amp_fx.compile` takes it): advise which matmuls to keep *out of
            fp8* instead. The default run has every matmul the fp8 pass converts in fp8 (eager,
            bitwise with ``amp_fx.compile(..., fp8=..., backend="aot_eager")``), the rest in
            ``dtype``; the search keeps modules' matmuls in ``dtype`` (``Policy(keep_out_of_fp8=...)``)
            until the target is met, starting from the matmuls whose fp8 GEMM error exceeds
            :data:`FP8_ERROR_HAZARD`. The advice also lists each fp8 matmul and whether it is too
            small to gain (:func:`fp8_too_small`). One recipe: the advice is itself which modules
            to keep out of it (a per-module map, ``amp_fx.LowPrecision``, is a TypeError).
        low_precision: the newer spelling of ``fp8`` (the same values); passing both is a TypeError.
        strict: raise instead of warning where advise does less than asked (``fp8`` set but no
            matmul runs in fp8); None: the ``AMP_FX_STRICT`` environment variable decides.

    Raises:
        EagerError: the model fails in plain fp32 eager mode on these inputs.
        ValueError: bad ``target``/``steps``, or ``loss_fn`` does not return a scalar.
        TypeError: the model is sharded with FSDP2 (advise runs on copies, which FSDP2 refuses;
            run it on the model before ``fully_shard``).
    """
    low, target = _checked(model, dtype, target, steps, optimizer, loss_fn)
    refuse_fsdp2(
        model,
        tool="advise",
        why="a float64 reference, runs with modules patched to fp32, training runs that step an optimizer",
    )
    config = Fp8Config.of(cast(Fp8Like, one_option(fp8, low_precision, "amp_fx.advise")))
    if isinstance(config, LowPrecision) and config.modules:
        raise TypeError(
            "amp_fx.advise takes one low-precision recipe (it advises which modules to keep out of it), "
            f"got a per-module map {config!r}; pass its recipe alone"
        )
    call = Call(args, kwargs)
    run_eager_checked(model, call, tool="advise")
    device_type = call.device_type(model)
    _check_rowwise(config, device_type)
    ref = reference(model, call, loss_fn)

    def run(keep: tuple[str, ...]) -> RunResult:
        return policy_run(model, call, ref, dtype=low, device_type=device_type, keep=keep, loss_fn=loss_fn, fp8=config)

    base = run(())
    if config is not None and not base.fp8_calls:
        _no_fp8_matmul(model, config, low, strict)
    best, runs = base, 1
    words: list[str] = []
    if not meets(base.finite, base.error, target):
        best, runs, words = search(base, run, target, grain(low, config), max_runs)
    verified = meets(best.finite, best.error, target)
    policy = Policy(keep_out_of_fp8=best.keep) if config is not None else Policy(keep_fp32=best.keep)
    training = None
    if steps:
        assert loss_fn is not None
        training = compare_training(
            model, call, loss_fn, optimizer, steps, dtype=low, device_type=device_type, keep=best.keep, fp8=config
        )
    costs = cost(model, call, dtype=low, device_type=device_type, keep=best.keep, fp8=config)
    ordered = tuple(base.modules[n] for n in base.order if n in base.modules)
    return Advice(
        dtype=low,
        policy=policy,
        target=target,
        error=best.error,
        baseline_error=base.error,
        verified=verified,
        modules=ordered,
        cost=costs,
        loss_scale=best.scale,
        runs=runs,
        steps=tuple(words),
        training=training,
        grads_measured=loss_fn is not None,
        parts=_parts(best),
        baseline_parts=_parts(base),
        kept=kept_modules(best.keep, base, costs.matmul_flops, "fp32" if config is None else dtype_name(low)),
        fp8=config,
        fp8_matmuls=() if config is None else fp8_matmuls(base.fp8_calls, config.recipe),
        _explain=lambda policy: _explain_model(model, call, low, policy, config),
    )


def _checked(
    model: Any,
    dtype: str | torch.dtype,
    target: float | None,
    steps: int,
    optimizer: Any,
    loss_fn: Callable[[Any], torch.Tensor] | None,
) -> tuple[torch.dtype, float]:
    """The low dtype and the target, after checking the arguments."""
    check_target(model, "amp_fx.advise", module_only=True)
    if not isinstance(model, torch.nn.Module):
        raise TypeError(
            f"amp_fx.advise: model must be an nn.Module (policies name its submodules), got {type(model).__name__}"
        )
    low = resolve_dtype(dtype)
    target = DEFAULT_TARGETS[low] if target is None else float(target)
    if not target > 0:
        raise ValueError(f"amp_fx.advise: target must be a positive error bound, got {target!r}")
    if steps < 0 or (steps and (optimizer is None or loss_fn is None)):
        raise ValueError("amp_fx.advise: steps=N needs optimizer=... and loss_fn=... (and N >= 0)")
    return low, target


def _check_rowwise(config: Fp8Config | None, device_type: str) -> None:
    """A rowwise recipe needs rowwise scales in ``torch._scaled_mm`` on this device."""
    if config is not None:
        check_rowwise_support(config.recipe, device_type, "amp_fx.advise")


def _no_fp8_matmul(model: Any, config: Fp8Config, low: torch.dtype, strict: bool | None) -> None:
    """Warn (or raise, strict) that ``fp8`` was asked for but no matmul ran in fp8."""
    did_less(
        ("advise fp8", type(model)),
        (
            f"amp_fx.advise: fp8={config.recipe.value!r} but no matmul of {type(model).__name__} ran in "
            f"fp8 (none has a parameter as its right operand, outside a module kept out of fp8, "
            f"under autocast); the advice is for {dtype_name(low)} alone. amp_fx.explain(model, ..., "
            f"fp8=...) says why for each matmul."
        ),
        strict=strict,
    )


def _explain_model(model: Any, call: Call, dtype: torch.dtype, policy: Policy, fp8: Fp8Config | None = None) -> Any:
    from amp_fx.inspect.explanation import explain

    return explain(model, *call.args, dtype=dtype, policy=policy, fp8=fp8, **call.kwargs)


def _parts(r: RunResult) -> tuple[tuple[str, float | None], ...]:
    return (("output", r.output_error), ("loss", r.loss_error), ("gradients", r.grad_error))
