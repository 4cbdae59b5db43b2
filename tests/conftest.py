"""One shared local Ray instance per test session (per xdist worker); GPU tests only where CUDA is (two
GPUs for gpus2); the longest files first, so that two xdist workers finish together; one torch thread in
each test process."""
from __future__ import annotations

import os

import pytest
import torch


def pytest_configure(config):
    # Two xdist workers share the machine's cores, and the in-process runner's stage workers set the
    # process's thread count to their cpus_per_stage (1) when they start: without this a test's speed
    # (and its reduction order) depended on whether one ran before it in the same worker. One thread from
    # the start: on a loaded 2-core machine a tiny LLaMA reference took 0.1 s on one thread, 6 s on two.
    torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    _pickle_test_code_by_value(items)
    _longest_files_first(items)
    # GPU-marked tests are deselected (not skipped) on machines without CUDA, and run where one exists:
    # `pytest -m gpu` on a GPU machine runs just those. Tests marked gpus2 need two GPUs: they are
    # deselected the same way where the node has fewer. Either way one line at the end of the run says
    # how many were deselected and why; none is skipped.
    if os.environ.get("RAYPIPE_LIST_GPU_TESTS") == "1":  # scripts/gpu_check.sh --dry-run: list them with --collect-only
        return
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        unrunnable, why = ("gpu", "gpus2", "gpus4"), "no CUDA GPU on this node"
    elif count < 2:
        unrunnable, why = ("gpus2", "gpus4"), f"gpus2 and gpus4 tests need 2 and 4 CUDA GPUs on this node, found {count}"
    elif count < 4:
        unrunnable, why = ("gpus4",), f"gpus4 tests need 4 CUDA GPUs on this node, found {count}"
    else:
        return
    selected = [item for item in items if not any(marker in item.keywords for marker in unrunnable)]
    deselected = [item for item in items if any(marker in item.keywords for marker in unrunnable)]
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = selected
        of_them = (f" ({sum('gpus2' in item.keywords for item in deselected)} of them gpus2, "
                   f"{sum('gpus4' in item.keywords for item in deselected)} gpus4)" if count == 0 else "")
        line = f"raypipe: deselected {len(deselected)} test(s) marked {' or '.join(unrunnable)}{of_them}: {why}"
        config.stash[_GPU_DESELECTED] = line
        if hasattr(config, "workeroutput"):  # an xdist worker: its controller prints the summary
            config.workeroutput["raypipe_gpu_deselected"] = line


_GPU_DESELECTED = pytest.StashKey[str]()


@pytest.hookimpl(optionalhook=True)  # xdist's hook: a run with -p no:xdist has none
def pytest_testnodedown(node, error):
    # xdist's controller collects nothing itself: each worker sends the line it would print (the same
    # collection on every worker, so the same line)
    line = getattr(node, "workeroutput", {}).get("raypipe_gpu_deselected")
    if line:
        node.config.stash[_GPU_DESELECTED] = line


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    line = config.stash.get(_GPU_DESELECTED, None)
    if line:
        terminalreporter.write_line(line)


@pytest.fixture
def collector_on():
    """Python's cyclic garbage collector on as the test starts, and as it was after it (the lowering,
    dry-runs and planner's search pause it: raypipe/core/collector_paused.py)."""
    import gc

    was_on = gc.isenabled()
    gc.enable()
    yield
    if not was_on:
        gc.disable()


@pytest.fixture(scope="session")
def ray_cluster():
    """A local Ray instance with 6 logical CPUs (workers take 1 each, up to 3 replicas x 2 stages;
    the machine has 2 cores), configured as the one raypipe starts itself."""
    import ray

    from raypipe.runtime.cluster import LOCAL_SYSTEM_CONFIG

    # address="local": a head another test (or person) started on this machine is not joined.
    # log_to_driver=False: the driver's log thread can hang ray.shutdown() at the session's end, closing
    # its GCS subscriber while the driver closes it too (ray-project/ray#44836; a CI run spent
    # pytest-timeout's 600 s there and failed). The workers' output stays in the session's log files;
    # failures reach the tests as exceptions with their tracebacks.
    if not ray.is_initialized():
        ray.init(address="local", num_cpus=6, include_dashboard=False, logging_level="WARNING",
                 log_to_driver=False, _system_config=LOCAL_SYSTEM_CONFIG)
    yield ray
    ray.shutdown()


def _longest_files_first(items) -> None:
    # `--dist loadfile` hands whole files to the two workers in collection order, as each asks for more
    # (pytest's addopts, pyproject.toml). Files that start their own cluster or kill processes run
    # longest, mostly waiting on timeouts and nodes (a core is free for the other worker meanwhile),
    # then files on the shared Ray instance, then in-process ones: the longest jobs first, so the last
    # files handed out are short and neither worker idles at the end. The order within a file is kept.
    def weight(item) -> int:
        if "cluster" in item.keywords:
            return 0
        return 1 if "ray_cluster" in getattr(item, "fixturenames", ()) else 2

    first_seen: dict[str, int] = {}
    for item in items:
        file = item.nodeid.split("::", 1)[0]
        first_seen[file] = min(first_seen.get(file, 2), weight(item))
    order = {file: (rank, position) for position, (file, rank) in enumerate(first_seen.items())}
    items.sort(key=lambda item: order[item.nodeid.split("::", 1)[0]])


def _pickle_test_code_by_value(items) -> None:
    # Ray workers cannot import test modules; ship their functions and classes by value.
    import sys

    from ray import cloudpickle

    for name, module in list(sys.modules.items()):
        if name == "tests" or name.startswith("tests."):
            cloudpickle.register_pickle_by_value(module)
