"""A PyTorch Lightning precision plugin (``pip install amp_fx[lightning]``; imports lightning).

    trainer = lightning.Trainer(plugins=[amp_fx.lightning.AmpFxPrecision(dtype="fp16")], ...)

It is Lightning's ``MixedPrecision`` plugin (``precision="16-mixed"``/``"bf16-mixed"``) with two
changes: the LightningModule is compiled in place by ``amp_fx.compile`` when the strategy sets it
up (``convert_module``), and fp16 loss scaling uses :class:`amp_fx.GradScaler`. Everything else is
Lightning's own code: the ``torch.autocast`` around ``training_step`` (so the loss and any code
outside the module's forward run under eager autocast, as with ``"16-mixed"``), scaling in
``pre_backward``, unscaling before gradient clipping, skipping non-finite steps in
``optimizer_step``, and the scaler's ``state_dict`` in checkpoints.

Only the module's ``forward`` is compiled (what ``self(x)`` runs in ``training_step``); a step
that calls submodules directly runs them under eager autocast, and the plugin says so once.

Lightning's ``MixedPrecision`` opens ``torch.autocast(..., cache_enabled=False)``: every use of a
weight gets a cast of its own. amp_fx's default policy shares one cast per weight, as eager
``torch.autocast`` does by default; ``policy=amp_fx.Policy(cast_cache=False)`` matches Lightning's
choice bit for bit on models that use a weight twice (tests/integrations/test_lightning.py).
"""

from __future__ import annotations

import contextlib
from typing import Any, Literal

import torch

try:
    import lightning.pytorch as pl
    from lightning.pytorch.plugins.precision import MixedPrecision
except ImportError as e:  # pragma: no cover - exercised where lightning is missing
    raise ImportError("amp_fx.lightning needs PyTorch Lightning: pip install amp_fx[lightning]") from e

from amp_fx._common.autocast import own_autocast
from amp_fx._common.downstream import Backend
from amp_fx._common.report import Reporter
from amp_fx.api import check_compile_kwargs, compile_with, options_of, records
from amp_fx.options import Options, inductor_config
from amp_fx.policy import Policy
from amp_fx.scaler import GradScaler

__all__ = ["AmpFxPrecision"]


class AmpFxPrecision(MixedPrecision):
    """Lightning's mixed precision with the LightningModule compiled by amp_fx.

    Args:
        dtype: "bf16" or "fp16" (or the torch dtype).
        device: the autocast device type ("cpu", "cuda").
        policy, backend, fold, strict, weight_cache: as for :func:`amp_fx.compile`.
        scaler: the fp16 loss scaler; default ``amp_fx.GradScaler(device)``. Must be None for bf16.
        **torch_compile_kwargs: passed on by :func:`amp_fx.compile` to ``torch.compile``.
    """

    def __init__(
        self,
        *,
        dtype: str | torch.dtype = "bf16",
        device: str = "cpu",
        policy: Policy | None = None,
        backend: str | Backend = "inductor",
        fold: bool = True,
        strict: bool | None = None,
        weight_cache: bool = False,
        scaler: torch.amp.GradScaler | None = None,
        **torch_compile_kwargs: Any,
    ) -> None:
        check_compile_kwargs(torch_compile_kwargs)
        mode, inductor = torch_compile_kwargs.pop("mode", None), torch_compile_kwargs.pop("options", None)
        self.options = Options(
            dtype=dtype,
            policy=policy,
            backend=backend,
            fold=fold,
            strict=strict,
            weight_cache=weight_cache,
            inductor=inductor_config(backend, mode, inductor),
            torch_compile=torch_compile_kwargs,
        )
        self.policy = self.options.policy
        self.dtype = self.options.dtype
        precision: Literal["16-mixed", "bf16-mixed"] = "16-mixed" if self.dtype is torch.float16 else "bf16-mixed"
        if scaler is None and self.dtype is torch.float16:
            scaler = GradScaler(device)
        super().__init__(precision, device, scaler)
        self._reporter = Reporter(self.options.strict)
        self._module: torch.nn.Module | None = None

    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        """Compile the LightningModule in place (once; the strategy calls this at every setup)."""
        if not _compiled(module):
            compile_with(module, self.options, inplace=True)
        self._module = module
        return module

    def autocast_context_manager(self) -> contextlib.AbstractContextManager[None]:  # type: ignore[override]
        # amp_fx's dtype; a shared cast per weight only where the policy shares it in the graphs;
        # amp_fx's own (the compiled module does not note it as the user's redundant autocast)
        return own_autocast(self.device, self.dtype, cache_enabled=self.policy.cast_cache)

    def optimizer_step(  # type: ignore[override]  # Lightning's trainer plugin signature, not fabric's
        self, optimizer: Any, model: pl.LightningModule, closure: Any, **kwargs: Any
    ) -> Any:
        out = super().optimizer_step(optimizer, model=model, closure=closure, **kwargs)
        self._check_compiled_forward_ran(model)
        return out

    def _check_compiled_forward_ran(self, model: pl.LightningModule) -> None:
        if not _compiled(model) or records(model):
            return
        self._reporter.did_less(
            "lightning forward not called",
            (
                f"amp_fx.lightning.AmpFxPrecision: {type(model).__name__}.training_step ran without calling the "
                f"module's forward (self(...)), the only code amp_fx compiles: the step ran under eager "
                f"torch.autocast, nothing compiled. Call self(...) in training_step, or compile the submodules it "
                f"calls with amp_fx.compile(submodule, inplace=True) in configure_model."
            ),
        )


def _compiled(module: torch.nn.Module) -> bool:
    try:
        options_of(module)
    except TypeError:
        return False
    return True
