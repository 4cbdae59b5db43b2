"""Before step 0 every reading worker opens the dataset where it runs, on a real
multi-node cluster (`ray.cluster_utils.Cluster`: a head without CPUs, two 1-CPU
worker nodes, so both stages run on nodes other than the driver's).

How "a path only the driver can open" is made on one machine: the driver runs
in a mount namespace of its own (`unshare --mount`) and mounts a tmpfs there,
on a directory that exists for everyone. Only the driver's process sees what it
writes into that tmpfs, exactly as only the driver's machine sees its local
disk; the raylets and stage workers, started outside the namespace by the
cluster process, see the directory as it is outside. Nothing in raypipe is
told about it. A second dataset is written into the same directory outside
the namespace first: at that path the workers find *a different* dataset than
the driver, like a stale copy on a node's own disk.

The cluster runs in a subprocess of its own, with its own temp directory
(RAY_TMPDIR, so no other `ray.init()` on the machine finds it) and a token of
Ray's token authentication; it is shut down through `Cluster.shutdown`, which
stops its own processes only.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from raypipe.data import prepare
from tests.deployment.ray_head import session_members, stop_session, token_env

REPO = Path(__file__).resolve().parents[2]

CLUSTER = """
import sys
from ray.cluster_utils import Cluster
cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
for _ in range(2):
    cluster.add_node(num_cpus=1, wait=False)
cluster.wait_for_nodes(timeout=300)  # generous: the machine may be busy
print(cluster.address, flush=True)
sys.stdin.read()  # until the test closes stdin
cluster.shutdown()
"""

DRIVER = """
import json, sys
import ray, torch
import raypipe
from raypipe.data import TokenDataset, prepare
from raypipe.errors import DataAccessError
from raypipe.models.layers import build_layer
from raypipe.models.llama import LlamaConfig, llama_layers, llama_loss
from raypipe.run import llama_count_tokens
from tests.reference import adamw, reference_step

address, private = sys.argv[1], sys.argv[2]
MODEL = LlamaConfig(vocab_size=259, dim=32, n_layers=2, n_heads=2, ffn_dim=64, max_seq_len=16)
tokens = prepare(f"{private}/tokens", seq_len=16, max_bytes=40_000, rows_per_shard=64)  # many small shards
stale = prepare(f"{private}/stale", seq_len=16, max_bytes=20_000)  # outside, this path holds another dataset
ray.init(address=address, logging_level="WARNING")
out = {"driver_node": ray.get_runtime_context().get_node_id()}

def splits(path):
    return [TokenDataset(path, split, micro_batch_size=2, num_micro_batches=2) for split in ("train", "validation")]

def failure(trainer, path, **limit):
    train, validation = splits(path)
    try:
        trainer.fit(train, 2, validation=validation, progress=False, **limit)
    except DataAccessError as error:
        return {"type": type(error).__name__, "message": str(error), "path": error.path,
                "steps_run": trainer.step_count}
    return {"type": None}

config = raypipe.PipelineConfig(num_stages=2, num_micro_batches=2)
with raypipe.PipelineTrainer(llama_layers(MODEL), llama_loss, adamw, config,
                             loss_count_fn=llama_count_tokens) as trainer:
    out["worker_nodes"] = [worker.node_id for worker in trainer.workers]
    out["stale"] = failure(trainer, stale)
    out["over_limit"] = failure(trainer, tokens, ship_data_limit_bytes=1000)
    train, validation = splits(tokens)
    results = trainer.fit(train, 3, validation=validation, eval_every=3, progress=False)
    out["losses"] = [r.loss for r in results]
    out["eval_loss"] = results[-1].eval_loss

reference = torch.nn.Sequential(*[build_layer(spec, i, seed=0) for i, spec in enumerate(llama_layers(MODEL))])
optimizer = adamw(reference.parameters())
out["reference_losses"] = [reference_step(reference, optimizer, llama_loss, *train.global_batch(step), 2)[0]
                           for step in range(3)]
