"""``python -m amp_fx``: the ``amp-fx`` command (see :mod:`amp_fx.cli`)."""

from __future__ import annotations

import sys

from amp_fx.cli import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
