"""amp_fx's exception and warning types."""

__all__ = ["AmpFxError", "AmpFxWarning"]


class AmpFxError(RuntimeError):
    """An op or input that amp_fx refuses; the message names the op and what to do instead."""


class AmpFxWarning(UserWarning):
    """amp_fx did less than it was asked (ignored a policy entry, captured no graph, fell back).

    Each is emitted once per thing it names; with ``strict=True`` (or ``AMP_FX_STRICT=1`` in the
    environment) it is raised as :class:`AmpFxError` instead.
    """
