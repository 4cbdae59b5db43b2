"""scripts/gpu_calibrate.py's CPU path: every measurement runs and sits beside the predictor's figure
for the same shapes (the GPU figures themselves come from `scripts/gpu_check.sh --calibrate`)."""
import importlib.util
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


def test_a_bad_shape_is_named_before_anything_runs(capsys):
    calibrate = load_script()
    for argv, named in ((["--cpu", "--model", "llama-9b"], "unknown model 'llama-9b'"),
                        (["--cpu", "--seq-len", "0"], "--seq-len must be at least 1, got 0")):
        try:
            calibrate.main(argv)
        except SystemExit as exit_:
            assert exit_.code == 2
        else:
            raise AssertionError(f"{argv} was accepted")
        assert named in capsys.readouterr().err
