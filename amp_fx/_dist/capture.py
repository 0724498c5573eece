"""Capturing graphs of models wrapped by DDP or sharded by FSDP2.

Why ``torch.compile`` of such a model can capture nothing (torch 2.13, checked with gloo on CPU):

* ``DistributedDataParallel.forward`` calls the wrapped module inside ``_inside_ddp_forward``,
  which torch marks ``_disable_dynamo``: Dynamo gives up on the frame there and the wrapped
  module's forward runs as a frame of its own. When that module is a ``torch.nn`` class
  (``nn.Sequential``, ``nn.Linear``) Dynamo never starts a frame in it, so nothing is captured
  and the model runs as eager autocast. A user-defined module class is captured.
* ``fully_shard`` puts its all-gather and reshard in module hooks that are ``_dynamo_disable``-d,
  so Dynamo breaks at every sharded module's call. A ``torch.nn`` root (``nn.Sequential``) or
  ``torch.nn`` layers are again never captured.

What amp_fx does instead (the pattern torch's own FSDP2 recipes use: compile each sharded unit,
run the hooks eagerly): the wrapper's ``__call__`` runs eagerly, so DDP's reducer and FSDP2's
hooks do exactly what they do without amp_fx, and the ``forward`` of each *unit* is compiled:
for DDP the wrapped module, for FSDP2 every module ``fully_shard`` was applied to, plus the root.
During the call each unit's ``forward`` is replaced, on the instance and only for the duration
of the call, by the compiled one; the model is left as it was. All units of one model share one
compiled function (so units of one class share Dynamo cache entries) and one record list.

Under DDP the compiled forward runs inside ``_inside_ddp_forward``, so Dynamo's DDPOptimizer
splits the graph at DDP's bucket boundaries, exactly as for ``DDP(torch.compile(m))``.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeGuard

import torch

from amp_fx._common.running_unit import unit_running
from amp_fx._dist.fp8_gather import GatheredFp8Weights

__all__ = [
    "FSDP1_ALTERNATIVE",
    "distributed_units",
    "is_fsdp1",
    "module_device_type",
    "root_linears",
    "root_state_modules",
    "unit_call",
    "unsharded_class_name",
]


def _fsdp_module_type() -> type | None:
    if not torch.distributed.is_available():
        return None
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch builds without FSDP2
        return None
    return FSDPModule


def is_fsdp1(model: torch.nn.Module) -> bool:
    """Whether ``model`` is, or contains, a ``FullyShardedDataParallel`` (FSDP1) wrapper."""
    if not torch.distributed.is_available():
        return False
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:
        return False
    return any(isinstance(m, FullyShardedDataParallel) for m in model.modules())


FSDP1_ALTERNATIVE = (
    "shard with FSDP2 instead: torch.distributed.fsdp.fully_shard on each block, then on the root "
    "(DTensor parameters; amp_fx.compile, amp_fx.GradScaler and amp_fx.compile_step support it)"
)


def _is_ddp(module: torch.nn.Module) -> TypeGuard[torch.nn.parallel.DistributedDataParallel]:
    return torch.distributed.is_available() and isinstance(module, torch.nn.parallel.DistributedDataParallel)


def distributed_units(module: torch.nn.Module) -> list[torch.nn.Module] | None:
    """The modules whose ``forward`` amp_fx compiles, or None for a model without DDP/FSDP2.

    DDP: the wrapped module (``ddp.module``). FSDP2: every module that ``fully_shard`` was
    applied to, and the root, in ``named_modules`` order (root first).
    """
    if _is_ddp(module):
        return [module.module]
    fsdp = _fsdp_module_type()
    if fsdp is None:
        return None
    sharded = [m for m in module.modules() if isinstance(m, fsdp)]
    if not sharded:
        return None
    return sharded if sharded[0] is module else [module, *sharded]


def root_linears(module: torch.nn.Module, units: list[torch.nn.Module]) -> list[torch.nn.Module]:
    """The ``nn.Linear`` modules of the root unit itself (outside every other unit), for FSDP2
    models whose root has sharded submodules; compiled as units of their own under ``fp8=``.

    The root's forward calls the sharded units, and Dynamo breaks its graph at each call (FSDP2's
    hooks); a break inside a loop (``for block in self.blocks``, ``nn.Sequential``) makes Dynamo
    skip the whole frame, so the root's own matmuls (a Llama's ``lm_head``) would run as eager
    autocast: bf16, not fp8, and their weights could not be all-gathered in fp8. Compiled as
    units, they are captured wherever the root's frame runs (a captured root breaks its graph at
    them, as at the sharded units).
    """
    if len(units) < 2 or units[0] is not module:
        return []
    others = {id(u) for u in units[1:]}
    found: dict[int, torch.nn.Module] = {}

    def walk(m: torch.nn.Module) -> None:
        for child in m.children():
            if id(child) in others or id(child) in found:
                continue
            if isinstance(child, torch.nn.Linear):
                found[id(child)] = child
            else:
                walk(child)

    walk(module)
    return list(found.values())


def root_state_modules(module: torch.nn.Module, units: list[torch.nn.Module]) -> list[str]:
    """The names under the root of the FSDP2 root's own modules that hold parameters or buffers
    (outside every other unit; ``""``: the root itself), for models whose root has sharded
    submodules; empty otherwise (DDP, a root that is the only unit).

    Their ops run in the root's frame, or in the frame of a module between the root and the
    units. That frame calls the sharded units, and Dynamo breaks its graph at each call (FSDP2's
    hooks); a break inside a loop (``for block in self.blocks``, ``nn.Sequential``) makes Dynamo
    skip the whole frame, and the ops run as eager autocast, outside every graph amp_fx sees.
    A module here that no op of the first call's graphs ran inside is reported
    (``amp_fx.backend.audit.report_root_outside_graphs``). Holding state is what says the module
    computes something when called (a ReLU or Dropout of an ``nn.Sequential`` root may run no op
    amp_fx would change).
    """
    if len(units) < 2 or units[0] is not module:
        return []
    others = {id(u) for u in units[1:]}
    found: list[str] = []
    seen: set[int] = set()

    def owns_state(m: torch.nn.Module) -> bool:
        return any(t is not None for t in (*m._parameters.values(), *m._buffers.values()))

    def walk(m: torch.nn.Module, prefix: str) -> None:
        for name, child in m.named_children():
            if id(child) in others or id(child) in seen:
                continue
            seen.add(id(child))
            if owns_state(child):
                found.append(prefix + name)
            walk(child, f"{prefix}{name}.")

    if owns_state(module):
        found.append("")
    walk(module, "")
    return found


def unsharded_class_name(module: torch.nn.Module) -> str:
    """The name of the module's own class: ``fully_shard`` swaps it for ``FSDP<name>``."""
    fsdp = _fsdp_module_type()
    if fsdp is None or not isinstance(module, fsdp):
        return type(module).__name__
    return next(c.__name__ for c in type(module).__mro__ if not issubclass(c, fsdp))


