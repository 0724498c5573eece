"""Shared plumbing of the inspection tools (explain, compare, find_nonfinite).

* run the user's model on a private copy, so BatchNorm's running stats and other buffers of the
  user's model never change;
* run it eagerly first, so a model that fails on its own (or inputs that do not fit it) is
  reported as that, not as an amp_fx failure deep inside torch.compile;
* a downstream backend that records the real inputs each captured graph is called with, so a
  graph can be re-run op by op later (:class:`InputRecorder`);
* small helpers on tensors: flatten outputs, ranges, short dtype names.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.fx
from torch.utils._pytree import tree_flatten

from amp_fx.backend import Backend, GraphRecord

__all__: list[str] = []

_SHORT = {
    torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.float64: "fp64",
    torch.int64: "i64", torch.int32: "i32", torch.int16: "i16", torch.int8: "i8",
    torch.uint8: "u8", torch.bool: "bool", torch.complex64: "c64", torch.complex128: "c128",
}


class EagerError(ValueError):
    """The model (or function) fails on the given inputs without amp_fx."""


def short_dtype(dtype: torch.dtype | None) -> str:
    if dtype is None:
        return "-"
    return _SHORT.get(dtype, str(dtype).replace("torch.", ""))


def tensors_of(value: Any) -> list[torch.Tensor]:
    """The tensors in a (possibly nested) value, in pytree order."""
    return [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]


def value_dtype(value: Any) -> torch.dtype | None:
    """The dtype that describes a value: its first floating tensor's, else its first tensor's."""
    ts = tensors_of(value)
    for t in ts:
        if t.is_floating_point():
            return t.dtype
    return ts[0].dtype if ts else None


def describe_value(value: Any) -> str:
    """``bf16[2, 8]`` for a tensor, a tuple of those for a tuple, ``-`` for no tensor."""
    if isinstance(value, torch.Tensor):
        return f"{short_dtype(value.dtype)}[{', '.join(_dim(s) for s in value.shape)}]"
    if isinstance(value, (tuple, list)):
        inner = [describe_value(v) for v in value]
        return "(" + ", ".join(inner) + ")"
    if value is None:
        return "-"
    return type(value).__name__


def _dim(s: Any) -> str:
    return str(s) if isinstance(s, int) else f"{s}"


def numel_or_none(t: torch.Tensor) -> int | None:
    try:
        return int(t.numel())
    except Exception:  # an unbacked or symbolic size: no number to report
        return None


def clone_inputs(inputs: Sequence[Any], leaf_flags: Sequence[bool] | None = None,
                 *, to: torch.dtype | None = None) -> list[Any]:
    """Fresh copies of recorded graph inputs; leaves that required grad become fresh leaves again
    (eager autocast's cast cache applies to them), floating tensors optionally converted ``to``."""
    out = []
    for i, a in enumerate(inputs):
        if isinstance(a, torch.Tensor):
            c = a.detach().clone()
            if to is not None and c.is_floating_point():
                c = c.to(to)
            if leaf_flags is not None and leaf_flags[i] and c.is_floating_point():
                c.requires_grad_(True)
            out.append(c)
        else:
            out.append(a)
    return out


def leaf_flags(record: GraphRecord) -> list[bool]:
    return [bool(n.meta.get("amp_fx_leaf", False))
            for n in record.captured.graph.nodes if n.op == "placeholder"]


def private_copy(model_or_fn: Any) -> Any:
    """A deep copy of a module (so its buffers and parameters stay the user's), or the function."""
    if not isinstance(model_or_fn, torch.nn.Module):
        return model_or_fn
    try:
        return copy.deepcopy(model_or_fn)
    except Exception as e:  # e.g. a module holding a lock or an open file
        raise TypeError(
            f"amp_fx: cannot deep-copy {type(model_or_fn).__name__} ({type(e).__name__}: {e}); the "
            "inspection tools run on a copy so that your model's buffers (BatchNorm running stats) "
            "are not updated") from e


def copy_args(args: Sequence[Any], kwargs: dict[str, Any]
              ) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Copies of the inputs (an in-place op on an input must not reach the user's tensor)."""
    def cp(a: Any) -> Any:
        if isinstance(a, torch.Tensor):
            return a.detach().clone().requires_grad_(a.requires_grad)
        if isinstance(a, (list, tuple)):
            return type(a)(cp(x) for x in a)
        if isinstance(a, dict):
            return {k: cp(v) for k, v in a.items()}
        return a
    return tuple(cp(a) for a in args), {k: cp(v) for k, v in kwargs.items()}


def _describe_inputs(args: Sequence[Any], kwargs: dict[str, Any]) -> str:
    parts = [describe_value(a) if isinstance(a, torch.Tensor) else type(a).__name__ for a in args]
    parts += [f"{k}={describe_value(v) if isinstance(v, torch.Tensor) else type(v).__name__}"
              for k, v in kwargs.items()]
    return ", ".join(parts) or "no inputs"


def run_eager_checked(model_or_fn: Any, args: Sequence[Any], kwargs: dict[str, Any], *,
                      tool: str) -> Any:
    """Run the model once in plain fp32 eager on copies; raise :class:`EagerError` if it fails."""
    target = private_copy(model_or_fn)
    a, k = copy_args(args, kwargs)
    name = type(model_or_fn).__name__ if isinstance(model_or_fn, torch.nn.Module) else getattr(
        model_or_fn, "__qualname__", repr(model_or_fn))
    try:
        with torch.no_grad():
            return target(*a, **k)
    except Exception as e:
        text = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
        looks_like_mismatch = any(w in str(e).lower() for w in
                                  ("shape", "size", "dimension", "dtype", "expected", "argument"))
        what = ("the inputs do not match the model" if looks_like_mismatch
                else "the model fails in eager mode")
        raise EagerError(
            f"amp_fx.{tool}: {what}: calling {name} on ({_describe_inputs(args, kwargs)}) without "
            f"amp_fx (plain eager, fp32) raises {text}. Fix the model or the example inputs; "
            "amp_fx can only inspect a model that runs eagerly.") from e


@contextlib.contextmanager
def many_recompiles() -> Iterator[None]:
    """Each inspection compiles a fresh copy with its own backend; Dynamo counts every one as a
    recompile of the same code object and would fall back to eager (capturing nothing) after 8."""
    with torch._dynamo.config.patch(recompile_limit=1 << 16, accumulated_recompile_limit=1 << 20):
        yield


def _resolve_backend(backend: str | Backend) -> Backend:
    if callable(backend):
        return backend
    if backend == "inductor":
        from torch._inductor.compile_fx import compile_fx

        return compile_fx
    return torch._dynamo.lookup_backend(backend)


class InputRecorder:
    """A downstream backend for :func:`amp_fx.compile` that keeps the real inputs of each graph.

    It wraps another backend (``"eager"``, ``"aot_eager"``, ``"inductor"`` or a callable). The first
    call of each compiled graph stores detached copies of its inputs, keyed by the graph module it
    was handed (``GraphRecord.rewritten``), taken *before* the graph runs (it may update buffers
    in place).
    """

    def __init__(self, downstream: str | Backend) -> None:
        self.name = downstream if isinstance(downstream, str) else getattr(
            downstream, "__name__", repr(downstream))
        self._inner = _resolve_backend(downstream)
        self._inputs: dict[int, list[Any]] = {}
        self._graphs: list[torch.fx.GraphModule] = []  # keeps ids stable
        self.__name__ = f"recorder({self.name})"

    def inputs_for(self, record: GraphRecord) -> list[Any] | None:
        return self._inputs.get(id(record.rewritten))

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        inner = self._inner(gm, example_inputs)
        self._graphs.append(gm)
        key = id(gm)

        def remember(args: Sequence[Any]) -> None:
            if key not in self._inputs:
                self._inputs[key] = [a.detach().clone() if isinstance(a, torch.Tensor) else a
                                     for a in args]

        # Dynamo calls the compiled graph with positional tensors whatever the backend returns
        def run(*args: Any) -> Any:
            remember(args)
            return inner(*args)

        return run


class ValueInterpreter(torch.fx.Interpreter):
    """Runs a graph and keeps every node's value (``env`` after :meth:`run`)."""

    def __init__(self, gm: torch.fx.GraphModule) -> None:
        super().__init__(gm, garbage_collect_values=False)


def input_labels(record: GraphRecord) -> dict[str, str]:
    """Placeholder name in the ATen graphs -> what the user calls it (``fc1.weight``, ``x``)."""
    dyn = [n for n in record.dynamo_graph.graph.nodes if n.op == "placeholder"]
    ours = [n for n in record.captured.graph.nodes if n.op == "placeholder"]
    labels = {}
    for mine, theirs in zip(ours, dyn):
        labels[mine.name] = _source_label(theirs)
    return labels


def _source_label(node: torch.fx.Node) -> str:
    from amp_fx.capture import module_path

    source = getattr(node, "_dynamo_source", None)
    if source is None:
        return node.name
    try:
        name = source.name
        text = name() if callable(name) else str(name)
    except Exception:
        return node.name
    if text.startswith("L['self']") or text.startswith("G['"):
        path = module_path(text)
        parts = [p for p in path.split(".") if p not in ("_parameters", "_buffers")]
        return ".".join(parts) or node.name
    if text.startswith("L['") and text.endswith("']") and text.count("'") == 2:
        return text[3:-2]
    return text


def tensor_range(t: torch.Tensor) -> dict[str, Any]:
    """min and max of |t| over its finite entries, and counts of inf and NaN (host syncs: this is
    a debugging tool)."""
    if not t.is_floating_point() or t.numel() == 0:
        return {"dtype": t.dtype, "shape": tuple(t.shape), "min_abs": None, "max_abs": None,
                "n_inf": 0, "n_nan": 0}
    d = t.detach().double().abs()
    finite = torch.isfinite(d)
    n_nan = int(torch.isnan(d).sum())
    n_inf = int(torch.isinf(d).sum())
    vals = d[finite]
    return {"dtype": t.dtype, "shape": tuple(t.shape),
            "min_abs": float(vals.min()) if vals.numel() else None,
            "max_abs": float(vals.max()) if vals.numel() else None,
            "n_inf": n_inf, "n_nan": n_nan}


def all_finite(value: Any) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in tensors_of(value)
               if t.is_floating_point() or t.is_complex())


def format_range(r: dict[str, Any]) -> str:
    if r["max_abs"] is None and not (r["n_inf"] or r["n_nan"]):
        return "-"
    lo = "-" if r["min_abs"] is None else f"{r['min_abs']:.3g}"
    hi = "-" if r["max_abs"] is None else f"{r['max_abs']:.3g}"
    bad = []
    if r["n_inf"]:
        bad.append(f"{r['n_inf']} inf")
    if r["n_nan"]:
        bad.append(f"{r['n_nan']} NaN")
    return f"|x| in [{lo}, {hi}]" + (f", {', '.join(bad)}" if bad else ", all finite")


def module_of(node: torch.fx.Node) -> tuple[str, str]:
    """(innermost module path, its type name) of a node; ("", "") outside any submodule."""
    from amp_fx.capture import module_stack

    stack = module_stack(node)
    if not stack:
        return "", ""
    path, mtype = stack[-1]
    return path, mtype.__name__


def op_label(node: torch.fx.Node) -> str:
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        name = target.name().replace("::", ".")
        return name
    return getattr(target, "__name__", str(target))


class AmpRunError(RuntimeError):
    """The model runs in plain eager mode but fails when run with mixed precision."""


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0] if text else ''}"


