"""Lost nodes: a worker is replaced on a spare node bitwise (with Ray's default
health checks: its replacement first dies in the lost node's bundle), a run with
no room for a replacement shrinks and grows back when a node is added (ZeRO-1,
its optimizer shards moved each time), and a
pipeline with no room for a stage goes on with fewer stages and back to its own
when a node is added (a new worker killed during that swap in place is healed); at
t = 2, a node lost with a whole tensor-parallel stage (both its ranks) is healed on a
spare node bitwise, and an elastic run shrinks and grows by whole replicas of such stages.

The elastic, re-partitioning and tensor-parallel runs share one multi-node
``ray.cluster_utils.Cluster`` with shortened health checks, run once in a subprocess
(lost_nodes_run.py: elastic_run.py, repartition_run.py, tp_node_loss_run.py and
tp_elastic_run.py in turn);
the node loss runs in a cluster of its own with Ray's default ones (node_loss_run.py;
the run without the loss it is compared with bitwise is the step runner's, in this process),
beside the shared cluster's runs: most of its time is a wait for Ray to declare the node dead.
Each test checks its part."""
import pytest
import torch

from raypipe.models.llama import llama_layers, llama_loss
from tests.executor import node_loss_run, tp_elastic_run, tp_node_loss_run
from tests.executor.cluster_run import Subprocess
from tests.executor.tp_kills_run import adamw, batches, one_process
from tests.gloo_pipeline import uninterrupted_run
from tests.reference import assert_mlp_run_matches_one_process


# the shared cluster's four runs take minutes, more on a loaded machine: past pytest's own 600 s, and the
# subprocess's limit below this one, so that a run cut short reports what it printed
pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def node_loss_started(tmp_path_factory):
    """node_loss_run.py, started: it waits ~15-30 s with both cores idle for Ray's default health
    checks to declare the lost node dead, so it runs beside the shared cluster's runs when both are
    to run (in its own cluster: the two share no process, port or setting)."""
    run = Subprocess("tests.executor.node_loss_run", tmp_path_factory.mktemp("node_loss") / "node_loss.json",
                     timeout_s=600)
    yield run
    run.stop()


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory):
    if any("node_loss" in item.fixturenames for item in request.session.items):
        request.getfixturevalue("node_loss_started")  # its idle wait overlaps these runs
    run = Subprocess("tests.executor.lost_nodes_run", tmp_path_factory.mktemp("lost_nodes") / "lost_nodes.json",
                     timeout_s=840)
    try:
        return run.result()
    finally:
        run.stop()


@pytest.fixture(scope="module")
def node_loss(node_loss_started):
    return node_loss_started.result()


@pytest.mark.cluster
def test_a_lost_node_shrinks_the_run_and_a_new_one_grows_it_back_resharding_zero1_losing_no_state(runs):
    """ZeRO-1, the harder case of the two optimizer layouts: a replicated run's shrink and grow
    are the same decisions and moves without the shards (their decisions: tests/control/test_policy.py)."""
    run = runs["elastic_zero1"]
    replicas = run["num_replicas"]
    assert run["replicas_at_start"] == 2 and replicas[:2] == [2, 2]
    assert replicas[2] == 1 and run["recovered"][2]  # the lost node's step returned, on one replica
    assert replicas[3] == 1 and replicas[-3:] == [2, 2, 2]  # ... and the added node brought the second back
    assert [direction for _, direction, _ in run["resizes"]] == ["shrink", "grow"]
    assert len(run["failures"]) == 1  # the shrink is one failure event
    assert sorted(run["nodes_at_end"]) != sorted(run["nodes_at_start"])
    # the lost worker's optimizer part came from its snapshot (the keeper's copy: its node is gone)
    assert len(run["sources"]) == 1 and run["sources"][0].endswith("resharded"), run["sources"]
    # AdamW's moments carried over every resize: a lost part would restart them and miss the reference
    assert_mlp_run_matches_one_process(run["losses"], run["state"], 12, 4, clip_grad_norm=0.5)
    for step, row in enumerate(run["optimizer_bytes"]):
        held = {(replica, stage): count for replica, stage, count in row}
        for stage in range(2):  # each parameter's moments on one replica at every size
            parts = [held[replica, stage] for replica in range(replicas[step])]
            assert sum(parts) == run["optimizer_bytes"][2][stage][2] and all(part > 0 for part in parts), step
    print(f"node loss to the step done on 1 replica: {run['shrink_seconds']:.1f} s; node added to the first step "
          f"on 2 replicas: {run['grow_seconds']:.1f} s")


