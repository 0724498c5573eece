"""amp_fx as a torch.compile backend by name: ``torch.compile(model, backend="amp_fx")``.

pyproject.toml registers three names in the ``torch_dynamo_backends`` entry-point group, which
Dynamo reads when it meets a backend name it does not know (torch/_dynamo/backends/registry.py):

* ``"amp_fx"``: the dtype of the ambient ``torch.autocast`` when the model runs inside one, else
  bf16; ``options={"dtype": "fp16"}`` chooses.
* ``"amp_fx_bf16"``, ``"amp_fx_fp16"``: that dtype, for code that passes only a backend name.

``torch.compile`` hands a non-inductor backend its ``options=`` dict (and ``mode=``) as keyword
arguments, on torch 2.11 to 2.15 alike (``torch._TorchCompileWrapper``). The keys amp_fx reads are
those of :data:`OPTIONS`; :func:`register_backend` gives any other configuration a name of its own.

    >>> import torch  # amp_fx installed (pip install): its entry points name the backends
    >>> m = torch.compile(torch.nn.Linear(4, 4), backend="amp_fx", options={"backend": "aot_eager"})
    >>> m(torch.randn(2, 4)).dtype
    torch.bfloat16

The backend sees only graphs. What ``amp_fx.compile`` does around them, it does here this way:

* Module names (``Policy.keep_fp32``, records, warnings) are names under the module given to
  ``torch.compile`` (or compiled in place by ``module.compile``): the backend finds that module on
  the Python stack of the call being compiled (:func:`_compiled_root`). A compiled function has no
  root; a policy that names modules is then an error, and other names are Dynamo's.
* ``amp_fx.compile`` runs every call inside ``torch.autocast``, so that code Dynamo leaves to eager
  (graph breaks, skipped modules) runs under eager autocast and Dynamo traces ``x.dtype`` reads with
  autocast's dtypes. A backend cannot open a context around the call: inside ``torch.autocast``
  the two are the same, outside one a graph break is reported once per model (that code runs in
  fp32).
* The per-call check "this call ran no graph" cannot run (Dynamo calls no backend then); the check
  of unused policy entries runs when the root module's own frame finishes compiling.
"""

from __future__ import annotations

import sys
import types
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch._dynamo
import torch._inductor
import torch.fx

from amp_fx._common.downstream import Backend
from amp_fx._common.dtype_names import dtype_name
from amp_fx.backend import AmpBackend
from amp_fx.backend.audit import report_unused_policy
from amp_fx.backend.names import frame_self
from amp_fx.backend.wrapper import check_keep_fp32
from amp_fx.low_precision import one_option
from amp_fx.options import Options
from amp_fx.passes.insert_casts import graph_device_type
from amp_fx.policy import Policy

__all__ = ["amp_fx_backend", "amp_fx_bf16_backend", "amp_fx_fp16_backend", "register_backend", "backend_of", "OPTIONS"]

OPTIONS: Mapping[str, str] = {
    "dtype": '"bf16"/"fp16" (or a torch dtype); default: the ambient torch.autocast dtype, else bf16',
    "backend": 'the downstream torch.compile backend: "inductor" (default), "aot_eager", "eager" or a callable',
    "policy": "an amp_fx.Policy",
    "fold": "run the value-preserving cast-folding pass (default True)",
    "strict": "raise instead of warning where amp_fx does less than asked (default: AMP_FX_STRICT)",
    "inductor": "a dict of inductor config patches (torch.compile's options= for inductor)",
    "low_precision": 'the low-precision recipe: "tensorwise", "rowwise", "rowwise_with_gw_hp", "mxfp8", "blockwise", '
    '"nvfp4", an amp_fx.Fp8Recipe or an amp_fx.Fp8Config (default None: off); a per-module map '
    "(amp_fx.LowPrecision) is checked against the model, and its Blocks found, by amp_fx.compile only",
    "fp8": "the older spelling of low_precision",
    "numerics": '"default" or "eager" (bitwise with eager autocast under inductor; docs: numerics.md)',
}
"""The keys of ``torch.compile(..., backend="amp_fx", options={...})``, with what each means."""


