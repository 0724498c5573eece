"""The weight-cast cache (``weight_cache=True``) against eager autocast and torch.amp.GradScaler.

Every reference is computed in the test on an identical copy of the model: eager
``torch.autocast`` (+ ``torch.amp.GradScaler`` for fp16 via ``amp_fx._step_reference``). With the
cache on, results must stay bitwise under ``aot_eager``; the structure tests show that the cache
is really used (graphs hold no weight cast, one cast per weight per optimizer step); each
invalidation test first checks that a stale copy would give a different result than the fresh
one, so it can fail.
"""

from __future__ import annotations

import copy
import math
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import amp_fx
from amp_fx.errors import AmpFxError, AmpFxWarning
from amp_fx.passes import meta
from amp_fx.passes.lift_weight_casts import lift_weight_casts
from amp_fx.scaler import GradScaler, ScalerMode, StepMode
from amp_fx.testing import assert_bitwise, eager_amp_step
from amp_fx.testing.zoo import ZOO, TiedLM, eager_autocast_step, step
from tests.backend._parity import assert_within_excess_precision

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def assert_copies_fresh(cache: Any, model: nn.Module, dtype: torch.dtype, *, all_valid: bool = False) -> None:
    """Every copy the cache would use as it is holds exactly its weight cast to ``dtype``
    (``all_valid``: and every copy is such a copy, none waits for a recast)."""
    pairs = cache.pairs(list(model.parameters()))
    assert pairs, "nothing cached: the test would not exercise the cache"
    for w, lowp in pairs:
        if cache.is_fresh(w, lowp):
            assert_bitwise(lowp, w.detach().to(dtype), "cached copy")
        else:
            assert not all_valid, "a copy waits for a recast"


class ThreeGraphs(nn.Module):
    """``fc`` used in three graphs (two breaks), twice in the last one: four gradient
    contributions that eager autocast adds in the low dtype one by one, latest use first.
    With ``early_twice`` the first graph uses it twice instead: that graph's backward adds its
    two contributions before they meet the later ones (same terms, other grouping)."""

    def __init__(self, d: int = 16, *, early_twice: bool = False) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.mid = nn.Linear(d, d)
        self.early_twice = early_twice

    def forward(self, x: Tensor) -> Tensor:
        h = F.gelu(self.fc(x))
        if self.early_twice:
            h = F.gelu(self.fc(h))
        torch._dynamo.graph_break()
        h = F.relu(self.mid(h)) + self.fc(h)
        torch._dynamo.graph_break()
        return self.fc(h) if self.early_twice else self.fc(F.gelu(self.fc(h)))


def _three_graphs(early_twice: bool = False) -> tuple[nn.Module, tuple[Tensor, ...], Callable[[object], Tensor]]:
    torch.manual_seed(0)
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(1))
    return ThreeGraphs(early_twice=early_twice), (x,), lambda out: out.float().pow(2).mean()  # type: ignore[union-attr]


class TiedBreakLM(TiedLM):
    """The zoo's TiedLM with ALBERT-style sharing across a graph break: ``block`` applied twice
    before the break and once after it, an output projection tied to the embedding after it.
    Eager autocast adds block's three gradient contributions into its cached cast one by one,
    latest use first; the first graph must hand back one gradient per use for the cache to do
    the same."""

    def forward(self, ids: Tensor) -> Tensor:
        h = self.emb(ids)
        h = h + F.gelu(self.block(h))
        h = h + F.gelu(self.block(h))
        torch._dynamo.graph_break()
        h = h + F.gelu(self.block(h))
        return F.linear(self.norm(h), self.emb.weight)


