"""A small model whose `up` Linear reads a massive activation (one channel at 10**6, which its
weights ignore): fine in bf16, but fp8's scale spends e4m3's range on that channel and flushes the
others to zero. For amp_fx.advise with fp8:

    amp-fx advise examples/advise_fp8.py:build --loss loss_fn --dtype bf16 --fp8 tensorwise
"""

from amp_fx.testing.hazards import build as _build


def build():
    model, inputs, _ = _build("fp8_outlier")
    return model, inputs


def loss_fn(out):
    return out.float().pow(2).mean()
