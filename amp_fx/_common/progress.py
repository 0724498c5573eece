"""Progress lines for long work: one INFO record per compiled graph, shown by default.

A first call that compiles can take tens of seconds; the ``amp_fx.progress`` logger says which
model's graph was compiled and how long it took, one line per graph. Like Lightning's
``lightning.pytorch`` logger, it is at INFO and prints to stderr by default; once the application
configures logging (a handler on the root logger: ``logging.basicConfig``, pytest), its handlers
print the records instead, so nothing is printed twice. To silence it:

    logging.getLogger("amp_fx.progress").setLevel(logging.WARNING)
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["PROGRESS_LOGGER", "progress_log", "timed"]

PROGRESS_LOGGER = "amp_fx.progress"
progress_log = logging.getLogger(PROGRESS_LOGGER)


class _UnlessConfigured(logging.StreamHandler):
    """stderr, as it is at each record (pytest's capsys swaps it), unless the root logger has a
    handler: then the record propagates there, and printing it here too would print it twice."""

    def emit(self, record: logging.LogRecord) -> None:
        if logging.getLogger().handlers:
            return
        self.stream = sys.stderr
        super().emit(record)


if progress_log.level == logging.NOTSET:  # a level the application set before importing amp_fx wins
    progress_log.setLevel(logging.INFO)
if not any(isinstance(h, _UnlessConfigured) for h in progress_log.handlers):
    _handler = _UnlessConfigured()
    _handler.setFormatter(logging.Formatter("%(message)s"))
    progress_log.addHandler(_handler)


@contextmanager
def timed(what: str) -> Iterator[None]:
    """Log ``"{what} in {seconds} s"`` at INFO when the block finishes (not when it raises: the
    error says what happened)."""
    if not progress_log.isEnabledFor(logging.INFO):
        yield
        return
    start = time.perf_counter()
    yield
    progress_log.info("%s in %.1f s", what, time.perf_counter() - start)
