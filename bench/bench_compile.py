"""amp_fx.compile vs torch.compile under torch.autocast: compile time, pass time, step time, casts.

    python bench/bench_compile.py                          # bf16, backends aot_eager and inductor
    python bench/bench_compile.py --dtypes bf16 fp16 --steps 50
    python bench/bench_compile.py --model hf-llama --layers 6 --d-model 128 --backends inductor \
        --compile-only --compile-repeats 5              # cold compile only, 5 fresh processes each
    python bench/bench_compile.py --model hf-gpt2 --layers 6 --d-model 128 --backends inductor \
        --compile-only --compile-repeats 6 --concurrent # on a machine other processes load
    python bench/bench_compile.py --model hf-gpt2 --layers 6 --d-model 128 --profile   # where it goes
    python bench/bench_compile.py --model hf-llama --d-model 128 --depth-sweep 2 8 32 --backends inductor
        # compiled regions (docs/regions.md): cold and warm first step per depth, step time

The model is the tests' small causal transformer LM (``amp_fx.testing.zoo.transformer_lm``: SDPA blocks,
LayerNorm, GELU MLP, tied embedding head; 2 layers, d_model 64, seq 32, batch 4 by default), or with
``--model hf-gpt2`` / ``hf-llama`` transformers' GPT2LMHeadModel / LlamaForCausalLM built from a config
of those sizes (random init, no download; the loss is the mean square of the fp32 logits).

* compile: wall time of the first forward+backward after ``torch._dynamo.reset()``, for
  ``amp_fx.compile(model, backend=B)`` and for ``torch.compile(model, backend=B)`` called under
  ``torch.autocast`` (same backend, same dtype). Each is timed in a fresh process with an empty
  inductor cache directory (unless ``--keep-cache``): the two graphs lower to largely the same
  kernels, so in one process whichever compiled second would reuse the first one's C++ builds. A
  warm-up compile of an unrelated nn.Linear in that process pays the one-time imports. amp_fx's
  own passes are timed from ``GraphRecord.pass_seconds`` (capture, insert_casts, fold_casts), also
  per 1,000 nodes of the captured ATen graph. With ``--compile-repeats N`` the two alternate
  (amp_fx first, then the baseline first, ...), so load from other processes hits both alike; the
  ratio column is the median of the N per-pair ratios, with their min and max. Beside wall time,
  CPU time: of the timed process and the children it waited for (with ``--compile-threads 1``
  inductor runs every C++ build from that process, so this counts all of the compile, and load
  from other processes skews it far less than wall time), and of the timed process alone (main
  CPU: Dynamo, amp_fx's passes, AOTAutograd, inductor's Python; the C++ builds of the two
  compiles are the same kernels). With ``--concurrent`` each pair's two processes run at the same
  time and start their timed call together, so load from other processes that comes and goes hits
  both alike (on a shared machine it moves sequential wall times by tens of percent); read the
  CPU ratios then: the wall ratio leans towards 1, since the one that finishes first leaves the
  other more of the machine.
* ``--profile``: one cold compile of each in a fresh process under cProfile, timed in CPU time of
  that process (so without the C++ builds, which inductor runs in other processes; empty inductor
  cache, the same warm-up); prints each one's top functions by cumulative time and the functions whose
  cumulative time differs most between amp_fx and the baseline (cProfile's overhead inflates
  Python-heavy code, so read the differences, not the totals).
* step: forward+backward, amp_fx and the baseline alternating step by step in one run so machine
  noise hits both alike; median and p10/p90 over ``--steps`` steps after ``--warmup``; the ratio is
  amp_fx's median over the baseline's.
* ``--depth-sweep 2 8 32``: compiled regions (``regions=True``, docs/regions.md)
  against the whole graph. For each depth, the first forward+backward in a fresh process with an
  empty inductor cache (cold), then again in a second fresh process on the cache the first one
  filled (warm: a restart), for amp_fx in regions, amp_fx as one graph (``regions=False``),
  ``torch.compile`` + autocast of the whole model, and of each repeated block alone
  (``block.compile()``, eager elsewhere); then the steady step time of the three whole-model
  ones in one process, alternating step by step. Ratios: each cold first step over amp_fx's at
  the smallest depth and over ``torch.compile`` + autocast's at the same depth; each step time
  over amp_fx's whole-graph step.
* casts: ``aten._to_copy`` calls in one eager-autocast forward (counted with a TorchDispatchMode;
  autocast's weight casts are cached per region) against the ``_to_copy`` nodes left in amp_fx's
  rewritten graphs (``GraphRecord.casts``), user casts included in both.

This CPU has no bf16/fp16 arithmetic units: low-precision matmuls run emulated, ~25x slower than
fp32, so no speed-up over fp32 is expected. Only the ratios between amp_fx and torch.compile +
autocast mean anything here.
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import json
import os
import pstats
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch._dynamo
from tabulate import tabulate
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode

import amp_fx
from amp_fx.backend.regions import repeated_blocks
from amp_fx.testing import zoo
from amp_fx.testing.bench import machine_lines, percentile

LossFn = Callable[[object], Tensor]

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
PASSES = ("capture", "insert_casts", "fold_casts")


class _CountCasts(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.casts = 0

    def __torch_dispatch__(
        self, func: torch._ops.OpOverload, types: object, args: tuple[object, ...] = (), kwargs: dict | None = None
    ) -> object:
        if func is torch.ops.aten._to_copy.default:
            self.casts += 1
        return func(*args, **(kwargs or {}))


def eager_casts_per_forward(model: nn.Module, inputs: tuple[Tensor, ...], dtype: torch.dtype) -> int:
    model = copy.deepcopy(model)
    counter = _CountCasts()
    with torch.autocast("cpu", dtype=dtype), counter:
        model(*inputs)
    return counter.casts


Step = Callable[[], None]


def _amp_fx_step(compiled: nn.Module, model: nn.Module, inputs: tuple[Tensor, ...], loss_fn: LossFn) -> Step:
    def run() -> None:
        model.zero_grad(set_to_none=True)
        loss_fn(compiled(*inputs)).backward()

    return run


def _autocast_step(
    compiled: nn.Module, model: nn.Module, inputs: tuple[Tensor, ...], loss_fn: LossFn, dtype: torch.dtype
) -> Step:
    def run() -> None:
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=dtype):
            loss = loss_fn(compiled(*inputs))
        loss.backward()

    return run


@dataclass
class Compiled:
    amp_fx: Step
    baseline: Step
    amp_fx_module: amp_fx.AmpCompiledModule


class _HFLogits(nn.Module):
    """A Hugging Face causal LM seen as ``ids -> logits``."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: Tensor) -> Tensor:
        return self.model(input_ids=ids).logits