def eager_autocast_error(model_or_fn: Any, args: Sequence[Any], kwargs: dict[str, Any],
                         device_type: str, dtype: torch.dtype) -> BaseException | None:
    """The error eager ``torch.autocast`` raises on this model, or None if it runs."""
    target = private_copy(model_or_fn)
    a, k = copy_args(args, kwargs)
    try:
        with torch.no_grad(), torch.autocast(device_type, dtype=dtype):
            target(*a, **k)
    except Exception as e:
        return e
    return None


def _compiled_autocast_error(model_or_fn: Any, args: Sequence[Any], kwargs: dict[str, Any],
                             device_type: str, dtype: torch.dtype, backend: str
                             ) -> BaseException | None:
    """The error plain ``torch.compile(backend=...)`` under eager autocast raises (forward and
    backward), or None if it runs."""
    target = private_copy(model_or_fn)
    a, k = copy_args(args, kwargs)
    try:
        with many_recompiles():
            compiled = torch.compile(target, backend=backend)
            with torch.autocast(device_type, dtype=dtype):
                out = compiled(*a, **k)
            floats = [t for t in tensors_of(out) if t.is_floating_point() and t.requires_grad]
            if floats:
                sum(t.float().sum() for t in floats).backward()
    except Exception as err:
        return err
    return None


