"""Ops outside ATen with an Autocast kernel of their own (``CastClass.OWN_KERNEL``): torchvision's
``roi_align`` and ``nms`` (CPU; four more on CUDA) and ops registered through ``torch.library``.

Eager autocast runs such an op's kernel at the Autocast dispatch key; amp_fx's graphs run with
autocast off, so before OWN_KERNEL the op ran on whatever dtype reached it: on CPU torchvision's
kernels have no bf16 implementation (``roi_align`` and ``nms`` raised) and fp16 ``roi_align``
computed in fp16 where eager autocast computes in fp32. amp_fx now encloses the op in a one-op
autocast region of the graph, so the op's own kernel runs as in eager. References: eager
``torch.autocast("cpu", dtype)`` on an identical copy of the model, compared bit for bit
(``aot_eager``), forward and gradients.

torchvision loads only with torch's standard Linux build (the torch 2.11 test environment has it:
``~/.cache/amp_fx/venvs/torch-2.11``); its tests skip with the reason elsewhere. The
``torch.library`` tests run everywhere.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv

import amp_fx
from amp_fx import CastClass, Policy
from amp_fx.passes import meta
from amp_fx.passes.capture import capture, eager_autocast
from amp_fx.passes.insert_casts import insert_casts
from amp_fx.policy import default_class
from amp_fx.testing import assert_bitwise
from amp_fx.testing.real_models import library_missing

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
_ENTER = torch.amp.autocast_mode._enter_autocast
_EXIT = torch.amp.autocast_mode._exit_autocast


def _torchvision() -> Any:
    missing = library_missing("torchvision")
    if missing:
        pytest.skip(f"{missing} (the torch 2.11 test environment has it: ~/.cache/amp_fx/venvs/torch-2.11)")
    import torchvision

    return torchvision


def _own_kernel_ops(dispatch_key: str, namespace: str) -> set[str]:
    return {
        n for n in torch._C._dispatch_get_registrations_for_dispatch_key(dispatch_key) if n.startswith(f"{namespace}::")
    }


def _own_kernel_nodes(compiled: Any, op_name: str) -> list[torch.fx.Node]:
    """The nodes calling ``op_name`` in the compiled model's rewritten graphs; each must sit in a
    one-op autocast region (enter before it, exit after it) and record its OWN_KERNEL decision."""
    nodes = [
        n
        for r in compiled.amp_fx_records
        for n in r.rewritten.graph.nodes
        if isinstance(n.target, torch._ops.OpOverload) and n.target.name() == op_name
    ]
    for n in nodes:
        assert n.meta[meta.DECISION].cast_class is CastClass.OWN_KERNEL, n.meta[meta.DECISION]
        assert n.prev.target is _ENTER and n.next.target is _EXIT and n.next.args == (n.prev,), (
            f"{n.format_node()} is not enclosed in its own autocast region"
        )
    return nodes


def _step(model: nn.Module, inputs: tuple[Tensor, ...], dtype: torch.dtype | None) -> tuple[Any, dict]:
    """Forward (under eager autocast when ``dtype`` is given), a float loss, backward: outputs
    and parameter gradients."""
    with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
        out = model(*inputs)
    floats = [o for o in (out if isinstance(out, tuple) else (out,)) if o.is_floating_point()]
    sum(o.float().square().sum() for o in floats).backward()
    return out, {n: p.grad for n, p in model.named_parameters()}


def _assert_like_eager(model: nn.Module, inputs: tuple[Tensor, ...], dtype: torch.dtype, **kwargs: Any) -> Any:
    expected = _step(copy.deepcopy(model), inputs, dtype)
    compiled = amp_fx.compile(model, dtype=dtype, backend="aot_eager", **kwargs)
    actual = _step(compiled, inputs, None)
    assert_bitwise(actual, expected, "(outputs, grads)")
    return compiled


# --- torchvision, CPU: every op it registers at AutocastCPU ---------------------------------------


class _RoiAlign(nn.Module):
    """Features from a conv (the low dtype under autocast) pooled by roi_align on fp32 boxes."""

    def __init__(self, rois_like_features: bool = False) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.rois_like_features = rois_like_features

    def forward(self, x: Tensor, rois: Tensor) -> Tensor:
        import torchvision

        f = self.conv(x)
        if self.rois_like_features:  # fp16 then runs without error, in fp16 unless autocast casts
            rois = rois.to(f.dtype)
        return torchvision.ops.roi_align(f, rois, (3, 3), spatial_scale=0.5, sampling_ratio=2) * 2


class _Nms(nn.Module):
    """Boxes and scores from a linear (the low dtype under autocast), filtered by nms."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 5)

    def forward(self, z: Tensor) -> tuple[Tensor, Tensor]:
        import torchvision

        b = self.lin(z)
        boxes = torch.cat([b[:, :2], b[:, :2] + b[:, 2:4].abs() + 0.5], dim=1)
        keep = torchvision.ops.nms(boxes, b[:, 4], 0.3)
        return keep, boxes * 2


