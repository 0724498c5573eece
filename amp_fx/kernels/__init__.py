"""Fused kernels for the training step: gradient unscale + inf/NaN check (+ norm).

``unscale`` holds the public functions and the ``torch.ops.amp_fx`` custom ops and picks a
backend per device: ``triton_unscale`` (the Triton kernel and its launcher) or
``cpu_unscale`` (torch's CPU kernels, cache-blocked). ``fallback`` routes dtypes the fused
kernel does not take (and everything, if it cannot be imported) to torch's kernel; it is what
``GradScaler`` calls. ``scale_update`` is the loss-scale update as a device op. The torch
baselines that the tests and the benchmark compare against are in
``amp_fx.testing.unscale_reference``.
"""

from amp_fx.kernels.unscale import unscale_check_, unscale_check_norm_

__all__ = ["unscale_check_", "unscale_check_norm_"]
