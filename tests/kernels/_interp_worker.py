"""Run the Triton unscale kernel through the interpreter on every case; save inputs and outputs.

Usage (from the repository root; ``test_unscale_triton.py`` runs it)::

    TRITON_INTERPRET=1 python tests/kernels/_interp_worker.py RESULTS.pt

A separate process because ``TRITON_INTERPRET`` is read when triton is first imported, and the
pytest process may already have imported triton (via torch._inductor) in compiled mode. This
script only runs the kernel; the comparison with torch happens in the test process, so a
failure there shows up as an ordinary pytest assertion.
"""

from __future__ import annotations

import os
import sys
from typing import Any

if os.environ.get("TRITON_INTERPRET") != "1" or "triton" in sys.modules:
    raise SystemExit("run with TRITON_INTERPRET=1 in the environment, before triton is imported")

# Run as a script, this file's folder is sys.path[0]: _unscale_cases imports without a path edit.
import torch  # noqa: E402

import tests.kernels._unscale_cases as _unscale_cases  # noqa: E402
from amp_fx.kernels import triton_unscale, unscale  # noqa: E402


def _patch_triton_language_once_per_launch() -> None:
    """Skip the interpreter's repeated patching of ``triton.language`` inside one kernel launch.

    Triton's interpreter (3.6 to 3.9) patches the ``triton.language`` modules a function sees
    (``_patch_lang``: ``inspect.getmembers`` over four modules) when a kernel launches
    (``GridExecutor.__call__``, restored after the launch) and again on every call of a
    ``@triton.jit`` function from inside the kernel (``InterpretedFunction.__call__``: our helpers,
    and ``tl.zeros``, ``tl.max``, ``tl.sum``, themselves jit functions), though those patches are
    never undone inside the launch: from the second time on, the same modules are patched again
    to the same values. Here a nested call patches only the modules not yet patched in this
    launch; the launch itself patches as before, so what runs is what the interpreter runs (the
    worker's outputs are bitwise the same). If the interpreter's layout changes, nothing is
    patched here and the worker is only slower.
    """
    from triton.runtime import interpreter

    if not all(hasattr(interpreter, name) for name in ("_patch_lang", "GridExecutor", "tl")):
        return
    patch_lang, launch = interpreter._patch_lang, interpreter.GridExecutor.__call__
    launches: list[set[int]] = []  # per launch in progress: the modules patched in it so far

    def launch_tracked(self: Any, *args: Any, **kwargs: Any) -> Any:
        launches.append(set())
        try:
            return launch(self, *args, **kwargs)
        finally:
            launches.pop()

    def patch_lang_unless_patched(fn: Any) -> Any:
        tl = interpreter.tl
        langs = {id(v) for v in fn.__globals__.values() if isinstance(v, type(tl)) and v in (tl, tl.core)}
        if launches and langs and langs <= launches[-1]:
            return interpreter._LangPatchScope()
        scope = patch_lang(fn)
        if launches:
            launches[-1] |= langs
        return scope

    interpreter.GridExecutor.__call__ = launch_tracked
    interpreter._patch_lang = patch_lang_unless_patched


def _run(case: _unscale_cases.Case, variant: str) -> dict[str, Any]:
    grads = case.grads()
    inputs = [g.clone() for g in grads]
    found_inf = torch.full((), case.found_inf_start, dtype=torch.float32)
    inv_scale = torch.tensor(case.inv_scale, dtype=torch.float32)
    sum_sq = None
    flags = torch.zeros(len(grads)) if variant.endswith("flags") else None
    if variant == "op_flags":
        unscale.unscale_check_(grads, found_inf, inv_scale, flags=flags)
    elif variant == "small_norm_flags":
        sum_sq = triton_unscale.launch_unscale_check(
            grads,
            found_inf,
            inv_scale,
            compute_norm=True,
            flags=flags,
            block=_unscale_cases.SMALL_BLOCK,
            chunk=_unscale_cases.SMALL_CHUNK,
        )
    elif variant == "op_check":
        unscale.unscale_check_(grads, found_inf, inv_scale)
    elif variant == "op_norm":
        sum_sq = unscale.unscale_check_norm_(grads, found_inf, inv_scale)
    elif variant in ("small_check", "small_norm"):
        sum_sq = triton_unscale.launch_unscale_check(
            grads,
            found_inf,
            inv_scale,
            compute_norm=variant == "small_norm",
            block=_unscale_cases.SMALL_BLOCK,
            chunk=_unscale_cases.SMALL_CHUNK,
        )
    else:
        raise ValueError(f"unknown variant {variant!r}")
    return {
        "inputs": inputs,
        "outputs": grads,
        "strides": [g.stride() for g in grads],
        "found_inf": found_inf,
        "sum_sq": sum_sq,
        "flags": flags,
    }


def main(out_path: str) -> None:
    _patch_triton_language_once_per_launch()
    results: dict[str, Any] = {
        "is_interpreted": triton_unscale.is_interpreted(),
        "use_triton_cpu": unscale._use_triton(torch.device("cpu")),
        "cases": {},
    }
    for case in _unscale_cases.all_cases():
        for variant in ("op_check", "op_norm", "small_check", "small_norm", "op_flags", "small_norm_flags"):
            results["cases"][(case.name, variant)] = _run(case, variant)
    torch.save(results, out_path)


if __name__ == "__main__":
    main(sys.argv[1])
