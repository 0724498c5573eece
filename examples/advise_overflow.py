"""A small model whose `up` Linear overflows fp16 (its output reaches ~1e5), for amp_fx.advise.

amp-fx advise examples/advise_overflow.py:build --loss loss_fn
"""

from amp_fx.testing.hazards import build as _build


def build():
    model, inputs, _ = _build("linear_overflow")
    return model, inputs


def loss_fn(out):
    return out.float().pow(2).mean()
