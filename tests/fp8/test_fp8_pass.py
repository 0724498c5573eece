"""The fp8 pass: what it converts (every ``nn.Linear``, functional linears torchao leaves), the
graph it leaves (outputs that are no views, what the backward saves), and what stays out of fp8
and why (shapes ``_scaled_mm`` cannot take, the policy, strict mode).
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from torch import Tensor, nn

import amp_fx
from amp_fx.fp8 import Fp8Recipe
from amp_fx.kernels.fp8_matmul import fp8_matmul
from amp_fx.passes import meta
from amp_fx.policy import Policy
from amp_fx.testing import assert_bitwise
from amp_fx.testing.fp8_reference import (
    count_gemm_flops,
    cpu_autocast_torchao,
    torchao_float8,
    torchao_missing,
)
from amp_fx.testing.memory import SavedBytes
from tests.fp8._fp8_cases import (
    RECIPES,
    LeftWeights,
    Odd,
    _needs_rowwise,
    _recipe,
    compile_fp8,
    loss_fn,
    mlp,
)

pytestmark = pytest.mark.skipif(torchao_missing() is not None, reason=str(torchao_missing()))


def _fp8_nodes(compiled: nn.Module) -> list[torch.fx.Node]:
    return [
        n
        for r in compiled.amp_fx_records
        for n in r.rewritten.graph.nodes
        if n.op == "call_function" and n.target is fp8_matmul
    ]


class LogitsAndLoss(nn.Module):
    """A causal LM's head: a bias-free Linear on 3-D input whose output the graph returns and
    also reads (the loss)."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.head = nn.Linear(32, n, bias=False)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        logits = self.head(x)
        return logits, logits.float().pow(2).mean()


@pytest.mark.filterwarnings("ignore:amp_fx. fp8='mxfp8' runs emulated here")
@pytest.mark.parametrize("n, weight_cache", [(64, False), (40, True)], ids=["aligned", "padded-cached"])
@pytest.mark.parametrize("recipe", [_recipe("tensorwise"), _recipe("rowwise"), "mxfp8"])
def test_a_converted_matmuls_output_is_no_view_as_eager_autocasts_is_none(
    recipe: str, n: int, weight_cache: bool
) -> None:
    """``aten.matmul`` ends in ``aten._unsafe_view``: a bias-free Linear's output on 3-D input is
    a tensor of its own under eager autocast. The fp8 matmuls ended in ``reshape``: AOTAutograd
    then handed the logits back as a view of the 2-D GEMM result, and FSDP2 warned that the model
    "returned a view tensor" (an in-place op on such a view drops the unit's pre-backward hook).
    Also where N is padded (the output is a slice of the GEMM's columns) and with the weight cache."""
    torch.manual_seed(0)
    model, x = LogitsAndLoss(n), torch.randn(2, 16, 32)
    with torch.autocast("cpu", torch.bfloat16):
        assert model(x)[0]._base is None  # the reference
    compiled = amp_fx.compile(
        model, dtype="bf16", fp8=recipe, weight_cache=weight_cache, backend="aot_eager", strict=True
    )
    logits, loss = compiled(x)
    assert len(_fp8_nodes(compiled)) == 1
    assert logits._base is None, f"{recipe}: the logits are a view of a {tuple(logits._base.shape)} tensor"
    loss.backward()  # and the graph's backward still runs on it


