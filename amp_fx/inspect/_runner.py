"""The one runner of the inspection tools (explain, compare, find_nonfinite).

Each tool does the same four things, here once:

* run the model in plain fp32 eager first (:func:`run_eager_checked`), so a model that fails on
  its own, or inputs that do not fit it, is reported as that (:class:`~amp_fx.errors.EagerError`)
  and not as an amp_fx failure deep inside torch.compile;
* run on private copies of the model and the inputs (:func:`private_copy`, :meth:`Call.copy`), so
  the user's parameters, buffers (BatchNorm running stats), gradients and RNG state never change;
  a model sharded with FSDP2, which refuses deep copies, is lent instead (:func:`lent`): each
  "copy" is the model itself with its buffers put back and no gradients, and the end of the tool
  puts back its gradients and FSDP2's sharding (:class:`~amp_fx._dist.lend.Loan`);
* compile the copy with amp_fx and a downstream backend wrapped in :class:`InputRecorder`, which
  keeps the real inputs each captured graph is called with and names them (``fc1.weight``, ``x``);
* re-raise amp_fx's own errors, and turn any other failure into
  :class:`~amp_fx.errors.AmpRunError` saying whether eager ``torch.autocast`` fails the same way
  (:func:`amp_failure`).

:func:`run_amp` does the last three; the tool passes what to do with the compiled copy.
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
import inspect
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
import torch.fx
from torch.utils._pytree import keystr, tree_flatten, tree_flatten_with_path

from amp_fx._common.downstream import Backend, backend_name, resolve_backend
from amp_fx._common.dtype_names import dtype_name
from amp_fx._common.targets import check_target
from amp_fx._dist.lend import Loan, is_fsdp2
from amp_fx.backend.splits import leaves_cast_with_shared_cast, splits_noted_by_caller
from amp_fx.errors import AmpFxError, AmpRunError, EagerError
from amp_fx.inspect._probe import (
    clone_tensor,
    describe_value,
    input_labels,
    module_of,
    source_label,
    source_text,
    tensors_of,
)
from amp_fx.low_precision import LowPrecisionLike
from amp_fx.passes.fx_edit import placeholders
from amp_fx.passes.pipeline import GraphRecord
from amp_fx.policy import Policy

__all__: list[str] = []

SEED = 0
"""The seed every run of the model starts from (dropout draws the same masks in each run)."""

T = TypeVar("T")


@dataclass(frozen=True)
class Call:
    """The model's own call form: ``model(*args, **kwargs)``."""

    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)

    def copy(self, *, to: torch.dtype | None = None) -> Call:
        """Copies of the inputs (an in-place op on an input must not reach the user's tensor);
        floating tensors converted ``to`` a dtype when given."""

        def cp(a: Any) -> Any:
            if isinstance(a, torch.Tensor):
                return clone_tensor(a, to=to, requires_grad=a.requires_grad)
            if isinstance(a, tuple) and hasattr(a, "_fields"):  # a namedtuple
                return type(a)(*(cp(x) for x in a))
            if isinstance(a, (list, tuple)):
                return type(a)(cp(x) for x in a)
            if isinstance(a, dict):
                return type(a)((k, cp(v)) for k, v in a.items())
            return a

        return Call(tuple(cp(a) for a in self.args), {k: cp(v) for k, v in self.kwargs.items()})

    def __call__(self, fn: Callable[..., T]) -> T:
        return fn(*self.args, **self.kwargs)

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in tree_flatten((list(self.args), self.kwargs))[0] if isinstance(t, torch.Tensor)]

    def device_type(self, model: Any = None) -> str:
        """``cuda`` when an input (or the model's first parameter) is on CUDA, else ``cpu``."""
        tensors = self.tensors()
        if isinstance(model, torch.nn.Module):
            tensors += list(model.parameters())[:1]
        return "cuda" if any(t.device.type == "cuda" for t in tensors) else "cpu"

    def describe(self) -> str:
        def one(v: Any) -> str:
            return describe_value(v) if isinstance(v, torch.Tensor) else type(v).__name__

        parts = [one(a) for a in self.args] + [f"{k}={one(v)}" for k, v in self.kwargs.items()]
        return ", ".join(parts) or "no inputs"

    def names(self, model_or_fn: Any) -> dict[int, str]:
        """id of each input tensor -> the forward's argument name (``x``, ``input_ids``), with
        the path inside a nested argument (``batch['mask']``)."""
        bound: Mapping[str, Any]
        try:
            target = model_or_fn.forward if isinstance(model_or_fn, torch.nn.Module) else model_or_fn
            bound = inspect.signature(target).bind(*self.args, **self.kwargs).arguments
        except (TypeError, ValueError):  # no signature (a builtin) or one that does not bind
            bound = {**{f"args[{i}]": a for i, a in enumerate(self.args)}, **self.kwargs}
        out: dict[int, str] = {}
        for name, value in bound.items():
            for path, leaf in tree_flatten_with_path(value)[0]:
                if isinstance(leaf, torch.Tensor):
                    out.setdefault(id(leaf), name + keystr(path))
        return out


