"""One shared local Ray instance per test session; GPU tests only where CUDA is."""
from __future__ import annotations

import os

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    _pickle_test_code_by_value(items)
    # GPU-marked tests are deselected (not skipped) on machines without CUDA, and
    # run where one exists: `pytest -m gpu` on a GPU machine runs just those. Tests
    # marked gpus2 need two GPUs: on a machine with one they skip, saying so.
    if os.environ.get("RAYPIPE_LIST_GPU_TESTS") == "1":  # scripts/gpu_check.sh --dry-run: list them with --collect-only
        return
    if torch.cuda.is_available():
        count = torch.cuda.device_count()
        if count < 2:
            skip = pytest.mark.skip(reason=f"needs 2 CUDA GPUs on this node, found {count}")
            for item in items:
                if "gpus2" in item.keywords:
                    item.add_marker(skip)
        return
    selected = [item for item in items if "gpu" not in item.keywords and "gpus2" not in item.keywords]
    deselected = [item for item in items if "gpu" in item.keywords or "gpus2" in item.keywords]
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = selected


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
