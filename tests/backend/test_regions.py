"""Compiled regions (issue 62): each repeated block captured, rewritten and compiled once.

Against eager ``torch.autocast`` (bitwise under ``aot_eager``: loss and every gradient), and
against amp_fx's whole-graph compile (``regions=False``) where the policy singles a block out
(``keep_fp32`` on one block: the whole-graph compile is the reference tests/policy hold to the
policy's meaning). The compile counter pins that the number of captured graphs (each one pass run
and one downstream compile) does not grow with depth; the overflow watch and ``explain`` name ops
of the 5th block as the whole-graph run does.
"""

from __future__ import annotations

import copy
import logging
import warnings

import pytest
import torch
import torch._dynamo.testing
from torch import Tensor, nn

import amp_fx
from amp_fx._common.progress import PROGRESS_LOGGER
from amp_fx.backend.regions import find_regions, repeated_blocks
from amp_fx.policy import Policy
from amp_fx.testing import assert_bitwise, zoo
from amp_fx.testing.real_models import REAL_MODELS, eager_autocast_real_step, real_step

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _lm(n_layers: int) -> zoo.Built:
    return zoo.transformer_lm(n_layers=n_layers, d_model=32, n_heads=2, seq=8, batch=2, vocab=32)


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(16)
        self.fc = nn.Linear(16, 16)

    def forward(self, x: Tensor) -> Tensor:
        return x + torch.relu(self.fc(self.norm(x)))


def _sequential(n_layers: int) -> zoo.Built:
    """An ``nn.Sequential`` root: its frame is all loop, so Dynamo captures none of it; the first
    and last Linear are compiled as units of their own."""
    torch.manual_seed(zoo.SEED)
    model = nn.Sequential(nn.Linear(8, 16), *(_Block() for _ in range(n_layers)), nn.Linear(16, 4))
    x = torch.randn(2, 8, generator=torch.Generator().manual_seed(zoo.SEED + 1))
    return model, (x,), lambda out: out.float().square().mean()  # type: ignore[union-attr]


MODELS = {"transformer_lm": _lm, "sequential": _sequential}


def _regions_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == PROGRESS_LOGGER and "compiled once" in r.getMessage()]


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("name", sorted(MODELS))
def test_regions_bitwise_with_eager_autocast(name: str, dtype: torch.dtype) -> None:
    model, inputs, loss_fn = MODELS[name](4)
    expected = zoo.eager_autocast_step(copy.deepcopy(model), inputs, loss_fn, dtype)
    compiled = amp_fx.compile(model, dtype=dtype, backend="aot_eager", regions=None)
    actual = zoo.step(compiled, model, inputs, loss_fn)
    assert_bitwise(actual, expected)
    assert len(amp_fx.records(compiled)) >= 1  # graphs ran (regions did not fall back to eager)


def _count(n_layers: int, regions: bool, caplog: pytest.LogCaptureFixture) -> tuple[int, int, list[str]]:
    model, inputs, loss_fn = _lm(n_layers)
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    caplog.clear()
    with caplog.at_level(logging.INFO, logger=PROGRESS_LOGGER):
        compiled = amp_fx.compile(model, backend=counter, regions=regions)
        zoo.step(compiled, model, inputs, loss_fn)
    return len(amp_fx.records(compiled)), counter.frame_count, _regions_lines(caplog)


def test_blocks_compiled_once(caplog: pytest.LogCaptureFixture) -> None:
    """2 and 6 blocks: the same number of captures, pass runs (one record each) and downstream
    compiles; a compile per block would add 4 of each. The progress line says so."""
    graphs_2, compiles_2, lines_2 = _count(2, True, caplog)
    graphs_6, compiles_6, lines_6 = _count(6, True, caplog)
    assert (graphs_6, compiles_6) == (graphs_2, compiles_2), (graphs_2, graphs_6, compiles_2, compiles_6)
    assert lines_2 == ["amp_fx: _TransformerLM: SDPABlock (blocks.0): compiled once, reused by 1 block"]
    assert lines_6 == ["amp_fx: _TransformerLM: SDPABlock (blocks.0): compiled once, reused by 5 blocks"]
    # The negative twin: the whole graph holds every block, one graph, no region line.
    whole_6, _, lines_whole = _count(6, False, caplog)
    assert whole_6 == 1 and lines_whole == []