def _roi_inputs(gen: torch.Generator) -> tuple[Tensor, ...]:
    x = torch.randn(2, 3, 12, 12, generator=gen)
    xy = torch.rand(5, 2, generator=gen) * 12
    wh = torch.rand(5, 2, generator=gen) * 10 + 1
    rois = torch.cat([torch.tensor([[0.0], [0.0], [1.0], [1.0], [1.0]]), xy, xy + wh], dim=1)
    return x, rois


# case id -> (op, module, inputs)
_CPU_CASES: dict[str, tuple[str, Callable[[], nn.Module], Callable[[torch.Generator], tuple[Tensor, ...]]]] = {
    "roi_align": ("torchvision::roi_align", _RoiAlign, _roi_inputs),
    "roi_align-rois-like-features": ("torchvision::roi_align", lambda: _RoiAlign(True), _roi_inputs),
    "nms": ("torchvision::nms", _Nms, lambda gen: (torch.randn(12, 8, generator=gen) * 3,)),
}
_CPU_OPS = {op for op, _, _ in _CPU_CASES.values()}


def test_every_cpu_autocast_op_of_torchvision_has_a_case() -> None:
    """A torchvision release that registers another AutocastCPU kernel fails here, naming it."""
    _torchvision()
    registered = _own_kernel_ops("AutocastCPU", "torchvision")
    assert registered, "torchvision registers no AutocastCPU kernel: nothing is tested below"
    assert registered <= _CPU_OPS, f"no case for {sorted(registered - _CPU_OPS)}"


@pytest.mark.parametrize("dtype_id", DTYPES)
@pytest.mark.parametrize("case", sorted(_CPU_CASES))
def test_torchvision_op_bitwise_eager_autocast(case: str, dtype_id: str) -> None:
    """Outputs (dtype included) and gradients bitwise; the op is in the graph, in its own region.

    nms's output size depends on its values: Dynamo breaks the graph there unless
    ``capture_dynamic_output_shape_ops`` is on, and the op then runs outside amp_fx's graphs."""
    _torchvision()
    op_name, module, inputs = _CPU_CASES[case]
    torch.manual_seed(0)
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        compiled = _assert_like_eager(module(), inputs(torch.Generator().manual_seed(1)), DTYPES[dtype_id])
    assert _own_kernel_nodes(compiled, op_name), f"Dynamo captured no {op_name}: eager was compared with eager"


# --- torchvision, CUDA: every op it registers at AutocastCUDA, on fake CUDA tensors ---------------


def _cuda_calls() -> dict[str, Callable[[Tensor, Tensor], Any]]:
    """Calls of each op itself (all its outputs, where torchvision.ops drops some) on fake CUDA
    tensors: ``x`` (1, 8, 8, 8) low-precision features, ``rois`` (3, 5) fp32."""
    tv = torch.ops.torchvision
    return {
        "torchvision::roi_align": lambda x, rois: tv.roi_align(x, rois, 1.0, 2, 2, 2, False),
        "torchvision::roi_pool": lambda x, rois: tv.roi_pool(x, rois, 1.0, 2, 2),
        "torchvision::ps_roi_align": lambda x, rois: tv.ps_roi_align(x, rois, 1.0, 2, 2, 2),
        "torchvision::ps_roi_pool": lambda x, rois: tv.ps_roi_pool(x, rois, 1.0, 2, 2),
        "torchvision::nms": lambda x, rois: tv.nms(rois[:, 1:], x[0, 0, 0, :3], 0.5),
        "torchvision::deform_conv2d": lambda x, rois: tv.deform_conv2d(
            x,
            rois.new_ones(4, 8, 3, 3),
            rois.new_zeros(1, 18, 8, 8),
            rois.new_ones(1, 9, 8, 8),
            rois.new_zeros(4),
            1,
            1,
            1,
            1,
            1,
            1,
            1,
            1,
            True,
        ),
    }


