"""The weight-cast cache: each fp32 parameter's low-precision copy, cast once per optimizer step.

Eager autocast, ``torch.compile`` under autocast and amp_fx without this cache cast every fp32
weight to bf16/fp16 in every forward (4 bytes read, 2 written per parameter), again for every
micro-batch of an accumulation window, and again in every graph after a graph break.
``amp_fx.compile(..., weight_cache=True)`` keeps one low-precision copy per (parameter, dtype)
and recasts it only when the fp32 weight changed.

How the graphs get the copy (see :mod:`amp_fx.passes.lift_weight_casts`): each captured graph's
shared cast of a parameter (eager autocast's cast cache, reproduced by ``insert_casts``) is
replaced by extra graph inputs, one per use. At run time :class:`WeightCache` fills them, once
per forward (the compiled module's call), with the output of :class:`_CachedCast`: an autograd
node whose forward returns the cached copy and whose backward casts the summed low-precision
gradient to fp32. Every use in every graph of the forward gets the same node, and each graph's
backward returns one gradient per use, so the autograd engine adds all of them into that node's
buffer one by one, in the order eager autocast's cached cast gets them (latest use first, graph
breaks included), before one cast back to fp32: parity stays bitwise. A weight that is also used
in fp32 (an embedding tied to the output projection) has its fp32 uses lifted too where the order
of its contributions matters, each fed through a node of its own (:class:`_Use`), the nodes of a
graph made in the order eager makes them: the engine then adds the cast's and the fp32 uses'
contributions into the weight's ``.grad`` in eager's order.

With ``fp8=``, an fp8 matmul's weight casts (amax, scale, fp8 data; :meth:`WeightCache.fp8_casts`)
are cached the same way, keyed by recipe and the views the matmul reads the weight through;
they carry no gradient. ``compile_step``'s finish graph does not rewrite them: the next forward
recomputes them, once.

When a copy is stale (any of these makes it so; checked on the host, no device sync):

* the parameter's version counter moved (``optimizer.step()`` of non-fused optimizers,
  ``load_state_dict``, any in-place edit under ``no_grad``);
* its storage is another one, or was freed (``.to()``, ``.data =``, ``swap_tensors``), or its
  dtype, device, shape, strides or offset changed (checked through a weak reference to the
  storage, so a reused address cannot pass for the old storage);
* an optimizer holding it stepped (a global step post-hook): torch's fused optimizers
  (``fused=True``) update parameters in place *without* bumping their version counters.

Not detectable cheaply, hence documented: in-place edits through ``param.data`` (a new version
counter, autograd's own checks miss them too) and fused kernels run outside a
``torch.optim.Optimizer``. Call :meth:`WeightCache.invalidate` after those.

Not cached, hence said (:func:`report_uncached_experts`; an error in strict mode): the
low-precision casts of grouped expert weights (MoE layers' ``[E, K, N]`` parameters in a grouped
GEMM the fp8 pass converted, any recipe). Their kernels quantize the weight inside the GEMM and
have no cached-weight twin yet, so each forward quantizes them again: the same values (bitwise
either way), one quantization per micro-batch. Kept out of low precision, their bf16 copies are
cached as any weight's.

Not supported, hence refused (:func:`weight_cache_off_for_fsdp2`): FSDP2 models.
FSDP2 all-gathers each parameter into the same unsharded tensor every forward without bumping its
version counter, and its optimizer steps the sharded parameters. DDP is supported: every rank
holds and updates whole fp32 parameters, and DDP's reducer hooks sit on their AccumulateGrad
nodes, which :class:`_CachedCast`'s backward feeds as eager autocast's cast does.

Inside ``compile_step`` the copy is written by the compiled finish graph right after the masked
optimizer update (:meth:`WeightCache.pairs` / :meth:`WeightCache.revalidate`), and right after a
fused optimizer's kernel, so the next forward casts nothing.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils.weak import WeakIdKeyDictionary

from amp_fx._common.compat import local_tensor
from amp_fx._common.report import Reporter
from amp_fx._dist.capture import distributed_units
from amp_fx.kernels.fp8_matmul import weight_casts
from amp_fx.passes.fp8_matmuls import Fp8Decision
from amp_fx.passes.lift_weight_casts import Fp8WeightCast, Lifted
from amp_fx.policy import Policy

__all__ = [
    "WeightCache",
    "StepWriter",
    "LOW_DTYPES",
    "weight_cache_applies",
    "weight_cache_off_for_fsdp2",
    "report_uncached_experts",
]

LOW_DTYPES = (torch.bfloat16, torch.float16)
_GROUPED_OPS = ("aten._grouped_mm", "transformers.grouped_mm_fallback")
"""The grouped expert GEMMs as :class:`~amp_fx.passes.fp8_matmuls.Fp8Decision` names them."""


class _CachedCast(torch.autograd.Function):
    """One forward's use of a cached low-precision copy of ``weight``.

    forward: returns an alias of ``lowp`` (no copy; a fresh tensor object per forward, so each
    forward has its own autograd node). backward: the low-precision gradient, already summed over
    every use in every graph by the autograd engine (each graph hands it one gradient per use),
    cast to the weight's dtype: eager autocast's ``ToCopyBackward`` on its cached cast.
    """

    @staticmethod
    def forward(ctx: Any, weight: torch.Tensor, lowp: torch.Tensor) -> torch.Tensor:
        ctx.weight_dtype = weight.dtype
        return lowp.detach()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor | None) -> tuple[torch.Tensor | None, None]:
        return (None if grad is None else grad.to(ctx.weight_dtype)), None


class _Use(torch.autograd.Function):
    """One fp32 use of a weight in a graph, as a node of its own: the graph's gradient for this
    use reaches the weight's ``AccumulateGrad`` through it, in the order eager's node for the
    use would (see :mod:`amp_fx.passes.lift_weight_casts`). forward: an alias; backward: identity."""

    @staticmethod
    def forward(ctx: Any, weight: torch.Tensor) -> torch.Tensor:
        return weight.detach()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


def _version(t: torch.Tensor) -> Any:
    """``t``'s version counter; a DTensor's with its local tensor's: an in-place op through
    DTensor's dispatch bumps the DTensor's counter only, and ``compile_step``'s finish updates the
    local tensor of a sharded parameter directly (amp_fx/_dist/step.py), which bumps the local
    tensor's only."""
    local = local_tensor(t)
    return t._version if local is t else (t._version, local._version)


