"""A zoo of tiny, deterministically seeded models for amp_fx's parity tests and benchmarks.

Each entry's factory returns ``(model, inputs, loss_fn)``:

* ``model`` is an fp32 ``nn.Module`` on the CPU, built under a fixed seed, in the mode the entry
  states (train mode everywhere here: BatchNorm updates its running stats);
* ``inputs`` is a tuple of example inputs (float activations, or int64 token ids and targets);
* ``loss_fn`` maps the model's output to a scalar fp32 loss using only ops that are *not* in eager
  autocast's CPU table (``.float()``, ``pow``, ``mean``, ``sum``), so it gives bitwise the same loss
  inside and outside an autocast region. The parity tests rely on that: eager autocast runs the loss
  inside ``torch.autocast``, amp_fx outside (``tests/backend/test_compile_parity.py`` checks the property).
  Models whose loss *is* an autocast op (cross_entropy) compute it in ``forward`` instead.

Dims are 8-32 and batches 2-4: bf16/fp16 matmuls are ~25x slower than fp32 on a CPU with no
low-precision units, and inductor compiles dominate the test time anyway. No dropout anywhere, so
every run is deterministic.

    >>> model, inputs, loss_fn = ZOO["mlp"].build()
    >>> loss_fn(model(*inputs)).shape
    torch.Size([])
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = [
    "SEED",
    "ZOO",
    "Built",
    "Factory",
    "LossFn",
    "StepResult",
    "ZooEntry",
    "eager_autocast_step",
    "step",
    "transformer_lm",
]

SEED = 0

LossFn = Callable[[Any], Tensor]  # of the model's output
Built = tuple[nn.Module, tuple[Tensor, ...], LossFn]
Factory = Callable[[], Built]


def _sq_mean(out: object) -> Tensor:
    """Mean of squares in fp32 of a tensor or of the tensors in a tuple (autocast-neutral ops)."""
    outs = out if isinstance(out, (tuple, list)) else (out,)
    total = torch.zeros((), dtype=torch.float32)
    for o in outs:
        total = total + o.float().pow(2).mean()
    return total


def _as_loss(out: object) -> Tensor:
    """For models whose forward already returns the scalar loss."""
    assert isinstance(out, Tensor) and out.dim() == 0, f"expected a scalar loss, got {out!r}"
    return out.float()


# --- models -----------------------------------------------------------------------------------


class MLP(nn.Module):
    def __init__(self, d_in: int = 16, d_hidden: int = 32, d_out: int = 8) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_in, d_hidden)
        self.fc2 = nn.Linear(d_hidden, d_hidden)
        self.fc3 = nn.Linear(d_hidden, d_out)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc3(F.relu(self.fc2(F.gelu(self.fc1(x)))))


class ConvBN(nn.Module):
    """Conv + BatchNorm2d (train mode: running stats update) + max and average pooling."""

    def __init__(self, c_in: int = 3, c: int = 8, n_classes: int = 4) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(c)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c)
        self.pool = nn.MaxPool2d(2)
        self.head = nn.Linear(c, n_classes)

    def forward(self, x: Tensor) -> Tensor:
        h = self.pool(F.relu(self.bn1(self.conv1(x))))
        h = F.relu(self.bn2(self.conv2(h)))
        h = F.adaptive_avg_pool2d(h, 1).flatten(1)
        return self.head(h)


class MHABlock(nn.Module):
    """Pre-norm transformer block with nn.MultiheadAttention, LayerNorm and a GELU MLP."""

    def __init__(self, d_model: int = 16, n_heads: int = 2, d_ff: int = 32) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = nn.MultiheadAttention(d_model, n_heads, batch_first=True)
        self.ln2 = nn.LayerNorm(d_model)
        self.ff1 = nn.Linear(d_model, d_ff)
        self.ff2 = nn.Linear(d_ff, d_model)

    def forward(self, x: Tensor) -> Tensor:
        h = self.ln1(x)
        a, _ = self.attn(h, h, h, need_weights=False)
        x = x + a
        return x + self.ff2(F.gelu(self.ff1(self.ln2(x))))


class SDPABlock(nn.Module):
    """Causal self-attention through F.scaled_dot_product_attention, LayerNorm, tanh-GELU MLP."""

    def __init__(self, d_model: int = 16, n_heads: int = 2, d_ff: int = 32) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.ln1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.ff1 = nn.Linear(d_model, d_ff)
        self.ff2 = nn.Linear(d_ff, d_model)

    def forward(self, x: Tensor) -> Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).chunk(3, dim=-1)
        q, k, v = (z.view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.ff2(F.gelu(self.ff1(self.ln2(x)), approximate="tanh"))


class RNNHead(nn.Module):
    """nn.LSTM or nn.GRU over a sequence, then a linear head on every step."""

    def __init__(self, cell: type[nn.LSTM | nn.GRU], d_in: int = 8, d_hidden: int = 16, d_out: int = 8) -> None:
        super().__init__()
        self.rnn = cell(d_in, d_hidden, batch_first=True)
        self.head = nn.Linear(d_hidden, d_out)

    def forward(self, x: Tensor) -> Tensor:
        y, _ = self.rnn(x)
        return self.head(y)


class TiedLM(nn.Module):
    """Embedding with int inputs, one block applied twice (weight sharing across depth) and an
    output projection tied to the embedding weight: ``emb.weight`` feeds the gather and a
    matmul, ``block.weight`` feeds two matmuls."""

    def __init__(self, vocab: int = 32, d_model: int = 16) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d_model)
        self.block = nn.Linear(d_model, d_model)
        self.norm = nn.LayerNorm(d_model)

    def forward(self, ids: Tensor) -> Tensor:
        h = self.emb(ids)
        h = h + F.gelu(self.block(h))
        h = h + F.gelu(self.block(h))
        return F.linear(self.norm(h), self.emb.weight)


class LlamaRMSNorm(nn.Module):
    """Llama's RMSNorm: computes in fp32 whatever comes in, returns the input's dtype."""

    def __init__(self, d: int, eps: float = 1e-6, *, use_type_as: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps
        self.use_type_as = use_type_as

    def forward(self, x: Tensor) -> Tensor:
        input_dtype = x.dtype
        h = x.float() if self.use_type_as else x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * (h.type_as(x) if self.use_type_as else h.to(input_dtype))


class RMSNormMLP(nn.Module):
    """Llama-style casts in user code around linears.

    * ``norm1`` sees the fp32 residual stream: its ``.to(torch.float32)`` and ``.to(input_dtype)``
      change nothing.
    * ``norm2`` sees a lower-precision linear output: ``.float()`` and ``.type_as(x)`` are real
      casts, and ``weight * h`` promotes back to fp32.
    * ``self.out(y.float())`` upcasts a lower-precision activation that ``out`` casts straight back
      down: an exact round trip that amp_fx's ``fold_casts`` removes.
    """

    def __init__(self, d: int = 16, d_ff: int = 32) -> None:
        super().__init__()
        self.norm1 = LlamaRMSNorm(d)
        self.up = nn.Linear(d, d_ff, bias=False)
        self.gate = nn.Linear(d, d_ff, bias=False)
        self.norm2 = LlamaRMSNorm(d_ff, use_type_as=True)
        self.down = nn.Linear(d_ff, d, bias=False)
        self.out = nn.Linear(d, d, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        h = self.norm1(x)
        u = self.norm2(self.up(h))
        g = F.silu(self.gate(h).float())
        y = self.down(g * u)
        return self.out(y.float())


class GraphBreakMLP(nn.Module):
    """A graph break in forward, with ``fc`` used on both sides of it."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.mid = nn.Linear(d, d)

    def forward(self, x: Tensor) -> Tensor:
        h = F.gelu(self.fc(x))
        torch._dynamo.graph_break()
        h = F.relu(self.mid(h))
        return self.fc(h)