def test_the_backward_saves_the_weights_not_their_fp8_casts_as_torchao_does() -> None:
    """The tensors saved from the forward for the backward, parameters left out, are torchao's
    (``torch.compile`` of ``convert_to_float8_training``'s model): each weight's fp8 cast is
    recomputed in the backward from the fp32 weight, which costs nothing to keep (a parameter).
    ``aot_eager_decomp_partition`` runs inductor's partitioner (min-cut) without building kernels.
    amp_fx handed AOTAutograd a graph without Dynamo's input metadata, so no parameter was static
    and the partitioner kept every weight's fp8 cast alive instead: one byte per weight element
    more than torchao (amp_fx/backend/dynamo_inputs.py)."""
    model, x = mlp()
    backend = "aot_eager_decomp_partition"

    def saved(forward: Callable[[Tensor], Tensor], params: list[Tensor]) -> int:
        loss_fn(forward(x)).backward()  # compiles (fake tensors: not under the hooks)
        with SavedBytes() as s:
            out = forward(x)
        loss_fn(out).backward()  # the saved tensors were the backward's inputs
        return s.bytes(exclude=params)

    ref = torch.compile(torchao_float8(model, "tensorwise"), backend=backend)

    def ref_forward(t: Tensor) -> Tensor:
        with cpu_autocast_torchao(), torch.autocast("cpu", torch.bfloat16):
            return ref(t)

    compiled = compile_fp8(model, "tensorwise", backend=backend)
    fp8_weights = sum(p.numel() for n, p in model.named_parameters() if n.endswith("weight"))  # one byte each
    amp = saved(compiled, list(model.parameters()))
    assert len(_fp8_nodes(compiled)) == 3
    assert amp == saved(ref_forward, list(ref.parameters())), f"{fp8_weights} fp8 weight bytes"


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_linear_becomes_one_fp8_matmul(recipe: str) -> None:
    model, x = mlp()
    compiled = compile_fp8(model, recipe)
    compiled(x)
    (record,) = compiled.amp_fx_records
    nodes = _fp8_nodes(compiled)
    assert len(nodes) == 3
    assert not [n for n in record.rewritten.graph.nodes if n.target is torch.ops.aten.linear.default]
    # The weight enters in fp32 (torchao scales the master weight): no bf16 cast of a weight is left.
    weights = {
        p
        for p in record.rewritten.graph.nodes
        if p.op == "placeholder" and (p.meta.get(meta.PARAMETER) or "").endswith("weight")
    }
    for w in weights:
        assert not [u for u in w.users if u.target is torch.ops.aten._to_copy.default], w
    assert [d.weight for d in record.fp8.decisions] == ["fc1.weight", "fc2.weight", "head.weight"]
    assert all(d.converted and d.recipe is Fp8Recipe(recipe) for d in record.fp8.decisions)
    assert [n.meta[meta.FP8].shape for n in nodes] == [(32, 32, 64), (32, 64, 48), (32, 48, 16)]


def test_without_fp8_no_fp8_matmul() -> None:
    model, x = mlp()
    compiled = compile_fp8(model, None)
    compiled(x)
    assert not _fp8_nodes(compiled)
    assert compiled.amp_fx_records[0].fp8 is None


class Functional(nn.Module):
    """Matmuls torchao cannot convert (it swaps nn.Linear modules): F.linear on the module's own
    parameters, x @ W with W as [K, N], and x @ W.t()."""

    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(64, 32) / 32**0.5)
        self.b1 = nn.Parameter(torch.randn(64) / 10)
        self.w2 = nn.Parameter(torch.randn(64, 48) / 8)
        self.w3 = nn.Parameter(torch.randn(16, 48) / 7)

    def forward(self, x: Tensor) -> Tensor:
        h = nn.functional.gelu(nn.functional.linear(x, self.w1, self.b1))
        return torch.relu(h @ self.w2) @ self.w3.t()


class FunctionalAsLinears(nn.Module):
    """The same model with nn.Linear modules (w2 transposed): what torchao converts."""

    def __init__(self, f: Functional) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(32, 64), nn.Linear(64, 48, bias=False), nn.Linear(48, 16, bias=False)
        with torch.no_grad():
            self.a.weight.copy_(f.w1)
            self.a.bias.copy_(f.b1)
            self.b.weight.copy_(f.w2.t())
            self.c.weight.copy_(f.w3)

    def forward(self, x: Tensor) -> Tensor:
        return self.c(torch.relu(self.b(nn.functional.gelu(self.a(x)))))


