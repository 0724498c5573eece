"""Cast bytes per optimizer step, step time and memory, with and without amp_fx's weight cache.

    python bench/bench_weight_casts.py                  # GPT-2-like, Llama-like, HF GPT-2, HF Llama: 6 x 512, bf16
    python bench/bench_weight_casts.py --quick          # 2 layers x 128 (a smoke run)
    python bench/bench_weight_casts.py --model hf-llama # one model: transformers' Llama (also hf-gpt2)

**Cast bytes** are counted from what executes under ``aot_eager``, per optimizer step (one
accumulation window), as the bytes each dtype cast reads plus writes:

* in compiled forward and finish graphs: a counting ``fw_compiler`` (aot_eager's own nop
  compiler underneath) counts every ``_to_copy``/``copy`` node that changes the dtype each time
  the graph runs. A ``TorchDispatchMode`` cannot do it: Dynamo runs frames eagerly while one is
  active.
* in eager code (eager autocast's forward) and in every backward (compiled backward graphs and
  the weight cache's eager gradient cast alike): a ``TorchDispatchMode``.

A cast is a **weight cast** when it reads a parameter (fp32 to bf16), or when it writes the
low-precision copy inside the update (the finish graph of ``compile_step``); every other cast is
an **activation cast** (activations, and gradients: the low-precision weight gradients cast back
to fp32 are the same in all four variants). ``update (fused)`` counts the copy written by the
update pass as the 2 bytes it writes: under inductor the cast reads the updated fp32 value in the
same loop that writes it (checked with ``--check-fusion``). Under aot_eager it runs as its own op
and also reads the 4 bytes; the ``as executed`` column counts that.

**Step time** (aot_eager, this CPU): amp_fx without and with the cache, interleaved, ratios only.
**Memory**: the bytes held between steps (parameters, gradients, optimizer state, cached copies)
and the peak during a step (held + the profiler's largest transient), with and without the cache.
"""

from __future__ import annotations

import argparse
import functools
import gc
import importlib.util
import math
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from tabulate import tabulate
from torch import Tensor, nn
from torch._dynamo.backends.debugging import aot_eager, boxed_nop
from torch.utils._python_dispatch import TorchDispatchMode

import amp_fx
from amp_fx.scaler import GradScaler, ScalerMode
from amp_fx.testing import eager_amp_step
from amp_fx.testing.bench import machine_lines, percentile

DTYPE = torch.bfloat16
_CASTS = (torch.ops.aten._to_copy.default, torch.ops.aten.copy.default, torch.ops.aten.copy_.default)


# --- models -----------------------------------------------------------------------------------


class _Attention(nn.Module):
    def __init__(self, d: int, heads: int, bias: bool) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d, bias=bias)
        self.out = nn.Linear(d, d, bias=bias)

    def forward(self, x: Tensor) -> Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, t, d))