def tensor_names(model_or_fn: Any, call: Call) -> dict[int, str]:
    """id -> name of every tensor the user can name: the model's parameters and buffers by their
    names under the root module (``0.weight``, ``encoder.fc.bias``), then the call's inputs."""
    out: dict[int, str] = {}
    if isinstance(model_or_fn, torch.nn.Module):
        for name, t in (
            *model_or_fn.named_parameters(remove_duplicate=False),
            *model_or_fn.named_buffers(remove_duplicate=False),
        ):
            out.setdefault(id(t), name)
    for key, name in call.names(model_or_fn).items():
        out.setdefault(key, name)
    return out


_LOANS: contextvars.ContextVar[dict[int, Loan]] = contextvars.ContextVar("amp_fx_inspect_loans", default={})
"""id -> the loan of each model lent to the tool running now (:func:`lent`)."""


@contextlib.contextmanager
def lent(model_or_fn: Any, *, tool: str) -> Iterator[None]:
    """Inside: :func:`private_copy` of an FSDP2 model gives the model itself, with its buffers as
    they were and no gradients; on the way out its buffers, gradients and FSDP2 sharding are put
    back (:class:`~amp_fx._dist.lend.Loan`). Any other model or function: nothing changes."""
    if not isinstance(model_or_fn, torch.nn.Module) or not is_fsdp2(model_or_fn):
        yield
        return
    loan = Loan(model_or_fn, tool=tool)
    token = _LOANS.set({**_LOANS.get(), id(model_or_fn): loan})
    try:
        yield
    finally:
        _LOANS.reset(token)
        loan.close()


NO_FLOAT64_LOAN = (
    "an FSDP2 model cannot be deep-copied, and converting it to float64 in place would replace its "
    "sharded parameters (your optimizer's); for a float64 reference, run on the model before fully_shard"
)


def is_lent(model_or_fn: Any) -> bool:
    """Whether ``model_or_fn`` is lent to the tool running now (runs use the model itself)."""
    return id(model_or_fn) in _LOANS.get()


def refuse_fsdp2(model_or_fn: Any, *, tool: str, why: str) -> None:
    """``TypeError`` before any run where ``model_or_fn`` is sharded with FSDP2 and the tool needs
    private copies of it (``why``: for what)."""
    if isinstance(model_or_fn, torch.nn.Module) and is_fsdp2(model_or_fn):
        raise TypeError(
            f"amp_fx.{tool}: {type(model_or_fn).__name__} is sharded with FSDP2, which refuses deep "
            f"copies, and {tool} needs copies of it ({why}). Run amp_fx.{tool} on the model before "
            "fully_shard, with the same weights (FSDP2 computes with the gathered weights); "
            "amp_fx.explain and amp_fx.compare run on the sharded model"
        )