with torch.no_grad():
    out["reference_eval_loss"] = llama_loss(reference(validation.global_batch(0)[0]),
                                            validation.global_batch(0)[1]).item()
print("RESULT " + json.dumps(out), flush=True)
"""


def _namespace_prefix() -> list[str]:
    """`unshare` into a mount namespace of its own (through a user namespace when not root)."""
    prefix = ["unshare", "--mount", "--propagation", "private"]
    if os.geteuid() != 0:
        prefix[1:1] = ["--user", "--map-root-user"]
    # a requirement, not an option: without its own disk the driver cannot be told apart from the workers
    available = shutil.which("unshare") is not None and subprocess.run([*prefix, "true"], capture_output=True
                                                                        ).returncode == 0
    assert available, ("this test needs mount namespaces (`unshare --mount`, util-linux; root or user namespaces) "
                       "to give the driver a disk only it can see")
    return prefix


@pytest.fixture
def cluster_address(tmp_path):
    temp_dir = tempfile.mkdtemp(prefix="rpd-", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    env = token_env(RAY_TMPDIR=temp_dir)
    process = subprocess.Popen([sys.executable, "-c", CLUSTER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               stderr=open(tmp_path / "cluster.log", "w"), text=True, env=env, cwd=REPO,
                               start_new_session=True)
    try:
        address = process.stdout.readline().strip()
        assert address, f"the cluster did not start:\n{(tmp_path / 'cluster.log').read_text()[-4000:]}"
        yield address, env
    finally:
        process.stdin.close()  # Cluster.shutdown() stops the nodes it started ...
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pass
        stop_session(process)  # ... and anything left in its session goes by pid
        assert session_members(process.pid) == []
        shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.mark.cluster
def test_reading_workers_check_the_dataset_before_step_0_and_get_local_data_shipped(cluster_address, tmp_path):
    prefix = _namespace_prefix()
    address, env = cluster_address
    private = tmp_path / "driver-disk"
    private.mkdir()
    prepare(private / "stale", seq_len=16, max_bytes=10_000)  # what the workers see at the driver's path
    script = 'mount -t tmpfs tmpfs "$1" && exec "$2" -c "$3" "$4" "$1"'
    done = subprocess.run([*prefix, "sh", "-c", script, "sh", str(private), sys.executable, DRIVER, address],
                          env=env, cwd=REPO, capture_output=True, text=True, timeout=400)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, f"stdout:\n{done.stdout[-4000:]}\nstderr:\n{done.stderr[-6000:]}"
    out = json.loads(lines[-1][len("RESULT "):])
    assert out["driver_node"] not in out["worker_nodes"]  # both stages run on other nodes
    assert not (private / "tokens").exists()  # the driver's dataset is invisible outside its namespace

    stale, over = out["stale"], out["over_limit"]
    assert stale["type"] == over["type"] == "DataAccessError"
    assert stale["steps_run"] == over["steps_run"] == 0  # stopped before step 0
    assert stale["path"] == str(private / "stale") and over["path"] == str(private / "tokens")
    # the first stage's problem is named with its node (id and IP) and what to do
    assert f"replica 0, stage 0 on node {out['worker_nodes'][0]} (" in stale["message"]
    assert "reads a different dataset there than the driver" in stale["message"]
    assert f"replica 0, stage 0 on node {out['worker_nodes'][0]} (" in over["message"]
    assert "cannot open it there (FileNotFoundError" in over["message"]
    assert "above ship_data_limit_bytes=1,000" in over["message"]
    assert "s3:// or gs://" in over["message"] and "shared filesystem" in over["message"]

    # under the default limit the shards are shipped: the stages read exactly the driver's rows
    assert out["losses"] == pytest.approx(out["reference_losses"], rel=1e-5)
    assert out["eval_loss"] == pytest.approx(out["reference_eval_loss"], rel=1e-5)