def amp_failure(e: BaseException, model_or_fn: Any, args: Sequence[Any], kwargs: dict[str, Any],
                *, tool: str, dtype: torch.dtype, backend: str | None = None) -> AmpRunError:
    """Describe a failure of the amp_fx-compiled model, saying whether eager autocast fails too."""
    device_type = "cuda" if any(isinstance(t, torch.Tensor) and t.device.type == "cuda"
                                for t in tree_flatten((list(args), kwargs))[0]) else "cpu"
    eager = eager_autocast_error(model_or_fn, args, kwargs, device_type, dtype)
    if eager is not None:
        same = (f"eager torch.autocast('{device_type}', {short_dtype(dtype)}) fails on it too "
                f"({_first_line(eager)}): this op has no {short_dtype(dtype)} kernel here; keep "
                f"the module that runs it in fp32 (Policy(keep_fp32=...)) or use another dtype")
    else:
        same = (f"eager torch.autocast('{device_type}', {short_dtype(dtype)}) runs it, so this "
                "looks like an amp_fx bug: please report it with this model")
        if isinstance(backend, str) and backend != "eager":
            compiled = _compiled_autocast_error(model_or_fn, args, kwargs, device_type, dtype,
                                                backend)
            if compiled is not None:
                same = (f"plain torch.compile(backend='{backend}') under eager torch.autocast "
                        f"fails the same way ({_first_line(compiled)}): a torch.compile problem "
                        "with this model, not amp_fx's; try backend='eager'")
    return AmpRunError(f"amp_fx.{tool}: the model runs in fp32 eager mode but fails with amp_fx "
                       f"({short_dtype(dtype)}): {_first_line(e)}; {same}")
