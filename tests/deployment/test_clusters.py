"""The Ray cluster launcher YAMLs in clusters/ pass Ray's own config validation.

`ray up` fills in the provider's defaults (`prepare_config`) and then checks the
result against Ray's cluster schema plus its cross-field rules
(`validate_config`); both run here, offline, on every YAML. The fake
multi-node provider takes its config as written (the autoscaler started by
`ray start --autoscaling-config` validates the file without merging defaults),
so that file is validated as is.
"""
from __future__ import annotations

import copy
import math
import re
import shlex
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from ray.autoscaler._private.util import prepare_config, validate_config

CLUSTERS_DIR = Path(__file__).resolve().parents[2] / "clusters"
CLUSTER_FILES = sorted(CLUSTERS_DIR.glob("*.yaml"))

# Providers whose configs `ray up` merges with the provider's defaults.
PROVIDERS_WITH_DEFAULTS = {"aws", "gcp"}


def load(path: Path) -> dict[str, Any]:
    with path.open() as f:
        config = yaml.safe_load(f)
    assert isinstance(config, dict), f"{path.name}: not a YAML mapping"
    return config


def ray_validated(config: dict[str, Any]) -> dict[str, Any]:
    """The config as Ray's launcher/autoscaler would use it; raises if Ray rejects it."""
    config = copy.deepcopy(config)
    if config["provider"]["type"] in PROVIDERS_WITH_DEFAULTS:
        config = prepare_config(config)
    validate_config(config)
    return config


def by_name(name: str) -> dict[str, Any]:
    return load(CLUSTERS_DIR / name)


def worker_types(config: dict[str, Any]) -> dict[str, dict[str, Any]]:
    head = config["head_node_type"]
    return {name: t for name, t in config["available_node_types"].items() if name != head}


def test_the_expected_cluster_files_exist() -> None:
    assert {p.name for p in CLUSTER_FILES} >= {"aws.yaml", "gcp.yaml", "local-fake-multinode.yaml"}


@pytest.mark.parametrize("path", CLUSTER_FILES, ids=lambda p: p.name)
def test_cluster_yaml_passes_ray_validation(path: Path) -> None:
    config = ray_validated(load(path))
    # Autoscaling: a head plus at least one worker type that can grow.
    assert config["head_node_type"] in config["available_node_types"]
    workers = worker_types(config)
    assert workers, f"{path.name}: no worker node type"
    for name, node_type in workers.items():
        assert node_type["max_workers"] > node_type.get("min_workers", 0), name
    assert config["max_workers"] >= max(t["max_workers"] for t in workers.values())


@pytest.mark.parametrize(
    ("name", "instance_key", "instance_type"),
    [("aws.yaml", "InstanceType", "p5.48xlarge"), ("gcp.yaml", "machineType", "a3-highgpu-8g")],
)
def test_cloud_clusters_have_8_gpu_h100_workers_that_install_raypipe(
    name: str, instance_key: str, instance_type: str
) -> None:
    config = ray_validated(by_name(name))
    (gpu_type,) = worker_types(config).values()
    assert gpu_type["node_config"][instance_key] == instance_type
    assert gpu_type["resources"]["GPU"] == 8
    # The head runs the driver only: no stage actor may land there.
    assert config["available_node_types"][config["head_node_type"]]["resources"]["CPU"] == 0
    # prepare_config merged setup_commands into both node kinds' setup.
    for commands in (config["head_setup_commands"], config["worker_setup_commands"]):
        assert any("pip install" in c and "raypipe" in c for c in commands)
        assert_pinned(commands, f"{name}'s setup")
    # Nothing listens on a public address unless configured to.
    head_start = " ".join(config["head_start_ray_commands"])
    assert "--dashboard-host=127.0.0.1" in head_start


def assert_pinned(commands: list[str], where: str) -> None:
    """Every ``pip install`` of raypipe or torch in ``commands`` takes the versions of the
    repository's constraints.txt, so a new upstream release cannot change what a node runs."""
    installs = [c for c in commands if "pip install" in c and ("raypipe" in c or "torch" in c)]
    assert installs, where
    for command in installs:
        arguments = shlex.split(command)
        assert "-c" in arguments and arguments[arguments.index("-c") + 1] == "/home/ray/raypipe/constraints.txt", \
            f"{where}: {command}"


def test_the_deployment_images_install_pinned_versions() -> None:
    """docs/deploy.md's image for the Helm chart installs as the cluster files do."""
    deploy = (CLUSTERS_DIR.parent / "docs" / "deploy.md").read_text()
    (dockerfile,) = re.findall(r"```dockerfile\n(.*?)```", deploy, flags=re.DOTALL)
    run = dockerfile.split("RUN ", 1)[1].replace("\\\n", " ")
    assert_pinned([part.split("#")[0] for part in run.split("&&")], "docs/deploy.md's Dockerfile")


