"""``compile_step`` on distributed models: DDP and FSDP2 (``fully_shard``); FSDP1 refused.

``compile_step`` normally compiles the forward and the loss as one full graph. DDP's forward
calls the wrapped module inside a ``_disable_dynamo`` function and FSDP2's hooks are
``_dynamo_disable``-d, so that capture fails with a Dynamo message pointing into torch.

**The forward, DDP and FSDP2 alike.** DDP's (FSDP2's) ``__call__`` runs eagerly with the
forwards of the units compiled by ``amp_fx.compile`` (per-unit capture, ``capture.py``), the
loss under the same autocast as torch's AMP recipe, then the step's own forward-and-loss
arithmetic (``amp_fx.step.forward.ForwardLoss``, handed in as a callable: the window division and
the scale multiply, one home for that rule). Every micro-batch of an accumulation window but the
last runs without gradient synchronisation:
DDP's ``no_sync()`` around the forward (DDP decides in the forward), FSDP2's
``set_requires_gradient_sync(False)`` (FSDP2 decides in the backward, so the flag is set for
each micro-batch before its forward and left as the last one set it: True after a window).

**The finish, DDP.** The gradients are plain replicated tensors, every rank computes the same
found-inf flag, and the finish graph (unscale, check, clip, masked step, scale update) runs
unchanged: no extra collective, no host read.

**The finish, FSDP2** (:class:`LocalShards`). The gradients, the parameters and the optimizer
state are DTensors sharded on dim 0 over one 1-D mesh. The finish graph works on their local
tensors (the same storage): the unscale and check, the clip multiply and the optimizer's own
step function are elementwise, so on the local shards they are what DTensor's dispatch runs.
Two quantities need every rank:

* the found-inf flag: one functional all-reduce (MAX) inside the graph, right after the check,
  on the device; every rank then skips the same steps and updates the same scale. The overflow
  record (amp_fx/overflow) rides in the same collective: which gradients' local shards held
  an inf/NaN and, with ``watch_nonfinite``, the first non-finite forward op of any rank.
* with ``max_grad_norm``, the global norm: ``clip_grad_norm_`` on DTensors gives per-gradient
  norms with a ``_NormPartial(2)`` placement, which DTensor turns into the replicated value by
  ``x**2``, an all-reduce (SUM) of the stacked norms, ``x**0.5``, before the norm of the norms.
  :meth:`LocalShards.global_norm` does exactly that, in one functional all-reduce, so the clip
  is bit for bit ``clip_grad_norm_``'s. With ``GradNorm.FUSED`` the unscale kernel's sum of
  squares is all-reduced (SUM) instead (:meth:`LocalShards.global_sum`; on other layouts one sum
  per set of mesh dimensions the gradients are sharded on).

The optimizer step runs on a *local view* of the user's optimizer (its class, hyperparameters
and state, with every DTensor replaced by its local tensor), so only optimizers whose update is
elementwise per parameter are accepted (:data:`SHARD_LOCAL_OPTIMIZERS`; ``fused=True`` ones
run their fused kernel on the local shards, with the combined flag), and parameters FSDP2 left
unsharded are refused with an error naming what works. Other layouts of DTensors (tensor
parallelism, FSDP2 x TP, HSDP) combine the flag over every rank and each gradient's norm over
the mesh dimensions it is sharded on (:func:`_layout`). The warm-up step runs eagerly on the
DTensors through ``amp_fx.GradScaler``, as on one device.
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Callable, Sequence
from typing import Any, TypeGuard

import torch

from amp_fx._common.autocast import own_autocast
from amp_fx._common.compat import dtensor_type, local_tensor
from amp_fx._dist.capture import FSDP1_ALTERNATIVE, distributed_units, is_fsdp1, module_device_type

__all__ = [
    "LocalShards",
    "SHARD_LOCAL_OPTIMIZERS",
    "check_distributed_step",
    "clip_sharded_",
    "combine_norms",
    "distributed_forward",
    "has_dtensor_params",
    "is_fsdp2",
    "is_sharded",
    "norm_groups",
    "torch_clips",
]

# torch.optim classes whose step is elementwise per parameter: on a rank's shard it computes
# what DTensor's dispatch computes for that shard. Exact classes: a subclass may override step.
SHARD_LOCAL_OPTIMIZERS: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.SGD,
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adamax,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.RMSprop,
    torch.optim.Adagrad,
    torch.optim.Adadelta,
)


def _is_ddp(model: torch.nn.Module) -> TypeGuard[torch.nn.parallel.DistributedDataParallel]:
    return torch.distributed.is_available() and isinstance(model, torch.nn.parallel.DistributedDataParallel)


def is_fsdp2(model: torch.nn.Module) -> bool:
    """Whether ``model`` is (or contains modules) sharded with ``fully_shard``."""
    return not _is_ddp(model) and distributed_units(model) is not None


def has_dtensor_params(model: torch.nn.Module) -> bool:
    """Whether any parameter of ``model`` is a DTensor (FSDP2, tensor parallelism, or both)."""
    return _any_dtensor(model.parameters())


def _any_dtensor(tensors: Any) -> bool:
    dtensor = dtensor_type()
    return dtensor is not None and any(isinstance(t, dtensor) for t in tensors)


def is_sharded(model: torch.nn.Module) -> bool:
    """Whether compile_step's finish runs on local tensors (:class:`LocalShards`): FSDP2, or
    DTensor parameters (``parallelize_module``), alone or together."""
    return is_fsdp2(model) or (not _is_ddp(model) and has_dtensor_params(model))


def check_distributed_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Refuse what ``compile_step`` cannot run on a distributed model, with the working form.

    FSDP1 (``FullyShardedDataParallel``): refused (flat parameters, no DTensor gradients).
    FSDP2 and DTensor parameters (tensor parallelism, FSDP2 x TP, HSDP): the optimizer must be one
    of :data:`SHARD_LOCAL_OPTIMIZERS`, and under FSDP2 every parameter a DTensor (see :func:`_layout`).
    """
    if is_fsdp1(model):
        raise NotImplementedError(
            "amp_fx.compile_step: the model is wrapped in FullyShardedDataParallel (FSDP1), which "
            f"compile_step does not support; {FSDP1_ALTERNATIVE}"
        )
    if not is_sharded(model):
        return
    kind = type(optimizer)
    if kind not in SHARD_LOCAL_OPTIMIZERS:
        names = ", ".join(c.__name__ for c in SHARD_LOCAL_OPTIMIZERS)
        raise NotImplementedError(
            f"amp_fx.compile_step: on a sharded model (FSDP2 or DTensor parameters) the optimizer steps on "
            f"each rank's local shards, which is exact only for elementwise optimizers ({names}); got "
            f"{kind.__module__}.{kind.__qualname__}. Use amp_fx.compile(model) with amp_fx.GradScaler("
            "step_mode=amp_fx.StepMode.MASKED), whose optimizer step runs on the DTensors"
        )
    _layout([p for g in optimizer.param_groups for p in g["params"]], fsdp2=is_fsdp2(model))


