"""amp_fx.policy: the default tables against torch's dispatcher, Policy validation, classify()."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from amp_fx import CastClass, Policy
from amp_fx._common.devices import DEVICES
from amp_fx.policy import DEFAULT_TABLES, default_class, op_from_name, resolve_dtype
from amp_fx.testing.real_models import library_missing

aten = torch.ops.aten

_DISPATCH_KEYS = {d.type: d.dispatch_key for d in DEVICES.values()}


# --- (a) the default tables are torch's autocast registrations, overload for overload -----------


@pytest.mark.parametrize("device_type", sorted(_DISPATCH_KEYS))
def test_default_table_is_exactly_torchs_registrations(device_type: str) -> None:
    """A torch upgrade that adds, drops or renames an autocast op fails here, naming it.

    torch's own ops (``aten::``) only: a library's ops (torchvision's ``nms``, ``roi_align``, ...)
    are not in the tables; they run their own kernel (the next test)."""
    registered = {
        name
        for name in torch._C._dispatch_get_registrations_for_dispatch_key(_DISPATCH_KEYS[device_type])
        if name.startswith("aten::")
    }
    ours = set(DEFAULT_TABLES[device_type])
    assert registered, f"torch reports no {_DISPATCH_KEYS[device_type]} registrations"
    assert not registered - ours, f"registered by torch, missing from amp_fx: {sorted(registered - ours)}"
    assert not ours - registered, f"in amp_fx's table, not registered by torch: {sorted(ours - registered)}"


@torch.library.custom_op("amp_fx_policy_test::probe", mutates_args=())
def _probe(x: torch.Tensor) -> torch.Tensor:
    return x.clone()


for _device_type in _DISPATCH_KEYS:
    torch.library.register_autocast("amp_fx_policy_test::probe", _device_type, torch.float32)


@pytest.mark.parametrize("device_type", sorted(_DISPATCH_KEYS))
def test_every_autocast_registration_outside_aten_runs_its_own_kernel(device_type: str) -> None:
    """No op with an Autocast kernel passes amp_fx silently: every one outside torch's tables (a
    library's, as torchvision's once imported, here a torch.library probe) is OWN_KERNEL, which
    runs that kernel (tests/policy/test_own_autocast_kernels.py checks the values)."""
    library_missing("torchvision")  # imports it where it loads (its kernels are then checked too)
    key = _DISPATCH_KEYS[device_type]
    others = {
        name for name in torch._C._dispatch_get_registrations_for_dispatch_key(key) if not name.startswith("aten::")
    }
    assert "amp_fx_policy_test::probe" in others, f"the probe's {key} kernel is not registered"
    for name in sorted(others):
        assert default_class(name, device_type) is CastClass.OWN_KERNEL, name
        decision = Policy().classify(op_from_name(name), device_type, ())
        assert decision.cast_class is CastClass.OWN_KERNEL, (name, decision)
        assert decision.reason.endswith(f"runs its own {key} kernel, as in eager autocast"), decision


@pytest.mark.parametrize("device_type", sorted(_DISPATCH_KEYS))
def test_default_table_names_resolve_to_overloads(device_type: str) -> None:
    for name, cls in DEFAULT_TABLES[device_type].items():
        assert isinstance(cls, CastClass)
        assert cls is not CastClass.NONE, f"{name}: NONE is for policies, not torch's tables"
        packet, _, overload = name.removeprefix("aten::").partition(".")
        op = getattr(getattr(aten, packet), overload or "default")
        assert op.name() == name


def test_default_tables_are_read_only() -> None:
    with pytest.raises(TypeError):
        DEFAULT_TABLES["cpu"]["aten::mm"] = CastClass.FP32  # type: ignore[index]
    with pytest.raises(TypeError):
        DEFAULT_TABLES["mps"] = {}  # type: ignore[index]


# --- (b) Policy validation -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "op", ["aten.not_an_op", "aten::not_an_op", "not_an_op", "torch.ops.aten.not_an_op", "nonexistent_ns::mm"]
)
def test_unknown_op_raises_value_error_naming_it(op: str) -> None:
    with pytest.raises(ValueError, match="not_an_op|nonexistent_ns"):
        Policy(op_classes={op: CastClass.FP32})


def test_unknown_overload_raises_value_error_naming_it() -> None:
    with pytest.raises(ValueError, match=r"conv2d.*no overload 'nonsense'") as info:
        Policy(op_classes={"aten::conv2d.nonsense": CastClass.FP32})
    assert "padding" in str(info.value), "the error should list the overloads that do exist"


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        pytest.param(
            {"op_classes": [("aten::mm", CastClass.FP32)]},
            "op_classes must be a mapping",
            id="op_classes-not-a-mapping",
        ),
        pytest.param({"op_classes": {"aten::mm": "fp32"}}, "must be a CastClass", id="class-is-a-string"),
        pytest.param({"op_classes": {42: CastClass.FP32}}, "string or a torch op", id="op-is-an-int"),
        pytest.param({"keep_fp32": (42,)}, "keep_fp32", id="keep-int"),
        pytest.param({"keep_fp32": ("",)}, "keep_fp32", id="keep-empty-name"),
        pytest.param({"keep_fp32": (int,)}, "keep_fp32", id="keep-non-module-type"),
    ],
)
def test_wrong_types_raise_type_error(kwargs: dict, match: str) -> None:
    with pytest.raises(TypeError, match=match):
        Policy(**kwargs)


@pytest.mark.parametrize("op", ["aten::mm", "aten::to.dtype", "aten::layer_norm"])
def test_set_opt_dtype_needs_an_optional_dtype_argument(op: str) -> None:
    """mm and layer_norm have no dtype argument; to.dtype has one, but it is required."""
    with pytest.raises(ValueError, match=f"{op.replace('.', r'[.]')} cannot be FP32_SET_OPT_DTYPE"):
        Policy(op_classes={op: CastClass.FP32_SET_OPT_DTYPE})


@pytest.mark.parametrize("op", ["aten::softmax.int", "aten::mean.dim", "aten::sum.dim_IntList"])
def test_set_opt_dtype_accepted_where_dtype_is_optional(op: str) -> None:
    policy = Policy(op_classes={op: CastClass.FP32_SET_OPT_DTYPE})
    assert set(policy.op_classes.values()) == {CastClass.FP32_SET_OPT_DTYPE}


def test_append_dtype_only_where_a_dtype_overload_exists() -> None:
    Policy(op_classes={"aten::norm.Scalar": CastClass.FP32_APPEND_DTYPE})
    with pytest.raises(ValueError, match="cannot be FP32_APPEND_DTYPE"):
        Policy(op_classes={"aten::mm": CastClass.FP32_APPEND_DTYPE})


def test_policy_is_frozen() -> None:
    policy = Policy(op_classes={"aten::mm": CastClass.FP32}, keep_fp32=("head",))
    with pytest.raises(dataclasses.FrozenInstanceError):
        policy.keep_fp32 = ()  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        policy.cast_cache = False  # type: ignore[misc]
    with pytest.raises(TypeError):
        policy.op_classes["aten::mm"] = CastClass.NONE  # type: ignore[index]


def test_equal_policies_hash_equal() -> None:
    """Spellings of the same policy compare and hash equal (the policy is a compile-cache key)."""
    spellings = [
        Policy(op_classes={"aten.layer_norm": CastClass.FP32, "aten::mm": CastClass.NONE}, keep_fp32=["head"]),
        Policy(op_classes={aten.mm: CastClass.NONE, aten.layer_norm: CastClass.FP32}, keep_fp32=("head",)),
        Policy(op_classes={"torch.ops.aten.mm": CastClass.NONE, "layer_norm": CastClass.FP32}, keep_fp32="head"),
    ]
    for other in spellings[1:]:
        assert other == spellings[0]
        assert hash(other) == hash(spellings[0])
    assert len(set(spellings)) == 1
    assert hash(Policy()) == hash(Policy())
    assert Policy() != Policy(cast_cache=False)
    assert Policy() != Policy(keep_fp32=("head",))
    assert Policy(op_classes={"aten::mm": CastClass.FP32}) != Policy(op_classes={"aten::mm": CastClass.NONE})
    # A string without an overload names the packet, so it is not the default overload alone.
    assert Policy(op_classes={"aten::mm": CastClass.NONE}) != Policy(op_classes={aten.mm.default: CastClass.NONE})


def test_packet_expands_to_every_overload() -> None:
    expected = {getattr(aten.layer_norm, o).name() for o in aten.layer_norm.overloads()}
    for key in (aten.layer_norm, "aten.layer_norm", "aten::layer_norm"):
        assert set(Policy(op_classes={key: CastClass.FP32}).op_classes) == expected, key
    conv = {getattr(aten.conv2d, o).name() for o in aten.conv2d.overloads()}
    assert len(conv) > 1
    assert set(Policy(op_classes={aten.conv2d: CastClass.FP32}).op_classes) == conv


def test_overload_and_dotted_string_name_one_overload() -> None:
    assert dict(Policy(op_classes={aten.conv2d.padding: CastClass.FP32}).op_classes) == {
        "aten::conv2d.padding": CastClass.FP32
    }
    assert dict(Policy(op_classes={"aten::conv2d.padding": CastClass.FP32}).op_classes) == {
        "aten::conv2d.padding": CastClass.FP32
    }
    assert dict(Policy(op_classes={aten.conv2d.default: CastClass.FP32}).op_classes) == {"aten::conv2d": CastClass.FP32}


class _Head(torch.nn.Linear):
    pass


@pytest.mark.parametrize(
    ("selector", "stack", "kept"),
    [
        pytest.param("lm_head", (("lm_head", torch.nn.Linear),), True, id="name"),
        pytest.param(
            "blocks.0",
            (("blocks", torch.nn.ModuleList), ("blocks.0.attn", torch.nn.Module)),
            True,
            id="name-covers-descendants",
        ),
        pytest.param("lm_head", (("lm_head2", torch.nn.Linear),), False, id="name-is-not-a-prefix"),
        pytest.param("lm_head", (), False, id="name-outside-any-module"),
        pytest.param(torch.nn.Linear, (("out", torch.nn.Linear),), True, id="type"),
        pytest.param(torch.nn.Linear, (("out", _Head),), True, id="type-covers-subclasses"),
        pytest.param(torch.nn.LayerNorm, (("out", torch.nn.Linear),), False, id="other-type"),
    ],
)
def test_keep_fp32_by_name_and_by_type(selector: object, stack: tuple, kept: bool) -> None:
    decision = Policy(keep_fp32=(selector,)).classify(aten.mm.default, "cpu", stack)
    if kept:
        assert decision.cast_class is CastClass.FP32
        assert "kept by policy" in decision.reason
    else:
        assert decision == Policy().classify(aten.mm.default, "cpu", stack)


@pytest.mark.parametrize(
    ("alias", "expected"),
    [
        ("bf16", torch.bfloat16),
        ("bfloat16", torch.bfloat16),
        (torch.bfloat16, torch.bfloat16),
        ("fp16", torch.float16),
        ("float16", torch.float16),
        ("half", torch.float16),
        (torch.float16, torch.float16),
    ],
)
def test_resolve_dtype_accepts_the_aliases(alias: object, expected: torch.dtype) -> None:
    assert resolve_dtype(alias) is expected


@pytest.mark.parametrize("bad", ["fp32", "BF16", "float", torch.float32, torch.float64, None, 16, ["bf16"]], ids=repr)
def test_resolve_dtype_rejects_others_listing_accepted_values(bad: object) -> None:
    with pytest.raises(ValueError) as info:
        resolve_dtype(bad)
    message = str(info.value)
    assert repr(bad) in message
    for accepted in ('"bf16"', '"bfloat16"', '"fp16"', '"float16"', '"half"', "torch.bfloat16", "torch.float16"):
        assert accepted in message, (accepted, message)


# --- (c) classify() records why ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("op", "device_type", "expected", "reason"),
    [
        (aten.mm.default, "cpu", CastClass.LOWER_PRECISION_FP, "lower precision fp: aten.mm (default cpu table)"),
        (aten.cat.default, "cpu", CastClass.PROMOTE, "promote: aten.cat (default cpu table)"),
        (aten.exp.default, "cuda", CastClass.FP32, "fp32: aten.exp (default cuda table)"),
        (
            aten.sum.dim_IntList,
            "cuda",
            CastClass.FP32_SET_OPT_DTYPE,
            "fp32 set opt dtype: aten.sum.dim_IntList (default cuda table)",
        ),
        (
            aten.norm.Scalar,
            "cuda",
            CastClass.FP32_APPEND_DTYPE,
            "fp32 append dtype: aten.norm.Scalar (default cuda table)",
        ),
        (
            aten.binary_cross_entropy.default,
            "cuda",
            CastClass.BANNED,
            "banned: aten.binary_cross_entropy (default cuda table)",
        ),
        (aten.exp.default, "cpu", CastClass.NONE, "not autocast: aten.exp runs in its inputs' dtypes"),
        (aten.add.Tensor, "cuda", CastClass.NONE, "not autocast: aten.add.Tensor runs in its inputs' dtypes"),
    ],
)
def test_classify_default_reasons(
    op: torch._ops.OpOverload, device_type: str, expected: CastClass, reason: str
) -> None:
    decision = Policy().classify(op, device_type, ())
    assert decision.cast_class is expected
    assert decision.cast_class is DEFAULT_TABLES[device_type].get(op.name(), CastClass.NONE)
    assert decision.reason == reason


def test_classify_moved_by_policy() -> None:
    policy = Policy(
        op_classes={"aten::mm": CastClass.FP32, "aten::exp": CastClass.LOWER_PRECISION_FP, "aten::cat": CastClass.NONE}
    )
    assert policy.classify(aten.mm.default, "cpu", ()).reason == "fp32: aten.mm (moved by policy)"
    assert policy.classify(aten.exp.default, "cuda", ()).reason == ("lower precision fp: aten.exp (moved by policy)")
    cat = policy.classify(aten.cat.default, "cpu", ())
    assert cat.cast_class is CastClass.NONE and "moved by policy" in cat.reason


def test_classify_kept_module_wins_over_tables_and_moves() -> None:
    policy = Policy(op_classes={"aten::mm": CastClass.LOWER_PRECISION_FP}, keep_fp32=("head",))
    decision = policy.classify(aten.mm.default, "cpu", (("", torch.nn.Module), ("head", torch.nn.Linear)))
    assert decision.cast_class is CastClass.FP32
    assert decision.reason == "fp32: module head kept by policy (head)"
    by_type = Policy(keep_fp32=(torch.nn.Linear,)).classify(aten.mm.default, "cuda", (("head", torch.nn.Linear),))
    assert by_type.reason == "fp32: module head kept by policy (Linear)"


def test_table_applies_the_policy_on_top_of_the_defaults() -> None:
    policy = Policy(op_classes={aten.mm.default: CastClass.NONE, aten.exp.default: CastClass.FP32})
    table = policy.table("cpu")
    assert "aten::mm" not in table
    assert table["aten::exp"] is CastClass.FP32
    assert {k: v for k, v in table.items() if k != "aten::exp"} == {
        k: v for k, v in DEFAULT_TABLES["cpu"].items() if k != "aten::mm"
    }
    assert dict(Policy().table("cuda")) == dict(DEFAULT_TABLES["cuda"])
    assert DEFAULT_TABLES["cpu"]["aten::mm"] is CastClass.LOWER_PRECISION_FP, "defaults untouched"
