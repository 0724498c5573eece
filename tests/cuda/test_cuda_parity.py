"""amp_fx.compile on CUDA against eager ``torch.autocast("cuda")``, on the tests' model zoo.

The CUDA twin of tests/test_compile_parity.py, with its helpers and its derived tolerance:
``aot_eager`` must be bitwise (outputs, loss, every ``.grad``, buffers) for bf16 and fp16;
``inductor`` within the excess-precision tolerance derived there (1 eps of the output's
magnitude, 4 eps of each gradient's).
"""

from __future__ import annotations

import copy
from collections.abc import Iterator

import pytest
import torch
import torch._dynamo
from _gpu import GPU_TIER
from test_compile_parity import (
    _GRAD_EPS,
    _INDUCTOR_MODELS,
    _OUT_EPS,
    DTYPES,
    _assert_every_graph_rewritten,
    _dynamo_config,
    _msg,
    _zoo_params,
)
from torch import Tensor, nn

import amp_fx
from amp_fx.testing import assert_bitwise
from amp_fx.testing.zoo import ZOO, LossFn, StepResult, _collect, step

pytestmark = GPU_TIER


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> Iterator[None]:
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _on_cuda(model: nn.Module, inputs: tuple[Tensor, ...]) -> tuple[nn.Module, tuple[Tensor, ...]]:
    return model.cuda(), tuple(t.cuda() for t in inputs)


def _eager_cuda_step(model: nn.Module, inputs: tuple[Tensor, ...], loss_fn: LossFn,
                     dtype: torch.dtype) -> StepResult:
    """amp_fx.testing.zoo.eager_autocast_step with ``torch.autocast("cuda")``."""
    with torch.autocast("cuda", dtype=dtype):
        out = model(*inputs)
        loss = loss_fn(out)
    loss.backward()
    return _collect(model, out, loss)


def _cuda_pair(name: str, dtype: torch.dtype, backend: str
               ) -> tuple[StepResult, StepResult, amp_fx.AmpCompiledModule]:
    entry = ZOO[name]
    model, inputs, loss_fn = entry.build()
    model, inputs = _on_cuda(model, inputs)
    reference = copy.deepcopy(model)
    expected = _eager_cuda_step(reference, inputs, loss_fn, dtype)
    compiled = amp_fx.compile(model, dtype=dtype, backend=backend)
    with _dynamo_config(entry):
        actual = step(compiled, model, inputs, loss_fn)
    return actual, expected, compiled


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("name", _zoo_params())
def test_cuda_aot_eager_bitwise(name: str, dtype: torch.dtype) -> None:
    actual, expected, compiled = _cuda_pair(name, dtype, "aot_eager")
    _assert_every_graph_rewritten(compiled)
    assert all(r.device_type == "cuda" for r in compiled.amp_fx_records)
    assert_bitwise(actual, expected, "amp_fx vs eager autocast on CUDA")


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("name", _INDUCTOR_MODELS)
def test_cuda_inductor_within_excess_precision_tolerance(name: str, dtype: torch.dtype) -> None:
    actual, expected, compiled = _cuda_pair(name, dtype, "inductor")
    _assert_every_graph_rewritten(compiled)
    eps = torch.finfo(dtype).eps
    assert actual.out.dtype == expected.out.dtype
    torch.testing.assert_close(actual.out, expected.out, rtol=0,
                               atol=_OUT_EPS * eps * expected.out.float().abs().max().item())
    for n, g in expected.grads.items():
        atol = _GRAD_EPS * eps * g.abs().max().item()
        torch.testing.assert_close(actual.grads[n], g, rtol=0, atol=atol, msg=_msg(f"{n}.grad"))