@dataclass(frozen=True)
class _Config:
    """One named backend's configuration: the options, and whether its dtype was given (else the
    ambient autocast's dtype at each compile, or bf16 outside one)."""

    options: Options = field(default_factory=Options)
    dtype_given: bool = False
    strict_given: bool = False
    """Otherwise ``AMP_FX_STRICT`` decides when a compiled model's backend is made."""

    @property
    def dtype(self) -> torch.dtype | None:
        """The dtype given, or None: the ambient autocast's at each compile, else bf16."""
        return self.options.dtype if self.dtype_given else None

    def merged(self, options: Mapping[str, Any] | None, mode: str | None) -> _Config:
        """This configuration with torch.compile's ``options=``/``mode=`` applied (checked)."""
        options = dict(options or {})
        unknown = sorted(set(options) - set(OPTIONS))
        if unknown:
            known = "; ".join(f"{k}: {v}" for k, v in OPTIONS.items())
            raise ValueError(
                f"amp_fx backend: unknown option(s) {unknown} in torch.compile(options=...); amp_fx reads {known}"
            )
        if "fp8" in options or "low_precision" in options:
            lp = one_option(options.pop("fp8", None), options.pop("low_precision", None), "amp_fx backend")
            options["fp8"] = lp
        inductor = dict(torch._inductor.list_mode_options(mode)) if mode and mode != "default" else {}
        inductor.update(options.pop("inductor", None) or self.options.inductor)
        return _Config(
            self.options.replace(**options, inductor=inductor),
            dtype_given=self.dtype_given or "dtype" in options,
            strict_given=self.strict_given or options.get("strict") is not None,
        )

    def resolved(self, ambient: torch.dtype | None) -> Options:
        """The options for one compile: the ambient autocast's dtype where none was given, strict
        mode from the environment where it was not given."""
        changes: dict[str, Any] = {} if self.strict_given else {"strict": None}
        if not self.dtype_given and ambient is not None:
            changes["dtype"] = ambient
        return self.options.replace(**changes) if changes else self.options


class _NamedBackend:
    """A backend registered by name: one :class:`AmpBackend` per (compiled root module, config)."""

    def __init__(self, name: str, config: _Config) -> None:
        self.__name__ = name
        self.config = config
        # root module -> config key -> backend; the function-compiled (rootless) ones by key
        self._by_root: weakref.WeakKeyDictionary[torch.nn.Module, dict[Options, AmpBackend]] = (
            weakref.WeakKeyDictionary()
        )
        self._rootless: dict[Options, AmpBackend] = {}

    def __call__(
        self,
        gm: torch.fx.GraphModule,
        example_inputs: list[Any],
        *,
        options: Mapping[str, Any] | None = None,
        mode: str | None = None,
    ) -> Callable[..., Any]:
        config = self.config.merged(options, mode) if options or mode else self.config
        device_type = graph_device_type(example_inputs)
        ambient = torch.is_autocast_enabled(device_type)
        ambient_dtype = torch.get_autocast_dtype(device_type) if ambient else None
        resolved = config.resolved(ambient_dtype)
        dtype = resolved.dtype
        root = _compiled_root()
        backend = self._backend_for(root, resolved)
        if ambient_dtype is not None and ambient_dtype != dtype:
            backend.reporter.did_less(
                ("ambient dtype", ambient_dtype),
                (
                    f"amp_fx backend {self.__name__!r}: the model runs inside torch.autocast(dtype="
                    f"{dtype_name(ambient_dtype)}) but the backend casts its graphs to {dtype_name(dtype)}; "
                    f"code Dynamo leaves to eager runs in {dtype_name(ambient_dtype)}. Use one dtype: "
                    f"options={{'dtype': '{dtype_name(ambient_dtype)}'}} or the matching autocast."
                ),
            )
        reason = getattr(gm, "compile_subgraph_reason", None)
        if not ambient and getattr(reason, "graph_break", False):
            backend.reporter.did_less(
                "graph break outside autocast",
                (
                    f"amp_fx backend {self.__name__!r}: {_root_label(root)} has a graph break, and the call "
                    f"runs outside torch.autocast: amp_fx casts inside the captured graphs, but the code "
                    f"Dynamo runs in eager at the break runs in fp32, where eager autocast (and "
                    f"amp_fx.compile) would run it in {dtype_name(dtype)}. Call the model inside "
                    f"torch.autocast('{device_type}', dtype={dtype}) or compile it with amp_fx.compile to "
                    f"match eager autocast."
                ),
            )
        compiled = backend(gm, example_inputs)
        if root is not None and not getattr(reason, "graph_break", False) and _frame_self() is root:
            # the root's own frame is done: every graph of a call is in
            report_unused_policy(backend.records, backend.options.policy, backend.reporter, fp8=backend.options.fp8)
        return compiled

    def _backend_for(self, root: torch.nn.Module | None, options: Options) -> AmpBackend:
        table = self._rootless if root is None else self._by_root.setdefault(root, {})
        found = table.get(options)
        if found is not None:
            return found
        names = [s for s in options.policy.keep_fp32 if isinstance(s, str)]
        if root is None and names:
            raise ValueError(
                f"amp_fx backend {self.__name__!r}: Policy.keep_fp32 names submodules {names}, but "
                "the compiled code is not a module called through torch.compile(module) or "
                "module.compile(), so the backend has no root module to find them under. "
                "Compile the module, or use amp_fx.compile(module)."
            )
        if root is not None:
            check_keep_fp32(options.policy, root)
        found = table[options] = AmpBackend(options, root=root)
        return found

    def reset(self) -> None:
        """Forget every compiled model (``torch._dynamo.reset()`` calls this through torch.compile's
        wrapper): a model compiled again starts with fresh records and split tracking. (A model's
        backends go with the model: they hold it weakly, and the table is keyed by it weakly.)"""
        self._by_root = weakref.WeakKeyDictionary()
        self._rootless = {}

    def backends(self, root: torch.nn.Module) -> list[AmpBackend]:
        return list(self._by_root.get(root, {}).values())