def _hf_model(args: argparse.Namespace) -> nn.Module:
    import transformers

    if args.model == "hf-gpt2":
        config = transformers.GPT2Config(
            vocab_size=args.vocab,
            n_positions=max(args.seq, 64),
            n_embd=args.d_model,
            n_layer=args.layers,
            n_head=args.heads,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            use_cache=False,
        )
        return transformers.GPT2LMHeadModel(config)
    config = transformers.LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.d_model,
        intermediate_size=2 * args.d_model,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.heads,
        max_position_embeddings=max(args.seq, 64),
        use_cache=False,
    )
    return transformers.LlamaForCausalLM(config)


def _fp32_sq_mean(out: object) -> Tensor:
    assert isinstance(out, Tensor)
    return out.float().square().mean()


def _build(args: argparse.Namespace) -> tuple[nn.Module, tuple[Tensor, ...], LossFn]:
    if args.model == "transformer_lm":
        return zoo.transformer_lm(
            vocab=args.vocab,
            d_model=args.d_model,
            n_heads=args.heads,
            n_layers=args.layers,
            seq=args.seq,
            batch=args.batch,
        )
    torch.manual_seed(zoo.SEED)
    model = _HFLogits(_hf_model(args)).train()
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(zoo.SEED + 1))
    return model, (ids,), _fp32_sq_mean


def _compile_pair(args: argparse.Namespace, backend: str, dtype: torch.dtype) -> Compiled:
    """Compile both (the first call, with backward, compiles); both stay usable together."""
    model, inputs, loss_fn = _build(args)
    base_model = copy.deepcopy(model)
    torch._dynamo.reset()
    compiled = amp_fx.compile(model, dtype=dtype, backend=backend)
    amp_step = _amp_fx_step(compiled, model, inputs, loss_fn)
    amp_step()
    base_step = _autocast_step(torch.compile(base_model, backend=backend), base_model, inputs, loss_fn, dtype)
    base_step()
    return Compiled(amp_step, base_step, compiled)


