"""The autocast policy as data: cast classes, torch's op tables, and user overrides.

``CastClass`` mirrors ATen's ``at::autocast::CastPolicy`` (aten/src/ATen/autocast_mode.h) plus the
banned ops. The default tables reproduce the registrations of the installed torch's (2.11 to 2.15)
``AutocastCPU`` and ``AutocastCUDA`` dispatch keys overload for overload; ``tests/policy/test_policy.py``
checks them against ``torch._C._dispatch_get_registrations_for_dispatch_key`` so a torch upgrade
that moves an op fails loudly instead of silently drifting from eager autocast.

A :class:`Policy` moves ops between classes and keeps chosen submodules in fp32:

    >>> import torch
    >>> p = Policy(op_classes={"aten.layer_norm": CastClass.FP32}, keep_fp32=("lm_head",))
    >>> p.classify(torch.ops.aten.layer_norm.default, "cpu", ()).cast_class
    <CastClass.FP32: 'fp32'>
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cache
from types import MappingProxyType
from typing import Union, cast

import torch

from amp_fx._common.compat import autocast_registrations
from amp_fx._common.op_names import label_of

__all__ = [
    "CastClass",
    "Policy",
    "Decision",
    "OpLike",
    "resolve_dtype",
    "DEFAULT_TABLES",
    "default_class",
    "module_matches",
    "op_from_name",
    "GROUPED_MM_OPS",
]


class CastClass(enum.Enum):
    """How an op's floating-point inputs are cast (ATen's ``CastPolicy`` and the banned list)."""

    LOWER_PRECISION_FP = "lower_precision_fp"
    """Cast every eligible input to the autocast dtype (bf16/fp16)."""
    FP32 = "fp32"
    """Cast every eligible input to float32."""
    FP32_SET_OPT_DTYPE = "fp32_set_opt_dtype"
    """If the first input is eligible and the op's ``dtype`` argument is unset, set it to float32."""
    FP32_APPEND_DTYPE = "fp32_append_dtype"
    """Redispatch to the overload that takes an output dtype, with float32 (``norm`` only)."""
    PROMOTE = "promote"
    """Cast eligible inputs to the widest floating dtype among them."""
    BANNED = "banned"
    """Autocast refuses the op (binary_cross_entropy on CUDA)."""
    OWN_KERNEL = "own_kernel"
    """The op's own Autocast kernel decides, as in eager: ops outside ATen that register one
    (torchvision's ``roi_align`` and ``nms``, a ``torch.library`` op). amp_fx runs the op inside a
    one-op autocast region of the graph instead of inserting casts (see :func:`default_class`)."""
    NONE = "none"
    """Not autocast: the op runs in whatever dtypes its inputs have (a policy can move ops here)."""


OpLike = Union[str, "torch._ops.OpOverload", "torch._ops.OpOverloadPacket"]


def _table(dispatch_key: str, **classes: str) -> tuple[Mapping[str, CastClass], Mapping[str, CastClass]]:
    """(every entry listed, the entries the installed torch registers at ``dispatch_key``)."""
    listed: dict[str, CastClass] = {}
    for cls_name, names in classes.items():
        for name in names.split():
            listed[f"aten::{name}"] = CastClass[cls_name]
    registered = autocast_registrations(dispatch_key)
    installed = {name: cls for name, cls in listed.items() if name in registered}
    return MappingProxyType(listed), MappingProxyType(installed)