class GPT2Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = _Attention(d, heads, bias=True)
        self.fc, self.proj = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.proj(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class GPT2(nn.Module):
    """GPT-2's layout: learned positions, pre-LayerNorm blocks, GELU MLP, head tied to the embedding."""

    def __init__(self, vocab: int, d: int, layers: int, heads: int, seq: int) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(GPT2Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)

    def forward(self, ids: Tensor) -> Tensor:
        h = self.wte(ids) + self.wpe(torch.arange(ids.shape[1], device=ids.device))
        for block in self.blocks:
            h = block(h)
        return F.linear(self.ln_f(h), self.wte.weight)


class RMSNorm(nn.Module):
    def __init__(self, d: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(d)), eps

    def forward(self, x: Tensor) -> Tensor:
        h = x.float()
        return self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


class LlamaBlock(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        hidden = 256 * math.ceil(8 * d / 3 / 256)
        self.norm1, self.norm2 = RMSNorm(d), RMSNorm(d)
        self.attn = _Attention(d, heads, bias=False)
        self.gate, self.up = nn.Linear(d, hidden, bias=False), nn.Linear(d, hidden, bias=False)
        self.down = nn.Linear(hidden, d, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.norm1(x))
        h = self.norm2(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class Llama(nn.Module):
    """Llama's layout: RMSNorm, SwiGLU, no biases, untied head (no rotary: it casts no weight)."""

    def __init__(self, vocab: int, d: int, layers: int, heads: int, seq: int) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(LlamaBlock(d, heads) for _ in range(layers))
        self.norm, self.head = RMSNorm(d), nn.Linear(d, vocab, bias=False)

    def forward(self, ids: Tensor) -> Tensor:
        h = self.emb(ids)
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


class HFLogits(nn.Module):
    """A Hugging Face causal LM (random init, no download) seen as ``ids -> logits``."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: Tensor) -> Tensor:
        return self.model(input_ids=ids).logits


def hf_gpt2(vocab: int, d: int, layers: int, heads: int, seq: int) -> nn.Module:
    """transformers' GPT2LMHeadModel (head tied to the embedding), no dropout."""
    import transformers

    return HFLogits(
        transformers.GPT2LMHeadModel(
            transformers.GPT2Config(
                vocab_size=vocab,
                n_positions=seq,
                n_embd=d,
                n_layer=layers,
                n_head=heads,
                resid_pdrop=0.0,
                embd_pdrop=0.0,
                attn_pdrop=0.0,
            )
        )
    )


def hf_llama(vocab: int, d: int, layers: int, heads: int, seq: int) -> nn.Module:
    """transformers' LlamaForCausalLM (rotary embeddings, SwiGLU, untied head), the llama-like MLP width."""
    import transformers

    return HFLogits(
        transformers.LlamaForCausalLM(
            transformers.LlamaConfig(
                vocab_size=vocab,
                hidden_size=d,
                intermediate_size=256 * math.ceil(8 * d / 3 / 256),
                num_hidden_layers=layers,
                num_attention_heads=heads,
                num_key_value_heads=heads,
                max_position_embeddings=max(seq, 64),
            )
        )
    )


MODELS: dict[str, Callable[..., nn.Module]] = {
    "gpt2-like": GPT2,
    "llama-like": Llama,
    "hf-gpt2": hf_gpt2,
    "hf-llama": hf_llama,
}


def lm_loss(logits: Tensor, targets: Tensor) -> Tensor:
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


# --- counting ---------------------------------------------------------------------------------


class CastBytes:
    """Bytes read + written by dtype casts, by kind, while ``active``."""

    def __init__(self) -> None:
        self.bytes: dict[str, int] = defaultdict(int)
        self.active = False
        self.phase = "forward"  # "update" while the optimizer step runs
        self.param_storages: set[int] = set()

    def add(self, src: Tensor | torch.dtype, dst_dtype: torch.dtype, numel: int, reads_param: bool) -> None:
        if not self.active:
            return
        src_dtype = src if isinstance(src, torch.dtype) else src.dtype
        if src_dtype == dst_dtype:
            return
        size = numel * (src_dtype.itemsize + dst_dtype.itemsize)
        if self.phase == "update" and src_dtype == torch.float32 and dst_dtype == DTYPE:
            self.bytes["update"] += size
            self.bytes["update (fused)"] += numel * dst_dtype.itemsize
        elif reads_param:
            self.bytes["weight"] += size
        else:
            self.bytes["activation"] += size

    def is_param(self, t: object) -> bool:
        return isinstance(t, Tensor) and t.untyped_storage().data_ptr() in self.param_storages

    # compiled graphs -------------------------------------------------------------------------
    def fw_compiler(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        placeholders = {n: i for i, n in enumerate(n for n in gm.graph.nodes if n.op == "placeholder")}
        plan = []
        for n in gm.graph.nodes:
            if n.op != "call_function" or n.target not in _CASTS:
                continue
            out = n.meta["val"]
            src = n.args[1] if n.target is not torch.ops.aten._to_copy.default else n.args[0]
            src_dtype = src.meta["val"].dtype
            plan.append((placeholders.get(src), src_dtype, out.dtype, out.numel()))
        inner = boxed_nop(gm, example_inputs)

        def run(args: list[Any]) -> Any:
            for index, src_dtype, dst_dtype, numel in plan:
                self.add(src_dtype, dst_dtype, numel, index is not None and self.is_param(args[index]))
            return inner(args)

        run._boxed_call = True  # type: ignore[attr-defined]
        return run

    def backend(self) -> Callable[..., Any]:
        return functools.partial(aot_eager, fw_compiler=self.fw_compiler)


class _EagerCasts(TorchDispatchMode):
    def __init__(self, counter: CastBytes) -> None:
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in _CASTS:
            src = args[1] if func is not torch.ops.aten._to_copy.default else args[0]
            dst = args[0] if func is torch.ops.aten.copy_.default else out
            self.counter.add(src, dst.dtype, dst.numel(), self.counter.is_param(src))
        return out


# --- variants ---------------------------------------------------------------------------------


class Variant:
    def __init__(self, name: str, model: nn.Module, accumulate: int, counter: CastBytes) -> None:
        self.name, self.model, self.counter = name, model, counter
        self.opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        self.eager_forward = name == "eager autocast"
        if name.startswith("amp_fx"):
            self.step = amp_fx.compile_step(
                model,
                self.opt,
                lm_loss,
                dtype=DTYPE,
                accumulate=accumulate,
                backend=counter.backend(),
                weight_cache=name.endswith("cache"),
            )
            self._wrap_update(self.step)
        else:
            run = model if self.eager_forward else torch.compile(model, backend=counter.backend())
            scaler = GradScaler("cpu", mode=ScalerMode.CHECK_ONLY)
            self.step = eager_amp_step(run, self.opt, lm_loss, scaler, dtype=DTYPE, accumulate=accumulate)
            self._wrap_opt_step()
        self._wrap_backward()

    def _wrap_update(self, step: Any) -> None:
        inner = step._optimizer_step

        def optimizer_step() -> None:
            self.counter.phase = "update"
            try:
                inner()
            finally:
                self.counter.phase = "forward"

        step._optimizer_step = optimizer_step

    def _wrap_opt_step(self) -> None:
        inner = self.opt.step

        def opt_step(*a: Any, **k: Any) -> Any:
            self.counter.phase = "update"
            try:
                return inner(*a, **k)
            finally:
                self.counter.phase = "forward"

        self.opt.step = opt_step  # type: ignore[method-assign]

    def _wrap_backward(self) -> None:
        """Every backward (and, for eager autocast, the forward too) under the counting mode."""
        counter, eager_forward = self.counter, self.eager_forward
        original = Tensor.backward

        def run(*batch: Any) -> Tensor:
            if eager_forward:  # one mode around the whole step, backward included
                with _EagerCasts(counter):
                    return self._inner(*batch)

            def backward(t: Tensor, *a: Any, **k: Any) -> None:
                with _EagerCasts(counter):
                    original(t, *a, **k)

            Tensor.backward = backward  # type: ignore[method-assign]
            try:
                return self._inner(*batch)
            finally:
                Tensor.backward = original  # type: ignore[method-assign]

        self._inner, self.step = self.step, run


def _build(name: str, kind: str, vocab: int, d: int, layers: int, heads: int, seq: int) -> nn.Module:
    torch.manual_seed(0)
    return MODELS[kind](vocab, d, layers, heads, seq)


# --- measurements ------------------------------------------------------------------------------


def cast_bytes(
    kind: str, dims: dict[str, int], accumulate: int, batch: list[tuple[Tensor, Tensor]]
) -> tuple[dict[str, dict[str, int]], dict[str, Variant]]:
    """Bytes per optimizer step for each variant; returns the two amp_fx variants, still compiled."""
    out, keep = {}, {}
    for name in ("eager autocast", "torch.compile+autocast", "amp_fx", "amp_fx + weight cache"):
        if name != "amp_fx + weight cache":  # the two amp_fx variants stay compiled, to be timed
            torch._dynamo.reset()
        counter = CastBytes()
        variant = Variant(name, _build(name, kind, **dims), accumulate, counter)
        counter.param_storages = {p.untyped_storage().data_ptr() for p in variant.model.parameters()}
        for x, y in batch[: 3 * accumulate]:  # compile, compile_step's eager warm-up, one compiled step
            variant.step(x, y)
        counter.active = True
        for x, y in batch[3 * accumulate : 4 * accumulate]:
            variant.step(x, y)
        counter.active = False
        out[name] = dict(counter.bytes)
        if name.startswith("amp_fx"):
            keep[name] = variant
    return out, keep


def _held_bytes(model: nn.Module, opt: torch.optim.Optimizer, cache: Any) -> int:
    seen: set[int] = set()
    total = 0
    tensors = [*model.parameters(), *(p.grad for p in model.parameters() if p.grad is not None)]
    tensors += [v for s in opt.state.values() for v in s.values() if isinstance(v, Tensor)]
    if cache is not None:
        tensors += [lowp for _, lowp in cache.pairs(list(model.parameters()))]
    for t in tensors:
        s = t.untyped_storage()
        if s.data_ptr() not in seen:
            seen.add(s.data_ptr())
            total += s.nbytes()
    return total


def _peak_transient(fn: Callable[[], None]) -> int:
    """The largest number of bytes allocated during ``fn`` beyond what was live before it (the
    profiler's memory timeline: tensors created and destroyed, CPU allocator included)."""
    from torch.profiler import ProfilerActivity, profile
    from torch.profiler._memory_profiler import Action

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True) as prof:
        fn()
    now = peak = 0
    for _, action, _, size in prof._memory_profile().timeline:
        if action is Action.CREATE:
            now += size
        elif action is Action.DESTROY:
            now -= size
        peak = max(peak, now)
    return peak


def time_and_memory(
    kind: str, variants: dict[str, Variant], accumulate: int, batch: list[tuple[Tensor, Tensor]], steps: int
) -> list[list[object]]:
    """amp_fx without and with the cache, already compiled and warm: interleaved step times, the
    bytes held between steps and the peak during one step."""
    window = batch[3 * accumulate : 4 * accumulate]
    times: dict[str, list[float]] = defaultdict(list)
    for i in range(steps):
        for name, v in variants.items() if i % 2 == 0 else reversed(variants.items()):
            t0 = time.perf_counter()
            for x, y in window:
                v.step(x, y)
            times[name].append(time.perf_counter() - t0)
    rows = []
    base = percentile(times["amp_fx"], 0.5)
    for name, v in variants.items():
        gc.collect()
        held = _held_bytes(v.model, v.opt, v._inner._forward.amp_fx_weight_cache)

        def one_window(v: Variant = v) -> None:
            for x, y in window:
                v.step(x, y)

        peak = held + _peak_transient(one_window)
        med = percentile(times[name], 0.5)
        rows.append(
            [
                kind,
                accumulate,
                name,
                f"{med * 1e3:.0f}",
                f"{med / base:.3f}",
                f"{percentile(times[name], 0.1) / base:.3f}",
                f"{percentile(times[name], 0.9) / base:.3f}",
                f"{held / 2**20:.1f}",
                f"{peak / 2**20:.1f}",
            ]
        )
    return rows


# --- fusion check -----------------------------------------------------------------------------


def check_fusion(kind: str, dims: dict[str, int]) -> str:
    """Compile compile_step's finish graph with inductor and report whether the kernel that
    stores an updated parameter also stores its bf16 copy (one loop: the 2-byte write)."""
    import torch._inductor.config as inductor_config
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    model = _build("fusion", kind, **dims)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9)
    step = amp_fx.compile_step(model, opt, lm_loss, dtype=DTYPE, backend="inductor", weight_cache=True)
    x, y = _batches(1, dims)[0]
    step(x, y)
    step(x, y)  # eager warm-up done; the next optimizer step compiles the finish graph
    with inductor_config.patch(fx_graph_cache=False):
        _, code = run_and_get_code(lambda: step(x, y))
    text = "\n".join(code)
    kernels = text.count('extern "C"')
    signatures = [chunk.split(")", 1)[0] for chunk in text.split('extern "C"')[1:]]
    both = sum(
        1
        for sig, chunk in zip(signatures, text.split('extern "C"')[1:])
        if "float* out_ptr" in sig and "at::BFloat16* out_ptr" in sig and "convert<at::BFloat16>" in chunk
    )
    return (
        f"code compiled for the step after warm-up (inductor, SGD momentum): {kernels} C++ kernels; {both} "
        "store updated fp32 parameters and their bf16 copies from the same loop"
    )


def _batches(n: int, dims: dict[str, int], batch_size: int = 1) -> list[tuple[Tensor, Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        (
            torch.randint(0, dims["vocab"], (batch_size, dims["seq"]), generator=g),
            torch.randint(0, dims["vocab"], (batch_size, dims["seq"]), generator=g),
        )
        for _ in range(n)
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 layers x 128: a smoke run")
    parser.add_argument("--steps", type=int, default=5, help="timed optimizer steps per variant")
    parser.add_argument("--model", choices=[*MODELS, "all"], default="all")
    parser.add_argument("--accumulate", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--check-fusion", action="store_true", help="inspect inductor's finish graph")
    parser.add_argument("--memory-only", action="store_true", help="amp_fx without/with the cache: memory")
    args = parser.parse_args()
    dims = (
        dict(vocab=256, d=128, layers=2, heads=4, seq=4)
        if args.quick
        else dict(vocab=256, d=512, layers=6, heads=8, seq=4)
    )
    print("\n".join(machine_lines()))
    print(f"bf16, batch 1 x seq {dims['seq']}, AdamW (non-fused); dims {dims}", flush=True)
    byte_headers = [
        "model",
        "params",
        "accumulate",
        "variant",
        "weight MiB",
        "weight B/param",
        "weight / eager",
        "weight / eager as executed",
        "activation MiB",
    ]
    time_headers = [
        "model",
        "accumulate",
        "variant",
        "median ms",
        "time / no cache",
        "p10",
        "p90",
        "held between steps MiB",
        "peak MiB",
    ]
    kinds = list(MODELS) if args.model == "all" else [args.model]
    if importlib.util.find_spec("transformers") is None and any(k.startswith("hf-") for k in kinds):
        print("transformers is not installed: no hf-* rows (pip install transformers)")
        kinds = [k for k in kinds if not k.startswith("hf-")]
    for kind in kinds:
        if args.memory_only:
            for accumulate in args.accumulate:
                batch = _batches(4 * accumulate, dims)
                torch._dynamo.reset()
                variants = {}
                for name in ("amp_fx", "amp_fx + weight cache"):
                    variants[name] = Variant(name, _build(name, kind, **dims), accumulate, CastBytes())
                    for x, y in batch[: 3 * accumulate]:
                        variants[name].step(x, y)
                print(tabulate(time_and_memory(kind, variants, accumulate, batch, 1), headers=time_headers), flush=True)
            continue
        n_params = sum(p.numel() for p in _build("count", kind, **dims).parameters())
        for accumulate in args.accumulate:
            batch = _batches(4 * accumulate, dims)
            result, compiled = cast_bytes(kind, dims, accumulate, batch)
            eager_weight = result["eager autocast"].get("weight", 0)
            rows = []
            for name, b in result.items():
                weight = b.get("weight", 0) + b.get("update (fused)", 0)
                executed = b.get("weight", 0) + b.get("update", 0)
                rows.append(
                    [
                        kind,
                        f"{n_params / 1e6:.1f}M",
                        accumulate,
                        name,
                        f"{weight / 2**20:.1f}",
                        f"{weight / n_params:.1f}",
                        f"{weight / eager_weight:.2f}",
                        f"{executed / eager_weight:.2f}",
                        f"{b.get('activation', 0) / 2**20:.1f}",
                    ]
                )
            print("\ncast bytes per optimizer step (reads + writes of executed dtype casts, aot_eager)")
            print(tabulate(rows, headers=byte_headers), flush=True)
            print(f"\nstep time (aot_eager, median of {args.steps}, interleaved) and memory, per optimizer step")
            print(
                tabulate(time_and_memory(kind, compiled, accumulate, batch, args.steps), headers=time_headers),
                flush=True,
            )
    if args.check_fusion:
        print("\n" + check_fusion("llama-like", dict(vocab=64, d=32, layers=1, heads=2, seq=8)))


if __name__ == "__main__":
    main()