def _blocks_compiled(model: nn.Module, backend: str) -> nn.Module:
    """``model`` with each repeated block ``.compile()``d (torchtitan's per-block compile; what
    transformers' and diffusers' ``compile_repeated_blocks`` do), eager elsewhere."""
    for _, block in repeated_blocks(model):
        block.compile(backend=backend)
    return model


def _cpu_seconds() -> float:
    """CPU time of this process and of the children it has waited for (the C++ compiler runs
    that inductor starts itself; not its compile workers' with more than one compile thread)."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def _compile_once(args: argparse.Namespace) -> None:
    """Child process: time one cold compile (first forward+backward) and print it as JSON."""
    backend, dtype = args.child_backend, DTYPES[args.child_dtype]
    _warm_up_imports([backend])
    model, inputs, loss_fn = _build(args)
    torch._dynamo.reset()
    if args.child in ("amp_fx", "amp_fx_whole"):
        compiled = amp_fx.compile(model, dtype=dtype, backend=backend, regions=args.child == "amp_fx")
        run = _amp_fx_step(compiled, model, inputs, loss_fn)
    elif args.child == "baseline_blocks":
        run = _autocast_step(_blocks_compiled(model, backend), model, inputs, loss_fn, dtype)
    else:
        run = _autocast_step(torch.compile(model, backend=backend), model, inputs, loss_fn, dtype)
    # CPU time of this process: the C++ builds (other processes) and waiting on them are left
    # out, and so is most of the noise from other processes' load.
    profiler = cProfile.Profile(time.process_time) if args.child_profile else None
    if args.child_barrier:
        _wait_for_parties(args.child_barrier, args.child, args.child_parties)
    cpu0, main0 = _cpu_seconds(), time.process_time()
    t0 = time.perf_counter()
    if profiler is not None:
        profiler.runcall(run)
    else:
        run()
    seconds = time.perf_counter() - t0
    out: dict[str, object] = {
        "seconds": seconds,
        "cpu_seconds": _cpu_seconds() - cpu0,
        "main_cpu_seconds": time.process_time() - main0,
    }
    if profiler is not None:
        profiler.dump_stats(args.child_profile)
    if args.child in ("amp_fx", "amp_fx_whole"):
        records = compiled.amp_fx_records
        out.update(
            graphs=len(records),
            nodes=sum(len(r.captured.graph.nodes) for r in records),
            passes={p: sum(r.pass_seconds[p] for r in records) for p in PASSES},
        )
    print(_CHILD_MARK + json.dumps(out))


_CHILD_MARK = "amp_fx-bench-compile-result: "


def _cold_compile(
    args: argparse.Namespace, which: str, backend: str, dtype_name: str, profile: str | None = None
) -> dict:
    """Run :func:`_compile_once` in a fresh process with an empty inductor cache directory, so
    neither compile profits from kernels the other one built (their kernels largely coincide).
    With ``profile``, the first forward+backward runs under cProfile, its stats written there."""
    return _cold_compiles(args, [which], backend, dtype_name, profile=profile)[0]


def _cold_compiles(
    args: argparse.Namespace,
    whiches: list[str],
    backend: str,
    dtype_name: str,
    profile: str | None = None,
    concurrent: bool = False,
) -> list[dict]:
    """:func:`_cold_compile` for each of ``whiches``, one after the other, or with ``concurrent``
    at the same time: the processes start together and wait for each other before the timed
    call, so both compile under the same load from other processes (and from each other)."""
    sizes = [
        f"--{k.replace('_', '-')}={getattr(args, k)}"
        for k in ("model", "layers", "d_model", "heads", "seq", "batch", "vocab")
    ]
    if profile is not None:
        sizes.append(f"--child-profile={profile}")
    env = dict(os.environ)
    if args.compile_threads is not None:
        env["TORCHINDUCTOR_COMPILE_THREADS"] = str(args.compile_threads)
    barrier = tempfile.mkdtemp(prefix="amp_fx_bench_barrier_") if concurrent else None
    caches: list[str] = []
    results = []
    try:
        procs = []
        for which in whiches:
            child_env = dict(env)
            if not args.keep_cache:
                caches.append(tempfile.mkdtemp(prefix=_CACHE_PREFIX))
                child_env["TORCHINDUCTOR_CACHE_DIR"] = caches[-1]
            command = [
                sys.executable,
                __file__,
                *sizes,
                "--child",
                which,
                "--child-backend",
                backend,
                "--child-dtype",
                dtype_name,
            ]
            if barrier is not None:
                command += [f"--child-barrier={barrier}", f"--child-parties={len(whiches)}"]
            proc = subprocess.Popen(command, env=child_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            procs.append((which, proc))
            if not concurrent:
                results.append(_child_result(which, proc, backend, dtype_name))
        if concurrent:
            results = [_child_result(which, proc, backend, dtype_name) for which, proc in procs]
    finally:
        for folder in (*caches, *([barrier] if barrier else [])):
            shutil.rmtree(folder, ignore_errors=True)
    return results


def _child_result(which: str, proc: subprocess.Popen, backend: str, dtype_name: str) -> dict:
    stdout, stderr = proc.communicate()
    lines = [ln for ln in stdout.splitlines() if ln.startswith(_CHILD_MARK)]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"compile-timing child failed ({which}, {backend}, {dtype_name}):\n{stderr[-3000:]}")
    return json.loads(lines[-1][len(_CHILD_MARK) :])


SWEEP_KINDS = ("amp_fx", "amp_fx_whole", "baseline", "baseline_blocks")
_SWEEP_LABELS = {
    "amp_fx": "amp_fx (regions)",
    "amp_fx_whole": "amp_fx (whole graph)",
    "baseline": "torch.compile+autocast (whole)",
    "baseline_blocks": "torch.compile+autocast (per block)",
}


def _cold_then_warm(args: argparse.Namespace, which: str, backend: str, dtype_name: str) -> tuple[dict, dict]:
    """:func:`_compile_once` in a fresh process with an empty inductor cache (cold), then in a
    second fresh process on that cache (warm: the first step after a restart)."""
    cache = tempfile.mkdtemp(prefix=_CACHE_PREFIX)
    keep = args.keep_cache
    try:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache
        args.keep_cache = True  # the children use the environment's cache directory: this one
        cold = _cold_compiles(args, [which], backend, dtype_name)[0]
        warm = _cold_compiles(args, [which], backend, dtype_name)[0]
    finally:
        args.keep_cache = keep
        os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
        shutil.rmtree(cache, ignore_errors=True)
    return cold, warm


def _sweep_steps(args: argparse.Namespace, backend: str, dtype: torch.dtype) -> dict[str, list[float]]:
    """Steady step times of amp_fx in regions, amp_fx whole-graph and torch.compile+autocast (whole),
    in this process, alternating step by step."""
    model, inputs, loss_fn = _build(args)
    models = {k: copy.deepcopy(model) for k in ("amp_fx", "amp_fx_whole", "baseline")}
    torch._dynamo.reset()
    steps: dict[str, Step] = {
        k: _amp_fx_step(amp_fx.compile(m, dtype=dtype, backend=backend, regions=k == "amp_fx"), m, inputs, loss_fn)
        for k, m in models.items()
        if k != "baseline"
    }
    base = models["baseline"]
    steps["baseline"] = _autocast_step(torch.compile(base, backend=backend), base, inputs, loss_fn, dtype)
    for run in steps.values():
        for _ in range(args.warmup):
            run()
    times: dict[str, list[float]] = {k: [] for k in steps}
    order = list(steps)
    for i in range(args.steps):
        for k in order[i % len(order) :] + order[: i % len(order)]:
            t0 = time.perf_counter()
            steps[k]()
            times[k].append(time.perf_counter() - t0)
    return times


def _depth_sweep(args: argparse.Namespace, backend: str, dtype_name: str) -> None:
    """The depth sweep (see the module doc): cold and warm first steps per depth and kind, the
    steady step times, and their ratios."""
    first: dict[tuple[int, str], tuple[dict, dict]] = {}
    step_rows = []
    depths = sorted(args.depth_sweep)
    for layers in depths:
        args.layers = layers
        for which in args.sweep_kinds:
            first[layers, which] = _cold_then_warm(args, which, backend, dtype_name)
            cold, warm = first[layers, which]
            print(
                f"{layers} layers, {which}: cold {cold['seconds']:.2f} s (CPU {cold['cpu_seconds']:.2f} s), "
                f"warm {warm['seconds']:.2f} s, load average {os.getloadavg()[0]:.1f}",
                file=sys.stderr,
                flush=True,
            )
        if not args.compile_only:
            times = _sweep_steps(args, backend, DTYPES[dtype_name])
            whole = statistics.median(times["amp_fx_whole"])
            step_rows += [
                [layers, _SWEEP_LABELS[k], _ms(v), f"{statistics.median(v) / whole:.3f}"] for k, v in times.items()
            ]
    rows = []
    for layers in depths:
        for which in args.sweep_kinds:
            cold, warm = first[layers, which]
            smallest = first[depths[0], which][0]["seconds"]
            baseline = first[layers, "baseline"][0]["seconds"] if (layers, "baseline") in first else float("nan")
            rows.append(
                [
                    layers,
                    _SWEEP_LABELS[which],
                    f"{cold['seconds']:.2f}",
                    f"{cold['cpu_seconds']:.2f}",
                    f"{warm['seconds']:.2f}",
                    cold.get("graphs", ""),
                    f"{cold['seconds'] / smallest:.2f}",
                    f"{cold['seconds'] / baseline:.2f}",
                ]
            )
    print(
        f"first forward+backward, {backend} {dtype_name}, seconds: cold (fresh process, empty inductor "
        f"cache; CPU: of that process and the C++ builds it waited for, which load from other processes "
        f"skews far less than wall time), warm (fresh process, the cache the cold one filled); ratios of "
        f"the cold wall times"
    )
    print(
        tabulate(
            rows,
            headers=[
                "layers",
                "compile",
                "cold s",
                "cold CPU s",
                "warm s",
                "graphs",
                f"/ same at {depths[0]} layers",
                "/ torch.compile+autocast (whole)",
            ],
        )
    )
    print(f"load average after: {os.getloadavg()[0]:.1f}")
    if step_rows:
        print(
            f"\nstep: forward+backward, ms, median (p10-p90) over {args.steps} steps after {args.warmup} "
            f"warm-up each, alternating; ratio: median over amp_fx (whole graph)'s"
        )
        print(tabulate(step_rows, headers=["layers", "compile", "step ms", "/ amp_fx (whole graph)"]))


def _wait_for_parties(folder: str, which: str, parties: int) -> None:
    """The concurrent children's barrier: say this one is ready, wait until all are."""
    open(os.path.join(folder, f"{which}.ready"), "w").close()
    while len([f for f in os.listdir(folder) if f.endswith(".ready")]) < parties:
        time.sleep(0.01)