class TwiceInOneOp(nn.Module):
    """``w`` twice in one op (``w @ w``) and once more in that graph, then once after a break:
    autograd adds one node's two gradients in argument order."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(d, d) / d**0.5)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(x @ (self.w @ self.w) + x @ self.w)
        torch._dynamo.graph_break()
        return h @ self.w


class SharedEncDec(TiedLM):
    """T5's pattern: one embedding looked up twice in fp32 (encoder and decoder) and tied to the
    output projection (``break_before_head``: after a graph break). Eager autograd adds the three
    contributions into ``emb.weight``'s buffer latest first, ``(head + dec) + enc``; a graph that
    sums its two lookups itself hands back ``enc + dec`` (before the fix: not bitwise in fp32)."""

    def __init__(self, *, break_before_head: bool = False) -> None:
        super().__init__()
        self.break_before_head = break_before_head

    def forward(self, ids: Tensor) -> Tensor:
        enc = self.emb(ids)
        enc = enc + F.gelu(self.block(enc))
        h = self.emb(ids.flip(-1)) * enc.mean(1, keepdim=True)
        if self.break_before_head:
            torch._dynamo.graph_break()
        return F.linear(self.norm(h), self.emb.weight)


def _sq_mean(out: object) -> Tensor:
    return out.float().pow(2).mean()  # type: ignore[union-attr]


def _build(name: str) -> tuple[nn.Module, tuple[Tensor, ...], Callable[[object], Tensor]]:
    if name in ("three_graphs", "three_graphs_early_twice"):
        return _three_graphs(early_twice=name.endswith("early_twice"))
    if name in ("tied_break", "twice_in_one_op", "shared_enc_dec", "shared_enc_dec_break"):
        torch.manual_seed(0)
        g = torch.Generator().manual_seed(1)
        if name.startswith("shared_enc_dec"):
            ids = torch.randint(0, 32, (4, 16), generator=g)
            return SharedEncDec(break_before_head=name.endswith("break")), (ids,), _sq_mean
        if name == "tied_break":
            return TiedBreakLM(), (torch.randint(0, 32, (2, 8), generator=g),), _sq_mean
        return TwiceInOneOp(), (torch.randn(4, 16, generator=g),), _sq_mean
    return ZOO[name].build()


# --- one forward+backward: bitwise with eager autocast --------------------------------------


@pytest.mark.slow_cases
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize(
    "name",
    [
        "mlp",
        "tied_embedding",
        "rmsnorm",
        "sdpa_block",
        "graph_break",
        "three_graphs",
        "three_graphs_early_twice",
        "tied_break",
        "twice_in_one_op",
        "shared_enc_dec",
        "shared_enc_dec_break",
    ],
)
def test_forward_backward_bitwise(name: str, dtype: torch.dtype) -> None:
    """``graph_break`` is a strict xfail without the cache (test_compile_parity.py): fc's two
    contributions then add up in fp32. With the cache every graph gets the same autograd node.
    ``tied_embedding`` uses ``block`` twice in one graph and no break; ``three_graphs_early_twice``,
    ``tied_break`` and ``twice_in_one_op`` use a weight several times in a graph and again after
    a break, where the graph must return one gradient per use (see lift_weight_casts).
    ``shared_enc_dec`` (T5's tied embedding: two fp32 lookups and the cast head) needs each fp32
    use lifted too, its node made in eager's order; ``shared_enc_dec_break`` the same with the
    head after a graph break (two fp32 uses and no cast in the first graph)."""
    model, inputs, loss_fn = _build(name)
    expected = eager_autocast_step(copy.deepcopy(model), inputs, loss_fn, dtype)
    compiled = amp_fx.compile(model, dtype=dtype, backend="aot_eager", weight_cache=True)
    actual = step(compiled, model, inputs, loss_fn)
    assert_bitwise(actual.out, expected.out, "output")
    assert_bitwise(actual.loss, expected.loss, "loss")
    for n, g in expected.grads.items():
        assert_bitwise(actual.grads[n], g, f"{n}.grad")
    assert compiled.amp_fx_weight_cache.refreshes > 0


def test_without_cache_the_three_graph_weight_is_not_bitwise() -> None:
    """Negative twin of the test above: without the cache fc.grad differs from eager (so the
    model does exercise the cross-graph summation that the cache fixes)."""
    model, inputs, loss_fn = _three_graphs()
    expected = eager_autocast_step(copy.deepcopy(model), inputs, loss_fn, torch.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        compiled = amp_fx.compile(model, dtype=torch.bfloat16, backend="aot_eager", strict=False)
        actual = step(compiled, model, inputs, loss_fn)
    assert not torch.equal(actual.grads["fc.weight"], expected.grads["fc.weight"])


# --- structure: the graphs cast no weight, each weight is cast once per optimizer step -------


def _recording_backend(graphs: list[torch.fx.GraphModule]) -> Callable[..., Any]:
    def backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        graphs.append(gm)
        return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)

    return backend


def _param_casts(gm: torch.fx.GraphModule) -> int:
    return sum(
        1
        for n in gm.graph.nodes
        if n.op == "call_function"
        and n.target is torch.ops.aten._to_copy.default
        and n.args[0].op == "placeholder"
        and n.args[0].meta["val"].dtype == torch.float32
        and n.kwargs.get("dtype") == torch.bfloat16
        and not n.args[0].name.startswith("l_args")
    )


@pytest.mark.parametrize("weight_cache", [True, False])
def test_downstream_graphs_cast_no_weight(weight_cache: bool) -> None:
    """The graph handed to the downstream backend reads lifted inputs instead of casting the
    weights (negative twin: without the cache it casts every one of them)."""
    graphs: list[torch.fx.GraphModule] = []
    model, inputs, loss_fn = ZOO["tied_embedding"].build()
    compiled = amp_fx.compile(
        model, dtype=torch.bfloat16, backend=_recording_backend(graphs), weight_cache=weight_cache
    )
    loss_fn(compiled(*inputs)).backward()
    (graph,) = graphs
    lifted = [n for n in graph.graph.nodes if n.meta.get(meta.WEIGHT_CACHE)]
    if weight_cache:
        # emb.weight once, block.weight and block.bias twice each: one input per use
        assert _param_casts(graph) == 0 and len(lifted) == 5
    else:
        assert _param_casts(graph) == 3 and not lifted
    # the recorded graph (what inspection tools run) keeps its casts either way
    assert compiled.amp_fx_records[0].casts >= 3


@pytest.mark.parametrize("name", ["shared_enc_dec", "shared_enc_dec_break", "tied_embedding", "tied_break"])
def test_fp32_uses_lifted_only_where_their_order_matters(name: str) -> None:
    """A trainable weight's fp32 uses get inputs of their own (``amp_fx_weight_use``) in a graph
    that also casts it, or uses it twice or more in fp32; a graph with one fp32 use and no cast
    of it keeps the weight itself (negative twin: ``tied_break``'s first graph, whose embedding
    lookup is the weight's only use there)."""
    graphs: list[torch.fx.GraphModule] = []
    model, inputs, loss_fn = _build(name)
    compiled = amp_fx.compile(model, dtype=torch.bfloat16, backend=_recording_backend(graphs), weight_cache=True)
    loss_fn(compiled(*inputs)).backward()
    uses = [sum(1 for n in g.graph.nodes if n.meta.get(meta.WEIGHT_USE)) for g in graphs]
    expected = {"shared_enc_dec": [2], "shared_enc_dec_break": [2, 0], "tied_embedding": [1], "tied_break": [0, 0]}
    assert uses == expected[name]


def _refuses_lifted_graphs(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
    if any(n.meta.get(meta.WEIGHT_CACHE) for n in gm.graph.nodes if n.op == "placeholder"):
        raise RuntimeError("this backend compiles no graph with lifted weight casts")
    return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)


@pytest.mark.parametrize("strict", [False, True])
def test_backend_failure_on_the_lifted_graph_is_reported(strict: bool) -> None:
    """A downstream backend that cannot compile the lifted graph: amp_fx says so through the
    reporter (naming the backend's error and the fix) and compiles the graph with its casts,
    bitwise with eager autocast; strict mode raises amp_fx's error, not Dynamo's."""
    model, inputs, loss_fn = ZOO["mlp"].build()
    expected = eager_autocast_step(copy.deepcopy(model), inputs, loss_fn, torch.bfloat16)
    compiled = amp_fx.compile(
        model, dtype=torch.bfloat16, backend=_refuses_lifted_graphs, weight_cache=True, strict=strict
    )
    message = r"weight_cache=True: the .* backend failed on graph 0 .*RuntimeError.*Pass weight_cache=False"
    if strict:
        with pytest.raises(AmpFxError, match=message):
            compiled(*inputs)
        return
    with pytest.warns(AmpFxWarning, match=message):
        actual = step(compiled, model, inputs, loss_fn)
    for n, g in expected.grads.items():
        assert_bitwise(actual.grads[n], g, f"{n}.grad")
    assert compiled.amp_fx_weight_cache.refreshes == 0


@pytest.mark.parametrize("frozen", [False, True])
def test_one_input_per_use_of_a_trainable_weight(frozen: bool) -> None:
    """The graph before the break uses block.weight and block.bias twice each: a trainable
    weight gets one lifted input per use (its graph returns one gradient per use), a frozen one
    a single input for all its uses (negative twin: no gradient, nothing to keep apart)."""
    graphs: list[torch.fx.GraphModule] = []
    model, inputs, loss_fn = _build("tied_break")
    model.block.requires_grad_(not frozen)
    compiled = amp_fx.compile(model, dtype=torch.bfloat16, backend=_recording_backend(graphs), weight_cache=True)
    loss_fn(compiled(*inputs)).backward()
    lifted = [n for n in graphs[0].graph.nodes if n.meta.get(meta.WEIGHT_CACHE)]
    assert len(lifted) == (2 if frozen else 4) and all(len(n.users) == (2 if frozen else 1) for n in lifted)


@pytest.mark.parametrize("accumulate", [1, 4])
def test_one_cast_per_weight_per_optimizer_step(accumulate: int) -> None:
    """Plain amp_fx.compile + a non-fused optimizer: the copies are recast lazily, once per
    optimizer step, whatever the number of micro-batches and graphs."""
    model, inputs, loss_fn = ZOO["graph_break"].build()
    compiled = amp_fx.compile(model, dtype=torch.bfloat16, backend="aot_eager", weight_cache=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cache = compiled.amp_fx_weight_cache
    n_cast = 4  # fc.weight, fc.bias, mid.weight, mid.bias
    for window in range(3):
        for _ in range(accumulate):
            loss_fn(compiled(*inputs)).backward()
        assert cache.refreshes == n_cast * (window + 1)
        opt.step()
        opt.zero_grad()
    assert cache.hits == n_cast * 3 * (accumulate - 1)


# --- training: bitwise trajectories ----------------------------------------------------------


def _batches(n: int, poison: dict[int, float]) -> list[tuple[Tensor, Tensor]]:
    g = torch.Generator().manual_seed(1)
    out = []
    for i in range(n):
        x, y = torch.randn(6, 16, generator=g), torch.randn(6, 8, generator=g)
        if i in poison:
            x[0, 0] = poison[i]
        out.append((x, y))
    return out


_OPTS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "sgd_momentum": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
    "adamw_fused": lambda p: torch.optim.AdamW(p, lr=1e-2, fused=True),
}
# fp16: 1e6 overflows the fp16 matmul, inf poisons both dtypes; windows in a row are skipped.
_POISON = {
    torch.float16: {2: 1e6, 3: 1e6, 4: math.inf, 9: 1e6},
    torch.bfloat16: {2: math.inf, 3: math.inf, 9: -math.inf},
}


def _scalers(dtype: torch.dtype) -> tuple[GradScaler, Any]:
    if dtype == torch.bfloat16:  # torch's scaler has no check-only mode (see tests/step/test_step.py)
        return (
            GradScaler("cpu", mode=ScalerMode.CHECK_ONLY, step_mode=StepMode.MASKED),
            GradScaler("cpu", mode=ScalerMode.CHECK_ONLY),
        )
    return (
        GradScaler("cpu", growth_interval=3, step_mode=StepMode.MASKED),
        torch.amp.GradScaler("cpu", growth_interval=3),
    )


@pytest.mark.slow_cases
@pytest.mark.parametrize("opt_name", ["sgd_momentum", "adamw_fused"])
@pytest.mark.parametrize("accumulate", [1, 4])
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_compile_step_trajectory_bitwise(dtype: torch.dtype, accumulate: int, opt_name: str) -> None:
    """compile_step(weight_cache=True) against eager autocast + GradScaler, with overflows: losses,
    parameters and scale bitwise at every window, and the copies equal to the weights' casts
    after every window (a skipped step keeps them, bit for bit)."""
    model = ZOO["mlp"].build()[0]  # compile_step compiles with fullgraph=True: no graph break
    ref_model = copy.deepcopy(model)
    ours_scaler, ref_scaler = _scalers(dtype)
    opt, ref_opt = _OPTS[opt_name](model.parameters()), _OPTS[opt_name](ref_model.parameters())
    ours = amp_fx.compile_step(
        model,
        opt,
        F.mse_loss,
        dtype=dtype,
        scaler=ours_scaler,
        accumulate=accumulate,
        backend="aot_eager",
        weight_cache=True,
    )
    ref = eager_amp_step(ref_model, ref_opt, F.mse_loss, ref_scaler, dtype=dtype, accumulate=accumulate)
    cache = ours._forward.amp_fx_weight_cache
    skipped_windows = 0
    before: list[Tensor | None] = []
    for i, (x, y) in enumerate(_batches(4 * accumulate + 6, _POISON[dtype])):
        compiled_finish = ours._follow.warmed_up  # else this window's step runs eagerly (warm-up)
        assert_bitwise(ours(x, y), ref(x, y), f"loss {i}")
        if (i + 1) % accumulate:
            continue
        assert_bitwise(ours_scaler._scale, ref_scaler._scale, f"scale after micro-batch {i}")
        for (n, p), q in zip(model.named_parameters(), ref_model.parameters(), strict=True):
            assert_bitwise(p, q, f"{n} after micro-batch {i}")
        # a compiled finish writes every copy; after an eager (warm-up) step they wait for a recast
        assert_copies_fresh(cache, model, dtype, all_valid=compiled_finish)
        if bool(ours.last_step_skipped) and before:
            skipped_windows += 1
            for (_, lowp), old in zip(cache.pairs(list(model.parameters())), before, strict=True):
                if old is not None:
                    assert_bitwise(lowp, old, "copy across a skipped step")
        before = [
            lowp.clone() if cache.is_fresh(w, lowp) else None for w, lowp in cache.pairs(list(model.parameters()))
        ]
    assert skipped_windows > 0, "no skipped step after warm-up: the overflow case was not exercised"


def test_compile_step_casts_nothing_in_the_forward_after_warm_up() -> None:
    """The finish graph writes the copies: no lazy recast once warm, and no recompile."""
    model = ZOO["mlp"].build()[0]
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ours = amp_fx.compile_step(
        model, opt, F.mse_loss, dtype=torch.bfloat16, accumulate=2, backend="aot_eager", weight_cache=True
    )
    cache = ours._forward.amp_fx_weight_cache
    batches = [(torch.randn(4, 16), torch.randn(4, 8)) for _ in range(10)]
    for x, y in batches[:4]:
        ours(x, y)
    refreshes, graphs = cache.refreshes, ours.graphs_compiled
    for x, y in batches[4:]:
        ours(x, y)
    assert cache.refreshes == refreshes and ours.graphs_compiled == graphs
    assert_copies_fresh(cache, model, torch.bfloat16, all_valid=True)


@pytest.mark.parametrize("accumulate", [1, 4])
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_tied_weights_training_bitwise(dtype: torch.dtype, accumulate: int) -> None:
    """TiedLM (embedding tied to the output projection, one block applied twice) trained with
    amp_fx.compile + SGD: parameters bitwise eager autocast's after each window."""
    model, inputs, loss_fn = ZOO["tied_embedding"].build()
    ref_model = copy.deepcopy(model)
    compiled = amp_fx.compile(model, dtype=dtype, backend="aot_eager", weight_cache=True)
    opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (model, ref_model)]
    for _ in range(3):
        for _ in range(accumulate):
            loss_fn(compiled(*inputs)).backward()
            with torch.autocast("cpu", dtype=dtype):
                ref_loss = loss_fn(ref_model(*inputs))
            ref_loss.backward()
        for opt in opts:
            opt.step()
            opt.zero_grad()
        for (n, p), q in zip(model.named_parameters(), ref_model.parameters(), strict=True):
            assert torch.isfinite(q).all(), f"eager diverged ({n}): the comparison would test NaNs"
            assert_bitwise(p, q, n)


@pytest.mark.parametrize("accumulate", [1, 4])
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_weight_used_twice_and_after_a_break_training_bitwise(dtype: torch.dtype, accumulate: int) -> None:
    """TiedBreakLM (block twice before a graph break and once after, tied head) trained with
    amp_fx.compile + amp_fx.GradScaler (fp16; bf16: no scaler) against eager autocast +
    torch.amp.GradScaler: scale and parameters bitwise after each window. In fp16 the first
    windows overflow at torch's initial scale: skipped steps, then real ones."""
    model, inputs, loss_fn = _build("tied_break")
    ref_model = copy.deepcopy(model)
    compiled = amp_fx.compile(model, dtype=dtype, backend="aot_eager", weight_cache=True)
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (model, ref_model))
    fp16 = dtype == torch.float16
    scaler = amp_fx.GradScaler("cpu", growth_interval=2, enabled=fp16)
    ref_scaler = torch.amp.GradScaler("cpu", growth_interval=2, enabled=fp16)
    skipped = 0
    for window in range(4):
        for _ in range(accumulate):
            scaler.scale(loss_fn(compiled(*inputs))).backward()
            with torch.autocast("cpu", dtype=dtype):
                ref_loss = loss_fn(ref_model(*inputs))
            ref_scaler.scale(ref_loss).backward()
        scale = ref_scaler.get_scale()
        for sc, o in ((scaler, opt), (ref_scaler, ref_opt)):
            sc.step(o)
            sc.update()
            o.zero_grad()
        skipped += ref_scaler.get_scale() < scale
        assert_bitwise(scaler.get_scale(), ref_scaler.get_scale(), f"scale after window {window}")
        for (n, p), q in zip(model.named_parameters(), ref_model.parameters(), strict=True):
            assert torch.isfinite(q).all(), f"eager diverged ({n}): the comparison would test NaNs"
            assert_bitwise(p, q, f"{n} after window {window}")
    if fp16:
        assert 0 < skipped < 4, f"{skipped} of 4 steps skipped: want both kinds"
    assert compiled.amp_fx_weight_cache.refreshes > 0


