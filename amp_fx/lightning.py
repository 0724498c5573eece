"""``amp_fx.lightning``: the Lightning adapter's public name (its code: ``amp_fx/integrations/lightning.py``)."""

from amp_fx.integrations.lightning import AmpFxPrecision

__all__ = ["AmpFxPrecision"]