def _time_steps(pair: Compiled, steps: int, warmup: int) -> tuple[list[float], list[float]]:
    for _ in range(warmup):
        pair.amp_fx()
        pair.baseline()
    amp_times, base_times = [], []
    for i in range(steps):
        order = [(pair.amp_fx, amp_times), (pair.baseline, base_times)]
        for run, out in order if i % 2 == 0 else reversed(order):
            t0 = time.perf_counter()
            run()
            out.append(time.perf_counter() - t0)
    return amp_times, base_times


def _ms(values: list[float]) -> str:
    return (
        f"{statistics.median(values) * 1e3:.2f} "
        f"({percentile(values, 0.1) * 1e3:.2f}-{percentile(values, 0.9) * 1e3:.2f})"
    )


def _warm_up_imports(backends: list[str]) -> None:
    """Pay one-time imports and initialisation before anything is timed."""
    for backend in backends:
        torch._dynamo.reset()
        lin = nn.Linear(4, 4)
        torch.compile(lin, backend=backend)(torch.randn(2, 4)).sum().backward()
        torch._dynamo.reset()
        compiled = amp_fx.compile(nn.Linear(4, 4), dtype="bf16", backend=backend)
        compiled(torch.randn(2, 4)).float().sum().backward()
    torch._dynamo.reset()