# --- invalidation: each way a weight can change ----------------------------------------------


def _edit_step(model: nn.Module, opt: torch.optim.Optimizer | None) -> None:
    assert opt is not None
    for p in model.parameters():
        p.grad = torch.full_like(p, 0.25)
    opt.step()


def _load_state_dict(model: nn.Module, opt: object, *, assign: bool = False) -> None:
    state = {k: v * 1.5 + 0.01 for k, v in model.state_dict().items()}
    model.load_state_dict(state, assign=assign)


def _in_place(model: nn.Module, opt: object) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(-0.75)


def _half_float(model: nn.Module, opt: object) -> None:
    # .to() swaps each parameter's storage (param.data = ...), its version counter stays.
    # The round trip through fp16 rounds every weight to 11 significant bits, and 1e-6 (an fp16
    # subnormal) to 2**-20 steps: their bf16 casts change.
    with torch.no_grad():
        for p in model.parameters():
            p.view(-1)[0] = 1.0e-6 + 3.0e-8
    versions = [p._version for p in model.parameters()]
    model.half().float()
    assert [p._version for p in model.parameters()] == versions  # only the storage check sees it


def _data_swap(model: nn.Module, opt: object) -> None:
    for p in model.parameters():
        p.data = p.data * 2 + 0.1  # new storage, version counter unchanged


