"""fp8 all-gather under FSDP2: each rank casts its weight shards to fp8 before the all-gather.

With ``fp8=`` on a model sharded by ``fully_shard``, FSDP2 would all-gather each fp32 weight (4
bytes per element) and the fp8 matmul would then cast the gathered weight. Tensorwise scaling
makes the cast elementwise given one scale per weight, ``fp8_max / amax(|w|)``, so each rank can
cast its own shard if every rank knows the whole weight's amax: that is torchao's
``enable_fsdp_float8_all_gather`` with ``precompute_float8_dynamic_scale_for_fsdp``, and here:

* :func:`precompute_scales` (once per forward, before FSDP2's first all-gather): the amax of every
  gathered weight's local shard, stacked, in *one* all-reduce (MAX), turned into scales with the
  fp8 matmul's own rule (:func:`amp_fx.kernels.fp8_matmul.scale_from_amax`);
* FSDP2's all-gather extension (``fsdp_pre_all_gather`` / ``fsdp_post_all_gather``, the protocol
  torchao's ``WeightWithDynamicFloat8CastTensor`` implements): the shard is cast to e4m3 with that
  scale and gathered (1 byte per element), and the gathered weight is a :class:`Fp8Weight`: fp32
  to autograd and FSDP2 (its gradient is fp32 and reduce-scattered as before), fp8 data and scale
  inside, which the fp8 matmul takes as its weight cast instead of casting again.

The cast is the one the fp8 matmul would make of the gathered fp32 weight (same amax, same scale
rule, elementwise multiply and saturate), so the values are bitwise what amp_fx computes without
the fp8 all-gather, and what torchao computes with it.

Which weights (:func:`gathered_fp8_weights`, when ``amp_fx.compile`` wraps the model): the
``weight`` of every ``nn.Linear`` owned by one module only, of the root unit of a model with
other sharded units only where amp_fx compiles the Linear as a unit of its own
(:func:`_fsdp_params` says why), sharded by ``fully_shard`` on dim 0 (of a 1-D mesh, or of the
data-parallel dimensions of FSDP2 x TP or HSDP: the local shard is then a shard of the TP shard,
cast with the whole weight's scale, and the gathered TP shard a DTensor over an Fp8Weight), gathered in
fp32 (``MixedPrecisionPolicy(param_dtype=None)``), not offloaded to the
CPU, and not kept out of fp8 or in fp32 by the policy; with the tensorwise recipe only (a rowwise
cast needs whole rows or columns; torchao refuses it too; the weights of blockwise and nvfp4
matmuls, scaled per tile of the whole weight, are gathered in fp32 and said once). Nothing to opt into: the values are
the same with and without, only the bytes change; a Linear weight gathered in fp32 for a reason
other than the user's choice is reported (``_CHOSEN``). After the first call, a gathered weight that
some graph reads other than as an fp8 matmul's weight (a model that reads the Linear's weight
elsewhere, or a matmul kept in ``dtype``) is reported (``Fp8Record.fp8_weight_reads``): that use
saw ``data / scale``.

The extension is attached to the sharded parameter's local tensor itself (FSDP2 looks the two
methods up by attribute), so the parameter, the optimizer and its state keep their plain
tensors; FSDP2 decided at ``fully_shard`` whether a parameter has an extension, so its parameter
state is re-initialised for it (:func:`_reset_fsdp_param`).
"""

from __future__ import annotations

import inspect
import logging
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

import torch

from amp_fx._common.compat import fsdp_param_groups
from amp_fx._common.report import Reporter
from amp_fx.fp8 import Fp8Config, Fp8Recipe
from amp_fx.kernels.fp8_matmul import scale_from_amax
from amp_fx.kernels.fp8_recipes import E4M3
from amp_fx.kernels.fp8_weight import EagerReads, Fp8Weight
from amp_fx.low_precision import recipe_for, recipes
from amp_fx.policy import Policy, module_matches

if TYPE_CHECKING:
    from amp_fx.passes.pipeline import GraphRecord

__all__ = ["GatheredFp8Weights", "gathered_fp8_weights", "precompute_scales"]

log = logging.getLogger(__name__)