_CACHE_PREFIX = "amp_fx_bench_compile_"
_KERNEL = re.compile(r"c[a-z0-9]{50,}\.kernel\.kernel")

# (phase, (file name, function)): the named steps of a cold compile in torch 2.13, nested ones
# marked with dots
_PHASES: tuple[tuple[str, tuple[str, str]], ...] = (
    ("first forward+backward (all)", ("bench_compile.py", "run")),
    ("Dynamo: trace, compile the frame (forward)", ("convert_frame.py", "_compile")),
    (". Dynamo: build guards", ("convert_frame.py", "build_guards")),
    (". backend call (amp_fx: its passes too)", ("output_graph.py", "_call_user_compiler")),
    (". . amp_fx: capture and passes", ("pipeline.py", "run_pipeline")),
    (". . . amp_fx: capture", ("capture.py", "capture")),
    (". . . amp_fx: insert_casts", ("insert_casts.py", "insert_casts")),
    (". . AOTAutograd and inductor (forward)", ("compile_fx.py", "compile_fx")),
    (". . . AOTAutograd: joint graph", ("graph_capture.py", "_create_graph")),
    (". . . AOTAutograd: partition", ("partitioners.py", "min_cut_rematerialization_partition")),
    (". . . inductor: forward graph", ("compile_fx.py", "fw_compiler_base")),
    ("inductor: backward graph (at the first backward)", ("compile_fx.py", "bw_compiler")),
)


