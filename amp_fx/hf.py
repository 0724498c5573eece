"""``amp_fx.hf``: the Hugging Face adapter's public name (its code: ``amp_fx/integrations/hf.py``)."""

from amp_fx.integrations.hf import AmpFxTrainer, amp_fx_dtype

__all__ = ["AmpFxTrainer", "amp_fx_dtype"]
