"""The ``amp-fx`` command: explain, compare and find-nonfinite on a model defined in a file.

    amp-fx explain examples/tiny_mlp.py:build --dtype bf16 --svg tiny_mlp.svg
    amp-fx compare examples/tiny_mlp.py:build --dtype fp16
    amp-fx find-nonfinite examples/tiny_mlp.py:build_overflowing
    amp-fx advise examples/advise_overflow.py:build --loss loss_fn --json

``FILE:FUNCTION`` names a Python file and a function in it that takes no arguments and returns
``(model, inputs)``: inputs a tuple of positional inputs (one tensor alone is one input), or a
dict of keyword inputs (a Hugging Face model's ``input_ids`` and ``labels``), or
``(model, args, kwargs)`` for both. Exit codes: 0 fine; 1 the check failed (compare differs,
find-nonfinite found an inf/NaN, advise found no policy that meets the target) or amp_fx refused
the model; 2 a problem in your file or model
(syntax error, missing function, an exception in it, a model that fails in eager mode), reported
with your file and line, not as an amp_fx traceback.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import traceback
import types
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["main"]


class UserCodeError(Exception):
    """A problem in the user's file or function (exit code 2)."""


def _user_frame(tb: types.TracebackType | None, path: Path) -> str:
    """``file:line`` of the innermost traceback frame in the user's file."""
    where = ""
    for frame in traceback.extract_tb(tb):
        if Path(frame.filename).resolve() == path:
            where = f"{frame.filename}:{frame.lineno}"
    return where


def load_target(spec: str) -> tuple[Any, tuple[Any, ...], dict[str, Any]]:
    """Import ``FILE:FUNCTION``, call the function, return ``(model, args, kwargs)``."""
    file, sep, func = spec.rpartition(":")
    if not sep or not file or not func:
        raise UserCodeError(f"expected FILE.py:FUNCTION, got {spec!r}")
    path = Path(file).resolve()
    if not path.is_file():
        raise UserCodeError(f"{file}: no such file")
    name = f"_amp_fx_user_{path.stem}"
    module_spec = importlib.util.spec_from_file_location(name, path)
    if module_spec is None or module_spec.loader is None:
        raise UserCodeError(f"{file}: cannot be imported as a Python file")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module
    try:
        module_spec.loader.exec_module(module)
    except SyntaxError as e:
        raise UserCodeError(f"{e.filename}:{e.lineno}: SyntaxError: {e.msg}") from None
    except Exception as e:
        raise UserCodeError(
            f"{_user_frame(e.__traceback__, path) or file}: importing {file} raised {type(e).__name__}: {e}"
        ) from None
    fn = getattr(module, func, None)
    if fn is None or not callable(fn):
        defined = sorted(
            k
            for k, v in vars(module).items()
            if callable(v) and getattr(v, "__module__", None) == name and not k.startswith("_")
        )
        raise UserCodeError(
            f"{file}: has no function {func!r} (it defines: {', '.join(defined) or 'nothing callable'})"
        )
    try:
        result = fn()
    except Exception as e:
        raise UserCodeError(
            f"{_user_frame(e.__traceback__, path) or file}: {func}() raised {type(e).__name__}: {e}"
        ) from None
    if not (isinstance(result, tuple) and len(result) in (2, 3)):
        raise UserCodeError(
            f"{file}: {func}() must return (model, inputs) or (model, args, kwargs), got "
            f"{type(result).__name__}" + (f" of {len(result)}" if isinstance(result, tuple) else "")
        )
    model, args, kwargs = result if len(result) == 3 else (result[0], *_split_inputs(result[1]))
    if not isinstance(args, tuple):
        args = (args,)
    if not (isinstance(kwargs, dict) and all(isinstance(k, str) for k in kwargs)):
        raise UserCodeError(
            f"{file}: {func}()'s keyword inputs must be a dict with str keys, got {type(kwargs).__name__}"
        )
    if not callable(model):
        raise UserCodeError(f"{file}: {func}() returned a model that is not callable: {type(model).__name__}")
    return model, args, kwargs


def _split_inputs(inputs: Any) -> tuple[Any, dict[str, Any]]:
    """``(model, inputs)``'s inputs as (args, kwargs): a dict is keyword inputs, as a Hugging Face
    batch is passed (``model(**batch)``); anything else positional."""
    if isinstance(inputs, dict):
        return (), inputs
    return inputs, {}


