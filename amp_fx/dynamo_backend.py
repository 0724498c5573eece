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
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch._dynamo
import torch._inductor
import torch.fx

from amp_fx._backends import Backend
from amp_fx._dtype_names import dtype_name
from amp_fx._report import Reporter
from amp_fx.backend import AmpBackend, check_backend
from amp_fx.passes.insert_casts import graph_device_type
from amp_fx.policy import Policy, resolve_dtype

__all__ = ["amp_fx_backend", "amp_fx_bf16_backend", "amp_fx_fp16_backend", "register_backend", "backend_of", "OPTIONS"]

OPTIONS: Mapping[str, str] = {
    "dtype": '"bf16"/"fp16" (or a torch dtype); default: the ambient torch.autocast dtype, else bf16',
    "backend": 'the downstream torch.compile backend: "inductor" (default), "aot_eager", "eager" or a callable',
    "policy": "an amp_fx.Policy",
    "fold": "run the value-preserving cast-folding pass (default True)",
    "strict": "raise instead of warning where amp_fx does less than asked (default: AMP_FX_STRICT)",
    "inductor": "a dict of inductor config patches (torch.compile's options= for inductor)",
}
"""The keys of ``torch.compile(..., backend="amp_fx", options={...})``, with what each means."""


@dataclass(frozen=True)
class _Config:
    """One named backend's configuration (``dtype=None``: the ambient autocast's, else bf16)."""

    dtype: torch.dtype | None = None
    policy: Policy = field(default_factory=Policy)
    backend: str | Backend = "inductor"
    fold: bool = True
    strict: bool | None = None
    inductor: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.policy, Policy):
            raise TypeError(f"amp_fx: policy must be an amp_fx.Policy, got {type(self.policy).__name__}")
        check_backend(self.backend)
        if not isinstance(self.fold, bool):
            raise TypeError(f"amp_fx: fold must be True or False, got {self.fold!r}")
        if self.inductor and self.backend != "inductor":
            raise ValueError(f"amp_fx: inductor options (or mode=) configure inductor, but backend={self.backend!r}")

    def merged(self, options: Mapping[str, Any] | None, mode: str | None) -> _Config:
        """This configuration with torch.compile's ``options=``/``mode=`` applied (checked)."""
        options = dict(options or {})
        unknown = sorted(set(options) - set(OPTIONS))
        if unknown:
            known = "; ".join(f"{k}: {v}" for k, v in OPTIONS.items())
            raise ValueError(f"amp_fx backend: unknown option(s) {unknown} in torch.compile(options=...); "
                             f"amp_fx reads {known}")
        if "dtype" in options:
            options["dtype"] = resolve_dtype(options["dtype"])
        inductor = dict(torch._inductor.list_mode_options(mode)) if mode and mode != "default" else {}
        inductor.update(options.pop("inductor", None) or self.inductor)
        kwargs = {"dtype": self.dtype, "policy": self.policy, "backend": self.backend, "fold": self.fold,
                  "strict": self.strict, **options, "inductor": inductor}
        return _Config(**kwargs)

    def key(self, dtype: torch.dtype) -> tuple[object, ...]:
        return (dtype, self.policy, self.backend, self.fold, self.strict, tuple(sorted(self.inductor.items())))


