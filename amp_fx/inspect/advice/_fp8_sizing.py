"""advise with ``fp8=``, sizing: each matmul that ran in fp8 (module, op, shape, calls, error) and
whether it is too small for fp8 to gain on an H100, by torchao's own rule."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from amp_fx.fp8 import Fp8Recipe
from amp_fx.inspect._fp8_eager import Fp8Call

__all__: list[str] = []


def fp8_too_small(recipe: Fp8Recipe, k: int, n: int) -> bool:
    """Whether a ``[M, K] x [K, N]`` matmul is too small for fp8 to gain on an H100, by torchao
    0.18's rule (``torchao.float8.float8_linear_utils._auto_filter_for_recipe``, thresholds from
    its H100 benchmarks, https://github.com/pytorch/ao/tree/main/torchao/float8#performance):
    tensorwise gains unless ``K <= 4096 and N <= 1024``; rowwise (torchao has no rule for
    rowwise_with_gw_hp: rowwise's is used) unless ``N <= 2048``, ``K <= 1024``, or
    ``N <= 4096 and K <= 2048``. ``K``: in features, ``N``: out features; the rule ignores ``M``
    (tokens per call), so a layer it passes can still be too small at a small batch. mxfp8:
    torchao has no rule (and an H100 has no MX kernel: amp_fx emulates it, slower than bf16 at
    every size); rowwise's is used, as a stand-in for a Blackwell GPU."""
    if recipe is Fp8Recipe.TENSORWISE:
        return k <= 4096 and n <= 1024
    return n <= 2048 or k <= 1024 or (n <= 4096 and k <= 2048)


@dataclass(frozen=True)
class Fp8Matmul:
    """With ``fp8=``: one matmul (module, op, shape) that ran in fp8 with every eligible matmul in
    fp8, as measured."""

    module: str
    op: str
    shape: tuple[int, int, int]
    """(M, K, N) of the forward GEMM: rows of the input, in features, out features."""
    calls: int
    error: float
    """The largest error fp8 added to its forward GEMM (see
    :data:`~amp_fx.inspect.advice.FP8_ERROR_HAZARD`)."""
    too_small: bool
    """Too small for fp8 to gain on an H100 (:func:`fp8_too_small`)."""

    @property
    def flops(self) -> int:
        """FLOPs of one forward GEMM (2 M K N); the backward adds twice that."""
        m, k, n = self.shape
        return 2 * m * k * n


def fp8_matmuls(calls: Sequence[Fp8Call], recipe: Fp8Recipe) -> tuple[Fp8Matmul, ...]:
    seen: dict[tuple[str, str, tuple[int, int, int]], list[float]] = {}
    for c in calls:
        seen.setdefault((c.module, c.op, c.shape), []).append(c.error)
    return tuple(
        Fp8Matmul(mod, op, shape, len(errs), max(errs), fp8_too_small(recipe, shape[1], shape[2]))
        for (mod, op, shape), errs in seen.items()
    )
