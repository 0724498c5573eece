"""``bench/bench_convergence.py``'s table: what docs/fp8.md's Convergence section prints. The
training itself is the bench's (minutes); its table arithmetic is checked here on made-up runs
against the same statistics computed by hand."""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

from bench_convergence import TAIL, Run, append_run, final_loss, read_runs, table_rows  # noqa: E402


def _losses(head: float, tail: float, n: int = 50) -> list[float]:
    """``n`` losses whose first ``n - TAIL`` are ``head`` and last ``TAIL`` are ``tail``: a final loss
    that averages the wrong window reads ``head`` in it."""
    return [head] * (n - TAIL) + [tail] * TAIL


def test_final_loss_is_the_mean_of_the_last_tail_steps() -> None:
    losses = [5.0] * 30 + [float(i) for i in range(TAIL)]
    assert final_loss(losses) == pytest.approx(statistics.fmean(range(TAIL)))
    assert final_loss([3.0, 1.0]) == 2.0  # fewer than TAIL: all of them
    with pytest.raises(ValueError, match="no losses"):
        final_loss([])


def test_table_rows_mean_spread_and_difference_from_bf16() -> None:
    runs = [
        Run("bf16", 0, _losses(9.0, 2.0), 4.0),
        Run("bf16", 1, _losses(9.0, 2.2), 6.0),
        Run("nvfp4", 0, _losses(9.0, 2.5), 1.0),
        Run("nvfp4", 1, _losses(9.0, 2.1), 3.0),
        Run("nvfp4", 2, _losses(9.0, 2.3), 2.0),
    ]
    rows = {row["recipe"]: row for row in table_rows(runs)}
    assert list(rows) == ["bf16", "nvfp4"]
    bf16_mean = statistics.fmean([2.0, 2.2])
    nvfp4_mean = statistics.fmean([2.5, 2.1, 2.3])
    assert rows["bf16"]["final loss (mean)"] == f"{bf16_mean:.4f}"
    assert rows["nvfp4"]["final loss (mean)"] == f"{nvfp4_mean:.4f}"
    assert rows["nvfp4"]["spread (max-min)"] == f"{2.5 - 2.1:.4f}"
    assert rows["nvfp4"]["seeds"] == "3"
    assert rows["bf16"]["- bf16"] == "+0.0000"
    assert rows["nvfp4"]["- bf16"] == f"{nvfp4_mean - bf16_mean:+.4f}"
    assert rows["nvfp4"]["- bf16 per seed"] == f"{2.5 - 2.0:+.4f} {2.1 - 2.2:+.4f}"  # seed 2 has no bf16 twin
    assert rows["nvfp4"]["first loss"] == "9.0000"
    assert rows["nvfp4"]["steps/s"] == "2.00"  # the median of 1, 3, 2: not the mean of 4 and 6's style
    assert rows["bf16"]["steps/s"] == "5.00"


def test_table_rows_without_bf16_leave_the_difference_blank() -> None:
    rows = table_rows([Run("rowwise", 0, _losses(9.0, 3.0), 1.0)])
    assert rows[0]["- bf16"] == ""
    assert rows[0]["final loss (mean)"] == "3.0000"


def test_runs_written_by_json_files_read_back_into_the_same_table(tmp_path: Path) -> None:
    """``--json`` from parallel processes, then ``--table`` over the files: the same rows as one
    process printing all the runs."""
    runs = [
        Run("bf16", 0, _losses(9.0, 2.0), 4.0),
        Run("nvfp4", 0, _losses(9.0, 2.5), 1.0),
        Run("bf16", 1, _losses(9.0, 2.2), 6.0),
    ]
    append_run(str(tmp_path / "a.jsonl"), runs[0])
    append_run(str(tmp_path / "b.jsonl"), runs[1])
    append_run(str(tmp_path / "a.jsonl"), runs[2])
    back = read_runs([str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl")])
    assert sorted(back, key=lambda r: (r.recipe, r.seed)) == sorted(runs, key=lambda r: (r.recipe, r.seed))
    assert table_rows(back) == table_rows([runs[0], runs[2], runs[1]])
