"""The inspection tools with fp8: ``explain`` names the recipe and each operand's granularity,
the non-finite watch names an inf made by an fp8 GEMM, ``compare`` is against torchao's numerics.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from torch import Tensor, nn

import amp_fx
from amp_fx.fp8 import Fp8Config, Fp8Recipe
from amp_fx.policy import Policy
from amp_fx.testing import assert_bitwise
from amp_fx.testing.fp8_reference import (
    cpu_autocast_torchao,
    torchao_float8,
    torchao_missing,
)
from tests.fp8._fp8_cases import (
    RECIPES,
    LeftWeights,
    Odd,
    _needs_rowwise,
    loss_fn,
    mlp,
    torchao_step,
)

pytestmark = pytest.mark.skipif(torchao_missing() is not None, reason=str(torchao_missing()))


def test_explain_takes_fp8_and_shows_recipe_and_granularity() -> None:
    _needs_rowwise()
    torch.manual_seed(0)
    model, x = Odd(), torch.randn(2, 16, 32)
    ex = amp_fx.explain(model, x, fp8="rowwise_with_gw_hp")
    fc1 = ex.fp8_decisions()[0]
    assert fc1.weight == "fc1.weight" and fc1.converted and fc1.recipe is Fp8Recipe.ROWWISE_WITH_GW_HP
    table = ex.fp8_text(0)
    assert "x (e4m3 rowwise) @ w (e4m3 rowwise)" in table
    assert "grad (e4m3 rowwise) @ w (e4m3 tensorwise)" in table
    assert "x (high precision) @ grad (high precision)" in table
    assert "fp8 matmuls" in ex.summary() and "3 of 4 (rowwise_with_gw_hp), 2 padded" in ex.summary()
    assert not any(n.op == "fp8_matmul" for n in amp_fx.explain(model, x).nodes())  # fp8 off: none


def test_explain_before_after_says_a_converted_matmul_runs_in_fp8_not_folded_away() -> None:
    """The before/after table's amp_fx column for a matmul the fp8 pass replaced: ``fp8 <recipe>
    -> <dtype>``, with and without a bias (the bias's add then stands for it); a cast that
    fold_casts removed still reads ``(folded away)``. Before, every converted matmul read
    ``(folded away)``, as if it had changed no value."""
    torch.manual_seed(0)
    model, x = Odd(), torch.randn(2, 16, 32)
    ex = amp_fx.explain(model, x, fp8="tensorwise", policy=Policy(keep_out_of_fp8=[]))
    rows = {line.split()[0]: line for line in ex.before_after(0).splitlines()[2:] if line.strip()}
    converted = [d.weight.removesuffix(".weight") for d in ex.fp8_decisions() if d.converted]
    linears = [name for name, line in rows.items() if " aten.linear " in f" {line} "]
    assert len(linears) == len(converted) == 3, (rows, converted)
    for name in linears:
        assert "fp8 tensorwise -> bf16" in rows[name] and "folded away" not in rows[name], rows[name]
    assert "fp8" not in rows["bmm"], rows["bmm"]  # the 3-D weight's bmm stays in bf16


def test_explain_shows_why_nothing_converts_instead_of_failing() -> None:
    """explain is where the reasons are read: strict mode does not stop it (the compiled model
    itself raises, test_strict_mode_refuses_fp8_honoured_nowhere)."""
    ex = amp_fx.explain(LeftWeights(), torch.randn(4, 24), fp8="tensorwise")
    assert any("no matmul runs in fp8" in n for n in ex.notes)
    assert all("left operand" in d.reason for d in ex.fp8_decisions())


class _Boosted(nn.Module):
    """Two fp8-sized linears with a multiplier between them (a buffer: 1 is healthy)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(32, 64)
        self.b = nn.Linear(64, 32)
        self.register_buffer("boost", torch.tensor(1.0))

    def forward(self, x: Tensor) -> Tensor:
        return self.b(torch.relu(self.a(x)) * self.boost)


def _planted(where: str) -> nn.Module:
    torch.manual_seed(0)
    model = _Boosted()
    with torch.no_grad():
        if where == "forward":  # b's fp8 GEMM sums 64 products of ~0.4 x 3e37: past bf16's range
            model.b.weight.fill_(3e37)
        else:  # b's input ~1e35: its weight-gradient GEMM (x.T @ grad: 16 rows of ~1e35 x 2048, the
            # mean's 1/512 at _BACKWARD_SCALE) overflows in the backward, while its forward (~1e35)
            # stays finite on every CPU (from b's input ~3e36 up, the CPU _scaled_mm gave NaN on a
            # Xeon with AMX: the test's forward assumption failed there at 1e38)
            model.boost.fill_(1e35)
    return model


_BACKWARD_SCALE = 2.0**20


def _first_nonfinite_module_output(model: nn.Module, run: Callable[[], object]) -> str | None:
    """The reference for a forward origin: the first module (in execution order) whose output
    holds an inf/NaN, from forward hooks on the eager torchao model."""
    found: list[str] = []
    handles = [
        m.register_forward_hook(
            lambda mod, args, out, name=name: (
                found.append(name) if not found and not bool(torch.isfinite(out).all()) else None
            )
        )
        for name, m in model.named_modules()
        if name
    ]
    try:
        run()
    finally:
        for h in handles:
            h.remove()
    return found[0] if found else None


@pytest.mark.parametrize("where", ["forward", "backward"])
def test_watch_names_an_inf_made_by_an_fp8_gemm(where: str) -> None:
    """fp8 with ``watch_nonfinite=True``: the fp8 operands are checked through an fp32 copy (no
    ``isinf`` kernel for fp8: the backward watch crashed on them) and the fp8 matmul is a watched
    op. The report names the same module and, in the backward, the same op as the reference:
    torchao's Float8Linear under eager autocast (forward hooks for the forward;
    ``amp_fx.testing.backward_origin`` for the backward)."""
    from amp_fx.testing.backward_origin import first_backward_origin

    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(1))
    model = _planted(where)
    ref = torchao_float8(model, "tensorwise")

    def ref_loss() -> Tensor:
        with cpu_autocast_torchao(), torch.autocast("cpu", torch.bfloat16):
            return ref(x).float().mean()

    compiled = amp_fx.compile(model, dtype="bf16", fp8="tensorwise", watch_nonfinite=True, backend="aot_eager")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = amp_fx.GradScaler("cpu", init_scale=_BACKWARD_SCALE)
    scaler.scale(compiled(x).float().mean()).backward()
    scaler.step(opt)
    scaler.update()
    report = scaler.overflow_report()
    assert report is not None and report.first_op is not None, report
    first = report.first_op
    if where == "forward":
        assert _first_nonfinite_module_output(ref, ref_loss) == "b"
        assert (first.backward, first.module, first.op) == (False, "b", "fp8_matmul"), str(report)
    else:
        assert _first_nonfinite_module_output(ref, ref_loss) is None  # the forward is finite
        origin = first_backward_origin(ref, lambda: ref_loss() * _BACKWARD_SCALE, torch.bfloat16)
        # torchao's is its subclass's aten.mm, which runs the _scaled_mm amp_fx's graph shows
        assert (origin.module, origin.op) == ("b", "aten.mm"), origin
        expected = (True, "b", "aten._scaled_mm", "fp8_matmul")
        assert (first.backward, first.module, first.op, first.grad_of) == expected, str(report)