# The tables list every op that some supported torch (2.11 to 2.15) registers at its Autocast
# dispatch key, with its class; DEFAULT_TABLES keeps the ones the installed torch registers
# (amp_fx._common.compat.autocast_registrations: a feature test, not a version check). An op whose class
# changed between versions would need two entries and a feature test of its own: none has.
# VERSION_DEPENDENT names every entry that some supported torch does not register; an entry
# missing from the installed torch and not named there fails tests/policy/test_op_tables.py, and so
# does an op the installed torch registers that is not listed.
#
# Overload names as the dispatcher spells them ("aten::conv2d" is the default overload).
# Source: KERNEL_CPU registrations in aten/src/ATen/autocast_mode.cpp, checked against the
# dispatcher of 2.11, 2.13 and 2.15.
_CPU_LISTED, _CPU_TABLE = _table(
    "AutocastCPU",
    LOWER_PRECISION_FP="""
        conv1d conv1d.padding conv2d conv2d.padding conv3d conv3d.padding bmm mm linalg_vecdot
        baddbmm addmm _addmm_activation addbmm linear _convolution.deprecated matmul conv_tbc
        mkldnn_rnn_layer conv_transpose1d conv_transpose2d.input conv_transpose3d.input prelu
        scaled_dot_product_attention _native_multi_head_attention""",
    FP32="""
        avg_pool3d binary_cross_entropy grid_sampler polar prod prod.dim_int prod.dim_Dimname
        quantile quantile.scalar nanquantile nanquantile.scalar stft stft.center cdist
        grid_sampler_2d _grid_sampler_2d_cpu_fallback grid_sampler_3d trace view_as_complex
        cholesky cholesky_inverse cholesky_solve inverse lu_solve orgqr ormqr pinverse max_pool3d
        max_unpool2d max_unpool3d adaptive_avg_pool3d reflection_pad1d reflection_pad2d
        replication_pad1d replication_pad2d replication_pad3d mse_loss cosine_embedding_loss
        nll_loss nll_loss2d hinge_embedding_loss poisson_nll_loss smooth_l1_loss
        cross_entropy_loss l1_loss huber_loss margin_ranking_loss soft_margin_loss
        triplet_margin_loss multi_margin_loss ctc_loss.IntList ctc_loss.Tensor kl_div
        multilabel_margin_loss binary_cross_entropy_with_logits fft_fft fft_ifft fft_fft2
        fft_ifft2 fft_fftn fft_ifftn fft_rfft fft_irfft fft_rfft2 fft_irfft2 fft_rfftn fft_irfftn
        fft_hfft fft_ihfft linalg_cond linalg_cond.p_str linalg_matrix_rank
        linalg_matrix_rank.tol_tensor linalg_matrix_rank.atol_rtol_tensor
        linalg_matrix_rank.atol_rtol_float linalg_solve linalg_cholesky linalg_svdvals
        linalg_eigvals linalg_eigvalsh linalg_inv linalg_householder_product linalg_tensorinv
        linalg_tensorsolve fake_quantize_per_tensor_affine geqrf _lu_with_info qr svd
        triangular_solve fractional_max_pool2d fractional_max_pool3d adaptive_max_pool3d
        multilabel_margin_loss_forward linalg_qr linalg_cholesky_ex linalg_svd linalg_eig
        linalg_eigh linalg_lstsq linalg_inv_ex linalg_matrix_sqrth""",
    PROMOTE="stack cat index_copy index_copy.dimname",
)

# Source: AT_FORALL_* lists in aten/src/ATen/autocast_mode.h, the Autocast (CUDA) registrations
# in autocast_mode.cpp and aten/src/ATen/cudnn/AutocastRNN.cpp, checked as above.
_CUDA_LISTED, _CUDA_TABLE = _table(
    "AutocastCUDA",
    LOWER_PRECISION_FP="""
        _convolution.deprecated _convolution conv1d conv2d conv3d conv_tbc conv_transpose1d
        conv_transpose2d.input conv_transpose3d.input convolution prelu addmm addmv addr matmul
        einsum mm mv linalg_vecdot linear addbmm baddbmm bmm chain_matmul linalg_multi_dot
        _thnn_fused_lstm_cell _thnn_fused_gru_cell lstm_cell gru_cell rnn_tanh_cell rnn_relu_cell
        _scaled_dot_product_flash_attention scaled_dot_product_attention cudnn_convolution
        cudnn_convolution_transpose _cudnn_rnn""",
    FP32="""
        acos asin cosh erfinv exp expm1 log log10 log2 log1p reciprocal rsqrt sinh tan
        pow.Tensor_Scalar pow.Tensor_Tensor pow.Scalar softplus layer_norm native_layer_norm
        rms_norm group_norm frobenius_norm.dim nuclear_norm nuclear_norm.dim cosine_similarity
        poisson_nll_loss cosine_embedding_loss nll_loss nll_loss2d hinge_embedding_loss kl_div
        l1_loss smooth_l1_loss huber_loss mse_loss margin_ranking_loss multilabel_margin_loss
        soft_margin_loss triplet_margin_loss multi_margin_loss binary_cross_entropy_with_logits
        dist pdist cdist renorm logsumexp upsample_nearest1d _upsample_nearest_exact1d
        upsample_nearest2d _upsample_nearest_exact2d upsample_nearest3d _upsample_nearest_exact3d
        upsample_linear1d upsample_bilinear2d _upsample_bilinear2d_aa upsample_trilinear3d
        upsample_bicubic2d _upsample_bicubic2d_aa linalg_matrix_sqrth""",
    FP32_SET_OPT_DTYPE="""
        prod prod.dim_int prod.dim_Dimname softmax.int softmax.Dimname log_softmax.int
        log_softmax.Dimname cumprod cumprod.dimname cumsum cumsum.dimname linalg_vector_norm
        linalg_matrix_norm linalg_matrix_norm.str_ord sum sum.dim_IntList sum.dim_DimnameList""",
    FP32_APPEND_DTYPE="norm.Scalar norm.ScalarOpt_dim norm.names_ScalarOpt_dim",
    PROMOTE="addcdiv addcmul atan2 bilinear cross dot vdot grid_sampler index_put tensordot scatter_add",
    BANNED="binary_cross_entropy",
)

