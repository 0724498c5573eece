"""The options of a compiled model or step: one frozen record, built and checked once.

``amp_fx.compile``, ``amp_fx.compile_step`` and the backend by name (``torch.compile(backend="amp_fx",
options={...})``) each build one :class:`Options` from what the user passed; everything downstream
(the backend object, the pipeline's stages, copies of a compiled model, the frameworks' adapters and
``explain``) reads that record. ``amp_fx.options_of(compiled)`` is the one public way to read a compiled
model's.

    >>> import torch, amp_fx
    >>> model = amp_fx.compile(torch.nn.Linear(4, 4), dtype="fp16", backend="aot_eager")
    >>> amp_fx.options_of(model).dtype
    torch.float16

Adding an option means a field here, its check in :meth:`Options.__post_init__`, and the code
that uses it (the keyword of ``compile``/``compile_step`` is derived from the field list).
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch._dynamo
import torch._inductor

from amp_fx import low_precision
from amp_fx._common.downstream import Backend, backend_name
from amp_fx._common.report import resolve_strict
from amp_fx.fp8 import Fp8Config, Fp8Recipe
from amp_fx.monitor.config import Fp8Monitor
from amp_fx.policy import Policy, resolve_dtype

__all__ = ["Options", "Numerics", "check_backend", "inductor_config"]


class Numerics(enum.Enum):
    """What a compiled graph's numbers are held to.

    ``DEFAULT``: the backend's own (inductor fuses and reorders freely). ``EAGER``: bitwise with
    eager autocast under inductor (this module)."""

    DEFAULT = "default"
    EAGER = "eager"

    @classmethod
    def of(cls, value: object) -> Numerics:
        if isinstance(value, cls):
            return value
        for member in cls:
            if value == member.value:
                return member
        raise ValueError(
            f"amp_fx: numerics must be one of {[m.value for m in cls]} or an amp_fx.Numerics, got {value!r}"
        )


@dataclass(frozen=True)
class Options:
    """What amp_fx was asked to do: validated on construction, never changed afterwards.

    ``dtype`` accepts the spellings of ``amp_fx.compile`` ("bf16", "fp16", torch dtypes) and is
    stored as a torch dtype; ``strict=None`` reads ``AMP_FX_STRICT`` when the record is built.
    ``inductor`` holds inductor config patches (torch.compile's ``mode=``/``options=``);
    ``torch_compile`` the keywords passed on to ``torch.compile`` (``fullgraph``, ``dynamic``, ...).
    """

    dtype: torch.dtype = torch.bfloat16
    policy: Policy = field(default_factory=Policy)
    backend: str | Backend = "inductor"
    fold: bool = True
    strict: bool | None = None
    """Always a bool once built (``None``: the ``AMP_FX_STRICT`` environment variable, read then)."""
    weight_cache: bool = False
    watch_nonfinite: bool = False
    inductor: Mapping[str, Any] = field(default_factory=dict)
    torch_compile: Mapping[str, Any] = field(default_factory=dict)
    regions: bool | None = False
    """Compile each repeated block once (``amp_fx/backend/regions.py``): True always, None where
    proven (``amp_fx.compile``'s default: not for convolutional blocks), False never (the
    record's default: compile_step and the adapters compile whole graphs)."""
    numerics: Numerics = Numerics.DEFAULT
    """``Numerics.EAGER`` (given as "eager"): inductor configured per graph to be bitwise with eager
    autocast (:mod:`amp_fx.backend.eager_numerics`); stored as a :class:`Numerics`."""
    fp8: Fp8Config | None = None
    """The low-precision recipe(s) (``low_precision=`` of ``amp_fx.compile``; ``fp8=`` is its older
    spelling): given as a recipe name, an ``Fp8Recipe``, an ``Fp8Config``, an
    ``amp_fx.LowPrecision`` or a dict ``{module: recipe or None}`` (:mod:`amp_fx.low_precision`);
    stored as an ``Fp8Config``, a ``LowPrecision`` for a per-module map (None: off)."""
    monitor: Fp8Monitor | None = None
    """Per-GEMM quantization statistics of the low-precision matmuls on the steps this schedule
    selects (:mod:`amp_fx.monitor`; read with ``amp_fx.fp8_stats``); None: off, and the graphs are
    those compiled without it."""

    if TYPE_CHECKING:  # what the constructor takes; __post_init__ stores the types declared above

        def __init__(
            self,
            dtype: torch.dtype | str = torch.bfloat16,
            policy: Policy | None = None,
            backend: str | Backend = "inductor",
            fold: bool = True,
            strict: bool | None = None,
            weight_cache: bool = False,
            watch_nonfinite: bool = False,
            inductor: Mapping[str, Any] = ...,
            torch_compile: Mapping[str, Any] = ...,
            regions: bool | None = False,
            numerics: Numerics | str = ...,
            fp8: low_precision.LowPrecisionLike = None,
            monitor: Fp8Monitor | None = None,
        ) -> None: ...

    def __post_init__(self) -> None:
        set_ = object.__setattr__  # the one place a frozen record normalises what it was given
        set_(self, "dtype", resolve_dtype(self.dtype))
        set_(self, "strict", resolve_strict(self.strict))
        set_(self, "fp8", low_precision.of(self.fp8))
        set_(self, "numerics", Numerics.of(self.numerics))
        if Fp8Recipe.MXFP8 in low_precision.recipes(self.fp8) and self.dtype != torch.bfloat16:
            where = "" if self.fp8 is not None and self.fp8.recipe is Fp8Recipe.MXFP8 else " (in the per-module map)"
            raise ValueError(
                f"amp_fx: the low-precision recipe 'mxfp8'{where} needs dtype=torch.bfloat16 (MXFP8 scales "
                f"bf16 operands, as torchao's MXFP8 training does), got dtype={self.dtype}; every recipe "
                f"of a per-module map must suit the dtype"
            )
        if self.fp8 is not None and self.fp8.recipe is Fp8Recipe.NVFP4 and self.dtype != torch.bfloat16:
            raise ValueError(
                f"amp_fx: fp8='nvfp4' needs dtype=torch.bfloat16 (NVFP4 quantizes bf16 operands, "
                f"as TransformerEngine's NVFP4 recipe does), got dtype={self.dtype}"
            )
        if self.policy is None:
            set_(self, "policy", Policy())
        if not isinstance(self.policy, Policy):
            raise TypeError(f"amp_fx: policy must be an amp_fx.Policy, got {type(self.policy).__name__}")
        check_backend(self.backend)
        for name in ("fold", "weight_cache", "watch_nonfinite"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise TypeError(f"amp_fx: {name} must be True or False, got {value!r}")
        if self.regions not in (True, False, None):
            raise TypeError(f"amp_fx: regions must be True, False or None, got {self.regions!r}")
        set_(self, "inductor", dict(self.inductor))
        set_(self, "torch_compile", dict(self.torch_compile))
        if self.inductor and self.backend != "inductor":
            raise ValueError(
                f"amp_fx: inductor options {dict(self.inductor)} are set, but backend="
                f"{self.backend!r}: mode= and options= configure inductor"
            )
        if self.numerics is Numerics.EAGER and self.backend != "inductor":
            raise ValueError(
                f"amp_fx: numerics='eager' configures inductor, but backend={self.backend!r}; "
                f"backend='aot_eager' is already bitwise with eager autocast (pass numerics='default')"
            )
        self._check_monitor()
        if self.numerics is Numerics.EAGER and self.watch_nonfinite:
            raise ValueError(
                "amp_fx: numerics='eager' and watch_nonfinite=True do not combine yet (the backward "
                "watch compiles its own inductor backward); pass one of them"
            )

    def _check_monitor(self) -> None:
        if self.monitor is None:
            return
        if not isinstance(self.monitor, Fp8Monitor):
            raise TypeError(
                f"amp_fx: monitor must be an amp_fx.Fp8Monitor (e.g. Fp8Monitor(every=100)) or None, "
                f"got {self.monitor!r}"
            )
        if self.fp8 is None:
            raise ValueError(
                "amp_fx: monitor= watches the low-precision matmuls, but low_precision= is not set; pass a "
                "recipe (low_precision='rowwise', ...) or monitor=None"
            )
        clash = [
            name
            for name, on in (
                ("weight_cache=True", self.weight_cache),
                ("watch_nonfinite=True", self.watch_nonfinite),
                ("numerics='eager'", self.numerics is Numerics.EAGER),
                ("regions=True", self.regions is True),
            )
            if on
        ]
        if clash:
            raise ValueError(
                f"amp_fx: monitor= does not combine with {', '.join(clash)} yet (its graphs would compute no "
                f"statistics); pass one or the other"
            )

    @property
    def backend_name(self) -> str:
        """The downstream backend as messages and records name it."""
        return backend_name(self.backend)

    def replace(self, **changes: Any) -> Options:
        """A copy with ``changes`` applied (and checked)."""
        return dataclasses.replace(self, **changes)

    def __hash__(self) -> int:  # the dict fields hold user values: hash what identifies a backend
        return hash(
            (
                self.dtype,
                self.policy,
                self.backend,
                self.fold,
                self.strict,
                self.weight_cache,
                self.watch_nonfinite,
                self.regions,
                tuple(sorted(self.inductor.items(), key=repr)),
                self.numerics,
                self.fp8,
                self.monitor,
            )
        )


def inductor_config(backend: object, mode: str | None, options: Mapping[str, Any] | None) -> dict[str, Any]:
    """torch.compile's ``mode=``/``options=`` as inductor config patches (checked against ``backend``)."""
    if (mode is not None or options) and backend != "inductor":
        raise ValueError(f"amp_fx: mode= and options= configure inductor (inductor options), but backend={backend!r}")
    config = dict(torch._inductor.list_mode_options(mode)) if mode else {}
    config.update(options or {})
    return config


def check_backend(backend: object) -> None:
    """Raise at build time for a backend torch.compile would only reject at the first call."""
    if callable(backend):
        return
    if not isinstance(backend, str):
        raise TypeError(
            f"amp_fx: backend must be a torch.compile backend name (a str such as "
            f"'inductor', 'aot_eager', 'eager') or a callable, got {backend!r} "
            f"({type(backend).__name__})"
        )
    known = torch._dynamo.list_backends(exclude_tags=())
    if backend not in known:
        raise ValueError(f"amp_fx: unknown backend {backend!r}; torch.compile knows {sorted(known)}")
