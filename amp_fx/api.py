"""amp_fx.compile: torch.compile with the autocast policy applied as a graph pass.

The public entry points (``amp_fx.compile``, ``records``, ``uncompile``, ``options_of``) and
:func:`compile_with`, the same compile from an :class:`~amp_fx.Options` record (for
``compile_step`` and the adapters). The wrapper and the in-place compile they build are in
``amp_fx/backend/`` (``wrapper.py``, ``inplace.py``)."""

from __future__ import annotations

import enum
import functools
import inspect
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from amp_fx._common.downstream import Backend
from amp_fx._common.report import regions_from_env
from amp_fx._common.suggest import did_you_mean
from amp_fx.backend.inplace import compile_inplace, inplace_call
from amp_fx.backend.wrapper import backend_of, wrap
from amp_fx.low_precision import LowPrecisionLike, one_option
from amp_fx.monitor.config import Fp8Monitor
from amp_fx.options import Numerics, Options, inductor_config
from amp_fx.passes.pipeline import GraphRecord
from amp_fx.policy import Policy

__all__ = ["compile", "records", "uncompile", "options_of", "compile_with", "check_compile_kwargs"]

F = TypeVar("F", bound=Callable[..., Any])


class _NotGiven(enum.Enum):
    """An option not given in the call (``compile(regions=...)``: its default is read from the
    environment when ``compile`` is called)."""

    NOT_GIVEN = "not given"

    def __repr__(self) -> str:
        return "<not given>"


NOT_GIVEN = _NotGiven.NOT_GIVEN