_DIMNAME = "Dimname overload: registered by 2.11, not by 2.13 or 2.15 (named tensors, which Dynamo does not trace)"
VERSION_DEPENDENT: Mapping[tuple[str, str], str] = MappingProxyType(
    {
        ("cpu", "aten::prod.dim_Dimname"): _DIMNAME,
        ("cpu", "aten::index_copy.dimname"): _DIMNAME,
        ("cpu", "aten::cholesky"): "registered by 2.11 and 2.13, not by 2.15",
        ("cpu", "aten::qr"): "registered by 2.11 and 2.13, not by 2.15",
        ("cpu", "aten::linalg_matrix_sqrth"): "registered by 2.15 (the op is new in 2.15)",
        ("cuda", "aten::linalg_matrix_sqrth"): "registered by 2.15 (the op is new in 2.15)",
        ("cuda", "aten::rms_norm"): "registered by 2.13 and 2.15, not by 2.11",
        ("cuda", "aten::_cudnn_rnn"): (
            "registered only by builds with cuDNN (the standard Linux wheels, not the CPU wheel); its "
            "kernel also re-flattens the weights into one buffer, which changes no value"
        ),
        **{
            ("cuda", f"aten::{name}"): _DIMNAME
            for name in (
                "prod.dim_Dimname",
                "softmax.Dimname",
                "log_softmax.Dimname",
                "cumprod.dimname",
                "cumsum.dimname",
                "sum.dim_DimnameList",
                "norm.names_ScalarOpt_dim",
            )
        },
    }
)
"""(device type, op) -> which torch versions or builds register it, for entries not in all."""

DEFAULT_TABLES: Mapping[str, Mapping[str, CastClass]] = MappingProxyType({"cpu": _CPU_TABLE, "cuda": _CUDA_TABLE})
"""Eager autocast's op classes per device type for the installed torch, keyed by
``"aten::name[.overload]"``."""

LISTED_TABLES: Mapping[str, Mapping[str, CastClass]] = MappingProxyType({"cpu": _CPU_LISTED, "cuda": _CUDA_LISTED})
"""Every entry of every supported torch, installed or not (for tests and tools)."""

# fp32_append_dtype redispatch targets (AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE).
APPEND_DTYPE_REDISPATCH: Mapping[str, str] = MappingProxyType(
    {
        "aten::norm.Scalar": "aten::norm.ScalarOpt_dtype",
        "aten::norm.ScalarOpt_dim": "aten::norm.ScalarOpt_dim_dtype",
        "aten::norm.names_ScalarOpt_dim": "aten::norm.names_ScalarOpt_dim_dtype",
    }
)

