"""The KubeRay Helm chart in helm/raypipe, rendered offline by Helm's own Go SDK.

`helm_python` (PyPI `helm-python-sdk`) renders and lints the chart exactly as
`helm template` / `helm lint` would. The rendered RayJob and RayCluster are
validated against the OpenAPI schemas of the KubeRay v1.7.0 CRDs
(tests/fixtures/kuberay-crds/), made strict about unknown fields, plus the
spec rules KubeRay's operator enforces on admission.
"""
from __future__ import annotations

import copy
import functools
import json
import re
import shlex
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import helm_python
import jsonschema
import pytest
import yaml

from raypipe.core.ops import BOUNDARY_SHAPES
from raypipe.core.schedule import SCHEDULES

ROOT = Path(__file__).resolve().parents[2]
CHART_DIR = ROOT / "helm" / "raypipe"
CRD_DIR = Path(__file__).resolve().parents[1] / "fixtures" / "kuberay-crds"
CRD_FILES = {"RayJob": "ray.io_rayjobs.yaml", "RayCluster": "ray.io_rayclusters.yaml"}

RELEASE = "demo"
NAMESPACE = "ml"
METRICS_PORT_NAME = "raypipe-metrics"

# Value overrides the chart must handle; each renders, lints clean and validates.
CASES: dict[str, dict[str, Any]] = {
    "defaults": {},
    "standalone-raycluster": {"rayCluster": {"enabled": True}},
    "raycluster-only": {"job": {"enabled": False}, "rayCluster": {"enabled": True}},
    "no-podmonitor": {"podMonitor": {"enabled": False}},
    "elastic-1-to-2-replicas": {"training": {"replicas": {"min": 1, "max": 2}}},
    "16-stages-on-2-to-4-nodes": {
        "training": {"stages": 16, "microBatches": 64},
        "gpuWorkers": {"replicas": 2, "minReplicas": 2, "maxReplicas": 4},
    },
    "tolerations-and-node-selectors": {
        "gpuWorkers": {
            "tolerations": [
                {"key": "dedicated", "operator": "Equal", "value": "llm", "effect": "NoSchedule"},
                {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
            ],
            "nodeSelector": {"node.kubernetes.io/instance-type": "p5.48xlarge"},
        },
        "head": {"nodeSelector": {"pool": "cpu"}, "rayStartParams": {"num-cpus": 0}},
    },
    "tiny-on-cpu-without-autoscaler": {
        "training": {"preset": "tiny", "stages": 2, "microBatches": 4, "seqLen": 64, "steps": 3},
        # null deletes a default key in Helm's value coalescing: no GPUs.
        "gpuWorkers": {
            "resources": {
                "requests": {"cpu": "2", "memory": "4Gi", "nvidia.com/gpu": None},
                "limits": {"cpu": "2", "memory": "4Gi", "nvidia.com/gpu": None},
            },
            "tolerations": [],
        },
        "autoscaling": {"enabled": False},
        "job": {"submissionMode": "HTTPMode", "shutdownAfterJobFinishes": False, "activeDeadlineSeconds": 3600},
        "grafanaDashboard": {"enabled": False},
    },
    "private-image-and-credentials": {
        "image": {"repository": "registry.example.com/ml/raypipe", "tag": "0.1.0-cu124"},
        "imagePullSecrets": [{"name": "regcred"}],
        "serviceAccountName": "raypipe-s3",
        "envFrom": [{"secretRef": {"name": "s3-credentials"}}],
        "volumes": [{"name": "ckpt", "persistentVolumeClaim": {"claimName": "raypipe-ckpt"}}],
        "volumeMounts": [{"name": "ckpt", "mountPath": "/mnt/ckpt"}],
        "training": {"checkpointDir": "/mnt/ckpt/llama-7b", "extraArgs": ["--eval-every", "100"]},
    },
}


# --------------------------------------------------------------------------- helpers


@pytest.fixture(scope="module")
def chart() -> Iterator[helm_python.Chart]:
    with helm_python.Chart.load(CHART_DIR) as loaded:
        yield loaded


def render(chart: helm_python.Chart, values: dict[str, Any] | None = None, name: str = RELEASE) -> dict[str, list[dict]]:
    """Rendered manifests grouped by kind (NOTES.txt left out)."""
    files = chart.render(values=values or {}, name=name, namespace=NAMESPACE)
    by_kind: dict[str, list[dict]] = {}
    for path, text in files.items():
        if path.endswith("NOTES.txt"):
            continue
        for doc in yaml.safe_load_all(text):
            if doc:
                by_kind.setdefault(doc["kind"], []).append(doc)
    return by_kind


def only(manifests: dict[str, list[dict]], kind: str) -> dict:
    (manifest,) = manifests[kind]
    return manifest


def _closed(schema: Any) -> Any:
    """Forbid fields a structural schema does not declare.

    The API server prunes unknown fields of a custom resource silently, so a
    misspelt field in the chart would vanish instead of failing; here it fails.
    """
    if isinstance(schema, dict):
        schema = {key: _closed(value) for key, value in schema.items()}
        if (
            schema.get("type") == "object"
            and "properties" in schema
            and "additionalProperties" not in schema
            and not schema.get("x-kubernetes-preserve-unknown-fields")
        ):
            schema["additionalProperties"] = False
    elif isinstance(schema, list):
        schema = [_closed(item) for item in schema]
    return schema


@functools.cache
def crd_validator(kind: str) -> jsonschema.Draft7Validator:
    """Validator for `kind` from the served v1 version of its KubeRay CRD."""
    with (CRD_DIR / CRD_FILES[kind]).open() as f:
        crd = yaml.load(f, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    assert crd["spec"]["names"]["kind"] == kind
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1" and v["served"]]
    return jsonschema.Draft7Validator(_closed(version["schema"]["openAPIV3Schema"]))


def crd_errors(manifest: dict) -> list[str]:
    errors = crd_validator(manifest["kind"]).iter_errors(manifest)
    return sorted(f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in errors)


DNS_1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
# KubeRay: RayCluster names <= 53; a RayJob's cluster is its name + 6 characters.
MAX_NAME = {"RayCluster": 53, "RayJob": 47}


def kuberay_spec_errors(manifest: dict) -> list[str]:
    """The RayJob/RayCluster rules KubeRay v1.7's operator enforces (utils/validation.go)."""
    errors = []
    name, spec = manifest["metadata"]["name"], manifest["spec"]
    if len(name) > MAX_NAME[manifest["kind"]] or not DNS_1035.match(name):
        errors.append(f"name {name!r} is not a DNS-1035 label of <= {MAX_NAME[manifest['kind']]} characters")
    cluster_specs = [spec] if manifest["kind"] == "RayCluster" else [spec.get("rayClusterSpec")]
    if manifest["kind"] == "RayJob":
        selector = spec.get("clusterSelector", {})
        if bool(spec.get("rayClusterSpec")) == bool(selector):
            errors.append("exactly one of rayClusterSpec and clusterSelector must be set")
        if selector and not selector.get("ray.io/cluster"):
            errors.append("clusterSelector needs ray.io/cluster")
        if spec.get("ttlSecondsAfterFinished", 0) > 0 and not spec.get("shutdownAfterJobFinishes"):
            errors.append("ttlSecondsAfterFinished needs shutdownAfterJobFinishes")
        if spec.get("submissionMode") == "SidecarMode" and (selector or "submitterPodTemplate" in spec):
            errors.append("SidecarMode supports neither clusterSelector nor submitterPodTemplate")
        if spec.get("activeDeadlineSeconds", 1) <= 0 or spec.get("backoffLimit", 0) < 0:
            errors.append("activeDeadlineSeconds must be > 0 and backoffLimit >= 0")
    for cluster in filter(None, cluster_specs):
        groups = [cluster["headGroupSpec"], *cluster.get("workerGroupSpecs", [])]
        for group in groups:
            if not group["template"]["spec"]["containers"]:
                errors.append("every group needs a container")
        for group in cluster.get("workerGroupSpecs", []):
            if not group["minReplicas"] <= group.get("replicas", 0) <= group["maxReplicas"]:
                errors.append(f"worker group {group['groupName']}: replicas outside [minReplicas, maxReplicas]")
    return errors


def ray_clusters(manifests: dict[str, list[dict]]) -> list[dict]:
    """Every Ray cluster spec rendered: embedded in the RayJob and standalone."""
    specs = [m["spec"]["rayClusterSpec"] for m in manifests.get("RayJob", []) if "rayClusterSpec" in m["spec"]]
    return specs + [m["spec"] for m in manifests.get("RayCluster", [])]


def pod_specs(manifests: dict[str, list[dict]]) -> list[dict]:
    pods = []
    for cluster in ray_clusters(manifests):
        pods.append(cluster["headGroupSpec"]["template"]["spec"])
        pods += [group["template"]["spec"] for group in cluster["workerGroupSpecs"]]
    pods += [m["spec"]["submitterPodTemplate"]["spec"] for m in manifests.get("RayJob", []) if "submitterPodTemplate" in m["spec"]]
    return pods


def head_container(cluster: dict) -> dict:
    (container,) = cluster["headGroupSpec"]["template"]["spec"]["containers"]
    return container


def entrypoint_flags(rayjob: dict) -> tuple[list[str], dict[str, list[str]]]:
    """(command before the first flag, {flag: [values]}) of the RayJob entrypoint."""
    argv = shlex.split(rayjob["spec"]["entrypoint"])
    first_flag = next(i for i, arg in enumerate(argv) if arg.startswith("--"))
    flags: dict[str, list[str]] = {}
    current = ""
    for arg in argv[first_flag:]:
        if arg.startswith("--"):
            current = arg
            flags.setdefault(current, [])
        else:
            flags[current].append(arg)
    return argv[:first_flag], flags


def combined(*overrides: dict[str, Any]) -> dict[str, Any]:
    """Several override sets deep-merged into one (later ones win)."""
    result: dict[str, Any] = {}
    for override in overrides:
        for key, value in override.items():
            if isinstance(value, dict) and isinstance(result.get(key), dict):
                result[key] = combined(result[key], value)
            else:
                result[key] = value
    return result


# --------------------------------------------------------------------------- every case


@pytest.mark.parametrize("values", CASES.values(), ids=CASES.keys())
def test_chart_lints_clean(values: dict[str, Any]) -> None:
    report = helm_python.lint(CHART_DIR, values, strict=True, namespace=NAMESPACE)
    assert report["errors"] == []
    assert [m for m in report["messages"] if m["severity"] >= 2] == []


def test_lint_reports_values_that_break_the_schema() -> None:
    report = helm_python.lint(CHART_DIR, {"training": {"stages": 0}}, strict=True, namespace=NAMESPACE)
    assert any("/training/stages" in error for error in report["errors"])
    for balance in ("memory", [3, 0]):
        report = helm_python.lint(CHART_DIR, {"training": {"balance": balance}}, strict=True, namespace=NAMESPACE)
        assert any("/training/balance" in error for error in report["errors"]), report["errors"]


@pytest.mark.parametrize("values", CASES.values(), ids=CASES.keys())
def test_rendered_kuberay_resources_match_the_kuberay_crds(chart, values: dict[str, Any]) -> None:
    manifests = render(chart, values)
    kuberay = manifests.get("RayJob", []) + manifests.get("RayCluster", [])
    assert kuberay, "neither a RayJob nor a RayCluster rendered"
    for manifest in kuberay:
        assert manifest["apiVersion"] == "ray.io/v1"
        assert crd_errors(manifest) == []
        assert kuberay_spec_errors(manifest) == []


@pytest.mark.parametrize("values", CASES.values(), ids=CASES.keys())
def test_every_pod_runs_as_non_root_without_privilege_escalation(chart, values: dict[str, Any]) -> None:
    manifests = render(chart, values)
    pods = pod_specs(manifests)
    assert pods
    for pod in pods:
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["runAsUser"] > 0
        for container in pod["containers"]:
            context = container["securityContext"]
            assert context["allowPrivilegeEscalation"] is False
            assert context["capabilities"]["drop"] == ["ALL"]
    for cluster in ray_clusters(manifests):
        if cluster["enableInTreeAutoscaling"]:
            # KubeRay injects the autoscaler sidecar with this context.
            autoscaler = cluster["autoscalerOptions"]["securityContext"]
            assert autoscaler["allowPrivilegeEscalation"] is False
            assert autoscaler["capabilities"]["drop"] == ["ALL"]


# --------------------------------------------------------------------------- RayJob


def test_entrypoint_passes_replicas_and_a_sharded_optimizer(chart) -> None:
    overrides = {"training": {"stages": 4, "replicas": 4, "shardOptimizer": True}}
    _command, flags = entrypoint_flags(only(render(chart, overrides), "RayJob"))
    assert flags["--stages"] == ["4"] and flags["--replicas"] == ["4"] and flags["--shard-optimizer"] == []


def test_entrypoint_passes_the_schedule(chart) -> None:
    _command, flags = entrypoint_flags(only(render(chart, {}), "RayJob"))
    assert "--schedule" not in flags  # the default, "gpipe", is train_7b.py's default too
    assert "--virtual-stages" not in flags
    for schedule in ("1f1b", "zb_h1"):
        _command, flags = entrypoint_flags(only(render(chart, {"training": {"schedule": schedule}}), "RayJob"))
        assert flags["--schedule"] == [schedule]
    _command, flags = entrypoint_flags(only(render(chart, {"training": {"schedule": "zbv", "virtualStages": 2}}),
                                            "RayJob"))
    assert flags["--schedule"] == ["zbv"] and flags["--virtual-stages"] == ["2"]
    # virtualStages left null: no flag, and the job takes the schedule's own (zbv 2, interleaved_1f1b 2)
    _command, flags = entrypoint_flags(only(render(chart, {"training": {"schedule": "interleaved_1f1b"}}), "RayJob"))
    assert flags["--schedule"] == ["interleaved_1f1b"] and "--virtual-stages" not in flags
    _command, flags = entrypoint_flags(only(render(chart, {"training": {"schedule": "interleaved_1f1b",
                                                                        "virtualStages": 3}}), "RayJob"))
    assert flags["--virtual-stages"] == ["3"]
    schema = json.loads((CHART_DIR / "values.schema.json").read_text())
    assert schema["properties"]["training"]["properties"]["schedule"]["enum"] == list(SCHEDULES)


def test_entrypoint_passes_tensor_parallelism(chart) -> None:
    _command, flags = entrypoint_flags(only(render(chart, {}), "RayJob"))
    assert "--tensor-parallel" not in flags and "--sequence-parallel" not in flags  # t = 1, train_7b.py's default
    overrides = {"training": {"stages": 2, "tensorParallel": 4, "snapshotEvery": 0}}
    _command, flags = entrypoint_flags(only(render(chart, overrides), "RayJob"))
    assert flags["--tensor-parallel"] == ["4"] and "--sequence-parallel" not in flags  # null: on at t > 1
    for value, flag in ((True, "--sequence-parallel"), (False, "--no-sequence-parallel")):
        overrides["training"]["sequenceParallel"] = value
        _command, flags = entrypoint_flags(only(render(chart, overrides), "RayJob"))
        assert flags[flag] == []


def test_entrypoint_passes_pack(chart) -> None:
    _command, flags = entrypoint_flags(only(render(chart, {}), "RayJob"))
    assert "--pack" not in flags  # off by default, as in train_7b.py
    _command, flags = entrypoint_flags(only(render(chart, {"training": {"pack": True}}), "RayJob"))
    assert flags["--pack"] == []
    schema = json.loads((CHART_DIR / "values.schema.json").read_text())
    assert schema["properties"]["training"]["properties"]["pack"]["type"] == "boolean"
    assert yaml.safe_load((CHART_DIR / "values.yaml").read_text())["training"]["pack"] is False
    report = helm_python.lint(CHART_DIR, {"training": {"pack": "yes"}}, strict=True, namespace=NAMESPACE)
    assert any("/training/pack" in error for error in report["errors"]), report["errors"]


def test_entrypoint_passes_the_balance(chart) -> None:
    _command, flags = entrypoint_flags(only(render(chart, {}), "RayJob"))
    assert "--balance" not in flags  # the default, "parameters", is train_7b.py's default too
    for balance, flag in (("time", "time"), ([3, 3, 2], "3,3,2"), ("parameters", None)):
        _command, flags = entrypoint_flags(only(render(chart, {"training": {"stages": 3, "balance": balance}}),
                                                "RayJob"))
        assert flags.get("--balance") == (None if flag is None else [flag])


def test_entrypoint_passes_the_failure_policy(chart) -> None:
    _command, flags = entrypoint_flags(only(render(chart, {}), "RayJob"))
    assert (flags["--max-failures"], flags["--snapshot-every"], flags["--hang-timeout"]) == (["3"], ["1"], ["30"])
    for failures, every in ((-1, 5), (0, 0)):  # zeros stay zeros (no template default swallows them)
        overrides = {"training": {"maxFailures": failures, "snapshotEvery": every, "hangTimeoutSeconds": 90}}
        _command, flags = entrypoint_flags(only(render(chart, overrides), "RayJob"))
        assert (flags["--max-failures"], flags["--snapshot-every"], flags["--hang-timeout"]) == (
            [str(failures)], [str(every)], ["90"])


def test_entrypoint_passes_the_slow_worker_knobs_only_when_set(chart) -> None:
    _command, flags = entrypoint_flags(only(render(chart, {}), "RayJob"))
    assert not {"--slow-factor", "--slow-steps", "--on-slow"} & set(flags)  # train_7b.py's defaults: 1.3, 10, report
    overrides = {"training": {"slowFactor": 1.5, "slowSteps": 20}}
    _command, flags = entrypoint_flags(only(render(chart, overrides), "RayJob"))
    assert (flags["--slow-factor"], flags["--slow-steps"]) == (["1.5"], ["20"])
    _command, flags = entrypoint_flags(only(render(chart, {"training": {"onSlow": "replace", "spareWorkers": 1}}),
                                            "RayJob"))
    assert (flags["--on-slow"], flags["--spare-workers"]) == (["replace"], ["1"])
    _command, flags = entrypoint_flags(only(render(chart, {"training": {"onSlow": "rebalance"}}), "RayJob"))
    assert flags["--on-slow"] == ["rebalance"]
    for bad in ({"slowFactor": 1}, {"slowSteps": 0}, {"onSlow": "ignore"}):
        report = helm_python.lint(CHART_DIR, {"training": bad}, strict=True, namespace=NAMESPACE)
        assert any(f"/training/{next(iter(bad))}" in error for error in report["errors"]), report["errors"]


def test_spare_workers_are_passed_and_counted_in_the_worker_pods(chart) -> None:
    manifests = render(chart, {})
    assert "--spare-workers" not in entrypoint_flags(only(manifests, "RayJob"))[1]  # none by default
    assert worker_group(manifests) == (1, 1, 1)  # 8 stages on one 8-GPU pod
    manifests = render(chart, {"training": {"spareWorkers": 2}})
    assert entrypoint_flags(only(manifests, "RayJob"))[1]["--spare-workers"] == ["2"]
    assert worker_group(manifests) == (2, 2, 2)  # 8 stages + 2 spares: ceil(10 / 8) pods
    with pytest.raises(Exception, match="spareWorkers"):
        render(chart, {"training": {"spareWorkers": -1}})
    tensor_parallel = {"spareWorkers": 2, "tensorParallel": 2, "stages": 4}  # one spare group: a whole stage's place
    assert entrypoint_flags(only(render(chart, {"training": tensor_parallel}), "RayJob"))[1]["--spare-workers"] == ["2"]
    with pytest.raises(Exception, match="spareWorkers=3 must be a multiple of training.tensorParallel=2"):
        render(chart, {"training": {**tensor_parallel, "spareWorkers": 3}})


def test_entrypoint_runs_train_7b_with_the_training_values(chart) -> None:
    overrides = combined(CASES["16-stages-on-2-to-4-nodes"], CASES["private-image-and-credentials"])
    training = chart.merge_values(overrides)["training"]
    rayjob = only(render(chart, overrides), "RayJob")
    command, flags = entrypoint_flags(rayjob)
    assert command == ["python", "jobs/train_7b.py"]
    assert flags == {
        "--preset": ["7b"],
        "--stages": ["16"],
        "--replicas": ["1"],
        "--max-failures": ["3"],
        "--snapshot-every": ["1"],
        "--hang-timeout": ["30"],
        "--replace-timeout": ["600"],
        "--micro-batches": ["64"],
        "--micro-batch-size": [str(training["microBatchSize"])],
        "--seq-len": [str(training["seqLen"])],
        "--steps": [str(training["steps"])],
        "--data": [training["dataPath"]],
        "--checkpoint-dir": ["/mnt/ckpt/llama-7b"],
        "--checkpoint-every": ["100"],
        "--resume": [],
        "--metrics-port": [str(training["metricsPort"])],
        "--metrics-host": ["0.0.0.0"],
        "--eval-every": ["100"],
    }


def test_a_rerun_resumes_from_checkpoints_at_the_chosen_cadence(chart) -> None:
    """What a job.backoffLimit rerun needs: --resume, the cadence, retention and the replacement timeout."""
    _command, flags = entrypoint_flags(only(render(chart, {}), "RayJob"))
    assert "--no-resume" not in flags and "--keep-last" not in flags  # keepLast 0: every checkpoint kept
    overrides = {"training": {"checkpointEvery": 25, "keepLast": 3, "replaceTimeoutSeconds": 120},
                 "job": {"backoffLimit": 4}}
    rayjob = only(render(chart, overrides), "RayJob")
    _command, flags = entrypoint_flags(rayjob)
    assert (flags["--checkpoint-every"], flags["--keep-last"], flags["--replace-timeout"]) == (["25"], ["3"], ["120"])
    assert flags["--resume"] == [] and rayjob["spec"]["backoffLimit"] == 4
    # without reruns, a run may start over
    _command, flags = entrypoint_flags(only(render(chart, {"training": {"resume": False, "checkpointDir": "/tmp/c"},
                                                           "job": {"backoffLimit": 0}}), "RayJob"))
    assert "--no-resume" in flags and "--resume" not in flags


def test_the_head_declares_a_lost_node_dead_and_every_node_kills_hung_workers_as_configured(chart) -> None:
    """Ray's GCS (on the head) reads RAY_health_check_*, every raylet RAY_kill_worker_timeout_milliseconds;
    the user's env still comes after and wins."""
    expected = {"RAY_health_check_period_ms": "1000", "RAY_health_check_timeout_ms": "5000",
                "RAY_health_check_failure_threshold": "5", "RAY_kill_worker_timeout_milliseconds": "1000"}
    for manifests in (render(chart), render(chart, {"rayCluster": {"enabled": True}})):
        for cluster in ray_clusters(manifests):
            env = {e["name"]: e["value"] for e in head_container(cluster)["env"]}
            assert expected.items() <= env.items()
            (group,) = cluster["workerGroupSpecs"]
            assert {e["name"]: e["value"] for e in group["template"]["spec"]["containers"][0]["env"]} == {
                "RAY_kill_worker_timeout_milliseconds": "1000"}
    overrides = {"head": {"nodeHealthCheck": {"periodMs": 500, "timeoutMs": 2000, "failureThreshold": 3}},
                 "workerKillGraceMs": 300, "env": [{"name": "AWS_REGION", "value": "us-west-2"}]}
    cluster = only(render(chart, overrides), "RayJob")["spec"]["rayClusterSpec"]
    assert head_container(cluster)["env"] == [
        {"name": "RAY_health_check_period_ms", "value": "500"},
        {"name": "RAY_health_check_timeout_ms", "value": "2000"},
        {"name": "RAY_health_check_failure_threshold", "value": "3"},
        {"name": "RAY_kill_worker_timeout_milliseconds", "value": "300"},
        {"name": "AWS_REGION", "value": "us-west-2"}]
    (group,) = cluster["workerGroupSpecs"]
    assert group["template"]["spec"]["containers"][0]["env"] == [
        {"name": "RAY_kill_worker_timeout_milliseconds", "value": "300"}, {"name": "AWS_REGION", "value": "us-west-2"}]


def test_large_step_counts_render_as_integers(chart) -> None:
    # Helm holds numbers as float64; a bare {{ .steps }} would print 1e+06.
    _, flags = entrypoint_flags(only(render(chart, {"training": {"steps": 1_000_000}}), "RayJob"))
    assert flags["--steps"] == ["1000000"]


ELASTIC_VALUES_FILE = """
training:
  stages: 8
  replicas: {min: 1, max: 2}   # elastic: --replicas 1:2
gpuWorkers:
  nodeSelector:
    node.kubernetes.io/instance-type: p5.48xlarge
"""


def worker_group(manifests: dict[str, list[dict]]) -> tuple[int, int, int]:
    """(replicas, minReplicas, maxReplicas) of the GPU worker group, the same in every Ray cluster rendered."""
    groups = {(g["replicas"], g["minReplicas"], g["maxReplicas"])
              for cluster in ray_clusters(manifests) for g in cluster["workerGroupSpecs"]}
    (group,) = groups
    return group


def test_an_elastic_values_file_drives_the_trainer_and_the_worker_group(chart, tmp_path) -> None:
    """One value: the job's --replicas MIN:MAX and the autoscaler's bounds of 8-GPU pods (8 stages each)."""
    path = tmp_path / "elastic-values.yaml"
    path.write_text(ELASTIC_VALUES_FILE)
    values = yaml.safe_load(path.read_text())
    for overrides in (values, combined(values, {"rayCluster": {"enabled": True}})):
        manifests = render(chart, overrides)
        _command, flags = entrypoint_flags(only(manifests, "RayJob"))
        assert (flags["--stages"], flags["--replicas"]) == (["8"], ["1:2"])
        assert worker_group(manifests) == (2, 1, 2)  # starts at max; the autoscaler may go down to 1 pod
        for manifest in manifests["RayJob"] + manifests.get("RayCluster", []):
            assert crd_errors(manifest) == [] and kuberay_spec_errors(manifest) == []
    report = helm_python.lint(CHART_DIR, values, strict=True, namespace=NAMESPACE)
    assert report["errors"] == [] and [m for m in report["messages"] if m["severity"] >= 2] == []


def test_the_values_file_of_docs_deploy_md_renders_an_elastic_run(chart) -> None:
    text = (ROOT / "docs" / "deploy.md").read_text()
    (block,) = re.findall(r"```yaml\n(# my-values\.yaml\n.*?)```", text, flags=re.S)
    manifests = render(chart, yaml.safe_load(block))
    _command, flags = entrypoint_flags(only(manifests, "RayJob"))
    assert (flags["--stages"], flags["--replicas"]) == (["8"], ["1:2"])
    assert worker_group(manifests) == (2, 1, 2)


GPUS_8 = {"limits": {"cpu": "160", "memory": "1500Gi", "nvidia.com/gpu": 8}}
GPUS_4 = {"requests": {"nvidia.com/gpu": 4}, "limits": {"cpu": "96", "memory": "700Gi", "nvidia.com/gpu": 4}}


def _cpu_pods(cpu: str) -> dict[str, Any]:
    return {"requests": {"cpu": cpu, "memory": "4Gi", "nvidia.com/gpu": None},
            "limits": {"cpu": cpu, "memory": "4Gi", "nvidia.com/gpu": None}}


@pytest.mark.parametrize(("training", "resources", "flag", "pods"), [
    pytest.param({}, GPUS_8, "1", (1, 1, 1), id="default-1x8-on-8-gpu-pods"),
    pytest.param({"replicas": 2}, GPUS_8, "2", (2, 2, 2), id="fixed-2x8"),
    pytest.param({"replicas": {"min": 2, "max": 2}}, GPUS_8, "2:2", (2, 2, 2), id="elastic-2-to-2"),
    pytest.param({"stages": 4, "replicas": {"min": 1, "max": 4}}, GPUS_8, "1:4", (2, 1, 2), id="two-replicas-a-pod"),
    # 6 and 18 stages on 4-GPU pods: ceil(6/4) = 2, ceil(18/4) = 5
    pytest.param({"stages": 6, "replicas": {"min": 1, "max": 3}}, GPUS_4, "1:3", (5, 2, 5), id="rounded-up"),
    # tiny: a stage per whole CPU; 2 and 8 stages on 3-CPU pods: 1 and 3 pods
    pytest.param({"preset": "tiny", "stages": 2, "replicas": {"min": 1, "max": 4}}, _cpu_pods("3"), "1:4",
                 (3, 1, 3), id="tiny-on-3-cpu-pods"),
    pytest.param({"preset": "tiny", "stages": 2, "replicas": {"min": 1, "max": 4}}, _cpu_pods("3500m"), "1:4",
                 (3, 1, 3), id="tiny-on-millicpu-pods"),
])
def test_worker_pods_follow_training_replicas(chart, training, resources, flag, pods) -> None:
    overrides = {"training": training, "gpuWorkers": {"resources": resources}}
    manifests = render(chart, overrides)
    _command, flags = entrypoint_flags(only(manifests, "RayJob"))
    assert flags["--replicas"] == [flag]
    assert worker_group(manifests) == pods


def test_set_worker_pods_override_what_training_replicas_gives(chart) -> None:
    elastic = {"training": {"replicas": {"min": 1, "max": 2}}}
    assert worker_group(render(chart, combined(elastic, {"gpuWorkers": {"maxReplicas": 3}}))) == (2, 1, 3)  # a spare
    assert worker_group(render(chart, combined(elastic, {"gpuWorkers": {"replicas": 1}}))) == (1, 1, 2)
    assert worker_group(render(chart, combined(elastic, {"gpuWorkers": {"minReplicas": 0}}))) == (2, 0, 2)
    manifests = render(chart, CASES["16-stages-on-2-to-4-nodes"])
    assert worker_group(manifests) == (2, 2, 4)
    assert entrypoint_flags(only(manifests, "RayJob"))[1]["--replicas"] == ["1"]


def test_job_lifecycle_follows_values(chart) -> None:
    job_values = chart.values["job"]
    spec = only(render(chart), "RayJob")["spec"]
    assert spec["shutdownAfterJobFinishes"] is True
    assert spec["ttlSecondsAfterFinished"] == job_values["ttlSecondsAfterFinished"]
    assert spec["backoffLimit"] == job_values["backoffLimit"]
    assert "activeDeadlineSeconds" not in spec  # 0 means no deadline
    assert yaml.safe_load(spec["runtimeEnvYAML"]) == job_values["runtimeEnv"]

    spec = only(render(chart, {"job": {"ttlSecondsAfterFinished": 60, "backoffLimit": 5, "activeDeadlineSeconds": 86400}}), "RayJob")["spec"]
    assert (spec["ttlSecondsAfterFinished"], spec["backoffLimit"], spec["activeDeadlineSeconds"]) == (60, 5, 86400)

    # Without shutdown KubeRay rejects a TTL, so none is rendered.
    spec = only(render(chart, {"job": {"shutdownAfterJobFinishes": False}}), "RayJob")["spec"]
    assert spec["shutdownAfterJobFinishes"] is False and "ttlSecondsAfterFinished" not in spec


def test_gpu_worker_group_follows_values(chart) -> None:
    overrides = combined(CASES["16-stages-on-2-to-4-nodes"], CASES["tolerations-and-node-selectors"])
    values = chart.merge_values(overrides)
    cluster = only(render(chart, overrides), "RayJob")["spec"]["rayClusterSpec"]
    assert cluster["enableInTreeAutoscaling"] is True
    assert cluster["autoscalerOptions"]["idleTimeoutSeconds"] == values["autoscaling"]["idleTimeoutSeconds"]
    (group,) = cluster["workerGroupSpecs"]
    assert (group["groupName"], group["replicas"], group["minReplicas"], group["maxReplicas"]) == ("gpu", 2, 2, 4)
    pod = group["template"]["spec"]
    assert pod["tolerations"] == values["gpuWorkers"]["tolerations"]
    assert pod["nodeSelector"] == {"node.kubernetes.io/instance-type": "p5.48xlarge"}
    (container,) = pod["containers"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 8
    assert container["image"] == f"{values['image']['repository']}:0.1.0"
    head = cluster["headGroupSpec"]
    assert head["rayStartParams"] == {"num-cpus": "0"}  # KubeRay wants strings
    assert head["template"]["spec"]["nodeSelector"] == {"pool": "cpu"}
    assert "tolerations" not in head["template"]["spec"]


def test_autoscaler_can_be_turned_off(chart) -> None:
    cluster = only(render(chart, {"autoscaling": {"enabled": False}}), "RayJob")["spec"]["rayClusterSpec"]
    assert cluster["enableInTreeAutoscaling"] is False
    assert "autoscalerOptions" not in cluster


def test_every_ray_pod_gets_a_memory_backed_dev_shm(chart) -> None:
    for pod in pod_specs(render(chart))[:2]:  # head and GPU workers
        (mount,) = [m for m in pod["containers"][0]["volumeMounts"] if m["mountPath"] == "/dev/shm"]
        (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
        assert volume["emptyDir"]["medium"] == "Memory"


def test_standalone_raycluster_runs_the_job_and_matches_the_embedded_spec(chart) -> None:
    embedded = only(render(chart), "RayJob")["spec"]["rayClusterSpec"]
    manifests = render(chart, {"rayCluster": {"enabled": True}})
    raycluster, rayjob = only(manifests, "RayCluster"), only(manifests, "RayJob")
    assert raycluster["spec"] == embedded
    assert rayjob["spec"]["clusterSelector"] == {"ray.io/cluster": raycluster["metadata"]["name"]}
    assert "rayClusterSpec" not in rayjob["spec"]
    assert rayjob["spec"]["shutdownAfterJobFinishes"] is False
    assert "ttlSecondsAfterFinished" not in rayjob["spec"]


def test_names_fit_kuberay_limits_for_long_release_names(chart) -> None:
    manifests = render(chart, {"rayCluster": {"enabled": True}}, name="a-very-long-release-name-for-a-training-run-of-llama")
    for manifest in manifests["RayJob"] + manifests["RayCluster"]:
        assert kuberay_spec_errors(manifest) == []


# --------------------------------------------------------------------------- monitoring


def test_podmonitor_scrapes_the_raypipe_exporter_on_the_head(chart) -> None:
    manifests = render(chart, {"training": {"metricsPort": 9123}})
    monitor = only(manifests, "PodMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert [e["port"] for e in monitor["spec"]["podMetricsEndpoints"]] == [METRICS_PORT_NAME, "metrics"]
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": [NAMESPACE]}

    cluster = ray_clusters(manifests)[0]
    head_pod = cluster["headGroupSpec"]["template"]
    ports = {p["name"]: p["containerPort"] for p in head_container(cluster)["ports"]}
    assert ports[METRICS_PORT_NAME] == 9123
    _, flags = entrypoint_flags(only(manifests, "RayJob"))
    assert flags["--metrics-port"] == ["9123"] and flags["--metrics-host"] == ["0.0.0.0"]
    # The selector picks the head pod (and workers, for Ray's own metrics).
    selector = monitor["spec"]["selector"]["matchLabels"]
    for pod in [head_pod] + [g["template"] for g in cluster["workerGroupSpecs"]]:
        assert selector.items() <= pod["metadata"]["labels"].items()
        assert "metrics" in {p["name"] for p in pod["spec"]["containers"][0]["ports"]}


def test_podmonitor_options(chart) -> None:
    assert "PodMonitor" not in render(chart, {"podMonitor": {"enabled": False}})
    monitor = only(render(chart, {"podMonitor": {"rayMetrics": False, "labels": {"release": "kube-prometheus-stack"}}}), "PodMonitor")
    assert [e["port"] for e in monitor["spec"]["podMetricsEndpoints"]] == [METRICS_PORT_NAME]
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"


def test_grafana_dashboard_configmap_ships_the_dashboard_json(chart) -> None:
    configmap = only(render(chart, {"grafanaDashboard": {"namespace": "monitoring"}}), "ConfigMap")
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert configmap["metadata"]["namespace"] == "monitoring"
    (text,) = configmap["data"].values()
    dashboard = json.loads(text)
    assert dashboard == json.loads((CHART_DIR / "dashboards" / "raypipe.json").read_text())
    queries = [t["expr"] for panel in dashboard["panels"] for t in panel.get("targets", [])]
    assert queries and all("raypipe_" in q for q in queries)
    (replicas,) = [panel for panel in dashboard["panels"] if panel["title"] == "Replicas"]
    assert [t["expr"] for t in replicas["targets"]] == [
        "raypipe_replicas", "sum by (direction) (increase(raypipe_resizes_total[$__rate_interval]))"]
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(set(ids)) == len(ids)
    assert "ConfigMap" not in render(chart, {"grafanaDashboard": {"enabled": False}})


# --------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    ("values", "error", "message"),
    [
        pytest.param({"training": {"stages": 0}}, helm_python.HelmValuesError, "/training/stages", id="zero-stages"),
        pytest.param({"training": {"preset": "70b"}}, helm_python.HelmValuesError, "/training/preset", id="unknown-preset"),
        pytest.param({"gpuWorker": {"replicas": 2}}, helm_python.HelmValuesError, "'gpuWorker' not allowed", id="misspelt-key"),
        pytest.param({"image": {"tag": 1.10}}, helm_python.HelmValuesError, "/image/tag", id="unquoted-numeric-tag"),
        pytest.param({"training": {"dataPath": "s3://b/x; rm -rf /"}}, helm_python.HelmValuesError, "/training/dataPath", id="shell-in-path"),
        pytest.param(
            {"gpuWorkers": {"replicas": 3, "minReplicas": 1, "maxReplicas": 2}}, helm_python.HelmRenderError,
            "need minReplicas <= replicas <= maxReplicas, got minReplicas=1 replicas=3 maxReplicas=2",
            id="replicas-above-max",
        ),
        pytest.param(
            {"gpuWorkers": {"minReplicas": 2}}, helm_python.HelmRenderError,
            "need minReplicas <= replicas <= maxReplicas, got minReplicas=2 replicas=2 maxReplicas=1 (unset ones "
            "follow training.stages x training.replicas)", id="min-pods-above-the-computed-max",
        ),
        pytest.param(
            {"training": {"stages": 24}, "gpuWorkers": {"maxReplicas": 2}}, helm_python.HelmRenderError,
            "training.stages=24 x training.replicas=1 needs 24 GPUs, but gpuWorkers.maxReplicas=2 pods x 8 GPUs",
            id="more-stages-than-gpus",
        ),
        pytest.param(
            {"training": {"stages": 4, "tensorParallel": 8}, "gpuWorkers": {"maxReplicas": 2}},
            helm_python.HelmRenderError,
            "training.stages=4 x training.tensorParallel=8 x training.replicas=1 needs 32 GPUs, but "
            "gpuWorkers.maxReplicas=2 pods x 8 GPUs", id="more-tensor-parallel-stages-than-gpus",
        ),
        pytest.param(
            {"training": {"tensorParallel": 16}}, helm_python.HelmRenderError,
            "training.tensorParallel=16 keeps a stage's workers on one pod, but a pod has 8 GPUs",
            id="tensor-parallel-beyond-a-pod",
        ),
        pytest.param(
            {"training": {"stages": 8, "replicas": 3}, "gpuWorkers": {"maxReplicas": 2}}, helm_python.HelmRenderError,
            "training.stages=8 x training.replicas=3 needs 24 GPUs, but gpuWorkers.maxReplicas=2 pods x 8 GPUs",
            id="more-replicas-than-gpus",
        ),
        pytest.param(
            {"training": {"replicas": {"min": 1, "max": 3}}, "gpuWorkers": {"maxReplicas": 2}},
            helm_python.HelmRenderError,
            "training.stages=8 x training.replicas.max=3 needs 24 GPUs, but gpuWorkers.maxReplicas=2 pods x 8 GPUs",
            id="elastic-max-above-the-pods",
        ),
        pytest.param(
            {"training": {"replicas": {"min": 3, "max": 2}}}, helm_python.HelmRenderError,
            "training.replicas: min=3 is above max=2", id="elastic-min-above-max",
        ),
        pytest.param({"training": {"replicas": {"min": 1}}}, helm_python.HelmValuesError, "missing property 'max'",
                     id="elastic-without-max"),
        pytest.param({"training": {"replicas": {"min": 0, "max": 2}}}, helm_python.HelmValuesError,
                     "/training/replicas", id="elastic-min-zero"),
        pytest.param({"training": {"replicas": "1:2"}}, helm_python.HelmValuesError, "/training/replicas",
                     id="replicas-as-a-flag-string"),
        pytest.param(
            combined(CASES["tiny-on-cpu-without-autoscaler"],
                     {"gpuWorkers": {"resources": {"requests": {"cpu": "500m"}, "limits": {"cpu": "500m"}}}}),
            helm_python.HelmRenderError, "gpuWorkers: a worker pod holds no pipeline stage (training.preset=tiny: a "
            "stage per whole CPU, none in gpuWorkers.resources), so its minReplicas and maxReplicas cannot follow "
            "training.replicas; set them", id="pods-of-half-a-cpu",
        ),
        pytest.param({"training": {"replicas": 0}}, helm_python.HelmValuesError, "/training/replicas",
                     id="zero-replicas"),
        pytest.param(
            {"gpuWorkers": {"resources": {"limits": {"nvidia.com/gpu": None}}}}, helm_python.HelmRenderError,
            "has no nvidia.com/gpu", id="7b-without-gpus",
        ),
        pytest.param(
            {"job": {"enabled": False}}, helm_python.HelmRenderError, "nothing to deploy", id="nothing-enabled",
        ),
        pytest.param(
            {"rayCluster": {"enabled": True}, "job": {"submissionMode": "SidecarMode"}}, helm_python.HelmRenderError,
            "SidecarMode cannot run on the standalone RayCluster", id="sidecar-on-standalone",
        ),
        pytest.param(
            {"training": {"resume": False}}, helm_python.HelmRenderError,
            "job.backoffLimit=2 reruns a failed job, which must resume from its checkpoints",
            id="reruns-without-resume",
        ),
        pytest.param(
            {"training": {"checkpointDir": "/home/ray/ckpt"}}, helm_python.HelmRenderError,
            "training.checkpointDir=/home/ray/ckpt is on the head pod's own disk",
            id="reruns-lose-a-local-checkpoint-dir",
        ),
        pytest.param(
            {"training": {"checkpointDir": "/mnt/ckpt-other/x"},
             "volumeMounts": [{"name": "c", "mountPath": "/mnt/ckpt"}], "volumes": [{"name": "c", "emptyDir": {}}]},
            helm_python.HelmRenderError, "training.checkpointDir=/mnt/ckpt-other/x is on the head pod's own disk",
            id="checkpoint-dir-beside-the-mount",
        ),
        pytest.param({"training": {"checkpointEvery": -1}}, helm_python.HelmValuesError, "/training/checkpointEvery",
                     id="negative-checkpoint-cadence"),
        pytest.param({"head": {"nodeHealthCheck": {"periodMs": 0}}}, helm_python.HelmValuesError,
                     "/head/nodeHealthCheck/periodMs", id="zero-health-check-period"),
        pytest.param({"workerKillGraceMs": -1}, helm_python.HelmValuesError, "/workerKillGraceMs",
                     id="negative-worker-kill-grace"),
    ],
)
def test_bad_values_fail_with_a_message_naming_them(chart, values, error, message) -> None:
    with pytest.raises(error, match=re.escape(message)):
        chart.render(values=values, name=RELEASE, namespace=NAMESPACE)


# A broken manifest must fail the CRD validation, or the checks above prove nothing.
def _misspell_max_replicas(job: dict) -> None:
    group = job["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]
    group["maxReplica"] = group.pop("maxReplicas")


def _integer_ray_start_param(job: dict) -> None:
    job["spec"]["rayClusterSpec"]["headGroupSpec"]["rayStartParams"] = {"num-cpus": 0}


def _string_backoff_limit(job: dict) -> None:
    job["spec"]["backoffLimit"] = "2"


def _unknown_container_field(job: dict) -> None:
    job["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["securityContxt"] = {}


def _bad_resource_quantity(job: dict) -> None:
    job["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]["resources"]["limits"]["memory"] = "lots"


@pytest.mark.parametrize(
    ("break_manifest", "where"),
    [
        pytest.param(_misspell_max_replicas, "spec/rayClusterSpec/workerGroupSpecs/0", id="misspelt-maxReplicas"),
        pytest.param(_integer_ray_start_param, "spec/rayClusterSpec/headGroupSpec/rayStartParams/num-cpus", id="integer-rayStartParams"),
        pytest.param(_string_backoff_limit, "spec/backoffLimit", id="string-backoffLimit"),
        pytest.param(_unknown_container_field, "spec/rayClusterSpec/headGroupSpec/template/spec/containers/0", id="unknown-field"),
        pytest.param(_bad_resource_quantity, "containers/0/resources/limits/memory", id="bad-quantity"),
    ],
)
def test_crd_validation_rejects_a_broken_rayjob(chart, break_manifest, where: str) -> None:
    rayjob = copy.deepcopy(only(render(chart), "RayJob"))
    break_manifest(rayjob)
    errors = crd_errors(rayjob)
    assert errors and any(where in error for error in errors), errors


def test_entrypoint_passes_the_boundary_shapes(chart) -> None:
    _command, flags = entrypoint_flags(only(render(chart, {}), "RayJob"))
    assert "--boundary-shapes" not in flags  # the default, "learned", is train_7b.py's default too
    _command, flags = entrypoint_flags(only(render(chart, {"training": {"boundaryShapes": "headers"}}), "RayJob"))
    assert flags["--boundary-shapes"] == ["headers"]
    schema = json.loads((CHART_DIR / "values.schema.json").read_text())
    assert schema["properties"]["training"]["properties"]["boundaryShapes"]["enum"] == list(BOUNDARY_SHAPES)
    report = helm_python.lint(CHART_DIR, {"training": {"boundaryShapes": "static"}}, strict=True, namespace=NAMESPACE)
    assert any("/training/boundaryShapes" in error for error in report["errors"]), report["errors"]
