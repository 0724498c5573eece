"""What differs between the supported torch versions (2.11 to 2.15), each found by a feature test.

Every difference amp_fx depends on is tested here, once, by what the installed torch does rather
than by its version string; each function says which versions take which branch (as measured on
2.11.0, 2.13.0 and 2.15.0; 2.12 and 2.14 lie between and are not run by CI).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, MutableMapping
from functools import cache
from typing import Any

import torch
import torch._dynamo

__all__ = ["autocast_registrations", "current_decomposition_table", "dynamo_splits_number_alpha",
           "number_alpha_as_eager"]


@cache
def autocast_registrations(dispatch_key: str) -> frozenset[str]:
    """The ops the installed torch registers a kernel for at ``dispatch_key`` ("AutocastCPU").

    Names as the dispatcher spells them (``"aten::conv2d"``, ``"aten::conv2d.padding"``). This is
    how the default op tables follow the installed torch: torch 2.11 still registers the Dimname
    overloads (``aten::softmax.Dimname`` ...) and not ``aten::rms_norm`` on CUDA, 2.15 adds
    ``aten::linalg_matrix_sqrth`` and drops ``aten::cholesky`` and ``aten::qr`` on CPU, and only
    builds with cuDNN (every standard Linux wheel, not the CPU wheel) register
    ``aten::_cudnn_rnn`` on CUDA.
    """
    return frozenset(torch._C._dispatch_get_registrations_for_dispatch_key(dispatch_key))


def current_decomposition_table() -> MutableMapping[Any, Callable[..., Any]]:
    """The decomposition table of the ``make_fx`` trace running now (the dict itself, mutable).

    2.13 and 2.15 keep it on the active proxy mode (``ProxyTorchDispatchMode.decomposition_table``);
    2.11 keeps it in the module global ``proxy_tensor.CURRENT_DECOMPOSITION_TABLE``, which
    ``make_fx`` points at the table it was given.
    """
    from torch.fx.experimental import proxy_tensor

    table = getattr(proxy_tensor.get_proxy_mode(), "decomposition_table", None)
    if table is None:
        table = proxy_tensor.CURRENT_DECOMPOSITION_TABLE
    return table


_splits_number_alpha: bool | None = None


def dynamo_splits_number_alpha() -> bool:
    """Whether Dynamo traces ``t.add_(o, alpha=a)``, ``a`` a Python number, as ``torch.mul(o, a)``
    then ``t.add_(...)``: two roundings, where eager's ``add_`` kernel rounds once (a fused
    multiply-add on CPU), so the last bit of ``t`` can differ.

    2.11 does (``TensorVariable.method_add_`` decomposes every ``alpha`` while
    ``torch._dynamo.config.enable_dynamo_decompositions``, the default); 2.13 and 2.15 keep one
    ``add_(o, alpha=a)`` node and decompose only a tensor ``alpha`` (into ``inductor_prims.fma``).
    Found by tracing ``t.add_(o, alpha=0.5)`` once (about 0.3 s, the first time it is asked).
    """
    global _splits_number_alpha
    if _splits_number_alpha is None:
        kept: list[bool] = []

        def record(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
            kept.append(any(n.kwargs.get("alpha") == 0.5 for n in gm.graph.nodes))
            return gm.forward

        def probe(t: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
            return t.add_(o, alpha=0.5)

        torch.compile(probe, backend=record, fullgraph=True)(torch.zeros(2), torch.ones(2))
        if not kept:  # Dynamo did not trace (e.g. a force_eager stance): nothing to keep, ask again later
            return False
        _splits_number_alpha = not kept[0]
    return _splits_number_alpha


@contextlib.contextmanager
def number_alpha_as_eager() -> Iterator[None]:
    """Inside, Dynamo traces ``add_(o, alpha=a)`` with a number ``a`` as eager computes it, one node.

    Where Dynamo would split it (:func:`dynamo_splits_number_alpha`), this turns off
    ``enable_dynamo_decompositions`` while tracing; that flag also decomposes a *tensor* ``alpha``
    or ``value`` (``add_``, ``addcmul_``, ``addcdiv_``), which 2.11's Dynamo cannot trace without
    it (``PendingUnbackedSymbolNotFound``, Adagrad's step-dependent lr for one). So only for
    code whose ``alpha`` and ``value`` arguments are all Python numbers.
    """
    if not dynamo_splits_number_alpha():
        yield
        return
    with torch._dynamo.config.patch(enable_dynamo_decompositions=False):
        yield


_guards_requires_grad: bool | None = None


def dynamo_guards_param_requires_grad() -> bool:
    """Whether Dynamo recompiles a module's forward when one of its parameters' ``requires_grad``
    changes (unfreezing a layer after the first compiled call).

    2.13 and 2.15 do. 2.11 does not, with plain ``torch.compile`` too: the unfrozen parameter
    keeps getting no gradient. Found by compiling a two-parameter module, unfreezing its frozen
    parameter and calling it again (about 0.3 s, the first time it is asked).
    """
    global _guards_requires_grad
    if _guards_requires_grad is None:
        graphs: list[int] = []

        def count(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
            graphs.append(1)
            return gm.forward

        probe = torch.nn.Linear(2, 1)
        probe.bias.requires_grad_(False)
        compiled = torch.compile(probe, backend=count, fullgraph=True)
        compiled(torch.ones(1, 2))
        probe.bias.requires_grad_(True)
        compiled(torch.ones(1, 2))
        if not graphs:  # Dynamo did not trace (e.g. a force_eager stance): ask again later
            return True
        _guards_requires_grad = len(graphs) == 2
    return _guards_requires_grad
