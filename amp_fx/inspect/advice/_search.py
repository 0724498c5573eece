"""advise, searching: when the default policy is not verified, which modules to keep. Candidates
are ranked from the default run's measurements (first the innermost modules where inf/NaN first
appears or whose values or weights do not fit the dtype, then the producers whose rounding grew
after them, then the modules that amplify error most: output error over input error) and policies
are tried in order, each one verified end to end: the hazards; then the next onset of inf/NaN, or
the next candidates by rank (1, 2, 4, ... at a time); then each kept module with something found
inside it is tried as that smaller part (a leaf before its parent); finally each kept module is
dropped again if the rest still meets the target.

Only modules that run a low-precision op are ever kept: keeping any other (a dropout, an
activation) moves no low-precision op to fp32, it only upcasts the values passing through, and
keeping the module that produced them does that too; a hazard found in one stands for the
producers of its inputs."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from amp_fx.inspect.advice._findings import FP8_ERROR, amplifies, inside
from amp_fx.inspect.advice._measure import RunResult
from amp_fx.inspect.advice._verify import meets

__all__: list[str] = []

MAX_RUNS = 8
"""End-to-end runs the search may make after the baseline (each one low-precision forward and
backward): the planted hazards need at most 3."""


def search(
    base: RunResult, run: Callable[[tuple[str, ...]], RunResult], target: float, dtype: torch.dtype, max_runs: int
) -> tuple[RunResult, int, list[str]]:
    """Grow a keep-list from the hazards, the next inf/NaN onset, then the ranked candidates; then
    narrow each kept module to what was found inside it, and drop what is not needed. Only modules
    that run a low-precision op are ever kept. Returns the best run, the runs made (the baseline
    included) and the steps in words."""
    words = [f"default policy: {'inf/NaN' if not base.finite else f'error {base.error:.3g}'} (target {target:.3g})"]
    s = _Search(run, target, dtype, max_runs, keepable(base), words, [base])
    best, last, tried = s.grow(base)
    if best is None:
        return s.give_up(base, last, tried)
    best = s.drop(s.narrow(best, base))
    return best, s.runs, s.words


@dataclass
class _Search:
    """The search's state: what it runs, against what, and what it has done so far."""

    run: Callable[[tuple[str, ...]], RunResult]
    target: float
    dtype: torch.dtype
    max_runs: int
    keepable: frozenset[str]
    words: list[str]
    seen: list[RunResult]
    """Every run made so far, the baseline's first (their findings are the evidence for narrowing)."""
    runs: int = 1

    def meets(self, r: RunResult) -> bool:
        return meets(r.finite, r.error, self.target)

    def grow(self, base: RunResult) -> tuple[RunResult | None, RunResult, set[tuple[str, ...]]]:
        """Keep more until a run meets the target: the hazards first, then the next inf/NaN onset
        or the next ranked candidates (1, 2, 4, ... groups at a time). Returns the run that met it
        (None if none did), the last run made and the keep-lists tried."""
        candidates = ranked(base, self.dtype, self.keepable)
        keep = add((), hazards(base, self.keepable))
        if not keep and candidates:
            keep = add((), candidates[0])
        batch = 1
        last = base
        tried: set[tuple[str, ...]] = set()
        while keep and self.runs <= self.max_runs and keep not in tried:
            tried.add(keep)
            last = self.run(keep)
            self.seen.append(last)
            self.runs += 1
            self.words.append(describe(last))
            if self.meets(last):
                return last, last, tried
            new, batch = self._next(keep, last, candidates, batch)
            if not new:
                break
            keep = add(keep, new)
        return None, last, tried

    def _next(
        self, keep: tuple[str, ...], last: RunResult, candidates: list[tuple[str, ...]], batch: int
    ) -> tuple[list[str], int]:
        """What to keep next after ``last`` missed the target (with the next batch size): the next
        inf/NaN onset outside ``keep``, else the next ``batch`` candidate groups by rank."""
        new = hazards(last, self.keepable) if not last.finite else []
        new = [n for n in new if not any(inside(n, k) for k in keep)]
        if not new:
            groups = [
                g
                for g in dict.fromkeys(ranked(last, self.dtype, self.keepable) + candidates)
                if not all(any(inside(n, k) for k in keep) for n in g)
            ]
            new, batch = [n for g in groups[:batch] for n in g], batch * 2
        return new, batch

    def give_up(
        self, base: RunResult, last: RunResult, tried: set[tuple[str, ...]]
    ) -> tuple[RunResult, int, list[str]]:
        """No policy met the target: advise the last one tried if it removed the default's inf/NaN,
        else the default policy, and say why."""
        words, runs = self.words, self.runs
        if not base.finite and last.finite:
            words.append(
                "no policy met the target within max_runs; advised: the last one tried, the first without inf/NaN"
            )
            return last, runs, words
        words.append(
            "no policy met the target: no module stands out (no value out of range, no "
            "low-precision op whose error grows in its module or after it), so the error "
            "is spread over the model; advised: the default policy (raise target= to accept "
            "it)"
            if not tried
            else "no policy met the target within max_runs; advised: the default policy"
        )
        return base, runs, words

    def narrow(self, best: RunResult, base: RunResult) -> RunResult:
        """A kept module with something found inside it is tried as that smaller part."""
        for name in best.keep:
            inner = inner_evidence(name, self.seen, self.dtype, self.keepable) if name in best.keep else ()
            if self.runs > self.max_runs or not inner or moved(inner, base) >= moved((name,), base):
                continue
            r = self.run(add(tuple(k for k in best.keep if k != name), inner))
            self.seen.append(r)
            self.runs += 1
            self.words.append(describe(r) + (f" (instead of {name})" if self.meets(r) else ""))
            if self.meets(r):
                best = r
        return best

    def drop(self, best: RunResult) -> RunResult:
        """Drop what the target does not need, latest-added first."""
        for name in reversed(best.keep):
            if len(best.keep) == 1 or self.runs > self.max_runs:
                break
            trial = tuple(k for k in best.keep if k != name)
            r = self.run(trial)
            self.runs += 1
            self.words.append(describe(r) + (" (dropped " + name + ")" if self.meets(r) else ""))
            if self.meets(r):
                best = r
        return best