def compile(
    model_or_fn: F,
    *,
    dtype: str | torch.dtype = "bf16",
    policy: Policy | None = None,
    backend: str | Backend = "inductor",
    fold: bool = True,
    strict: bool | None = None,
    weight_cache: bool = False,
    inplace: bool = False,
    watch_nonfinite: bool = False,
    low_precision: LowPrecisionLike = None,
    fp8: LowPrecisionLike = None,
    regions: bool | None | _NotGiven = NOT_GIVEN,
    numerics: str | Numerics = "default",
    monitor: Fp8Monitor | None = None,
    **torch_compile_kwargs: Any,
) -> F:
    """Compile a module or function with mixed precision inserted into its graphs.

    Args:
        model_or_fn: an ``nn.Module`` or a callable.
        dtype: the lower-precision dtype: "bf16"/"bfloat16"/torch.bfloat16 or
            "fp16"/"float16"/torch.float16.
        policy: overrides of eager autocast's op tables and fp32-kept submodules.
        backend: any torch.compile backend ("inductor", "aot_eager", "eager", or a callable);
            amp_fx rewrites each captured graph, then hands it on.
        fold: run the value-preserving cast-folding pass.
        strict: raise :class:`AmpFxError` where amp_fx would warn that it did less than asked
            (a call that ran no graph, a policy entry that matched no op, a weight used on both
            sides of a graph break, whose gradient then differs from eager's). ``None`` reads the
            ``AMP_FX_STRICT`` environment variable when ``compile`` is called.
        weight_cache: cast each fp32 parameter to ``dtype`` once per optimizer step instead of
            once per forward, and share that cast across graph breaks (``amp_fx.backend.weight_cache``;
            keeps a low-precision copy of the parameters alive between steps).
        inplace: compile the module itself, as ``nn.Module.compile()`` does, and return it:
            ``model(...)``, and every method that calls ``self(...)`` (Hugging Face ``generate``),
            then run amp_fx's compiled forward; ``model.forward(...)`` stays the eager forward.
            :func:`uncompile` undoes it. Modules only.
        watch_nonfinite: record, on the device and for each call, the first op (in graph order)
            whose low-precision output holds an inf/NaN (``amp_fx.overflow``); an
            ``amp_fx.GradScaler`` whose optimizer trains this model names it in
            ``overflow_report()`` (it finds the model itself; ``scaler.watch(model)`` says which
            model when several are watched). Values computed are unchanged.
        low_precision: train the matmuls in a low-precision recipe: ``"tensorwise"``,
            ``"rowwise"`` or ``"rowwise_with_gw_hp"`` (torchao's float8 training recipes and
            numerics), ``"mxfp8"`` (torchao's MXFP8 numerics; MX kernels on Blackwell GPUs,
            emulated elsewhere, with a warning), ``"blockwise"`` (DeepSeek-V3's 1x128/128x128
            blockwise fp8, torchao's numerics; emulated off Hopper, with a notice), ``"nvfp4"``
            (TransformerEngine's NVFP4 recipe, emulated without fp4 tensor cores, with a notice),
            an ``amp_fx.Fp8Recipe`` or an
            ``amp_fx.Fp8Config``. Every matmul with a parameter operand (``nn.Linear``,
            ``F.linear``, ``Conv1D``, ``x @ W``) runs in it, forward and backward; everything
            else stays in ``dtype`` (:mod:`amp_fx.passes.fp8_matmuls`; ``Policy(keep_out_of_fp8=...)``
            keeps modules out). A recipe per module: an ``amp_fx.LowPrecision`` (its preset
            ``LowPrecision.keep_ends(recipe=...)`` keeps the first and last blocks and the head
            in ``dtype``) or a dict ``{module: recipe or None}`` (:mod:`amp_fx.low_precision`).
        fp8: the older spelling of ``low_precision`` (the same values); passing both is a TypeError.
        regions: compile each repeated block once (:mod:`amp_fx.backend.regions`): the blocks of
            one class in a ``ModuleList``/``Sequential`` (a transformer's layers) share one
            compiled region, so the first step's compile time does not grow with depth; the
            root's stateful modules outside the blocks are compiled as units of their own, and
            the root's forward around them as far as Dynamo captures it (code it skips runs as
            eager autocast, and is reported where it uses the root's own parameters).
            ``False`` (the default when not given, for now: docs/regions.md says what is still
            to be shown; ``AMP_FX_REGIONS=1`` makes it None): the whole model as one graph
            (fusion across blocks). ``True``: regions wherever there are repeated blocks.
            ``None``: as True, except for blocks that hold convolutions (channels-last block
            outputs are not bitwise with eager autocast in regions: ConvNext, UNets) and with
            ``fp8`` or ``Policy.op_classes`` (their reach into code of the root's forward that
            Dynamo skips is not checked); the progress lines say so. Not used for functions,
            models under DDP/FSDP2 (whose units are compiled alike) or models without a
            repeated block. The progress lines say which classes were compiled once
            (docs/regions.md).
        numerics: ``"default"`` (the backend's own numbers) or ``"eager"``: under inductor, every
            op stays on ATen's kernel except the pointwise ops inductor can fuse without changing
            a value, so the forward and backward are bitwise with eager autocast
            (:mod:`amp_fx.backend.eager_numerics`; docs "Eager numerics under inductor").
            Needs ``backend="inductor"``.
        monitor: an ``amp_fx.Fp8Monitor(every=..., start=..., end=...)``: on the steps it selects
            (a step is one call), every converted GEMM's quantization statistics (underflows,
            saturations, amax, scales, relative error) for its input, weight and output gradient,
            computed on the device in the compiled forward and backward; read them with
            ``amp_fx.fp8_stats(model)`` (docs/fp8-monitor.md). Needs ``low_precision=``. None
            (default): off, the graphs are those compiled without it.
        **torch_compile_kwargs: passed to ``torch.compile`` (``fullgraph``, ``dynamic``, ...);
            an unknown keyword raises ``TypeError`` here.

    Returns:
        For a module, an :class:`AmpCompiledModule` sharing the module's parameters, buffers and
        state_dict keys (its methods, e.g. ``generate``, run with ``self(...)`` compiled; the
        module itself with ``inplace=True``); for a function, the compiled function. A module already wrapped by
        ``amp_fx.compile`` or ``torch.compile`` is unwrapped first: the module under it is
        compiled with these options, and module names are its names.

    Example:
        >>> model = amp_fx.compile(torch.nn.Linear(4, 4), dtype="bf16", backend="aot_eager")
        >>> model(torch.randn(2, 4)).dtype
        torch.bfloat16
    """
    check_compile_kwargs(torch_compile_kwargs)
    if not isinstance(inplace, bool):
        raise TypeError(f"amp_fx: inplace must be True or False, got {inplace!r}")
    mode, inductor = torch_compile_kwargs.pop("mode", None), torch_compile_kwargs.pop("options", None)
    options = Options(
        dtype=dtype,
        policy=policy,
        backend=backend,
        fold=fold,
        strict=strict,
        weight_cache=weight_cache,
        watch_nonfinite=watch_nonfinite,
        inductor=inductor_config(backend, mode, inductor),
        torch_compile=torch_compile_kwargs,
        regions=_regions_default(regions),
        fp8=one_option(fp8, low_precision, "amp_fx.compile"),
        numerics=numerics,
        monitor=monitor,
    )
    return compile_with(model_or_fn, options, inplace=inplace)