def test_block_kept_in_fp32_gets_its_own_region(caplog: pytest.LogCaptureFixture) -> None:
    policy = Policy(keep_fp32=("blocks.2",))
    model, inputs, loss_fn = _lm(4)
    whole_model = copy.deepcopy(model)
    with caplog.at_level(logging.INFO, logger=PROGRESS_LOGGER):
        compiled = amp_fx.compile(model, backend="aot_eager", policy=policy, regions=None)
        actual = zoo.step(compiled, model, inputs, loss_fn)
    whole = amp_fx.compile(whole_model, backend="aot_eager", policy=policy, regions=False)
    expected = zoo.step(whole, whole_model, inputs, loss_fn)
    assert_bitwise(actual, expected)
    assert _regions_lines(caplog) == [
        "amp_fx: _TransformerLM: SDPABlock (blocks.0): compiled once, reused by 2 blocks",
        "amp_fx: _TransformerLM: SDPABlock_1 (blocks.2): compiled once, a block of its own (policy)",
    ]
    # The kept block's graph ran its matmuls in fp32, its siblings' in bf16 (the test can fail:
    # a region shared by all four would run blocks.2 in bf16 and differ from the whole graph).
    autocast = zoo.eager_autocast_step(copy.deepcopy(whole_model), inputs, loss_fn, torch.bfloat16)
    assert not torch.equal(actual.grads["blocks.2.ff1.weight"], autocast.grads["blocks.2.ff1.weight"])


def test_regions_found_where_they_are_and_nowhere_else() -> None:
    model, _, _ = _lm(3)
    assert [n for n, _ in repeated_blocks(model)] == ["blocks.0", "blocks.1", "blocks.2"]
    regions = find_regions(model, Policy())
    assert regions is not None and [type(m).__name__ for m in regions.outside] == ["Embedding", "LayerNorm"]
    # Negative twins: a Sequential of Linears (leaves, one op each) and a single block are no regions.
    assert repeated_blocks(nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))) == []
    assert find_regions(_lm(1)[0], Policy()) is None


# --- names: the watch and explain ---------------------------------------------------------------

_PLANTED = "blocks.4.ff1"


def _planted_lm() -> zoo.Built:
    model, inputs, loss_fn = _lm(6)
    with torch.no_grad():
        model.get_submodule(_PLANTED).weight.mul_(1e5)  # its fp16 output overflows in the forward
    return model, inputs, loss_fn


@pytest.mark.parametrize("regions", [True, False], ids=["regions", "whole"])
def test_watch_names_the_fifth_block(regions: bool) -> None:
    model, inputs, loss_fn = _planted_lm()
    compiled = amp_fx.compile(model, dtype="fp16", backend="aot_eager", watch_nonfinite=True, regions=regions)
    zoo.step(compiled, model, inputs, loss_fn)
    watch = compiled.amp_fx_watch
    assert watch is not None
    first = watch.describe(int(watch.peek(torch.device("cpu"))))
    assert first is not None and first.module == _PLANTED, first
    assert not first.backward


def test_watch_names_the_fifth_block_in_the_backward() -> None:
    """An inf that first appears in the 5th block's backward (its forward finite) is named there,
    as in the whole-graph run: the shared graph's backward is renamed for the block it ran for."""
    found = {}
    for regions in (True, False):
        model, inputs, loss_fn = _lm(6)
        with torch.no_grad():
            model.get_submodule("blocks.4.ff2").weight.mul_(3e3)  # finite forward, its grad overflows
        compiled = amp_fx.compile(model, dtype="fp16", backend="aot_eager", watch_nonfinite=True, regions=regions)
        out = compiled(*inputs)
        (loss_fn(out) * 6e4).backward()
        watch = compiled.amp_fx_watch
        assert watch is not None
        found[regions] = watch.describe(int(watch.peek(torch.device("cpu"))))
    assert found[False] is not None and found[False].backward and found[False].module.startswith("blocks.4."), found
    assert found[True] is not None and (found[True].module, found[True].op) == (found[False].module, found[False].op)