def describe(r: RunResult) -> str:
    what = "inf/NaN" if not r.finite else f"error {r.error:.3g}"
    return f"keep ({', '.join(r.keep) or 'nothing'}): {what}"


def keepable(base: RunResult) -> frozenset[str]:
    """The modules whose fp32 keep moves at least one op to fp32: those that ran a low-precision
    op (themselves or in a descendant) under the default policy. Not the root: no policy keeps it."""
    return frozenset(n for n, s in base.modules.items() if n and s.low_precision_ops)


def as_keepable(names: Sequence[str], run: RunResult, keepable: frozenset[str]) -> list[str]:
    """``names``, each one that runs no low-precision op (a dropout passing an overflow along, an
    activation whose ``exp`` overflows) replaced by the producers of its inputs: keeping those
    upcasts the same values at their source."""
    out: list[str] = []
    for n in names:
        out += [n] if n in keepable else sorted(p for p in run.fed_by.get(n, ()) if p in keepable)
    return list(dict.fromkeys(out))


def hazards(run: RunResult, keepable: frozenset[str]) -> list[str]:
    """Modules whose values do not fit the dtype, innermost: one with another hazard inside it (a
    block whose output is its Linear's overflowing output) is left out, since keeping the inner one
    may be enough; when it is not, the next run finds the outer one on its own (see
    :func:`as_keepable` for the modules that run no low-precision op)."""
    found = [
        n
        for n, s in run.modules.items()
        if n and s.finding in ("non-finite", "weight overflows", "overflow", FP8_ERROR)
    ]
    inner = [n for n in found if not any(o != n and inside(o, n) for o in found)]
    return as_keepable(inner, run, keepable)


def ranked(run: RunResult, dtype: torch.dtype, keepable: frozenset[str]) -> list[tuple[str, ...]]:
    """Candidate groups by how much error they let grow: first the producers whose rounding the
    code after them amplified (``amplified after``), largest growth first, then the modules that
    amplify the error they are handed, largest amplification first."""
    after = sorted(
        ((g, x) for g, x in run.amplified.items() if all(n in keepable for n in g)), key=lambda gx: (-gx[1], gx[0])
    )
    groups = [g for g, _ in after]
    amplifying = sorted(
        (s for n, s in run.modules.items() if n and amplifies(s, dtype)), key=lambda s: (-s.amplification, s.name)
    )
    groups += [g for g in (tuple(as_keepable([s.name], run, keepable)) for s in amplifying) if g]
    return list(dict.fromkeys(groups))


def moved(keep: Sequence[str], base: RunResult) -> int:
    """Low-precision ops the keep-list moves to fp32 (counted in the default policy's run)."""
    return sum(len(ops) for o, ops in base.low_ops.items() if any(inside(o, k) for k in keep))


def inner_evidence(
    name: str, runs: Sequence[RunResult], dtype: torch.dtype, keepable: frozenset[str]
) -> tuple[str, ...]:
    """What the runs found strictly inside module ``name``: its hazards and candidate groups."""
    found: list[str] = []
    for r in runs:
        groups = [(h,) for h in hazards(r, keepable)] + ranked(r, dtype, keepable)
        found += [n for g in groups if all(n != name and inside(n, name) for n in g) for n in g]
    return add((), found)


def add(keep: Sequence[str], new: Sequence[str]) -> tuple[str, ...]:
    out = list(keep)
    for n in new:
        if any(inside(n, k) for k in out):
            continue
        out = [k for k in out if not inside(k, n)] + [n]
    return tuple(out)