@pytest.mark.cluster
def test_a_lost_node_is_replaced_on_a_spare_one_bitwise_after_its_replacement_died_in_the_lost_bundle(node_loss):
    """Ray's default health checks: the node is declared dead ~15-30 s after it went, and
    until then its placement-group bundle is still placed there."""
    uninterrupted, lost = node_loss_run.uninterrupted(), node_loss["lost"]
    stage0, stage1 = lost["nodes_before"]
    assert stage0 != stage1 and node_loss["head"] not in (stage0, stage1)  # a stage per worker node
    assert stage1 not in node_loss["alive_nodes"]  # the node is gone ...
    assert lost["nodes_after"][0] == stage0  # ... stage 0 stayed where it was ...
    assert lost["nodes_after"][1] not in (stage0, stage1, node_loss["head"])  # ... stage 1 moved to a spare node
    assert len(lost["failures"]) == 1 and "replica 0 stage 1" in lost["failures"][0], lost["failures"]
    # the replacement started into the lost node's bundle died as it started, and was started again: one heal
    died = [line for line in lost["warnings"] if "a replacement died while it started" in line]
    assert died, lost["warnings"]
    # the keeper never copied step 1's snapshot, so step 2's was not taken (a new one waits for the
    # copy of the one before) and the keeper's copy of step 0's was still there to heal from
    assert lost["healed_from"] == [["snapshot of step 0", 2]], lost["healed_from"]
    assert lost["losses"] == uninterrupted["losses"]  # no step lost, none redone differently
    assert lost["state"] == uninterrupted["state"]  # bitwise (floats compared exactly)
    print(f"node loss to step done: {lost['seconds']:.1f} s")


@pytest.mark.cluster
def test_a_pipeline_with_no_room_for_a_stage_goes_on_with_fewer_stages_and_back_when_there_is_room(runs):
    """... even when a new worker is killed during the swap back in place."""
    run = runs["repartition"]
    assert run["balance_at_start"] == [3, 4] and run["replicas_at_start"] == 1  # the second replica asked for
    assert run["balance_before_nodes_added"] == [7]
    stages, replicas = run["stages"], run["num_replicas"]
    assert stages[:2] == [2, 2] and stages[2:4] == [1, 1]  # re-partitioned at the lost node's step
    back = stages.index(2, 2)
    # back on two stages once the node was added (before step 4), and there to the end: two 1-CPU nodes had
    # room for them only in place of the one stage (snapshotted, stopped, its layers adopted)
    assert back >= 4 and stages[back:] == [2] * (len(stages) - back)
    grown = replicas.index(2)
    assert grown > back and replicas[grown:] == [2, 2, 2]  # then the elastic run grows again
    assert run["balance_at_end"] == [3, 4] and run["workers_at_end"] == [[0, 0], [0, 1], [1, 0], [1, 1]]
    # no step lost, none redone; the heal at the swap in place is the step's own
    assert run["recovered"] == [step in (2, back) for step in range(len(stages))]
    assert run["resizes"] == [[2, "repartition", 1], [back, "restore", 1], [grown, "grow", 2]]
    for direction in ("repartition", "restore", "grow"):
        assert f'raypipe_resizes_total{{direction="{direction}"}} 1.0' in run["metrics"]
    assert len(run["sources"]) == 2 and "re-partitioned onto 1 stage(s)" in run["sources"][0]
    # the new stage 1, SIGKILLed in the swap in place before it adopted the snapshot: healed in the swap, from
    # the snapshot the swap took (no step to replay), never a raw Ray error
    assert run["sources"][1] == f"snapshot of step {back}" and run["killed_in_place"] not in run["pids_at_end"]
    assert len(run["failures"]) == 2 and f"step {back}: replica 0 stage 1 died" in run["failures"][1], run["failures"]
    # the weights and AdamW's moments went 2 stages -> 1 -> 2 -> 2 replicas: a lost part would miss the reference
    assert_mlp_run_matches_one_process(run["losses"], run["state"], 8, 4, clip_grad_norm=0.5)
    print(f"node added to the first step on the configured stages: {run['return_seconds']:.1f} s")