def test_explain_names_the_fifth_block() -> None:
    """explain compiles its own copy as one graph: every block's ops by their own names."""
    model, inputs, _ = _lm(6)
    explanation = amp_fx.explain(model, *inputs)
    modules = {n.module for n in explanation.nodes()}
    assert {f"blocks.{i}.ff1" for i in range(6)} <= modules, sorted(modules)


# --- the real-model tier's transformers ---------------------------------------------------------


@pytest.mark.models
@pytest.mark.parametrize("name", ["hf_llama", "hf_gpt2", "hf_bert"])
def test_real_transformers_in_regions_bitwise(name: str, caplog: pytest.LogCaptureFixture) -> None:
    entry = REAL_MODELS[name]
    if entry.missing():
        pytest.skip(entry.missing() or "")
    model, inputs, loss_fn = entry.build()
    expected = eager_autocast_real_step(copy.deepcopy(model), inputs, loss_fn, torch.bfloat16)
    with caplog.at_level(logging.INFO, logger=PROGRESS_LOGGER):
        compiled = amp_fx.compile(model, backend="aot_eager", policy=entry.policy, regions=None)
        actual = real_step(compiled, model, inputs, loss_fn)
    assert_bitwise(actual, expected)
    lines = _regions_lines(caplog)
    assert len(lines) == 1 and "compiled once, reused by 1 block" in lines[0], lines


def test_new_batch_and_length_bitwise_in_regions() -> None:
    """Regions under Dynamo's automatic dynamic shapes: a second batch and length recompile the
    shared block graph (symbolic sizes), still bitwise with eager autocast at each call."""
    model, _, loss_fn = _lm(3)
    reference = copy.deepcopy(model)
    compiled = amp_fx.compile(model, backend="aot_eager", regions=None)
    gen = torch.Generator().manual_seed(0)
    for batch, length in ((2, 8), (3, 12)):
        ids = torch.randint(0, 32, (batch, length), generator=gen)
        for p in (*model.parameters(), *reference.parameters()):
            p.grad = None
        expected = zoo.eager_autocast_step(reference, (ids,), loss_fn, torch.bfloat16)
        assert_bitwise(zoo.step(compiled, model, (ids,), loss_fn), expected, f"batch {batch}, length {length}")


class _ConvBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 3, padding=1)
        self.norm = nn.GroupNorm(2, 4)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.conv(self.norm(x))


@pytest.mark.parametrize("regions", [None, True], ids=["default", "forced"])
def test_convolutional_blocks_compile_as_one_graph_by_default(
    regions: bool | None, caplog: pytest.LogCaptureFixture
) -> None:
    """Blocks that hold convolutions are not shown bitwise in regions (transformers' ConvNext,
    diffusers' UNets: tests/models), so the default compiles them as one graph and says so;
    regions=True compiles them in regions all the same."""
    torch.manual_seed(zoo.SEED)
    model = nn.Sequential(*(_ConvBlock() for _ in range(3)))
    with caplog.at_level(logging.INFO, logger=PROGRESS_LOGGER):
        compiled = amp_fx.compile(model, backend="aot_eager", regions=regions)
        compiled(torch.randn(1, 4, 6, 6)).float().sum().backward()
    said = [r.getMessage() for r in caplog.records if r.name == PROGRESS_LOGGER]
    if regions is None:
        assert len(amp_fx.records(compiled)) == 1
        assert any("compiled as one graph: its repeated blocks hold convolutions (0.conv)" in m for m in said), said
    else:
        # one block graph per input dtype (fp32 into the first block, bf16 after it), 3 blocks
        assert len(amp_fx.records(compiled)) == 2
        assert any("_ConvBlock (0): compiled once, reused by 2 blocks" in m for m in said), said


