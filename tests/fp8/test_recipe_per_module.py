"""A low-precision recipe per module (issue 60): ``low_precision=`` (``fp8=`` its older spelling),
:class:`amp_fx.LowPrecision`, :class:`amp_fx.Blocks` and the preset ``LowPrecision.keep_ends``.

The references: a kept module's numerics against ``Policy(keep_out_of_fp8=...)`` (itself bitwise
with torchao's ``module_filter_fn``, tests/fp8/test_fp8_pass.py), with a negative twin (the run that
converts them); a mix of recipes against torchao 0.18 converting each module with its own recipe;
the selection rule on module stacks, each case with the entry that must not win.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor, nn

import amp_fx
from amp_fx import Blocks, LowPrecision
from amp_fx.fp8 import Fp8Recipe
from amp_fx.low_precision import recipe_for, with_blocks
from amp_fx.testing import assert_bitwise
from amp_fx.testing.fp8_reference import cpu_autocast_torchao, torchao_float8, torchao_missing
from amp_fx.testing.real_models import LLAMA_4_LAYERS
from tests.fp8._fp8_cases import _needs_rowwise, loss_fn, mlp

pytestmark = pytest.mark.skipif(torchao_missing() is not None, reason=str(torchao_missing()))

_KEPT = ("model.layers.0", "model.layers.3", "lm_head")
"""What the preset keeps in bf16 on the 4-block Llama: the first and last blocks and the head."""


# --- the selection rule (no compile) ----------------------------------------------------------------


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.Linear(16, 16)
        self.experts = nn.ModuleList([nn.Linear(16, 16), nn.Linear(16, 16)])  # a smaller repeated list

    def forward(self, x: Tensor) -> Tensor:
        x = x + torch.relu(self.attn(x))
        return x + sum(torch.relu(e(x)) for e in self.experts)


class _Net(nn.Module):
    def __init__(self, n: int = 4, as_dict: bool = False) -> None:
        super().__init__()
        blocks = [_Block() for _ in range(n)]
        self.layers: nn.Module = (
            nn.ModuleDict({str(i): b for i, b in enumerate(blocks)}) if as_dict else nn.ModuleList(blocks)
        )
        self.head = nn.Linear(16, 16)

    def forward(self, x: Tensor) -> Tensor:
        for block in self.layers.values() if isinstance(self.layers, nn.ModuleDict) else self.layers:
            x = block(x)
        return self.head(x)


def _stack(root: nn.Module, path: str) -> list[tuple[str, type]]:
    parts = path.split(".")
    return [("", type(root))] + [
        (p, type(root.get_submodule(p))) for p in (".".join(parts[: i + 1]) for i in range(len(parts)))
    ]


@pytest.mark.parametrize("as_dict", [False, True], ids=["ModuleList", "ModuleDict"])
def test_blocks_are_the_largest_repeated_list(as_dict: bool) -> None:
    """``Blocks`` finds ``layers`` (a ModuleList as transformers', a ModuleDict as torchtitan's),
    not the smaller repeated ``experts`` lists inside each block."""
    net = _Net(4, as_dict)
    assert Blocks(first=1, last=2).paths(net) == ("layers.0", "layers.2", "layers.3")
    assert Blocks(first=3, last=3).paths(net) == ("layers.0", "layers.1", "layers.2", "layers.3")  # overlap: once
    assert Blocks(last=1, of="layers.0.experts").paths(net) == ("layers.0.experts.1",)


def test_the_most_specific_selector_wins() -> None:
    net = _Net()
    lp = with_blocks(
        LowPrecision(
            recipe="tensorwise",
            modules={
                "layers.1": "rowwise",  # a block by name
                nn.Linear: "rowwise_with_gw_hp",  # every Linear: deeper than any name here but the next
                "layers.1.attn": None,  # deeper than the Linear type's match at the same module: same depth
                Blocks(last=1): None,
            },
        ),
        net,
    )
    assert isinstance(lp, LowPrecision)

    def at(path: str) -> tuple[Fp8Recipe | None, str | None]:
        return recipe_for(lp, _stack(net, path))

    # the type selects the innermost Linear (depth 3), deeper than "layers.1" (depth 2)
    assert at("layers.1.experts.0") == (Fp8Recipe.ROWWISE_WITH_GW_HP, "Linear")
    # a name and a type on the same module: the name wins
    assert at("layers.1.attn") == (None, "'layers.1.attn'")
    # Blocks(last=1) names layers.3 (depth 2), shallower than the Linear inside it
    assert at("layers.3.attn") == (Fp8Recipe.ROWWISE_WITH_GW_HP, "Linear")
    # without the type entry, the block's entry decides what is inside it
    no_type = with_blocks(LowPrecision(recipe="tensorwise", modules={"layers.1": "rowwise", Blocks(last=1): None}), net)
    assert no_type is not None
    assert recipe_for(no_type, _stack(net, "layers.3.attn")) == (None, "Blocks(first=0, last=1, of=None)")
    assert recipe_for(no_type, _stack(net, "layers.1.attn")) == (Fp8Recipe.ROWWISE, "'layers.1'")
    # nothing selects the head: the default recipe, no selector
    assert recipe_for(no_type, _stack(net, "head")) == (Fp8Recipe.TENSORWISE, None)
    # two types selecting the same module (the innermost around the matmul): the later entry wins
    first = LowPrecision(recipe="tensorwise", modules={nn.Module: None, nn.Linear: "rowwise"})
    assert recipe_for(first, _stack(net, "head")) == (Fp8Recipe.ROWWISE, "Linear")
    swapped = LowPrecision(recipe="tensorwise", modules={nn.Linear: "rowwise", nn.Module: None})
    assert recipe_for(swapped, _stack(net, "head")) == (None, "Module")


@pytest.mark.parametrize(
    "build, error, match",
    [
        (lambda: LowPrecision(modules={3: None}), TypeError, "module's qualified name"),
        (lambda: LowPrecision(modules={"": None}), TypeError, "module's qualified name"),
        (lambda: LowPrecision(recipe="rowwize"), ValueError, "unknown low-precision recipe 'rowwize'"),
        (lambda: LowPrecision(modules={"fc1": "fp4"}), ValueError, "unknown low-precision recipe 'fp4'"),
        (lambda: LowPrecision(modules={"fc1": None}), ValueError, "runs no matmul in low precision"),
        (lambda: LowPrecision(modules=["fc1"]), TypeError, "must be a mapping"),
        (lambda: Blocks(), ValueError, "selects no block"),
        (lambda: Blocks(first=-1), TypeError, "int >= 0"),
        (lambda: amp_fx.compile(nn.Linear(4, 4), low_precision=3), TypeError, "low-precision recipe"),
    ],
)
def test_bad_maps_fail_with_the_reason(build: Callable[[], object], error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        build()


def test_a_map_is_frozen_hashable_and_picklable() -> None:
    import pickle

    lp = LowPrecision.keep_ends(recipe="rowwise")
    with pytest.raises(AttributeError):
        lp.recipe = Fp8Recipe.TENSORWISE  # type: ignore[misc]
    same = pickle.loads(pickle.dumps(lp))
    assert same == lp and hash(same) == hash(lp)
    assert lp != LowPrecision.keep_ends(recipe="rowwise", blocks=2)


# --- the option's name ------------------------------------------------------------------------------


def test_fp8_and_low_precision_give_identical_graphs() -> None:
    model, x = mlp()
    graphs = []
    for kw in ({"fp8": "tensorwise"}, {"low_precision": "tensorwise"}):
        compiled = amp_fx.compile(copy.deepcopy(model), dtype="bf16", backend="aot_eager", **kw)
        compiled(x)
        graphs.append([r.rewritten.code for r in amp_fx.records(compiled)])
        assert amp_fx.options_of(compiled).fp8 == amp_fx.Fp8Config("tensorwise")
    assert graphs[0] == graphs[1]
    # negative twin: another recipe gives another graph
    other = amp_fx.compile(copy.deepcopy(model), dtype="bf16", backend="aot_eager", low_precision="rowwise_with_gw_hp")
    other(x)
    assert [r.rewritten.code for r in amp_fx.records(other)] != graphs[0]


@pytest.mark.parametrize("entry", ["compile", "compile_step", "explain", "compare", "advise"])
def test_fp8_and_low_precision_at_once_is_an_error(entry: str) -> None:
    model, x = mlp()
    both: dict[str, Any] = {"fp8": "tensorwise", "low_precision": "rowwise"}
    calls: dict[str, Callable[[], object]] = {
        "compile": lambda: amp_fx.compile(model, **both),
        "compile_step": lambda: amp_fx.compile_step(
            model, torch.optim.SGD(model.parameters(), lr=0.1), lambda out: out.sum(), dtype="bf16", **both
        ),
        "explain": lambda: amp_fx.explain(model, x, **both),
        "compare": lambda: amp_fx.compare(model, x, **both),
        "advise": lambda: amp_fx.advise(model, x, dtype="bf16", **both),
    }
    with pytest.raises(TypeError, match=r"both fp8='tensorwise' and low_precision='rowwise'"):
        calls[entry]()


def test_every_recipe_of_a_map_must_suit_the_dtype() -> None:
    lp = LowPrecision(recipe="tensorwise", modules={"fc2": "mxfp8"})
    with pytest.raises(ValueError, match=r"'mxfp8' \(in the per-module map\) needs dtype=torch.bfloat16"):
        amp_fx.compile(mlp()[0], dtype="fp16", low_precision=lp)
    amp_fx.compile(mlp()[0], dtype="bf16", low_precision=lp)  # the twin: bf16 takes it


# --- selectors that select nothing ------------------------------------------------------------------


def test_a_name_not_in_the_model_warns_with_did_you_mean_and_strict_raises() -> None:
    model, _ = mlp()
    lp = LowPrecision(recipe="tensorwise", modules={"model.fc2": None})
    with pytest.warns(amp_fx.AmpFxWarning, match=r"'model.fc2', which MLP does not have \(did you mean \['fc2'\]\?\)"):
        amp_fx.compile(model, low_precision=lp, strict=False)
    with pytest.raises(amp_fx.AmpFxError, match=r"does not have \(did you mean \['fc2'\]\?\)"):
        amp_fx.compile(model, low_precision=lp, strict=True)
    amp_fx.compile(model, low_precision={"fc2": "tensorwise"}, strict=True)  # the twin: a name it has


def test_an_entry_that_decides_no_matmul_is_reported() -> None:
    """An entry selecting no module that runs a matmul (no Conv2d in the MLP) says so at the first call."""
    model, x = mlp()
    lp = LowPrecision(recipe="tensorwise", modules={"head": None, nn.Conv2d: "rowwise"})
    with pytest.raises(amp_fx.AmpFxError, match=r"map entry Conv2d -> 'rowwise' decided no matmul"):
        amp_fx.compile(model, dtype="bf16", backend="aot_eager", low_precision=lp, strict=True)(x)
    twin = LowPrecision(recipe="tensorwise", modules={"head": None})
    amp_fx.compile(model, dtype="bf16", backend="aot_eager", low_precision=twin, strict=True)(x)


def test_the_policy_keeps_a_module_out_whatever_the_map_says() -> None:
    """``Policy(keep_out_of_fp8=["fc2"])`` wins over the map's ``fc2`` entry; its twin without the
    policy runs fc2 in the map's recipe."""
    model, x = mlp()
    lp = LowPrecision(recipe="tensorwise", modules={"fc2": "rowwise_with_gw_hp"})
    for policy, fc2 in ((amp_fx.Policy(keep_out_of_fp8=["fc2"]), None), (None, Fp8Recipe.ROWWISE_WITH_GW_HP)):
        decisions = {d.module: d for d in amp_fx.explain(model, x, low_precision=lp, policy=policy).fp8_decisions()}
        assert decisions["fc2"].recipe is fc2, decisions["fc2"]
        assert ("kept out of fp8 by policy (fc2)" in decisions["fc2"].reason) is (policy is not None)
        assert decisions["fc1"].recipe is Fp8Recipe.TENSORWISE and decisions["fc1"].selector is None