@pytest.mark.slow_cases
@pytest.mark.parametrize("recipe", RECIPES)
def test_functional_linears_in_fp8_where_torchao_converts_none(recipe: str) -> None:
    """F.linear and x @ W run in fp8 with torchao's numerics: bitwise with torchao on the same
    model written with nn.Linear, and the same share of GEMM FLOPs in fp8 (counted from the ops
    that ran, forward and backward), where torchao converts nothing of the functional model."""
    torch.manual_seed(0)
    # x requires grad: torchao's eager Function computes the input gradient GEMM of the first
    # layer whether or not it is needed, a compiled backward only where it is.
    functional, x = Functional(), torch.randn(2, 16, 32, requires_grad=True)
    linears = FunctionalAsLinears(functional)

    ref = torchao_float8(linears, recipe)
    with count_gemm_flops() as ref_flops:
        with cpu_autocast_torchao(), torch.autocast("cpu", torch.bfloat16):
            loss_ref = loss_fn(ref(x))
        loss_ref.backward()
    untouched = torchao_float8(functional, recipe)
    with count_gemm_flops() as untouched_flops:
        with cpu_autocast_torchao(), torch.autocast("cpu", torch.bfloat16):
            loss_fn(untouched(x)).backward()

    ours = copy.deepcopy(functional)
    compiled = compile_fp8(ours, recipe)
    loss_fn(compiled(x)).backward()  # compiles forward and backward outside the count
    for p in ours.parameters():
        p.grad = None
    with count_gemm_flops() as flops:
        loss = loss_fn(compiled(x))
        loss.backward()

    assert_bitwise(loss.detach(), loss_ref.detach(), "loss")
    assert_bitwise(ours.w1.grad, ref.a.weight.grad, "w1.grad")
    assert_bitwise(ours.b1.grad, ref.a.bias.grad, "b1.grad")
    assert_bitwise(ours.w2.grad, ref.b.weight.grad.t(), "w2.grad")
    assert_bitwise(ours.w3.grad, ref.c.weight.grad, "w3.grad")
    assert untouched_flops.fp8 == 0 and untouched_flops.other > 0
    assert flops.fp8_share == ref_flops.fp8_share > 0


def _decisions(compiled: nn.Module) -> dict[str, object]:
    return {d.weight: d for r in compiled.amp_fx_records for d in r.fp8.decisions}


def test_shapes_scaled_mm_cannot_take_are_padded_and_a_3d_weight_stays_in_dtype() -> None:
    """N=40 and K=40 run in fp8, padded to 48 (tests/fp8/test_fp8_padding.py: bitwise torchao's
    ``pad_inner_dim``); the bmm on a 3-D weight stays in bf16, says why in its decision and is
    reported once (issue 59: a matmul with a parameter fp8 leaves out is never silent)."""
    torch.manual_seed(0)
    model, x = Odd(), torch.randn(2, 16, 32)
    compiled = compile_fp8(model, "tensorwise", strict=False)
    with pytest.warns(UserWarning, match=r"1 matmul\(s\) with a parameter operand stay in bf16 under .*experts.*3-D"):
        compiled(x)
    d = _decisions(compiled)
    assert [w for w, dec in d.items() if dec.converted] == ["fc1.weight", "odd.weight", "head.weight"]
    assert d["fc1.weight"].padding is None
    assert d["odd.weight"].padding.dims == {"N": (40, 48)} and "N 40->48" in d["odd.weight"].reason
    assert d["head.weight"].padding.dims == {"K": (40, 48)}
    assert "3-D weight" in d["experts"].reason
    (record,) = compiled.amp_fx_records
    assert not [n for n in record.rewritten.graph.nodes if n.target is torch.ops.aten.linear.default]
    ex = amp_fx.explain(compiled)
    assert "padded to multiples of 16 for torch._scaled_mm: N 40->48" in ex.table()
    assert "3 of 4 (tensorwise), 2 padded" in str(ex)


@pytest.mark.parametrize("recipe, fp8_grad_weight", [("rowwise", True), ("rowwise_with_gw_hp", False)])
def test_rows_not_a_multiple_of_16_are_padded_only_where_the_weight_gradient_is_fp8(
    recipe: str, fp8_grad_weight: bool
) -> None:
    """M (batch x tokens) is the inner dimension of the weight-gradient GEMM: 2 x 9 = 18 rows are
    padded to 32 for rowwise, not for rowwise_with_gw_hp (whose weight gradient is high precision);
    both run in fp8."""
    _needs_rowwise()
    model, _ = mlp()
    compiled = compile_fp8(model, recipe, strict=True)
    compiled(torch.randn(2, 9, 32))
    d = _decisions(compiled)
    assert all(dec.converted for dec in d.values())
    for dec in d.values():
        assert (dec.padding.dims if dec.padding else None) == ({"M": (18, 32)} if fp8_grad_weight else None)


