"""The real-model tier's table, model x dtype x feature, from pytest's JUnit XML of each torch version.

    python -m pytest -m models tests/models --junitxml=tier-2.13.xml      # per torch version
    python bench/tier_table.py 2.13=tier-2.13.xml 2.11=tier-2.11.xml 2.15=tier-2.15.xml

Prints one Markdown row per model and dtype, one column per feature, each cell one entry per
torch version: ``bitwise`` (passed), ``xfail`` (a known difference, strict), ``skip`` (the library
does not import there), ``FAIL``; then each version's time: the sum of the tier's test times
and the slowest cases. With ``--slow IDS.txt`` (``pytest --collect-only -q -m models_slow
tests/models``), also the time of a default run, which leaves those out.
"""

from __future__ import annotations

import argparse
import re
import xml.etree.ElementTree as ET
from collections import defaultdict

from tabulate import tabulate

_FEATURES = {
    "test_compile_bitwise": "compile",
    "test_weight_cache_bitwise_and_one_cast_per_optimizer_step": "weight_cache",
    "test_compile_step_fused_adamw_bitwise_eager_recipe": "compile_step",
    "test_inspection_tools_agree_with_eager_autocast": "inspect",
    "test_grouped_query_attention_differs_as_torch_compile_does": "gqa (torch.compile's difference)",
    "test_overflow_watch_changes_no_value": "overflow: watch on/off",
    "test_overflow_planted_is_named_as_eager_finds_it": "overflow: planted named",
}

# What a passing test asserts, where it is not "bitwise".
_PASSED = {
    "gqa (torch.compile's difference)": "differs as torch.compile's",
    "overflow: planted named": "named",
}


def _outcome(case: ET.Element) -> str:
    for child in case:
        if child.tag == "skipped":
            return "xfail" if child.get("type") == "pytest.xfail" else "skip"
        if child.tag in ("failure", "error"):
            return "FAIL"
    return "bitwise"


def read(path: str) -> tuple[dict[tuple[str, str, str], str], dict[str, float]]:
    """(model, dtype, feature) -> outcome, and each test id's time in seconds."""
    out, times = {}, {}
    for case in ET.parse(path).getroot().iter("testcase"):
        m = re.fullmatch(r"(\w+)\[(.+)\]", case.get("name", ""))
        if not m or m.group(1) not in _FEATURES:
            continue
        params = m.group(2).rsplit("-", 1)
        model, dtype = params if len(params) == 2 else ("hf_llama_gqa", params[0])
        feature = _FEATURES[m.group(1)]
        outcome = _outcome(case)
        if outcome == "bitwise":
            outcome = _PASSED.get(feature, outcome)
        out[model, dtype, feature] = outcome
        times[case.get("name", "")] = float(case.get("time", 0.0))
    return out, times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", help="VERSION=FILE.xml, one per torch version")
    parser.add_argument("--slowest", type=int, default=8)
    parser.add_argument("--slow", help="the models_slow test ids, one per line (pytest --collect-only -q)")
    args = parser.parse_args()
    results: dict[str, dict[tuple[str, str, str], str]] = {}
    all_times: dict[str, dict[str, float]] = {}
    for run in args.runs:
        version, path = run.split("=", 1)
        results[version], all_times[version] = read(path)
    versions = list(results)
    rows: dict[tuple[str, str], dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
    for version in versions:
        for (model, dtype, feature), outcome in results[version].items():
            rows[model, dtype][feature].append(f"{version}: {outcome}")
    features = list(dict.fromkeys(_FEATURES.values()))
    table = [
        [model, dtype, *("<br>".join(rows[model, dtype].get(f, [])) or "-" for f in features)]
        for (model, dtype) in rows
    ]
    print(tabulate(table, headers=["model", "dtype", *features], tablefmt="github"))
    for version in versions:
        times = all_times[version]
        slowest = sorted(times.items(), key=lambda kv: -kv[1])[: args.slowest]
        print(
            f"\ntorch {version}: {len(times)} cases, {sum(times.values()):.0f} s in all; slowest: "
            + ", ".join(f"{name} {t:.0f} s" for name, t in slowest)
        )
        if args.slow:
            with open(args.slow) as f:
                slow = {line.strip().split("::")[-1] for line in f if "::" in line}
            default = {n: t for n, t in times.items() if n not in slow}
            print(
                f"torch {version}, default run (without models_slow): {len(default)} cases, "
                f"{sum(default.values()):.0f} s"
            )


if __name__ == "__main__":
    main()