GROUPED_MM_OPS: tuple[str, ...] = ("aten::_grouped_mm", "transformers::grouped_mm_fallback")
"""The grouped expert GEMMs of mixture-of-experts layers, which no autocast table lists (so eager
autocast runs them in their inputs' dtype: fp32 with fp32 weights). ``aten::_grouped_mm`` is what
``torch._grouped_mm`` and ``F.grouped_mm`` call; transformers (5.x) keeps each expert layer as one
3-D parameter and multiplies it with them, or, compiled with non-bf16 weights, with its custom op
``transformers::grouped_mm_fallback`` (a loop of ``torch.mm`` over the experts after
``offs.tolist()``, a host sync). ``Policy(autocast_experts=...)`` decides them."""

_DTYPE_ALIASES: Mapping[object, torch.dtype] = MappingProxyType(
    {
        "bf16": torch.bfloat16,
        "bfloat16": torch.bfloat16,
        torch.bfloat16: torch.bfloat16,
        "fp16": torch.float16,
        "float16": torch.float16,
        "half": torch.float16,
        torch.float16: torch.float16,
    }
)


def resolve_dtype(dtype: object) -> torch.dtype:
    """Map the user's ``dtype`` argument to torch.bfloat16 or torch.float16, or raise ValueError."""
    try:
        return _DTYPE_ALIASES[dtype]
    except (KeyError, TypeError):
        accepted = '"bf16", "bfloat16", "fp16", "float16", "half", torch.bfloat16, torch.float16'
        raise ValueError(f"amp_fx: unknown dtype {dtype!r}; accepted values are {accepted}") from None


def default_class(op_name: str, device_type: str) -> CastClass:
    """Eager autocast's class for ``op_name`` ("aten::mm", "torchvision::roi_align") on ``device_type``.

    The tables for torch's own ops; :attr:`CastClass.OWN_KERNEL` for an op outside them that has a
    kernel at the device's Autocast dispatch key (asked of the dispatcher at each call, so an op
    registered after amp_fx was imported counts); NONE otherwise.

    Why OWN_KERNEL runs the op's kernel rather than transcribing its rule into a table: the rules
    differ per op and per library version. torchvision's kernels (csrc/ops/autocast/) cast float
    inputs to fp32 and cast back to the input's dtype, but ``nms`` returns its int64 indices as
    they are and ``roi_pool``/``ps_roi_pool`` cast their int64 argmax output to the input's dtype
    too; a ``torch.library`` op may do anything. Running the kernel reproduces each one exactly.
    """
    cls = DEFAULT_TABLES.get(device_type, {}).get(op_name)
    if cls is not None:
        return cls
    if _has_own_kernel(op_name, device_type):
        return CastClass.OWN_KERNEL
    return CastClass.NONE


def _has_own_kernel(op_name: str, device_type: str) -> bool:
    """Whether a library registered a kernel for ``op_name`` at ``device_type``'s Autocast key.

    torch's ops are in the tables (tests/policy/test_policy.py checks it), so only other namespaces count.
    """
    from amp_fx._common.devices import DEVICES

    device = DEVICES.get(device_type)
    if device is None or op_name.startswith("aten::"):
        return False
    return torch._C._dispatch_has_kernel_for_dispatch_key(op_name, device.dispatch_key)


@cache
def op_from_name(name: str) -> torch._ops.OpOverload:
    ns, _, rest = name.partition("::")
    packet_name, _, overload = rest.partition(".")
    packet = getattr(getattr(torch.ops, ns), packet_name)
    return getattr(packet, overload or "default")


def _normalize_op(op: OpLike) -> tuple[str, ...]:
    """Resolve an op given as an overload, a packet or a string to its overloads' names."""
    if isinstance(op, torch._ops.OpOverload):
        return (op.name(),)
    if isinstance(op, torch._ops.OpOverloadPacket):
        return tuple(getattr(op, o).name() for o in op.overloads())
    if not isinstance(op, str):
        raise TypeError(f"amp_fx: a policy op must be a string or a torch op, got {op!r}")
    text = op.replace("torch.ops.", "")
    ns, sep, rest = text.partition("::")
    if not sep:
        ns, sep, rest = text.partition(".")
        if not sep:
            ns, rest = "aten", text
    packet_name, _, overload = rest.partition(".")
    try:
        packet = getattr(getattr(torch.ops, ns), packet_name)
    except (AttributeError, RuntimeError):
        raise ValueError(f"amp_fx: the policy names op {op!r}, which does not exist") from None
    if overload:
        if overload not in packet.overloads():
            raise ValueError(
                f"amp_fx: the policy names op {op!r}, but {ns}::{packet_name} has no overload "
                f"{overload!r} (it has {sorted(packet.overloads())})"
            )
        return (getattr(packet, overload).name(),)
    return tuple(getattr(packet, o).name() for o in packet.overloads())