def _compiled_root() -> torch.nn.Module | None:
    """The module whose call Dynamo is compiling: the innermost ``torch.compile(module)`` wrapper's
    module on the Python stack, or a module compiled in place (``module.compile()``), else None.

    Dynamo calls the backend while it compiles a frame of the user's call, so the frames of that
    call (``OptimizedModule.__call__``, ``Module._wrapped_call_impl``) are still on the stack, with
    their ``self``. The frame being compiled may be a submodule's (after a graph break inside it):
    the stack still leads to the module the user compiled.
    """
    optimized = torch._dynamo.eval_frame.OptimizedModule
    frame: types.FrameType | None = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if (
            code.co_argcount
            and code.co_varnames[0] == "self"
            and code.co_name in ("__call__", "_wrapped_call_impl", "_call_impl")
        ):
            obj = frame.f_locals.get("self")
            if isinstance(obj, optimized):
                return obj._orig_mod
            if isinstance(obj, torch.nn.Module) and getattr(obj, "_compiled_call_impl", None) is not None:
                return obj
        frame = frame.f_back
    return None


def _frame_self() -> object:
    """The first argument (``self``) of the frame Dynamo is compiling (or the first of its
    ``*args``, for a decorated ``forward``), or None."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        tx = InstructionTranslator.current_tx()
        return frame_self(tx.f_code, tx.f_locals)
    except Exception:  # a torch without these internals: the unused-policy check does not run
        return None


def _root_label(root: torch.nn.Module | None) -> str:
    return type(root).__name__ if root is not None else "the compiled function"


amp_fx_backend = _NamedBackend("amp_fx", _Config())
"""``torch.compile(..., backend="amp_fx")``: the ambient autocast's dtype, else bf16."""
amp_fx_bf16_backend = _NamedBackend("amp_fx_bf16", _Config(Options(dtype=torch.bfloat16), dtype_given=True))
"""``torch.compile(..., backend="amp_fx_bf16")``."""
amp_fx_fp16_backend = _NamedBackend("amp_fx_fp16", _Config(Options(dtype=torch.float16), dtype_given=True))
"""``torch.compile(..., backend="amp_fx_fp16")``."""

_NAMED: dict[str, _NamedBackend] = {b.__name__: b for b in (amp_fx_backend, amp_fx_bf16_backend, amp_fx_fp16_backend)}


def register_backend(
    name: str,
    *,
    dtype: str | torch.dtype | None = None,
    policy: Policy | None = None,
    backend: str | Backend = "inductor",
    fold: bool = True,
    strict: bool | None = None,
    inductor: Mapping[str, Any] | None = None,
) -> str:
    """Register an amp_fx configuration under ``name`` for ``torch.compile(..., backend=name)``.

    For code that takes only a backend name (a config file, a framework's ``backend=`` string).
    The options are those of :data:`OPTIONS`; ``dtype=None`` takes the ambient autocast's, else bf16.
    Returns ``name``.

    >>> import amp_fx.integrations.dynamo_backend as db, torch
    >>> db.register_backend("amp_fx_fp16_eager_doc", dtype="fp16", backend="aot_eager")
    'amp_fx_fp16_eager_doc'
    >>> torch.compile(torch.nn.Linear(4, 4), backend="amp_fx_fp16_eager_doc")(torch.randn(2, 4)).dtype
    torch.float16
    """
    if not isinstance(name, str) or not name:
        raise TypeError(f"amp_fx: register_backend needs a non-empty str name, got {name!r}")
    if name in torch._dynamo.list_backends(exclude_tags=()):
        raise ValueError(f"amp_fx: a torch.compile backend named {name!r} already exists; choose another name")
    config = _Config(
        Options(
            dtype=torch.bfloat16 if dtype is None else dtype,
            policy=policy,
            backend=backend,
            fold=fold,
            strict=strict,
            inductor=dict(inductor or {}),
        ),
        dtype_given=dtype is not None,
        strict_given=strict is not None,
    )
    named = _NAMED[name] = _NamedBackend(name, config)
    torch._dynamo.register_backend(named, name=name)
    return name


def backend_of(model: torch.nn.Module) -> list[AmpBackend]:
    """The amp_fx backends (one per configuration) that compiled ``model`` through a backend name.

    ``model`` is the ``torch.compile`` wrapper or the module itself; their ``records`` hold one
    :class:`~amp_fx.backend.GraphRecord` per captured graph."""
    root = model._orig_mod if isinstance(model, torch._dynamo.eval_frame.OptimizedModule) else model
    return [b for named in _NAMED.values() for b in named.backends(root)]