def private_copy(model_or_fn: Any, *, float64: bool = False) -> Any:
    """A deep copy of a module (so its buffers and parameters stay the user's), or the function;
    with ``float64``, the copy converted to float64.

    A lent model (:func:`lent`) is not copied: it comes back itself, reset to the user's buffers
    with no gradients; converting it to float64 would replace FSDP2's sharded parameters (your
    optimizer's), so ``float64`` raises ``TypeError`` there."""
    if not isinstance(model_or_fn, torch.nn.Module):
        return model_or_fn
    loan = _LOANS.get().get(id(model_or_fn))
    if loan is not None:
        if float64:
            raise TypeError(NO_FLOAT64_LOAN)
        loan.reset()
        return model_or_fn
    try:
        target = copy.deepcopy(model_or_fn)
    except Exception as e:  # e.g. a module holding a lock or an open file
        raise TypeError(
            f"amp_fx: cannot deep-copy {type(model_or_fn).__name__} ({type(e).__name__}: {e}); the "
            "inspection tools run on a copy so that your model's buffers (BatchNorm running stats) "
            "are not updated"
        ) from e
    return target.double() if float64 else target


def _model_name(model_or_fn: Any) -> str:
    if isinstance(model_or_fn, torch.nn.Module):
        return type(model_or_fn).__name__
    return getattr(model_or_fn, "__qualname__", repr(model_or_fn))


def run_eager_checked(model_or_fn: Any, call: Call, *, tool: str) -> Any:
    """Run the model once in plain fp32 eager on copies; raise :class:`EagerError` if it fails
    (``TypeError`` where it is no model at all: a class, a string)."""
    check_target(model_or_fn, f"amp_fx.{tool}")
    target = private_copy(model_or_fn)
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            torch.manual_seed(SEED)
            return call.copy()(target)
    except Exception as e:
        text = _first_line(e)
        looks_like_mismatch = any(
            w in str(e).lower() for w in ("shape", "size", "dimension", "dtype", "expected", "argument")
        )
        what = "the inputs do not match the model" if looks_like_mismatch else "the model fails in eager mode"
        raise EagerError(
            f"amp_fx.{tool}: {what}: calling {_model_name(model_or_fn)} on ({call.describe()}) "
            f"without amp_fx (plain eager, fp32) raises {text}. Fix the model or the example "
            "inputs; amp_fx can only inspect a model that runs eagerly."
        ) from e


@contextlib.contextmanager
def many_recompiles() -> Iterator[None]:
    """Each inspection compiles a fresh copy with its own backend; Dynamo counts every one as a
    recompile of the same code object and would fall back to eager (capturing nothing) after 8."""
    with torch._dynamo.config.patch(recompile_limit=1 << 16, accumulated_recompile_limit=1 << 20):
        yield


class InputRecorder:
    """A downstream backend for :func:`amp_fx.compile` that keeps the real inputs of each graph
    and what the user calls each of them.

    It wraps another backend (``"eager"``, ``"aot_eager"``, ``"inductor"`` or a callable). At
    compile time, each graph input is named by identity from ``names`` (see :func:`tensor_names`);
    with ``keep_inputs``, the first call of each compiled graph stores detached copies of its
    inputs, taken *before* the graph runs (it may update buffers in place). Both are keyed by the
    graph module it was handed (``GraphRecord.rewritten``).
    """

    def __init__(
        self, downstream: str | Backend, *, names: dict[int, str] | None = None, keep_inputs: bool = True
    ) -> None:
        self.name = backend_name(downstream)
        self._inner = resolve_backend(downstream)
        self._names = names or {}
        self._keep = keep_inputs
        self._inputs: dict[int, list[Any]] = {}
        self._labels: dict[int, dict[str, str]] = {}
        self._graphs: list[torch.fx.GraphModule] = []  # keeps ids stable
        self.__name__ = f"recorder({self.name})"

    def inputs_for(self, record: GraphRecord) -> list[Any] | None:
        return self._inputs.get(id(record.rewritten))

    def labels_for(self, record: GraphRecord) -> dict[str, str]:
        """Placeholder name -> the name of the tensor it was called with, where one is known."""
        return self._labels.get(id(record.rewritten), {})

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        self._graphs.append(gm)
        key = id(gm)
        self._labels[key] = {
            n.name: self._names[id(t)]
            for n, t in zip(placeholders(gm.graph), example_inputs)
            if isinstance(t, torch.Tensor) and id(t) in self._names
        }
        inner = self._inner(gm, example_inputs)
        if not self._keep:
            return inner

        def remember(args: Sequence[Any]) -> None:
            if key not in self._inputs:
                self._inputs[key] = [a.detach().clone() if isinstance(a, torch.Tensor) else a for a in args]

        # Dynamo calls the compiled graph with positional tensors whatever the backend returns
        def run(*args: Any) -> Any:
            remember(args)
            return inner(*args)

        return run