@pytest.mark.parametrize("dtype_id", DTYPES)
def test_every_cuda_autocast_op_of_torchvision_keeps_eager_dtypes(dtype_id: str) -> None:
    """On fake CUDA tensors (no GPU here): each op torchvision registers at AutocastCUDA is
    OWN_KERNEL, sits in its own autocast region, and every value of the rewritten graph has the
    dtype eager autocast gives it (``roi_pool``'s int64 argmax comes back in the input's dtype:
    torchvision's rule, which no table of amp_fx's states)."""
    _torchvision()
    dtype = DTYPES[dtype_id]
    calls = _cuda_calls()
    registered = _own_kernel_ops("AutocastCUDA", "torchvision")
    assert registered, "torchvision registers no AutocastCUDA kernel"
    assert registered <= set(calls), f"no case for {sorted(registered - set(calls))}"
    for op_name in sorted(registered):

        def fn(a: Tensor, b: Tensor, rois: Tensor, call: Callable[..., Any] = calls[op_name]) -> Any:
            return call((a @ b).view(1, 8, 8, 8), rois)  # mm: the low dtype under autocast

        with FakeTensorMode(shape_env=ShapeEnv()) as mode:  # a shape env: nms's size is data-dependent
            a, b = torch.empty(64, 16, device="cuda"), torch.empty(16, 8, device="cuda")
            rois = torch.tensor([[0, 1, 1, 5, 5], [0, 2, 0, 7, 6], [0, 0, 0, 3, 3.0]], device="cuda")
            gm = capture(fn, [a, b, rois], policy=Policy(), device_type="cuda", dtype=dtype, leaf_flags=[False] * 3)
            gm, record = insert_casts(gm, policy=Policy(), device_type="cuda", dtype=dtype, fake_mode=mode)
            with eager_autocast("cuda", dtype):
                eager = calls[op_name](torch.empty(1, 8, 8, 8, device="cuda", dtype=dtype), rois)
        (node,) = [n for n in gm.graph.nodes if getattr(n.target, "name", lambda: "")() == op_name]
        assert node.meta[meta.DECISION].cast_class is CastClass.OWN_KERNEL, op_name
        assert node.prev.target is _ENTER and node.next.target is _EXIT, op_name
        assert node.prev.args[:3] == ("cuda", dtype, True), (op_name, node.prev.args)
        assert not record.autocast_mismatches, (op_name, record.autocast_mismatches)
        vals = [node.meta["val"]] if isinstance(node.meta["val"], Tensor) else list(node.meta["val"])
        eager = [eager] if isinstance(eager, Tensor) else list(eager)
        assert [v.dtype for v in vals] == [e.dtype for e in eager], op_name


# --- ops registered through torch.library ---------------------------------------------------------


@torch.library.custom_op("amp_fx_test::affine", mutates_args=())
def _affine(x: Tensor) -> Tensor:
    """x * 1.1 + 0.3: rounds differently in each dtype, so the dtype it computes in shows."""
    return x * 1.1 + 0.3


@_affine.register_fake
def _(x: Tensor) -> Tensor:
    return torch.empty_like(x)


_affine.register_autograd(lambda ctx, grad: grad * 1.1)
# Its own AutocastCPU kernel: inputs to fp32, the output left in fp32 (torch.library's rule).
torch.library.register_autocast("amp_fx_test::affine", "cpu", torch.float32)


@torch.library.custom_op("amp_fx_test::plain", mutates_args=())
def _plain(x: Tensor) -> Tensor:
    """The same op with no Autocast kernel: the negative twin."""
    return x * 1.1 + 0.3


_plain.register_fake(lambda x: torch.empty_like(x))
_plain.register_autograd(lambda ctx, grad: grad * 1.1)


class _Lib(nn.Module):
    """A linear (the low dtype under autocast) into a library op; ``region`` opens the model's own
    torch.autocast around the op (None: none)."""

    def __init__(self, op: Callable[[Tensor], Tensor], region: dict[str, Any] | None = None) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.op = op
        self.region = region

    def forward(self, x: Tensor) -> Tensor:
        h = self.lin(x)
        if self.region is None:
            return self.op(h)
        with torch.autocast("cpu", **self.region):
            return self.op(h)


