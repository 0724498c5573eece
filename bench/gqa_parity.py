"""Grouped-query attention against eager autocast: amp_fx and torch.compile + autocast, bitwise or not.

A 2-layer Hugging Face Llama (random init, hidden size = heads x head size, vocabulary 128, batch
2) per row: query heads, key/value heads, head size, sequence length, transformers' attention
(``sdpa`` or ``eager``) and dtype. One forward+backward under ``torch.autocast("cpu", dtype)`` is
the reference; each column says whether the output, the loss and every gradient are bitwise the
reference's: ``amp_fx.compile(..., backend="aot_eager")`` and ``torch.compile(backend="aot_eager")``
under autocast; ``reported``: whether amp_fx reported the traced path at compile time
(``amp_fx/backend/traced_paths.py``). docs/parity.md, "Models that branch on being compiled", has
the table and why.

    python bench/gqa_parity.py
    python bench/gqa_parity.py --shapes 4/2 8/2 --head-sizes 16 --seqs 16 --dtypes bf16
"""

from __future__ import annotations

import argparse
import copy
import itertools
import warnings
from typing import Any

import torch
from tabulate import tabulate

import amp_fx
from amp_fx.testing.real_models import eager_autocast_real_step, real_step

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _build(heads: int, kv_heads: int, head_size: int, seq: int, attention: str) -> tuple[Any, dict[str, Any], Any]:
    import transformers as tf

    torch.manual_seed(0)
    config = tf.LlamaConfig(
        vocab_size=128,
        hidden_size=heads * head_size,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_size,
        max_position_embeddings=128,
        use_cache=False,
        attn_implementation=attention,
    )
    model = tf.LlamaForCausalLM(config).train()
    ids = torch.randint(0, 128, (2, seq), generator=torch.Generator().manual_seed(1))
    return model, {"input_ids": ids, "labels": ids}, lambda out: out.loss


def _bitwise(a: Any, b: Any) -> bool:
    pairs = [(a.out, b.out), (a.grads, b.grads)]
    for x, y in pairs:
        for k in y:
            if x[k] is None or y[k] is None:
                if x[k] is not y[k]:
                    return False
            elif not torch.equal(x[k], y[k]):
                return False
    return torch.equal(a.loss, b.loss)


def _row(heads: int, kv_heads: int, head_size: int, seq: int, attention: str, dtype_id: str) -> list[Any]:
    dtype = DTYPES[dtype_id]
    model, inputs, loss_fn = _build(heads, kv_heads, head_size, seq, attention)
    ref = eager_autocast_real_step(copy.deepcopy(model), inputs, loss_fn, dtype)
    ours_model = copy.deepcopy(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", amp_fx.AmpFxWarning)
        ours = real_step(
            amp_fx.compile(ours_model, dtype=dtype, backend="aot_eager", strict=False), ours_model, inputs, loss_fn
        )
    reported = any("grouped-query attention" in str(w.message) for w in caught)
    plain_model = copy.deepcopy(model)
    compiled = torch.compile(plain_model, backend="aot_eager")

    def under_autocast(**kw: Any) -> Any:
        with torch.autocast("cpu", dtype=dtype):
            return compiled(**kw)

    plain = real_step(under_autocast, plain_model, inputs, loss_fn)
    torch._dynamo.reset()
    yes = {True: "bitwise", False: "differs"}
    return [
        heads,
        kv_heads,
        head_size,
        seq,
        attention,
        dtype_id,
        yes[_bitwise(ours, ref)],
        yes[_bitwise(plain, ref)],
        "yes" if reported else "no",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", nargs="+", default=["4/4", "4/2", "4/1", "8/2"], help="query/key-value heads")
    parser.add_argument("--head-sizes", nargs="+", type=int, default=[16])
    parser.add_argument("--seqs", nargs="+", type=int, default=[16, 17])
    parser.add_argument("--attention", nargs="+", default=["sdpa", "eager"])
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES))
    args = parser.parse_args()
    rows = []
    for shape, head_size, seq, attention, dtype_id in itertools.product(
        args.shapes, args.head_sizes, args.seqs, args.attention, args.dtypes
    ):
        heads, kv_heads = (int(p) for p in shape.split("/"))
        rows.append(_row(heads, kv_heads, head_size, seq, attention, dtype_id))
        print(rows[-1], flush=True)
    print(f"torch {torch.__version__}")
    print(
        tabulate(
            rows,
            headers=[
                "heads",
                "kv heads",
                "head size",
                "seq",
                "attention",
                "dtype",
                "amp_fx",
                "torch.compile",
                "reported",
            ],
            tablefmt="github",
        )
    )


if __name__ == "__main__":
    main()
