"""The time balancer against brute force over every contiguous partition, its memory limit,
the LLaMA layers' costs, and the balance a trainer resolves (no Ray)."""
from __future__ import annotations

import itertools
import random

import pytest
from torch import nn

from raypipe.config import PipelineConfig
from raypipe.core.partition import partition_by_cost
from raypipe.errors import ConfigError
from raypipe.models.layers import LayerCost, LayerSpec, layer_parameter_count
from raypipe.models.llama import get_config, llama_layers
from raypipe.models.llama_costs import llama_layer_cost, llama_layer_costs
from raypipe.models.llama_memory import stage_input_bytes
from raypipe.planning.balance import (balance_by_time, cost_stage_bytes, layer_step_flops, llama_stage_bytes,
                                      min_max_partition, resolve_balance, stage_times)


def compositions(num_layers: int, num_stages: int):
    """Every split of num_layers into num_stages positive contiguous parts."""
    for cuts in itertools.combinations(range(1, num_layers), num_stages - 1):
        bounds = (0, *cuts, num_layers)
        yield [bounds[i + 1] - bounds[i] for i in range(num_stages)]


def brute_force(times, num_stages, fits=None):
    """The smallest bottleneck over every contiguous split whose stages all fit (None: none fits)."""
    best = None
    for sizes in compositions(len(times), num_stages):
        starts = [sum(sizes[:i]) for i in range(num_stages)]
        if fits is not None and not all(fits(s, starts[s], starts[s] + sizes[s]) for s in range(num_stages)):
            continue
        bottleneck = max(sum(times[a:a + n]) for a, n in zip(starts, sizes))
        best = bottleneck if best is None else min(best, bottleneck)
    return best


def random_costs(rng: random.Random, num_layers: int) -> list[LayerCost]:
    return [LayerCost(rng.randint(0, 50), rng.randint(0, 80), rng.randint(0, 60), saved_bytes=rng.randint(0, 1000),
                      param_bytes=4 * rng.randint(1, 500), output_bytes=rng.randint(1, 200))
            for _ in range(num_layers)]


def test_the_bottleneck_is_brute_forces_on_random_cases() -> None:
    rng = random.Random(0)
    for _ in range(150):
        num_layers = rng.randint(1, 9)
        num_stages = rng.randint(1, num_layers)
        costs = random_costs(rng, num_layers)
        mode = rng.choice(["never", "always", "except_last"])
        micro_batches = rng.randint(1, 4)
        balance = balance_by_time(costs, num_stages, activation_checkpoint=mode, num_micro_batches=micro_batches)
        times = [layer_step_flops(cost, mode, micro_batches) for cost in costs]
        assert len(balance) == num_stages and sum(balance) == num_layers and min(balance) >= 1
        assert max(stage_times(times, balance)) == brute_force(times, num_stages)


def test_the_step_flops_count_the_recomputed_forwards() -> None:
    cost = LayerCost(3, 5, 7)
    assert layer_step_flops(cost) == 15
    assert layer_step_flops(cost, "always", 4) == 4 * 15 + 4 * 3
    assert layer_step_flops(cost, "except_last", 4) == 4 * 15 + 3 * 3


def test_a_memory_limit_is_respected_and_the_bottleneck_is_the_best_that_fits() -> None:
    rng = random.Random(1)
    checked = 0
    for _ in range(150):
        num_layers = rng.randint(2, 8)
        num_stages = rng.randint(1, num_layers)
        costs = random_costs(rng, num_layers)
        schedule = rng.choice(["gpipe", "1f1b"])
        stage_bytes = cost_stage_bytes(costs, num_stages, num_micro_batches=3, schedule=schedule,
                                       activation_checkpoint=rng.choice(["never", "always"]))
        every = [stage_bytes(s, a, a + n) for sizes in compositions(num_layers, num_stages)
                 for s, (a, n) in enumerate(zip([sum(sizes[:i]) for i in range(num_stages)], sizes))]
        limit = rng.randint(min(every), max(every))
        times = [layer_step_flops(cost) for cost in costs]
        optimum = brute_force(times, num_stages, lambda s, a, b: stage_bytes(s, a, b) <= limit)
        if optimum is None:
            with pytest.raises(ConfigError, match="memory_limit_bytes"):
                balance_by_time(costs, num_stages, stage_bytes=stage_bytes, memory_limit_bytes=limit)
            continue
        balance = balance_by_time(costs, num_stages, stage_bytes=stage_bytes, memory_limit_bytes=limit)
        start = 0
        for stage, size in enumerate(balance):
            assert stage_bytes(stage, start, start + size) <= limit
            start += size
        assert max(stage_times(times, balance)) == optimum
        checked += 1
    assert checked > 50


def test_an_infeasible_limit_raises_a_clear_error() -> None:
    costs = [LayerCost(1, 1, 1, param_bytes=4000)] * 4
    stage_bytes = cost_stage_bytes(costs, 2)
    with pytest.raises(ConfigError, match=r"invalid memory_limit_bytes=100: no split of 4 layers into 2 stages"):
        balance_by_time(costs, 2, stage_bytes=stage_bytes, memory_limit_bytes=100)


