"""Small models with planted problems, shared by the explain/compare/find_nonfinite tests."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class Overflowing(nn.Module):
    """``up``'s output exceeds fp16's max (65504); the LayerNorm after it brings it back to ~1."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(4, 8)
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 2)
        with torch.no_grad():
            self.up.weight.mul_(1e5)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.norm(self.up(x)))


class ExpOverflow(nn.Module):
    """A top-level ``exp`` (not autocast: runs in its input's fp16) overflows above ~11.1."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        with torch.no_grad():
            self.fc.weight.fill_(1.0)
            self.fc.bias.fill_(10.0)

    def forward(self, x: Tensor) -> Tensor:
        return torch.exp(self.fc(x)).mean(-1, keepdim=True) * 1e-6


class GradOverflow(nn.Module):
    """Finite forward; the gradient of ``fc``'s fp16 output is 1e6 > 65504."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        return (self.fc(x).float() * 1e6).sum()


class TwoLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 8)
        self.fc2 = nn.Linear(8, 4)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class RoundTrip(nn.Module):
    """``fc1(x).float()`` fed to ``fc2``: a bf16 -> fp32 -> bf16 chain fold_casts folds."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 8)
        self.fc2 = nn.Linear(8, 4)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(self.fc1(x).float())


class BNNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)

    def forward(self, x: Tensor) -> Tensor:
        return F.relu(self.bn(self.conv(x))).mean((2, 3))


def seeded(cls: type[nn.Module], *shape: int) -> tuple[nn.Module, Tensor]:
    torch.manual_seed(0)
    model = cls()
    return model, torch.randn(*shape, generator=torch.Generator().manual_seed(1))


class KeywordLM(nn.Module):
    """A stand-in for a Hugging Face model: called as ``model(input_ids=..., labels=...)``,
    returns a dict with ``logits`` and, given labels, ``loss``."""

    def __init__(self, vocab: int = 11, d: int = 8) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.fc = nn.Linear(d, d)
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)

    def forward(
        self, input_ids: Tensor, attention_mask: Tensor | None = None, labels: Tensor | None = None
    ) -> dict[str, Tensor]:
        h = self.norm(self.fc(self.embed(input_ids)))
        if attention_mask is not None:
            h = h * attention_mask.unsqueeze(-1).to(h.dtype)
        out = {"logits": self.head(h)}
        if labels is not None:
            out["loss"] = F.cross_entropy(out["logits"].flatten(0, 1).float(), labels.flatten())
        return out


def keyword_batch(vocab: int = 11) -> dict[str, Tensor]:
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (2, 5), generator=gen)
    mask = torch.ones(2, 5, dtype=torch.long)
    mask[1, 3:] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": torch.randint(0, vocab, (2, 5), generator=gen)}


class AutocastMask(nn.Module):
    """Like HF T5's attention: the mask is made with ``dtype=q.dtype`` while autocast is on, so
    the captured graph holds a bf16/fp16 mask that no longer matches q when run without autocast."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(8, 24)
        self.out = nn.Linear(8, 8)

    def forward(self, x: Tensor) -> Tensor:
        q, k, v = self.qkv(x).chunk(3, -1)
        n = x.shape[1]
        future = torch.ones(n, n, dtype=torch.bool).triu(1)
        mask = torch.zeros(n, n, dtype=q.dtype).masked_fill(future, torch.finfo(q.dtype).min)
        return self.out(F.scaled_dot_product_attention(q, k, v, attn_mask=mask))


@torch._dynamo.disable
def _eager_copy(t: Tensor) -> Tensor:
    """Runs outside the graphs (a graph break): a new tensor with ``t``'s values."""
    return t.clone()


class _Log(nn.Module):
    def forward(self, t: Tensor) -> Tensor:
        return torch.log(t / 2)