def _regions_default(regions: bool | None | _NotGiven) -> bool | None:
    """``compile``'s ``regions``: as given, else ``AMP_FX_REGIONS`` (default: False)."""
    return regions_from_env() if regions is NOT_GIVEN else regions


def compile_with(
    model_or_fn: F,
    options: Options,
    *,
    inplace: bool = False,
    label: str | None = None,
    root: torch.nn.Module | None = None,
) -> F:
    """:func:`compile` with its options given as the record (for compile_step and the adapters);
    ``label`` names the model in the progress lines (default: its class or function name).

    ``root``: for a function that runs a module (compile_step's frame), that module: the graphs'
    module paths, parameters and buffers are then named under it by identity, as they are when the
    module itself is compiled (one rule: :class:`amp_fx.backend.names.RootNames`)."""
    if inplace:
        return compile_inplace(model_or_fn, options)
    if inplace_call(model_or_fn) is not None:
        raise ValueError(
            f"amp_fx.compile: this {type(model_or_fn).__name__} is already compiled in place by "
            "amp_fx; call amp_fx.compile(model, inplace=True, ...) again to change its options, "
            "or amp_fx.uncompile(model) first to wrap it instead"
        )
    return wrap(model_or_fn, options, label=label, root=root)


def check_compile_kwargs(kwargs: dict[str, Any]) -> None:
    """Raise for a keyword that is neither amp_fx's option nor torch.compile's, naming both lists.

    Both lists come from the signatures, so options added to either are known here."""
    ours = [n for n, p in inspect.signature(compile).parameters.items() if p.kind is p.KEYWORD_ONLY]
    theirs = _torch_compile_keywords()
    unknown = [k for k in kwargs if k not in theirs]
    if not unknown:
        return
    hint = did_you_mean(unknown[0], ours + theirs, n=1)
    raise TypeError(
        f"amp_fx.compile got an unexpected keyword argument {unknown[0]!r}{hint}. amp_fx's options: "
        f"{', '.join(ours)}; passed on to torch.compile: {', '.join(theirs)}"
    )


@functools.cache
def _torch_compile_keywords() -> list[str]:
    """torch.compile's keyword arguments, less the model and the backend (amp_fx's own ``backend``)."""
    params = inspect.signature(torch.compile).parameters.items()
    return [n for n, p in params if p.kind is p.KEYWORD_ONLY and n != "backend"]


def records(compiled: object) -> list[GraphRecord]:
    """The per-graph records of a module or function returned by :func:`compile` (or compiled
    in place by it)."""
    inplace = inplace_call(compiled)
    if inplace is not None:
        return inplace.build().amp_fx_records
    found = getattr(compiled, "amp_fx_records", None)
    if found is None:
        raise TypeError(f"amp_fx: {compiled!r} was not returned by amp_fx.compile")
    return found


def uncompile(model: torch.nn.Module) -> torch.nn.Module:
    """Undo ``amp_fx.compile(model, inplace=True)``: ``model(...)`` runs its eager forward again.

    Returns ``model``. Raises ``ValueError`` if ``model`` is not compiled in place by amp_fx.
    """
    call = inplace_call(model)
    if call is None:
        raise ValueError(
            f"amp_fx.uncompile: {type(model).__name__} is not compiled in place by amp_fx "
            "(amp_fx.compile(model, inplace=True)); a module returned by amp_fx.compile(model) "
            "is undone by using model itself (its original_module)"
        )
    call.uninstall()
    return model


def options_of(compiled: object) -> Options:
    """The :class:`~amp_fx.Options` a model or function returned by :func:`compile` (or compiled in
    place by it) was compiled with: what is in effect (``weight_cache`` is False where amp_fx
    turned the cache off and said why).

    Raises ``TypeError`` for anything amp_fx did not compile.

    Example:
        >>> model = amp_fx.compile(torch.nn.Linear(4, 4), dtype="fp16", backend="aot_eager")
        >>> amp_fx.options_of(model).dtype
        torch.float16
    """
    inplace = inplace_call(compiled)
    if inplace is not None:
        return inplace.options
    backend = backend_of(compiled)
    if backend is not None:
        return backend.options
    found = getattr(compiled, "amp_fx_options", None)
    if not isinstance(found, Options):
        raise TypeError(f"amp_fx.options_of: {type(compiled).__name__} was not compiled by amp_fx.compile")
    return found
