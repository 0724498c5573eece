"""Hugging Face Trainer with a model compiled in place by amp_fx (``pip install amp_fx[hf]``).

    python examples/hf_trainer.py [--dtype bf16|fp16]

A 2-layer GPT-2 (random init, no download) trains 5 steps on random tokens. bf16: a plain
``Trainer``; prints whether the parameters match ``Trainer(bf16=True)`` on the eager model bit for
bit. fp16: ``amp_fx.hf.AmpFxTrainer`` with ``fp16=True`` scales the loss with amp_fx.GradScaler.
"""

from __future__ import annotations

import argparse
import tempfile

import torch
import transformers

import amp_fx
from amp_fx.hf import AmpFxTrainer


def tiny_gpt2() -> transformers.GPT2LMHeadModel:
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=128))


def random_tokens() -> list[dict[str, torch.Tensor]]:
    ids = torch.randint(0, 128, (8, 16), generator=torch.Generator().manual_seed(1))
    return [{"input_ids": row, "labels": row} for row in ids]  # a causal LM: each sequence is its own label


def train(model: torch.nn.Module, trainer_cls: type = transformers.Trainer, **args: object) -> list[float]:
    with tempfile.TemporaryDirectory() as out:
        targs = transformers.TrainingArguments(
            output_dir=out,
            per_device_train_batch_size=2,
            max_steps=5,
            logging_steps=1,
            report_to=[],
            use_cpu=True,
            disable_tqdm=True,
            save_strategy="no",
            **args,
        )
        trainer = trainer_cls(model=model, args=targs, train_dataset=random_tokens())
        trainer.train()
        model.save_pretrained(out)  # the usual keys: the model is the same module object
        return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    dtype = parser.parse_args().dtype
    transformers.logging.set_verbosity_error()

    model = amp_fx.compile(tiny_gpt2(), inplace=True, dtype=dtype, backend="aot_eager")
    if dtype == "fp16":
        print("amp_fx fp16 losses:", train(model, AmpFxTrainer, fp16=True))
        return
    losses = train(model)
    eager = tiny_gpt2()
    eager_losses = train(eager, bf16=True)
    same = all(torch.equal(a, b) for a, b in zip(model.parameters(), eager.parameters()))
    print(
        f"amp_fx losses: {losses}\nTrainer(bf16=True) losses: {eager_losses}\n"
        f"parameters bitwise equal after 5 steps: {same}"
    )


if __name__ == "__main__":
    main()
