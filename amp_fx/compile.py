"""amp_fx.compile: torch.compile with the autocast policy applied as a graph pass."""

from __future__ import annotations

import difflib
import functools
import inspect
import types
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch._dynamo
import torch._inductor

from amp_fx._common.devices import check_supported
from amp_fx._common.downstream import Backend
from amp_fx._common.fresh_code import calls_forward_only
from amp_fx._common.report import Reporter
from amp_fx._common.targets import check_target
from amp_fx._common.unwrap import unwrap_compiled
from amp_fx._dist.capture import (
    FSDP1_ALTERNATIVE,
    distributed_units,
    is_fsdp1,
    root_linears,
    root_state_modules,
    unit_call,
)
from amp_fx._dist.fp8_gather import gathered_fp8_weights
from amp_fx.backend import AmpBackend
from amp_fx.backend.call import amp_call, checked_units
from amp_fx.backend.weight_cache import WeightCache
from amp_fx.fp8 import Fp8Like
from amp_fx.options import Options, inductor_config
from amp_fx.overflow import ForwardWatch
from amp_fx.passes.pipeline import GraphRecord, summarize
from amp_fx.policy import Policy

__all__ = ["compile", "AmpCompiledModule", "records", "uncompile", "options_of"]

F = TypeVar("F", bound=Callable[..., Any])


