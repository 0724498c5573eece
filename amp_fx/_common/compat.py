"""What differs between the supported torch versions (2.11 to 2.15), each found by a feature test.

Every difference amp_fx depends on is tested here, once, by what the installed torch does rather
than by its version string; each function says which versions take which branch (as measured on
2.11.0, 2.13.0 and 2.15.0; 2.12 and 2.14 lie between and are not run by CI).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator, MutableMapping
from functools import cache
from typing import TYPE_CHECKING, Any

import torch
import torch._dynamo

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

__all__ = [
    "dtensor_type",
    "fsdp_param_groups",
    "autocast_registrations",
    "current_decomposition_table",
    "dynamo_decomposes_number_scalars",
    "dynamo_folds_is_exporting",
    "is_exporting_as_eager",
    "number_scalars_as_eager",
]


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
        table = proxy_tensor.CURRENT_DECOMPOSITION_TABLE  # type: ignore[attr-defined]  # torch 2.11's only
    return table


_decomposes_number_scalars: bool | None = None


def dynamo_decomposes_number_scalars() -> bool:
    """Whether Dynamo rewrites an in-place op's Python-number scalar into a separate multiply:
    ``t.add_(o, alpha=a)``, ``t.addcmul_(x, y, value=a)`` or ``t.addcdiv_(x, y, value=a)``, ``a`` a
    number. The rewrite rounds twice (``torch.mul`` then ``add_``, or ``inductor_prims.fma``, which
    aot_eager runs as a multiply then an add) where eager's CPU kernel rounds once, so the last bit
    of ``t`` can differ.

    Every supported version does, while ``torch._dynamo.config.enable_dynamo_decompositions`` (the
    default): 2.11 all three (``TensorVariable.method_add_`` and co. into ``mul`` + ``add_``); 2.13
    and 2.15 keep ``add_(o, alpha=a)`` as one node but still rewrite ``addcmul_``/``addcdiv_`` with
    a ``value`` into ``mul``/``div`` + ``fma``. Found by tracing the three once (about 0.5 s, the
    first time it is asked).
    """
    global _decomposes_number_scalars
    if _decomposes_number_scalars is None:
        kept: list[bool] = []

        def record(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
            calls = [n for n in gm.graph.nodes if n.op in ("call_function", "call_method")]
            kept.append(len(calls) == 1)
            return gm.forward

        probes: list[Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = [
            lambda t, o: t.add_(o, alpha=0.5),
            lambda t, o: t.addcmul_(o, o, value=0.5),
            lambda t, o: t.addcdiv_(o, o, value=0.5),
        ]
        for probe in probes:
            torch.compile(probe, backend=record, fullgraph=True)(torch.zeros(2), torch.ones(2))
        if len(kept) != len(probes):  # Dynamo did not trace (e.g. a force_eager stance): ask again later
            return False
        _decomposes_number_scalars = not all(kept)
    return _decomposes_number_scalars


@contextlib.contextmanager
def number_scalars_as_eager() -> Iterator[None]:
    """Inside, Dynamo traces ``add_``/``addcmul_``/``addcdiv_`` with a number scalar as eager
    computes them: one node each, one rounding.

    Where Dynamo would rewrite them (:func:`dynamo_decomposes_number_scalars`), this turns off
    ``enable_dynamo_decompositions`` while tracing. That flag is also how Dynamo traces a *tensor*
    ``alpha`` or ``value`` without reading it: without it 2.11 cannot trace one at all
    (``PendingUnbackedSymbolNotFound``) and 2.13 reads it on the host (``item()``, a sync per
    call: Adagrad's step-dependent lr is one). So only for code whose ``alpha`` and ``value``
    arguments are all Python numbers.
    """
    if not dynamo_decomposes_number_scalars():
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

        with torch.random.fork_rng(devices=[]):  # its init must not move the user's random stream
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


_folds_is_exporting: bool | None = None
_reads_exporting_flag = contextvars.ContextVar("amp_fx_reads_exporting_flag", default=False)


def dynamo_folds_is_exporting() -> bool:
    """Whether Dynamo traces ``torch.compiler.is_exporting()`` as ``True`` under ``torch.compile``,
    not only under ``torch.export``.

    2.11 does (its ``tracing_state_functions`` table maps ``is_exporting`` to ``True``); 2.13 and
    2.15 read the real flag (pytorch#176499). Libraries branch on it: transformers' masks
    (``masking_utils._ignore_causal_mask_sdpa``) then never skip the causal mask while compiling, so
    a compiled T5 or Llama runs a materialised mask where eager runs ``is_causal`` (for T5 a
    position-bias gradient summed over the batch in another order). Found by tracing a function
    that branches on it (about 0.2 s, the first time it is asked).
    """
    global _folds_is_exporting
    if _folds_is_exporting is None:
        seen: list[bool] = []

        def record(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
            seen.append(any(n.target is torch.add for n in gm.graph.nodes))
            return gm.forward

        def probe(x: torch.Tensor) -> torch.Tensor:
            return torch.add(x, 1) if torch.compiler.is_exporting() else torch.mul(x, 2)

        torch.compile(probe, backend=record, fullgraph=True)(torch.zeros(1))
        if not seen:  # Dynamo did not trace (e.g. a force_eager stance): ask again later
            return False
        _folds_is_exporting = seen[0]
        table = getattr(torch._dynamo.variables.torch, "tracing_state_functions", None)
        if _folds_is_exporting and callable(table):  # the table 2.11's Dynamo consults
            _install_exporting_flag_reader(table)
    return _folds_is_exporting


def _install_exporting_flag_reader(table: Callable[[], dict[Callable[[], Any], Any]]) -> None:
    """Replace Dynamo's ``tracing_state_functions`` with one that, inside
    :func:`is_exporting_as_eager`, maps ``torch.compiler.is_exporting`` to the real flag (as 2.13
    does). Outside it, every other ``torch.compile`` in the process sees Dynamo's own table."""

    def tracing_state_functions() -> dict[Callable[[], Any], Any]:
        found = table()
        if _reads_exporting_flag.get():
            return {**found, torch.compiler.is_exporting: torch.compiler._is_exporting_flag}
        return found

    torch._dynamo.variables.torch.tracing_state_functions = tracing_state_functions  # type: ignore[assignment]  # same call as the lru_cache'd original


def is_exporting_as_eager() -> contextlib.AbstractContextManager[None]:
    """Inside, Dynamo traces ``torch.compiler.is_exporting()`` as what it returns at run time
    (``False`` outside ``torch.export``), so code that branches on it traces the branch eager runs.

    Where Dynamo folds it to ``True`` (:func:`dynamo_folds_is_exporting`: torch 2.11) amp_fx's own
    compiles run inside this; elsewhere it is a shared ``nullcontext`` (each compiled call enters
    it). It reads the answer :func:`dynamo_folds_is_exporting` found, never probes: a call inside
    an enclosing trace must not compile; ``amp_call`` asks when the model is compiled.
    ``torch.compile(backend="amp_fx")`` is traced before amp_fx is called and keeps Dynamo's
    answer.
    """
    if not _folds_is_exporting or torch.compiler.is_compiling():
        # Inside an enclosing trace (an amp_fx model called from compile_step's forward) the
        # enclosing call set the flag already, and Dynamo cannot trace a ContextVar's set.
        return _NOTHING
    return _ReadExportingFlag()


_NOTHING = contextlib.nullcontext()


class _ReadExportingFlag:
    def __enter__(self) -> None:
        self.token = _reads_exporting_flag.set(True)

    def __exit__(self, *exc: object) -> None:
        _reads_exporting_flag.reset(self.token)


def dtensor_type() -> type[DTensor] | None:
    """``torch.distributed.tensor.DTensor``, or None in a torch build without distributed support."""
    if not torch.distributed.is_available():
        return None
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:
        return None
    return DTensor


def local_tensor(t: Any) -> Any:
    """A DTensor's local tensor (the same tensor object DTensor holds, sharing its storage: an
    in-place op on it bumps its own version counter, not the DTensor's); anything else as it is."""
    local = getattr(t, "_local_tensor", None)
    return t if local is None else local


def fsdp_param_groups(module: Any) -> list[Any]:
    """The FSDP2 parameter groups of ``module`` (one ``fully_shard`` was applied to; [] for any
    other): one per mesh. A ``shard_placement_fn`` may put a module's parameters on several meshes
    (torchtitan's MoE blocks under expert parallelism: the experts on ``(efsdp, ep)``, the rest on
    ``fsdp``), and then FSDP2's ``_fsdp_param_group`` (singular) raises; torch 2.13 keeps the list
    ``_fsdp_param_groups`` (2.11 and 2.15 not checked), a torch without the list the singular alone."""
    get_state = getattr(module, "_get_fsdp_state", None)
    if get_state is None:
        return []
    state = get_state()
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:
        group = state._fsdp_param_group
        return [] if group is None else [group]
    return list(groups)
