"""PyTorch Lightning with amp_fx as the precision plugin (``pip install amp_fx[lightning]``).

    python examples/lightning_plugin.py

Trains a small LightningModule 5 steps in fp16 with ``AmpFxPrecision`` (the module compiled by
amp_fx, loss scaling by amp_fx.GradScaler) and with Lightning's own ``MixedPrecision("16-mixed")``,
and prints whether the parameters match bit for bit.
"""

from __future__ import annotations

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.plugins.precision import MixedPrecision

from amp_fx.lightning import AmpFxPrecision


class Regressor(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self(x).float(), y)  # call self(...): amp_fx compiles the module's forward

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def fit(plugin: object) -> Regressor:
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(40, 16, generator=g), torch.randn(40, 1, generator=g))
    model = Regressor()
    pl.Trainer(
        accelerator="cpu",
        max_steps=5,
        plugins=[plugin],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        gradient_clip_val=1.0,
    ).fit(model, torch.utils.data.DataLoader(data, batch_size=8))
    return model


if __name__ == "__main__":
    ours = fit(AmpFxPrecision(dtype="fp16", backend="aot_eager"))
    # Lightning turns precision="16-mixed" into bf16 on a CPU; its fp16 plugin given directly runs fp16
    theirs = fit(MixedPrecision("16-mixed", "cpu"))
    same = all(torch.equal(a, b) for a, b in zip(ours.parameters(), theirs.parameters()))
    print(f"AmpFxPrecision(fp16) vs MixedPrecision('16-mixed'): parameters bitwise equal after 5 steps: {same}")