class _Functional(nn.Module):
    """``x @ W.T`` on a parameter, an ``nn.Linear``, ``F.linear`` with a transposed parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(64, 32) / 32**0.5)
        self.lin = nn.Linear(64, 48)
        self.v = nn.Parameter(torch.randn(48, 16) / 48**0.5)

    def forward(self, x: Tensor) -> Tensor:
        return nn.functional.linear(torch.relu(self.lin(x @ self.w.t())), self.v.t())


@pytest.mark.parametrize("recipe", RECIPES)
def test_compare_with_fp8_is_against_torchaos_numerics(recipe: str) -> None:
    """``amp_fx.compare(..., fp8=recipe)``: the eager side runs the converted matmuls in fp8, and that
    eager fp8 run is torchao's (loss and gradients bitwise with ``convert_to_float8_training`` on the
    MLP); amp_fx agrees with it op by op (each converted matmul matched to the node that replaced
    it, its rule the fp8 recipe), in the outputs and in every gradient, bitwise. Before,
    ``fp8=`` was passed on to the model as an input."""
    from amp_fx.inspect._fp8_eager import Fp8Eager, module_stack

    model, x = mlp()
    eager = copy.deepcopy(model)
    stack: list[str] = []
    with (
        module_stack(eager, stack),
        torch.autocast("cpu", torch.bfloat16),
        Fp8Eager(Fp8Config(recipe), torch.bfloat16, "cpu", stack, measure=False),
    ):
        loss = loss_fn(eager(x))
    loss.backward()
    ref_loss, ref_grads = torchao_step(model, x, recipe)
    assert_bitwise(
        (loss.detach(), {n: p.grad for n, p in eager.named_parameters()}),
        (ref_loss, ref_grads),
        f"eager fp8 vs torchao, {recipe}",
    )

    for m in (model, _Functional()):
        report = amp_fx.compare(m, x, dtype="bf16", fp8=recipe, loss_fn=loss_fn)
        assert report.first_divergence is None and all(o.agree for o in report.ops), str(report)
        assert all(v.agree for v in report.outputs) and report.grads and all(g.agree for g in report.grads)
        fp8_ops = [o for o in report.ops if o.rule.startswith(f"fp8 {Fp8Recipe(recipe).value}")]
        assert len(fp8_ops) == 3, str(report)
        # the float64 columns show fp8's cost: far above bf16's rounding (2**-8)
        assert all(o.error_vs_reference.rel > 2**-6 for o in fp8_ops)


def test_compare_with_fp8_honours_keep_out_of_fp8_by_type() -> None:
    """With ``Policy(keep_out_of_fp8=(nn.Linear,))`` amp_fx keeps the ``nn.Linear`` in bf16 and the
    functional matmuls in fp8; compare's eager side selects the module by type as the pass does, so
    everything still agrees (it would not if eager ran that Linear in fp8)."""
    torch.manual_seed(0)
    policy = Policy(keep_out_of_fp8=(nn.Linear,))
    report = amp_fx.compare(
        _Functional(), torch.randn(2, 16, 32), dtype="bf16", fp8="tensorwise", policy=policy, loss_fn=loss_fn
    )
    assert report.first_divergence is None and all(g.agree for g in report.grads), str(report)
    matmuls = [(o.module, o.rule) for o in report.ops if o.op in ("aten.linear", "aten.matmul")]
    assert [m for m, r in matmuls if r.startswith("fp8 tensorwise")] == ["", ""], matmuls  # the root's two
    assert [m for m, r in matmuls if not r.startswith("fp8")] == ["lin"], matmuls
