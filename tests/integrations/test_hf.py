"""Hugging Face Trainer with a model compiled in place by amp_fx (aot_eager: bit for bit).

The reference is ``Trainer(bf16=True)`` on the eager model (accelerate's autocast); for fp16, the
same Trainer with torch.amp.GradScaler. Parameters after 5 steps and every logged loss must match
bit for bit; the saved checkpoints must have the eager model's keys.
"""

from __future__ import annotations

import functools
import os
import tempfile

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="amp_fx.hf needs transformers (pip install amp_fx[hf])")
pytest.importorskip("accelerate", reason="transformers.Trainer needs accelerate (pip install amp_fx[hf])")

import amp_fx  # noqa: E402
from amp_fx import Policy  # noqa: E402
from amp_fx.hf import AmpFxTrainer  # noqa: E402
from amp_fx.testing import assert_bitwise  # noqa: E402
from amp_fx.testing.generate import tiny_causal_lm  # noqa: E402

STEPS = 5


def _model() -> torch.nn.Module:
    return tiny_causal_lm("gpt2")  # 2 layers x 64, random init; Trainer puts it in train mode


def _tokens() -> list[dict[str, torch.Tensor]]:
    """8 random sequences of 16 tokens, each its own label (causal LM)."""
    ids = torch.randint(0, 128, (8, 16), generator=torch.Generator().manual_seed(1))
    return [{"input_ids": row, "labels": row} for row in ids]


def _train(
    model: torch.nn.Module,
    *,
    trainer_cls=transformers.Trainer,
    evaluate: bool = False,
    save: bool = False,
    trainer_kwargs=None,
    **args,
) -> dict[str, object]:
    transformers.logging.set_verbosity_error()
    with tempfile.TemporaryDirectory() as out:
        targs = transformers.TrainingArguments(
            output_dir=out,
            per_device_train_batch_size=2,
            max_steps=STEPS,
            report_to=[],
            use_cpu=True,
            logging_steps=1,
            save_strategy="no",
            seed=0,
            data_seed=0,
            disable_tqdm=True,
            per_device_eval_batch_size=2,
            **args,
        )
        trainer = trainer_cls(
            model=model, args=targs, train_dataset=_tokens(), eval_dataset=_tokens(), **(trainer_kwargs or {})
        )
        trainer.train()
        result: dict[str, object] = {
            "params": {n: p.detach().clone() for n, p in model.named_parameters()},
            "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
        }
        if evaluate:
            result["eval_loss"] = trainer.evaluate()["eval_loss"]
        if save:
            from safetensors.torch import load_file

            trainer.save_model(os.path.join(out, "trainer"))
            model.save_pretrained(os.path.join(out, "pretrained"))
            for kind in ("trainer", "pretrained"):
                result[kind] = load_file(os.path.join(out, kind, "model.safetensors"))
            reloaded = type(model).from_pretrained(os.path.join(out, "pretrained"))
            result["reloaded"] = {n: p.detach().clone() for n, p in reloaded.named_parameters()}
        if trainer.accelerator.scaler is not None:
            result["scaler"] = trainer.accelerator.scaler.state_dict()
    return result


@functools.cache
def _eager_bf16() -> dict[str, object]:
    return _train(_model(), bf16=True, evaluate=True, save=True)


def _amp(dtype: str = "bf16", policy: Policy | None = None) -> torch.nn.Module:
    return amp_fx.compile(_model(), inplace=True, dtype=dtype, backend="aot_eager", policy=policy)


@pytest.mark.slow
def test_trainer_bitwise_with_bf16_autocast_saves_usual_keys():
    ref, got = _eager_bf16(), _train(_amp(), evaluate=True, save=True)
    assert len(got["losses"]) == STEPS
    for key in ("params", "losses", "eval_loss", "reloaded"):
        assert_bitwise(got[key], ref[key], key)
    for kind in ("trainer", "pretrained"):
        assert sorted(got[kind]) == sorted(ref[kind]), kind
        assert not [k for k in got[kind] if "_orig_mod" in k or "amp_fx" in k], kind
        assert_bitwise(got[kind], ref[kind], kind)
    assert_bitwise(got["params"], {n: p for n, p in got["reloaded"].items()}, "reloaded")