def _phase_seconds(table: dict[tuple[str, int, str], tuple[int, float, float]], where: tuple[str, str]) -> float:
    """The cumulative time of the outermost entry of ``where`` (the largest, when one function
    name has several entries); 0 when it did not run."""
    file, name = where
    return max((c for (f, _, n), (_, _, c) in table.items() if n == name and os.path.basename(f) == file), default=0.0)


def _profile(args: argparse.Namespace, backend: str, dtype_name: str, top: int) -> None:
    """cProfile one cold compile of each (fresh processes), print the top of each and the largest
    differences in cumulative time, amp_fx minus the baseline."""
    stats = {}
    folder = tempfile.mkdtemp(prefix="amp_fx_bench_profile_")
    for which in ("amp_fx", "baseline"):
        path = os.path.join(folder, f"{which}.prof")
        seconds = _cold_compile(args, which, backend, dtype_name, profile=path)["seconds"]
        print(f"{which}: cold compile {seconds:.2f} s wall under cProfile ({path})")
        stats[which] = pstats.Stats(path).stats  # type: ignore[attr-defined]

    def label(key: tuple[str, int, str]) -> str:
        file, line, name = key
        parts = file.split(os.sep)
        short = os.sep.join(parts[-3:]) if len(parts) > 3 else file
        return f"{short}:{line}({name})"

    def cum(which: str) -> dict[tuple[str, int, str], tuple[int, float, float]]:
        """key -> (primitive calls, own time, cumulative time); inductor's generated modules and
        C++ kernels (named by a hash of their code and of the cache directory) merged by kind."""
        out: dict[tuple[str, int, str], tuple[int, float, float]] = {}
        for (file, line, name), v in stats[which].items():
            if _CACHE_PREFIX in file:
                file, line = "<inductor generated code>", 0
            name = _KERNEL.sub("<C++ kernel>", name)
            n, t, c = out.get((file, line, name), (0, 0.0, 0.0))
            out[file, line, name] = (n + v[0], t + v[2], c + v[3])
        return out

    amp, base = cum("amp_fx"), cum("baseline")
    print("\nphases, cumulative CPU seconds of the compiling process")
    print(
        tabulate(
            [
                [
                    phase,
                    *(f"{_phase_seconds(t, where):.2f}" for t in (amp, base)),
                    f"{_phase_seconds(amp, where) - _phase_seconds(base, where):+.2f}",
                ]
                for phase, where in _PHASES
            ],
            headers=["phase", "amp_fx", "baseline", "difference"],
        )
    )
    for which, table in (("amp_fx", amp), ("baseline", base)):
        rows = sorted(table.items(), key=lambda kv: -kv[1][2])[:top]
        print(f"\n{which}: top {top} by cumulative CPU seconds of the compiling process")
        print(
            tabulate(
                [[f"{c:.2f}", f"{t:.2f}", n, label(k)] for k, (n, t, c) in rows],
                headers=["cum s", "own s", "calls", "function"],
            )
        )
    diff = []
    for key in amp.keys() | base.keys():
        a, b = amp.get(key, (0, 0.0, 0.0)), base.get(key, (0, 0.0, 0.0))
        diff.append((a[2] - b[2], a[1] - b[1], a[2], b[2], a[0], b[0], key))
    for title, order in (("cumulative", 0), ("own", 1)):
        rows = sorted(diff, key=lambda r: -r[order])[:top]
        print(f"\nlargest differences in {title} seconds, amp_fx minus baseline")
        print(
            tabulate(
                [[f"{r[0]:+.2f}", f"{r[1]:+.2f}", f"{r[2]:.2f}", f"{r[3]:.2f}", r[4], r[5], label(r[6])] for r in rows],
                headers=[
                    "cum diff",
                    "own diff",
                    "amp_fx cum",
                    "baseline cum",
                    "amp_fx calls",
                    "baseline calls",
                    "function",
                ],
            )
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="transformer_lm", choices=["transformer_lm", "hf-gpt2", "hf-llama"])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=128)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--backends", nargs="+", default=["aot_eager", "inductor"])
    parser.add_argument("--dtypes", nargs="+", default=["bf16"], choices=sorted(DTYPES))
    parser.add_argument(
        "--compile-repeats", type=int, default=1, help="cold compiles of each kind (median reported; each is a process)"
    )
    parser.add_argument(
        "--keep-cache", action="store_true", help="use inductor's usual cache directory (compile times may be warm)"
    )
    parser.add_argument(
        "--compile-only", action="store_true", help="time the cold compiles only (no step times, no cast counts)"
    )
    parser.add_argument(
        "--compile-threads",
        type=int,
        help="inductor's compile threads in the timed processes "
        "(TORCHINDUCTOR_COMPILE_THREADS); with 1, the CPU-time column counts "
        "every C++ build, which makes it a measure that load skews little",
    )
    parser.add_argument(
        "--profile", action="store_true", help="cProfile one cold compile of each instead (first backend and dtype)"
    )
    parser.add_argument("--profile-top", type=int, default=30)
    parser.add_argument(
        "--concurrent", action="store_true", help="run each pair's two compiles at the same time (see the module doc)"
    )
    parser.add_argument("--child-profile", help=argparse.SUPPRESS)
    parser.add_argument("--child-barrier", help=argparse.SUPPRESS)
    parser.add_argument("--child-parties", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument(
        "--depth-sweep",
        type=int,
        nargs="+",
        metavar="LAYERS",
        help="compiled regions against the whole graph at these depths (see the module doc); first backend",
    )
    parser.add_argument(
        "--sweep-kinds",
        nargs="+",
        choices=SWEEP_KINDS,
        default=list(SWEEP_KINDS),
        help="the compiles the depth sweep times (default: all; 'baseline' is each ratio's denominator)",
    )
    parser.add_argument("--child", choices=SWEEP_KINDS, help=argparse.SUPPRESS)
    parser.add_argument("--child-backend", help=argparse.SUPPRESS)
    parser.add_argument("--child-dtype", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _compile_once(args)
        return

    model, inputs, _ = _build(args)
    n_params = sum(p.numel() for p in model.parameters())
    print(*machine_lines(), sep="\n")
    print(
        f"model: {args.model} layers={args.layers} d_model={args.d_model} heads={args.heads} "
        f"seq={args.seq} batch={args.batch} vocab={args.vocab} ({n_params:,} parameters)"
    )
    print("no bf16/fp16 units on this CPU: compare amp_fx with torch.compile+autocast, not with fp32\n")
    if args.profile:
        _profile(args, args.backends[0], args.dtypes[0], args.profile_top)
        return
    if args.depth_sweep:
        _depth_sweep(args, args.backends[0], args.dtypes[0])
        return

    compile_rows, step_rows, cast_rows = [], [], []
    for dtype_name in args.dtypes:
        dtype = DTYPES[dtype_name]
        for backend in args.backends:
            amps, bases = [], []
            for i in range(args.compile_repeats):  # alternate which one goes first
                order = ["amp_fx", "baseline"] if i % 2 == 0 else ["baseline", "amp_fx"]
                found = dict(
                    zip(
                        order, _cold_compiles(args, order, backend, dtype_name, concurrent=args.concurrent), strict=True
                    )
                )
                amps.append(found["amp_fx"])
                bases.append(found["baseline"])
            amp = amps[0]
            amp_s = statistics.median(a["seconds"] for a in amps)
            base_s = statistics.median(b["seconds"] for b in bases)
            ratios = [a["seconds"] / b["seconds"] for a, b in zip(amps, bases, strict=True)]
            cpu_ratios = [a["cpu_seconds"] / b["cpu_seconds"] for a, b in zip(amps, bases, strict=True)]
            main_ratios = [a["main_cpu_seconds"] / b["main_cpu_seconds"] for a, b in zip(amps, bases, strict=True)]
            passes = {p: statistics.median(a["passes"][p] for a in amps) for p in PASSES}
            nodes = amp["nodes"]
            total = sum(passes.values())
            compile_rows.append(
                [
                    backend,
                    dtype_name,
                    amp["graphs"],
                    nodes,
                    f"{amp_s:.2f}",
                    f"{base_s:.2f}",
                    f"{statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f})",
                    f"{statistics.median(a['cpu_seconds'] for a in amps):.2f}",
                    f"{statistics.median(b['cpu_seconds'] for b in bases):.2f}",
                    f"{statistics.median(cpu_ratios):.3f} ({min(cpu_ratios):.3f}-{max(cpu_ratios):.3f})",
                    f"{statistics.median(main_ratios):.3f} ({min(main_ratios):.3f}-{max(main_ratios):.3f})",
                    *(f"{passes[p] * 1e3:.1f}" for p in PASSES),
                    f"{total * 1e3:.1f}",
                    f"{total / nodes * 1e6:.1f}",
                ]
            )
            amp_list = " ".join(f"{a['seconds']:.2f}/{a['cpu_seconds']:.2f}/{a['main_cpu_seconds']:.2f}" for a in amps)
            base_list = " ".join(
                f"{b['seconds']:.2f}/{b['cpu_seconds']:.2f}/{b['main_cpu_seconds']:.2f}" for b in bases
            )
            print(
                f"compile {backend} {dtype_name} (wall/CPU/main CPU): amp_fx {amp_list} s, baseline {base_list} s, "
                f"load average "
                f"{os.getloadavg()[0]:.1f}",
                file=sys.stderr,
                flush=True,
            )
            if args.compile_only:
                continue
            pair = _compile_pair(args, backend, dtype)
            if backend == args.backends[0]:
                records = pair.amp_fx_module.amp_fx_records
                cast_rows.append(
                    [
                        dtype_name,
                        eager_casts_per_forward(model, inputs, dtype),
                        sum(r.inserted.casts_inserted for r in records),
                        sum(r.inserted.casts_shared for r in records),
                        sum(r.folded.total for r in records),
                        sum(r.casts for r in records),
                    ]
                )
            amp_times, base_times = _time_steps(pair, args.steps, args.warmup)
            step_rows.append(
                [
                    backend,
                    dtype_name,
                    _ms(amp_times),
                    _ms(base_times),
                    f"{statistics.median(amp_times) / statistics.median(base_times):.3f}",
                ]
            )
            print(f"done: {backend} {dtype_name}", file=sys.stderr, flush=True)

    print(
        f"compile: first forward+backward after torch._dynamo.reset(), cold (a fresh process and "
        f"inductor cache each), seconds, median of {args.compile_repeats}; ratio: median (min-max) "
        f"of the per-pair ratios; CPU: the timed process and the children it waited for; main CPU: the "
        f"timed process alone; amp_fx's passes, ms"
    )
    print(
        tabulate(
            compile_rows,
            headers=[
                "backend",
                "dtype",
                "graphs",
                "ATen nodes",
                "amp_fx s",
                "torch.compile+autocast s",
                "ratio",
                "amp_fx CPU s",
                "baseline CPU s",
                "CPU ratio",
                "main CPU ratio",
                "capture ms",
                "insert_casts ms",
                "fold_casts ms",
                "passes ms",
                "passes ms / 1k nodes",
            ],
        )
    )
    print(f"load average after: {os.getloadavg()[0]:.1f}")
    if args.compile_only:
        return
    print(
        f"\nstep: forward+backward, ms, median (p10-p90) over {args.steps} steps after "
        f"{args.warmup} warm-up, amp_fx and baseline alternating"
    )
    print(tabulate(step_rows, headers=["backend", "dtype", "amp_fx", "torch.compile+autocast", "ratio (median)"]))
    print("\ncasts per forward: eager autocast (aten._to_copy calls) vs amp_fx's rewritten graphs")
    print(
        tabulate(
            cast_rows,
            headers=[
                "dtype",
                "eager autocast",
                "amp_fx inserted",
                "leaf-cast uses shared",
                "folded",
                "amp_fx in graph",
            ],
        )
    )


if __name__ == "__main__":
    main()
