"""Every ``python`` code block of README.md and of the documentation site (``docs/*.md``) runs as
the page presents it, and amp_fx says nothing.

"Say when you did less than asked" has a twin: an example must not make amp_fx say it. Each block
is run with the names it takes from the reader's context defined first (small shapes), and, where
the block only builds a model, a call of it (amp_fx's policy checks run after the first call).

``BLOCKS`` lists every block of every page, by page and by the block's first line: a ``Run``
(run here, with what runs after it and the replacements it needs, each with its reason) or a
``NotRun`` (the reason it cannot run here). A new block, or a new page with blocks, fails
``test_every_block_is_listed`` until it is listed there. The CLI commands in
``examples/tiny_mlp.py``'s docstring run the same way; ``examples/train_demo.py`` is covered by
``tests/usage/test_demo.py``. ``examples/train_ddp.py`` and ``train_fsdp.py`` need ``torchrun`` with two
processes (about 30 s each here), so they are not run by the suite: see docs/distributed.md for
the command.
"""

from __future__ import annotations

import re
import shutil
import sys
import textwrap
import types
import warnings
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

_ROOT = Path(__file__).resolve().parents[2]
_BLOCK = re.compile(r"^```python\n(.*?)^```", re.M | re.S)


def pages() -> list[str]:
    """README.md and every Markdown page of the documentation site, relative to the root."""
    return ["README.md", *sorted(str(p.relative_to(_ROOT)) for p in (_ROOT / "docs").rglob("*.md"))]


def python_blocks(page: str) -> dict[str, str]:
    """First line of each ``python`` block of ``page`` -> the block."""
    blocks = [m.group(1) for m in _BLOCK.finditer((_ROOT / page).read_text())]
    return {b.splitlines()[0]: b for b in blocks}


# What the blocks take from the reader's context: a model with the modules the Policy example
# names, a batch, a loss, an optimizer, a scheduler and a loader of four micro-batches.
_CONTEXT = """
import torch
import amp_fx
from torch import nn

class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 16)
        self.norm = nn.LayerNorm(16)
        self.lm_head = nn.Linear(16, 4)

    def forward(self, x):
        return self.lm_head(self.norm(torch.relu(self.fc(x))))

torch.manual_seed(0)
model = Model()
x, y = torch.randn(4, 8), torch.randint(0, 4, (4,))
loss_fn = torch.nn.functional.cross_entropy
opt = optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)
loader = [(torch.randn(4, 8), torch.randint(0, 4, (4,))) for _ in range(4)]

class Fp8Model(nn.Module):  # every matmul size a multiple of 16: fp8 with no padding (docs/fp8.md)
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(32, 64)
        self.lm_head = nn.Linear(64, 16)

    def forward(self, x):
        return self.lm_head(torch.relu(self.fc(x)))

x16 = torch.randn(16, 32)
"""


@dataclass(frozen=True)
class Run:
    """A block run here."""

    after: str = ""
    """Run after the block: a call of the model the block built, so that its graphs are captured
    and the policy is checked against them."""
    replace: tuple[tuple[str, str], ...] = ()
    """(text, replacement) in the block, each with its reason in the table below."""
    needs: str = ""
    """A module the block imports that only some environments install (an optional extra): the
    block is skipped, with the reason, where it does not import. Warnings raised in that package's
    own files (Lightning's FutureWarning about torch's pytree API) and its "INFO: " log lines on
    stderr (Lightning's "GPU available: False") are its, shown without amp_fx too, and are not
    counted."""


@dataclass(frozen=True)
class NotRun:
    """A block not run here, and why."""

    reason: str


_CALL = "model(x).float().sum().backward()\n"
_NO_CUDA = () if torch.cuda.is_available() else (('"cuda"', '"cpu"'),)
# without Graphviz, to_svg writes the DOT and raises GraphvizNotFound (tested in test_explain)
_NO_DOT = () if shutil.which("dot") else (('report.to_svg("graph.svg")', 'report.to_dot("graph.dot")'),)

