"""Everyday use (issue 19): generate() and in-place compilation, hooks added after compile,
torch._dynamo.reset(), unknown options, and installing without Triton.

The reference is eager ``torch.autocast`` throughout, bit for bit (backend="aot_eager").
"""

from __future__ import annotations

import copy
import importlib.metadata
import importlib.util
import inspect
import io
import os
import pickle
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import amp_fx
from amp_fx.errors import AmpFxError, AmpFxWarning
from amp_fx.testing.generate import ARCHS, NEW_TOKENS, greedy_generate, prompt, tiny_causal_lm

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
ROOT = Path(__file__).resolve().parents[2]


class TwoLayer(torch.nn.Module):
    """A forward of its own (amp_fx compiles a copy of it) and a method that calls self(...)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(8, 16)
        self.fc2 = torch.nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))

    def twice(self, x: torch.Tensor) -> torch.Tensor:
        return self(self(x))

    def direct(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward(x)


def _eager(model: torch.nn.Module, fn, dtype: str):
    with torch.autocast("cpu", dtype=DTYPES[dtype]):
        return fn(model)


# --- 1. generate() and in-place compilation ------------------------------------------------------


# Both forms of compile, each with one dtype, keep the cases (about 6 s of CPU each) to six.
@pytest.mark.slow
@pytest.mark.parametrize(("dtype", "mode"), [("bf16", "inplace"), ("fp16", "wrap")])
@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("arch", ARCHS)
def test_generate_matches_eager_autocast(arch: str, cache: str, dtype: str, mode: str) -> None:
    """Greedy generate with the KV cache: the same tokens and bitwise logits and scores as eager
    autocast, with no more graphs than torch's own in-place compile captures on the same calls
    (torch.compile(model).generate compiles nothing: it runs the original forward)."""
    if arch == "llama" and cache == "static":
        pytest.skip(
            "eager autocast itself fails here (no reference): transformers' StaticCache keeps "
            "fp32 buffers and Llama's k/v projections write autocast's low-precision values "
            "into them (index_copy_ dtype mismatch)"
        )
    pytest.importorskip("transformers", reason="the generate() cases need transformers")
    model = tiny_causal_lm(arch)
    ids = prompt()
    ref = _eager(model, lambda m: greedy_generate(m, ids, cache), dtype)

    counter = CompileCounterWithBackend("aot_eager")
    model.compile(backend=counter)
    _eager(model, lambda m: greedy_generate(m, ids, cache), dtype)
    model._compiled_call_impl = None
    torch._dynamo.reset()

    # One graph per frame, as torch.compile's (regions=False): compiled regions capture a graph per
    # block class and per module around them, more than torch's whole-model compile by design.
    compiled = amp_fx.compile(model, dtype=dtype, backend="aot_eager", inplace=(mode == "inplace"), regions=False)
    assert (compiled is model) == (mode == "inplace")
    out = greedy_generate(compiled, ids, cache)
    assert torch.equal(out.sequences, ref.sequences)
    for ours, theirs in ((out.logits, ref.logits), (out.scores, ref.scores)):
        assert len(ours) == len(theirs) == NEW_TOKENS
        for a, b in zip(ours, theirs, strict=True):
            assert a.dtype == b.dtype
            assert torch.equal(a, b)
    graphs = len(amp_fx.records(compiled))
    assert 0 < graphs <= counter.frame_count


def test_inplace_compile_module_semantics() -> None:
    """compile(inplace=True) returns the module itself: its call and methods calling self(...) run
    amp_fx's graphs (bitwise eager autocast), forward() stays eager, state_dict keys and records
    are the module's, copies are compiled again, compiling again changes options, uncompile undoes."""
    torch.manual_seed(0)
    model = TwoLayer()
    keys = list(model.state_dict())
    x = torch.randn(4, 8)
    eager = _eager(model, lambda m: m.twice(x), "bf16")
    fp32 = model(x)

    assert amp_fx.compile(model, dtype="bf16", backend="aot_eager", inplace=True) is model
    assert torch.equal(model.twice(x), eager)
    assert model(x).dtype == torch.bfloat16
    assert torch.equal(model.forward(x), fp32)  # as nn.Module.compile(): forward() is the eager forward
    assert list(model.state_dict()) == keys
    assert len(amp_fx.records(model)) >= 1

    for copied in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        with torch.no_grad():
            copied.fc1.weight.mul_(2)  # its own parameters, not the original's
        expected = _eager(copied, lambda m: m(x), "bf16")
        assert torch.equal(copied(x), expected)
        assert len(amp_fx.records(copied)) >= 1
        assert amp_fx.records(copied) is not amp_fx.records(model)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert torch.equal(loaded(x), _eager(loaded, lambda m: m(x), "bf16"))

    amp_fx.compile(model, dtype="fp16", backend="aot_eager", inplace=True)  # again: new options
    assert torch.equal(model(x), _eager(model, lambda m: m(x), "fp16"))
    with pytest.raises(ValueError, match="already compiled in place"):
        amp_fx.compile(model)
    assert amp_fx.uncompile(model) is model
    assert torch.equal(model(x), fp32)
    with pytest.raises(ValueError, match="not compiled in place"):
        amp_fx.uncompile(model)
    with pytest.raises(TypeError, match="nn.Module"):
        amp_fx.compile(lambda t: t, inplace=True)


