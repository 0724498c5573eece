"""amp_fx.lightning.AmpFxPrecision against Lightning's own MixedPrecision plugin, bit for bit
(parameters after 5 steps with gradient clipping, and the scaler's state), on aot_eager.

Lightning turns ``precision="16-mixed"`` into bf16 on a CPU, so the fp16 reference is its
``MixedPrecision("16-mixed", "cpu")`` plugin given directly (its code, torch.amp.GradScaler("cpu")).
"""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.nn.functional as F

pl = pytest.importorskip("lightning.pytorch", reason="amp_fx.lightning needs lightning (pip install amp_fx[lightning])")

from lightning.pytorch.plugins.precision import MixedPrecision  # noqa: E402

import amp_fx  # noqa: E402
from amp_fx.lightning import AmpFxPrecision  # noqa: E402
from amp_fx.testing import assert_bitwise  # noqa: E402

STEPS = 5


class _Net(pl.LightningModule):
    """Two linears; ``reuse`` runs them twice (each weight feeds two low-precision matmuls)."""

    def __init__(self, *, reuse: bool = False, call_forward: bool = True) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = torch.nn.Linear(16, 32)
        self.fc2 = torch.nn.Linear(32, 16)
        self.reuse = reuse
        self.call_forward = call_forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc2(F.gelu(self.fc1(x)))
        return self.fc2(F.gelu(self.fc1(h))) if self.reuse else h

    def training_step(self, batch, batch_idx):
        x, y = batch
        out = self(x) if self.call_forward else self.fc2(F.gelu(self.fc1(x)))
        return F.mse_loss(out.float(), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def _data() -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(1)
    ds = torch.utils.data.TensorDataset(torch.randn(20, 16, generator=g), torch.randn(20, 16, generator=g))
    return torch.utils.data.DataLoader(ds, batch_size=4)


def _fit(model: pl.LightningModule, **trainer_kwargs) -> tuple[dict[str, torch.Tensor], pl.Trainer]:
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        gradient_clip_val=1.0,
        **trainer_kwargs,
    )
    trainer.fit(model, _data())
    return {n: p.detach().clone() for n, p in model.named_parameters()}, trainer


def _scaler_state(trainer: pl.Trainer) -> dict[str, object]:
    return {k: v for k, v in trainer.precision_plugin.scaler.state_dict().items() if k != "amp_fx"}


@pytest.mark.parametrize("init_scale", [2.0**16, 2.0**40], ids=["default", "overflowing"])
def test_fp16_bitwise_with_lightning_16_mixed(init_scale):
    """2**40 overflows fp16 at once: steps are skipped and the scale backs off, in both."""
    ref, theirs = _fit(_Net(), plugins=[MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu", init_scale))])
    plugin = AmpFxPrecision(dtype="fp16", backend="aot_eager", scaler=amp_fx.GradScaler("cpu", init_scale=init_scale))
    got, ours = _fit(_Net(), plugins=[plugin])
    assert_bitwise(got, ref)
    assert _scaler_state(ours) == _scaler_state(theirs)
    assert (_scaler_state(theirs)["scale"] < init_scale) == (init_scale > 2.0**16)
    assert amp_fx.records(ours.lightning_module), "amp_fx compiled nothing"


def test_fp16_default_scaler_is_amp_fx():
    assert type(AmpFxPrecision(dtype="fp16").scaler) is amp_fx.GradScaler
    assert AmpFxPrecision(dtype="bf16").scaler is None


def test_bf16_bitwise_with_lightning_bf16_mixed():
    ref, _ = _fit(_Net(), precision="bf16-mixed")
    got, _ = _fit(_Net(), plugins=[AmpFxPrecision(dtype="bf16", backend="aot_eager")])
    assert_bitwise(got, ref)


def test_weight_used_twice_needs_cast_cache_off_to_match_lightning():
    """Lightning's autocast has cache_enabled=False (one cast per use): Policy(cast_cache=False) is
    bitwise with it; amp_fx's default (one shared cast, as eager torch.autocast) is not."""
    ref, _ = _fit(_Net(reuse=True), plugins=[MixedPrecision("16-mixed", "cpu")])
    matched, _ = _fit(
        _Net(reuse=True),
        plugins=[AmpFxPrecision(dtype="fp16", backend="aot_eager", policy=amp_fx.Policy(cast_cache=False))],
    )
    assert_bitwise(matched, ref)
    shared, _ = _fit(_Net(reuse=True), plugins=[AmpFxPrecision(dtype="fp16", backend="aot_eager")])
    assert not torch.equal(shared["fc1.weight"], ref["fc1.weight"])


def test_checkpoint_keys_and_scaler_state():
    model = _Net()
    _, trainer = _fit(model, plugins=[AmpFxPrecision(dtype="fp16", backend="aot_eager")])
    with tempfile.TemporaryDirectory() as out:
        path = os.path.join(out, "last.ckpt")
        trainer.save_checkpoint(path)
        ckpt = torch.load(path, weights_only=False)
    assert sorted(ckpt["state_dict"]) == sorted(_Net().state_dict())
    assert_bitwise(ckpt["state_dict"], dict(model.state_dict()))
    saved = ckpt["AmpFxPrecision"]
    assert saved == trainer.precision_plugin.scaler.state_dict()
    fresh = AmpFxPrecision(dtype="fp16")
    fresh.load_state_dict(saved)
    assert fresh.scaler.state_dict() == saved


def test_training_step_that_skips_forward_is_reported():
    with pytest.raises(amp_fx.AmpFxError, match=r"training_step ran without calling the module's forward"):
        _fit(_Net(call_forward=False), plugins=[AmpFxPrecision(dtype="bf16", backend="aot_eager")])