def _layout(t: torch.Tensor) -> tuple[Any, ...]:
    return t.dtype, t.device, tuple(t.shape), t.stride(), t.storage_offset()


@dataclass
class _Entry:
    lowp: Any
    """The low-precision copy, or an fp8 matmul's weight casts (a tuple of tensors)."""
    version: Any
    """The weight's :func:`_version` when the copy was made; -1 marks it stale."""
    storage: StorageWeakRef
    layout: tuple[Any, ...]

    def fresh_for(self, weight: torch.Tensor) -> bool:
        if _version(weight) != self.version or self.storage.expired():
            return False
        return self.storage.cdata == weight.untyped_storage()._cdata and self.layout == _layout(weight)


class _ForwardState(threading.local):
    def __init__(self) -> None:
        self.depth = 0
        # (id(weight), dtype) -> (weight, this forward's node output)
        self.uses: dict[tuple[int, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}


_CACHES: weakref.WeakSet[WeightCache] = weakref.WeakSet()
_HOOK: Any = None


def _after_optimizer_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """Fused optimizers do not bump version counters: every optimizer step invalidates its params."""
    if not _CACHES:
        return
    params = [p for g in optimizer.param_groups for p in g["params"]]
    for cache in list(_CACHES):
        cache._mark_stale(params)


def _install_step_hook() -> None:
    global _HOOK
    if _HOOK is None:
        from torch.optim.optimizer import register_optimizer_step_post_hook

        _HOOK = register_optimizer_step_post_hook(_after_optimizer_step)


class WeightCache:
    """Low-precision copies of fp32 parameters for one compiled model (or compiled step).

    ``refreshes`` counts the casts it computed (one per stale (parameter, dtype) per forward),
    ``hits`` the forwards that reused a copy; both are host counters.
    """

    def __init__(self) -> None:
        self._entries: WeakIdKeyDictionary = WeakIdKeyDictionary()  # weight -> {dtype or (fp8 recipe, views): _Entry}
        self._forward = _ForwardState()
        self.refreshes = 0
        self.hits = 0
        _CACHES.add(self)
        _install_step_hook()

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor the cache holds now: low-precision copies and fp8 casts (data and scales)."""
        out: list[torch.Tensor] = []
        for per_key in self._entries.values():
            for entry in per_key.values():
                out += (
                    [entry.lowp]
                    if isinstance(entry.lowp, torch.Tensor)
                    else [t for t in entry.lowp if isinstance(t, torch.Tensor)]
                )
        return out

    # ------------------------------------------------------------------ one forward
    @contextlib.contextmanager
    def forward(self) -> Iterator[None]:
        """One forward of the compiled model: every graph in it shares one node per weight.

        Nested calls join the outermost forward, as nested autocast regions share eager
        autocast's cache until the outermost one exits.
        """
        state = self._forward
        state.depth += 1
        try:
            yield
        finally:
            state.depth -= 1
            if state.depth == 0:
                state.uses.clear()

    def lowp(self, weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The low-precision copy of ``weight`` to feed a graph in the current forward."""
        if not isinstance(weight, torch.nn.Parameter) or weight.dtype != torch.float32:
            return weight.to(dtype)  # not a parameter: an ordinary cast, as the graph had
        state = self._forward
        key = (id(weight), dtype)
        use = state.uses.get(key)
        if use is not None and use[0] is weight:
            return use[1]
        copy = self._fresh(weight, dtype)
        if torch.is_grad_enabled() and weight.requires_grad:
            out = _CachedCast.apply(weight, copy)
        else:
            out = copy.detach()
        if state.depth > 0:
            state.uses[key] = (weight, out)
        return out

    def _fresh(self, weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        per_dtype = self._entries.get(weight)
        if per_dtype is None:
            per_dtype = self._entries[weight] = {}
        entry = per_dtype.get(dtype)
        if entry is not None and entry.fresh_for(weight):
            self.hits += 1
            return entry.lowp
        with torch.no_grad():
            lowp = weight.detach().to(dtype)  # a new tensor: a pending backward may hold the old one
        per_dtype[dtype] = _Entry(lowp, _version(weight), StorageWeakRef(weight.untyped_storage()), _layout(weight))
        self.refreshes += 1
        return lowp

    def fp8_casts(self, weight: torch.Tensor, cast: Fp8WeightCast) -> tuple[torch.Tensor, ...]:
        """The fp8 casts of ``weight`` for an fp8 matmul (:func:`amp_fx.kernels.fp8_matmul.weight_casts`
        of ``cast.operand(weight)``), computed when stale, as a low-precision copy is. They carry no
        gradient: the matmul's weight-gradient GEMM reads the input and the output gradient."""
        per_key = self._entries.get(weight)
        if per_key is None:
            per_key = self._entries[weight] = {}
        key = (cast.recipe, cast.views, cast.nvfp4)
        entry = per_key.get(key)
        if entry is not None and entry.fresh_for(weight):
            self.hits += 1
            return entry.lowp
        casts = weight_casts(cast.operand(weight.detach()), cast.recipe, cast.nvfp4)
        per_key[key] = _Entry(casts, _version(weight), StorageWeakRef(weight.untyped_storage()), _layout(weight))
        self.refreshes += 1
        return casts

    # ------------------------------------------------------------------ invalidation
    def invalidate(self, weights: Sequence[torch.Tensor] | None = None) -> None:
        """Drop the copies of ``weights`` (all if None): for edits no check can see (``p.data``)."""
        if weights is None:
            self._entries = WeakIdKeyDictionary()
        else:
            for w in weights:
                self._entries.pop(w, None)

    def _mark_stale(self, weights: Sequence[torch.Tensor]) -> None:
        for w in weights:
            per_dtype = self._entries.get(w)
            if per_dtype:
                for entry in per_dtype.values():
                    entry.version = -1

    # ------------------------------------------------------------------ written with the update
    def pairs(self, weights: Sequence[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(weight, copy) for every cached copy of ``weights``: what an update pass rewrites."""
        out = []
        for w in weights:
            for entry in (self._entries.get(w) or {}).values():
                if isinstance(entry.lowp, torch.Tensor):  # fp8 casts are recomputed by the next forward
                    out.append((w, entry.lowp))
        return out

    def is_fresh(self, weight: torch.Tensor, lowp: torch.Tensor) -> bool:
        """Whether the next forward would use ``lowp`` for ``weight`` as it is (no recast)."""
        return any(e.lowp is lowp and e.fresh_for(weight) for e in (self._entries.get(weight) or {}).values())

    @staticmethod
    def write(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Cast each updated weight into its copy, in place (traceable: runs inside the finish
        graph, right after the update, where the compiler can fuse it with the update)."""
        for w, lowp in pairs:
            local_tensor(lowp).copy_(local_tensor(w))  # a sharded weight and its copy: the same placements

    def versions(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> list[Any]:
        return [_version(w) for w, _ in pairs]

    def revalidate(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], versions: Sequence[Any]) -> None:
        """After :meth:`write`: the copies match the weights as they were at ``versions``; an
        entry stays stale if its weight moved since (a post-step hook edited it)."""
        for (w, lowp), version in zip(pairs, versions, strict=True):
            if _version(w) != version:
                continue
            for entry in (self._entries.get(w) or {}).values():
                if entry.lowp is lowp:
                    entry.version = version
                    entry.storage = StorageWeakRef(w.untyped_storage())
                    entry.layout = _layout(w)

    # ------------------------------------------------------------------ graphs
    def use(self, weight: torch.Tensor) -> torch.Tensor:
        """One fp32 use of ``weight`` with an autograd node of its own (:class:`_Use`)."""
        if torch.is_grad_enabled() and weight.requires_grad:
            return _Use.apply(weight)
        return weight.detach()

    def wrap(self, compiled: Callable[..., Any], lifted: Sequence[Lifted]) -> Callable[..., Any]:
        """A compiled graph whose lifted inputs (:class:`~amp_fx.passes.lift_weight_casts.Lifted`)
        are filled here: every use of a trainable weight's cast gets this forward's one node
        output, every lifted fp32 use a node of its own, the nodes made in eager's creation order
        (autograd runs the later-made first, and so adds their contributions in eager's order)."""
        if not lifted:
            return compiled
        order = sorted(range(len(lifted)), key=lambda j: lifted[j].created)

        def run(*args: Any) -> Any:
            fed: list[Any] = [None] * len(lifted)
            casts: dict[tuple[int, torch.dtype], torch.Tensor] = {}
            fp8: dict[tuple[Any, ...], tuple[torch.Tensor, ...]] = {}
            for j in order:
                i, dtype, _, fp8_cast = lifted[j]
                weight = args[i]
                if fp8_cast is not None:
                    key = (i, fp8_cast.recipe, fp8_cast.views, fp8_cast.nvfp4)
                    if key not in fp8:
                        fp8[key] = self.fp8_casts(weight, fp8_cast)
                    fed[j] = fp8[key][fp8_cast.part]
                    continue
                if dtype == weight.dtype:
                    fed[j] = self.use(weight)
                    continue
                # one node for all the uses even outside a forward() (a graph called on its own)
                if (i, dtype) not in casts:
                    casts[(i, dtype)] = self.lowp(weight, dtype)
                fed[j] = casts[(i, dtype)]
            return compiled(*args, *fed)

        run._boxed_call = getattr(compiled, "_boxed_call", False)  # type: ignore[attr-defined]  # AOT's boxed-calling flag, set on the function
        return run


class StepWriter:
    """How ``compile_step`` writes the cached copies in the same pass as the weight update.

    Non-fused optimizers: :meth:`in_finish` runs inside the compiled finish graph, right after the
    masked update, so the compiler sees ``lowp.copy_(w)`` next to the update of ``w`` (inductor
    fuses the two into one loop: the updated fp32 value is written and cast without a second
    read). Fused optimizers: their kernel cannot be traced, so :meth:`after_fused_step` casts right
    after it. On a skipped step (inf/NaN) the weights keep their bits and so does each copy: it is
    rewritten with the same values, no host read needed to know the step was skipped.
    """

    def __init__(self, cache: WeightCache, weights: Sequence[torch.Tensor]) -> None:
        self.cache = cache
        self.weights = list(weights)
        self.pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._versions: list[Any] = []

    def before_finish(self) -> None:
        pairs = self.cache.pairs(self.weights)
        if len(pairs) != len(self.pairs) or any(a[1] is not b[1] for a, b in zip(pairs, self.pairs)):
            self.pairs = pairs  # a new list only when a copy changed, so the finish graph's guards hold

    def in_finish(self) -> None:
        WeightCache.write(self.pairs)

    def after_finish(self) -> None:
        self._versions = self.cache.versions(self.pairs)

    def after_hooks(self) -> None:
        """Copies written by the finish graph are fresh unless a post-step hook moved a weight."""
        self.cache.revalidate(self.pairs, self._versions)

    def after_fused_step(self) -> None:
        with torch.no_grad():
            WeightCache.write(self.pairs)
        self.cache.revalidate(self.pairs, self.cache.versions(self.pairs))


def weight_cache_applies(policy: Policy, root: torch.nn.Module | None, reporter: Reporter, caller: str) -> bool:
    """Whether ``weight_cache=True`` can be honoured for ``root``; where not, the reporter says why."""
    if root is not None and weight_cache_off_for_fsdp2(root, reporter, caller):
        return False
    if not policy.cast_cache:
        reporter.did_less(
            "weight_cache:cast_cache",
            "amp_fx: weight_cache=True needs the shared leaf cast that Policy(cast_cache=False) "
            "turns off (each use would get its own gradient cast); the weight cache is off. "
            "Drop cast_cache=False or weight_cache=True.",
        )
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
    if units is None or (
        torch.distributed.is_available() and isinstance(model, torch.nn.parallel.DistributedDataParallel)
    ):
        return False
    reporter.did_less(
        "weight_cache:fsdp2",
        (
            f"{caller}(weight_cache=True): the model is sharded with fully_shard (FSDP2), which gathers "
            "its parameters again in every forward into tensors whose changes the weight cache cannot "
            "see; the cache is off and each forward casts the gathered weights, as eager autocast does. "
            "Drop weight_cache=True (FSDP2's MixedPrecisionPolicy(param_dtype=...) gathers low-precision "
            "weights instead)."
        ),
    )
    return True


def report_uncached_experts(decisions: Sequence[Fp8Decision], reporter: Reporter) -> None:
    """Say once (an error in strict mode) that the grouped expert GEMMs among ``decisions`` (one
    graph's fp8 decisions) that run in low precision have their weights quantized in every forward:
    the weight cache holds no cast of theirs (module doc)."""
    grouped = [d for d in decisions if d.converted and d.op in _GROUPED_OPS]
    if not grouped:
        return
    shown = ", ".join(f"{d.weight} ({d.recipe.value if d.recipe else '?'})" for d in grouped[:4])
    modules = sorted({d.module for d in grouped if d.module})
    keep = f"Policy(keep_out_of_fp8={tuple(modules)!r})" if modules else "Policy(keep_out_of_fp8=[module])"
    reporter.did_less(
        ("weight_cache", "grouped experts"),
        (
            f"amp_fx: weight_cache=True does not cache the low-precision casts of grouped expert weights "
            f"({shown}{', ...' if len(grouped) > 4 else ''}): their grouped GEMMs quantize the weight "
            f"themselves, so every forward quantizes them again (the same values: results are bitwise "
            f"either way; the cost is one quantization of the experts' weights per micro-batch). Every "
            f"other weight is cached. Keep the experts out of low precision ({keep}, whose bf16 casts "
            f"are cached) or accept the cost; strict=True makes this an error."
        ),
    )