# Where a unit's own per-instance ``forward`` waits while amp_fx's compiled one stands in for it.
_OWN_FORWARD = "_amp_fx_own_forward"


def _unit_forward(module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    # A forward set on the instance runs, not the class's: torchtitan's ``Module.parallelize``
    # installs one that redistributes the inputs and outputs (TP's DTensor layouts) around the
    # class's forward; skipping it fed a plain tensor to an op whose weight is a DTensor.
    own = getattr(module, _OWN_FORWARD, None)
    if own is not None:
        return own(*args, **kwargs)
    return type(module).forward(module, *args, **kwargs)


def _fresh_unit_forward(group: str) -> Callable[..., Any]:
    """A copy of ``_unit_forward`` with its own code object, named after the unit class (``group``:
    the class name, with a suffix for a second group of one class, a block the policy treats
    differently from its siblings).

    Dynamo keeps its cache entries (at most ``recompile_limit``) on the code object; a copy per
    compiled model and unit class keeps one model's units from using up another's entries. The
    name matters too: Dynamo's automatic dynamic shapes keep their record of the sizes seen by
    the code's file, line and *name* (``torch._dynamo.pgo.CodeId``), so copies under one name
    shared it. A root called with token ids (2-D) beside a block called with activations (3-D)
    then made the next unit's inputs symbolic at its first compile; torchtitan's TP units passed
    DTensors with symbolic sizes, which amp_fx cannot fakify (DTensor's sharding propagation
    hashes the sizes: "unhashable type: non-nested SymInt"), and the fallback hit a RecursionError.
    """
    name = f"{_unit_forward.__name__}_{group}"
    code = _unit_forward.__code__
    if sys.version_info >= (3, 11):  # co_qualname is new in 3.11
        code = code.replace(co_name=name, co_qualname=name)
    else:
        code = code.replace(co_name=name)
    fn = types.FunctionType(code, _unit_forward.__globals__, name)
    fn.__qualname__ = name
    return fn


@contextmanager
def _forwards_replaced(
    units: list[torch.nn.Module], forward_of: Callable[[torch.nn.Module], Callable[..., Any]]
) -> Iterator[None]:
    saved = [u.__dict__.get("forward") for u in units]
    for u, old in zip(units, saved):
        if old is not None:
            u.__dict__[_OWN_FORWARD] = old
        u.__dict__["forward"] = forward_of(u)
    try:
        yield
    finally:
        for u, old in zip(units, saved):
            if old is None:
                u.__dict__.pop("forward", None)
            else:
                u.__dict__["forward"] = old
                u.__dict__.pop(_OWN_FORWARD, None)


@contextmanager
def _eager_call(module: torch.nn.Module) -> Iterator[None]:
    """``module(...)`` runs nn.Module's own call, hooks and all, while amp_fx's compiled call set by
    ``amp_fx.compile(module, inplace=True)`` (``_compiled_call_impl``) stands aside: that compiled
    call is the one running this, and calling it again recursed without end (torchtitan's
    integration compiles its FSDP2 model in place)."""
    own = module.__dict__.pop("_compiled_call_impl", None)
    try:
        yield
    finally:
        if own is not None:
            module.__dict__["_compiled_call_impl"] = own


def unit_call(
    module: torch.nn.Module,
    units: list[torch.nn.Module],
    compile_fn: Callable[[Callable[..., Any]], Callable[..., Any]],
    dtype: torch.dtype,
    *,
    gathered: GatheredFp8Weights | None = None,
    group_of: Callable[[torch.nn.Module], tuple[object, str]] | None = None,
    first_output: Callable[[str, Any], None] | None = None,
) -> Callable[..., Any]:
    """The forward of a compiled DDP/FSDP2 model, or of a model compiled in regions
    (``amp_fx/backend/regions.py``): ``module.__call__`` eagerly, units compiled.

    ``compile_fn`` turns a function into amp_fx's compiled callable of it (``amp_fx.compile``'s
    call wrapper: autocast around it, one Dynamo cache per leaf pattern, amp_fx errors
    unwrapped); it is called once per unit class, so the units of one class (a model's
    transformer blocks) share one compiled function, and one record list through the backend.
    Units of different classes get code objects and names of their own (:func:`_fresh_unit_forward`):
    each class has Dynamo's ``recompile_limit`` cache entries and its record of the sizes seen
    (automatic dynamic shapes) to itself. ``group_of``: a unit's group (the units that share one
    compiled function) and its name in the code objects; default: its class. While a unit runs,
    its name under ``module`` is the running unit (``amp_fx._common.running_unit``): the graphs
    its group shares are named after the unit that compiled them, and the overflow watch renames
    their modules for the unit that runs them. ``gathered``: the FSDP2
    weights all-gathered in fp8 (``amp_fx._dist.fp8_gather``), whose scales are computed before
    each call, before FSDP2's first all-gather. ``first_output``: called with each unit's name and
    output on the unit's first call (regions: the gradient layout check,
    ``amp_fx.backend.regions.check_gradient_layout``).
    """
    _check_fsdp_mixed_precision(units, dtype)
    if group_of is None:
        group_of = _class_group
    by_group: dict[object, Callable[..., Any]] = {}
    names: dict[int, str] = {}
    for name, m in module.named_modules(remove_duplicate=False):  # a shared module: its first name
        names.setdefault(id(m), name)
    forwards: dict[int, Callable[..., Any]] = {}

    def compiled_for(unit: torch.nn.Module) -> Callable[..., Any]:
        group, group_name = group_of(unit)
        compiled = by_group.get(group)
        if compiled is None:
            # Dynamo would otherwise compile the wrapper's own frame as part of the enclosing unit's
            # (after the graph break at FSDP2's hooks), where the unit is only ``args[0]``, and the
            # helpers it calls as frames of their own; skipping them lets each unit's forward be
            # compiled as a frame of its own, so its ops are attributed to the unit's name under the
            # root (Policy.keep_fp32 by name). The torch.compile inside still compiles.
            compiled = by_group[group] = compile_fn(_fresh_unit_forward(group_name))
        return compiled

    def forward_of(unit: torch.nn.Module) -> Callable[..., Any]:
        found = forwards.get(id(unit))
        if found is None:
            compiled, name = compiled_for(unit), names.get(id(unit), "")

            first = [first_output]

            @torch._dynamo.disable
            def forward(*args: Any, **kwargs: Any) -> Any:
                with unit_running(name):
                    out = compiled(unit, *args, **kwargs)
                if first[0] is not None:
                    first[0], check = None, first[0]
                    check(name, out)
                return out

            found = forwards[id(unit)] = forward
        return found

    device_type = module_device_type(module)

    def call(*args: Any, **kwargs: Any) -> Any:
        if gathered is not None:
            gathered.precompute_scales()  # the weights changed since the last call (optimizer step)
        with _forwards_replaced(units, forward_of), _eager_call(module):
            # The ambient autocast covers what runs between the units (DDP's and FSDP2's
            # hooks, and code Dynamo leaves to eager) exactly as eager autocast would.
            with torch.autocast(device_type, dtype=dtype):
                return module(*args, **kwargs)

    return call


def _class_group(unit: torch.nn.Module) -> tuple[object, str]:
    return type(unit), type(unit).__name__


def _check_fsdp_mixed_precision(units: list[torch.nn.Module], dtype: torch.dtype) -> None:
    """How FSDP2's ``MixedPrecisionPolicy`` composes with amp_fx: FSDP2 casts storage and
    communication, amp_fx casts compute.

    * ``param_dtype=None`` (or float32): parameters are gathered in fp32 and amp_fx casts them
      for each op as eager autocast does.
    * ``param_dtype`` equal to amp_fx's dtype: parameters are gathered already in low precision
      (half the all-gather bytes); amp_fx's casts of them fold away, and ops autocast runs in
      fp32 still get fp32 inputs. Bitwise with eager FSDP2 + the same policy + autocast.
    * any other ``param_dtype`` is refused: every weight would be rounded to one low-precision
      format by FSDP2 and then to the other by the autocast policy.

    ``reduce_dtype`` and ``output_dtype`` are FSDP2's business and compose unchanged.
    """
    fsdp = _fsdp_module_type()
    if fsdp is None:
        return
    for unit in units:
        if not isinstance(unit, fsdp):
            continue
        param_dtype = unit._get_fsdp_state()._mp_policy.param_dtype  # type: ignore[operator]  # FSDPModule, mixed in by fully_shard
        if param_dtype in (None, torch.float32, dtype):
            continue
        raise ValueError(
            f"amp_fx: {type(unit).__name__} was sharded with MixedPrecisionPolicy(param_dtype="
            f"{param_dtype}) but amp_fx.compile was given dtype={dtype}: each weight would be "
            f"rounded to {param_dtype} by FSDP2, then to {dtype} by the autocast policy. Use "
            f"param_dtype={dtype} (low-precision all-gather) or param_dtype=None (fp32 storage, "
            "amp_fx casts for compute)"
        )


def module_device_type(module: torch.nn.Module) -> str:
    for t in module.parameters():
        local = t.to_local() if hasattr(t, "to_local") else t
        return "cuda" if local.is_cuda else "cpu"
    return "cpu"