def _check_keywords(tool: Any, kwargs: dict[str, Any], target: str) -> None:
    """Keyword inputs named like one of the tool's own options would be taken as that option."""
    import inspect

    own = [
        n
        for n, p in inspect.signature(tool).parameters.items()
        if p.kind is not inspect.Parameter.VAR_KEYWORD and p.kind is not inspect.Parameter.VAR_POSITIONAL
    ]
    clash = sorted(set(kwargs) & set(own))
    if clash:
        raise UserCodeError(
            f"{target}: keyword inputs {clash} have the names of amp_fx.{tool.__name__}'s own "
            f"options; rename them in the model, or call amp_fx.{tool.__name__} from Python "
            f"with a wrapper function"
        )


_EXAMPLE = """\
TARGET is FILE.py:FUNCTION: a function in your file that takes no arguments and returns the model
and its example inputs. For example, in my_model.py:

    def build():
        model = MyModel()
        return model, (torch.randn(8, 64),)          # positional inputs
        # return model, {"input_ids": ids, "labels": ids}   # keyword inputs (Hugging Face)
        # return model, (x,), {"mask": m}                   # both

then:

    amp-fx explain my_model.py:build --dtype bf16
    amp-fx compare my_model.py:build --dtype fp16
"""

_TARGET_HELP = "FILE.py:FUNCTION, a function returning (model, inputs): see 'amp-fx --help'"
_DTYPE_HELP = "the low-precision dtype (default %(default)s)"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="amp-fx",
        description="Inspect amp_fx's mixed precision.",
        epilog=_EXAMPLE,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="command", required=True)

    def parser(name: str, help: str) -> argparse.ArgumentParser:
        return sub.add_parser(
            name, help=help, description=help, epilog=_EXAMPLE, formatter_class=argparse.RawDescriptionHelpFormatter
        )

    def common(sp: argparse.ArgumentParser, dtype: str, backend: str | None) -> None:
        sp.add_argument("target", help=_TARGET_HELP)
        sp.add_argument("--dtype", default=dtype, choices=["bf16", "fp16", "bfloat16", "float16"], help=_DTYPE_HELP)
        if backend is not None:
            sp.add_argument("--backend", default=backend, help=f"downstream torch.compile backend (default {backend})")
        sp.add_argument(
            "--keep-fp32",
            action="append",
            default=[],
            metavar="MODULE",
            help="keep this submodule in fp32 (repeatable)",
        )

    e = parser("explain", "per-node dtypes, rules and casts; before/after; picture")
    common(e, "bf16", None)
    e.add_argument("--svg", metavar="PATH", help="write the graph picture (SVG via Graphviz)")
    e.add_argument(
        "--low-precision",
        "--fp8",
        dest="fp8",
        default=None,
        choices=_FP8,
        help="also which matmuls run in this low-precision recipe (--fp8: its older spelling)",
    )
    e.add_argument(
        "--table",
        action="store_true",
        help="also every op: its dtype and why, the casts on its inputs, each matmul's fp8 decision",
    )
    c = parser("compare", "op by op against eager torch.autocast")
    common(c, "bf16", "aot_eager")
    c.add_argument("--no-grads", action="store_true", help="skip the gradient comparison")
    c.add_argument(
        "--low-precision",
        "--fp8",
        dest="fp8",
        default=None,
        choices=_FP8,
        help="with fp8 on (this recipe) on both sides: the eager side with torchao's numerics",
    )
    f = parser("find-nonfinite", "the first op or gradient holding inf/NaN")
    common(f, "fp16", None)
    f.add_argument("--no-backward", action="store_true", help="check the forward only")
    f.add_argument(
        "--loss-scale",
        type=float,
        default=1.0,
        help="multiply the loss by this before the backward, as a GradScaler would (default 1.0)",
    )
    a = parser("advise", "which modules to keep in fp32, measured and verified")
    a.add_argument("target", help=_TARGET_HELP)
    a.add_argument("--dtype", default="fp16", choices=["bf16", "fp16", "bfloat16", "float16"], help=_DTYPE_HELP)
    a.add_argument(
        "--loss",
        metavar="FUNCTION",
        help="a function in the same file mapping the output to a scalar loss (gradients are then measured too)",
    )
    a.add_argument(
        "--error-target",
        type=float,
        default=None,
        dest="error_target",
        help="largest end-to-end error vs float64 (default: 32 eps of the dtype)",
    )
    a.add_argument(
        "--low-precision",
        "--fp8",
        dest="fp8",
        default=None,
        choices=_FP8,
        help="advise which matmuls to keep out of fp8 with this recipe (the rest in --dtype)",
    )
    a.add_argument("--json", action="store_true", help="print the advice as JSON")
    a.add_argument("--html", metavar="PATH", help="also write the advice as a self-contained HTML page")
    return p