@dataclass
class AmpRun:
    """What :func:`run_amp` gives back."""

    compiled: Any
    """The amp_fx-compiled private copy."""
    records: list[GraphRecord]
    recorder: InputRecorder
    result: Any
    """What the tool's ``then`` returned (the model's output by default)."""
    forward: Callable[..., Any] | None = None
    model: Any = None
    """The private copy that was compiled (its module names are the root's)."""
    _prefixes: dict[int, str] = field(default_factory=dict)
    _modules: dict[str, torch.nn.Module] | None = None

    def module_of(self, record: GraphRecord, node: torch.fx.Node) -> tuple[str, str]:
        """(module path under the root, type name) of a node of ``record``.

        Dynamo names modules relative to the frame it compiled; after a graph break inside a
        submodule, that frame is the submodule's forward. The frame's name under the root is read
        off its parameters (Dynamo's name against the name found by identity) and put in front,
        where the result is a module of the root; otherwise the path is kept as it is.
        """
        path, mtype = module_of(node)
        prefix = self._prefix(record)
        if not prefix or not isinstance(self.model, torch.nn.Module):
            return path, mtype
        if self._modules is None:
            self._modules = dict(self.model.named_modules())
        modules = self._modules
        full = prefix + path if path else prefix.rstrip(".")
        if full in modules:
            return full, type(modules[full]).__name__
        return path, mtype

    def _prefix(self, record: GraphRecord) -> str:
        if record.index not in self._prefixes:
            self._prefixes[record.index] = _frame_prefix(record, self.recorder.labels_for(record))
        return self._prefixes[record.index]

    def labels(self, record: GraphRecord) -> dict[str, str]:
        """Placeholder name -> what the user calls the tensor: parameters and buffers by their
        name under the root module (``0.weight``, whatever frame Dynamo compiled), inputs by the
        forward's argument names; Dynamo's source names for anything else."""
        return {**input_labels(record, self.forward), **self.recorder.labels_for(record)}


def run_amp(
    model_or_fn: Any,
    call: Call,
    *,
    tool: str,
    dtype: torch.dtype,
    policy: Policy | None,
    downstream: str | Backend,
    fold: bool = True,
    keep_inputs: bool = True,
    then: Callable[[Any], Any] | None = None,
    fp8: LowPrecisionLike = None,
) -> AmpRun:
    """Compile a private copy of the model with amp_fx and ``downstream`` (wrapped in an
    :class:`InputRecorder`), call it on copies of the inputs from :data:`SEED`, and pass the output
    to ``then`` (a loss and backward, say) in the same guarded region.

    amp_fx's own errors (:class:`~amp_fx.errors.AmpFxError`, ``ValueError``) propagate; any other
    failure becomes :class:`~amp_fx.errors.AmpRunError` (see :func:`amp_failure`).
    """
    from amp_fx.api import compile as amp_compile
    from amp_fx.api import records

    if fp8 is not None and is_lent(model_or_fn):
        raise TypeError(
            f"amp_fx.{tool}(fp8=...) on an FSDP2 model: amp_fx.compile(fp8=...) attaches its fp8 "
            "all-gather to the sharded parameters, which would stay on your model after the tool; "
            f"run amp_fx.{tool} with fp8 on the model before fully_shard"
        )
    target = private_copy(model_or_fn)
    inputs = call.copy()
    recorder = InputRecorder(downstream, names=tensor_names(target, inputs), keep_inputs=keep_inputs)
    with many_recompiles(), torch.random.fork_rng(devices=[]), splits_noted_by_caller():
        torch.manual_seed(SEED)
        compiled = amp_compile(target, dtype=dtype, policy=policy, backend=recorder, fold=fold, fp8=fp8)
        try:
            out = inputs(compiled)
            result = then(out) if then is not None else out
        except (AmpFxError, ValueError):
            raise
        except Exception as e:
            raise amp_failure(
                e,
                model_or_fn,
                call,
                tool=tool,
                dtype=dtype,
                backend=downstream if isinstance(downstream, str) else None,
            ) from e
    forward = target.forward if isinstance(target, torch.nn.Module) else target
    return AmpRun(compiled, list(records(compiled)), recorder, result, forward, target)