@dataclass(frozen=True)
class Decision:
    """Why a node got its cast class: recorded on the node as ``meta["amp_fx_decision"]``."""

    cast_class: CastClass
    reason: str
    kept_module: str | None = None
    """The qualified name of the fp32-kept module that decided, if one did."""


ModuleSelector = Union[str, type]


@dataclass(frozen=True)
class Policy:
    """User overrides on top of eager autocast's tables.

    Args:
        op_classes: ops moved to another :class:`CastClass`, keyed by overload
            (``torch.ops.aten.layer_norm.default``), packet (``torch.ops.aten.layer_norm``: every
            overload) or string (``"aten.layer_norm"``, ``"aten::conv2d.padding"``). Unknown ops
            raise ValueError.
        keep_fp32: submodules whose ops all run in float32, by qualified name (``"lm_head"``,
            ``"blocks.0.attn"``; a name covers its descendants) or by type
            (``torch.nn.LayerNorm``). Names are checked against the model at compile time.
        cast_cache: share one lower-precision cast of each fp32 leaf tensor that requires grad
            among all its uses in a graph, as eager autocast's cast cache does. Turning it off
            casts per use (gradients of the uses then add up in fp32).
        keep_out_of_fp8: with ``fp8=`` on, submodules whose matmuls stay in the autocast dtype,
            selected as in ``keep_fp32`` (``"lm_head"``, ``torch.nn.Embedding``). Without it,
            every matmul with a parameter operand whose sizes ``torch._scaled_mm`` takes runs
            in fp8 (:mod:`amp_fx.passes.fp8_matmuls`).
        autocast_experts: the grouped GEMMs of mixture-of-experts layers (:data:`GROUPED_MM_OPS`:
            ``torch._grouped_mm``, ``F.grouped_mm``, transformers' ``grouped_mm_fallback``),
            which eager autocast does not list. ``None`` (default): as eager autocast, in their
            inputs' dtype (fp32 for fp32 weights), and amp_fx warns once naming the experts
            (an error in strict mode). ``True``: in the autocast dtype, each as one
            ``aten._grouped_mm`` (transformers' fallback, a per-expert loop behind a host sync,
            is replaced), the weights' casts shared and cached as a linear's are. ``False``: as
            eager autocast, without the warning. With ``fp8=`` on, ``None`` means ``True`` and
            the grouped GEMMs then run in fp8 as every matmul with a parameter operand does
            (:mod:`amp_fx.kernels.fp8_grouped_mm`); ``False`` keeps them in fp32.

    The policy is hashable and part of amp_fx's compile cache key.
    """

    op_classes: Mapping[OpLike, CastClass] = field(default_factory=dict)
    keep_fp32: Sequence[ModuleSelector] = ()
    cast_cache: bool = True
    keep_out_of_fp8: Sequence[ModuleSelector] = ()
    autocast_experts: bool | None = None
    op_entries: tuple[tuple[str, tuple[str, ...], CastClass], ...] = field(init=False, repr=False, compare=False)
    """The entries of ``op_classes`` as given: (label, overload names, class), in order. Labels
    name the entry in messages ("aten.linear" for the user's "aten.linear")."""

    def __post_init__(self) -> None:
        if not isinstance(self.op_classes, Mapping):
            raise TypeError(f"amp_fx: Policy.op_classes must be a mapping, got {self.op_classes!r}")
        resolved: dict[str, CastClass] = {}
        entries = []
        for op, cls in self.op_classes.items():
            if not isinstance(cls, CastClass):
                raise TypeError(f"amp_fx: Policy.op_classes[{op!r}] must be a CastClass, got {cls!r}")
            names = _normalize_op(op)
            for name in names:
                _check_class_fits(name, cls)
                resolved[name] = cls
            entries.append((_entry_spelling(op), names, cls))
        object.__setattr__(self, "op_classes", MappingProxyType(dict(sorted(resolved.items()))))
        object.__setattr__(self, "op_entries", tuple(entries))
        if isinstance(self.keep_fp32, (str, type)):
            object.__setattr__(self, "keep_fp32", (self.keep_fp32,))
        object.__setattr__(self, "keep_fp32", _selectors("keep_fp32", self.keep_fp32))
        object.__setattr__(self, "keep_out_of_fp8", _selectors("keep_out_of_fp8", self.keep_out_of_fp8))
        if self.autocast_experts is not None and not isinstance(self.autocast_experts, bool):
            raise TypeError(
                f"amp_fx: Policy.autocast_experts must be True, False or None, got {self.autocast_experts!r}"
            )

    def __hash__(self) -> int:
        return hash(
            (
                tuple(self.op_classes.items()),
                self.keep_fp32,
                self.cast_cache,
                self.keep_out_of_fp8,
                self.autocast_experts,
            )
        )

    def __reduce__(self) -> tuple[object, tuple[object, ...]]:
        # The read-only mappings do not pickle; the entries as given rebuild an equal policy
        # (copy.deepcopy, pickle and torch.save all go through here).
        return (
            Policy,
            (
                {label: cls for label, _, cls in self.op_entries},
                self.keep_fp32,
                self.cast_cache,
                self.keep_out_of_fp8,
                self.autocast_experts,
            ),
        )

    def entry_for(self, op_name: str) -> str | None:
        """The label of the ``op_classes`` entry that decides ``op_name`` ("aten::linear"), if any."""
        for label, names, _ in reversed(self.op_entries):
            if op_name in names:
                return label
        return None

    def lowers_experts(self, op_name: str) -> bool:
        """Whether ``autocast_experts=True`` decides ``op_name`` (a grouped expert GEMM that no
        ``op_classes`` entry moves)."""
        return self.autocast_experts is True and op_name in GROUPED_MM_OPS and op_name not in self.op_classes

    def table(self, device_type: str) -> Mapping[str, CastClass]:
        """The effective op table for a device type: torch's defaults with this policy applied."""
        return _effective_table(self, device_type)

    def classify(
        self, op: torch._ops.OpOverload, device_type: str, module_types: Sequence[tuple[str, type]]
    ) -> Decision:
        """Decide the cast class of ``op`` running inside the modules ``module_types``.

        ``module_types`` is the node's module stack, outermost first, as (qualified name, type).
        A kept module wins over the op tables.
        """
        for path, mtype in module_types:
            for sel in self.keep_fp32:
                if module_matches(sel, path, mtype):
                    label = sel if isinstance(sel, str) else sel.__name__
                    return Decision(
                        CastClass.FP32, f"fp32: module {path or '<root>'} kept by policy ({label})", kept_module=path
                    )
        name = op.name()
        short = label_of(name)
        if name in self.op_classes:
            cls = self.op_classes[name]
            return Decision(cls, f"{_label(cls)}: {short} (moved by policy)")
        if self.lowers_experts(name):
            return Decision(
                CastClass.LOWER_PRECISION_FP,
                f"lower precision fp: {short} (grouped expert GEMM, Policy(autocast_experts=True))",
            )
        cls = default_class(name, device_type)
        if cls is CastClass.NONE and name in GROUPED_MM_OPS:
            return Decision(
                cls,
                f"not autocast: {short} runs in its inputs' dtypes (a grouped expert GEMM: "
                "no autocast table lists it; Policy(autocast_experts=True) runs it in the "
                "autocast dtype)",
            )
        if cls is CastClass.NONE:
            return Decision(cls, f"not autocast: {short} runs in its inputs' dtypes")
        if cls is CastClass.OWN_KERNEL:
            from amp_fx._common.devices import DEVICES

            return Decision(
                cls,
                f"own kernel: {short} runs its own {DEVICES[device_type].dispatch_key} kernel, as in eager autocast",
            )
        return Decision(cls, f"{_label(cls)}: {short} (default {device_type} table)")