@pytest.mark.slow
def test_accelerate_bf16_autocast_around_amp_fx_keeps_amp_fx_policy():
    """Trainer(bf16=True) opens torch.autocast around amp_fx's graphs: amp_fx's policy still decides.
    keep_fp32 gives the same training with and without accelerate's autocast, and not the default's."""
    policy = Policy(keep_fp32=("transformer.h.0.mlp",))
    with_autocast = _train(_amp(policy=policy), bf16=True)
    without = _train(_amp(policy=policy))
    assert_bitwise(with_autocast, without)
    default = _train(_amp(), bf16=True)
    assert_bitwise(default, {k: _eager_bf16()[k] for k in default})  # amp_fx + bf16=True is still eager's
    name = "transformer.h.0.mlp.c_fc.weight"
    assert not torch.equal(with_autocast["params"][name], default["params"][name]), "keep_fp32 changed nothing"


@pytest.mark.slow
@pytest.mark.parametrize("init_scale", [2.0**16, 2.0**40], ids=["default", "overflowing"])
def test_amp_fx_trainer_fp16_with_amp_fx_grad_scaler(init_scale):
    """AmpFxTrainer(fp16=True) scales with amp_fx.GradScaler: bitwise with accelerate's recipe around
    the eager model and torch.amp.GradScaler (2**40 overflows fp16: steps skipped, scale backed off)."""
    ref = _train(
        _model(),
        trainer_cls=AmpFxTrainer,
        fp16=True,
        trainer_kwargs={"scaler": torch.amp.GradScaler("cpu", init_scale=init_scale)},
    )
    got = _train(
        _amp("fp16"),
        trainer_cls=AmpFxTrainer,
        fp16=True,
        trainer_kwargs={"scaler": amp_fx.GradScaler("cpu", init_scale=init_scale)},
    )
    assert_bitwise(got["params"], ref["params"])
    assert_bitwise(got["losses"], ref["losses"])
    theirs = {k: v for k, v in got["scaler"].items() if k != "amp_fx"}
    assert theirs == ref["scaler"]
    assert (ref["scaler"]["scale"] < init_scale) == (init_scale > 2.0**16), ref["scaler"]
    assert got["losses"] != _eager_bf16()["losses"]  # fp16 autocast ran (on CPU accelerate alone would not)


def test_amp_fx_trainer_default_scaler_is_amp_fx():
    args = transformers.TrainingArguments(output_dir=tempfile.gettempdir(), use_cpu=True, fp16=True, report_to=[])
    trainer = AmpFxTrainer(model=_amp("fp16"), args=args, train_dataset=_tokens())
    assert type(trainer.accelerator.scaler) is amp_fx.GradScaler


def test_amp_fx_trainer_refuses_fp16_model_without_loss_scaling():
    args = transformers.TrainingArguments(output_dir=tempfile.gettempdir(), use_cpu=True, report_to=[])
    with pytest.raises(ValueError, match=r"fp16.*TrainingArguments\(fp16=True\)"):
        AmpFxTrainer(model=_amp("fp16"), args=args, train_dataset=_tokens())


def test_amp_fx_trainer_reports_other_dtype():
    args = transformers.TrainingArguments(output_dir=tempfile.gettempdir(), use_cpu=True, fp16=True, report_to=[])
    with pytest.raises(amp_fx.AmpFxError, match="asks for fp16 but the model is compiled by amp_fx to bf16"):
        AmpFxTrainer(model=_amp("bf16"), args=args, train_dataset=_tokens())  # strict suite: an error
