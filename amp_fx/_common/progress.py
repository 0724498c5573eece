"""Progress lines for long work: one INFO record when a call starts compiling, one per compiled
graph (forward and backward), shown by default.

A first call that compiles can take tens of seconds; the ``amp_fx.progress`` logger says, as the
call starts, that it compiles, then which model's graph was compiled, how long that took and how
long since the call (:class:`CompileClock`), one line per graph; the backward graph that
AOTAutograd compiles at the first backward is announced when it starts and when it is done. Like Lightning's
``lightning.pytorch`` logger, it is at INFO and prints to stderr by default; once the application
configures logging (a handler on the root logger: ``logging.basicConfig``, pytest), its handlers
print the records instead, so nothing is printed twice. To silence it:

    logging.getLogger("amp_fx.progress").setLevel(logging.WARNING)
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

__all__ = ["PROGRESS_LOGGER", "CompileClock", "progress_log", "timed"]

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
def timed(what: str | Callable[[], str], *, since: float | None = None, starting: str | None = None) -> Iterator[None]:
    """Log ``"{what} in {seconds} s"`` at INFO when the block finishes (not when it raises: the
    error says what happened), with ``", {seconds} s since the call"`` where ``since`` (a
    ``time.perf_counter()`` of the user's call) is given; ``starting``: a line logged as it starts.
    ``what`` may be a callable, called when the block is done (a count known only then)."""
    if not progress_log.isEnabledFor(logging.INFO):
        yield
        return
    if starting is not None:
        progress_log.info("%s", starting)
    start = time.perf_counter()
    yield
    end = time.perf_counter()
    if callable(what):
        what = what()
    if since is None:
        progress_log.info("%s in %.1f s", what, end - start)
    else:
        progress_log.info("%s in %.1f s, %.1f s since the call", what, end - start, end - since)


class CompileClock:
    """The user's call that compiles, shared by a compiled model's backends (a copy shares it).

    :meth:`start` announces the compile as the call begins (before Dynamo traces, which takes
    seconds on a large model) and starts the clock; the graphs compiled until :meth:`stop` (the
    call's return) are that call's (:attr:`graphs`), and so are their backward graphs, compiled
    at their first backward: :meth:`since` gives the call's start for those only, so a graph
    recompiled much later is not timed from a call long gone."""

    def __init__(self) -> None:
        self.started: float | None = None
        self.open = False
        self.graphs: set[int] = set()

    def start(self, line: str) -> None:
        """Announce ``line`` and time what the call compiles from now."""
        progress_log.info("%s", line)
        self.started, self.open, self.graphs = time.perf_counter(), True, set()

    def stop(self) -> None:
        self.open = False

    def compiling(self, index: int) -> float | None:
        """Graph ``index`` is being compiled: the start of the call compiling it, None if no call is open."""
        if not self.open:
            return None
        self.graphs.add(index)
        return self.started

    def since(self, index: int) -> float | None:
        """The start of the call that compiled graph ``index`` (for its backward), else None."""
        return self.started if index in self.graphs else None
