"""amp_fx.compile against eager autocast on one zoo model, on any device: what
tests/backend/test_compile_parity.py and the GPU tier's tests/cuda/test_cuda_parity.py share.

:func:`run_pair` builds one seeded model, deep-copies it before compiling, and runs the copy under
eager ``torch.autocast(device, dtype)``: the reference is computed, never stored.
:func:`assert_within_excess_precision` is inductor's tolerance, derived below.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager

import pytest
import torch
import torch._dynamo
from torch import Tensor, nn

import amp_fx
from amp_fx.testing.zoo import ZOO, LossFn, StepResult, ZooEntry, eager_autocast_step, step

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def dynamo_config(entry: ZooEntry) -> AbstractContextManager[None]:
    return torch._dynamo.config.patch(dict(entry.dynamo_config))


def _eager_reference(
    model: nn.Module, inputs: tuple[Tensor, ...], loss_fn: LossFn, dtype: torch.dtype, device: str
) -> StepResult:
    try:
        return eager_autocast_step(model, inputs, loss_fn, dtype, device_type=device)
    except RuntimeError as e:  # e.g. oneDNN has no fp16 LSTM primitive on this CPU
        pytest.skip(f"eager autocast itself fails for {dtype}, so there is no reference: {e}")


def _on(device: str, model: nn.Module, inputs: tuple[Tensor, ...]) -> tuple[nn.Module, tuple[Tensor, ...]]:
    return model.to(device), tuple(t.to(device) for t in inputs)


def _skip_if_backend_fails_without_amp_fx(entry: ZooEntry, backend: str, err: Exception, device: str) -> None:
    """When amp_fx's run raised, check whether plain fp32 torch.compile fails the same way."""
    torch._dynamo.reset()
    model, inputs, loss_fn = entry.build()
    model, inputs = _on(device, model, inputs)
    try:
        with dynamo_config(entry):
            loss_fn(torch.compile(model, backend=backend)(*inputs)).backward()
    except Exception as plain:  # noqa: BLE001 (any failure of the baseline means: not amp_fx)
        pytest.skip(
            f"torch.compile(backend={backend!r}) fails on {entry.name} in fp32 without "
            f"amp_fx too ({type(plain).__name__}: {str(plain)[:120]}); amp_fx raised "
            f"{type(err).__name__}"
        )


@contextlib.contextmanager
def reports_splits(entry: ZooEntry) -> Iterator[None]:
    """Inside: amp_fx reports each of ``entry.split_params`` once (an AmpFxWarning naming it),
    and nothing when the entry has none (the suite runs strict: a report would raise)."""
    if not entry.split_params:
        yield
        return
    with pytest.warns(amp_fx.AmpFxWarning, match="both sides of a graph break") as said:
        yield
    named = [str(w.message).split()[1] for w in said if "both sides of a graph break" in str(w.message)]
    assert sorted(named) == sorted(entry.split_params)


def run_pair(
    entry: ZooEntry,
    dtype: torch.dtype,
    *,
    device: str = "cpu",
    reference: Callable[[], AbstractContextManager[object]] = contextlib.nullcontext,
    **compile_kwargs: object,
) -> tuple[StepResult, StepResult, amp_fx.AmpCompiledModule]:
    """(amp_fx result, eager autocast result, compiled module) from identical model copies on
    ``device``; ``reference``: a context the eager reference runs inside."""
    model, inputs, loss_fn = entry.build()
    model, inputs = _on(device, model, inputs)
    reference_model = copy.deepcopy(model)
    with reference():
        expected = _eager_reference(reference_model, inputs, loss_fn, dtype, device)
    if entry.split_params:
        compile_kwargs = {"strict": False, **compile_kwargs}  # the report is under test
    compiled = amp_fx.compile(model, dtype=dtype, **compile_kwargs)
    try:
        with dynamo_config(entry), reports_splits(entry):
            actual = step(compiled, model, inputs, loss_fn)
    except Exception as e:
        _skip_if_backend_fails_without_amp_fx(entry, str(compile_kwargs.get("backend")), e, device)
        raise
    return actual, expected, compiled


def msg(what: str) -> Callable[[str], str]:
    return lambda m: f"{what} differs from eager autocast:\n{m}"


def assert_every_graph_rewritten(compiled: amp_fx.AmpCompiledModule) -> None:
    records = compiled.amp_fx_records
    assert records, "Dynamo captured no graph: the test would compare eager with eager"
    for r in records:
        assert r.inserted.casts_inserted > 0 and r.casts > 0, f"graph {r.index} got no casts:\n{r}"


