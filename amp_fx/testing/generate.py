"""Tiny Hugging Face causal LMs (random init, no download) and the greedy ``generate`` call that
the generate tests (tests/usage/test_everyday.py) and bench/bench_generate.py share."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["ARCHS", "NEW_TOKENS", "tiny_causal_lm", "greedy_generate", "prompt"]

ARCHS = ("gpt2", "llama")
NEW_TOKENS = 6


def tiny_causal_lm(arch: str) -> torch.nn.Module:
    """GPT-2 or Llama, 2 layers of width 64, vocabulary 128, seeded, in eval mode (needs transformers)."""
    import transformers

    torch.manual_seed(0)
    if arch == "gpt2":
        config = transformers.GPT2Config(
            n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=64, bos_token_id=0, eos_token_id=0
        )
        return transformers.GPT2LMHeadModel(config).eval()
    if arch == "llama":
        llama = transformers.LlamaConfig(
            num_hidden_layers=2,
            hidden_size=64,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=128,
            vocab_size=128,
            max_position_embeddings=64,
            bos_token_id=0,
            eos_token_id=0,
        )
        return transformers.LlamaForCausalLM(llama).eval()
    raise ValueError(f"unknown arch {arch!r}; one of {ARCHS}")


def prompt(batch: int = 2, length: int = 5) -> torch.Tensor:
    return torch.randint(1, 128, (batch, length), generator=torch.Generator().manual_seed(1))


def greedy_generate(model: torch.nn.Module, ids: torch.Tensor, cache: str) -> Any:
    """``NEW_TOKENS`` greedy tokens with the KV cache ("dynamic" or "static"), logits and scores
    returned; no early stop (no end-of-sequence token), so every call runs the same steps."""
    kwargs: dict[str, Any] = dict(
        max_new_tokens=NEW_TOKENS,
        do_sample=False,
        output_logits=True,
        output_scores=True,
        return_dict_in_generate=True,
        pad_token_id=0,
        eos_token_id=None,
    )
    if cache == "static":
        kwargs["cache_implementation"] = "static"
    with torch.no_grad():
        return model.generate(ids, **kwargs)  # type: ignore[operator]  # transformers' GenerationMixin.generate