BLOCKS: dict[str, dict[str, Run | NotRun]] = {
    "README.md": {
        "import amp_fx": Run(),
        'policy = amp_fx.Policy(keep_fp32=("lm_head",))      # this submodule stays in fp32': Run(
            after="compiled(x).float().sum().backward()\n"
        ),
        'report = amp_fx.explain(model, x, dtype="bf16")': Run(),
        'result = amp_fx.compare(model, x, dtype="fp16")': Run(),
        "scaler = amp_fx.GradScaler(x.device.type, step_mode=amp_fx.StepMode.MASKED)  # no host sync in step()": Run(),
        # fp16 on the CPU through inductor compiles for about a minute: the same step on aot_eager
        'step = amp_fx.compile_step(model, optimizer, loss_fn, dtype="fp16", max_grad_norm=1.0)': Run(
            replace=(("max_grad_norm=1.0)", 'max_grad_norm=1.0, backend="aot_eager")'),)
        ),
        'advice = amp_fx.advise(model, x, dtype="fp16", loss_fn=lambda out: out.float().sum())': Run(),
        'step = amp_fx.compile_step(model, optimizer, loss_fn, dtype="fp16", watch_nonfinite=True)': Run(
            replace=(("watch_nonfinite=True)", 'watch_nonfinite=True, backend="aot_eager")'),)
        ),
    },
    "docs/advise.md": {
        "import amp_fx": Run(),
        "from amp_fx.testing.hazards import build": Run(),
    },
    "docs/overflow.md": {
        "# compile_step: the report, and a scheduler that stands still on skipped steps": Run(),
        "# GradScaler around amp_fx.compile: the scaler watches the compiled model": Run(),
    },
    "docs/getting-started.md": {
        "import amp_fx": Run(),
        # fp16 on the CPU through inductor compiles for about a minute: the same loop on aot_eager
        "# fp16: scale the loss so that small gradients do not underflow": Run(
            replace=(('dtype="fp16")', 'dtype="fp16", backend="aot_eager")'),)
        ),
        "# fp16, the whole step in one call": Run(
            replace=(("max_grad_norm=1.0)", 'max_grad_norm=1.0, backend="aot_eager")'),)
        ),
        # Fp8Model and x16 as in docs/fp8.md below (sizes _scaled_mm takes unpadded), on aot_eager
        "# fp8 matmuls, bf16 everywhere else": Run(
            replace=(
                (
                    'amp_fx.compile(model, dtype="bf16", fp8="tensorwise")',
                    'amp_fx.compile(Fp8Model(), dtype="bf16", fp8="tensorwise", backend="aot_eager")',
                ),
            ),
            after="model(x16).float().sum().backward()\n",
        ),
        "# which dtype each op ran in, by module; then op by op against eager autocast and float64": Run(),
    },
    "docs/concepts.md": {
        "from amp_fx import Policy, CastClass": Run(after=_CALL),
    },
    "docs/parity.md": {
        'model = amp_fx.compile(model, dtype="bf16", backend="eager")': Run(after=_CALL),
    },
    "docs/debugging.md": {
        'report = amp_fx.explain(model, x, dtype="bf16")     # or amp_fx.explain(compiled) after it ran': Run(
            replace=_NO_DOT
        ),
    },
    "docs/loss-scaling.md": {
        # a CUDA scaler where there is none: the same options on the CPU
        "from amp_fx import GradScaler, ScalerMode, StepMode": Run(replace=_NO_CUDA),
    },
    "docs/compiled-step.md": {
        # fp16 on the CPU through inductor compiles for about a minute: the same step on aot_eager
        "step = amp_fx.compile_step(model, optimizer, torch.nn.functional.cross_entropy,": Run(
            replace=(("accumulate=4)", 'accumulate=4, backend="aot_eager")'),)
        ),
        "model = transformers.GPT2LMHeadModel(config)": NotRun(
            "needs transformers (not a dependency); compile_step(**batch) with an HF-style model is "
            "tests/step/test_step.py's"
        ),
        "step = amp_fx.compile_step(model, torch.optim.AdamW(model.parameters(), lr=1e-3), loss_fn,": NotRun(
            "tests/step/test_lowprec.py runs compile_step(train_state=...) against torchao"
        ),
    },
    "docs/numerics.md": {
        'model = amp_fx.compile(model, dtype="bf16", numerics="eager")          # backend="inductor"': NotRun(
            "model, opt and loss_fn are the reader's: tests/backend/test_numerics_eager.py runs both calls "
            "against eager autocast"
        ),
    },
    "docs/distributed.md": {
        "from torchtitan.models.qwen3 import parallelize_qwen3": NotRun(
            "needs a process group and torchtitan's Qwen3 MoE: tests/integrations/test_torchtitan_moe.py runs "
            "amp_fx_parallelize(parallelize_qwen3, ...) under expert parallelism on 2 gloo ranks"
        ),
        "from torch.distributed.tensor import DTensor, Shard": NotRun(
            "a fragment of an attention's forward under context parallelism, CUDA only: "
            "tests/cuda/test_cuda_context_parallel.py runs it (the .ci/gpu cp stage)"
        ),
        'model = DDP(amp_fx.compile(model, dtype="fp16"))      # or amp_fx.compile(DDP(model), ...)': NotRun(
            "needs a process group; examples/train_ddp.py and train_fsdp.py run it under torchrun"
        ),
        "class Model(nn.Module):": NotRun(
            "a fragment (no blocks or embed): tests/distributed/_dist_cases.py's MethodRoot runs it under FSDP2"
        ),
        "# Llama, Qwen2, Mistral, ...: the embedding is the root's own module": NotRun(
            "needs a process group: tests/distributed/_dist_real_model_cases.py's _shard runs both shardings "
            "under FSDP2"
        ),
        'parallelize_module(block, tp_mesh, {"attn.q": ColwiseParallel(), "attn.wo": RowwiseParallel(), ...})': NotRun(
            "needs a process group and a mesh: tests/distributed/_dist_tp_cases.py's tensor_parallel runs it on "
            "2 gloo ranks"
        ),
        "model = AutoModelForCausalLM.from_pretrained(path, distributed_config=DistributedConfig(tp_size=2))": NotRun(
            "needs a process group: tests/distributed/_dist_tp_real_cases.py's tp_real loads the model so on "
            "2 gloo ranks"
        ),
        'stage_module = amp_fx.compile(stage_module, dtype="fp16")': NotRun(
            "needs a process group: tests/distributed/_dist_tp_cases.py's pipeline_run runs it on 2 gloo ranks"
        ),
    },
    "docs/torchtitan.md": {
        "# my_configs.py": NotRun(
            "a torchtitan config module: torchtitan's Trainer needs an accelerator (and tensorboard); "
            "tests/integrations/test_torchtitan.py runs the parallelize_fn with_amp_fx puts in the spec on 2 gloo "
            "ranks"
        ),
    },
    "docs/everyday.md": {
        "# compile in place: model(...) and its methods run amp_fx's graphs": Run(),
        "# generate() on the wrapper module (needs transformers; skipped without it)": Run(),
        "# a hook registered after the first call runs": Run(),
        "# an unknown option is refused when compile is called": Run(),
        "# silence amp_fx's progress lines (warnings are unaffected)": Run(
            after="import amp_fx\nassert not amp_fx._common.progress.progress_log.isEnabledFor(logging.INFO)\n"
            'logging.getLogger("amp_fx.progress").setLevel(logging.INFO)\n'
        ),
    },
    "docs/call-overhead.md": {
        "import torch": Run(),
    },
    "docs/frameworks.md": {
        # the entry point is registered by `pip install -e .` (as .ci/run does)
        "import torch": Run(),
        "import lightning.pytorch as pl": Run(needs="lightning"),
    },
    "docs/real-models.md": {
        "import torch": Run(needs="transformers"),
    },
    "docs/weight-cache-real-models.md": {
        "import torch": Run(needs="transformers"),
    },
    # the blocks take Fp8Model and x16, sizes _scaled_mm takes unpadded (the context's Model, 8
    # features and 4 rows, would run in fp8 padded to 16); aot_eager instead of a minute of
    # inductor compiling, as in docs/compiled-step.md.
    "docs/fp8.md": {
        'model = amp_fx.compile(model, dtype="bf16", low_precision="tensorwise")  # or "rowwise", "mxfp8"': Run(
            replace=(
                (
                    'amp_fx.compile(model, dtype="bf16", low_precision="tensorwise")',
                    'amp_fx.compile(Fp8Model(), dtype="bf16", low_precision="tensorwise", backend="aot_eager")',
                ),
            ),
            after="model(x16).float().sum().backward()\n",
        ),
        "# the preset: the first and last blocks and lm_head in dtype, every other matmul in mxfp8": NotRun(
            "needs a model with repeated blocks, an lm_head and a Mixtral router (a transformers model); "
            "tests/fp8/test_recipe_per_module.py runs the preset, Blocks, types and plain dicts"
        ),
        'policy = amp_fx.Policy(keep_out_of_fp8=("lm_head",))': Run(
            replace=(
                (
                    'amp_fx.compile(model, dtype="bf16", fp8="tensorwise", policy=policy)',
                    'amp_fx.compile(Fp8Model(), dtype="bf16", fp8="tensorwise", policy=policy, backend="aot_eager")',
                ),
            ),
            after="model(x16).float().sum().backward()\n",
        ),
        'report = amp_fx.explain(model, x, dtype="bf16", fp8="tensorwise")': Run(
            replace=(("amp_fx.explain(model, x,", "amp_fx.explain(Fp8Model(), x16,"),)
        ),
    },
    # Fp8Model and x16 as for docs/fp8.md; aot_eager instead of a minute of inductor compiling
    "docs/fp8-monitor.md": {
        'model = amp_fx.compile(model, dtype="bf16", low_precision="tensorwise",': Run(
            replace=(("amp_fx.compile(model,", 'amp_fx.compile(Fp8Model(), backend="aot_eager",'),),
            after="model(x16).float().sum().backward()\n",
        ),
        "stats = amp_fx.fp8_stats(model)   # the one host read": Run(
            replace=(
                (
                    "stats = amp_fx.fp8_stats(model)",
                    'model = amp_fx.compile(Fp8Model(), dtype="bf16", low_precision="tensorwise", '
                    'backend="aot_eager", monitor=amp_fx.Fp8Monitor())\n'
                    "model(x16).float().sum().backward()\n"
                    "stats = amp_fx.fp8_stats(model)",
                ),
            )
        ),
        'for name, value in stats.to_dict().items():   # "fp8/down/input/underflows%": 24.12, ...': NotRun(
            "needs a SummaryWriter; tests/fp8/test_fp8_monitor.py checks to_dict's figures"
        ),
        'model = amp_fx.compile(model, dtype="bf16",': NotRun(
            "the planted model of tests/fp8/test_fp8_monitor.py (a module named down): "
            "test_per_module_recipe_fixes_the_planted_underflow runs this map"
        ),
    },
    "docs/memory.md": {
        # inductor compiles for tens of seconds here: the same model on aot_eager
        'model = amp_fx.compile(model, dtype="bf16")': Run(
            replace=(('dtype="bf16")', 'dtype="bf16", backend="aot_eager")'),)
        ),
    },
    "docs/weight-cache.md": {
        'model = amp_fx.compile(model, dtype="bf16", weight_cache=True)': Run(
            after="for xb, yb in loader:\n    step(xb, yb)\n",
            # as in docs/compiled-step.md: aot_eager instead of a minute of inductor compiling
            replace=(("accumulate=4, weight_cache=True)", 'accumulate=4, weight_cache=True, backend="aot_eager")'),),
        ),
    },
}
"""Every python block of every page, by page and first line."""