def test_wrapper_methods_run_the_compiled_forward() -> None:
    """A method of the wrapped module that calls self(...) runs amp_fx's graphs; the original module
    stays eager outside it; a method that reaches the forward as self.forward(...) is reported."""
    torch.manual_seed(0)
    model = TwoLayer()
    x = torch.randn(4, 8)
    compiled = amp_fx.compile(model, dtype="bf16", backend="aot_eager", strict=False)
    assert torch.equal(compiled.twice(x), _eager(model, lambda m: m.twice(x), "bf16"))
    assert model._compiled_call_impl is None
    assert model(x).dtype == torch.float32
    with pytest.warns(AmpFxWarning, match=r"\.direct\(\.\.\.\) called self\.forward"):
        assert torch.equal(compiled.direct(x), model(x))
    assert "forward" not in model.__dict__
    strict = amp_fx.compile(TwoLayer(), backend="aot_eager", strict=True)
    with pytest.raises(AmpFxError, match="self.forward"):
        strict.direct(x)


# --- 2. hooks added or removed after compile -----------------------------------------------------


@pytest.mark.parametrize("where", ["root", "fc1"])
@pytest.mark.parametrize("kind", ["forward", "forward_pre"])
def test_hook_added_and_removed_after_compile(kind: str, where: str) -> None:
    """A hook registered after the first call runs (a recompile), as in eager autocast; removed,
    it stops. Dynamo's own setting (skip_nnmodule_hook_guards) is left as it was."""
    torch.manual_seed(0)
    model = TwoLayer()
    x = torch.randn(4, 8)
    compiled = amp_fx.compile(model, dtype="bf16", backend="aot_eager")
    skip_before = torch._dynamo.config.skip_nnmodule_hook_guards
    assert torch.equal(compiled(x), _eager(model, lambda m: m(x), "bf16"))

    target = model if where == "root" else model.fc1
    if kind == "forward":
        handle = target.register_forward_hook(lambda mod, args, out: out * 3 + 1)
    else:
        handle = target.register_forward_pre_hook(lambda mod, args: (args[0] * 3 + 1,))
    with_hook = _eager(model, lambda m: m(x), "bf16")
    assert torch.equal(compiled(x), with_hook)
    handle.remove()
    without = _eager(model, lambda m: m(x), "bf16")
    assert not torch.equal(with_hook, without)
    assert torch.equal(compiled(x), without)
    assert torch._dynamo.config.skip_nnmodule_hook_guards == skip_before


# --- 3. torch._dynamo.reset() --------------------------------------------------------------------


