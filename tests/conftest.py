"""One shared local Ray instance per test session; GPU tests only where CUDA is (two GPUs for gpus2)."""
from __future__ import annotations

import os

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    _pickle_test_code_by_value(items)
    # GPU-marked tests are deselected (not skipped) on machines without CUDA, and run where one exists:
    # `pytest -m gpu` on a GPU machine runs just those. Tests marked gpus2 need two GPUs: they are
    # deselected the same way where the node has fewer. Either way one line at the end of the run says
    # how many were deselected and why; none is skipped.
    if os.environ.get("RAYPIPE_LIST_GPU_TESTS") == "1":  # scripts/gpu_check.sh --dry-run: list them with --collect-only
        return
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        unrunnable, why = ("gpu", "gpus2"), "no CUDA GPU on this node"
    elif count < 2:
        unrunnable, why = ("gpus2",), f"gpus2 tests need 2 CUDA GPUs on this node, found {count}"
    else:
        return
    selected = [item for item in items if not any(marker in item.keywords for marker in unrunnable)]
    deselected = [item for item in items if any(marker in item.keywords for marker in unrunnable)]
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = selected
        of_them = f" ({sum('gpus2' in item.keywords for item in deselected)} of them gpus2)" if count == 0 else ""
        config.stash[_GPU_DESELECTED] = (
            f"raypipe: deselected {len(deselected)} test(s) marked {' or '.join(unrunnable)}{of_them}: {why}")


_GPU_DESELECTED = pytest.StashKey[str]()


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    line = config.stash.get(_GPU_DESELECTED, None)
    if line:
        terminalreporter.write_line(line)


@pytest.fixture(scope="session")
def ray_cluster():
    """A local Ray instance with 6 logical CPUs (workers take 1 each, up to 3 replicas x 2 stages;
    the machine has 2 cores), configured as the one raypipe starts itself."""
    import ray

    from raypipe.runtime.cluster import LOCAL_SYSTEM_CONFIG

    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    # address="local": a head another test (or person) started on this machine is not joined
    if not ray.is_initialized():
        ray.init(address="local", num_cpus=6, include_dashboard=False, logging_level="WARNING",
                 _system_config=LOCAL_SYSTEM_CONFIG)
    yield ray
    ray.shutdown()


def _pickle_test_code_by_value(items) -> None:
    # Ray workers cannot import test modules; ship their functions and classes by value.
    import sys

    from ray import cloudpickle

    for name, module in list(sys.modules.items()):
        if name == "tests" or name.startswith("tests."):
            cloudpickle.register_pickle_by_value(module)
