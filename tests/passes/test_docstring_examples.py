"""The passes' docstring examples run and give what they show."""

import doctest

import pytest

import amp_fx._common.op_names
import amp_fx.fp8
import amp_fx.kernels.fp8_matmul
import amp_fx.kernels.fp8_padding
import amp_fx.kernels.fp8_recipes
import amp_fx.kernels.nvfp4
import amp_fx.low_precision
import amp_fx.options
import amp_fx.passes.fold_casts
import amp_fx.passes.fp8_matmuls
import amp_fx.passes.fx_edit
import amp_fx.passes.insert_casts
import amp_fx.passes.lift_weight_casts


@pytest.mark.parametrize(
    "module",
    [
        amp_fx.passes.insert_casts,
        amp_fx.passes.fold_casts,
        amp_fx.passes.lift_weight_casts,
        amp_fx.options,
        amp_fx.passes.fp8_matmuls,
        amp_fx.kernels.fp8_matmul,
        amp_fx.fp8,
        amp_fx.low_precision,
        amp_fx.kernels.fp8_recipes,
        amp_fx.kernels.fp8_padding,
        amp_fx.kernels.nvfp4,
        amp_fx.passes.fx_edit,
        amp_fx._common.op_names,
    ],
    ids=lambda m: m.__name__,
)
def test_docstring_examples(module):
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0