class MaskedLog(nn.Module):
    """T5's relative position buckets in small: ``log`` of a position that can be 0 (in the
    submodule ``buckets``) gives an intended -inf (in fp32: the positions are an fp32 buffer),
    which ``torch.where`` discards for the small positions. With ``reaches=True`` (the negative
    twin) the log's output is added to the output unmasked, so the -inf reaches it. ``overflow``
    plants ``Overflowing``'s fp16 overflow after the masked log: a real inf/NaN reaches the
    output, after a discarded one. ``between`` puts a graph break between the log and its use:
    the -inf crosses from graph 0 to graph 1 as the same tensor (``"break"``) or as a copy made
    by eager code (``"eager"``)."""

    def __init__(self, *, reaches: bool = False, overflow: bool = False, between: str | None = None) -> None:
        super().__init__()
        self.reaches = reaches
        self.between = between
        self.fc = nn.Linear(4, 4)
        self.buckets = _Log()
        self.register_buffer("positions", torch.arange(4, dtype=torch.float32))
        self.up = Overflowing() if overflow else None

    def forward(self, x: Tensor) -> Tensor:
        log = self.buckets(self.positions)
        if self.between == "break":
            torch._dynamo.graph_break()
        elif self.between == "eager":
            log = _eager_copy(log)
        bias = log if self.reaches else torch.where(self.positions < 2, self.positions, log)
        h = self.fc(x) + bias
        return h if self.up is None else self.up(h)


def chain_overflow() -> nn.Sequential:
    """``0``'s fp16 output overflows; kept in fp32, its output (~1e5) overflows the fp16 cast of
    ``1``'s input; the LayerNorm ``2`` brings values back to ~1. Keeping both fixes it."""
    torch.manual_seed(0)
    seq = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 2))
    with torch.no_grad():
        seq[0].weight.mul_(1e5)
    return seq


class NestedOverflow(nn.Module):
    """``chain_overflow``'s two layers inside one submodule, ``block``."""

    def __init__(self) -> None:
        super().__init__()
        seq = chain_overflow()
        self.block = seq[:2]
        self.norm = seq[2]
        self.head = seq[3]

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.norm(self.block(x)))


class BreakInside(nn.Module):
    """A graph break inside a submodule: Dynamo compiles ``model.forward`` as its own frame, where
    ``self`` is ``model`` (issue 8's Wrapper/Inner)."""

    class Inner(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(8, 8)
            self.head = nn.Linear(8, 4)

        def forward(self, x: Tensor) -> Tensor:
            h = self.head(torch.relu(self.a(x)))
            torch._dynamo.graph_break()
            return h

    def __init__(self) -> None:
        super().__init__()
        self.model = self.Inner()

    def forward(self, x: Tensor) -> Tensor:
        return self.model(x)


class SplitInside(BreakInside):
    """BreakInside with ``model.a`` used on both sides of the break: the split weights are
    ``model.a.weight`` and ``model.a.bias`` under the root (Dynamo calls them ``a.weight``)."""

    class Inner(BreakInside.Inner):
        def forward(self, x: Tensor) -> Tensor:
            h = torch.relu(self.a(x))
            torch._dynamo.graph_break()
            return self.head(self.a(h))


SPLIT_CASES = ("graph_break", "graph_break_branch", "split_inside")
"""Graph-break models: fc on both sides (zoo), every weight on one side (zoo, the negative twin),
a split inside a submodule (named under the root)."""


def split_case(name: str) -> tuple[nn.Module, tuple[Tensor, ...]]:
    """The model and inputs of one of :data:`SPLIT_CASES`."""
    from amp_fx.testing.zoo import ZOO

    if name == "split_inside":
        torch.manual_seed(0)
        return SplitInside(), (torch.randn(2, 8, generator=torch.Generator().manual_seed(1)),)
    model, inputs, _ = ZOO[name].build()
    return model, inputs


def split_weights_reported(model: nn.Module, *inputs: Tensor, dtype: str) -> list[str]:
    """The weights amp_fx's backend reports as used on both sides of a graph break when ``model``
    (a copy) is compiled and called: the reference the inspection tools' notes are checked against."""
    import copy
    import warnings

    import amp_fx

    compiled = amp_fx.compile(copy.deepcopy(model), dtype=dtype, backend="eager", strict=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled(*inputs)
    said = [str(w.message) for w in caught if issubclass(w.category, amp_fx.AmpFxWarning)]
    return sorted(m.split()[1] for m in said if "both sides of a graph break" in m)


def split_weights_noted(notes: list[str]) -> list[str]:
    """The weights an inspection tool's notes name as used in several graphs."""
    return sorted(n.split()[0] for n in notes if " is used in graphs " in n)
