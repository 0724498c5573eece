"""amp_fx as torchtitan's mixed precision: torchtitan's Llama 3 debugmodel under its own
``parallelize_llama`` on 2 gloo ranks (tp 2, dp_shard 2) and 4 (dp_shard 2 x tp 2), bitwise with
eager autocast (tests/integrations/_dist_titan_cases.py); the documented ``--module`` command parsed by
torchtitan's own config machinery; what the integration refuses. fp8 against torchtitan's float8
converter: tests/integrations/test_torchtitan_fp8.py.

Before the fixes in ``amp_fx/_dist/capture.py`` the tp cases failed: amp_fx's FSDP2 unit capture
called ``type(module).forward`` and skipped the per-instance forward torchtitan installs for TP
redistribution ("TorchRuntimeError ... rms_norm": a plain tensor beside a DTensor weight); with
that called, the units' shared compiled forward turned dynamic (automatic dynamic shapes, whose
record of sizes Dynamo keeps by the code's name, across units of different signatures) and amp_fx
could not fakify a DTensor with symbolic sizes (each fix reverted alone fails the tp cases). Every
amp_fx case compiles the model in place (``amp_fx_parallelize``), which recursed without end on
FSDP2 models before ``_eager_call``. torchtitan always applies ``fully_shard`` (a no-op all-gather
at dp_shard=1), so tp=2 alone runs through the unit capture too.
"""

from __future__ import annotations

import functools
import json
import os
import re
import subprocess
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("torchtitan", reason="needs torchtitan (pip install amp_fx[torchtitan]; torch >= 2.12)")

from amp_fx import AmpFxError, AmpFxWarning  # noqa: E402
from amp_fx.integrations.torchtitan import AmpFxTitanConfig, amp_fx_parallelize, with_amp_fx  # noqa: E402
from amp_fx.testing import assert_bitwise  # noqa: E402
from amp_fx.testing.distributed import run_ranks  # noqa: E402
from amp_fx.testing.torchtitan import trainer_config_fields  # noqa: E402
from tests.integrations._dist_titan_cases import CASES, titan_all, world_size_of  # noqa: E402

pytestmark = [
    pytest.mark.skipif(
        not (torch.distributed.is_available() and torch.distributed.is_gloo_available()),
        reason="needs torch.distributed with gloo",
    ),
    pytest.mark.slow,
]


@pytest.fixture(scope="module")
def spawn() -> Callable[[int], list[dict]]:
    """``spawn(world_size)``: every rank's results of the cases of that world size (one spawn
    each, on first use: 2 ranks for tp and dp, 4 for dp_tp)."""
    return functools.cache(lambda world_size: run_ranks(titan_all, world_size=world_size))


def _name(case: tuple) -> str:
    return " ".join(case)


@pytest.mark.parametrize("case", [c for c in CASES if c[2] == "amp_fx"], ids=_name)
def test_torchtitan_parallelize_llama_bitwise_with_eager_autocast(spawn, case):
    """Losses, scales, every rank's local gradients at the 3rd step and parameters after it, bit
    for bit; no amp_fx warning (a fallback to torch.compile + autocast would warn)."""
    layout, dtype, _ = case
    ranks = spawn(world_size_of(layout))
    assert len(ranks) == world_size_of(layout)
    for rank, res in enumerate(ranks):
        got, want = res[case], res[(layout, dtype, "eager")]
        what = f"rank {rank}, {_name(case)}"
        assert "error" not in want, f"{what}: eager reference: {want.get('error')}"
        assert "error" not in got, f"{what}: {got.get('error')}"
        assert got["amp_fx_warnings"] == [], what
        assert_bitwise(got["losses"], want["losses"], f"{what}: losses")
        assert_bitwise(got["scales"], want["scales"], f"{what}: scales")
        assert set(got["grads"]) == set(want["grads"]), what
        for name in want["grads"]:
            assert_bitwise(got["grads"][name], want["grads"][name], f"{what}: grad {name}")
            assert_bitwise(got["params"][name], want["params"][name], f"{what}: {name}")


