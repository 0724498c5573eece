"""Loss scaling: ``GradScaler`` and the rules it shares with ``compile_step``.

* ``rules.py``: the tensor-only loss-scale rules (inverse scale and its guard, the combination
  of found-inf flags, the scale update, the skip record), called by both.
* ``snapshot.py``: the masked step's copy of parameters and optimizer state, and the
  ``where(found_inf, old, new)`` restore, called by both.
* ``grad_scaler.py``: the ``GradScaler`` class (torch's state machine, errors and state_dict).
"""

from amp_fx.scaler.grad_scaler import GradScaler, ScalerMode, StepMode

__all__ = ["GradScaler", "ScalerMode", "StepMode"]