class AmpCompiledModule(torch.nn.Module):
    """The module :func:`compile` returns: the original's parameters, buffers and submodules.

    It shares the original module's ``_parameters``, ``_buffers`` and ``_modules`` dicts, so
    ``state_dict()`` keys, parameter objects and buffers are the original's: a state_dict of
    either loads into the other, and an optimizer built on either trains both. Attributes it does
    not define are read from the original module.
    """

    def __init__(self, module: torch.nn.Module, backend: AmpBackend) -> None:
        super().__init__()
        for name in ("_parameters", "_buffers", "_modules", "_non_persistent_buffers_set"):
            self.__dict__[name] = module.__dict__[name]
        self.__dict__["_amp_fx_original"] = module
        self.__dict__["_amp_fx_backend"] = backend
        units = distributed_units(module)  # DDP / FSDP2: hooks eager, wrapped forwards compiled
        if units is not None and backend.options.fp8 is not None:  # the root's own Linears in fp8 too
            units = [*units, *root_linears(module, units)]
        gathered = None if units is None else gathered_fp8_weights(module, units, backend.options.fp8,
                                                                      backend.options.policy, backend.reporter)
        self.__dict__["_amp_fx_gathered_fp8"] = gathered
        self.__dict__["_amp_fx_forward"] = (
            amp_call(module, backend) if units is None
            else checked_units(unit_call(module, units, lambda fn: amp_call(fn, backend, check=False),
                                          backend.dtype, gathered=gathered), module, backend,
                               gathered=gathered, root_own=root_state_modules(module, units)))
        self.training = module.training

    def __reduce_ex__(self, protocol: object) -> tuple[object, tuple[object, ...]]:
        # The compiled callables do not copy or pickle: a copy is the original module (copied
        # by deepcopy, pickled by pickle/torch.save) compiled again with the same options, with
        # no records until it first runs. Its state is independent of this module's.
        return (_recompile, (self._amp_fx_original, self._amp_fx_backend.options, self.training))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # Straight to amp_fx's call where nn.Module.__call__ would only call forward (no hooks on
        # this module, no forward set on it, no compiled call, not traced by torch.jit): two
        # Python frames fewer on every call (docs/call-overhead.md). Otherwise nn.Module's call.
        d = self.__dict__
        if (self._compiled_call_impl is None and "forward" not in d and calls_forward_only(self)
                and not torch._C._get_tracing_state()):
            return d["_amp_fx_forward"](*args, **kwargs)
        return super().__call__(*args, **kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._amp_fx_forward(*args, **kwargs)

    def train(self, mode: bool = True) -> AmpCompiledModule:
        self._amp_fx_original.train(mode)
        return super().train(mode)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            original = self.__dict__["_amp_fx_original"]
            found = getattr(original, name)
            if isinstance(found, types.MethodType) and found.__self__ is original:
                watch = self.__dict__.get("_amp_fx_forward_watch")
                if watch is None:
                    watch = _ForwardWatch(original, self.__dict__["_amp_fx_forward"],
                                          self.__dict__["_amp_fx_backend"].reporter)
                    self.__dict__["_amp_fx_forward_watch"] = watch
                return _routed(found, watch)
            return found

    @property
    def amp_fx_weight_cache(self) -> WeightCache | None:
        """The weight-cast cache (``compile(..., weight_cache=True)``), else None."""
        return self._amp_fx_backend.weight_cache

    @property
    def amp_fx_watch(self) -> ForwardWatch | None:
        """The forward record of ``compile(..., watch_nonfinite=True)`` (``amp_fx.overflow``), else None."""
        return self._amp_fx_backend.watch

    @property
    def original_module(self) -> torch.nn.Module:
        """The module that was compiled (shares all state with this one)."""
        return self._amp_fx_original

    @property
    def amp_fx_records(self) -> list[GraphRecord]:
        """One record per graph captured so far (filled in when the module first runs)."""
        return self._amp_fx_backend.records

    def amp_fx_summary(self) -> str:
        """A table of what the passes did to each captured graph."""
        return summarize(self._amp_fx_backend.records)


def _routed(method: types.MethodType, watch: _ForwardWatch) -> Callable[..., Any]:
    """``method`` of the compiled module, run with the module's own call (``module(...)``, so
    ``self(...)`` inside the method: Hugging Face ``generate``) running amp_fx's compiled forward.

    Set as ``nn.Module.compile()`` sets it (the module's ``_compiled_call_impl``) for the duration
    of the method, then restored: outside it, the original module stays the eager module. While it
    runs, ``module.forward`` is ``watch``: a method that calls ``self.forward(...)`` (the eager
    forward, fp32) is reported.
    """
    module = watch.module

    @functools.wraps(method)
    def run(*args: Any, **kwargs: Any) -> Any:
        if module.__dict__.get("forward") is watch:  # inside another method of the wrapper: set already
            return method(*args, **kwargs)
        before = module._compiled_call_impl
        watch.own = module.__dict__.get("forward")  # an instance forward of the user's (accelerate's hooks)
        module._compiled_call_impl = watch.call
        module.__dict__["forward"] = watch
        watch.method = method.__name__
        try:
            return method(*args, **kwargs)
        finally:
            module._compiled_call_impl = before
            if watch.own is not None:
                module.__dict__["forward"] = watch.own
            else:
                del module.__dict__["forward"]

    return run


class _ForwardWatch:
    """``module.forward`` while a method of the wrapper runs: reports a call of it from outside
    amp_fx's compiled call (the eager forward, run in fp32 without a graph), then runs it.

    One per wrapper, so Dynamo, which may read ``self.forward`` while it traces a module with
    hooks, sees the same object every time."""

    def __init__(self, module: torch.nn.Module, call: Callable[..., Any], reporter: Reporter) -> None:
        self.module = module
        self.reporter = reporter
        self.own: Callable[..., Any] | None = None
        self.method = ""
        self.inside = 0

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.inside += 1
            try:
                return call(*args, **kwargs)
            finally:
                self.inside -= 1

        self.call = counted
        """The compiled call, set as the module's call while a method runs; inside it ``forward`` is not reported."""

    @property
    def __wrapped__(self) -> Callable[..., Any]:  # inspect.signature(module.forward) reads through it
        return self.own if self.own is not None else types.MethodType(type(self.module).forward, self.module)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not torch.compiler.is_compiling() and not self.inside:
            self.reporter.did_less(("uncompiled method", self.method), (
                f"amp_fx.compile({type(self.module).__name__}).{self.method}(...) called self.forward(...), "
                f"the eager forward: it ran in fp32, uncompiled, without amp_fx's graphs. Call "
                f"self(...) in {self.method} instead (it runs the compiled forward), or run it under "
                f"torch.autocast."))
        return self.__wrapped__(*args, **kwargs)


class _InplaceCall:
    """The compiled call ``compile(module, inplace=True)`` sets on the module (``_compiled_call_impl``).

    nn.Module drops ``_compiled_call_impl`` when it is copied or pickled (its ``__getstate__``), so
    a copy of ``module.compile()`` runs eagerly, silently. amp_fx keeps this object under a second
    name (``_amp_fx_inplace``) that is copied, and reviving it sets the copy's compiled call: a
    copy (deepcopy, pickle, torch.save) is compiled again with the same options, lazily at its
    first call (while it is being copied its parameters are not there yet), with its own records
    and Dynamo cache entries.
    """

    def __init__(self, module: torch.nn.Module, options: Options) -> None:
        self.module = module
        self.options = options
        self.compiled: AmpCompiledModule | None = None

    def install(self) -> None:
        self.module.__dict__["_compiled_call_impl"] = self
        self.module.__dict__["_amp_fx_inplace"] = self

    def build(self) -> AmpCompiledModule:
        if self.compiled is None:
            compiled = _compile(self.module, self.options)
            assert isinstance(compiled, AmpCompiledModule)  # _compile wraps every module in one
            self.compiled = compiled
            self.forward = compiled._amp_fx_forward  # type: ignore[method-assign]  # built: its forward from now on
        return self.compiled

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Until built (a copy's first call): build, then the compiled forward (set on the instance)."""
        return self.build()._amp_fx_forward(*args, **kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward(*args, **kwargs)

    def __reduce_ex__(self, protocol: object) -> tuple[object, tuple[object, ...]]:
        return (_revive_inplace, (self.module, self.options))


def _revive_inplace(module: torch.nn.Module, options: Options) -> _InplaceCall:
    # Called while ``module`` (the copy) is being rebuilt, before its __setstate__, whose state
    # has no _compiled_call_impl: what is set here stays.
    call = _InplaceCall(module, options)
    call.install()
    return call


def _inplace_call(model: object) -> _InplaceCall | None:
    found = getattr(model, "__dict__", {}).get("_compiled_call_impl")
    return found if isinstance(found, _InplaceCall) else None


def uncompile(model: torch.nn.Module) -> torch.nn.Module:
    """Undo ``amp_fx.compile(model, inplace=True)``: ``model(...)`` runs its eager forward again.

    Returns ``model``. Raises ``ValueError`` if ``model`` is not compiled in place by amp_fx.
    """
    if _inplace_call(model) is None:
        raise ValueError(f"amp_fx.uncompile: {type(model).__name__} is not compiled in place by amp_fx "
                         "(amp_fx.compile(model, inplace=True)); a module returned by amp_fx.compile(model) "
                         "is undone by using model itself (its original_module)")
    model._compiled_call_impl = None
    del model.__dict__["_amp_fx_inplace"]
    return model


def check_keep_fp32(policy: Policy, model: object) -> None:
    """The module names of ``keep_fp32`` and ``keep_out_of_fp8`` are the model's."""
    for field in ("keep_fp32", "keep_out_of_fp8"):
        names = [s for s in getattr(policy, field) if isinstance(s, str)]
        if not names:
            continue
        if not isinstance(model, torch.nn.Module):
            raise ValueError(f"amp_fx: Policy.{field} names submodules {names}, but {model!r} is a "
                             "function, not an nn.Module")
        known = {n for n, _ in model.named_modules() if n}
        for name in names:
            if name not in known:
                close = sorted(k for k in known if k.split(".")[-1] == name.split(".")[-1])[:5]
                hint = f" (did you mean {close}?)" if close else ""
                raise ValueError(f"amp_fx: Policy.{field} names submodule {name!r}, which "
                                 f"{type(model).__name__} does not have{hint}")


def _recompile(module: torch.nn.Module, options: Options, training: bool) -> AmpCompiledModule:
    compiled = _compile(module, options)
    assert isinstance(compiled, AmpCompiledModule)  # _compile wraps every module in one
    compiled.train(training)
    return compiled


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
    fp8: Fp8Like = None,
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
        fp8: train in fp8: ``"tensorwise"``, ``"rowwise"`` or ``"rowwise_with_gw_hp"`` (torchao's
            float8 training recipes and numerics), ``"mxfp8"`` (torchao's MXFP8 numerics; MX
            kernels on Blackwell GPUs, emulated elsewhere, with a warning), an
            ``amp_fx.Fp8Recipe`` or an ``amp_fx.Fp8Config``. Every matmul with a parameter operand (``nn.Linear``,
            ``F.linear``, ``Conv1D``, ``x @ W``) whose sizes ``torch._scaled_mm`` takes runs in
            fp8, forward and backward; everything else stays in ``dtype``
            (:mod:`amp_fx.passes.fp8_matmuls`; ``Policy(keep_out_of_fp8=...)`` keeps modules out).
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
    options = Options(dtype=dtype, policy=policy, backend=backend, fold=fold, strict=strict,
                      weight_cache=weight_cache, watch_nonfinite=watch_nonfinite,
                      inductor=inductor_config(backend, mode, inductor), torch_compile=torch_compile_kwargs,
                      fp8=fp8)
    return compile_with(model_or_fn, options, inplace=inplace)


def compile_with(model_or_fn: F, options: Options, *, inplace: bool = False, label: str | None = None,
                 root: torch.nn.Module | None = None) -> F:
    """:func:`compile` with its options given as the record (for compile_step and the adapters);
    ``label`` names the model in the progress lines (default: its class or function name).

    ``root``: for a function that runs a module (compile_step's frame), that module: the graphs'
    module paths, parameters and buffers are then named under it by identity, as they are when the
    module itself is compiled (one rule: :class:`amp_fx.backend.names.RootNames`)."""
    if inplace:
        return _compile_inplace(model_or_fn, options)
    if _inplace_call(model_or_fn) is not None:
        raise ValueError(f"amp_fx.compile: this {type(model_or_fn).__name__} is already compiled in place by "
                         "amp_fx; call amp_fx.compile(model, inplace=True, ...) again to change its options, "
                         "or amp_fx.uncompile(model) first to wrap it instead")
    return _compile(model_or_fn, options, label=label, root=root)


def _compile(model_or_fn: F, options: Options, *, label: str | None = None,
             root: torch.nn.Module | None = None) -> F:
    reporter = Reporter(options.strict)
    check_target(model_or_fn, "amp_fx.compile")
    model_or_fn = unwrap_compiled(model_or_fn)  # type: ignore[assignment]  # the target under a wrapper, same kind
    if isinstance(model_or_fn, torch.nn.Module):
        root = model_or_fn
    check_keep_fp32(options.policy, model_or_fn if root is None else root)
    if options.weight_cache and not weight_cache_applies(options.policy, root, reporter, "amp_fx.compile"):
        options = options.replace(weight_cache=False)  # the record holds what is in effect
    if label is None:
        label = type(root).__name__ if root is not None else getattr(model_or_fn, "__qualname__", "the function")
    amp_backend = AmpBackend(options, root=root, reporter=reporter, label=label)
    if isinstance(model_or_fn, torch.nn.Module):
        _check_devices(model_or_fn)
        if is_fsdp1(model_or_fn):
            reporter.did_less("fsdp1", (
                f"amp_fx.compile({type(model_or_fn).__name__}): the model is sharded by "
                "FullyShardedDataParallel (FSDP1), whose flat parameters and hooks Dynamo does not "
                "capture: it will run as eager FSDP1 under autocast, nothing compiled. To compile it, "
                f"{FSDP1_ALTERNATIVE}."))
        return AmpCompiledModule(model_or_fn, amp_backend)  # type: ignore[return-value]  # F: a module comes back wrapped
    compiled = amp_call(model_or_fn, amp_backend)
    compiled.amp_fx_records = amp_backend.records  # type: ignore[attr-defined]  # read back by options_of and explain
    compiled.amp_fx_weight_cache = amp_backend.weight_cache  # type: ignore[attr-defined]  # read back by options_of and explain
    compiled.amp_fx_watch = amp_backend.watch  # type: ignore[attr-defined]  # read back by options_of and explain
    compiled.amp_fx_options = options  # type: ignore[attr-defined]  # read back by options_of and explain
    return compiled  # type: ignore[return-value]  # F: a module comes back wrapped


def _compile_inplace(model: object, options: Options) -> Any:
    """``compile(model, inplace=True)``: the module, its call set to amp_fx's compiled forward."""
    check_target(model, "amp_fx.compile(inplace=True)")
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"amp_fx.compile(inplace=True) compiles an nn.Module in place, got "
                        f"{type(model).__name__}; drop inplace=True to compile a function")
    if isinstance(model, (AmpCompiledModule, torch._dynamo.eval_frame.OptimizedModule)):
        raise TypeError(f"amp_fx.compile(inplace=True): {type(model).__name__} is a compiled wrapper; "
                        "compile the module under it in place (its original_module / _orig_mod)")
    call = _InplaceCall(model, options)
    call.build()  # the checks of compile() run now, not at the first call
    call.install()
    return model


def compile_inplace_at_first_call(model: torch.nn.Module, options: Options) -> torch.nn.Module:
    """``compile(model, inplace=True)`` whose build, and so its checks, waits for the first call:
    for a model whose parameters are not materialised yet (torchtitan builds it on the meta
    device, then ``to_empty`` and ``init_weights``)."""
    _InplaceCall(model, options).install()
    return model


def check_compile_kwargs(kwargs: dict[str, Any]) -> None:
    """Raise for a keyword that is neither amp_fx's option nor torch.compile's, naming both lists.

    Both lists come from the signatures, so options added to either are known here."""
    ours = [n for n, p in inspect.signature(compile).parameters.items() if p.kind is p.KEYWORD_ONLY]
    theirs = _torch_compile_keywords()
    unknown = [k for k in kwargs if k not in theirs]
    if not unknown:
        return
    close = difflib.get_close_matches(unknown[0], ours + theirs, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    raise TypeError(f"amp_fx.compile got an unexpected keyword argument {unknown[0]!r}{hint}. amp_fx's options: "
                    f"{', '.join(ours)}; passed on to torch.compile: {', '.join(theirs)}")


@functools.cache
def _torch_compile_keywords() -> list[str]:
    """torch.compile's keyword arguments, less the model and the backend (amp_fx's own ``backend``)."""
    params = inspect.signature(torch.compile).parameters.items()
    return [n for n, p in params if p.kind is p.KEYWORD_ONLY and n != "backend"]


def weight_cache_applies(policy: Policy, root: torch.nn.Module | None, reporter: Reporter, caller: str) -> bool:
    """Whether ``weight_cache=True`` can be honoured for ``root``; where not, the reporter says why."""
    if root is not None and weight_cache_off_for_fsdp2(root, reporter, caller):
        return False
    if not policy.cast_cache:
        reporter.did_less("weight_cache:cast_cache",
                          "amp_fx: weight_cache=True needs the shared leaf cast that Policy(cast_cache=False) "
                          "turns off (each use would get its own gradient cast); the weight cache is off. "
                          "Drop cast_cache=False or weight_cache=True.")
        return False
    return True


def weight_cache_off_for_fsdp2(model: torch.nn.Module, reporter: Reporter, caller: str) -> bool:
    """Report (and return True) when ``model`` is sharded with ``fully_shard``: no weight cache.

    FSDP2 all-gathers each parameter, every forward, into the same unsharded tensor, under
    ``torch.autograd._unsafe_preserve_version_counter``: neither its version counter nor its
    storage tells the cache that the values changed, and the optimizer steps the *sharded*
    parameters, so no invalidation rule of amp_fx/backend/weight_cache.py would ever fire and the copy
    would stay the first forward's (checked: training drifts from eager FSDP2 after one step).
    DDP keeps whole fp32 parameters on every rank and is supported.
    """
    units = distributed_units(model)
    if units is None or (torch.distributed.is_available()
                         and isinstance(model, torch.nn.parallel.DistributedDataParallel)):
        return False
    reporter.did_less("weight_cache:fsdp2", (
        f"{caller}(weight_cache=True): the model is sharded with fully_shard (FSDP2), which gathers "
        "its parameters again in every forward into tensors whose changes the weight cache cannot "
        "see; the cache is off and each forward casts the gathered weights, as eager autocast does. "
        "Drop weight_cache=True (FSDP2's MixedPrecisionPolicy(param_dtype=...) gathers low-precision "
        "weights instead)."))
    return True


def _check_devices(module: torch.nn.Module) -> None:
    for name, t in (*module.named_parameters(), *module.named_buffers()):
        check_supported(t.device.type, name)


def records(compiled: object) -> list[GraphRecord]:
    """The per-graph records of a module or function returned by :func:`compile` (or compiled
    in place by it)."""
    inplace = _inplace_call(compiled)
    if inplace is not None:
        return inplace.build().amp_fx_records
    found = getattr(compiled, "amp_fx_records", None)
    if found is None:
        raise TypeError(f"amp_fx: {compiled!r} was not returned by amp_fx.compile")
    return found


def reporter_of(compiled: object) -> Reporter | None:
    """The reporter of a module returned by :func:`compile` (what it warns through, once per key),
    else None: the inspection tools report a model's shortfalls once per model through it."""
    if isinstance(compiled, AmpCompiledModule):
        return compiled.__dict__["_amp_fx_backend"].reporter
    return None


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
    inplace = _inplace_call(compiled)
    if inplace is not None:
        return inplace.options
    if isinstance(compiled, AmpCompiledModule):
        return compiled.__dict__["_amp_fx_backend"].options
    found = getattr(compiled, "amp_fx_options", None)
    if not isinstance(found, Options):
        raise TypeError(f"amp_fx.options_of: {type(compiled).__name__} was not compiled by amp_fx.compile")
    return found