@pytest.mark.parametrize("layout", ["tp", "dp_tp"])
def test_torchtitan_cases_train(spawn, layout):
    """The comparison is not vacuous: the loss moves over the 3 steps, the ranks of a tp group hold
    different shards, and on dp_tp the two tp groups train on different tokens."""
    ranks = spawn(world_size_of(layout))
    for res in ranks:
        for case in (c for c in CASES if c[0] == layout):
            assert "error" not in res[case], f"{_name(case)}: {res[case].get('error')}"
            losses = res[case]["losses"]
            assert losses[0] != losses[-1], _name(case)
    case = (layout, "bf16", "amp_fx")
    tp0, tp1 = ranks[0][case], ranks[1][case]
    name = "layers.0.attention.wo.weight"
    assert name in tp0["params"], sorted(tp0["params"])
    assert not torch.equal(tp0["params"][name], tp1["params"][name])
    if layout == "dp_tp":
        assert torch.equal(ranks[0][case]["losses"], ranks[1][case]["losses"])  # one tp group, one loss
        assert not torch.equal(ranks[0][case]["losses"], ranks[2][case]["losses"])


_DOCS = Path(__file__).resolve().parents[2] / "docs" / "torchtitan.md"

# Run in a process of its own: torchtitan's registries import its Trainer (tensorboard, datasets:
# stood in for where missing) and its float8 converter's registry entries touch inductor's config.
_PARSE = """
import json, sys
from amp_fx.testing.torchtitan import stand_in_for_trainer_extras
stand_in_for_trainer_extras()
sys.path.insert(0, sys.argv[1])
from torchtitan.config.manager import ConfigManager

def parse(args):
    try:
        config = ConfigManager().parse_args(args)
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}"}
    fn = config.model_spec.parallelize_fn
    return {"parallelize_fn": "/".join(fn.__code__.co_filename.split("/")[-3:]),
            "wraps": f"{fn.__wrapped__.__module__}.{fn.__wrapped__.__name__}",
            "mixed_precision_param": config.training.mixed_precision_param,
            "compile_components": config.compile.components,
            "loss": type(config.loss).__qualname__}

print(json.dumps([parse(args) for args in json.loads(sys.argv[2])]))
"""


def _documented_command() -> tuple[str, list[str]]:
    """docs/torchtitan.md's config module (the block that starts ``# my_configs.py``) and the
    arguments its command gives ``torchtitan.train``."""
    text = _DOCS.read_text()
    module = next(b for b in re.findall(r"^```python\n(.*?)^```", text, re.M | re.S) if b.startswith("# my_configs.py"))
    command = next(line for line in text.splitlines() if "-m torchtitan.train" in line)
    return module, command.split("-m torchtitan.train", 1)[1].split()