_FP8 = ["tensorwise", "rowwise", "rowwise_with_gw_hp", "mxfp8", "blockwise", "nvfp4"]
"""amp_fx.Fp8Recipe's values, written out: the parser is built before amp_fx (and torch) is imported."""


def _loss_function(target: str, name: str) -> Any:
    """The function ``name`` of the file that ``target`` (FILE:FUNCTION) names."""
    module = sys.modules.get(f"_amp_fx_user_{Path(target.rpartition(':')[0]).resolve().stem}")
    fn = getattr(module, name, None)
    if fn is None or not callable(fn):
        raise UserCodeError(f"{target.rpartition(':')[0]}: has no function {name!r} for --loss")
    return fn


def _advise(model: Any, inputs: tuple[Any, ...], kwargs: dict[str, Any], args: argparse.Namespace) -> int:
    import amp_fx

    loss_fn = _loss_function(args.target, args.loss) if args.loss else None
    advice = amp_fx.advise(
        model, *inputs, dtype=args.dtype, loss_fn=loss_fn, target=args.error_target, fp8=args.fp8, **kwargs
    )
    print(advice.to_json() if args.json else advice)
    if args.html:
        path = advice.to_html(args.html)
        print(f"wrote {path}", file=sys.stderr if args.json else sys.stdout)
    return 0 if advice.verified else 1


def _keep_fp32_hint(report: Any, args: argparse.Namespace) -> str:
    """The suggested fix as this command's flags (keep_fp32 names; op classes have no flag)."""
    fix = report.suggested_policy
    if fix is None:
        return ""
    names = [k for k in fix.keep_fp32 if isinstance(k, str)]
    lines = []
    if names and not fix.op_classes:
        flags = " ".join(f"--keep-fp32 {n}" for n in names)
        lines.append(f"hint: check the fix with: amp-fx find-nonfinite {args.target} --dtype {args.dtype} {flags}")
    if fix.op_classes:
        lines.append(
            "hint: the fix moves ops to fp32 (op_classes), which has no command-line flag: "
            "pass policy=... to amp_fx.find_nonfinite in Python"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    import amp_fx
    from amp_fx.errors import AmpRunError, EagerError, GraphvizNotFound

    tool = {
        "advise": amp_fx.advise,
        "explain": amp_fx.explain,
        "compare": amp_fx.compare,
        "find-nonfinite": amp_fx.find_nonfinite,
    }[args.command]
    try:
        model, inputs, kwargs = load_target(args.target)
        _check_keywords(tool, kwargs, args.target)
    except UserCodeError as e:
        print(f"amp-fx: error in your code: {e}", file=sys.stderr)
        return 2
    try:
        if args.command == "advise":
            return _advise(model, inputs, kwargs, args)
        policy = amp_fx.Policy(keep_fp32=tuple(args.keep_fp32))
        if args.command == "explain":
            ex = amp_fx.explain(model, *inputs, dtype=args.dtype, policy=policy, fp8=args.fp8, **kwargs)
            print(ex)
            if args.table:
                print(f"\n{ex.table()}")
            if args.svg:
                try:
                    print(f"\nwrote {ex.to_svg(args.svg)}")
                except GraphvizNotFound as g:
                    print(f"\n{g}")
            return 0
        if args.command == "compare":
            report = amp_fx.compare(
                model,
                *inputs,
                dtype=args.dtype,
                policy=policy,
                backend=args.backend,
                grads=not args.no_grads,
                fp8=args.fp8,
                **kwargs,
            )
            print(report)
            return 0 if report.ok else 1
        found = amp_fx.find_nonfinite(
            model,
            *inputs,
            dtype=args.dtype,
            policy=policy,
            backward=not args.no_backward,
            loss_scale=args.loss_scale,
            **kwargs,
        )
        print(found)
        hint = _keep_fp32_hint(found, args)
        if hint:
            print(hint)
        return 1 if found.found else 0
    except UserCodeError as e:
        print(f"amp-fx: error in your code: {e}", file=sys.stderr)
        return 2
    except EagerError as e:
        cause = e.__cause__
        where = (
            _user_frame(cause.__traceback__, Path(args.target.rpartition(":")[0]).resolve())
            if cause is not None
            else ""
        )
        print(f"amp-fx: error in your model{' at ' + where if where else ''}: {e}", file=sys.stderr)
        return 2
    except (amp_fx.AmpFxError, AmpRunError) as e:
        print(f"amp-fx: {e}", file=sys.stderr)
        return 1
    except (ValueError, TypeError) as e:
        print(f"amp-fx: {e}", file=sys.stderr)
        return 2