class _Extension:
    """One of FSDP2's two all-gather extension methods, for one local shard (held weakly: the
    method is an attribute of the shard). Pickles as nothing to call (``torch.save`` of a
    parameter pickles the tensor's attributes): a loaded shard gathers in fp32."""

    def __init__(self, shard: torch.Tensor, post: bool) -> None:
        self._shard = weakref.ref(shard)
        self._post = post
        signature = inspect.signature(_post_all_gather if post else _pre_all_gather)
        # FSDP2 reads the method's signature (its 5-argument form): the shard is bound
        self.__signature__ = signature.replace(parameters=list(signature.parameters.values())[1:])

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        shard = self._shard()
        assert shard is not None, "the extension is an attribute of the shard, which is alive"
        return (_post_all_gather if self._post else _pre_all_gather)(shard, *args, **kwargs)

    def __reduce__(self) -> tuple[object, tuple[object, ...]]:
        return (_none, ())


def _none() -> None:
    return None


def _pre_all_gather(
    shard: torch.Tensor, mesh: Any, outer_size: torch.Size, outer_stride: Any, module: Any, mp_policy: Any
) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """FSDP2's all-gather inputs for ``shard``: its e4m3 cast with the precomputed scale, padded
    to FSDP2's equal shard size (zeros cast to zeros), and the scale as metadata. torchao's
    ``hp_tensor_and_scale_to_float8``: multiply in fp32, saturate, cast."""
    scale = shard._amp_fx_fp8_scale  # type: ignore[attr-defined]  # amp_fx's attribute on the local shard
    rows = -(-outer_size[0] // mesh.size())
    if shard.shape[0] != rows:
        shard = torch.nn.functional.pad(shard, (0, 0) * (shard.ndim - 1) + (0, rows - shard.shape[0]))
    fp8_max = torch.finfo(E4M3).max
    data = (shard.to(torch.float32) * scale).clamp(min=-fp8_max, max=fp8_max).to(E4M3)
    # gathered as its bytes: gloo has no float8 type ("Invalid scalar type" where every input of a
    # unit's all-gather is e4m3; FSDP2 gathers mixed dtypes as bytes anyway)
    return (data.view(torch.uint8),), (scale,)


def _post_all_gather(
    shard: torch.Tensor,
    outputs: tuple[torch.Tensor, ...],
    metadata: tuple[torch.Tensor, ...],
    param_dtype: torch.dtype,
    *,
    out: torch.Tensor | None = None,
) -> tuple[Fp8Weight, tuple[torch.Tensor, ...]] | None:
    """The gathered weight (an :class:`Fp8Weight` over the gathered data, freed by FSDP2 after the
    forward), or, on later all-gathers into the same storage, its new scale."""
    (data,), (scale,) = outputs, metadata
    data = data.view(E4M3)
    if out is not None:  # FSDP2 x TP: the unsharded parameter is a DTensor of the TP mesh over it
        # out: the Fp8Weight this function returned at the first all-gather (or a DTensor over it)
        cast(Fp8Weight, getattr(out, "_local_tensor", out))._scale = scale
        return None
    return Fp8Weight(data, scale, param_dtype, shard._amp_fx_fp8_reads), (data,)  # type: ignore[attr-defined]  # amp_fx's attribute on the local shard


class GatheredFp8Weights:
    """The FSDP2 parameters whose shards are cast to fp8 before the all-gather (``names``: their
    names in the model), their scales, and the eager reads of their gathered weights (their own
    record: another model's ``check`` neither sees nor clears them)."""

    def __init__(self, params: Sequence[torch.Tensor], names: Sequence[str]) -> None:
        self.params = list(params)
        self.names = list(names)
        self._reads = EagerReads()
        self._checked = 0  # the records checked so far
        for p in self.params:
            local = p._local_tensor  # type: ignore[attr-defined]  # p: a DTensor (typed Tensor)
            local._amp_fx_fp8_scale = torch.ones((), dtype=torch.float32, device=local.device)
            local._amp_fx_fp8_reads = self._reads.id
            local.fsdp_pre_all_gather = _Extension(local, post=False)
            local.fsdp_post_all_gather = _Extension(local, post=True)

    def precompute_scales(self) -> None:
        precompute_scales(self.params)

    def check(self, records: Sequence[GraphRecord], reporter: Reporter) -> None:
        """After each call, once a graph has run: every gathered weight ran only as the weight of fp8
        matmuls, in the graphs captured since the last check (``records``: all of them so far)
        and in eager code since. A use that did not (the weight read elsewhere, or by a matmul
        kept in ``dtype``) computed with the fp8 weight's ``data / scale``, not the fp32 weight:
        said once, with the fix."""
        new, self._checked = records[self._checked :], len(records)
        reads = [r for record in new if record.fp8 is not None for r in record.fp8.fp8_weight_reads]
        reads += [f"a weight by {op} outside any compiled graph" for op in self._reads.take()]
        if reads:
            reporter.did_less(
                "fp8_all_gather:read_elsewhere",
                (
                    f"amp_fx: FSDP2 all-gathers the weights of the fp8 matmuls in fp8 ({', '.join(self.names)}), "
                    f"but the model also reads one outside an fp8 matmul ({'; '.join(reads[:4])}): that use "
                    "computed with the fp8 weight (data / scale), not the fp32 one. Keep its module out of fp8 "
                    "(Policy(keep_out_of_fp8=[...]): FSDP2 then gathers it in fp32)."
                ),
            )


@torch.no_grad()
def precompute_scales(params: Sequence[torch.Tensor]) -> None:
    """Every weight's tensorwise e4m3 scale from the amax of the whole (sharded) weight, the
    amaxes of the local shards of the weights on one mesh in *one* all-reduce (MAX) per mesh
    dimension (a 1-D FSDP2 mesh: one; FSDP2 x TP: over dp, then over tp, so every rank holds the
    max over every shard of the weight; a replicated dimension's max is its value); stored on each
    local shard for its next all-gathers. torchao's ``precompute_float8_dynamic_scale_for_fsdp``
    (an inf-norm is the amax; DTensor reduces it over every mesh dimension), with the fp8 matmul's
    own scale rule."""
    by_mesh: dict[Any, list[torch.Tensor]] = {}
    for p in params:
        by_mesh.setdefault(p.device_mesh, []).append(p._local_tensor)  # type: ignore[attr-defined]  # DTensor
    for mesh, shards in by_mesh.items():
        amax = torch.stack([torch.max(torch.abs(t)) if t.numel() else t.new_zeros(()) for t in shards])
        for dim in range(mesh.ndim):
            torch.distributed.all_reduce(amax, op=torch.distributed.ReduceOp.MAX, group=mesh.get_group(dim))
        for t, scale in zip(shards, scale_from_amax(amax, E4M3).unbind()):
            t._amp_fx_fp8_scale = scale  # type: ignore[attr-defined]  # amp_fx's own attribute on the local shard (set in Fp8Gather.__init__)


def _reset_fsdp_param(fsdp_param: Any) -> None:
    """FSDP2 decides at ``fully_shard`` (and at its first all-gather) how a parameter is
    gathered; make it gather through the extension from its next all-gather on."""
    fsdp_param._init_extensions()
    fsdp_param.all_gather_outputs = []
    fsdp_param.__dict__.pop("_unsharded_param", None)


def _fsdp_params(root: torch.nn.Module, units: Sequence[torch.nn.Module]) -> list[Any]:
    """The FSDP2 parameters of the units; of the root's own, where it has sharded submodules, only
    those of the modules compiled as units of their own (its ``nn.Linear`` modules,
    :func:`amp_fx._dist.capture.root_linears`). The root's forward calls the sharded units, Dynamo
    breaks its graph at each call (FSDP2's hooks), and the code after a break may run eagerly (a
    loop over blocks: Dynamo skips the frame), where a weight is no fp8 matmul's and would compute
    with the fp8 weight; a root Linear compiled as a unit is captured wherever the root runs."""
    own = {id(u) for u in units if u is not root}
    out = []
    for unit in units:
        for group in fsdp_param_groups(unit):
            if unit is root and own:
                out += [p for p in group.fsdp_params if id(p._module_info.module) in own]
            else:
                out += group.fsdp_params
    return out


def _stack(root: torch.nn.Module, path: str) -> list[tuple[str, type]]:
    """The modules around ``path`` in ``root``, outermost first, as the fp8 pass sees a matmul's."""
    parts = path.split(".") if path else []
    prefixes = [".".join(parts[:i]) for i in range(len(parts) + 1)]
    return [(p, type(root.get_submodule(p))) for p in prefixes]


def _why_not(fsdp_param: Any, policy: Policy, path: str) -> str | None:
    """Why this FSDP2 parameter is not gathered in fp8, or None if it is."""
    from torch.distributed.tensor import Shard

    info = fsdp_param._module_info
    module = info.module
    if not (isinstance(module, torch.nn.Linear) and info.param_name == "weight"):
        return "not an nn.Linear weight"
    if info.shared_modules:
        return "shared by several modules"
    if any(module_matches(s, path, type(module)) for s in (*policy.keep_out_of_fp8, *policy.keep_fp32)):
        return "kept out of fp8 by the policy"
    param = fsdp_param.sharded_param
    if fsdp_param.fsdp_placement != Shard(0):
        return f"FSDP2 shards it as {fsdp_param.fsdp_placement}, not Shard(0)"
    if fsdp_param.mp_policy.param_dtype not in (None, torch.float32) or param.dtype != torch.float32:
        return "not gathered in fp32 (MixedPrecisionPolicy(param_dtype=...) gathers it in low precision already)"
    if fsdp_param.offload_to_cpu:
        return "offloaded to the CPU"
    if hasattr(type(param._local_tensor), "fsdp_pre_all_gather"):
        return "its shard has an all-gather extension already"
    if fsdp_param.sharded_state.name != "SHARDED":
        return "not sharded now"
    return None


# What _why_not says of a parameter gathered in fp32 by the user's own choice, or that no fp8
# matmul would read: said only at debug level. Any other reason is an fp8 matmul's weight gathered
# at 4 bytes instead of 1, reported.
_MAPPED = "run in "  # another recipe, or high precision, by a per-module map
_BLOCK_GATHERED_HP = frozenset({Fp8Recipe.BLOCKWISE, Fp8Recipe.NVFP4})
"""Recipes whose weights FSDP2 gathers in high precision, said once (their scales are per tile
of the whole weight; the fp8 all-gather here casts with one scale per weight)."""
_CHOSEN = ("not an nn.Linear weight", "kept out of fp8 by the policy", "not gathered in fp32", _MAPPED)


def gathered_fp8_weights(
    root: torch.nn.Module,
    units: Sequence[torch.nn.Module],
    fp8: Fp8Config | None,
    policy: Policy,
    reporter: Reporter | None = None,
) -> GatheredFp8Weights | None:
    """Cast before the all-gather the FSDP2 weights the fp8 matmul would cast after it (see the
    module docstring); None where there are none. An ``nn.Linear`` weight left to gather in fp32
    for a reason other than the user's choice is said once through ``reporter``."""
    used = set(recipes(fp8))
    if Fp8Recipe.TENSORWISE not in used and not used & _BLOCK_GATHERED_HP:
        return None
    assert fp8 is not None
    paths = {id(m): name for name, m in root.named_modules()}
    params, names, less, block_scaled = [], [], [], []
    for fsdp_param in _fsdp_params(root, units):
        path = paths.get(id(fsdp_param._module_info.module), "")
        why = _why_not(fsdp_param, policy, path)
        recipe, selector = recipe_for(fp8, _stack(root, path))
        if why is None and recipe in _BLOCK_GATHERED_HP:
            block_scaled.append(f"{path}.{fsdp_param._module_info.param_name} ({recipe.value})")
            continue
        if Fp8Recipe.TENSORWISE not in used:
            continue
        if why is None and recipe is not Fp8Recipe.TENSORWISE:
            why = f"{_MAPPED}{recipe.value if recipe else 'high precision'} by the low-precision map ({selector})"
        if why is not None:
            log.debug("FSDP2 all-gathers %s in fp32: %s", path or "the root", why)
            if not why.startswith(_CHOSEN):
                less.append(f"{path}.{fsdp_param._module_info.param_name} ({why})")
            continue
        params.append(fsdp_param.sharded_param)
        names.append(f"{path}.weight" if path else "weight")
        _reset_fsdp_param(fsdp_param)
    if less and reporter is not None:
        reporter.did_less(
            "fp8_all_gather:fp32",
            (
                f"amp_fx: FSDP2 all-gathers {', '.join(less)} in fp32 (4 bytes per element), not in fp8 "
                "before the fp8 matmul as the other fp8 weights; the values are the same, only the bytes "
                "differ. Shard it with fully_shard on dim 0 (the default), not offloaded, owned by one "
                "nn.Linear, to gather it in fp8; strict=True makes this an error."
            ),
        )
    if block_scaled and reporter is not None:
        reporter.did_less(
            "fp8_all_gather:block_scaled",
            (
                f"amp_fx: FSDP2 all-gathers {', '.join(block_scaled[:4])}{', ...' if len(block_scaled) > 4 else ''} "
                "in fp32 (4 bytes per element), not in low precision: amp_fx's low-precision all-gather "
                "is tensorwise fp8 only (one scale per weight, all-reduced before the gather), while "
                "blockwise scales each 128x128 tile and nvfp4 each 16x16 tile from the gathered "
                "weight; the values are the same, only the bytes differ. "
                "MixedPrecisionPolicy(param_dtype=torch.bfloat16) gathers 2 bytes (nvfp4 quantizes the "
                "weight's bf16 cast anyway; blockwise then scales the bf16 weight, not the fp32 one), "
                "fp8='tensorwise' gathers 1; strict=True makes this an error."
            ),
        )
    if not params:
        return None
    gathered = GatheredFp8Weights(params, names)
    log.info("FSDP2 all-gathers %d weights in fp8: %s", len(names), ", ".join(names))
    return gathered