class GraphBreakBranch(nn.Module):
    """A data-dependent branch (Dynamo breaks the graph there); every weight is on one side."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.pos = nn.Linear(d, d)
        self.neg = nn.Linear(d, d)
        self.head = nn.Linear(d, d)

    def forward(self, x: Tensor) -> Tensor:
        h = F.gelu(self.fc(x))
        h = self.pos(h) if h.mean() > 0 else self.neg(h)
        return self.head(F.relu(h))


class ClassifierLoss(nn.Module):
    """softmax, log_softmax and cross_entropy with sum and mean reductions; returns the loss."""

    def __init__(self, d_in: int = 16, n_classes: int = 8) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_in, 32)
        self.fc2 = nn.Linear(32, n_classes)

    def forward(self, x: Tensor, target: Tensor) -> Tensor:
        logits = self.fc2(torch.tanh(self.fc1(x)))
        ce_mean = F.cross_entropy(logits, target)
        ce_sum = F.cross_entropy(logits, target, reduction="sum")
        nll = F.nll_loss(F.log_softmax(logits, dim=-1), target)
        entropy = -(F.softmax(logits, dim=-1) * F.log_softmax(logits, dim=-1)).sum(-1).mean()
        return ce_mean + 0.1 * ce_sum + nll + 0.01 * entropy


# --- registry ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class ZooEntry:
    """A named model family and its factory."""

    name: str
    factory: Factory
    graph_breaks: int = 0
    """Graph breaks the model's own forward causes (``graph_break()``, data-dependent branches)."""
    split_params: tuple[str, ...] = ()
    """Parameters the forward uses on both sides of a graph break: amp_fx reports each (an
    ``AmpFxWarning``, an error in strict mode), since their gradients add up in fp32 where eager
    autocast adds them in the low dtype (docs/parity.md, Known differences)."""
    dynamo_config: tuple[tuple[str, object], ...] = ()
    """``torch._dynamo.config`` settings under which Dynamo captures the model at all: by default
    Dynamo skips any frame that calls nn.LSTM/nn.GRU and runs it in eager (``allow_rnn``)."""

    def build(self) -> Built:
        """The model, inputs and loss function; identical on every call (seeded)."""
        return self.factory()