def _parse(tmp_path: Path, module: str, *arg_lists: list[str]) -> list[dict]:
    """What ``ConfigManager().parse_args`` makes of each argument list, in one fresh process."""
    (tmp_path / "my_configs.py").write_text(module)
    done = subprocess.run(
        [sys.executable, "-c", _PARSE, str(tmp_path), json.dumps(arg_lists)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_documented_command_parses_into_amp_fxs_config(tmp_path):
    """The command and config module of docs/torchtitan.md, parsed by torchtitan's own
    ``ConfigManager`` (what ``torchtitan.train`` does first; training itself needs an accelerator):
    the model's parallelize_fn is amp_fx's around torchtitan's ``parallelize_llama``, the
    parameters stay fp32 (autocast semantics), torchtitan's model compile is off and the loss is
    the plain one (lm_head inside the model); a CLI override still applies on top. A config name
    with a typo gets torchtitan's error, which lists the module's config functions."""
    module, args = _documented_command()
    assert args[:2] == ["--module", "my_configs"], args
    config, overridden, typo = _parse(
        tmp_path,
        module,
        args,
        [*args, "--training.mixed_precision_param", "bfloat16"],
        [a + "x" if a == args[-1] else a for a in args],
    )
    assert config == {
        "parallelize_fn": "amp_fx/integrations/torchtitan.py",  # functools.wraps hides the name
        "wraps": "torchtitan.models.llama3.parallelize.parallelize_llama",
        "mixed_precision_param": "float32",
        "compile_components": ["loss"],
        "loss": "CrossEntropyLoss.Config",
    }, config
    assert overridden["mixed_precision_param"] == "bfloat16"
    assert "error" in typo and f"'{args[-1]}x' not found" in typo["error"], typo
    assert f"'{args[-1]}'" in typo["error"]  # the available config functions are listed


def test_with_amp_fx_rewrites_the_trainer_config():
    from torchtitan.components.loss import CrossEntropyLoss
    from torchtitan.models.llama3 import parallelize_llama

    config = trainer_config_fields()
    assert with_amp_fx(config, AmpFxTitanConfig(dtype="bf16")) is config
    assert config.model_spec.parallelize_fn.__wrapped__ is parallelize_llama
    assert config.compile.components == ["loss"]
    assert isinstance(config.loss, CrossEntropyLoss.Config)  # lm_head back inside the model's forward


def test_with_amp_fx_refuses_fp16_and_bad_configs():
    with pytest.raises(ValueError, match="loss scaling"):
        with_amp_fx(trainer_config_fields(), AmpFxTitanConfig(dtype="fp16"))
    with pytest.raises(ValueError, match="fp8"):
        AmpFxTitanConfig(dtype="fp16", fp8="tensorwise")
    with pytest.raises(ValueError):
        AmpFxTitanConfig(dtype="int8")
    with pytest.raises(TypeError, match="AmpFxTitanConfig"):
        amp_fx_parallelize(lambda m, **kw: m, {"dtype": "bf16"})


def test_with_amp_fx_refuses_pipeline_parallelism_and_torchtitans_float8(monkeypatch):
    """Both at config time, before any rank starts, each naming the fix."""
    from torchtitan.config import ParallelismConfig
    from torchtitan.models.llama3 import model_registry

    from amp_fx.testing.fp8_reference import torchao_missing

    config = trainer_config_fields()
    config.parallelism = ParallelismConfig(pipeline_parallel_degree=2)
    with pytest.raises(ValueError, match=r"pipeline parallelism .*amp_fx.compile"):
        with_amp_fx(config)
    config = trainer_config_fields()
    assert with_amp_fx(config, AmpFxTitanConfig(fp8="rowwise")) is config  # unconverted: accepted
    if torchao_missing() is not None:
        pytest.skip(f"torchtitan's float8 converter needs torchao: {torchao_missing()}")
    from torchtitan.components.quantization import Float8LinearConverter

    # its hardware check, let through as amp_fx.testing.torchtitan.cpu_debugmodel does
    monkeypatch.setattr("torchtitan.components.quantization.float8.has_cuda_capability", lambda major, minor: True)
    config = trainer_config_fields()
    config.model_spec = model_registry("debugmodel", converters=[Float8LinearConverter.Config()])
    said = r"made 31 Linear layers Float8Linear \(lm_head, .*AmpFxTitanConfig\(fp8='rowwise'\)"
    with pytest.raises(ValueError, match=said):
        with_amp_fx(config, AmpFxTitanConfig(fp8="rowwise"))


def _parallelize_args(*, pp: bool = False, param: str = "float32") -> dict:
    from torchtitan.config import CompileConfig, TrainingConfig

    return {
        "parallel_dims": SimpleNamespace(pp_enabled=pp),
        "compile_config": CompileConfig(),
        "training": TrainingConfig(mixed_precision_param=param),
    }


def test_amp_fx_parallelize_refuses_what_it_cannot_do():
    fp16 = amp_fx_parallelize(lambda m, **kw: m, AmpFxTitanConfig(dtype="fp16"))
    with pytest.raises(ValueError, match="mixed_precision_param='bfloat16'"):
        fp16(torch.nn.Linear(2, 2), **_parallelize_args(param="bfloat16"))
    with pytest.raises(ValueError, match="pipeline parallelism"):
        fp16(torch.nn.Linear(2, 2), **_parallelize_args(pp=True))


class _SkipsLmHead(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body, self.lm_head = torch.nn.Linear(8, 8), torch.nn.Linear(8, 16)
        self._skip_lm_head = False

    def forward(self, x):
        h = self.body(x)
        return h if self._skip_lm_head else self.lm_head(h)


def test_lm_head_called_outside_the_model_is_named():
    """torchtitan's ChunkedLossWrapper sets ``_skip_lm_head`` and calls ``lm_head`` from the loss:
    amp_fx says so once, naming it, and the logits it computes there are fp32 (not autocast's bf16)."""
    said = r"_SkipsLmHead\.lm_head runs outside the model's forward"
    x = torch.randn(4, 8)
    for strict in (False, True):
        model = amp_fx_parallelize(lambda m, **kw: m, AmpFxTitanConfig(dtype="bf16", backend="eager", strict=strict))(
            _SkipsLmHead(), **_parallelize_args()
        )
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert model(x).dtype == torch.bfloat16  # lm_head inside: nothing said
        model._skip_lm_head = True
        if strict:
            with pytest.raises(AmpFxError, match=said):
                model(x)
            continue
        with pytest.warns(AmpFxWarning, match=said):
            h = model(x)
        assert model.lm_head(h.float()).dtype == torch.float32
