"""The passes' docstring examples run and give what they show."""

import doctest

import pytest

import amp_fx.options
import amp_fx.passes.fold_casts
import amp_fx.passes.insert_casts
import amp_fx.passes.lift_weight_casts


@pytest.mark.parametrize("module", [amp_fx.passes.insert_casts, amp_fx.passes.fold_casts,
                                    amp_fx.passes.lift_weight_casts, amp_fx.options],
                         ids=lambda m: m.__name__)
def test_docstring_examples(module):
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0