def _selectors(name: str, value: object) -> tuple[ModuleSelector, ...]:
    """A ``keep_fp32``-style field as a tuple of module names and types, checked."""
    if isinstance(value, (str, type)):
        value = (value,)
    if not isinstance(value, Sequence):
        raise TypeError(
            f"amp_fx: Policy.{name} must be a sequence of module names or nn.Module subclasses, got {value!r}"
        )
    keep = tuple(value)
    for sel in keep:
        is_module_type = isinstance(sel, type) and issubclass(sel, torch.nn.Module)
        if not (isinstance(sel, str) and sel) and not is_module_type:
            raise TypeError(f"amp_fx: Policy.{name} entries must be module names or nn.Module subclasses, got {sel!r}")
    return keep


def banned_message(op_name: str, policy: Policy, device_type: str) -> str:
    """Why amp_fx refuses ``op_name`` ("aten::linear"): the user's policy entry, or torch's table."""
    short = label_of(op_name)
    bce = (
        "torch.nn.functional.binary_cross_entropy and torch.nn.BCELoss are unsafe to autocast: "
        "use torch.nn.functional.binary_cross_entropy_with_logits or torch.nn.BCEWithLogitsLoss."
    )
    label = policy.entry_for(op_name)
    if label is not None and policy.op_classes.get(op_name) is CastClass.BANNED:
        return (
            f"amp_fx: {short} is banned by your policy: the entry "
            f"Policy(op_classes={{{label!r}: CastClass.BANNED}}) makes amp_fx refuse every call "
            f"of it. Drop the entry or give it another CastClass to run the op."
            + (f" ({bce})" if op_name == "aten::binary_cross_entropy" else "")
        )
    if op_name == "aten::binary_cross_entropy":
        advice = f"{bce} Or move the op with Policy(op_classes=...)."
    else:
        advice = "Move the op to another class with Policy(op_classes=...) if it is safe."
    return (
        f"amp_fx: {short} is unsafe to autocast on {device_type} (banned by eager autocast's "
        f"{device_type} table, and so by amp_fx): {advice}"
    )