def _seeded(make: Callable[[torch.Generator], Built]) -> Factory:
    def factory() -> Built:
        torch.manual_seed(SEED)  # nn.Module initialisers draw from the global generator
        return make(torch.Generator().manual_seed(SEED + 1))

    factory.__name__ = make.__name__
    return factory


def _randn(gen: torch.Generator, *shape: int) -> Tensor:
    return torch.randn(*shape, generator=gen)


@_seeded
def _mlp(gen: torch.Generator) -> Built:
    return MLP(), (_randn(gen, 4, 16),), _sq_mean


@_seeded
def _cnn_bn(gen: torch.Generator) -> Built:
    return ConvBN().train(), (_randn(gen, 2, 3, 8, 8),), _sq_mean


@_seeded
def _mha_block(gen: torch.Generator) -> Built:
    return MHABlock(), (_randn(gen, 2, 8, 16),), _sq_mean


@_seeded
def _sdpa_block(gen: torch.Generator) -> Built:
    return SDPABlock(), (_randn(gen, 2, 8, 16),), _sq_mean


@_seeded
def _lstm(gen: torch.Generator) -> Built:
    return RNNHead(nn.LSTM), (_randn(gen, 2, 6, 8),), _sq_mean


@_seeded
def _gru(gen: torch.Generator) -> Built:
    return RNNHead(nn.GRU), (_randn(gen, 2, 6, 8),), _sq_mean


@_seeded
def _tied_embedding(gen: torch.Generator) -> Built:
    ids = torch.randint(0, 32, (2, 8), generator=gen)
    return TiedLM(), (ids,), _sq_mean


@_seeded
def _rmsnorm(gen: torch.Generator) -> Built:
    return RMSNormMLP(), (_randn(gen, 2, 4, 16),), _sq_mean


@_seeded
def _graph_break(gen: torch.Generator) -> Built:
    return GraphBreakMLP(), (_randn(gen, 4, 16),), _sq_mean


@_seeded
def _graph_break_branch(gen: torch.Generator) -> Built:
    return GraphBreakBranch(), (_randn(gen, 4, 16),), _sq_mean


