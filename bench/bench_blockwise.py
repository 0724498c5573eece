"""Blockwise fp8 on a Hopper GPU: amp_fx's quantizers against torchao's Triton kernels, bit for bit,
and amp_fx's blockwise matmul beside torchao's ``Float8BlockwiseLinear`` on Llama 3 8B's layers.

    python bench/bench_blockwise.py --device cuda    # .ci/gpu's blockwise stage (H100/H200 + torchao)
    python bench/bench_blockwise.py                  # elsewhere: says why it cannot run, exits 0

Check (exit 1 on any difference): each of torchao 0.18's blockwise quantization kernels
(``triton_fp8_blockwise_act_quant_lhs``, ``..._act_quant_rhs``, ``..._act_quant_transposed_lhs``,
``..._weight_quant_rhs``, ``..._weight_quant_transposed_rhs``) against amp_fx's quantizer of the same
tensor (``amp_fx.kernels.blockwise_fp8``), e4m3 bits and fp32 scales, on random tensors with
all-zero blocks and values at e4m3's limits; the tests hold the same quantizers to torchao's torch
references on the CPU (tests/fp8/test_blockwise.py), this holds them to the kernels. Then, per
layer, amp_fx's forward output against torchao's ``fp8_blockwise_mm`` on the same bf16 operands.

Speed: forward + backward of ``x @ w.T`` per Llama 3 8B projection (d 4096, FFN 14336, 8 KV heads of
128; 8192 tokens), tokens/s median and p10-p90 over repetitions, for bf16 ``F.linear``, torchao's
``fp8_blockwise_mm`` (cuBLAS's blockwise ``scaled_mm``) on a bf16 weight, and amp_fx's blockwise
matmul on the fp32 master weight (what ``amp_fx.compile(fp8="blockwise")`` runs), all eager.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable

import torch
from tabulate import tabulate

from amp_fx.kernels import blockwise_fp8 as bw
from amp_fx.testing.bench import machine_lines, percentile, sync

# Llama 3 8B's projections as (name, K, N): q/o 4096 -> 4096, k/v 4096 -> 1024 (8 KV heads x 128),
# w1/w3 4096 -> 14336, w2 14336 -> 4096.
LAYERS = [("wq/wo", 4096, 4096), ("wk/wv", 4096, 1024), ("w1/w3", 4096, 14336), ("w2", 14336, 4096)]
TOKENS = 8192


def _why_not(device: str) -> str | None:
    if device != "cuda" or not torch.cuda.is_available():
        return "needs CUDA (--device cuda on a Hopper GPU)"
    major, minor = torch.cuda.get_device_capability()
    if major != 9:
        return f"needs a Hopper GPU (compute capability 9.x), this one is {major}.{minor}"
    try:
        import torchao.prototype.blockwise_fp8_training.kernels  # noqa: F401
    except ImportError as e:
        return f"torchao's blockwise fp8 training does not import ({e})"
    return None


def _tensor(rows: int, cols: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random, with an all-zero 1x128 block, 128x128 tile and 128x1 column, and values at e4m3's
    limits (x 448 x 2^10, x 2^-20 of the block's amax), as tests/fp8/test_blockwise.py's."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(rows, cols, generator=gen, device="cuda")
    x[3, :128] = 0
    x[128:256, 128:256] = 0
    x[:128, 5] = 0
    x[:, ::7] *= 448 * 2.0**10
    x[:, 3::11] *= 2.0**-20
    return x.to(dtype)


def _same(ours: tuple[torch.Tensor, torch.Tensor], theirs: tuple[torch.Tensor, torch.Tensor]) -> str:
    data = (ours[0].view(torch.uint8) != theirs[0].contiguous().view(torch.uint8)).sum().item()
    scales = (ours[1].contiguous() != theirs[1].contiguous()).sum().item()
    return "bitwise" if data == scales == 0 else f"DIFFER: {data} bytes, {scales} scales"


def check_quantizers() -> list[list[str]]:
    from torchao.prototype.blockwise_fp8_training import kernels as k

    x = _tensor(512, 1024, torch.bfloat16, 0)  # activations and gradients: bf16
    w = _tensor(512, 1024, torch.float32, 1)  # amp_fx scales the fp32 master weight
    tw = bw.quantize_128x128(w)
    rows = []
    xt = bw.quantize_1x128(x.t())
    for name, ours, theirs in (
        ("act_quant_lhs (x in out, grad in grad_x)", bw.quantize_1x128(x), k.triton_fp8_blockwise_act_quant_lhs(x)),
        ("act_quant_transposed_lhs (grad.T in grad_w)", xt, k.triton_fp8_blockwise_act_quant_transposed_lhs(x)),
        ("act_quant_rhs (x in grad_w)", _t(xt), k.triton_fp8_blockwise_act_quant_rhs(x)),
        ("weight_quant_rhs (w in grad_x)", tw, k.triton_fp8_blockwise_weight_quant_rhs(w)),
        ("weight_quant_transposed_rhs (w.T in out)", _t(tw), k.triton_fp8_blockwise_weight_quant_transposed_rhs(w)),
    ):
        rows.append([name, _same((ours.data, ours.inv_scale), theirs)])
    return rows


def _t(b: bw.Blocks) -> bw.Blocks:
    return bw.Blocks(b.data.t(), b.inv_scale.t())


def _time(fn: Callable[[], None], reps: int) -> list[float]:
    for _ in range(3):
        fn()
    sync("cuda")
    times = []
    for _ in range(reps):
        began = time.perf_counter()
        fn()
        sync("cuda")
        times.append(time.perf_counter() - began)
    return times


def bench_layers(reps: int) -> list[list[str]]:
    from torchao.prototype.blockwise_fp8_training.linear import fp8_blockwise_mm

    rows = []
    emulate = bw.blockwise_kernels_missing("cuda") is not None
    for name, k, n in LAYERS:
        x = torch.randn(TOKENS, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        w32 = torch.randn(n, k, device="cuda", requires_grad=True)
        w16 = w32.detach().bfloat16().requires_grad_()
        g = torch.randn(TOKENS, n, device="cuda", dtype=torch.bfloat16)
        same = torch.equal(
            bw.blockwise_fp8_matmul(x.detach(), w16.detach().t(), emulate=emulate),
            fp8_blockwise_mm.apply(x.detach(), w16.detach(), 128, torch.bfloat16, False),
        )
        variants = {
            "bf16 F.linear": lambda: torch.nn.functional.linear(x, w16).backward(g),
            "torchao fp8_blockwise_mm": lambda: fp8_blockwise_mm.apply(x, w16, 128, torch.bfloat16, False).backward(g),
            "amp_fx blockwise": lambda: bw.blockwise_fp8_matmul(x, w32.t(), emulate=emulate).backward(g),
        }
        base = None
        for variant, fn in variants.items():
            t = _time(fn, reps)
            tps = [TOKENS / s for s in t]
            med = percentile(tps, 0.5)
            base = base or med
            rows.append(
                [
                    f"{name} ({k}->{n})",
                    variant,
                    f"{med:,.0f}",
                    f"{percentile(tps, 0.1):,.0f}-{percentile(tps, 0.9):,.0f}",
                    f"{med / base:.2f}",
                    ("bitwise" if same else "DIFFERS") if variant.startswith("amp_fx") else "",
                ]
            )
        x.grad = w32.grad = w16.grad = None
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--reps", type=int, default=10)
    args = parser.parse_args()
    for line in machine_lines():
        print(line)
    why = _why_not(args.device)
    if why is not None:
        print(f"[bench_blockwise] skipped: {why}")
        return 0
    missing = bw.blockwise_kernels_missing("cuda")
    print(f"device: {torch.cuda.get_device_name()}; amp_fx's blockwise GEMM: {missing or 'yes'}")
    checks = check_quantizers()
    print(tabulate(checks, headers=["torchao Triton kernel", "amp_fx's quantizer"]))
    rows = bench_layers(args.reps)
    print(tabulate(rows, headers=["layer", "variant", "tokens/s", "p10-p90", "x bf16", "out vs torchao"]))
    failed = [r for r in checks if r[1] != "bitwise"] + [r for r in rows if r[-1] == "DIFFERS"]
    for r in failed:
        print(f"[bench_blockwise] {r[0]} failed: {r[-1]}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