def _layout(params: Sequence[torch.Tensor], *, fsdp2: bool) -> Any:
    """The 1-D device mesh all ``params`` are sharded over on dim 0 (the first, where meshes over
    the same ranks differ): FSDP2's default layout, where the found-inf flag and the gradient
    norm are combined over that mesh's group. None for any other layout of DTensors (tensor
    parallel placements, 2-D meshes, plain tensors beside DTensors): there the flag is combined
    over every rank of the default group, and each gradient's norm over the mesh dimensions it is
    sharded on (:meth:`LocalShards.global_norm`). Plain tensors in an
    FSDP2 model are a clear error (their gradients are not reduced by FSDP2)."""
    from torch.distributed.tensor import DTensor, Shard

    meshes: dict[tuple[int, ...], Any] = {}
    default = True
    for i, p in enumerate(params):
        if not isinstance(p, DTensor):
            if fsdp2:
                raise NotImplementedError(
                    f"amp_fx.compile_step: parameter {i} of the optimizer is a plain tensor in an FSDP2 model "
                    "(not sharded by fully_shard); apply fully_shard to the root module too, so every "
                    "parameter is sharded"
                )
            default = False
            continue
        if p.device_mesh.ndim != 1 or tuple(p.placements) != (Shard(0),):
            default = False
        # fully_shard without a mesh makes a new mesh per call: meshes over the same ranks are one.
        meshes.setdefault(tuple(p.device_mesh.mesh.flatten().tolist()), p.device_mesh)
    if default and len(meshes) == 1:
        return next(iter(meshes.values()))
    return None


def torch_clips(params: Sequence[torch.Tensor], *, fsdp2: bool) -> bool:
    """Whether ``torch.nn.utils.clip_grad_norm_`` combines these parameters' gradient norms: plain
    tensors alone, or FSDP2's default layout (:func:`_layout`); else :func:`clip_sharded_`."""
    return not _any_dtensor(params) or _layout(params, fsdp2=fsdp2) is not None