# --- numerics ---------------------------------------------------------------------------------------


def _step(model: nn.Module, x: Tensor, **compile_kwargs: Any) -> tuple[Tensor, dict[str, Tensor]]:
    compiled = amp_fx.compile(model, dtype="bf16", backend="aot_eager", **compile_kwargs)
    loss = loss_fn(compiled(x))
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def test_a_mix_of_recipes_is_bitwise_with_torchao_converting_each_module_with_its_own() -> None:
    """fc1 tensorwise (the default), fc2 rowwise, head in bf16: torchao converts fc1 with its
    tensorwise config and fc2 with its rowwise one and leaves head alone; loss and every gradient
    bit for bit. The negative twin: one recipe everywhere differs on fc2's gradient."""
    _needs_rowwise()
    model, x = mlp()
    lp = LowPrecision(recipe="tensorwise", modules={"fc2": "rowwise", "head": None})
    loss, grads = _step(copy.deepcopy(model), x, low_precision=lp)

    ref = torchao_float8(model, "tensorwise", lambda m, name: name == "fc1")
    ref = torchao_float8(ref, "rowwise", lambda m, name: name == "fc2")
    with cpu_autocast_torchao(), torch.autocast("cpu", torch.bfloat16):
        ref_loss = loss_fn(ref(x))
    ref_loss.backward()
    assert_bitwise(loss, ref_loss.detach(), "loss")
    assert_bitwise(grads, {n: p.grad for n, p in ref.named_parameters()}, "gradients")

    _, single = _step(copy.deepcopy(model), x, low_precision=LowPrecision(recipe="tensorwise", modules={"head": None}))
    assert not torch.equal(single["fc2.weight"], grads["fc2.weight"])


