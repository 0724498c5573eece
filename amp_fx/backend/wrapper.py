"""The module :func:`amp_fx.compile` returns: :class:`AmpCompiledModule`, which shares the
original module's state and runs amp_fx's compiled call (``backend/call.py``), its methods run
with that call (``_routed``), and :func:`wrap`, which builds it (or compiles a function) from one
:class:`~amp_fx.Options` after the checks of a compile."""

from __future__ import annotations

import functools
import types
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from amp_fx import low_precision
from amp_fx._common.devices import check_supported
from amp_fx._common.fresh_code import calls_forward_only
from amp_fx._common.report import Reporter
from amp_fx._common.suggest import did_you_mean
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
from amp_fx.backend.call import amp_call, checked_units
from amp_fx.backend.compiler import AmpBackend
from amp_fx.backend.regions import check_gradient_layout, find_regions, log_regions
from amp_fx.backend.weight_cache import WeightCache, weight_cache_applies
from amp_fx.monitor.state import MonitorState
from amp_fx.options import Options
from amp_fx.overflow import ForwardWatch
from amp_fx.passes.pipeline import GraphRecord, summarize
from amp_fx.policy import Policy

__all__ = ["AmpCompiledModule", "wrap", "check_keep_fp32", "backend_of", "reporter_of"]

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
        regions = (
            find_regions(
                module,
                backend.options.policy,
                proven_only=backend.options.regions is None,
                label=backend.label,
                fp8=backend.options.fp8,
            )
            if units is None and backend.options.regions is not False
            else None
        )
        if regions is not None:  # the repeated blocks compiled once per class, as FSDP2's units
            units = regions.units(module)
            log_regions(backend.label, regions)
        if units is not None and backend.options.monitor is not None:
            raise ValueError(
                f"amp_fx: monitor= does not cover a model compiled unit by unit yet ({type(module).__name__}: "
                f"DDP, FSDP2 or regions); compile it whole (regions=False, DDP(amp_fx.compile(model))) or "
                f"pass monitor=None"
            )
        gathered = (
            None
            if units is None
            else gathered_fp8_weights(module, units, backend.options.fp8, backend.options.policy, backend.reporter)
        )
        self.__dict__["_amp_fx_gathered_fp8"] = gathered
        self.__dict__["_amp_fx_forward"] = (
            amp_call(module, backend)
            if units is None
            else checked_units(
                unit_call(
                    module,
                    units,
                    lambda fn: amp_call(fn, backend, check=False),
                    backend.dtype,
                    gathered=gathered,
                    group_of=None if regions is None else regions.group_of,
                    first_output=None
                    if regions is None
                    else functools.partial(check_gradient_layout, reporter=backend.reporter),
                ),
                module,
                backend,
                gathered=gathered,
                root_own=root_state_modules(module, units),
                in_regions=regions is not None,
            )
        )
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
        if (
            self._compiled_call_impl is None
            and "forward" not in d
            and calls_forward_only(self)
            and not torch._C._get_tracing_state()
        ):
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
                    watch = _ForwardWatch(
                        original, self.__dict__["_amp_fx_forward"], self.__dict__["_amp_fx_backend"].reporter
                    )
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
    def amp_fx_monitor(self) -> MonitorState | None:
        """The fp8 monitor's state (``compile(..., monitor=...)``; read with ``amp_fx.fp8_stats``), else None."""
        return self._amp_fx_backend.monitor

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
            self.reporter.did_less(
                ("uncompiled method", self.method),
                (
                    f"amp_fx.compile({type(self.module).__name__}).{self.method}(...) called self.forward(...), "
                    f"the eager forward: it ran in fp32, uncompiled, without amp_fx's graphs. Call "
                    f"self(...) in {self.method} instead (it runs the compiled forward), or run it under "
                    f"torch.autocast."
                ),
            )
        return self.__wrapped__(*args, **kwargs)