def _listed_blocks() -> list[tuple[str, str]]:
    return [(page, first) for page, blocks in BLOCKS.items() for first, how in blocks.items() if isinstance(how, Run)]


@pytest.mark.parametrize("page", pages())
def test_every_block_is_listed(page):
    found, listed = set(python_blocks(page)), set(BLOCKS.get(page, {}))
    assert found - listed == set(), f"{page}: blocks not listed in BLOCKS (Run or NotRun with a reason)"
    assert listed - found == set(), f"{page}: BLOCKS lists blocks the page no longer has"


def test_every_listed_page_exists():
    assert set(BLOCKS) <= set(pages())


_AMP_FX = str(_ROOT / "amp_fx")


def _shown(w: warnings.WarningMessage) -> bool:
    """Whether a user sees the warning: Python's default filters hide deprecation warnings raised
    outside ``__main__`` (torch warns about its own ``torch.jit.script_method`` when inductor
    imports ``torch.utils.mkldnn``); amp_fx's and the block's own (its page's name) are always counted."""
    hidden = issubclass(w.category, (DeprecationWarning, PendingDeprecationWarning))
    return not hidden or w.filename.startswith(_AMP_FX) or w.filename.endswith(".md")


def _run_quietly(source: str, monkeypatch, tmp_path, capfd, *, filename: str = "README.md", foreign: str = "") -> None:
    """Run ``source`` as a user would (not strict) in ``tmp_path``; fail on any warning or any
    output to stderr."""
    monkeypatch.delenv("AMP_FX_STRICT", raising=False)
    monkeypatch.chdir(tmp_path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        # a module of its own, as a script is: Dynamo imports the frame's module by name
        module = types.ModuleType("readme_block")
        monkeypatch.setitem(sys.modules, module.__name__, module)
        exec(compile(source, filename, "exec"), module.__dict__)
    said = [
        f"{w.category.__name__}: {w.message} ({w.filename}:{w.lineno})"
        for w in caught
        if _shown(w)
        and not (foreign and f"/{foreign.split('.')[0]}/" in w.filename)
        and not _SLOW_FP8_NOTE.match(str(w.message))
    ]
    assert said == [], "\n".join(said)
    err = [
        line
        for line in capfd.readouterr().err.splitlines()
        if not _MACHINE_NOTE.search(line)
        and not _FOREIGN_IMPORT_NOTE.search(line)
        and not (foreign and line.startswith("INFO: "))
    ]
    assert err == []


# torch 2.15's inductor imports torch.utils.cpp_extension, which logs this once per process on a
# machine that has a CUDA toolkit (an nvcc under /usr/local) but no CUDA runtime: a note about the
# machine, printed by torch whatever the code, not a warning a block's user could act on.
_MACHINE_NOTE = re.compile(r"torch/utils/cpp_extension\.py:\d+\].*No CUDA runtime is found, using CUDA_HOME=")

# The docs' fp8 blocks are written for a GPU with fp8 tensor cores; run here, amp_fx says once that
# fp8 is slower than bf16 on this machine (amp_fx.backend.audit.slow_fp8_text): a note about the
# machine, as above, that a user on a GPU does not see.
_SLOW_FP8_NOTE = re.compile(r"amp_fx: fp8='\w+' runs (without fp8 tensor cores|emulated) here")

# torch 2.15 logs this once per process when torchao (installed for the fp8 tests) is first
# imported (transformers imports it when it is installed). Which test imports it first depends on
# the selection: a note about another library's import, not the block's doing.
_FOREIGN_IMPORT_NOTE = re.compile(r"torch/utils/_pytree\.py:\d+\] <enum '\w+'> is an Enum subclass")


@pytest.mark.slow_cases
@pytest.mark.parametrize(("page", "first_line"), _listed_blocks())
def test_block_runs_without_a_warning(page, first_line, monkeypatch, tmp_path, capfd):
    block = python_blocks(page)[first_line]
    run = BLOCKS[page][first_line]
    if run.needs:
        pytest.importorskip(run.needs, reason=f"{page}: the block needs {run.needs} (an optional extra)")
    for old, new in run.replace:
        assert old in block, f"{page}: block changed: {old!r} not in it"
        block = block.replace(old, new)
    _run_quietly(
        _CONTEXT + textwrap.dedent(block) + run.after, monkeypatch, tmp_path, capfd, filename=page, foreign=run.needs
    )


_TINY = _ROOT / "examples" / "tiny_mlp.py"


def _docstring_commands() -> list[list[str]]:
    """The ``amp-fx ...`` lines of examples/tiny_mlp.py's docstring, as argument lists."""
    doc = _TINY.read_text().split('"""')[1]
    return [line.split()[1:] for line in doc.splitlines() if line.strip().startswith("amp-fx ")]


@pytest.mark.parametrize("argv", _docstring_commands(), ids=lambda a: a[0])
def test_tiny_mlp_commands_run_without_a_warning(argv, monkeypatch, tmp_path, capfd):
    argv = [str(_TINY) + a.removeprefix("examples/tiny_mlp.py") if a.startswith("examples/") else a for a in argv]
    source = (
        f"from amp_fx.cli import main\ncode = main({argv!r})\n"
        # find-nonfinite exits 1 when it finds an inf/NaN, as on build_overflowing
        f"assert code == {1 if argv[0] == 'find-nonfinite' else 0}, code\n"
    )
    _run_quietly(source, monkeypatch, tmp_path, capfd)
