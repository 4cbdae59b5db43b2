"""ResourceRequest against Ray's fake multi-node autoscaler, for real.

One `fake_multinode` head for the module (1-CPU worker nodes, at most 3),
started and stopped by pid as in tests/deployment. Drivers are subprocesses
connected with RAY_ADDRESS and the head's token; the test steers each through
its stdin and reads the autoscaler's view of the standing request from the
public `ray status` ("From request_resources:"), which the autoscaler's
monitor rewrites once a loop (every second here).
"""
from __future__ import annotations

import ast
import re
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest
import yaml

from raypipe.runtime.autoscaling import ResourceRequest
from tests.deployment.ray_head import FAKE_AUTOSCALER_ENV, fake_autoscaling_head, head_ports, ray_cli, token_env

REPO = Path(__file__).resolve().parents[2]
WAIT_S = 120
STATUS_REQUEST_LINE = re.compile(r"^ (\{.*\}): (\d+) from request_resources\(\)$", flags=re.MULTILINE)

# Steered through stdin, one command a line; answers each on a stdout line that starts with "> " (Ray prints
# autoscaler events there too).
DRIVER = textwrap.dedent("""
    import sys, time
    import ray
    from raypipe.runtime.autoscaling import ResourceRequest

    ray.init(logging_level="ERROR")
    requests = ResourceRequest([{"CPU": 1}])

    def alive_cpus():
        return sum(node["Resources"].get("CPU", 0) for node in ray.nodes() if node["Alive"])

    for line in sys.stdin:
        command, *args = line.split()
        if command == "request":
            requests.request(int(args[0]))
        elif command == "withdraw":
            requests.withdraw()
        elif command == "wait-cpus":
            deadline = time.monotonic() + float(args[1])
            while alive_cpus() < float(args[0]) and time.monotonic() < deadline:
                time.sleep(1)
            print(">", "cpus", alive_cpus(), flush=True)
            continue
        elif command == "guards":  # alive RequestGuard actors on the cluster (the public state API)
            # waits for the expected count: a guard starts (a worker process) and is reported dead only
            # within Ray's state refresh, both seconds on a loaded machine
            from ray.util.state import list_actors
            deadline = time.monotonic() + float(args[1])
            while True:
                guards = list_actors(filters=[("class_name", "=", "RequestGuard"), ("state", "=", "ALIVE")])
                if len(guards) == int(args[0]) or time.monotonic() >= deadline:
                    break
                time.sleep(1)
            print(">", "guards", len(guards), flush=True)
            continue
        elif command == "raise":
            raise RuntimeError("driver failed on purpose")
        print(">", "done", command, flush=True)
""")