class _HeadAfterLoop(nn.Module):
    """A root whose own parameter (a head) is used after the loop over its blocks. Each block call
    breaks Dynamo's graph, and a break inside a loop makes Dynamo skip the whole frame: with the
    loop in ``forward`` (``own_method=False``) the head runs outside every compiled graph; with the
    loop in a method of its own (the fix the report names) only that method's frame is skipped."""

    def __init__(self, *, own_method: bool) -> None:
        super().__init__()
        self.own_method = own_method
        self.emb = nn.Embedding(10, 16)
        self.blocks = nn.ModuleList(_Block() for _ in range(3))
        self.head = nn.Parameter(torch.randn(10, 16))

    def run_blocks(self, h: Tensor) -> Tensor:
        for block in self.blocks:
            h = block(h)
        return h

    def forward(self, ids: Tensor) -> Tensor:
        h = self.emb(ids)
        if self.own_method:
            h = self.run_blocks(h)
        else:
            for block in self.blocks:
                h = block(h)
        return nn.functional.linear(h, self.head)


@pytest.mark.parametrize("own_method", [False, True], ids=["loop_in_forward", "loop_in_own_method"])
def test_root_ops_outside_every_graph_are_reported(own_method: bool) -> None:
    """The root's own parameter used where Dynamo skipped the root's frame ran as eager autocast,
    outside every compiled graph: said once, naming the root and the two fixes; with the loop in
    a method of its own, the head is captured in the root's graph, bitwise, and nothing is said."""
    torch.manual_seed(zoo.SEED)
    model = _HeadAfterLoop(own_method=own_method)
    ids = torch.randint(0, 10, (2, 5), generator=torch.Generator().manual_seed(zoo.SEED))
    loss_fn = lambda out: out.float().square().mean()  # noqa: E731
    expected = zoo.eager_autocast_step(copy.deepcopy(model), (ids,), loss_fn, torch.bfloat16)
    compiled = amp_fx.compile(model, backend="aot_eager", regions=None, strict=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert_bitwise(zoo.step(compiled, model, (ids,), loss_fn), expected)
        compiled(ids)
    said = [str(w.message) for w in caught if "outside every compiled graph" in str(w.message)]
    if own_method:
        assert said == []
        heads = [
            n
            for r in amp_fx.records(compiled)
            for n in r.captured.graph.nodes
            if n.target is torch.ops.aten.linear.default and n.meta["val"].shape[-1] == 10
        ]
        assert len(heads) == 1  # the head's linear, in the root's graph
        return
    assert len(said) == 1, said
    assert "amp_fx.compile(_HeadAfterLoop) in compiled regions" in said[0] and "<root>" in said[0]
    assert "regions=False" in said[0] and "def run_blocks" in said[0]
    with pytest.raises(amp_fx.AmpFxError, match="outside every compiled graph"):
        amp_fx.compile(_HeadAfterLoop(own_method=False), backend="aot_eager", regions=None, strict=True)(ids)


class _PermutedBlock(nn.Module):
    """ConvNext's layer without its convolution: channels last inside, a layer scale, the
    residual added in the input's layout."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(32)
        self.fc = nn.Linear(32, 32)
        self.scale = nn.Parameter(torch.rand(32))

    def forward(self, x: Tensor) -> Tensor:
        return x + (self.scale * self.fc(self.norm(x.permute(0, 2, 3, 1)))).permute(0, 3, 1, 2)


class _PooledStack(nn.Module):
    def __init__(self, *, channels_last: bool) -> None:
        super().__init__()
        self.channels_last = channels_last
        self.blocks = nn.ModuleList(_PermutedBlock() for _ in range(3))
        self.head = nn.Linear(32, 4)

    def run_blocks(self, x: Tensor) -> Tensor:
        for block in self.blocks:
            x = block(x)
        return x

    def forward(self, x: Tensor) -> Tensor:
        if self.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        return self.head(self.run_blocks(x).mean([-2, -1]))  # mean's backward: a contiguous gradient


@pytest.mark.parametrize("channels_last", [True, False], ids=["channels_last", "contiguous"])
def test_gradient_laid_out_unlike_the_block_output_is_reported(channels_last: bool) -> None:
    """The cause of ConvNext's 1-ulp gradients in regions: a block's output is channels last, its
    gradient arrives contiguous (from the pooling's backward), AOTAutograd lays it out as the
    output before the region's backward, eager autocast's backward reads it as it arrived, and
    the layer scale's gradient (a reduction) sums in another order. No convolution is needed.
    Said once, naming the block and regions=False (bitwise); its negative twin, contiguous
    throughout, is bitwise in regions and says nothing."""
    torch.manual_seed(zoo.SEED)
    model = _PooledStack(channels_last=channels_last)
    x = torch.randn(4, 32, 8, 8, generator=torch.Generator().manual_seed(zoo.SEED))
    loss_fn = lambda out: out.float().square().mean()  # noqa: E731
    expected = zoo.eager_autocast_step(copy.deepcopy(model), (x,), loss_fn, torch.bfloat16)
    whole = copy.deepcopy(model)
    assert_bitwise(zoo.step(amp_fx.compile(whole, backend="aot_eager", regions=False), whole, (x,), loss_fn), expected)
    compiled = amp_fx.compile(model, backend="aot_eager", regions=None, strict=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        actual = zoo.step(compiled, model, (x,), loss_fn)
    said = [str(w.message) for w in caught if "the gradient reaching the output of" in str(w.message)]
    if not channels_last:
        assert said == []
        assert_bitwise(actual, expected)
        return
    assert len(said) == 1 and "blocks.2" in said[0] and "regions=False" in said[0], said
    differ = [k for k, g in actual.grads.items() if not torch.equal(g, expected.grads[k])]
    assert "blocks.2.scale" in differ, differ  # what it is said for: 1 ulp off eager autocast
    strict = amp_fx.compile(copy.deepcopy(model), backend="aot_eager", regions=None, strict=True)
    with pytest.raises(amp_fx.AmpFxError, match="the gradient reaching the output of blocks.2"):
        loss_fn(strict(x)).backward()


@pytest.mark.parametrize("regions", [None, True], ids=["default", "forced"])
def test_op_classes_compile_as_one_graph_by_default(regions: bool | None, caplog: pytest.LogCaptureFixture) -> None:
    """Policy(op_classes=...) acts on single ops, and code around the regions that Dynamo skips is
    out of its reach, so the default compiles the whole model as one graph and says why (fp8 alike,
    through the same rule); regions=True compiles the blocks once all the same."""
    model, inputs, loss_fn = _lm(3)
    policy = Policy(op_classes={"aten.gelu": amp_fx.CastClass.FP32})
    with caplog.at_level(logging.INFO, logger=PROGRESS_LOGGER):
        compiled = amp_fx.compile(model, backend="aot_eager", policy=policy, regions=regions, strict=False)
        zoo.step(compiled, model, inputs, loss_fn)
    said = [r.getMessage() for r in caplog.records if r.name == PROGRESS_LOGGER]
    if regions is None:
        assert len(amp_fx.records(compiled)) == 1
        assert any("compiled as one graph: Policy(op_classes=...) acts on single ops" in m for m in said), said
    else:
        assert any("compiled once, reused by 2 blocks" in m for m in said), said


@pytest.mark.parametrize(
    "env,given,expected",
    [("", None, False), ("1", None, None), ("always", None, True), ("0", None, False), ("1", False, False)],
)
def test_regions_default_read_from_the_environment(
    env: str, given: bool | None, expected: bool | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``AMP_FX_REGIONS`` sets compile's default (the suite runs with regions on through it); a
    ``regions=`` given in the call wins; an unknown value is an error, not silently ignored."""
    monkeypatch.setenv("AMP_FX_REGIONS", env)
    kwargs = {} if given is None else {"regions": given}
    compiled = amp_fx.compile(nn.Linear(4, 4), backend="aot_eager", **kwargs)
    assert amp_fx.options_of(compiled).regions is expected
    monkeypatch.setenv("AMP_FX_REGIONS", "sometimes")
    with pytest.raises(ValueError, match="AMP_FX_REGIONS='sometimes'"):
        amp_fx.compile(nn.Linear(4, 4), backend="aot_eager")