@pytest.mark.cluster
def test_a_lost_node_taking_a_whole_tensor_parallel_stage_is_healed_on_a_spare_one_bitwise(runs):
    """(1, 2, 2), a stage's two workers in one bundle, so on one node: the node of stage 1 lost with
    both its ranks, the stage is replaced on the spare node, each new rank restoring its lost
    one's snapshot (the keeper's copy), and the run goes on bitwise the run without the loss (the
    same workers in processes over gloo)."""
    run = runs["tp_node_loss"]
    stage0, stage0_too, stage1, stage1_too = run["nodes_before"]
    assert stage0 == stage0_too and stage1 == stage1_too and stage0 != stage1  # a stage's ranks on one node
    assert stage1 not in run["alive_tensor_parallel_nodes"]  # the node is gone ...
    assert run["nodes_after"][:2] == [stage0] * 2  # ... stage 0 stayed where it was ...
    spare = run["nodes_after"][2]
    assert run["nodes_after"][3] == spare and spare not in (stage0, stage1)  # ... stage 1 moved to the spare node
    assert spare in run["alive_tensor_parallel_nodes"]
    assert not set(run["lost_pids"]) & set(run["pids_after"])
    lost_at = tp_node_loss_run.LOST_AT
    assert run["recovered"] == [step == lost_at for step in range(tp_node_loss_run.STEPS)]
    assert run["failures"] and all(failure.startswith(f"step {lost_at}: ") and "replica 0 stage 1 tp_rank" in failure
                                   for failure in run["failures"]), run["failures"]
    steps, state = uninterrupted_run(llama_layers("tiny"), llama_loss, adamw, tp_node_loss_run.config(),
                                     batches(tp_node_loss_run.STEPS))
    assert run["steps"] == steps  # no step lost, none redone differently
    assert run["state"] == state  # bitwise (floats compared exactly)
    print(f"node loss with a tensor-parallel stage to step done: {run['seconds']:.1f} s; healed from "
          f"{run['sources']}; {run['failures']}")


@pytest.mark.cluster
def test_an_elastic_run_at_t2_shrinks_by_a_whole_replica_when_a_node_goes_and_grows_back_as_one_process(runs):
    """(2, 2, 2) -> (1, 2, 2) -> (2, 2, 2): a stage's two ranks on one node, that node lost with no
    room to replace them drops its replica (every survivor's state moved onto the smaller layout's
    meshes), and a node added brings the replica back; every step equals one process within 1e-4."""
    run = runs["tp_elastic"]
    replicas = run["num_replicas"]
    assert run["replicas_at_start"] == 2 and replicas[:2] == [2, 2]
    lost_at = tp_elastic_run.LOST_AT
    assert replicas[lost_at] == 1 and run["recovered"][lost_at]  # the lost node's step returned, on one replica
    assert replicas[lost_at + 1] == 1 and replicas[-3:] == [2, 2, 2]  # ... and the added node brought it back
    assert [direction for _, direction, _ in run["resizes"]] == ["shrink", "grow"]
    assert len(run["failures"]) == 1  # the shrink is one failure event: both ranks of the stage
    assert all(f"replica 1 stage 1 tp_rank {tp_rank} died" in run["failures"][0] for tp_rank in range(2))
    assert run["workers_at_end"] == [[r, s, t] for r in range(2) for s in range(2) for t in range(2)]
    nodes = run["nodes_at_end"]
    assert all(nodes[rank] == nodes[rank + 1] for rank in range(0, 8, 2))  # each stage on one node
    assert run["lost_node"] in run["nodes_at_start"] and run["lost_node"] not in nodes
    steps, state = one_process(tp_elastic_run.config(), batches(len(replicas)))
    for (loss, norm), (expected_loss, expected_norm) in zip(run["steps"], steps, strict=True):
        assert (loss, norm) == (pytest.approx(expected_loss, rel=1e-4), pytest.approx(expected_norm, rel=1e-4))
    for name, expected in state.items():
        assert float((torch.tensor(run["state"][name]) - expected).norm()) <= 1e-4 * float(expected.norm()), name