def norm_groups(params: Sequence[torch.Tensor]) -> list[tuple[Any, ...]]:
    """Per parameter, the process groups of the mesh dimensions it (and its gradient) is sharded
    on; one group object per set of ranks (fully_shard without a mesh makes a mesh, and a group
    object, per call), so that gradients sharded over the same ranks share one all-reduce."""
    same_ranks: dict[tuple[int, ...], Any] = {}
    return [
        tuple(same_ranks.setdefault(tuple(torch.distributed.get_process_group_ranks(g)), g) for g in _sharded_over(p))
        for p in params
    ]


def combine_norms(local_norms: Sequence[torch.Tensor], groups: Sequence[tuple[Any, ...]]) -> torch.Tensor:
    """``clip_grad_norm_``'s total norm from the local shards' norms, ``groups[j]`` the groups
    ``local_norms[j]``'s gradient is sharded over (:func:`norm_groups`); traceable.

    As DTensor reduces the stacked ``_NormPartial(2)`` norms: square, all-reduce (SUM) over each mesh
    dimension a gradient is sharded on, square root, then the 2-norm of the norms in the parameters'
    order. Gradients sharded alike share one all-reduce; a replicated or plain gradient's norm is
    its local norm.
    """
    from torch.distributed import _functional_collectives as funcol

    by_groups: dict[tuple[Any, ...], list[int]] = {}
    for j, key in enumerate(groups):
        by_groups.setdefault(key, []).append(j)
    norms: list[torch.Tensor] = list(local_norms)
    for key, members in by_groups.items():
        if not key:
            continue
        squares = torch.stack([local_norms[j] for j in members]) ** 2.0
        for group in key:
            squares = funcol.all_reduce(squares, "sum", group)
        for j, value in zip(members, (squares ** (1.0 / 2.0)).unbind(0), strict=True):
            norms[j] = value
    return torch.linalg.vector_norm(torch.stack(norms), 2.0)


def clip_sharded_(params: Sequence[torch.Tensor], max_norm: float) -> torch.Tensor:
    """``clip_grad_norm_(params, max_norm)`` for gradients torch's cannot combine: on several
    meshes (FSDP2 x TP), beside plain tensors (TP without sequence parallelism), or ``Partial``.
    Each gradient is first given its parameter's placements (:func:`_placed_as_param`, set as its
    ``.grad``), its local norm combined by :func:`combine_norms` (the rule the compiled finish
    traces), and the local tensors scaled by clip_grad_norm_'s coefficient. Returns the norm."""
    with torch.no_grad():
        present = [p for p in params if p.grad is not None]
        for p in present:
            p.grad = _placed_as_param(p.grad, p)
        local = [local_tensor(p.grad) for p in present]
        total = combine_norms(list(torch._foreach_norm(local, 2.0)), norm_groups(present))
        clip_coef = max_norm / (total + 1e-6)
        torch._foreach_mul_(local, torch.clamp(clip_coef, max=1.0))
    return total


def _sharded_over(param: Any) -> tuple[Any, ...]:
    """The process groups of the mesh dimensions ``param`` (and so its gradient) is sharded on;
    () for a replicated or plain parameter."""
    placements = getattr(param, "placements", None)
    if placements is None:
        return ()
    # not is_shard(): FSDP2 shards a TP shard's dim 0 over dp as _StridedShard, whose is_shard() is
    # False (torch 2.13); counted as replicated, the dp sum was left out of FSDP2 x TP's global norm
    # and each dp rank clipped with its own (0.99 and 1.00 against 1.07 on a dp 2 x tp 2 mesh)
    return tuple(
        param.device_mesh.get_group(dim) for dim, p in enumerate(placements) if not (p.is_replicate() or p.is_partial())
    )


def _placed_as_param(grad: Any, param: Any) -> Any:
    """``grad`` with its parameter's placements. A compiled backward can leave a DTensor gradient
    ``Partial`` (each rank's unreduced sum) where the parameter is ``Replicate`` (the norms of
    sequence parallelism); DTensor's dispatch reduces it when the optimizer's first op meets the
    parameter, so the local step must reduce it first: the same all-reduce, here and eagerly."""
    placements = getattr(param, "placements", None)
    if placements is None or tuple(grad.placements) == tuple(placements):
        return grad
    return grad.redistribute(param.device_mesh, placements)


