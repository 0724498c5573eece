"""Matmuls whose parameter operand the model casts itself (issue 59): torchtitan's experts.

torchtitan's ``GroupedExperts`` casts its expert weights itself (``w1_EFD.bfloat16().transpose(-2,
-1)``), so the grouped GEMM's weight operand is ``transpose(_to_copy(parameter))``, a cast amp_fx
did not insert. Before this change the fp8 pass looked through its own casts only, found no
parameter, and left every expert GEMM in bf16 without recording a decision or saying a word
(0 of 3 grouped GEMMs converted under torchtitan's expert parallelism). Now:

* a parameter behind the model's own float casts and views is a weight operand, in every recipe;
  the model's cast stays where the model put it (the fp8 GEMM scales the bf16 value the model
  multiplies by, which is what torchao's grouped fp8 GEMMs take: bf16 ``A`` and ``B_t``);
* a matmul with an operand computed from a parameter by other ops (``w * 2``), or in a form the
  fp8 kernels do not take (a 3-D weight in ``bmm``), is recorded with its reason and reported once
  (strict mode: an error), unless the policy keeps its module out of fp8 on purpose.

The references: torchtitan's own seam for low-precision experts (``GroupedExperts._grouped_mm``,
"overridable seam for low-precision variants") replaced, in eager, by amp_fx's grouped fp8 kernel
(held bitwise with torchao's per-expert ``Float8Linear`` in ``tests/fp8/test_fp8_experts.py``) or by
torchao's own ``_to_mxfp8_then_scaled_grouped_mm(..., EMULATED)``, on the same bf16 operands.
Random init, tiny sizes (4 experts, dim 32, hidden 64, 64 tokens), aot_eager.
"""

from __future__ import annotations

import copy
import re
import warnings
from collections.abc import Callable

import pytest
import torch
from torch import Tensor, nn

import amp_fx
from amp_fx.errors import AmpFxError
from amp_fx.fp8 import Fp8Recipe
from amp_fx.kernels.fp8_matmul import fp8_matmul
from amp_fx.passes.fp8_matmuls import Fp8Decision
from amp_fx.testing import assert_bitwise
from amp_fx.testing.distributed import one_rank
from amp_fx.testing.fp8_reference import torchao_missing
from amp_fx.testing.torchtitan import low_precision_experts
from tests.fp8._fp8_cases import _recipe

pytestmark = pytest.mark.skipif(torchao_missing() is not None, reason=str(torchao_missing()))


def _titan_experts() -> nn.Module:
    moe = pytest.importorskip("torchtitan.models.common.moe", reason="torchtitan's GroupedExperts (torch >= 2.12)")
    model = moe.GroupedExperts.Config(dim=32, hidden_dim=64, num_experts=4).build()
    torch.manual_seed(0)
    for p in model.parameters():
        nn.init.normal_(p, std=0.1)
    return model


def _inputs() -> tuple[Tensor, Tensor]:
    torch.manual_seed(1)
    # groups of 16, 0 (an expert with no token), 40 and 8 rows: sizes not multiples of 32 (64 in all:
    # torchao's MXFP8 weight-gradient GEMM blocks the tokens by 32 and pads nothing)
    return torch.randn(64, 32), torch.tensor([16, 0, 40, 8])


def _step(model: nn.Module, x: Tensor, counts: Tensor) -> tuple[Tensor, dict[str, Tensor | None]]:
    x = x.clone().requires_grad_()
    out = model(x, counts)
    out.float().square().mean().backward()
    grads: dict[str, Tensor | None] = {n: p.grad for n, p in model.named_parameters()}
    grads["x"] = x.grad
    return out, grads