@pytest.mark.parametrize("dtype_id", DTYPES)
def test_library_op_with_autocast_kernel_bitwise_eager(dtype_id: str) -> None:
    """Eager autocast computes ``affine`` in fp32 and returns fp32; without OWN_KERNEL amp_fx
    returned it in the low dtype."""
    torch.manual_seed(0)
    compiled = _assert_like_eager(_Lib(torch.ops.amp_fx_test.affine), (torch.randn(4, 8),), DTYPES[dtype_id])
    (node,) = _own_kernel_nodes(compiled, "amp_fx_test::affine")
    assert node.meta["val"].dtype is torch.float32
    assert node.meta[meta.DECISION].reason == (
        "own kernel: amp_fx_test.affine runs its own AutocastCPU kernel, as in eager autocast"
    )


@pytest.mark.parametrize(
    "options",
    [
        pytest.param({"backend": "eager"}, id="eager-backend"),
        pytest.param({"weight_cache": True}, id="weight_cache"),
        pytest.param({"watch_nonfinite": True}, id="watch_nonfinite"),
        pytest.param({"fold": False}, id="no-fold"),
    ],
)
def test_library_op_with_autocast_kernel_under_each_option(options: dict[str, Any]) -> None:
    """The one-op region survives the other passes and the eager backend (which runs the graph
    as written, regions included)."""
    torch.manual_seed(0)
    model, x = _Lib(torch.ops.amp_fx_test.affine), (torch.randn(4, 8),)
    expected = _step(copy.deepcopy(model), x, torch.bfloat16)
    compiled = amp_fx.compile(model, dtype=torch.bfloat16, **{"backend": "aot_eager", **options})
    assert_bitwise(_step(compiled, x, None), expected, "(outputs, grads)")
    assert _own_kernel_nodes(compiled, "amp_fx_test::affine")


def test_library_op_inductor_bitwise_torch_compile_under_autocast() -> None:
    """The backend ladder's last step. Inductor keeps fused intermediates in fp32, so eager
    autocast is not the bitwise reference (bias gradient: 5 of 8 values differ by a bf16 ulp);
    torch.compile(backend="inductor") under an ambient autocast, which gives inductor the same
    ops and casts, is."""
    torch.manual_seed(0)
    model, x = _Lib(torch.ops.amp_fx_test.affine), (torch.randn(4, 8),)
    plain = copy.deepcopy(model)
    out, grads = _step(torch.compile(plain, backend="inductor"), x, torch.bfloat16)
    expected = (out, {n.removeprefix("_orig_mod."): g for n, g in grads.items()})
    compiled = amp_fx.compile(model, dtype=torch.bfloat16, backend="inductor")
    assert_bitwise(_step(compiled, x, None), expected, "(outputs, grads)")
    assert _own_kernel_nodes(compiled, "amp_fx_test::affine")


def test_library_op_without_autocast_kernel_gets_no_region() -> None:
    """Negative twin: the same op with no Autocast kernel runs in its input's dtype, as in eager."""
    torch.manual_seed(0)
    compiled = _assert_like_eager(_Lib(torch.ops.amp_fx_test.plain), (torch.randn(4, 8),), torch.bfloat16)
    nodes = [n for r in compiled.amp_fx_records for n in r.rewritten.graph.nodes]
    (node,) = [n for n in nodes if n.target is torch.ops.amp_fx_test.plain.default]
    assert node.meta[meta.DECISION].cast_class is CastClass.NONE
    assert node.meta["val"].dtype is torch.bfloat16
    assert not [n for n in nodes if n.target in (_ENTER, _EXIT)]


@pytest.mark.parametrize(
    "region",
    [
        pytest.param({"enabled": False}, id="model-disables-autocast"),
        pytest.param({"dtype": torch.float16}, id="model-region-fp16"),
    ],
)
def test_model_autocast_region_around_the_op_is_followed(region: dict[str, Any]) -> None:
    """Inside the model's own torch.autocast(enabled=False) the op runs without its Autocast
    kernel; inside a nested fp16 region under bf16 it runs with it (same values as eager)."""
    torch.manual_seed(0)
    compiled = _assert_like_eager(_Lib(torch.ops.amp_fx_test.affine, region), (torch.randn(4, 8),), torch.bfloat16)
    nodes = [
        n
        for r in compiled.amp_fx_records
        for n in r.rewritten.graph.nodes
        if n.target is torch.ops.amp_fx_test.affine.default
    ]
    assert len(nodes) == 1
    expected = CastClass.NONE if region.get("enabled") is False else CastClass.OWN_KERNEL
    assert nodes[0].meta[meta.DECISION].cast_class is expected