_EDITS: dict[str, tuple[Callable[..., None], Callable[[Any], torch.optim.Optimizer] | None]] = {
    "optimizer_step": (_edit_step, lambda p: torch.optim.SGD(p, lr=0.5)),
    "fused_optimizer_step": (_edit_step, lambda p: torch.optim.SGD(p, lr=0.5, fused=True)),
    "fused_adamw_step": (_edit_step, lambda p: torch.optim.AdamW(p, lr=0.1, fused=True)),
    "load_state_dict": (_load_state_dict, None),
    "load_state_dict_assign": (lambda m, o: _load_state_dict(m, o, assign=True), None),
    "in_place_no_grad": (_in_place, None),
    "to_half_and_back": (_half_float, None),
    "data_swap": (_data_swap, None),
}


@pytest.mark.parametrize("edit", _EDITS)
def test_invalidation(edit: str) -> None:
    """After each kind of weight change the next forward and backward are bitwise eager
    autocast's on the changed weights, and a stale copy would not have been (checked first)."""
    dtype = torch.bfloat16
    change, make_opt = _EDITS[edit]
    model, inputs, loss_fn = ZOO["graph_break"].build()
    ref_model = copy.deepcopy(model)
    compiled = amp_fx.compile(model, dtype=dtype, backend="aot_eager", weight_cache=True)
    step(compiled, model, inputs, loss_fn)
    stale = [lowp.clone() for _, lowp in compiled.amp_fx_weight_cache.pairs(list(model.parameters()))]

    change(model, make_opt(model.parameters()) if make_opt else None)
    change(ref_model, make_opt(ref_model.parameters()) if make_opt else None)
    for p in (*model.parameters(), *ref_model.parameters()):
        p.grad = None
    fresh = [p.detach().to(dtype) for p in model.parameters()]
    assert any(not torch.equal(s, f) for s, f in zip(stale, fresh, strict=True)), (
        "the edit left every bf16 cast unchanged: a stale copy could not fail this test"
    )

    expected = eager_autocast_step(ref_model, inputs, loss_fn, dtype)
    actual = step(compiled, model, inputs, loss_fn)
    assert_bitwise(actual.out, expected.out, "output")
    for n, g in expected.grads.items():
        assert_bitwise(actual.grads[n], g, f"{n}.grad")
    assert_copies_fresh(compiled.amp_fx_weight_cache, model, dtype)