@pytest.mark.slow_cases
@pytest.mark.parametrize("recipe", [_recipe("rowwise"), "tensorwise", "mxfp8"])
def test_torchtitan_experts_that_cast_their_weights_run_in_fp8(recipe: str) -> None:
    """torchtitan's ``GroupedExperts``: all 3 grouped GEMMs convert (1.00 of the GEMM FLOPs),
    strict mode raises nothing, and the output and every gradient (the three expert weights and the
    input) are bitwise with torchtitan's seam running the recipe's grouped GEMM in eager on the same
    operands. Without the fix the GEMMs ran in bf16: the output differs from the fp8 reference."""
    model = _titan_experts()
    decisions, reference = _bitwise_with_the_seam(model, recipe)
    assert [d.weight for d in decisions] == ["w1_EFD", "w3_EFD", "w2_EDF"], decisions
    bf16 = copy.deepcopy(reference)
    bf16._grouped_mm = lambda *, A, B_t, offs: torch._grouped_mm(A, B_t, offs=offs)
    x, counts = _inputs()
    want_out = _step(reference, x, counts)[0]
    assert not torch.equal(_step(bf16, x, counts)[0], want_out), "the reference must not be the bf16 GEMM"


@pytest.mark.parametrize("recipe", [_recipe("rowwise"), "mxfp8"])
def test_expert_weights_behind_to_local_run_in_fp8(recipe: str) -> None:
    """torchtitan's ``GroupedExperts`` with DTensor parameters (one gloo rank; under expert
    parallelism its forward calls ``w.to_local()`` before its own cast): all 3 grouped GEMMs
    convert in strict mode, bitwise with the seam on the same operands. Before, the fp8 pass saw
    ``to_local`` as an op computing the weight, left the 3 GEMMs in bf16 and reported them (strict:
    raised), which is what torchtitan's Qwen3 MoE under EP 2 did (0 of 6 converted;
    tests/integrations/test_torchtitan_moe.py)."""
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    if not torch.distributed.is_available():
        pytest.skip("torch built without torch.distributed")
    with one_rank():
        model = _titan_experts()
        mesh = init_device_mesh("cpu", (1,))
        for name, p in list(model.named_parameters()):
            setattr(model, name, nn.Parameter(distribute_tensor(p.detach(), mesh, [Shard(0)])))
        _bitwise_with_the_seam(model, recipe)


def test_nvfp4_experts_take_a_token_count_that_changes() -> None:
    """Under expert parallelism a rank receives another number of tokens at each step, and Dynamo
    recompiles the experts' graph with a symbolic count. nvfp4's stochastic rounding drew with
    ``torch.rand(shape, generator=...)``, which AOTAutograd refuses for a symbolic shape ("SymIntArrayRef
    expected to contain only concrete integers": strict mode raised at the second call; torchtitan's
    Qwen3 MoE under EP 2 did it). Now it draws with ``uniform_``, as ``torch.rand`` itself does (the
    same numbers: tests/fp8/test_nvfp4.py holds them to TransformerEngine's reference)."""
    compiled = amp_fx.compile(_titan_experts(), dtype="bf16", fp8="nvfp4", backend="aot_eager", strict=True)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*(runs emulated|without fp8 tensor cores).*")
        for tokens in (64, 96, 80):
            out, grads = _step(compiled, torch.randn(tokens, 32), torch.tensor([16, 0, tokens - 24, 8]))
            assert out.shape == (tokens, 32) and all(g is not None for g in grads.values())
    records = amp_fx.records(compiled)
    assert len(records) == 2, records  # the first count, then the symbolic one
    assert all(r.fp8 is not None and len(r.fp8.converted) == 3 for r in records)


def _bitwise_with_the_seam(model: nn.Module, recipe: str) -> tuple[list[Fp8Decision], nn.Module]:
    """``model`` compiled with ``recipe`` (strict) against a copy whose experts run the recipe
    through torchtitan's own seam, on the same operands: the output and every gradient (the expert
    weights' local values, the input's) bit for bit, and all 3 grouped GEMMs converted. Returns
    amp_fx's decisions and the reference."""
    x, counts = _inputs()
    reference = copy.deepcopy(model)
    assert low_precision_experts(reference, recipe) == 1  # torchtitan's own seam
    want_out, want = _step(reference, x, counts)
    compiled = amp_fx.compile(model, dtype="bf16", fp8=recipe, backend="aot_eager", strict=True)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*(runs emulated|without fp8 tensor cores).*")
        out, got = _step(compiled, x, counts)
    (record,) = amp_fx.records(compiled)
    assert record.fp8 is not None
    decisions = record.fp8.decisions
    assert [(d.op, d.converted) for d in decisions] == [("aten._grouped_mm", True)] * 3, decisions
    assert_bitwise(out, want_out, "out")
    for name in want:
        assert_bitwise(_local(got[name]), _local(want[name]), name)
    return decisions, reference