def test_policy_can_move_an_own_kernel_op() -> None:
    """Policy(op_classes={op: NONE}) turns the op's Autocast kernel off: the reference is eager
    autocast with the op inside torch.autocast(enabled=False)."""
    torch.manual_seed(0)
    model = _Lib(torch.ops.amp_fx_test.affine)
    reference = copy.deepcopy(model)
    reference.region = {"enabled": False}
    x = (torch.randn(4, 8),)
    expected = _step(reference, x, torch.bfloat16)
    policy = Policy(op_classes={"amp_fx_test::affine": CastClass.NONE})
    compiled = amp_fx.compile(model, dtype=torch.bfloat16, backend="aot_eager", policy=policy)
    actual = _step(compiled, x, None)
    assert_bitwise(actual, expected, "(outputs, grads)")
    assert actual[0].dtype is torch.bfloat16
    (node,) = [
        n
        for r in compiled.amp_fx_records
        for n in r.rewritten.graph.nodes
        if n.target is torch.ops.amp_fx_test.affine.default
    ]
    assert node.meta[meta.DECISION].reason == "none: amp_fx_test.affine (moved by policy)"
    assert node.meta["val"].dtype is torch.bfloat16, "the recorded value is the one the op gives"


def test_own_kernel_only_for_ops_that_have_one() -> None:
    assert default_class("amp_fx_test::affine", "cpu") is CastClass.OWN_KERNEL
    assert default_class("amp_fx_test::affine", "cuda") is CastClass.NONE, "registered for cpu only"
    assert default_class("amp_fx_test::plain", "cpu") is CastClass.NONE
    assert default_class("aten::mm", "cpu") is CastClass.LOWER_PRECISION_FP
    Policy(op_classes={"amp_fx_test::affine": CastClass.OWN_KERNEL})
    for op in ("aten::mm", "amp_fx_test::plain"):
        with pytest.raises(ValueError, match=f"{op}.*cannot be OWN_KERNEL"):
            Policy(op_classes={op: CastClass.OWN_KERNEL})


# --- a detection model ----------------------------------------------------------------------------


@pytest.mark.models
@pytest.mark.models_slow
@pytest.mark.parametrize("mode", ["train", "eval"])
def test_fasterrcnn_bitwise_eager_autocast(mode: str) -> None:
    """torchvision's Faster R-CNN (MobileNetV3-FPN, random init, 64x64 images): roi_align in the
    box head runs in amp_fx's graphs (asserted); nms (RPN, post-processing) breaks the graph, as
    its output size depends on its values, and runs between them under eager autocast. Train: the
    four losses and every gradient bitwise; eval: boxes, labels and scores bitwise. Train about
    50 s, eval about 20 s here (before OWN_KERNEL, bf16 roi_align raised)."""
    tv = _torchvision()
    torch.manual_seed(0)
    model = tv.models.detection.fasterrcnn_mobilenet_v3_large_320_fpn(
        weights=None,
        weights_backbone=None,
        num_classes=3,
        min_size=64,
        max_size=64,
        rpn_pre_nms_top_n_train=50,
        rpn_post_nms_top_n_train=20,
        rpn_pre_nms_top_n_test=50,
        rpn_post_nms_top_n_test=20,
        box_detections_per_img=10,
    )
    getattr(model, mode)()
    gen = torch.Generator().manual_seed(1)
    images = [torch.rand(3, 64, 64, generator=gen) for _ in range(2)]
    targets = [{"boxes": torch.tensor([[4.0, 6, 30, 40], [20, 10, 60, 50]]), "labels": torch.tensor([1, 2])}] * 2

    def run(m: nn.Module, dtype: torch.dtype | None) -> Any:
        with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
            if mode == "eval":
                with torch.no_grad():
                    return m(images)
            out = m(images, targets)
        sum(out.values()).backward()
        return out, {n: p.grad for n, p in m.named_parameters()}

    expected = run(copy.deepcopy(model), torch.bfloat16)
    compiled = amp_fx.compile(model, dtype=torch.bfloat16, backend="aot_eager")
    assert_bitwise(run(compiled, None), expected, mode)
    assert _own_kernel_nodes(compiled, "torchvision::roi_align"), "roi_align ran outside amp_fx's graphs"
