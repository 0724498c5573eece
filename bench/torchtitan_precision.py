"""How far each precision mode of torchtitan's Llama 3 debugmodel is from float64 (docs/torchtitan.md).

    python bench/torchtitan_precision.py [--layers 2] [--batch 4] [--seq 128] [--seeds 3]

One gloo rank (torchtitan applies FSDP2 even at dp_shard=1), the same weights (seed 0) and, per
seed, the same random tokens and labels for every mode; one forward and backward of the mean
cross-entropy:

* float64: the model without torchtitan's parallelization, parameters and activations in float64
  (RoPE's fp32 islands in torchtitan's model code stay fp32);
* torchtitan default: ``parallelize_llama`` with ``mixed_precision_param="bfloat16"`` (FSDP2 gathers
  bf16 parameters, every op in bf16, no autocast: norms and softmax in bf16);
* amp_fx bf16 (fp32 params): ``amp_fx_parallelize`` with ``mixed_precision_param="float32"``
  (autocast semantics: fp32 master weights, matmuls in bf16, norms, softmax and the loss in fp32);
* amp_fx bf16 (bf16 params): ``mixed_precision_param="bfloat16"`` under amp_fx (FSDP2 gathers bf16
  weights; amp_fx runs autocast's fp32 ops in fp32 on top).

Printed: the loss's error against float64 (relative, worst over seeds), each FSDP2 unit's output
error (relative Frobenius norm, worst over seeds; the worst unit named), and the gradient error
(relative norm over all parameters, and the parameter with the worst one), and whether the
mode's loss and gradients are bitwise those of torchtitan's default.
"""

from __future__ import annotations

import argparse
import functools
from typing import Any

import torch
from tabulate import tabulate

from amp_fx.testing.bench import machine_lines
from amp_fx.testing.distributed import run_ranks

MODES = ["torchtitan default", "amp_fx bf16 (fp32 params)", "amp_fx bf16 (bf16 params)"]


def _identity(model: torch.nn.Module, **_: Any) -> torch.nn.Module:
    return model


def _to_float64(model: torch.nn.Module) -> None:
    with torch.no_grad():
        for module in model.modules():
            for name, p in module.named_parameters(recurse=False):
                p.data = p.data.double()
            for name, b in module.named_buffers(recurse=False):
                if b is not None and (b.is_floating_point() or b.is_complex()):
                    module._buffers[name] = b.to(torch.complex128 if b.is_complex() else torch.float64)


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().double()


def _run(model: torch.nn.Module, tokens: torch.Tensor, labels: torch.Tensor) -> dict[str, Any]:
    units = {n: m for n, m in model.named_modules() if n and "." not in n.removeprefix("layers.")}
    outs: dict[str, torch.Tensor] = {}

    @torch._dynamo.disable  # a hook that only records: never part of a graph
    def record(name: str, module: torch.nn.Module, args: Any, out: torch.Tensor) -> None:
        outs[name] = _full(out)

    hooks = [m.register_forward_hook(functools.partial(record, n)) for n, m in units.items() if n != "layers"]
    model.zero_grad(set_to_none=True)
    logits = model(tokens)
    logits = logits.full_tensor() if hasattr(logits, "full_tensor") else logits
    loss = torch.nn.functional.cross_entropy(logits.double().flatten(0, 1), labels.flatten())
    loss.backward()
    for h in hooks:
        h.remove()
    grads = {n: _full(p.grad) for n, p in model.named_parameters()}
    return {"loss": loss.item(), "outs": outs, "grads": grads}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def measure(rank: int, world: int, layers: int, batch: int, seq: int, seeds: int) -> list[list[Any]]:
    from torchtitan.models.llama3 import parallelize_llama

    from amp_fx.integrations.torchtitan import AmpFxTitanConfig, amp_fx_parallelize
    from amp_fx.testing.torchtitan import TITAN_VOCAB, cpu_debugmodel

    amp = amp_fx_parallelize(parallelize_llama, AmpFxTitanConfig(dtype="bf16", backend="aot_eager"))
    reference = cpu_debugmodel(n_layers=layers, parallelize_fn=_identity)
    _to_float64(reference)
    models = {
        "torchtitan default": cpu_debugmodel(n_layers=layers, param_dtype="bfloat16"),
        "amp_fx bf16 (fp32 params)": cpu_debugmodel(n_layers=layers, parallelize_fn=amp),
        "amp_fx bf16 (bf16 params)": cpu_debugmodel(n_layers=layers, param_dtype="bfloat16", parallelize_fn=amp),
    }
    worst: dict[str, dict[str, Any]] = {m: {"loss": 0.0, "outs": {}, "grad": 0.0, "grads": {}} for m in MODES}
    for seed in range(seeds):
        gen = torch.Generator().manual_seed(1000 + seed)
        tokens = torch.randint(0, TITAN_VOCAB, (batch, seq), generator=gen)
        labels = torch.randint(0, TITAN_VOCAB, (batch, seq), generator=gen)
        ref = _run(reference, tokens, labels)
        default = None
        for mode, model in models.items():
            got = _run(model, tokens, labels)
            w = worst[mode]
            default = got if default is None else default
            w["same"] = (
                w.get("same", True)
                and got["loss"] == default["loss"]
                and all(torch.equal(got["grads"][n], default["grads"][n]) for n in got["grads"])
            )
            w["loss"] = max(w["loss"], abs(got["loss"] - ref["loss"]) / abs(ref["loss"]))
            for name, out in got["outs"].items():
                w["outs"][name] = max(w["outs"].get(name, 0.0), _rel(out, ref["outs"][name]))
            names = list(ref["grads"])
            all_err = _rel(
                torch.cat([got["grads"][n].flatten() for n in names]),
                torch.cat([ref["grads"][n].flatten() for n in names]),
            )
            w["grad"] = max(w["grad"], all_err)
            for n in names:
                w["grads"][n] = max(w["grads"].get(n, 0.0), _rel(got["grads"][n], ref["grads"][n]))
    rows = []
    for mode in MODES:
        w = worst[mode]
        unit, unit_err = max(w["outs"].items(), key=lambda kv: kv[1])
        param, param_err = max(w["grads"].items(), key=lambda kv: kv[1])
        rows.append(
            [
                mode,
                f"{w['loss']:.2e}",
                f"{w['outs'].get('lm_head', float('nan')):.2e}",
                f"{unit} {unit_err:.2e}",
                f"{w['grad']:.2e}",
                f"{param} {param_err:.2e}",
                "yes" if w["same"] else "no",
            ]
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--seeds", type=int, default=3)
    args = parser.parse_args()
    rows = run_ranks(measure, args.layers, args.batch, args.seq, args.seeds, world_size=1)[0]
    for line in machine_lines():
        print(line)
    import torchtitan

    print(
        f"torchtitan {torchtitan.__version__ if hasattr(torchtitan, '__version__') else '0.3.0'}, "
        f"Llama 3 debugmodel, {args.layers} layers, SDPA, batch {args.batch} x {args.seq} tokens, "
        f"worst of {args.seeds} seeds, errors relative to float64"
    )
    print(
        tabulate(
            rows,
            headers=[
                "mode",
                "loss error",
                "logits error",
                "worst unit output",
                "gradient error (all)",
                "worst parameter gradient",
                "bitwise = torchtitan default",
            ],
            tablefmt="github",
        )
    )


if __name__ == "__main__":
    main()
