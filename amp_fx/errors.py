"""amp_fx's exception type."""

__all__ = ["AmpFxError"]


class AmpFxError(RuntimeError):
    """An op or input that amp_fx refuses; the message names the op and what to do instead."""
