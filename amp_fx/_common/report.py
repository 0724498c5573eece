"""One way to say that amp_fx did less than it was asked: warn once, or raise in strict mode.

Every place that ignores a policy entry, captures no graph, falls back to eager or cannot honour
an option calls :meth:`Reporter.did_less` with a key naming the thing, so the same thing is
reported once per owner (a compiled model, a compiled step) however often it recurs. Strict mode
(the owner's ``strict=True``, or ``AMP_FX_STRICT=1`` in the environment when the owner was
created) raises :class:`~amp_fx.errors.AmpFxError` with the same message instead.
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Hashable

import torch

from amp_fx.errors import AmpFxError, AmpFxWarning

__all__ = ["Reporter", "did_less", "resolve_strict", "strict_from_env", "STRICT_ENV", "user_stacklevel", "warn"]

# Frames that are not the user's: amp_fx's and torch's own files, and the code FX generates for a
# GraphModule (its file name is "<eval_with_key>.N").
_NOT_USERS = (
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep,
    os.path.dirname(os.path.abspath(torch.__file__)) + os.sep,
    "<eval_with_key>",
)

STRICT_ENV = "AMP_FX_STRICT"


def strict_from_env() -> bool:
    """Whether ``AMP_FX_STRICT`` asks for strict mode ("1", "true", "yes", "on")."""
    return os.environ.get(STRICT_ENV, "").strip().lower() in ("1", "true", "yes", "on")


REGIONS_ENV = "AMP_FX_REGIONS"


def regions_from_env() -> bool | None:
    """``amp_fx.compile``'s ``regions`` where the call does not give it: False (the whole graph,
    the default for now), unless ``AMP_FX_REGIONS`` says otherwise: "1" (also "true", "yes", "on")
    gives None (regions where shown safe, the default to be), "always" gives True, "0" (also
    "false", "no", "off") False. For running the suite with regions on (issue 62); a ``regions=``
    given in the call wins."""
    said = os.environ.get(REGIONS_ENV, "").strip().lower()
    if said in ("1", "true", "yes", "on"):
        return None
    if said == "always":
        return True
    if said in ("", "0", "false", "no", "off"):
        return False
    raise ValueError(f"amp_fx: {REGIONS_ENV}={said!r}: expected 1 (where shown safe), always, 0, or unset")


def resolve_strict(strict: bool | None) -> bool:
    """An explicit ``strict=`` wins; ``None`` defers to the environment."""
    if strict is None:
        return strict_from_env()
    if not isinstance(strict, bool):
        raise TypeError(f"amp_fx: strict must be True, False or None, got {strict!r}")
    return strict


def user_stacklevel() -> int:
    """The ``stacklevel`` that makes a ``warnings.warn`` in the caller point at the user's line:
    the first frame outside amp_fx and torch (the outermost frame where every one is theirs).

    The one rule for every amp_fx warning, instead of a count of frames per call site that goes
    stale when a call moves (Python 3.12's ``skip_file_prefixes`` does this; amp_fx supports 3.10)."""
    frame = sys._getframe(1)
    level = 1
    while frame.f_back is not None and os.path.abspath(frame.f_code.co_filename).startswith(_NOT_USERS):
        frame = frame.f_back
        level += 1
    return level


def warn(message: str, category: type[Warning] = AmpFxWarning) -> None:
    """``warnings.warn`` attributed to the user's line (:func:`user_stacklevel`)."""
    warnings.warn(message, category, stacklevel=user_stacklevel())


class Reporter:
    """Reports shortfalls of one owner (a compiled model or step), each key once."""

    def __init__(self, strict: bool | None = None) -> None:
        self.strict = resolve_strict(strict)
        self._seen: set[Hashable] = set()

    def did_less(self, key: Hashable, message: str, *, cause: BaseException | None = None) -> None:
        """Warn once per ``key`` with ``message`` (which names the thing and the fix); raise if
        strict (chained from ``cause``, where the shortfall has one)."""
        if self.strict:
            raise AmpFxError(f"{message} [strict mode: {STRICT_ENV}=0 or strict=False makes this a warning]") from cause
        if key in self._seen:
            return
        self._seen.add(key)
        warn(message)

    def notice(self, key: Hashable, message: str) -> None:
        """Warn once per ``key`` (a ``UserWarning``, never raised in strict mode): amp_fx does what
        was asked, and the message says something the user should know (a slow kernel)."""
        if key in self._seen:
            return
        self._seen.add(key)
        warn(message, UserWarning)

    def __getstate__(self) -> dict[str, object]:
        return {"strict": self.strict, "_seen": set()}


_GLOBAL = Reporter(strict=False)


def did_less(key: Hashable, message: str, *, strict: bool | None = None) -> None:
    """For code with no owner: warn once per key in the process; raise if ``strict`` (or the env) says so."""
    if resolve_strict(strict):
        raise AmpFxError(f"{message} [strict mode]")
    _GLOBAL.did_less(key, message)