def ray_start_env(commands: list[str], start: str) -> dict[str, str]:
    """The environment given to the one ``ray start ...`` command of ``commands``."""
    (command,) = [part for command in commands for part in command.split(";") if start in part]
    words = shlex.split(command)
    ray_at = words.index("ray")
    assert " ".join(words[ray_at:]).startswith(start)
    return dict(word.split("=", 1) for word in words[:ray_at])


@pytest.mark.parametrize("name", ["aws.yaml", "gcp.yaml"])
def test_cloud_nodes_declare_a_lost_node_dead_and_kill_hung_workers_as_the_helm_chart_does(name: str) -> None:
    """The GCS reads RAY_health_check_* from the environment of `ray start --head`; every
    node's raylet reads RAY_kill_worker_timeout_milliseconds from its `ray start`'s."""
    config = ray_validated(by_name(name))
    chart = yaml.safe_load((CLUSTERS_DIR.parent / "helm" / "raypipe" / "values.yaml").read_text())
    check, kill = chart["head"]["nodeHealthCheck"], {"RAY_kill_worker_timeout_milliseconds": str(
        chart["workerKillGraceMs"])}
    assert ray_start_env(config["head_start_ray_commands"], "ray start --head") == {
        "RAY_health_check_period_ms": str(check["periodMs"]), "RAY_health_check_timeout_ms": str(check["timeoutMs"]),
        "RAY_health_check_failure_threshold": str(check["failureThreshold"]), **kill}
    assert ray_start_env(config["worker_start_ray_commands"], "ray start --address") == kill


def header_command(path: Path) -> list[str]:
    """The `python jobs/train_7b.py ...` example of a cluster file's header comment, as argv."""
    lines = [line.removeprefix("#").strip() for line in path.read_text().splitlines() if line.startswith("#")]
    text = " ".join(line.removesuffix("\\").strip() for line in lines)
    start = text.index("python jobs/train_7b.py")
    return shlex.split(text[start:text.index("ray down", start)])


@pytest.mark.parametrize("name", ["aws.yaml", "gcp.yaml"])
def test_cloud_clusters_size_their_gpu_nodes_for_the_elastic_example(name: str) -> None:
    """min_workers/max_workers hold the example's stages x MIN/MAX replicas, one GPU a stage (the 7b preset)."""
    from raypipe.config import parse_replicas

    argv = header_command(CLUSTERS_DIR / name)
    stages, replicas = int(argv[argv.index("--stages") + 1]), parse_replicas(argv[argv.index("--replicas") + 1])
    assert isinstance(replicas, tuple), f"{name}: the example is not an elastic run: {argv}"
    config = ray_validated(by_name(name))
    (gpu_type,) = worker_types(config).values()
    gpus = gpu_type["resources"]["GPU"]
    assert (gpu_type["min_workers"], gpu_type["max_workers"]) == tuple(math.ceil(stages * r / gpus) for r in replicas)
    assert config["max_workers"] >= gpu_type["max_workers"]


def test_fake_multinode_cluster_is_local_and_complete() -> None:
    config = ray_validated(by_name("local-fake-multinode.yaml"))
    assert config["provider"]["type"] == "fake_multinode"
    # FakeMultiNodeProvider registers its head under this node type name.
    assert config["head_node_type"] == "ray.head.default"
    assert config["available_node_types"]["ray.head.default"]["resources"]["CPU"] == 0


# A broken config must fail the same validation: otherwise the tests above
# would prove nothing.
def _head_node_type_not_defined(config: dict[str, Any]) -> None:
    config["head_node_type"] = "no.such.node.type"


def _misspell_a_node_type_field(config: dict[str, Any]) -> None:
    node_type = next(iter(worker_types(config).values()))
    node_type["max_worker"] = node_type.pop("max_workers")


def _negative_cpu_count(config: dict[str, Any]) -> None:
    next(iter(worker_types(config).values()))["resources"]["CPU"] = -1


def _fractional_gpu_count(config: dict[str, Any]) -> None:
    next(iter(worker_types(config).values()))["resources"]["GPU"] = 7.5


def _min_workers_above_global_max(config: dict[str, Any]) -> None:
    next(iter(worker_types(config).values()))["min_workers"] = config["max_workers"] + 1


@pytest.mark.parametrize("path", CLUSTER_FILES, ids=lambda p: p.name)
@pytest.mark.parametrize(
    ("break_config", "error", "message"),
    [
        pytest.param(f, error, message, id=f.__name__.lstrip("_"))
        for f, error, message in [
            (_head_node_type_not_defined, ValueError, "must be one of `available_node_types`"),
            (_misspell_a_node_type_field, jsonschema.ValidationError, "'max_worker' was unexpected"),
            (_negative_cpu_count, jsonschema.ValidationError, "-1 is less than the minimum of 0"),
            (_fractional_gpu_count, jsonschema.ValidationError, "7.5 is not of type 'integer'"),
            (_min_workers_above_global_max, ValueError, "smaller than the sum of `min_workers`"),
        ]
    ],
)
def test_ray_validation_rejects_a_broken_config(path: Path, break_config, error, message) -> None:
    config = load(path)
    break_config(config)
    with pytest.raises(error, match=re.escape(message)):
        ray_validated(config)