def test_invalidate_after_data_edit() -> None:
    """An in-place edit through ``p.data`` bumps no version counter (a documented limit);
    ``invalidate()`` makes the next forward recast."""
    model, inputs, loss_fn = ZOO["mlp"].build()
    compiled = amp_fx.compile(model, dtype=torch.bfloat16, backend="aot_eager", weight_cache=True)
    compiled(*inputs)
    for p in model.parameters():
        p.data.mul_(2.0)
    compiled.amp_fx_weight_cache.invalidate()
    expected = eager_autocast_step(copy.deepcopy(model), inputs, loss_fn, torch.bfloat16)
    assert_bitwise(step(compiled, model, inputs, loss_fn).out, expected.out, "output")


# --- options ----------------------------------------------------------------------------------


def test_cast_cache_off_turns_weight_cache_off_and_says_so() -> None:
    policy = amp_fx.Policy(cast_cache=False)
    with pytest.warns(AmpFxWarning, match="weight_cache=True needs the shared leaf cast"):
        compiled = amp_fx.compile(
            nn.Linear(4, 4), dtype="bf16", backend="aot_eager", policy=policy, weight_cache=True, strict=False
        )
    assert compiled.amp_fx_weight_cache is None
    with pytest.raises(AmpFxError, match="weight_cache=True needs"):
        amp_fx.compile(
            nn.Linear(4, 4), dtype="bf16", backend="aot_eager", policy=policy, weight_cache=True, strict=True
        )