def _local(t: Tensor | None) -> Tensor | None:
    return t.to_local() if isinstance(t, torch.distributed.tensor.DTensor) else t


class _CastsItsWeight(nn.Module):
    """A linear layer whose forward casts its weight itself (``F.linear(x, w.bfloat16())``)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(48, 32) / 32**0.5)

    def forward(self, x: Tensor) -> Tensor:
        return torch.nn.functional.linear(x, self.weight.bfloat16())


@pytest.mark.parametrize("recipe", ["tensorwise", _recipe("rowwise")])
def test_a_linear_whose_weight_the_model_casts_runs_in_fp8(recipe: str) -> None:
    """``F.linear(x, w.bfloat16())``: converted, bitwise with amp_fx's fp8 matmul called in eager on
    the model's own bf16 weight (the model's cast kept, not replaced by the fp32 master weight)."""
    torch.manual_seed(0)
    model, x = _CastsItsWeight(), torch.randn(4, 16, 32)
    reference = copy.deepcopy(model)
    want_out = fp8_matmul(x.bfloat16(), reference.weight.bfloat16().t(), Fp8Recipe(recipe))
    want_out.float().square().mean().backward()

    compiled = amp_fx.compile(model, dtype="bf16", fp8=recipe, backend="aot_eager", strict=True)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*without fp8 tensor cores.*")
        out = compiled(x)
    out.float().square().mean().backward()
    (record,) = amp_fx.records(compiled)
    assert record.fp8 is not None and [d.converted for d in record.fp8.decisions] == [True]
    assert_bitwise(out, want_out, "out")
    assert_bitwise(model.weight.grad, reference.weight.grad, "weight.grad")


class _Scaled(nn.Module):
    """A linear layer whose weight is computed from its parameter (``w * 2``)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(32, 32) / 32**0.5)

    def forward(self, x: Tensor) -> Tensor:
        return torch.nn.functional.linear(x, self.weight * 2.0)


class _ComputedWeight(nn.Module):
    """One plain linear, then one whose weight is computed."""

    def __init__(self) -> None:
        super().__init__()
        self.plain = nn.Linear(32, 32)
        self.scaled = _Scaled()

    def forward(self, x: Tensor) -> Tensor:
        return self.scaled(self.plain(x))


def _compile_computed(**kwargs: object) -> Callable[[Tensor], Tensor]:
    torch.manual_seed(0)
    return amp_fx.compile(_ComputedWeight(), dtype="bf16", fp8="tensorwise", backend="aot_eager", **kwargs)


def test_a_matmul_fp8_leaves_out_is_reported_not_skipped() -> None:
    """``F.linear(x, w * 2)``: recorded as not converted with the op that computes the weight, and
    warned once naming the module, the parameter and the way to keep it out on purpose; strict mode
    raises the same; ``keep_out_of_fp8`` on that module silences it (its negative twin). Before, the
    matmul had no decision at all and nothing was said."""
    x = torch.randn(4, 32)
    compiled = _compile_computed(strict=False)  # the suite runs strict (tests/conftest.py)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled(x)
    (record,) = amp_fx.records(compiled)
    assert record.fp8 is not None
    left = [d for d in record.fp8.decisions if not d.converted]
    assert [(d.weight, d.left_out) for d in left] == [("scaled.weight", True)], record.fp8.decisions
    assert "computed from the parameter by aten.mul" in left[0].reason
    said = [str(w.message) for w in caught if "stay in bf16 under low_precision" in str(w.message)]
    assert len(said) == 1 and re.search(r"1 matmul\(s\) .*scaled \(aten.linear, scaled.weight\)", said[0]), said
    assert "keep_out_of_fp8" in said[0]

    with pytest.raises(AmpFxError, match="stay in bf16 under low_precision"):
        _compile_computed(strict=True)(x)

    kept = _compile_computed(strict=True, policy=amp_fx.Policy(keep_out_of_fp8=["scaled"]))
    kept(x)  # the root kept out on purpose: nothing to say, even in strict mode
    (record,) = amp_fx.records(kept)
    assert record.fp8 is not None and not any(d.left_out for d in record.fp8.decisions)