def _entry_spelling(op: OpLike) -> str:
    """The user's spelling of an op entry, one that :func:`_normalize_op` maps back to it."""
    if isinstance(op, torch._ops.OpOverload):
        return f"{op._schema.name}.{op._overloadname}"
    if isinstance(op, torch._ops.OpOverloadPacket):
        return op._qualified_op_name
    return op


def _label(cls: CastClass) -> str:
    return cls.value.replace("_", " ")


def module_matches(sel: ModuleSelector, path: str, mtype: type) -> bool:
    if isinstance(sel, str):
        return path == sel or path.startswith(sel + ".")
    return issubclass(mtype, sel)


def _check_class_fits(name: str, cls: CastClass) -> None:
    op = op_from_name(name)
    if cls is CastClass.OWN_KERNEL:
        from amp_fx._common.devices import DEVICES

        if not any(_has_own_kernel(name, d) for d in DEVICES):
            raise ValueError(
                f"amp_fx: {name} cannot be OWN_KERNEL: it has no Autocast kernel of its own outside "
                f"torch's tables (only ops of other libraries that register one, such as "
                f"torchvision::roi_align, have)"
            )
    if cls is CastClass.FP32_SET_OPT_DTYPE:
        arg = next((a for a in op._schema.arguments if a.name == "dtype"), None)
        if arg is None or "Optional" not in str(arg.type) and "?" not in str(arg.type):
            raise ValueError(f"amp_fx: {name} cannot be FP32_SET_OPT_DTYPE: it has no optional dtype argument")
    if cls is CastClass.FP32_APPEND_DTYPE and name not in APPEND_DTYPE_REDISPATCH:
        raise ValueError(
            f"amp_fx: {name} cannot be FP32_APPEND_DTYPE: only {sorted(APPEND_DTYPE_REDISPATCH)} "
            "have a dtype-taking overload to redispatch to"
        )


@cache
def _effective_table(policy: Policy, device_type: str) -> Mapping[str, CastClass]:
    table = dict(DEFAULT_TABLES.get(device_type, {}))
    table.update(cast(Mapping[str, CastClass], policy.op_classes))  # keys resolved in __post_init__
    return MappingProxyType({k: v for k, v in table.items() if v is not CastClass.NONE})