@_seeded
def _classifier_loss(gen: torch.Generator) -> Built:
    x = _randn(gen, 4, 16)
    target = torch.randint(0, 8, (4,), generator=gen)
    return ClassifierLoss(), (x, target), _as_loss


_ALLOW_RNN: tuple[tuple[str, object], ...] = (("allow_rnn", True),)

ZOO: dict[str, ZooEntry] = {
    e.name: e
    for e in (
        ZooEntry("mlp", _mlp),
        ZooEntry("cnn_bn", _cnn_bn),
        ZooEntry("mha_block", _mha_block),
        ZooEntry("sdpa_block", _sdpa_block),
        ZooEntry("lstm", _lstm, dynamo_config=_ALLOW_RNN),
        ZooEntry("gru", _gru, dynamo_config=_ALLOW_RNN),
        ZooEntry("tied_embedding", _tied_embedding),
        ZooEntry("rmsnorm", _rmsnorm),
        ZooEntry("graph_break", _graph_break, graph_breaks=1, split_params=("fc.bias", "fc.weight")),
        ZooEntry("graph_break_branch", _graph_break_branch, graph_breaks=1),
        ZooEntry("classifier_loss", _classifier_loss),
    )
}
"""Every zoo entry by name."""


def transformer_lm(
    *,
    vocab: int = 64,
    d_model: int = 64,
    n_heads: int = 4,
    n_layers: int = 2,
    seq: int = 32,
    batch: int = 4,
    seed: int = SEED,
) -> Built:
    """A small pre-norm causal transformer LM (SDPA blocks, tied head) for the benchmark."""
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed + 1)
    model = _TransformerLM(vocab, d_model, n_heads, n_layers)
    ids = torch.randint(0, vocab, (batch, seq), generator=gen)
    return model, (ids,), _sq_mean


class _TransformerLM(nn.Module):
    def __init__(self, vocab: int, d_model: int, n_heads: int, n_layers: int) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d_model)
        self.blocks = nn.ModuleList(SDPABlock(d_model, n_heads, 4 * d_model) for _ in range(n_layers))
        self.norm = nn.LayerNorm(d_model)
        self.scale = math.sqrt(d_model)

    def forward(self, ids: Tensor) -> Tensor:
        h = self.emb(ids) * self.scale
        for block in self.blocks:
            h = block(h)
        return F.linear(self.norm(h), self.emb.weight)


# --- running one step -------------------------------------------------------------------------


@dataclass
class StepResult:
    """What one forward+backward left behind: output, loss, every parameter's .grad, buffers."""

    out: Tensor
    loss: Tensor
    grads: dict[str, Tensor | None]
    buffers: dict[str, Tensor]


def _collect(model: nn.Module, out: Tensor, loss: Tensor) -> StepResult:
    grads = {n: None if p.grad is None else p.grad.detach().clone() for n, p in model.named_parameters()}
    buffers = {n: b.detach().clone() for n, b in model.named_buffers()}
    return StepResult(out.detach(), loss.detach(), grads, buffers)


def eager_autocast_step(
    model: nn.Module, inputs: tuple[Tensor, ...], loss_fn: LossFn, dtype: torch.dtype, *, device_type: str = "cpu"
) -> StepResult:
    """The reference: ``with torch.autocast(device_type, dtype): loss = loss_fn(model(*inputs))``,
    then ``loss.backward()`` outside the region, as torch's AMP recipe does."""
    with torch.autocast(device_type, dtype=dtype):
        out = model(*inputs)
        loss = loss_fn(out)
    loss.backward()
    return _collect(model, out, loss)


def step(run: Callable[..., object], model: nn.Module, inputs: tuple[Tensor, ...], loss_fn: LossFn) -> StepResult:
    """One forward+backward through ``run`` (e.g. an amp_fx-compiled module) with no ambient
    autocast; grads and buffers are read from ``model``, which ``run`` shares state with."""
    out = run(*inputs)
    assert isinstance(out, Tensor)
    loss = loss_fn(out)
    loss.backward()
    return _collect(model, out, loss)
