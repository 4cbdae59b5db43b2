"""The cluster the step-time predictor runs on (:class:`Cluster`), and its loader: a preset
(``planning/clusters/*.json``) or a user's JSON file. Per device the peak flop rate of each
precision, memory, memory bandwidth, host-copy bandwidth (device to host), the bandwidth of a
copy into Ray's object store (``object_store_bytes_per_s``: optional, default
:data:`OBJECT_STORE_BYTES_PER_S`), and an ``achievable_fraction`` of peak that compute reaches; per GPU the link to a GPU on its node (NVLink) and to one on
another node (its NIC), the first also the link a stage's tensor-parallel collectives run on
(a stage's t GPUs share a node); GPUs per node; optionally the fixed overheads a calibration measured
(``op_overhead_s`` per compute op, ``step_overhead_s`` per step; 0 in the presets). No Ray, no torch."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

CLUSTERS_DIR = Path(__file__).resolve().parent / "clusters"
PRESET_CLUSTERS = ("h100", "h200")
OBJECT_STORE_BYTES_PER_S = 10e9
"""A host memcpy into Ray's object store (a task result put by one thread), where a cluster file gives
none: an assumption for a server CPU; the project's 2-core CPU measured ~4.3 GB/s (a 50 MB state put
in 11.7 ms, benchmarks/RESULTS.md, 2026-12-01)."""
_COMPUTE_PRECISION = {"bf16": "bf16", "fp16": "fp16", "fp32": "fp32"}  # raypipe leaves TF32 off: fp32 is fp32

@dataclass(frozen=True)
class Link:
    """A point-to-point path, per GPU: bytes/s one way and the latency of one message."""

    bandwidth_bytes_per_s: float
    latency_s: float

    def seconds(self, num_bytes: float) -> float:
        """Time to move ``num_bytes`` as one message."""
        return self.latency_s + num_bytes / self.bandwidth_bytes_per_s

    def ring_seconds(self, passes: int, num_bytes: float, ranks: int) -> float:
        """Time of ``passes`` ring passes over ``ranks`` ranks of a tensor of ``num_bytes``: each pass
        (a reduce-scatter or an all-gather; an all-reduce is two) moves ``(ranks-1)/ranks`` of it over
        this link in ``ranks - 1`` messages. 0 on one rank."""
        steps = ranks - 1
        return passes * (steps / ranks * num_bytes / self.bandwidth_bytes_per_s + steps * self.latency_s)


@dataclass(frozen=True)
class Cluster:
    """A cluster of identical nodes of ``gpus_per_node`` GPUs (see the module docstring)."""

    name: str
    peak_flops: dict[str, float]  # per precision ("bf16", "fp16", "fp32"; "tf32" for reference)
    memory_bytes: int
    memory_bandwidth_bytes_per_s: float
    gpus_per_node: int
    intra_node: Link
    inter_node: Link
    host_copy_bytes_per_s: float
    achievable_fraction: float  # of peak, for the layers' flops (the MFU ceiling of a busy GPU)
    source: str = ""
    description: str = ""
    object_store_bytes_per_s: float = OBJECT_STORE_BYTES_PER_S  # a snapshot's put (see the module docstring)
    # Measured overheads the flops do not count (0 unless a calibration gives them): the time a
    # worker spends around each compute op (F, B, I, W) outside the op's flops (dispatch,
    # kernel launches, Python), and the fixed time of a step outside its pipeline (the driver's
    # dispatch and commit). benchmarks/bench_predicted_step.py measures both on this machine.
    op_overhead_s: float = 0.0
    step_overhead_s: float = 0.0

    def peak(self, precision: str) -> float:
        """Peak flop/s of ``precision``'s compute (what MFU divides by)."""
        key = _COMPUTE_PRECISION.get(precision, precision)
        if key not in self.peak_flops:
            raise ValueError(f"cluster {self.name!r} gives no peak_flops for {key!r} (it has "
                             f"{sorted(self.peak_flops)})")
        return self.peak_flops[key]

    def flops_per_s(self, precision: str) -> float:
        """The rate the layers' flops run at: peak x achievable_fraction."""
        return self.peak(precision) * self.achievable_fraction

    def node(self, gpu: int) -> int:
        return gpu // self.gpus_per_node

    def link(self, gpu_a: int, gpu_b: int) -> Link:
        """NVLink between GPUs of one node, the inter-node link otherwise."""
        return self.intra_node if self.node(gpu_a) == self.node(gpu_b) else self.inter_node

    def slots_per_node(self, tensor_parallel: int = 1) -> int:
        """Stage slots a node holds: a slot is one stage's ``tensor_parallel`` GPUs, which share a
        node (raypipe's bundle of t GPUs per stage); at t = 1 a slot is a GPU."""
        if not 1 <= tensor_parallel <= self.gpus_per_node:
            raise ValueError(f"tensor_parallel={tensor_parallel} must be in 1..{self.gpus_per_node}: a stage's "
                             f"tensor-parallel ranks share one node of the cluster's {self.gpus_per_node} GPUs")
        return self.gpus_per_node // tensor_parallel

    def slot_link(self, slot_a: int, slot_b: int, tensor_parallel: int = 1) -> Link:
        """The link between tensor-parallel rank i of stage slot ``slot_a`` and rank i of ``slot_b``
        (each pair on its own GPUs' link): NVLink within a node, the inter-node link otherwise."""
        per_node = self.slots_per_node(tensor_parallel)
        return self.intra_node if slot_a // per_node == slot_b // per_node else self.inter_node

    @classmethod
    def from_dict(cls, data: dict, origin: str = "cluster") -> Cluster:
        """A cluster from its JSON form; a missing or bad field raises ValueError naming it."""
        if not isinstance(data, dict):
            raise ValueError(f"{origin}: a cluster is a JSON object, not {type(data).__name__}")

        def number(value: object, name: str, integer: bool = False) -> float:
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 \
                    or not math.isfinite(value) or (integer and value != int(value)):
                raise ValueError(f"{origin}: {name}={value!r} must be a {'whole ' if integer else ''}number > 0")
            return int(value) if integer else float(value)

        def get(name: str) -> object:
            if name not in data:
                raise ValueError(f"{origin}: missing field {name!r} (see raypipe/planning/clusters/h100.json)")
            return data[name]

        def link(name: str) -> Link:
            value = get(name)
            if not isinstance(value, dict) or set(value) != {"bandwidth_bytes_per_s", "latency_s"}:
                raise ValueError(f"{origin}: {name} must be {{\"bandwidth_bytes_per_s\": ..., \"latency_s\": ...}}")
            latency = value["latency_s"]
            if isinstance(latency, bool) or not isinstance(latency, (int, float)) or not 0 <= latency < math.inf:
                raise ValueError(f"{origin}: {name}.latency_s={latency!r} must be a number >= 0")
            return Link(number(value["bandwidth_bytes_per_s"], f"{name}.bandwidth_bytes_per_s"), float(latency))

        peaks = get("peak_flops")
        if not isinstance(peaks, dict) or not peaks:
            raise ValueError(f"{origin}: peak_flops must map precisions (bf16, fp16, fp32) to flop/s")
        fraction = number(get("achievable_fraction"), "achievable_fraction")
        if fraction > 1:
            raise ValueError(f"{origin}: achievable_fraction={fraction!r} must be in (0, 1]")
        known = {"name", "description", "peak_flops", "memory_bytes", "memory_bandwidth_bytes_per_s", "gpus_per_node",
                 "intra_node", "inter_node", "host_copy_bytes_per_s", "achievable_fraction", "source",
                 "op_overhead_s", "step_overhead_s", "object_store_bytes_per_s"}
        overheads = {}
        for name in ("op_overhead_s", "step_overhead_s"):
            value = data.get(name, 0.0)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
                raise ValueError(f"{origin}: {name}={value!r} must be a number >= 0 (seconds)")
            overheads[name] = float(value)
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"{origin}: unknown field(s) {unknown}; a cluster has {sorted(known)}")
        return cls(name=str(data.get("name", origin)),
                   peak_flops={str(key): number(value, f"peak_flops.{key}") for key, value in peaks.items()},
                   memory_bytes=number(get("memory_bytes"), "memory_bytes", integer=True),
                   memory_bandwidth_bytes_per_s=number(get("memory_bandwidth_bytes_per_s"),
                                                       "memory_bandwidth_bytes_per_s"),
                   gpus_per_node=number(get("gpus_per_node"), "gpus_per_node", integer=True),
                   intra_node=link("intra_node"), inter_node=link("inter_node"),
                   host_copy_bytes_per_s=number(get("host_copy_bytes_per_s"), "host_copy_bytes_per_s"),
                   object_store_bytes_per_s=number(data.get("object_store_bytes_per_s", OBJECT_STORE_BYTES_PER_S),
                                                   "object_store_bytes_per_s"),
                   achievable_fraction=fraction, source=str(data.get("source", "")),
                   description=str(data.get("description", "")), **overheads)


def load_cluster(name_or_path: str | Path) -> Cluster:
    """A preset (``"h100"``, ``"h200"``: ``raypipe/planning/clusters/NAME.json``) or a JSON file."""
    text = str(name_or_path)
    path = CLUSTERS_DIR / f"{text}.json" if text in PRESET_CLUSTERS else Path(text)
    if not path.is_file():
        raise ValueError(f"unknown cluster {text!r}: give a preset ({', '.join(PRESET_CLUSTERS)}) or a JSON file "
                         f"like {CLUSTERS_DIR / 'h100.json'}")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"cluster file {path}: not JSON ({error})") from None
    return Cluster.from_dict(data, origin=text if text in PRESET_CLUSTERS else f"cluster file {path}")
