"""torch.compile(model, backend="amp_fx"): amp_fx by name, for code that takes only a backend name.

    python examples/torch_compile_backend.py

Needs amp_fx installed (``pip install -e .``): torch finds the names "amp_fx", "amp_fx_bf16" and
"amp_fx_fp16" through amp_fx's ``torch_dynamo_backends`` entry points. Prints the output dtype and
whether one training step matches eager ``torch.autocast`` bit for bit.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.LayerNorm(64), nn.Linear(64, 8))
x = torch.randn(16, 32)
reference = copy.deepcopy(model)

# "amp_fx" takes its dtype from options= (or from an ambient torch.autocast; bf16 otherwise);
# "backend" is the downstream backend ("inductor" by default; aot_eager is bitwise with eager autocast)
compiled = torch.compile(model, backend="amp_fx", options={"dtype": "bf16", "backend": "aot_eager"})
out = compiled(x)
out.float().square().mean().backward()

with torch.autocast("cpu", dtype=torch.bfloat16):
    expected = reference(x)
expected.float().square().mean().backward()

same = torch.equal(out, expected) and all(
    torch.equal(a.grad, b.grad) for a, b in zip(model.parameters(), reference.parameters())
)
print(f"output dtype: {out.dtype}; bitwise equal to eager torch.autocast (output and gradients): {same}")
