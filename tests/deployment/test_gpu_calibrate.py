"""scripts/gpu_calibrate.py's CPU path: every measurement runs and sits beside the predictor's figure
for the same shapes (the GPU figures themselves come from `scripts/gpu_check.sh --calibrate`)."""
import importlib.util
import json
import math
from pathlib import Path

from raypipe.models.llama import get_config
from raypipe.models.llama_costs import llama_layer_cost
from raypipe.planning.cluster_spec import load_cluster

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu_calibrate.py"


def load_script():
    spec = importlib.util.spec_from_file_location("gpu_calibrate", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_cpu_path_measures_every_op_beside_its_prediction(capsys):
    calibrate = load_script()
    results = calibrate.calibrate(cpu=True, cluster_name="h200")
    shape = results["shape"]
    cluster = load_cluster("h200")
    for kind in ("embedding", "block", "head"):
        cost = llama_layer_cost(get_config("tiny"), kind, shape["seq_len"], shape["precision"])
        for op, flops in (("F", cost.fwd_flops), ("I", cost.bwd_input_flops), ("W", cost.bwd_weight_flops)):
            row = results["layers"][kind][op]
            # the prediction is the predictor's own rule: flops at peak x achievable_fraction
            assert math.isclose(row["predicted_s"], shape["micro_batch_size"] * flops / cluster.flops_per_s("fp32"))
            assert row["measured_s"] >= 0
    assert results["layers"]["embedding"]["I"]["measured_s"] == 0  # token ids: no input gradient
    assert results["layers"]["block"]["I"]["measured_s"] > 0 and results["layers"]["block"]["W"]["measured_s"] > 0
    whole = results["whole_model"]
    assert 0 < whole["mfu"] < whole["predicted_mfu"] == cluster.achievable_fraction
    assert results["host_copy"]["host_to_device_bytes_per_s"] > 0
    calibrate.print_table(results)
    out = capsys.readouterr().out
    assert "block      I" in out and "MFU" in out and "H2D" in out


def test_another_shape_is_predicted_at_its_own_sequence_length_and_layers_can_run_alone(capsys):
    """--seq-len below the model's max_seq_len: the whole model's flops are the shape's (they
    were once the specs' own, at max_seq_len: an 8B at 4096 tokens read an MFU of 1.18)."""
    from raypipe.models.llama_costs import llama_layer_costs

    calibrate = load_script()
    results = calibrate.calibrate(cpu=True, cluster_name="h200", shape={"seq_len": 16})
    assert results["shape"] == {"model": "tiny", "micro_batch_size": 2, "seq_len": 16, "precision": "fp32"}
    flops = 2 * sum(cost.train_flops for cost in llama_layer_costs(get_config("tiny"), 16, "fp32"))
    assert math.isclose(results["whole_model"]["predicted_s"], flops / load_cluster("h200").flops_per_s("fp32"))
    assert results["layers"]["block"]["F"]["host_issue_s"] > 0  # the host's time to issue the forward
    alone = calibrate.calibrate(cpu=True, cluster_name="h200", shape={"seq_len": 16}, whole_model=False)
    assert "whole_model" not in alone and alone["layers"]["block"]["W"]["measured_s"] > 0
    calibrate.print_table(alone)
    assert "whole model: not run (--layers-only)" in capsys.readouterr().out


def assert_refused(main, cases, capsys) -> None:
    """Each ``(argv, named)``: ``main(argv)`` exits 2 with ``named`` on stderr, before anything runs."""
    for argv, named in cases:
        try:
            main(argv)
        except SystemExit as exit_:
            assert exit_.code == 2
        else:
            raise AssertionError(f"{argv} was accepted")
        assert named in capsys.readouterr().err


def test_a_bad_shape_is_named_before_anything_runs(capsys):
    assert_refused(load_script().main, [(["--cpu", "--model", "llama-9b"], "unknown model 'llama-9b'"),
                                        (["--cpu", "--seq-len", "0"], "--seq-len must be at least 1, got 0")], capsys)


def test_the_tensor_parallel_path_times_a_split_block_and_its_collectives_beside_the_model(tmp_path, capsys,
                                                                                          monkeypatch):
    """--cpu --tensor-parallel 2: one block split over two processes over gloo (as a stage splits
    it), each op's slowest rank beside the predictor's flops / t plus the block's collectives on
    the preset's NVLink, and the collectives alone beside the ring model. (Run as the script: its
    ranks are spawned processes, which import the script by its module name: scripts/ on the path.)"""
    from raypipe.planning.tensor_parallel_collectives import collective_seconds, llama_layer_collectives

    monkeypatch.syspath_prepend(str(SCRIPT.parent))  # the spawned ranks get the parent's path
    gpu_calibrate = importlib.import_module("gpu_calibrate")
    out = tmp_path / "calibrate_tp2.json"
    assert gpu_calibrate.main(["--cpu", "--tensor-parallel", "2", "--cluster", "h100", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "block F" in printed and "reduce_scatter" in printed
    results = json.loads(out.read_text())
    shape, cluster = results["shape"], load_cluster("h100")
    cost = llama_layer_cost(get_config("tiny"), "block", shape["seq_len"], shape["precision"])
    block = llama_layer_collectives(get_config("tiny"), shape["seq_len"], "fp32", sequence_parallel=True)[1]
    communicated = {"F": collective_seconds(block.forward, 2, cluster.intra_node, shape["micro_batch_size"]),
                    "I": collective_seconds(block.backward, 2, cluster.intra_node, shape["micro_batch_size"]),
                    "W": 0.0}
    for op, flops in (("F", cost.fwd_flops), ("I", cost.bwd_input_flops), ("W", cost.bwd_weight_flops)):
        row = results["block"][op]
        compute = shape["micro_batch_size"] * flops / cluster.flops_per_s("fp32") / 2
        assert math.isclose(row["predicted_s"], compute + communicated[op]) and row["measured_s"] > 0
    assert set(results["collectives"]) == {"all_gather", "reduce_scatter"}  # sequence parallel: no all-reduce
    hidden = shape["micro_batch_size"] * shape["seq_len"] * get_config("tiny").dim * 4
    for name, row in results["collectives"].items():
        assert row["bytes"] == hidden and row["measured_s"] > 0
        assert math.isclose(row["predicted_s"], cluster.intra_node.ring_seconds(1, hidden, 2))
    assert_refused(gpu_calibrate.main, [
        (["--cpu", "--tensor-parallel", "0"], "--tensor-parallel must be at least 1, got 0"),
        (["--cpu", "--tensor-parallel", "3"], "--seq-len 64 must divide by --tensor-parallel 3")], capsys)
