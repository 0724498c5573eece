"""Known differences that tests mark rather than hide, each with its reason.

None at present. The one listed before, torch 2.11's ``compile_step`` with ``torch.optim.SGD`` not
bitwise with the eager recipe, is fixed: 2.11's Dynamo traced ``param.add_(grad, alpha=-lr)`` as
``torch.mul`` then ``add_`` (two roundings where eager's kernel rounds once); compile_step now
traces SGD's step with that decomposition off there (``amp_fx._compat.dynamo_splits_number_alpha``).
"""

from __future__ import annotations

__all__: list[str] = []
