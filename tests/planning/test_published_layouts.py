"""``raypipe plan --published`` (no Ray, no torch): every published row predicted at its own layout,
within 20% or with its reason stated; the fixed-layout prediction is the search's own for that
candidate; the flop counts the conversion uses, by hand; the flag's errors."""
from __future__ import annotations

import contextlib
import io
import json

import pytest

from raypipe.models.llama import get_config
from raypipe.models.llama_costs import llama_layer_cost
from raypipe.planning.cluster_spec import load_cluster
from raypipe.planning.configuration_search import predict_llama_layout, search_plans
from raypipe.planning.plan import main as plan_main
from raypipe.planning.predict import StepShape
from raypipe.planning.published_layouts import (PUBLISHED_LAYOUTS, TOLERANCE, gpt_as_llama, megatron_flops_per_token,
                                                published_tokens_per_s_per_gpu, render_published_plan)


@pytest.fixture(scope="module")
def published() -> dict:
    """``raypipe plan --published --json``, run once for the module."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert plan_main(["--published", "--json"]) == 0
    return json.loads(out.getvalue())


def test_every_row_agrees_or_states_its_reason(published):
    rows = published["rows"]
    assert published["published_on"] == "h100" and published["tolerance"] == TOLERANCE
    assert [row["name"] for row in rows] == [row.name for row in PUBLISHED_LAYOUTS]
    assert len({row["name"] for row in rows}) == len(rows)
    for row, data in zip(rows, PUBLISHED_LAYOUTS):
        assert row["url"].startswith("https://"), row["name"]
        assert row["published_tokens_per_s_per_gpu"] == pytest.approx(published_tokens_per_s_per_gpu(data))
        assert row["published_tokens_per_s_per_gpu"] > 0
        if row["layout"] is None:  # not expressible: said why, nothing predicted
            assert row["reason"].startswith("not expressible"), row["name"]
            assert row["predicted_tokens_per_s_per_gpu"] is None and row["within_tolerance"] is None
            continue
        layout = row["layout"]
        assert layout["replicas"] * layout["stages"] * layout["tensor_parallel"] == data.gpus
        assert layout["replicas"] * layout["micro_batches"] * layout["micro_batch_size"] == data.global_batch
        assert layout["tensor_parallel"] == data.tensor_parallel and layout["stages"] == data.pipeline_parallel
        predicted, measured = row["predicted_tokens_per_s_per_gpu"], row["published_tokens_per_s_per_gpu"]
        assert row["ratio"] == pytest.approx(predicted / measured)
        if row["precision"] == "bf16":
            assert row["within_tolerance"] == (abs(row["ratio"] - 1) <= TOLERANCE)
            assert row["within_tolerance"] or row["reason"], f"{row['name']}: off by {row['ratio']:.2f}, no reason"
        else:
            assert row["within_tolerance"] is None and row["reason"], row["name"]
    # the acceptance's rows: the Llama 3 paper's TP 8 x PP 16 bf16 runs agree
    assert all(row["within_tolerance"] for row in rows if row["name"].startswith("llama3-405b-") and row["layout"])


def test_the_overlap_reason_is_borne_out(published):
    """The rows whose reason is Megatron-LM's overlap agree once the what-if hides that communication."""
    blamed = [row for row in published["rows"] if "--tp-comm-overlap" in row["reason"]]
    assert blamed
    for row in blamed:
        assert row["within_tolerance"] is False
        assert abs(row["hidden_communication_ratio"] - 1) <= TOLERANCE, row["name"]


def test_text_table_names_every_row(published):
    text = render_published_plan(published)
    lines = text.splitlines()
    for row in published["rows"]:
        assert any(line.startswith(row["name"] + " ") for line in lines), row["name"]
        assert f"{row['name']}: {row['source']}, {row['url']}" in text
    assert "not expressible" in text and "reason:" in text


def test_fixed_layout_prediction_is_the_searchs():
    """predict_llama_layout of the search's best candidate (split by time) is that candidate's prediction."""
    config, cluster = get_config("llama-1b"), load_cluster("h100")
    result = search_plans(config, cluster, 8, seq_len=2048, global_batch=16, top=1, snapshot_every=0)
    best = result.best[0]
    assert best.balance_mode == "time"
    again = predict_llama_layout(config, cluster, best.shape)
    assert again.step_s == pytest.approx(best.prediction.step_s, rel=1e-12)
    assert again.balance == best.prediction.balance and again.fits


def test_hidden_collectives_what_if():
    config, cluster = get_config("llama3-8b"), load_cluster("h100")
    one = StepShape(2, 2, 4, "1f1b", "never", "bf16", True, 1, 4096, None, 0, 1, 1, None)
    assert predict_llama_layout(config, cluster, one, hide_tensor_parallel_collectives=True).step_s == \
        predict_llama_layout(config, cluster, one).step_s  # nothing to hide at t = 1
    eight = StepShape(1, 2, 4, "1f1b", "never", "bf16", False, 1, 4096, None, 0, 1, 8, None)
    assert predict_llama_layout(config, cluster, eight, hide_tensor_parallel_collectives=True).step_s < \
        predict_llama_layout(config, cluster, eight).step_s
    with pytest.raises(ValueError, match="tensor_parallel=3"):
        predict_llama_layout(config, cluster, StepShape(1, 2, 4, tensor_parallel=3, seq_len=4096))


def test_flop_counts_by_hand():
    h, layers, seq, vocab = 8192, 84, 4096, 131072
    assert megatron_flops_per_token(gpt_as_llama(h, 64, layers), seq) == \
        72 * layers * h * h + 12 * layers * h * seq + 6 * h * vocab
    # the GPT's stand-in has its matmul flops: 24 h^2 a token forward (4h^2 attention, 2 x 4h^2 MLP)
    block = llama_layer_cost(gpt_as_llama(h, 64, layers), "block", seq, "bf16")
    assert block.bwd_weight_flops / seq == pytest.approx(24 * h * h, rel=1e-3)


def test_published_flag_errors(capsys):
    assert plan_main(["--published", "--gpus", "8"]) == 2
    assert "--published predicts the published runs' own layouts: it takes no --gpus" in capsys.readouterr().err