def weights_split_by_graph_breaks(run: AmpRun) -> dict[str, list[int]]:
    """Name -> the graphs that cast it, for each weight that more than one graph of the run's one
    call casts (a graph break between its uses).

    Eager autocast casts such a weight once for the whole autocast region and sums its uses'
    gradients in the low dtype; amp_fx without the weight cache casts it once per graph, so the
    sum is in fp32: a known difference, not bitwise (docs/parity.md, Known differences). The backend
    reports it as a shortfall of a user's compiled model; inside the inspection tools it is part
    of what they report (:func:`split_weight_note`). All graphs are of one call here, so
    two graphs of one frame (a recompile within the call) count too.
    """
    graphs_of: dict[str, list[int]] = {}
    for r in run.records:
        labels = run.labels(r)
        for leaf in leaves_cast_with_shared_cast(r.rewritten):
            where = graphs_of.setdefault(labels.get(leaf.name, f"graph {r.index} input {leaf.name}"), [])
            if r.index not in where:
                where.append(r.index)
    return {name: where for name, where in graphs_of.items() if len(where) > 1}


def split_weight_note(name: str, graphs: Sequence[int], dtype: torch.dtype) -> str:
    """What the inspection tools say about a weight of :func:`weights_split_by_graph_breaks`."""
    low = dtype_name(dtype)
    return (
        f"{name} is used in graphs {', '.join(map(str, graphs))} (a graph break between its "
        f"uses): eager autocast casts it to {low} once for the whole autocast region and sums "
        f"its uses' gradients in that dtype; amp_fx casts it once per graph, so the sum is in "
        "fp32 (not bitwise eager autocast; weight_cache=True shares one cast)"
    )


def _frame_prefix(record: GraphRecord, by_identity: dict[str, str]) -> str:
    """``model.`` when Dynamo's frame ``self`` is the root's submodule ``model`` (a parameter
    Dynamo calls ``a.weight`` is ``model.a.weight`` by identity); empty for the root."""
    dyn = placeholders(record.dynamo_graph.graph)
    ours = placeholders(record.captured.graph)
    for mine, theirs in zip(ours, dyn):
        full = by_identity.get(mine.name)
        if full is None or not source_text(theirs).startswith("L['self']"):
            continue
        relative = source_label(theirs)
        if full.endswith("." + relative):
            return full[: len(full) - len(relative)]
    return ""


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0] if text else ''}"


def eager_autocast_error(model_or_fn: Any, call: Call, device_type: str, dtype: torch.dtype) -> BaseException | None:
    """The error eager ``torch.autocast`` raises on this model (forward and backward, as the tools
    run it), or None if it runs.

    With grad, not under ``no_grad``: a kernel may exist for inference only (oneDNN's fp16 LSTM on
    CPUs with AMX runs under ``no_grad`` and fails to create its training primitive), and the
    tools' own run, which failed, had grad on."""
    target = private_copy(model_or_fn)
    try:
        with torch.autocast(device_type, dtype=dtype):
            out = call.copy()(target)
        floats = [t for t in tensors_of(out) if t.is_floating_point() and t.requires_grad]
        if floats:
            loss = sum(t.float().sum() for t in floats)
            assert isinstance(loss, torch.Tensor)  # floats is not empty
            loss.backward()
    except Exception as e:
        return e
    return None