def test_compare_runs_the_map_on_both_sides() -> None:
    """``compare``'s eager side runs each matmul in the recipe of its module: every op agrees."""
    _needs_rowwise()
    model, x = mlp()
    lp = LowPrecision(recipe="tensorwise", modules={"fc2": "rowwise", "head": None})
    report = amp_fx.compare(model, x, low_precision=lp, backend="aot_eager", loss_fn=loss_fn)
    assert report.first_divergence is None and all(o.agree for o in report.ops), str(report)
    assert all(v.agree for v in report.outputs) and report.grads and all(g.agree for g in report.grads)
    assert report.fp8 == "tensorwise + rowwise"


def test_preset_on_a_small_block_model_is_the_policy_naming_the_same_modules() -> None:
    """The preset's fast twin of the Llama test below (a ModuleDict of blocks, as torchtitan's):
    bitwise with ``Policy(keep_out_of_fp8=[first block, last block, head])``, and the kept
    blocks' gradients differ from the run converting every matmul."""
    torch.manual_seed(0)
    model, x = _Net(3, as_dict=True), torch.randn(2, 8, 16)
    preset = LowPrecision.keep_ends(recipe="tensorwise", head="head")
    _, grads = _step(copy.deepcopy(model), x, low_precision=preset)
    policy = amp_fx.Policy(keep_out_of_fp8=["layers.0", "layers.2", "head"])
    _, ref = _step(copy.deepcopy(model), x, fp8="tensorwise", policy=policy)
    assert_bitwise(grads, ref, "gradients")
    _, every = _step(copy.deepcopy(model), x, fp8="tensorwise")
    for name in ("layers.0.attn.weight", "layers.2.experts.1.weight", "head.weight"):
        assert not torch.equal(grads[name], every[name]), name


