"""Helpers for amp_fx's tests and benchmarks: references, a host-sync counter, a model zoo.

Not part of the training API: nothing in ``amp_fx`` imports this package, and its names may
change between releases. It lives in the package (as ``torchao.testing`` does) so that the tests
and the benchmarks build the same models and compare against the same references without
``sys.path`` edits.

* ``asserts``: :func:`assert_bitwise`, the one bit-for-bit comparison.
* ``step_reference``: :func:`eager_amp_step` (torch's AMP recipe, what ``compile_step`` must
  reproduce) and :class:`HostSyncCounter` (host reads of tensor values, seen at the dispatcher).
* ``unscale_reference``: torch baselines for the unscale kernels.
* ``zoo``: tiny seeded models with an autocast-neutral loss, and one eager-autocast step on them.
* ``real_models``: real models from transformers, torchvision, timm and diffusers (random init,
  small configs) for the real-model tier (tests/models), and one eager-autocast step on them.
* ``distributed``: :func:`run_ranks`, gloo ranks on 127.0.0.1 for the DDP/FSDP2 tests and bench.
* ``generate``: tiny Hugging Face causal LMs and the greedy ``generate`` call (needs transformers).
* ``bench``: what every benchmark prints and computes (machine and versions, percentiles).
"""

from amp_fx.testing.asserts import assert_bitwise
from amp_fx.testing.step_reference import HOST_READ_OPS, HostSyncCounter, eager_amp_step

__all__ = ["HOST_READ_OPS", "HostSyncCounter", "assert_bitwise", "eager_amp_step"]