class _NamedBackend:
    """A backend registered by name: one :class:`AmpBackend` per (compiled root module, config)."""

    def __init__(self, name: str, config: _Config) -> None:
        self.__name__ = name
        self.config = config
        # root module -> config key -> backend; the function-compiled (rootless) ones by key
        self._by_root: weakref.WeakKeyDictionary[torch.nn.Module, dict[tuple[object, ...], AmpBackend]] = (
            weakref.WeakKeyDictionary())
        self._rootless: dict[tuple[object, ...], AmpBackend] = {}

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any], *,
                 options: Mapping[str, Any] | None = None, mode: str | None = None) -> Callable[..., Any]:
        config = self.config.merged(options, mode) if options or mode else self.config
        device_type = graph_device_type(example_inputs)
        ambient = torch.is_autocast_enabled(device_type)
        ambient_dtype = torch.get_autocast_dtype(device_type) if ambient else None
        dtype = config.dtype or ambient_dtype or torch.bfloat16
        root = _compiled_root()
        backend = self._backend_for(root, config, dtype)
        if ambient_dtype is not None and ambient_dtype != dtype:
            backend.reporter.did_less(("ambient dtype", ambient_dtype), (
                f"amp_fx backend {self.__name__!r}: the model runs inside torch.autocast(dtype="
                f"{dtype_name(ambient_dtype)}) but the backend casts its graphs to {dtype_name(dtype)}; "
                f"code Dynamo leaves to eager runs in {dtype_name(ambient_dtype)}. Use one dtype: "
                f"options={{'dtype': '{dtype_name(ambient_dtype)}'}} or the matching autocast."), stacklevel=2)
        reason = getattr(gm, "compile_subgraph_reason", None)
        if not ambient and getattr(reason, "graph_break", False):
            backend.reporter.did_less("graph break outside autocast", (
                f"amp_fx backend {self.__name__!r}: {_root_label(root)} has a graph break, and the call "
                f"runs outside torch.autocast: amp_fx casts inside the captured graphs, but the code "
                f"Dynamo runs in eager at the break runs in fp32, where eager autocast (and "
                f"amp_fx.compile) would run it in {dtype_name(dtype)}. Call the model inside "
                f"torch.autocast('{device_type}', dtype={dtype}) or compile it with amp_fx.compile to "
                f"match eager autocast."), stacklevel=2)
        compiled = backend(gm, example_inputs)
        if root is not None and not getattr(reason, "graph_break", False) and _frame_self() is root:
            backend.report_unused_policy()  # the root's own frame is done: every graph of a call is in
        return compiled

    def _backend_for(self, root: torch.nn.Module | None, config: _Config, dtype: torch.dtype) -> AmpBackend:
        key = config.key(dtype)
        table = self._rootless if root is None else self._by_root.setdefault(root, {})
        found = table.get(key)
        if found is not None:
            return found
        reporter = Reporter(config.strict)
        names = [s for s in config.policy.keep_fp32 if isinstance(s, str)]
        if root is None and names:
            raise ValueError(f"amp_fx backend {self.__name__!r}: Policy.keep_fp32 names submodules {names}, but "
                             "the compiled code is not a module called through torch.compile(module) or "
                             "module.compile(), so the backend has no root module to find them under. "
                             "Compile the module, or use amp_fx.compile(module).")
        if root is not None:
            from amp_fx.compile import _check_keep_fp32

            _check_keep_fp32(config.policy, root)
        found = table[key] = AmpBackend(dtype=dtype, policy=config.policy, backend=config.backend, fold=config.fold,
                                        inductor_config=dict(config.inductor), root=root, reporter=reporter)
        return found

    def reset(self) -> None:
        """Forget every compiled model (``torch._dynamo.reset()`` calls this through torch.compile's
        wrapper): a model compiled again starts with fresh records and split tracking. The backends
        hold their root module, so this is also what frees them."""
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
    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if code.co_argcount and code.co_varnames[0] == "self" and code.co_name in (
                "__call__", "_wrapped_call_impl", "_call_impl"):
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

        from amp_fx.backend import _frame_self as frame_self

        tx = InstructionTranslator.current_tx()
        return frame_self(tx.f_code, tx.f_locals)
    except Exception:  # a torch without these internals: the unused-policy check does not run
        return None


def _root_label(root: torch.nn.Module | None) -> str:
    return type(root).__name__ if root is not None else "the compiled function"


amp_fx_backend = _NamedBackend("amp_fx", _Config())
"""``torch.compile(..., backend="amp_fx")``: the ambient autocast's dtype, else bf16."""
amp_fx_bf16_backend = _NamedBackend("amp_fx_bf16", _Config(dtype=torch.bfloat16))
"""``torch.compile(..., backend="amp_fx_bf16")``."""
amp_fx_fp16_backend = _NamedBackend("amp_fx_fp16", _Config(dtype=torch.float16))
"""``torch.compile(..., backend="amp_fx_fp16")``."""

_NAMED: dict[str, _NamedBackend] = {b.__name__: b for b in (amp_fx_backend, amp_fx_bf16_backend, amp_fx_fp16_backend)}


def register_backend(name: str, *, dtype: str | torch.dtype | None = None, policy: Policy | None = None,
                     backend: str | Backend = "inductor", fold: bool = True, strict: bool | None = None,
                     inductor: Mapping[str, Any] | None = None) -> str:
    """Register an amp_fx configuration under ``name`` for ``torch.compile(..., backend=name)``.

    For code that takes only a backend name (a config file, a framework's ``backend=`` string).
    The options are those of :data:`OPTIONS`; ``dtype=None`` takes the ambient autocast's, else bf16.
    Returns ``name``.

    >>> import amp_fx.dynamo_backend as db, torch
    >>> db.register_backend("amp_fx_fp16_eager_doc", dtype="fp16", backend="aot_eager")
    'amp_fx_fp16_eager_doc'
    >>> torch.compile(torch.nn.Linear(4, 4), backend="amp_fx_fp16_eager_doc")(torch.randn(2, 4)).dtype
    torch.float16
    """
    if not isinstance(name, str) or not name:
        raise TypeError(f"amp_fx: register_backend needs a non-empty str name, got {name!r}")
    if name in torch._dynamo.list_backends(exclude_tags=()):
        raise ValueError(f"amp_fx: a torch.compile backend named {name!r} already exists; choose another name")
    config = _Config(dtype=None if dtype is None else resolve_dtype(dtype),
                     policy=Policy() if policy is None else policy, backend=backend, fold=fold, strict=strict,
                     inductor=dict(inductor or {}))
    named = _NAMED[name] = _NamedBackend(name, config)
    torch._dynamo.register_backend(named, name=name)
    return name


def backend_of(model: torch.nn.Module) -> list[AmpBackend]:
    """The amp_fx backends (one per configuration) that compiled ``model`` through a backend name.

    ``model`` is the ``torch.compile`` wrapper or the module itself; their ``records`` hold one
    :class:`~amp_fx.backend.GraphRecord` per captured graph."""
    root = model._orig_mod if isinstance(model, torch._dynamo.eval_frame.OptimizedModule) else model
    return [b for named in _NAMED.values() for b in named.backends(root)]