def test_weight_cache_must_be_bool() -> None:
    with pytest.raises(TypeError, match="weight_cache must be True or False"):
        amp_fx.compile(nn.Linear(4, 4), weight_cache="yes")  # type: ignore[arg-type]


def test_frozen_weights_use_the_cache_without_gradients() -> None:
    """A frozen fp32 weight (fine-tuning) is cast per use by eager autocast, all casts equal and
    gradient-free: one cached copy serves them; values and the trainable grads stay bitwise."""
    model, inputs, loss_fn = ZOO["tied_embedding"].build()
    model.block.weight.requires_grad_(False)
    expected = eager_autocast_step(copy.deepcopy(model), inputs, loss_fn, torch.bfloat16)
    compiled = amp_fx.compile(model, dtype=torch.bfloat16, backend="aot_eager", weight_cache=True)
    actual = step(compiled, model, inputs, loss_fn)
    assert_bitwise(actual.out, expected.out, "output")
    for n, g in expected.grads.items():
        assert_bitwise(actual.grads[n], g, f"{n}.grad")
    assert any(w is model.block.weight for w, _ in compiled.amp_fx_weight_cache.pairs([model.block.weight]))


# --- the backend ladder: inductor ------------------------------------------------------------


@pytest.mark.slow_cases
@pytest.mark.parametrize("name", ["rmsnorm", "tied_break"])
def test_inductor_within_the_excess_precision_tolerance(name: str) -> None:
    """Inductor takes the lifted inputs too; with the cache it stays within the tolerance derived
    in tests/backend/_parity.py (outputs 1 eps, gradients 4 eps of their max magnitude).
    ``tied_break``: block's uses before the break come back as one gradient each from inductor's
    backward too, so inductor does not add them in fp32 (its excess precision) before eager's
    order does."""
    dtype = torch.bfloat16
    model, inputs, loss_fn = _build(name)
    expected = eager_autocast_step(copy.deepcopy(model), inputs, loss_fn, dtype)
    compiled = amp_fx.compile(model, dtype=dtype, backend="inductor", weight_cache=True)
    actual = step(compiled, model, inputs, loss_fn)
    # rmsnorm: up, gate, down, out; tied_break: block.weight, block.bias, emb.weight
    assert compiled.amp_fx_weight_cache.refreshes == {"rmsnorm": 4, "tied_break": 3}[name]
    assert_within_excess_precision(actual, expected, dtype)


def test_a_graph_without_inputs_lifts_nothing() -> None:
    """A graph with no input (in compiled regions, the part of Llama's root that builds a mask
    from nothing but sizes) has no weight to lift: it is returned as it is (it raised IndexError,
    and weight_cache then said the downstream backend failed)."""
    graph = torch.fx.Graph()
    graph.output(graph.call_function(torch.ones, (2,)))
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)
    assert lift_weight_casts(gm, []) == (gm, [], [])
