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
