"""What differs between amp_fx and eager autocast where the GPU tier has a strict xfail: cnn_bn in
fp16 (conv1's weight gradient, about one fp16 ulp in 152 of 216 elements on an H200, torch 2.11,
cuDNN deterministic or not). A diagnosis, not a test: ``bash .ci/gpu OUT diagnose`` runs it.

    python -m tests.cuda.diagnose [--device cuda] [--model cnn_bn] [--dtype fp16]

Prints, per tensor of the step (output, loss, every gradient, every buffer), how many elements
differ in their bits: eager against eager (is the reference itself deterministic?), amp_fx against
eager, and both again with cuDNN off; then the ATen ops each side ran that the other did not
(the profiler's names, with their input dtypes where it records them).
"""

from __future__ import annotations

import argparse
from collections import Counter
from collections.abc import Callable

import torch
from torch.profiler import ProfilerActivity, profile

import amp_fx
from amp_fx.testing.zoo import ZOO, StepResult, eager_autocast_step, step

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _tensors(r: StepResult) -> dict[str, torch.Tensor]:
    out = {"out": r.out, "loss": r.loss}
    out.update({f"grad {k}": v for k, v in r.grads.items() if v is not None})
    out.update({f"buffer {k}": v for k, v in r.buffers.items()})
    return out


def _differing(a: StepResult, b: StepResult) -> dict[str, str]:
    out = {}
    for name, x in _tensors(a).items():
        y = _tensors(b)[name]
        if x.dtype != y.dtype or x.shape != y.shape:
            out[name] = f"dtype/shape {x.dtype}{tuple(x.shape)} vs {y.dtype}{tuple(y.shape)}"
            continue
        xb, yb = (t.detach().reshape(-1).contiguous().view(torch.uint8).reshape(t.numel(), -1) for t in (x, y))
        n = int((xb != yb).any(dim=1).sum())
        if n:
            rel = ((x.double() - y.double()).abs().max() / y.double().abs().max().clamp_min(1e-30)).item()
            out[name] = f"{n} of {x.numel()} elements (max |diff| / max |ref| {rel:.2e})"
    return out


def _ops(fn: Callable[[], object]) -> Counter[str]:
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        fn()
    names: Counter[str] = Counter()
    for e in prof.events():
        if e.name.startswith("aten::"):
            types = getattr(e, "input_types", None) or ""
            names[f"{e.name}{tuple(types) if types else ''}"] += 1
    return names


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--model", default="cnn_bn")
    parser.add_argument("--dtype", default="fp16", choices=list(_DTYPES))
    args = parser.parse_args()
    dtype, entry = _DTYPES[args.dtype], ZOO[args.model]

    def build() -> tuple[torch.nn.Module, tuple[torch.Tensor, ...], Callable[..., torch.Tensor]]:
        model, inputs, loss_fn = entry.build()
        return model.to(args.device), tuple(t.to(args.device) for t in inputs), loss_fn

    def eager() -> StepResult:
        model, inputs, loss_fn = build()
        return eager_autocast_step(model, inputs, loss_fn, dtype, device_type=args.device)

    def compiled() -> StepResult:
        torch._dynamo.reset()
        model, inputs, loss_fn = build()
        run = amp_fx.compile(model, dtype=dtype, backend="aot_eager", strict=False)
        with torch._dynamo.config.patch(dict(entry.dynamo_config)):
            return step(run, model, inputs, loss_fn)

    where = f", {torch.cuda.get_device_name()}, cuDNN {torch.backends.cudnn.version()}" if args.device == "cuda" else ""
    print(f"{args.model}, {args.dtype}, {args.device}, torch {torch.__version__}{where}")
    for cudnn in (True, False):
        with torch.backends.cudnn.flags(
            enabled=cudnn, benchmark=False, deterministic=True, allow_tf32=torch.backends.cudnn.allow_tf32
        ):
            reference = eager()
            print(f"cuDNN {'on (deterministic)' if cudnn else 'off'}:")
            print(f"  eager against eager: {_differing(eager(), reference) or 'bitwise'}")
            print(f"  amp_fx against eager: {_differing(compiled(), reference) or 'bitwise'}")
    model, inputs, loss_fn = build()
    eager_ops = _ops(lambda: eager_autocast_step(model, inputs, loss_fn, dtype, device_type=args.device))
    torch._dynamo.reset()
    model, inputs, loss_fn = build()
    run = amp_fx.compile(model, dtype=dtype, backend="aot_eager", strict=False)
    with torch._dynamo.config.patch(dict(entry.dynamo_config)):
        step(run, model, inputs, loss_fn)  # compiled outside the profile: it sees the run, not the compile
        amp_ops = _ops(lambda: step(run, model, inputs, loss_fn))
    print("ATen ops eager ran and amp_fx did not (count):")
    for name, n in sorted((eager_ops - amp_ops).items()):
        print(f"  {n} x {name}")
    print("ATen ops amp_fx ran and eager did not (count):")
    for name, n in sorted((amp_ops - eager_ops).items()):
        print(f"  {n} x {name}")


if __name__ == "__main__":
    main()