class Reused(torch.nn.Module):
    """One weight used twice in one graph (one shared cast: no split)."""

    def __init__(self, graph_break: bool) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)
        self.graph_break = graph_break

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.fc(x))
        if self.graph_break:
            torch._dynamo.graph_break()
        return self.fc(h)


def test_reset_starts_afresh() -> None:
    """After torch._dynamo.reset() the model recompiles and nothing is reported: Dynamo's frame
    and compile ids restart, which must not look like DDPOptimizer's pieces or a graph break."""
    torch.manual_seed(0)
    model = Reused(graph_break=False)
    x = torch.randn(4, 8)
    compiled = amp_fx.compile(model, dtype="bf16", backend="aot_eager", strict=True)
    compiled(x).sum().backward()
    expected = [p.grad.clone() for p in model.parameters()]
    for _ in range(2):
        torch._dynamo.reset()
        model.zero_grad()
        out = compiled(x)
        out.sum().backward()
        assert torch.equal(out, _eager(model, lambda m: m(x), "bf16"))
        assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), expected, strict=True))


def test_reset_keeps_reporting_a_real_split() -> None:
    """The negative twin: a weight used on both sides of a graph break is still reported after a
    reset, with the graph-break reason."""
    compiled = amp_fx.compile(Reused(graph_break=True), backend="aot_eager", strict=True)
    x = torch.randn(4, 8)
    for _ in range(2):
        with pytest.raises(AmpFxError, match="both sides of a graph break"):
            compiled(x)
        torch._dynamo.reset()


# --- 4. unknown keyword arguments -----------------------------------------------------------------


def _keyword_only(fn) -> list[str]:
    return [n for n, p in inspect.signature(fn).parameters.items() if p.kind is p.KEYWORD_ONLY]


@pytest.mark.parametrize("key", ["dtyp", "no_such_option"])
def test_unknown_keyword_is_refused_at_compile(key: str) -> None:
    with pytest.raises(TypeError) as info:
        amp_fx.compile(TwoLayer(), **{key: "bf16"})
    message = str(info.value)
    assert repr(key) in message
    for name in _keyword_only(amp_fx.compile) + [n for n in _keyword_only(torch.compile) if n != "backend"]:
        assert name in message, name
    assert ("did you mean 'dtype'" in message) == (key == "dtyp")


def test_torch_compile_keywords_still_pass() -> None:
    torch.manual_seed(0)
    model = TwoLayer()
    x = torch.randn(4, 8)
    compiled = amp_fx.compile(model, backend="aot_eager", fullgraph=True, dynamic=False)
    assert torch.equal(compiled(x), _eager(model, lambda m: m(x), "bf16"))


# --- 5. installing without Triton -----------------------------------------------------------------


_NO_TRITON = textwrap.dedent("""
    import sys, warnings
    sys.modules["triton"] = None  # import triton raises ImportError, as where no wheel exists
    warnings.simplefilter("error")
    import torch, amp_fx
    from amp_fx.kernels.unscale import unscale_check_norm_

    torch.manual_seed(0)
    grads = [torch.randn(1000) * 1e3, torch.randn(37).half(), torch.randn(5).bfloat16()]
    grads[1][3] = float("inf")
    ref = [g.clone() for g in grads]
    found, ref_found, inv = torch.zeros(()), torch.zeros(()), torch.tensor(2.0 ** -10)
    total = unscale_check_norm_(grads, found, inv)
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        group = [g for g in ref if g.dtype == dtype]
        torch._amp_foreach_non_finite_check_and_unscale_(group, ref_found, inv)
    assert all(torch.equal(a, b) for a, b in zip(grads, ref)), "unscale differs from torch's kernel"
    assert torch.equal(found, ref_found)

    model = torch.nn.Linear(8, 8)
    twin = torch.nn.Linear(8, 8)
    twin.load_state_dict(model.state_dict())
    x = torch.randn(4, 8)
    for m, scaler in ((model, amp_fx.GradScaler("cpu")), (twin, torch.amp.GradScaler("cpu"))):
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = m(x).float().square().mean()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters()))
    assert "triton" not in [k for k, v in sys.modules.items() if v is not None]
    print("ok")
""")