def test_compile_step_takes_the_map() -> None:
    """``compile_step(low_precision=...)`` with ``Blocks`` (found on the step's model): one step's
    loss and parameters bitwise with ``Policy(keep_out_of_fp8=...)`` naming the same modules."""
    torch.manual_seed(0)
    model, x = _Net(3), torch.randn(2, 8, 16)
    results = []
    for kw in (
        {"low_precision": LowPrecision(recipe="tensorwise", modules={Blocks(first=1): None, "head": None})},
        {"fp8": "tensorwise", "policy": amp_fx.Policy(keep_out_of_fp8=["layers.0", "head"])},
    ):
        m = copy.deepcopy(model)
        step = amp_fx.compile_step(
            m, torch.optim.SGD(m.parameters(), lr=0.1), loss_fn, dtype="bf16", backend="aot_eager", **kw
        )
        results.append((step(x), [p.detach().clone() for p in m.parameters()]))
    assert_bitwise(results[0][0], results[1][0], "loss")
    assert_bitwise(results[0][1], results[1][1], "parameters")


def _llama_step(model: nn.Module, inputs: dict[str, Tensor], loss: Any, **kw: Any) -> dict[str, Tensor]:
    compiled = amp_fx.compile(model, dtype="bf16", backend="aot_eager", **kw)
    loss(compiled(**inputs)).backward()
    return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.slow  # about 100 s here: explain and three compiles of a 4-block Llama
@pytest.mark.skipif(LLAMA_4_LAYERS.missing() is not None, reason=str(LLAMA_4_LAYERS.missing()))
def test_preset_keeps_first_last_blocks_and_head_in_bf16_on_a_llama() -> None:
    """``LowPrecision.keep_ends`` on a transformers Llama with 4 blocks: ``explain`` shows blocks 0
    and 3 and ``lm_head`` in bf16 (chosen by the preset's entries) and every matmul of blocks 1-2
    in tensorwise fp8; the gradients are bitwise those of ``Policy(keep_out_of_fp8=...)`` naming
    the same modules, and the kept blocks' weight gradients differ from the run converting every
    matmul (so the check can fail)."""
    model, inputs, loss = LLAMA_4_LAYERS.build()
    preset = LowPrecision.keep_ends(recipe="tensorwise")
    decisions = amp_fx.explain(model, **inputs, low_precision=preset).fp8_decisions()
    assert len(decisions) == 4 * 7 + 1
    for d in decisions:
        kept = d.module.startswith(_KEPT)
        assert d.converted is not kept and d.recipe is (None if kept else Fp8Recipe.TENSORWISE), d
        if kept:
            assert d.selector == ("'lm_head'" if d.module == "lm_head" else "Blocks(first=1, last=1, of=None)"), d

    grads = _llama_step(copy.deepcopy(model), inputs, loss, low_precision=preset)
    policy = amp_fx.Policy(keep_out_of_fp8=list(_KEPT))
    assert_bitwise(grads, _llama_step(copy.deepcopy(model), inputs, loss, fp8="tensorwise", policy=policy), "grads")
    every = _llama_step(copy.deepcopy(model), inputs, loss, fp8="tensorwise")
    for name in ("model.layers.0.mlp.down_proj.weight", "model.layers.3.self_attn.q_proj.weight", "lm_head.weight"):
        assert not torch.equal(grads[name], every[name]), name
