"""A compiled model's call: each call of ``amp_fx.compile``'s result runs here.

:func:`amp_call` compiles the target once per pattern of leaf arguments (through Dynamo, with an
:class:`~amp_fx.backend.AmpBackend`), runs it inside ``torch.autocast`` on the call's device, and
checks what the call did against what was asked (:mod:`amp_fx.backend.audit`). Every step here is
paid on every call (docs/call-overhead.md has the measurements).
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch._dynamo
from torch.utils._pytree import tree_flatten

from amp_fx._common.autocast import in_own_autocast
from amp_fx._common.compat import dynamo_folds_is_exporting, is_exporting_as_eager
from amp_fx._common.devices import DEVICES, autocast_device_type
from amp_fx._common.downstream import BACKWARD_BACKENDS
from amp_fx._common.dtype_names import dtype_name
from amp_fx._common.fresh_code import calls_forward_only, fresh_callable, fresh_forward
from amp_fx.backend.audit import report_no_graph, report_root_outside_graphs, report_unused_policy
from amp_fx.backend.compiler import AmpBackend
from amp_fx.errors import AmpFxError
from amp_fx.passes.capture import is_cacheable_leaf

if TYPE_CHECKING:
    from amp_fx._dist.fp8_gather import GatheredFp8Weights

__all__ = ["amp_call", "checked_units"]


def _module_device_type(module: torch.nn.Module) -> str:
    """The autocast device of the module's first parameter (or buffer); cpu if it has none.

    Only the first: walking every submodule on each call costs more than the call itself for
    small models, and a module split across cpu and cuda is not something autocast handles.
    """
    first = next(itertools.chain(module.parameters(), module.buffers()), None)
    return autocast_device_type([first] if first is not None else [])


class _ModuleDevice:
    """:func:`_module_device_type` of one module, at the cost of a dict lookup per call.

    Finding the first parameter walks every submodule (about 4.5 us for a 3-layer MLP, a fifth of
    amp_fx's whole per-call overhead). The tensor found is remembered with the dict that holds it
    and its key there: while that entry still holds the same tensor, its device is the answer
    (``module.to()`` moves it in place, or swaps its contents); a parameter replaced by another
    object (``to()`` under ``torch.__future__.set_overwrite_module_params_on_conversion``, a
    reassigned attribute) makes the next call search again.
    """

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module
        self._found: tuple[dict[str, Any], str, torch.Tensor] | None = None

    def __call__(self) -> str:
        found = self._found
        if found is not None and found[0].get(found[1]) is found[2]:
            if found[2].is_cpu:  # without .device, a sixth of its cost
                return "cpu"
            device_type = found[2].device.type
            if device_type in DEVICES:
                return device_type
        self._found = self._first()
        return _module_device_type(self.module)

    def _first(self) -> tuple[dict[str, Any], str, torch.Tensor] | None:
        modules = list(self.module.modules())
        for table in ("_parameters", "_buffers"):  # parameters first, as _module_device_type
            for m in modules:
                for name, t in getattr(m, table).items():
                    if t is not None:
                        return getattr(m, table), name, t
        return None


# Types tree_flatten never looks into: a call whose arguments are all of these needs no flattening.
_FLAT_TYPES = frozenset({torch.Tensor, torch.nn.Parameter, int, float, bool, complex, str, bytes, type(None)})


def _call_tensors(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
    """The tensors of a call's arguments, in ``tree_flatten((args, kwargs))`` order.

    Arguments that are plain tensors and scalars (a model's usual call) are read directly:
    ``tree_flatten`` costs about 5 us a call, a fifth of amp_fx's per-call overhead before this
    shortcut. Anything else (containers, other objects) goes through ``tree_flatten``.
    """
    for v in itertools.chain(args, kwargs.values()):
        if type(v) not in _FLAT_TYPES:
            return [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
    return [v for v in itertools.chain(args, kwargs.values()) if isinstance(v, torch.Tensor)]


def amp_call(target: Callable[..., Any], backend: AmpBackend, *, check: bool = True) -> Callable[..., Any]:
    """Compile ``target`` with ``backend`` and call it inside ``torch.autocast``.

    The captured graphs run with autocast off and their casts explicit (AmpBackend). The ambient
    autocast serves two other purposes: code that Dynamo leaves to eager (graph breaks, skipped
    modules such as nn.LSTM) runs under eager autocast, exactly as without amp_fx; and Dynamo's
    own fake propagation sees autocast's dtypes, so Python code that reads ``x.dtype`` (e.g.
    ``h.to(x.dtype)`` in an RMSNorm) is specialised to the dtype the tensor has at run time.

    Dynamo compiles a code object of this target's own (see :mod:`amp_fx._common.fresh_code`), so its
    cache entries are this target's alone and the 9th compiled model compiles like the first.

    Whether a tensor argument is a leaf that requires grad decides whether its cast is shared
    (eager autocast's cast cache), and Dynamo does not guard on leafness: each pattern of leaf
    arguments gets its own compiled callable, with a backend that shares the records.
    amp_fx's own errors are re-raised unwrapped from Dynamo's BackendCompilerFailed.

    After each call, what was done is checked against what was asked (through the backend's
    reporter): a call that ran no graph is reported, and after the first call that captured
    graphs, each policy entry that matched no op.

    Every call pays for this over ``torch.compile`` under ``torch.autocast``, so each step is
    cheap (docs/call-overhead.md has the measurements): "ran no graph" is a run counter the
    backend's graphs bump, compared on every call (the outputs are scanned only when it did not
    move); the call's tensors are read without ``tree_flatten`` when the arguments are plain
    (:func:`_call_tensors`); the model's device is remembered with the parameter it was read
    from (:class:`_ModuleDevice`).
    """
    compiled_by_leaves: dict[tuple[object, ...], Callable[..., Any]] = {}
    backends: list[AmpBackend] = []  # Dynamo holds them weakly (AmpBackend.for_dynamo): this call owns them
    dynamo_folds_is_exporting()  # found once, here, outside any trace (is_exporting_as_eager reads it)
    compile_kwargs = backend.options.torch_compile
    own_call = fresh_callable(target)
    # A module is compiled from a copy of its own forward where calling it is calling forward
    # (no hooks): Dynamo's names are then those of torch.compile(module) (L['x'], not L['args'][0]).
    own_forward = fresh_forward(target) if isinstance(target, torch.nn.Module) else None
    module_device = _ModuleDevice(target) if isinstance(target, torch.nn.Module) else None
    policy_checked = False

    def call(*args: Any, **kwargs: Any) -> Any:
        nonlocal policy_checked
        tensors = _call_tensors(args, kwargs)
        direct = own_forward is not None and calls_forward_only(target)  # type: ignore[arg-type]  # set for a module only
        leaves = (direct, *map(is_cacheable_leaf, tensors))
        device_type = autocast_device_type(tensors, default="")
        if device_type in ("", "cpu"):
            # a cuda model called with cpu inputs autocasts on cuda
            device_type = module_device() if module_device is not None else "cpu"
        compiled = compiled_by_leaves.get(leaves)
        clock = None
        if compiled is None:
            clock = backend.clock
            backward = torch.is_grad_enabled() and backend.options.backend_name in BACKWARD_BACKENDS
            clock.start(
                f"amp_fx: {backend.label}: compiling (backend {backend.options.backend_name}): the forward now"
                + (", its backward at the first backward" if backward else "")
                + "; a first step takes seconds to minutes (docs/compiled-step.md#the-first-step)"
            )
            if check and not torch.compiler.is_compiling():
                _check_outer_autocast(backend, device_type)
            sibling = backend if not compiled_by_leaves else backend.sibling()
            backends.append(sibling)
            compiled = compiled_by_leaves[leaves] = torch.compile(
                own_forward if direct else own_call, backend=sibling.for_dynamo(), **compile_kwargs
            )
        runs = backend.runs.count
        if check and backend.monitor is not None:
            backend.monitor.begin_call()  # one step of the fp8 monitor's schedule (host-side)
        try:
            with torch.autocast(device_type, dtype=backend.dtype), is_exporting_as_eager():
                if backend.weight_cache is None:
                    out = compiled(*args, **kwargs)
                else:
                    with backend.weight_cache.forward():
                        out = compiled(*args, **kwargs)
        except torch._dynamo.exc.BackendCompilerFailed as e:
            inner = getattr(e, "inner_exception", None)
            if isinstance(inner, (AmpFxError, ValueError)):
                raise inner from inner.__cause__  # its own cause kept (a fallen-back stage's), Dynamo's wrapper dropped
            raise
        finally:
            if clock is not None:
                clock.stop()
        if not check or (policy_checked and backend.runs.count != runs) or torch.compiler.is_compiling():
            return out  # checked by the caller; ran graphs, policy checked; traced by an enclosing torch.compile
        policy_checked = _check_call(backend, target, runs, out, tensors, policy_checked)
        return out

    if not isinstance(target, torch.nn.Module):
        call = functools.wraps(target)(call)
    return call


def _check_outer_autocast(backend: AmpBackend, device_type: str) -> None:
    """A compiling call made inside the user's own ``torch.autocast`` on the same device: amp_fx
    casts to its own dtype whatever the outer autocast says, so a different dtype is ignored
    (said once; strict mode: an error) and the same dtype is redundant (a note). Checked when a
    call compiles, not on every call (docs/call-overhead.md)."""
    if in_own_autocast() or not torch.is_autocast_enabled(device_type):
        return
    outer = torch.get_autocast_dtype(device_type)
    ours = dtype_name(backend.dtype)
    if outer != backend.dtype:
        backend.reporter.did_less(
            ("outer autocast", outer),
            (
                f"amp_fx: {backend.label} was compiled with dtype={ours!r} and is called inside "
                f"torch.autocast({device_type!r}, dtype={outer}): the outer autocast is ignored, the model "
                f"runs in {ours}. Drop the torch.autocast around the call (amp_fx casts itself), or "
                f"compile with dtype={dtype_name(outer)!r} if that is the dtype you want."
            ),
        )
    else:
        backend.reporter.notice(
            ("outer autocast", outer),
            (
                f"amp_fx: {backend.label} is called inside torch.autocast({device_type!r}, dtype={outer}), "
                f"which amp_fx opens itself: the outer autocast is redundant and can be dropped."
            ),
        )


def _check_call(
    backend: AmpBackend,
    target: object,
    runs: int,
    out: Any,
    tensors: list[torch.Tensor],
    policy_checked: bool,
    outside: Sequence[tuple[str, type]] = (),
) -> bool:
    """What one call did against what was asked: a call that ran no graph is reported, and after
    the first call that ran graphs, each policy entry that matched no op (``outside``: modules
    already reported as run outside every graph). Returns whether the policy has been checked."""
    if backend.runs.count == runs:
        if _computed_floats(out, tensors):
            report_no_graph(backend.reporter, target)
        return policy_checked
    if not policy_checked:
        report_unused_policy(
            backend.records, backend.options.policy, backend.reporter, fp8=backend.options.fp8, outside=outside
        )
    return True


def checked_units(
    call: Callable[..., Any],
    module: torch.nn.Module,
    backend: AmpBackend,
    *,
    gathered: GatheredFp8Weights | None = None,
    root_own: Sequence[str] = (),
    in_regions: bool = False,
) -> Callable[..., Any]:
    """A DDP/FSDP2 model's call (or one compiled in regions), checked once the whole model ran
    (each unit alone runs only part of the policy's modules); ``gathered``: its weights
    all-gathered in fp8, checked against the fp8 matmuls of the graphs captured so far;
    ``root_own``: the root's own modules that hold state outside every other unit
    (``amp_fx._dist.capture.root_state_modules``), each reported if the first call's graphs ran
    none of its ops (Dynamo skipped the frame that runs it); ``in_regions``: the units are the
    model's compiled regions (``amp_fx/backend/regions.py``), not FSDP2's, and the report says
    so. The fp8 weights are checked at every call once a graph has run: an eager read can come
    later (a branch taken at step 100)."""
    policy_checked = False

    def checked(*args: Any, **kwargs: Any) -> Any:
        nonlocal policy_checked
        runs = backend.runs.count
        out = call(*args, **kwargs)
        outside: Sequence[tuple[str, type]] = ()
        if root_own and not policy_checked and backend.runs.count != runs:
            outside = report_root_outside_graphs(
                backend.records, module, root_own, backend.reporter, in_regions=in_regions
            )
        policy_checked = _check_call(backend, module, runs, out, _call_tensors(args, kwargs), policy_checked, outside)
        if gathered is not None and backend.records:
            gathered.check(backend.records, backend.reporter)
        return out

    return checked


def _computed_floats(out: Any, inputs: list[torch.Tensor]) -> bool:
    """Whether a call returned a floating-point tensor it computed (not one of its inputs): a
    call that returns its input or only integers had nothing for amp_fx to compile."""
    given = {id(t) for t in inputs}
    return any(
        isinstance(t, torch.Tensor) and t.is_floating_point() and id(t) not in given for t in tree_flatten(out)[0]
    )