def test_cpu_path_without_triton() -> None:
    """With ``import triton`` failing, amp_fx imports, warns nothing, and its unscale kernel and
    GradScaler step are bitwise torch's."""
    result = subprocess.run(
        [sys.executable, "-c", _NO_TRITON],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**_env(), "PYTHONPATH": str(ROOT)},
        timeout=300,
    )
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-3000:]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    return env


def _environments(*versions: str) -> list[dict[str, str]]:
    return [
        {
            "platform_system": system,
            "sys_platform": plat,
            "platform_machine": machine,
            "python_version": version,
            "python_full_version": version + ".0",
            "implementation_name": "cpython",
            "os_name": "nt" if system == "Windows" else "posix",
        }
        for system, plat in (("Linux", "linux"), ("Darwin", "darwin"), ("Windows", "win32"))
        for machine in ("x86_64", "aarch64", "arm64", "AMD64")
        for version in versions or ("3.10", "3.12", "3.14", "3.16")
    ]


def _can_build_wheels() -> bool:
    """setuptools builds wheels itself from 70.1 on; before, only with the ``wheel`` package."""
    try:
        import setuptools
        from packaging.version import Version
    except ImportError:
        return False
    return Version(setuptools.__version__) >= Version("70.1") or importlib.util.find_spec("wheel") is not None


def _wheel_requirements(tmp_path: Path) -> list[str]:
    """Requires-Dist of the wheel built from this checkout (pip wheel, no build isolation)."""
    src = tmp_path / "src"
    src.mkdir()
    shutil.copy(ROOT / "pyproject.toml", src)
    shutil.copy(ROOT / "README.md", src)
    shutil.copytree(ROOT / "amp_fx", src / "amp_fx", ignore=shutil.ignore_patterns("__pycache__"))
    build = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            str(src),
            "-w",
            str(tmp_path / "dist"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert build.returncode == 0, build.stderr[-3000:]
    (wheel,) = (tmp_path / "dist").glob("amp_fx-*.whl")
    with zipfile.ZipFile(wheel) as z:
        metadata = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    return [line.split(":", 1)[1].strip() for line in metadata.splitlines() if line.startswith("Requires-Dist:")]


def _pyproject_requirements() -> list[str]:
    tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml needs Python 3.11")
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]


def test_wheel_declares_triton_only_where_torch_does(tmp_path: Path) -> None:
    """The built wheel's Requires-Dist names triton with a platform marker: never on macOS or
    Windows, where triton has no wheel; and, where this torch declares triton itself, on exactly
    the platforms torch's own marker selects. (An environment whose setuptools cannot build
    wheels reads the same list from pyproject.toml.)"""
    requirements = pytest.importorskip("packaging.requirements", reason="reading markers needs packaging")
    lines = _wheel_requirements(tmp_path) if _can_build_wheels() else _pyproject_requirements()
    (triton,) = [r for r in map(requirements.Requirement, lines) if r.name == "triton"]
    assert triton.marker is not None, "triton must not be required on every platform"
    envs = _environments()
    assert not any(triton.marker.evaluate(e) for e in envs if e["platform_system"] in ("Darwin", "Windows"))
    assert any(triton.marker.evaluate(e) for e in envs)
    torchs = [requirements.Requirement(r) for r in importlib.metadata.requires("torch") or []]
    theirs = [r for r in torchs if r.name == "triton" and r.marker is not None]
    if not theirs:
        pytest.skip(f"torch {torch.__version__} declares no triton (a CPU wheel): checked macOS/Windows only")
    # torch may declare more than one (per extra); the unconditional one is the install's
    (their,) = [r for r in theirs if "extra" not in str(r.marker)]
    here = f"{sys.version_info.major}.{sys.version_info.minor}"  # a Python this torch exists for
    for env in _environments(here):
        assert triton.marker.evaluate(env) == their.marker.evaluate(env), env