SHARED_ACROSS_BREAK = pytest.mark.xfail(
    strict=True,
    raises=AssertionError,
    reason="fc is used on both sides of the graph break: eager autocast's cast cache shares one "
    "bf16/fp16 copy of fc.weight for the whole autocast region, so the two uses' gradients "
    "add up in the low dtype before one cast back to fp32; amp_fx casts once per graph, so "
    "they are cast back separately and add up in fp32 (reported to the amp_fx owner). "
    "weight_cache=True makes it bitwise: tests/backend/test_weight_cache.py",
)


def zoo_params(exclude: tuple[str, ...] = ()) -> list[object]:
    """Every zoo model as a test parameter; the one whose weight a graph break splits is a
    strict xfail of the bitwise tests."""
    out = []
    for name in ZOO:
        if name in exclude:
            continue
        marks = [SHARED_ACROSS_BREAK] if name == "graph_break" else []
        out.append(pytest.param(name, marks=marks, id=name))
    return out


# --- inductor: a derived tolerance ------------------------------------------------------------
#
# Eager autocast rounds every op's output to the low dtype (relative error <= u = eps/2).
# Inductor fuses the pointwise ops between two matmuls and keeps the fused intermediates in
# fp32, so it skips those roundings; to first order each skipped rounding moves a value by at
# most u relative to the tensor's magnitude, and the skipped errors add along a chain.
#   * outputs: the longest fused pointwise chain feeding a rounded output in these models has
#     two low-precision ops (e.g. silu then mul, or gelu then add), so |Δ| <= 2u = 1 eps of the
#     output's max magnitude;
#   * gradients: the backward re-walks the forward chain (<= 2u in the saved activations) and its
#     own fused pointwise chain (<= 2u in the incoming gradient); the weight-gradient matmul
#     multiplies both, so |Δ| <= 4u + 4u = 4 eps of the gradient's max magnitude.
# Measured on this CPU (bf16 / fp16): outputs 0.63 / 0.31 eps (rmsnorm), 0 (mlp); gradients
# 1.51 / 0.97 eps (rmsnorm), 0.26 / 0.36 eps (mlp).
OUT_EPS = 1.0
GRAD_EPS = 4.0
INDUCTOR_MODELS = ["mlp", "rmsnorm"]


def assert_within_excess_precision(actual: StepResult, expected: StepResult, dtype: torch.dtype) -> None:
    """Inductor against eager autocast: the output within :data:`OUT_EPS`, each gradient within
    :data:`GRAD_EPS` eps of its largest magnitude (derivation above)."""
    eps = torch.finfo(dtype).eps
    assert actual.out.dtype == expected.out.dtype
    torch.testing.assert_close(
        actual.out, expected.out, rtol=0, atol=OUT_EPS * eps * expected.out.float().abs().max().item()
    )
    for n, g in expected.grads.items():
        atol = GRAD_EPS * eps * g.abs().max().item()
        torch.testing.assert_close(actual.grads[n], g, rtol=0, atol=atol, msg=msg(f"{n}.grad"))


# --- RNNs where eager runs cuDNN ----------------------------------------------------------------

RNN_MODELS = ("lstm", "gru")


@contextlib.contextmanager
def eager_rnns_as_cells() -> Iterator[None]:
    """Inside: ``nn.LSTM``/``nn.GRU`` run torch's Python decomposition of their op (the cells as
    linears and pointwise ops) under eager autocast, instead of the C++ kernel (cuDNN on CUDA).

    What amp_fx captures where eager would take cuDNN's path (``amp_fx.passes.capture.
    _rnn_without_cudnn``), run eagerly: the bitwise reference for that capture. Unpacked
    sequences only (the ``.input`` overloads, the zoo's)."""
    from torch.nn.modules import rnn

    class _Cells:
        def __getattr__(self, name: str) -> object:
            return getattr(torch._VF, name)

        @staticmethod
        def lstm(*args: object) -> object:
            return torch.ops.aten.lstm.input.decompose(*args)

        @staticmethod
        def gru(*args: object) -> object:
            return torch.ops.aten.gru.input.decompose(*args)

    before = rnn._VF
    rnn._VF = _Cells()  # type: ignore[assignment]
    try:
        yield
    finally:
        rnn._VF = before


def run_rnn_as_cells(
    name: str, dtype: torch.dtype, device: str, backend: str
) -> tuple[StepResult, StepResult, list[str]]:
    """amp_fx (not strict: it reports the cells) and the eager reference of
    :func:`eager_rnns_as_cells` on zoo model ``name``; with the AmpFxWarnings amp_fx gave."""
    with pytest.warns(amp_fx.AmpFxWarning) as said:
        actual, expected, compiled = run_pair(
            ZOO[name], dtype, device=device, reference=eager_rnns_as_cells, backend=backend, strict=False
        )
    assert_every_graph_rewritten(compiled)
    return actual, expected, [str(w.message) for w in said if issubclass(w.category, amp_fx.AmpFxWarning)]
