"""Issue 61: mistakes a new user makes, caught and named with their fix.

Each test asserts that the message names the fix (the right module name, ``scaler=``, dropping the
outer autocast, the command line's form), and a twin where nothing is wrong and nothing is said."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import amp_fx
from amp_fx.cli import main


class _Lm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 16)
        self.lm_head = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(torch.relu(self.embed(x)))


@pytest.mark.parametrize("field", ["keep_fp32", "keep_out_of_fp8"])
@pytest.mark.parametrize("entry", ["compile", "compile_step"])
def test_a_misspelt_module_name_gets_did_you_mean(field: str, entry: str) -> None:
    """``lm_haed`` is refused naming ``lm_head`` (it used to be refused with no suggestion: the
    old hint matched the last path component only), through amp_fx.compile and compile_step; the
    right name is accepted."""
    model = _Lm()
    for name, ok in (("lm_haed", False), ("lm_head", True)):
        policy = amp_fx.Policy(**{field: (name,)})

        def build() -> object:
            if entry == "compile":
                return amp_fx.compile(model, dtype="bf16", backend="eager", policy=policy)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            return amp_fx.compile_step(model, opt, lambda o: o.float().sum(), dtype="bf16", policy=policy)

        if ok:
            build()
            continue
        with pytest.raises(ValueError, match=rf"Policy\.{field} names submodule 'lm_haed'.*did you mean 'lm_head'\?"):
            build()


@pytest.mark.parametrize(("option", "value"), [("init_scale", 2.0**10), ("growth_interval", 100)])
def test_compile_step_points_scaler_options_at_scaler(option: str, value: object) -> None:
    """A GradScaler option passed to compile_step names the scaler call to make, with the model's
    device and the value given; the call it names works."""
    model = nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TypeError) as caught:
        amp_fx.compile_step(model, opt, lambda o: o.float().sum(), **{option: value})
    fix = f"scaler=amp_fx.GradScaler('cpu', {option}={value!r})"
    assert f"unexpected keyword argument {option!r}: it is an option of the loss scaler" in str(caught.value)
    assert fix in str(caught.value), caught.value
    step = amp_fx.compile_step(
        model, opt, lambda o: o.float().sum(), scaler=eval(fix.removeprefix("scaler="), {"amp_fx": amp_fx})
    )
    assert getattr(step.scaler, f"_{option}") == value


def test_compile_step_typo_gets_did_you_mean() -> None:
    model = nn.Linear(4, 4)
    with pytest.raises(TypeError, match=r"'watch_nonfinit' \(did you mean 'watch_nonfinite'\?\)"):
        amp_fx.compile_step(model, torch.optim.SGD(model.parameters(), lr=0.1), sum, watch_nonfinit=True)


def test_an_outer_autocast_of_another_dtype_is_named_and_the_model_runs_its_own() -> None:
    """A bf16-compiled model called inside a leftover ``torch.autocast(dtype=float16)``: amp_fx runs
    bf16 (reference: eager bf16 autocast, bitwise) and says the outer autocast is ignored and how to
    fix it (strict mode: an error); the same dtype outside is redundant (a note, not an error);
    no outer autocast: nothing is said."""
    torch.manual_seed(0)
    model, x = _Lm(), torch.randn(4, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = model(x)
    strict = amp_fx.compile(model, dtype="bf16", backend="eager", strict=True)
    with pytest.raises(amp_fx.AmpFxError, match=r"ignored.*Drop the torch.autocast around the call"):
        with torch.autocast("cpu", dtype=torch.float16):
            strict(x)
    for outer, said in ((torch.float16, "ignored"), (torch.bfloat16, "redundant"), (None, None)):
        compiled = amp_fx.compile(model, dtype="bf16", backend="eager", strict=False)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if outer is None:
                out = compiled(x)
            else:
                with torch.autocast("cpu", dtype=outer):
                    out = compiled(x)
        torch.testing.assert_close(out, expected, atol=0, rtol=0)
        ours = [str(w.message) for w in caught if "torch.autocast('cpu'" in str(w.message)]
        if said is None:
            assert ours == [], ours
            continue
        assert len(ours) == 1 and said in ours[0], ours
        if said == "ignored":
            assert "compile with dtype='fp16'" in ours[0], ours[0]


@pytest.mark.parametrize(
    ("target", "expected"),
    [
        ("{example}", "command-line mistake: the target must be FILE.py:FUNCTION"),
        ("{example}", ":build (" + "{example_name} defines: build, build_overflowing)"),
        ("{example}:biuld", "command-line mistake: {example}: has no function 'biuld' (did you mean 'build'?)"),
        (
            "{folder}/tiny_mpl.py:build",
            "command-line mistake: {folder}/tiny_mpl.py: no such file (did you mean 'tiny_mlp.py'?)",
        ),
    ],
)
def test_command_line_mistakes_are_called_command_line_mistakes(
    target: str, expected: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """``amp-fx explain tinygpt.py`` used to say "error in your code: expected FILE.py:FUNCTION"."""
    from pathlib import Path

    example = Path(__file__).resolve().parents[2] / "examples" / "tiny_mlp.py"
    fields = {"example": str(example), "example_name": str(example), "folder": str(example.parent)}
    assert main(["explain", target.format(**fields)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("amp-fx explain: command-line mistake: "), err
    assert expected.format(**fields) in err, err
    assert "error in your code" not in err
