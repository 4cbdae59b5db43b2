"""One real `ray start --head` shared by the deployment tests that need a head which lives
(each `ray start` costs ~20 s on 2 busy cores); a test that kills a head starts its own."""
from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import NamedTuple

import pytest

from tests.deployment.ray_head import head_ports, start_head, stop_session, token_env, wait_for_dashboard

REPO = Path(__file__).resolve().parents[2]


class SharedHead(NamedTuple):
    url: str  # the dashboard and job server
    address: str  # what a driver's RAY_ADDRESS names
    env: dict[str, str]  # with the head's token (Ray's token authentication)


@pytest.fixture(scope="package")  # stopped after the deployment tests: an idle head costs the rest CPU
def ray_head():
    """A real Ray head (`ray start --head`, 2 CPUs) on 127.0.0.1, every port chosen here so
    that it collides with no other Ray instance on the machine, with a token of its own."""
    temp_dir = tempfile.mkdtemp(prefix="rpj-", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    env = token_env(PYTHONPATH=str(REPO))
    ports = head_ports()
    head = start_head(temp_dir, env, ports, "--num-cpus=2", "--object-store-memory=300000000")
    url = f"http://127.0.0.1:{ports['dashboard-port']}"
    try:
        wait_for_dashboard(head, url, Path(temp_dir) / "ray-start.log")
        yield SharedHead(url, f"127.0.0.1:{ports['port']}", env)
    finally:
        stop_session(head)
        shutil.rmtree(temp_dir, ignore_errors=True)