def _compiled_autocast_error(
    model_or_fn: Any, call: Call, device_type: str, dtype: torch.dtype, backend: str
) -> BaseException | None:
    """The error plain ``torch.compile(backend=...)`` under eager autocast raises (forward and
    backward), or None if it runs."""
    target = private_copy(model_or_fn)
    try:
        with many_recompiles():
            compiled = torch.compile(target, backend=backend)
            with torch.autocast(device_type, dtype=dtype):
                out = call.copy()(compiled)
            floats = [t for t in tensors_of(out) if t.is_floating_point() and t.requires_grad]
            if floats:
                loss = sum(t.float().sum() for t in floats)
                assert isinstance(loss, torch.Tensor)  # floats is not empty
                loss.backward()
    except Exception as err:
        return err
    return None


def amp_failure(
    e: BaseException, model_or_fn: Any, call: Call, *, tool: str, dtype: torch.dtype, backend: str | None = None
) -> AmpRunError:
    """Describe a failure of the amp_fx-compiled model, saying whether eager autocast fails too."""
    device_type = call.device_type()
    name = dtype_name(dtype)
    eager = eager_autocast_error(model_or_fn, call, device_type, dtype)
    if eager is not None:
        same = (
            f"eager torch.autocast('{device_type}', {name}) fails on it too "
            f"({_first_line(eager)}): this op has no {name} kernel here; keep "
            f"the module that runs it in fp32 (Policy(keep_fp32=...)) or use another dtype"
        )
    else:
        same = (
            f"eager torch.autocast('{device_type}', {name}) runs it, so this "
            "looks like an amp_fx bug: please report it with this model"
        )
        if isinstance(backend, str) and backend != "eager":
            compiled = _compiled_autocast_error(model_or_fn, call, device_type, dtype, backend)
            if compiled is not None:
                same = (
                    f"plain torch.compile(backend='{backend}') under eager torch.autocast "
                    f"fails the same way ({_first_line(compiled)}): a torch.compile problem "
                    "with this model, not amp_fx's; try backend='eager'"
                )
    return AmpRunError(
        f"amp_fx.{tool}: the model runs in fp32 eager mode but fails with amp_fx ({name}): {_first_line(e)}; {same}"
    )


class _GroupedMmPerGroup(torch.overrides.TorchFunctionMode):
    """``torch._grouped_mm`` (what ``F.grouped_mm`` calls) on float64 operands, computed one group at
    a time with ``torch.mm`` (differentiable, so the backward too)."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is torch._grouped_mm:
            names = ("mat_a", "mat_b", "offs", "bias", "out_dtype")
            given = dict(zip(names, args)) | kwargs
            a, b, offs = given.get("mat_a", given.get("self")), given["mat_b"], given.get("offs")
            if (
                isinstance(a, torch.Tensor)
                and a.dtype == torch.float64
                and offs is not None
                and given.get("bias") is None
                and given.get("out_dtype") in (None, torch.float64)
                and a.dim() == 2
                and b.dim() in (2, 3)
            ):
                return _grouped_mm_per_group(a, b, offs)
        return func(*args, **kwargs)


def _grouped_mm_per_group(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    ends = offs.tolist()
    starts = [0, *ends[:-1]]
    if b.dim() == 3:  # [M, K] x [E, K, N] -> [M, N]; rows past the last group: zeros
        pieces = [a[s:t] @ b[e] for e, (s, t) in enumerate(zip(starts, ends))]
        pieces.append(a.new_zeros(a.shape[0] - ends[-1], b.shape[-1]))
        return torch.cat(pieces)
    return torch.stack([a[:, s:t] @ b[s:t] for s, t in zip(starts, ends)])  # [N, M] x [M, K] -> [E, N, K]


@contextlib.contextmanager
def float64_grouped_mm() -> Iterator[None]:
    """Inside: the grouped expert GEMMs of a float64 reference run (``torch._grouped_mm`` has no
    float64 kernel; transformers' MoE layers call it on whatever dtype their weights have) compute
    one group at a time, in float64."""
    with _GroupedMmPerGroup():
        yield
