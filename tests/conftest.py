import os

# The suite runs strict (issue 8): every "amp_fx did less than asked" warning is an AmpFxError,
# so no test passes while amp_fx silently ignores what it was asked. Set before amp_fx is
# imported; tests of the warnings themselves pass strict=False.
os.environ["AMP_FX_STRICT"] = "1"
# Inductor compiles in-process: its pool of compile subprocesses (one per core, started in every
# process that compiles with inductor: each xdist worker, each spawned rank) buys nothing on a
# 2-core machine already running two workers, and costs CPU: one inductor test file took 101 s of
# CPU with the pool and 91 s without (fresh inductor caches). Read when torch._inductor's config loads.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
# No debug line tables (-g1) in inductor's C++ builds of CPU kernels (torch 2.13 to 2.15 add them
# for profilers): the same code, about 14 % less time per build (1.97 s -> 1.69 s for a kernel
# of test_overflow.py's watched model, g++ here), and the suite builds about 340 kernels cold.
os.environ.setdefault("AOT_INDUCTOR_ENABLE_LINE_TABLES", "0")

import pytest
import torch

# pytest-xdist (pyproject's addopts: -n 2): each worker takes its share of the cores for torch's
# intra-op threads; two workers with every core each oversubscribe the 2-core CI machine. Results
# compared bit for bit are computed in one process, under one thread count.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // _WORKERS))


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Each test compiles from scratch: no cache entries, recompile or graph-break counts leak."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    yield
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()


def _uses_module_fixture(item: pytest.Item) -> bool:
    """Whether the test asks for a module- or package-scoped fixture (spawned ranks, the Triton
    interpreter's worker, a docs build): such a file runs in one xdist worker, so that the fixture
    is set up once (pyproject's ``--dist loadgroup``); every other test goes to whichever worker is
    free, so that no file's length sets the run's tail."""
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return False
    return any(defs[-1].scope in ("module", "package") for defs in info.name2fixturedefs.values())


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """``@pytest.mark.slow_cases`` on a test function: its first collected case stays in the inner
    loop (``-m "not slow"``), every other case is marked ``slow``; a ``models_slow`` case is
    ``slow`` too (``-m "not slow"`` replaces the default ``-m "not models_slow"``). tryfirst:
    before ``-m`` selects."""
    seen: set[str] = set()
    # .ci/matrix names the slow cases it runs besides the inner loop (one pytest run: one start of
    # the workers, one tail): they get the ``matrix_case`` mark its -m selects.
    matrix_cases = set(os.environ.get("AMP_FX_MATRIX_CASES", "").split())
    for item in items:
        if item.nodeid in matrix_cases:
            item.add_marker(pytest.mark.matrix_case)
        if item.get_closest_marker("models_slow") is not None:
            item.add_marker(pytest.mark.slow)
        if _uses_module_fixture(item):
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::")[0]))
        if item.get_closest_marker("slow_cases") is None:
            continue
        func = item.nodeid.split("[")[0]
        if func in seen:
            item.add_marker(pytest.mark.slow)
        seen.add(func)