class FakeCluster:
    def __init__(self, address: str, env: dict[str, str]):
        self.address, self.env = address, env

    def driver(self) -> subprocess.Popen:
        env = dict(self.env, RAY_ADDRESS=self.address, PYTHONPATH=str(REPO))
        return subprocess.Popen([sys.executable, "-c", DRIVER], env=env, stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def requested(self) -> list[tuple[dict, int]] | None:
        """The autoscaler's view of the standing request, (bundle, count) pairs; None
        before its monitor has reported ("No cluster status")."""
        done = subprocess.run([ray_cli(), "status", "--address", self.address], env=self.env, capture_output=True,
                              text=True, timeout=60)
        assert done.returncode == 0, done.stderr[-3000:]
        if "From request_resources:" not in done.stdout:
            assert "No cluster status" in done.stdout, done.stdout
            return None
        return [(ast.literal_eval(bundle), int(count)) for bundle, count in STATUS_REQUEST_LINE.findall(done.stdout)]

    def wait_until_requested(self, expected: list[tuple[dict, int]]) -> None:
        deadline = time.monotonic() + WAIT_S
        seen = self.requested()
        while seen != expected and time.monotonic() < deadline:
            time.sleep(2)
            seen = self.requested()
        assert seen == expected, f"the autoscaler sees {seen} from request_resources, not {expected}"


def one_cpu_bundles(count: int) -> list[tuple[dict, int]]:
    return [({"CPU": 1}, count)]


def tell(driver: subprocess.Popen, command: str) -> str:
    driver.stdin.write(command + "\n")
    driver.stdin.flush()
    for line in driver.stdout:
        if line.startswith("> "):
            return line[2:].strip()
    pytest.fail(f"the driver ended on {command!r}:\n{driver.stderr.read()[-3000:]}")


@pytest.fixture(scope="module")
def fake_cluster():
    temp_dir = tempfile.mkdtemp(prefix="rpa-", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    ports = head_ports()
    config = yaml.safe_load((REPO / "clusters" / "local-fake-multinode.yaml").read_text())
    config["provider"]["gcs_address"] = f"127.0.0.1:{ports['port']}"  # the provider assumes 6379 otherwise
    config["max_workers"] = 3
    worker = config["available_node_types"]["ray.worker.cpu"]
    worker["max_workers"] = 3
    worker["resources"] = {"CPU": 1, "object_store_memory": 200_000_000}
    env = token_env(**FAKE_AUTOSCALER_ENV)
    with fake_autoscaling_head(temp_dir, ports, config, env) as address:
        yield FakeCluster(address, env)


@pytest.mark.cluster
def test_a_request_adds_nodes_and_a_withdrawal_clears_it(fake_cluster):
    driver = fake_cluster.driver()
    try:
        assert tell(driver, "request 2") == "done request"
        assert tell(driver, f"wait-cpus 2 {WAIT_S}") == "cpus 2.0"  # the head has none: two nodes were added
        fake_cluster.wait_until_requested(one_cpu_bundles(2))
        assert tell(driver, "withdraw") == "done withdraw"
        fake_cluster.wait_until_requested([])
        assert tell(driver, "withdraw") == "done withdraw"  # idempotent
    finally:
        driver.kill()
        driver.wait()


@pytest.mark.cluster
def test_a_driver_that_fails_withdraws_its_request(fake_cluster):
    driver = fake_cluster.driver()
    try:
        assert tell(driver, "request 3") == "done request"
        fake_cluster.wait_until_requested(one_cpu_bundles(3))
        driver.stdin.write("raise\n")
        driver.stdin.close()
        assert driver.wait(timeout=60) == 1
        assert "RuntimeError: driver failed on purpose" in driver.stderr.read()
        fake_cluster.wait_until_requested([])
    finally:
        driver.kill()
        driver.wait()


@pytest.mark.cluster
def test_a_driver_stopped_with_sigterm_withdraws_its_request(fake_cluster):
    driver = fake_cluster.driver()
    try:
        assert tell(driver, "request 1") == "done request"
        fake_cluster.wait_until_requested(one_cpu_bundles(1))
        driver.send_signal(signal.SIGTERM)  # as `ray job stop` does first
        assert driver.wait(timeout=60) == signal.SIGTERM  # ray.init's handler: sys.exit(15)
        fake_cluster.wait_until_requested([])
    finally:
        driver.kill()
        driver.wait()


@pytest.mark.cluster
def test_a_driver_killed_with_sigkill_has_its_request_withdrawn_by_its_guard(fake_cluster):
    driver = fake_cluster.driver()
    try:
        assert tell(driver, "request 1") == "done request"
        fake_cluster.wait_until_requested(one_cpu_bundles(1))
        driver.kill()  # no atexit hook runs: an OOM kill, or `ray job stop` after its grace period
        assert driver.wait(timeout=60) == -signal.SIGKILL
        fake_cluster.wait_until_requested([])
    finally:
        driver.kill()
        driver.wait()
    # the guard exits once it has withdrawn; a driver that withdraws itself stops its guard
    driver = fake_cluster.driver()
    try:
        assert tell(driver, "request 1") == "done request"
        assert tell(driver, f"guards 1 {WAIT_S}") == "guards 1"
        assert tell(driver, "withdraw") == "done withdraw"
        assert tell(driver, f"guards 0 {WAIT_S}") == "guards 0"
    finally:
        driver.kill()
        driver.wait()


def _nodes_resources(ray_cluster) -> dict[str, float]:
    """The cluster's resources without those of placement groups' bundles (``CPU_group_…``,
    ``bundle_group_…``): an earlier test's placement groups on the shared instance are removed
    asynchronously, so theirs may vanish while this test runs."""
    return {name: amount for name, amount in ray_cluster.cluster_resources().items() if "_group_" not in name}


def test_a_request_without_an_autoscaler_is_harmless(ray_cluster):
    before = _nodes_resources(ray_cluster)
    requests = ResourceRequest([{"CPU": 1}, {"CPU": 1}])
    requests.request(4)
    requests.request(4)
    assert requests.standing
    requests.withdraw()
    requests.withdraw()
    assert not requests.standing
    assert _nodes_resources(ray_cluster) == before


@pytest.mark.parametrize("bundles, named", [
    ([], "non-empty list"), ({"CPU": 1}, "non-empty list"), ([{}], r"bundles_per_replica\[0\]"),
    ([{"CPU": 1}, "GPU"], r"bundles_per_replica\[1\]"), ([{"CPU": -1}], r"\['CPU'\]"),
    ([{"CPU": True}], r"\['CPU'\]"), ([{"CPU": float("nan")}], r"\['CPU'\]"), ([{1: 1.0}], "not a str"),
])
def test_bad_bundles_are_named(bundles, named):
    with pytest.raises(ValueError, match=named):
        ResourceRequest(bundles)


@pytest.mark.parametrize("num_replicas", [-1, 1.5, True, "2"])
def test_a_bad_replica_count_is_named(num_replicas):
    with pytest.raises(ValueError, match="num_replicas"):
        ResourceRequest([{"CPU": 1}]).request(num_replicas)
