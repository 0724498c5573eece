"""A griffe extension for the API reference: Sphinx roles in docstrings become code spans.

amp_fx's docstrings name other objects the Sphinx way (``:func:`~amp_fx.api.compile```,
``:class:`Policy```), which mkdocstrings would print as written. This shows each as the name in
code (``compile``, ``Policy``): the last component where the role's target starts with ``~``, as
Sphinx shows it. Loaded by mkdocs.yml (``extensions:``); not part of the package.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_ROLE = re.compile(r":(?:py:)?(?:func|class|meth|mod|attr|data|exc|obj|const):`(~?)([^`]+)`")


def _plain(match: re.Match[str]) -> str:
    short, target = match.groups()
    return f"`{target.rsplit('.', 1)[-1] if short else target}`"


def strip_roles(text: str) -> str:
    """``:func:`~a.b``` -> ```b```, ``:class:`a.B``` -> ```a.B```."""
    return _ROLE.sub(_plain, text)


class SphinxRoles(griffe.Extension):
    """Rewrites each loaded object's docstring (see the module docstring)."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = strip_roles(obj.docstring.value)