def check_keep_fp32(policy: Policy, model: object) -> None:
    """The module names of ``keep_fp32`` and ``keep_out_of_fp8`` are the model's."""
    for field in ("keep_fp32", "keep_out_of_fp8"):
        names = [s for s in getattr(policy, field) if isinstance(s, str)]
        if not names:
            continue
        if not isinstance(model, torch.nn.Module):
            raise ValueError(
                f"amp_fx: Policy.{field} names submodules {names}, but {model!r} is a function, not an nn.Module"
            )
        known = {n for n, _ in model.named_modules() if n}
        for name in names:
            if name not in known:
                raise ValueError(
                    f"amp_fx: Policy.{field} names submodule {name!r}, which {type(model).__name__} does not "
                    f"have{did_you_mean(name, known)}; names are paths under the compiled module, as in its "
                    f"named_modules()"
                )


def _recompile(module: torch.nn.Module, options: Options, training: bool) -> AmpCompiledModule:
    compiled = wrap(module, options)
    assert isinstance(compiled, AmpCompiledModule)  # wrap wraps every module in one
    compiled.train(training)
    return compiled


def wrap(model_or_fn: F, options: Options, *, label: str | None = None, root: torch.nn.Module | None = None) -> F:
    """``model_or_fn`` compiled with ``options`` (:func:`amp_fx.api.compile_with` less the in-place
    form): a module wrapped in :class:`AmpCompiledModule`, a function compiled and given its records."""
    reporter = Reporter(options.strict)
    check_target(model_or_fn, "amp_fx.compile")
    model_or_fn = unwrap_compiled(model_or_fn)  # type: ignore[assignment]
    if isinstance(model_or_fn, torch.nn.Module):
        root = model_or_fn
    check_keep_fp32(options.policy, model_or_fn if root is None else root)
    # the record holds the map in effect: its Blocks as the model's block names
    options = options.replace(fp8=low_precision.bind(options.fp8, model_or_fn if root is None else root, reporter))
    if options.weight_cache and not weight_cache_applies(options.policy, root, reporter, "amp_fx.compile"):
        options = options.replace(weight_cache=False)  # the record holds what is in effect
    if label is None:
        label = type(root).__name__ if root is not None else getattr(model_or_fn, "__qualname__", "the function")
    amp_backend = AmpBackend(options, root=root, reporter=reporter, label=label)
    if isinstance(model_or_fn, torch.nn.Module):
        _check_devices(model_or_fn)
        if is_fsdp1(model_or_fn):
            reporter.did_less(
                "fsdp1",
                (
                    f"amp_fx.compile({type(model_or_fn).__name__}): the model is sharded by "
                    "FullyShardedDataParallel (FSDP1), whose flat parameters and hooks Dynamo does not "
                    "capture: it will run as eager FSDP1 under autocast, nothing compiled. To compile it, "
                    f"{FSDP1_ALTERNATIVE}."
                ),
            )
        return AmpCompiledModule(model_or_fn, amp_backend)  # type: ignore[return-value]
    compiled = amp_call(model_or_fn, amp_backend)
    compiled.amp_fx_records = amp_backend.records  # type: ignore[attr-defined]
    compiled.amp_fx_weight_cache = amp_backend.weight_cache  # type: ignore[attr-defined]
    compiled.amp_fx_watch = amp_backend.watch  # type: ignore[attr-defined]
    compiled.amp_fx_monitor = amp_backend.monitor  # type: ignore[attr-defined]
    compiled.amp_fx_options = options  # type: ignore[attr-defined]
    return compiled  # type: ignore[return-value]


def _check_devices(module: torch.nn.Module) -> None:
    for name, t in (*module.named_parameters(), *module.named_buffers()):
        check_supported(t.device.type, name)


def backend_of(compiled: object) -> AmpBackend | None:
    """The backend of a module returned by :func:`amp_fx.compile` (its options, records and
    reporter), else None."""
    if isinstance(compiled, AmpCompiledModule):
        return compiled.__dict__["_amp_fx_backend"]
    return None


def reporter_of(compiled: object) -> Reporter | None:
    """The reporter of a module returned by :func:`compile` (what it warns through, once per key),
    else None: the inspection tools report a model's shortfalls once per model through it."""
    backend = backend_of(compiled)
    return None if backend is None else backend.reporter