class LocalShards:
    """compile_step's finish on an FSDP2 model: local tensors, and the two cross-rank reductions.

    ``params``: the local tensors of the optimizer's (DTensor) parameters, each given the local
    tensor of its gradient by :meth:`before_finish`. ``optimizer``: a view of the user's optimizer
    (same class, ``__dict__`` shared but for ``param_groups`` and ``state``) whose groups hold
    the local parameters and whose state holds the local tensors of the user's state, so that
    its step function updates the user's DTensors in place. Built after the warm-up step
    created the state; the view is kept between steps (Dynamo guards on it).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor], *, fsdp2: bool = True) -> None:
        self._user = optimizer
        self._dparams = list(params)
        # the group the found-inf flag is combined over: FSDP2's default layout's (where the fused
        # norm's one sum is too), else every rank (see _layout)
        mesh = _layout(self._dparams, fsdp2=fsdp2)
        self.group: Any = torch.distributed.group.WORLD if mesh is None else mesh.get_group()
        self._one_sum = mesh is not None
        self._norm_groups = norm_groups(self._dparams)
        self.params = [local_tensor(p) for p in self._dparams]
        view = object.__new__(type(optimizer))
        view.__dict__.update(optimizer.__dict__)
        by_id = {id(p): lp for p, lp in zip(self._dparams, self.params)}
        view.param_groups = [{**g, "params": [by_id[id(p)] for p in g["params"]]} for g in optimizer.param_groups]
        view.state = collections.defaultdict(dict)
        self.optimizer = view

    def before_finish(self) -> None:
        """Point the view at this step's gradients, hyperparameters and state (no device read)."""
        for g, vg in zip(self._user.param_groups, self.optimizer.param_groups):
            for k, v in g.items():
                if k != "params" and vg.get(k) is not v:
                    vg[k] = v
        state = self.optimizer.state
        for p, lp in zip(self._dparams, self.params):
            lp.grad = None if p.grad is None else local_tensor(_placed_as_param(p.grad, p))
            user = self._user.state.get(p)
            if not user:
                continue
            entry = state[lp]
            for k, v in user.items():
                lv = local_tensor(v)
                if entry.get(k) is not lv:
                    entry[k] = lv

    def after_finish(self) -> None:
        """Drop the references to the gradients; a state entry the step rebound is written back."""
        from torch.distributed.tensor import DTensor

        for p, lp in zip(self._dparams, self.params):
            lp.grad = None
            entry, user = self.optimizer.state.get(lp), self._user.state.get(p)
            if not entry or not user:
                continue
            for k, lv in entry.items():
                old = user.get(k)
                if local_tensor(old) is lv:
                    continue
                user[k] = (
                    DTensor.from_local(
                        lv, old.device_mesh, old.placements, run_check=False, shape=old.shape, stride=old.stride()
                    )
                    if isinstance(old, DTensor)
                    else lv
                )

    def combine_found_inf(
        self, found_inf: torch.Tensor, flags: torch.Tensor, first_op: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
        """The flag of every rank's shards, in one all-reduce (MAX) on the device (traceable), with
        what amp_fx/overflow records folded into it: ``flags`` (per gradient, 0/1: which local
        shards held an inf/NaN; the same gradients, in the same order, on every rank) and the
        forward record ``first_op``, packed as one int64 vector (:func:`~amp_fx._dist.found_inf.pack_overflow`).
        Returns the flag, the flags and (record, rank) or None.
        """
        from torch.distributed import _functional_collectives as funcol

        from amp_fx._dist.found_inf import pack_overflow, unpack_overflow

        packed = funcol.all_reduce(pack_overflow(found_inf, [flags], first_op), "max", self.group)
        flag, reduced_flags, first = unpack_overflow(packed, flags.numel(), first_op is not None)
        return flag.to(found_inf.dtype).reshape(found_inf.shape), reduced_flags.to(flags.dtype), first

    def global_norm(self, local_norms: Sequence[torch.Tensor], present: Sequence[int]) -> torch.Tensor:
        """``clip_grad_norm_``'s total norm over DTensor gradients, from the local shards' norms
        (``local_norms[j]`` of parameter ``present[j]``).

        As DTensor reduces the stacked ``_NormPartial(2)`` norms: square, all-reduce (SUM) over each
        mesh dimension the gradient is sharded on, square root, then the 2-norm of the norms
        (``torch.linalg.vector_norm``) in the parameters' order. Gradients sharded alike go in one
        all-reduce: on FSDP2's default layout that is all of them, op for op DTensor's reduction; a
        replicated or plain gradient's norm is its local norm.
        """
        return combine_norms(local_norms, [self._norm_groups[i] for i in present])

    def norm_segments(self, present: Sequence[int]) -> list[int] | None:
        """GradNorm.FUSED: which sum of squares each present gradient (parameter ``present[j]``) adds
        to (``unscale_check_norm_``'s ``segments``): one per set of groups the gradients are sharded
        over (:func:`norm_groups`), in first-seen order. None on FSDP2's default layout: one sum."""
        if self._one_sum:
            return None
        index = self._segment_index(present)
        return [index[self._norm_groups[i]] for i in present]

    def _segment_index(self, present: Sequence[int]) -> dict[tuple[Any, ...], int]:
        """Per set of groups the present gradients are sharded over, its sum's index."""
        index: dict[tuple[Any, ...], int] = {}
        for i in present:
            index.setdefault(self._norm_groups[i], len(index))
        return index

    def global_sum(self, local_sum: torch.Tensor, present: Sequence[int]) -> torch.Tensor:
        """GradNorm.FUSED's sum of squares over every rank's shards (traceable). FSDP2's default
        layout: ``local_sum`` is one sum, all-reduced (SUM) over the mesh's group. Elsewhere it holds
        one sum per segment (:meth:`norm_segments`), each all-reduced over the groups its gradients
        are sharded on (:func:`_combine_sums`): a replicated or plain gradient, whole on every rank,
        is counted once, as ``clip_grad_norm_`` counts it."""
        from torch.distributed import _functional_collectives as funcol

        if self._one_sum:
            return funcol.all_reduce(local_sum, "sum", self.group)
        return _combine_sums(local_sum, list(self._segment_index(present)))


def _combine_sums(sums: torch.Tensor, keys: Sequence[tuple[Any, ...]]) -> torch.Tensor:
    """The total of ``sums`` (fp32 ``[len(keys)]``), ``sums[j]`` first summed over every rank of
    the groups ``keys[j]`` (the mesh dimensions its gradients are sharded on; () for none).
    One all-reduce per group, over the sums that are sharded on it: FSDP2 x TP's 2-D gradients
    and its norms' 1-D ones share the dp all-reduce. The same groups in the same order on every
    rank (:func:`norm_groups` follows the parameters' order), as collectives need."""
    from torch.distributed import _functional_collectives as funcol

    by_group: dict[Any, list[int]] = {}
    for j, key in enumerate(keys):
        for group in key:
            by_group.setdefault(group, []).append(j)
    parts = list(sums.unbind(0))
    for group, members in by_group.items():
        reduced = funcol.all_reduce(torch.stack([parts[j] for j in members]), "sum", group)
        for j, value in zip(members, reduced.unbind(0), strict=True):
            parts[j] = value
    return torch.stack(parts).sum() if parts else sums.new_zeros(())


def distributed_forward(
    model: torch.nn.Module,
    forward_loss: Callable[..., tuple[torch.Tensor, torch.Tensor]],
    *,
    dtype: torch.dtype,
    accumulate: int,
    micro_step: Callable[[], int],
    compile_model: Callable[[torch.nn.Module], Any],
) -> Callable[..., Any] | None:
    """The forward part of a compiled step whose model is DDP or FSDP2, or None for others.

    ``forward_loss(model, scale, *batch, **model_kwargs) -> (loss, scaled loss)``: the step's
    forward-and-loss arithmetic, called here with the compiled model, under ``torch.autocast`` with
    ``dtype``. ``accumulate``: micro-batches per window; ``micro_step()``: how many of this window
    ran before this one. ``compile_model``: ``amp_fx.compile`` with the step's options. The returned
    callable takes ``(scale, *batch, **model_kwargs)`` and has the compiled forward's
    ``amp_fx_records``, ``amp_fx_weight_cache`` and ``amp_fx_watch`` attributes.
    """
    ddp_model = model if _is_ddp(model) else None
    ddp, fsdp2 = ddp_model is not None, is_fsdp2(model)
    if not (ddp or fsdp2):
        return None
    compiled = compile_model(model)
    device_type = module_device_type(model)

    def forward(scale: torch.Tensor, *batch: Any, **model_kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        last_of_window = micro_step() == accumulate - 1
        if fsdp2 and accumulate > 1:  # FSDP2 reads the flag in the backward, after this call returns
            model.set_requires_gradient_sync(last_of_window)  # type: ignore[operator]  # FSDPModule's, mixed in
        sync = ddp_model.no_sync() if ddp_model is not None and not last_of_window else contextlib.nullcontext()
        with sync, own_autocast(device_type, dtype):
            return forward_loss(compiled, scale, *batch, **model_kwargs)

    forward.amp_fx_records = compiled.amp_fx_records  # type: ignore[attr-defined]  # set on the function
    forward.amp_fx_weight_cache = compiled.amp_fx_weight_cache  # type: ignore[attr-defined]  # set on the function
    forward.amp_fx_watch = compiled.amp_fx_watch  # type: ignore[attr-defined]  # set on the function
    return forward
