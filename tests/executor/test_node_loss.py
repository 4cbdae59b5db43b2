"""A lost node costs no step: its worker is replaced on a spare node and the
result is bitwise that of a run without the loss (a multi-node
``ray.cluster_utils.Cluster`` in a subprocess, see node_loss_run.py)."""
from tests.executor.cluster_run import run_in_subprocess


def test_a_lost_node_is_replaced_on_a_spare_one_bitwise(tmp_path):
    result = run_in_subprocess("tests.executor.node_loss_run", tmp_path / "node_loss.json", timeout_s=420)
    uninterrupted, lost = result["uninterrupted"], result["lost"]
    stage0, stage1 = lost["nodes_before"]
    assert stage0 != stage1 and result["head"] not in (stage0, stage1)  # a stage per worker node
    assert stage1 not in result["alive_nodes"]  # the node is gone ...
    assert lost["nodes_after"][0] == stage0  # ... stage 0 stayed where it was ...
    assert lost["nodes_after"][1] not in (stage0, stage1, result["head"])  # ... stage 1 moved to the spare node
    assert len(lost["failures"]) == 1 and "replica 0 stage 1" in lost["failures"][0], lost["failures"]
    # the keeper never copied step 1's snapshot, so step 2's was not taken (a new one waits for the
    # copy of the one before) and the keeper's copy of step 0's was still there to heal from
    assert lost["healed_from"] == [["snapshot of step 0", 2]], lost["healed_from"]
    assert lost["losses"] == uninterrupted["losses"]  # no step lost, none redone differently
    assert lost["state"] == uninterrupted["state"]  # bitwise (floats compared exactly)
    print(f"node loss to step done: {lost['seconds']:.1f} s")