def test_the_bf16_path_is_unchanged_where_nothing_converts() -> None:
    """A model none of whose matmuls fp8 takes: bitwise amp_fx without fp8."""
    torch.manual_seed(0)
    model = LeftWeights()
    x = torch.randn(4, 24)
    with_fp8 = compile_fp8(copy.deepcopy(model), "tensorwise", strict=False)
    with pytest.warns(amp_fx.AmpFxWarning, match="none of its 2 matmuls"):
        out = with_fp8(x)
    assert_bitwise(out, compile_fp8(copy.deepcopy(model), None)(x), "output")


def test_strict_mode_refuses_fp8_honoured_nowhere() -> None:
    with pytest.raises(
        amp_fx.AmpFxError, match=r"low_precision='tensorwise' was asked, but none of its 2 matmuls.*left operand"
    ):
        compile_fp8(LeftWeights(), "tensorwise")(torch.randn(4, 24))


def test_strict_mode_refuses_fp8_on_a_model_without_parameter_matmuls() -> None:
    class NoWeights(nn.Module):
        def forward(self, x: Tensor, y: Tensor) -> Tensor:
            return x @ y

    with pytest.raises(amp_fx.AmpFxError, match="no graph of the first call has a matmul with a parameter"):
        compile_fp8(NoWeights(), "tensorwise")(torch.randn(16, 16), torch.randn(16, 16))


@pytest.mark.parametrize("selector", ["head", nn.Linear], ids=["name", "type"])
def test_policy_keeps_modules_out_of_fp8_like_torchao_module_filter(selector: object) -> None:
    """Policy(keep_out_of_fp8=...) by name or type; by name it is torchao's module_filter_fn,
    bitwise."""
    model, x = mlp()
    policy = Policy(keep_out_of_fp8=(selector,))
    ours = copy.deepcopy(model)
    if selector is nn.Linear:
        compiled = compile_fp8(ours, "tensorwise", policy=policy, strict=False)
        with pytest.warns(amp_fx.AmpFxWarning, match="none of its 3 matmuls.*kept out of fp8 by policy"):
            compiled(x)
        assert not any(d.converted for d in _decisions(compiled).values())
        return
    compiled = compile_fp8(ours, "tensorwise", policy=policy)
    loss = loss_fn(compiled(x))
    loss.backward()
    d = _decisions(compiled)
    assert [w for w, dec in d.items() if not dec.converted] == ["head.weight"]
    assert "kept out of fp8 by policy (head)" in d["head.weight"].reason

    ref = torchao_float8(model, "tensorwise", module_filter_fn=lambda m, fqn: fqn != "head")
    with cpu_autocast_torchao(), torch.autocast("cpu", torch.bfloat16):
        loss_ref = loss_fn(ref(x))
    loss_ref.backward()
    assert_bitwise(loss.detach(), loss_ref.detach(), "loss")
    assert_bitwise(
        {n: p.grad for n, p in ours.named_parameters()}, {n: p.grad for n, p in ref.named_parameters()}, "grads"
    )


def test_keep_fp32_wins_over_fp8() -> None:
    model, x = mlp()
    compiled = compile_fp8(model, "tensorwise", policy=Policy(keep_fp32=("fc2",)))
    compiled(x)
    d = _decisions(compiled)
    assert not d["fc2.weight"].converted and "kept by policy" in d["fc2.weight"].reason
    assert d["fc1.weight"].converted and d["head.weight"].converted


def test_keep_out_of_fp8_names_are_checked_at_compile_time() -> None:
    model, _ = mlp()
    with pytest.raises(ValueError, match="Policy.keep_out_of_fp8 names submodule 'fc3'"):
        compile_fp8(model, "tensorwise", policy=Policy(keep_out_of_fp8=("fc3",)))


@pytest.mark.parametrize("recipe", ["tensorwise", None], ids=["unmatched", "fp8-off"])
def test_a_keep_out_of_fp8_entry_that_changes_nothing_is_reported(recipe: str | None) -> None:
    model, x = mlp()
    policy = Policy(keep_out_of_fp8=(nn.Conv2d,) if recipe else ("head",))
    why = "entry Conv2d matched no op" if recipe else "entry 'head' changes nothing: fp8 is off"
    with pytest.raises(amp_fx.AmpFxError, match=why):
        compile_fp8(model, recipe, policy=policy)(x)