def test_without_costs_it_is_the_parameter_partitioner() -> None:
    rng = random.Random(2)
    for _ in range(50):
        values = [rng.randint(1, 100) for _ in range(rng.randint(1, 10))]
        stages = rng.randint(1, len(values))
        assert min_max_partition(values, stages) == partition_by_cost(values, stages)


@pytest.mark.parametrize("name", ["tiny", "llama-1b"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_cost_stage_bytes_is_the_llama_memory_model(name: str, precision: str) -> None:
    """The generic memory from LayerCost bytes gives estimate_stage's totals for a LLaMA
    (one sequence per micro-batch), so both share one set of formulas."""
    config = get_config(name)
    shape = {"num_micro_batches": 4, "micro_batch_size": 1, "precision": precision, "schedule": "1f1b",
             "activation_checkpoint": "except_last"}
    generic = cost_stage_bytes(llama_layer_costs(config, None, precision), 3,
                               model_input_bytes=stage_input_bytes(config, 0, 1, config.max_seq_len), **shape)
    exact = llama_stage_bytes(config, 3, seq_len=config.max_seq_len, **shape)
    layers = config.n_layers + 2
    for stage, start in itertools.product(range(3), range(0, layers, 3)):
        for end in range(start + 1, layers + 1, 4):
            assert generic(stage, start, end) == exact(stage, start, end)


def test_llama_costs_from_the_shapes() -> None:
    config = get_config("llama-7b")
    seq = 2048
    block = llama_layer_cost(config, "block", seq, fused_attention=True)
    linear = 2 * seq * (4 * 4096 * 4096 + 3 * 4096 * 11008)  # 2 flops per multiply-add per token
    assert block.bwd_weight_flops == linear
    assert block.fwd_flops == linear + 2 * seq * seq * 4096  # causal half of QK^T and PV
    assert block.bwd_input_flops == linear + 5 * seq * seq * 4096
    unfused = llama_layer_cost(config, "block", seq, fused_attention=False)
    assert unfused.fwd_flops == linear + 4 * seq * seq * 4096
    assert unfused.saved_bytes > block.saved_bytes  # the T x T probabilities
    embedding, head = llama_layer_cost(config, "embedding", seq), llama_layer_cost(config, "head", seq)
    assert embedding.fwd_flops == 0 and embedding.param_bytes == 4 * 32000 * 4096
    assert head.bwd_weight_flops == 2 * seq * 4096 * 32000 and head.fwd_flops > head.bwd_weight_flops  # + loss
    assert head.output_bytes == 4 * seq * 32000  # fp32 logits
    block_parameters = 2 * 4096 + 4 * 4096 * 4096 + 3 * 4096 * 11008  # two norms, wq wk wv wo, w1 w2 w3
    assert llama_layer_cost(config, "block", seq, "bf16").param_bytes == 2 * block_parameters  # bf16 weights


def test_time_balance_moves_layers_off_the_heavy_head() -> None:
    """The embedding is heavy in parameters and cheap, the head heavy in compute: the time
    balance gives the first stage more blocks than the parameter balance does, the last fewer."""
    layers = llama_layers(get_config("llama-1b"), seq_len=2048)
    by_parameters = resolve_balance(PipelineConfig(num_stages=4), layers)
    by_time = resolve_balance(PipelineConfig(num_stages=4, balance="time"), layers)
    assert by_time[0] > by_parameters[0] and by_time[-1] <= by_parameters[-1]
    times = [layer_step_flops(layer.cost) for layer in layers]
    assert max(stage_times(times, by_time)) < max(stage_times(times, by_parameters))


def test_resolve_balance_gives_the_list_the_trainer_runs() -> None:
    layers = llama_layers("tiny")
    assert resolve_balance(PipelineConfig(num_stages=2), layers) == partition_by_cost(
        [layer_parameter_count(layer) for layer in layers], 2)
    assert resolve_balance(PipelineConfig(num_stages=2, balance="parameters"), layers) == resolve_balance(
        PipelineConfig(num_stages=2), layers)
    assert resolve_balance(PipelineConfig(num_stages=3, balance=[1, 3, 2]), layers) == [1, 3, 2]
    chosen = resolve_balance(PipelineConfig(num_stages=3, balance="time", activation_checkpoint="always"), layers)
    times = [layer_step_flops(layer.cost, "always") for layer in layers]
    assert max(stage_times(times, chosen)) == brute_force(times, 3)


def test_a_layer_without_a_cost_is_named() -> None:
    layers = [LayerSpec(nn.Linear, 4, 4, cost=LayerCost(1, 1, 1)), nn.Linear(4, 4), LayerSpec(nn.Linear, 4, 4)]
    with pytest.raises(ConfigError, match=r"layer 1 \(Linear.*\) has no cost"):
        resolve_balance(PipelineConfig(num_stages=2, balance="time"), layers)


def test_layer_cost_rejects_bad_values_and_spec_keeps_it_out_of_the_module() -> None:
    with pytest.raises(ConfigError, match="LayerCost.fwd_flops"):
        LayerCost(-1, 0, 0)
    spec = LayerSpec(nn.Linear, 3, 2, bias=False, cost=LayerCost(1, 2, 3))
    assert spec.build().bias is None and spec.cost.train_flops == 6
    assert spec.with_cost(None).cost is None and spec.cost is not None


def test_the_trainer_runs_the_resolved_list(monkeypatch) -> None:
    """balance="time" is resolved in the trainer's constructor, before any actor starts, to the
    list a run given that list runs: the same stages, the same layers in each (no Ray started)."""
    from raypipe.models.llama import llama_loss
    from raypipe.trainer import PipelineTrainer

    monkeypatch.setattr(PipelineTrainer, "_start", lambda self: setattr(self, "use_gpu", False))
    layers = llama_layers(get_config("llama-1b"), seq_len=2048)
    by_time = PipelineTrainer(layers, llama_loss, config=PipelineConfig(num_stages=4, balance="time"))
    chosen = resolve_balance(PipelineConfig(num_stages=4, balance="time"), layers)
    given = PipelineTrainer(layers, llama_loss, config=PipelineConfig(num_stages=4, balance=chosen))
    assert by_time.balance == given.balance == chosen
    assert [spec.layer_indices for spec in by_time._stage_specs()] == [
        spec.layer_indices for spec in given._stage_specs()]
    with pytest.raises(ConfigError, match="layer 0"):
        PipelineTrainer([nn.Linear(2, 2), nn.Linear(2, 2)], llama_loss,
                        config=PipelineConfig(num_stages=2, balance="time"))


def test_plan_prints_both_balances(capsys) -> None:
    import argparse
    import json

    from raypipe.planning.plan import add_plan_arguments, run_plan

    def plan(*argv: str) -> str:
        parser = argparse.ArgumentParser()
        add_plan_arguments(parser)
        assert run_plan(parser.parse_args(list(argv))) == 0
        return capsys.readouterr().out

    argv = ["--model", "llama-1b", "--stages", "4", "--micro-batches", "8", "--seq-len", "2048",
            "--precision", "bf16", "--gpu-memory", "80GB"]
    result = json.loads(plan(*argv, "--json"))
    balances = result["balances"]
    assert balances["parameters"]["balance"] == [len(stage["layers"]) for stage in result["stages"]]
    assert balances["parameters"]["stage_total_bytes"] == [stage["total_bytes"] for stage in result["stages"]]
    layers = llama_layers(get_config("llama-1b"), seq_len=2048, precision="bf16")
    assert balances["time"]["balance"] == resolve_balance(PipelineConfig(num_stages=4, balance="time"), layers)
    times = [layer_step_flops(layer.cost, "never", 8) for layer in layers]
    for name in ("parameters", "time"):
        assert balances[name]["stage_flops"] == stage_times(times, balances[name]["balance"])
        assert balances[name]["fits"] is True
    assert balances["time"]["max_stage_flops"] < balances["parameters"]["max_stage_flops"]
    table = plan(*argv)
    assert f"by time       {balances['time']['balance']}" in table and "by parameters [6, 6, 6, 6]" in table


def test_plan_keeps_the_time_balance_within_the_memory() -> None:
    """Under 1F1B the first stage holds the most micro-batches: a limit just below the time balance's
    largest stage moves a block off it, giving up some speed to fit."""
    from raypipe.models.llama import get_config as config_of
    from raypipe.planning.plan import PlanSettings, compare_balances

    config = config_of("llama-1b")
    settings = PlanSettings(4, 8, 1, 2048, "bf16", "never", None, False, True, "1f1b", None)
    stages = settings.estimate(config, None)
    free = compare_balances(config, settings, stages, None)["time"]
    limit = max(free["stage_total_bytes"]) - 1
    limited = compare_balances(config, settings, stages, limit)["time"]
    assert limited["memory_limited"] and limited["fits"] and max(limited["stage_total_bytes"]) <= limit
    assert limited["max_stage_flops"] > free["max_stage_flops"] and limited["balance"][0] < free["balance"][0]


def test_with_llama_costs_keeps_the_spec_class_and_uses_the_runs_shape() -> None:
    from raypipe.models.llama_costs import with_llama_costs

    class Pretrained(LayerSpec):  # as raypipe.models.hf's PretrainedLayer: a subclass with more state
        pass

    config = get_config("tiny")
    specs = [Pretrained(spec.cls, *spec.args) for spec in llama_layers(config)]
    costed = with_llama_costs(specs, config, seq_len=64, precision="bf16")
    assert all(type(spec) is Pretrained for spec in costed) and all(spec.cost is None for spec in specs)
    assert [spec.cost for spec in costed] == llama_layer_costs(config, 64, "bf16")
    assert costed[1].cost == llama_layer_cost(config, "block", 64, "bf16") != llama_layers(config)[1].cost
    with pytest.raises(ValueError, match="3 layers"):
        with_llama_costs(specs[:3], config)
