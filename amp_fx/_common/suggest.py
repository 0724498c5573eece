"""One did-you-mean for every name a user types: module paths (``Policy(keep_fp32=...)``,
``keep_out_of_fp8``), keyword arguments, command-line targets."""

from __future__ import annotations

import difflib
from collections.abc import Iterable

__all__ = ["did_you_mean"]


def did_you_mean(name: str, known: Iterable[str], *, n: int = 3) -> str:
    """``" (did you mean 'lm_head'?)"``, or ``""`` where nothing known is close to ``name``.

    Close is difflib's ratio of at least 0.6 on the whole name (a typo: ``lm_haed``); failing that,
    a known dotted path that ends with ``name``'s last part (a path given from the wrong root:
    ``head`` for ``model.head``).

    >>> did_you_mean("lm_haed", ["lm_head", "model", "model.embed_tokens"])
    " (did you mean 'lm_head'?)"
    """
    choices = sorted(set(known))
    close = difflib.get_close_matches(name, choices, n=n)
    if not close:
        leaf = name.rsplit(".", 1)[-1]
        close = [k for k in choices if k.rsplit(".", 1)[-1] == leaf][:n]
    if not close:
        return ""
    return f" (did you mean {' or '.join(repr(c) for c in close)}?)"
