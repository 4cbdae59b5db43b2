"""Hugging Face LLaMA interop, checked against transformers itself: a tiny random
LlamaForCausalLM saved in several safetensors shards is imported, trained in a
2-stage pipeline, exported and loaded back. The pipeline runs on Ray for one rotary
scaling, its stages' actors writing the shards and the checkpoint; for the other on the
step runner that trains, in one process, each stage's worker writing its own files."""
from __future__ import annotations

import contextlib
import dataclasses
import json
import shutil

import pytest
import torch
import transformers

import raypipe
from raypipe.checkpoint.store import write_manifest
from raypipe.cli import main as cli_main
from raypipe.core.micro_batches import loss_weights, split_micro_batches
from raypipe.errors import ConfigError
from raypipe.models.hf import from_pretrained
from raypipe.models.llama import llama_loss
from raypipe.run import RunConfig, llama_count_tokens, train
from tests.data.test_hf_tokenizer import stdlib_slice, train_tokenizer
from tests.reference import InterpretedTrainer, on_ray

SEQ_LEN = 24
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16}  # wavelengths 6..2e4 span all three frequency bands


def hf_model(rope_scaling: dict | None = None, tie: bool = False, seed: int = 0, vocab_size: int = 96):
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6, rope_theta=10000.0,
        rope_scaling=dict(rope_scaling) if rope_scaling else None, tie_word_embeddings=tie)  # it edits the dict
    model = transformers.LlamaForCausalLM(config).float().eval()
    with torch.no_grad():  # norms away from 1 and sharp attention: misplaced norms or rotations show in the loss
        for name, parameter in model.named_parameters():
            if "norm" in name:
                parameter.uniform_(0.5, 1.5)
            elif "q_proj" in name or "k_proj" in name:
                parameter.normal_(0.0, 0.4)
    return model


def save(model, path, shard: str = "40KB"):
    model.save_pretrained(path, max_shard_size=shard, safe_serialization=True)
    return path


def rows(count: int = 4, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 96, (count, SEQ_LEN + 1), generator=torch.Generator().manual_seed(seed))


def hf_loss(model, tokens: torch.Tensor) -> float:
    """transformers' own loss: it shifts labels, so position t predicts token t + 1 as in raypipe."""
    with torch.no_grad():
        return float(model(input_ids=tokens, labels=tokens).loss)


def local_loss(layers, tokens: torch.Tensor) -> float:
    """The imported layers built in this process (no pipeline)."""
    model = torch.nn.Sequential(*(layer.build() for layer in layers))
    with torch.no_grad():
        return float(llama_loss(model(tokens[:, :-1]), tokens[:, 1:]))


def relative(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


class InProcessLlamaTrainer:
    """What the test below asks of a trainer of a LLaMA, on :class:`InterpretedTrainer` (the step
    runner that trains, in one process): its steps and state, and, as the trainer runs them, an
    evaluation (each micro-batch forward through the stages' workers, weighted by its counted
    targets), ``export_hf`` (each stage's worker writing its layers' shards; the index and config
    after) and ``save_checkpoint`` (each worker its layer files; the manifest recording the model,
    which ``raypipe export`` reads)."""

    def __init__(self, layers, loss_fn, optimizer_factory, config: raypipe.PipelineConfig, loss_count_fn) -> None:
        from raypipe.models.hf.export import describe_llama

        self.trainer = InterpretedTrainer(layers, loss_fn, optimizer_factory, config, loss_count_fn=loss_count_fn)
        self.config, self.loss_count_fn, self.model = config, loss_count_fn, describe_llama(layers)
        self.workers = self.trainer.pipeline.replicas[0].workers

    def step(self, inputs: torch.Tensor, targets: torch.Tensor):
        return self.trainer.step(inputs, targets)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.trainer.state_dict()

    def evaluate(self, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        inputs, targets = split_micro_batches(inputs, targets, self.config.num_micro_batches)
        weights = loss_weights([self.loss_count_fn(part) for part in targets])
        loss = 0.0
        for micro_batch, (hidden, part, weight) in enumerate(zip(inputs, targets, weights)):
            for worker in self.workers[:-1]:
                hidden = worker.evaluate(micro_batch, hidden)
            loss += self.workers[-1].evaluate(micro_batch, hidden, part, weight)
        return loss

    def export_hf(self, out) -> None:
        from raypipe.models.hf.export import prepare_output, write_index_and_config

        prepare_output(str(out))
        n_blocks = self.model["llama_config"]["n_layers"]
        shards = [shard for worker in self.workers for shard in worker.export_hf(str(out), None, n_blocks)]
        write_index_and_config(str(out), self.model, None, shards)

    def save_checkpoint(self, root) -> None:
        step, layer_files = self.trainer.step_count, {}
        for worker in self.workers:
            started = worker.start_checkpoint(str(root), step)
            layer_files.update(worker.checkpoint_files(step, started).layers)
        write_manifest(root, step, layer_files, {"model": self.model})


def in_process_llama(layers, loss_fn, optimizer_factory, config: raypipe.PipelineConfig, loss_count_fn):
    """An :class:`InProcessLlamaTrainer`, as a context manager (as :func:`tests.reference.on_ray`)."""
    return contextlib.nullcontext(InProcessLlamaTrainer(layers, loss_fn, optimizer_factory, config, loss_count_fn))


def test_import_train_export_matches_transformers(ray_cluster, tmp_path):
    """LLaMA 3's rotary scaling, on Ray, one stage split over two tensor-parallel workers (their
    layers gathered whole for the export, tp_rank 0 writing; two stages' workers each writing theirs:
    the test below, through the stage workers in one process)."""
    assert_import_train_export_matches_transformers(on_ray, tmp_path, LLAMA3, tensor_parallel=2, num_stages=1)


def test_import_train_export_matches_transformers_in_process(tmp_path):
    """Plain rotary embeddings, in one process."""
    assert_import_train_export_matches_transformers(in_process_llama, tmp_path, None)


def assert_import_train_export_matches_transformers(trainer_of, tmp_path, rope_scaling: dict | None,
                                                    tensor_parallel: int = 1, num_stages: int = 2) -> None:
    source = hf_model(rope_scaling)
    save(source, tmp_path / "hf")
    assert len(json.loads((tmp_path / "hf/model.safetensors.index.json").read_text())["weight_map"]) == 3 * 9 + 3
    assert len(list((tmp_path / "hf").glob("*.safetensors"))) > 2  # several shards, tensors of a layer split
    tokens = rows()
    config = raypipe.PipelineConfig(num_stages=num_stages, num_micro_batches=2, tensor_parallel=tensor_parallel)
    adamw = lambda params: torch.optim.AdamW(params, lr=1e-2)  # noqa: E731
    layers = from_pretrained(tmp_path / "hf")  # rotary tables for max_position_embeddings, one per stage
    with trainer_of(layers, llama_loss, adamw, config, loss_count_fn=llama_count_tokens) as trainer:
        before = trainer.evaluate(tokens[:, :-1], tokens[:, 1:])
        assert relative(before, hf_loss(source, tokens)) < 1e-5
        losses = [trainer.step(tokens[:, :-1], tokens[:, 1:]).loss for _ in range(3)]
        assert relative(losses[0], before) < 1e-6 and losses[-1] < losses[0] - 0.05  # it trained
        after = trainer.evaluate(tokens[:, :-1], tokens[:, 1:])
        trainer.export_hf(tmp_path / "out")  # default: as trained, the fp32 main weights
        trained = trainer.state_dict()
        trainer.save_checkpoint(tmp_path / "ckpt")
    exported = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "out").eval()  # dtype "auto": the config's
    assert exported.config.tie_word_embeddings is False and exported.lm_head.weight.dtype == torch.float32
    assert relative(hf_loss(exported, tokens), after) < 1e-6
    assert torch.equal(exported.model.layers[1].self_attn.k_proj.weight, trained["2.attention.wk.weight"])
    # the CLI's default is the same: the checkpoint's fp32 main weights, recorded as such
    assert cli_main(["export", "--checkpoint", str(tmp_path / "ckpt"), "--out", str(tmp_path / "as-trained")]) == 0
    assert json.loads((tmp_path / "as-trained/config.json").read_text())["dtype"] == "float32"
    assert torch.equal(transformers.LlamaForCausalLM.from_pretrained(tmp_path / "as-trained").lm_head.weight,
                       trained["4.output.weight"])
    # the CLI converts the checkpoint the trainer saved, here in bf16
    assert cli_main(["export", "--checkpoint", str(tmp_path / "ckpt"), "--step", "3",
                     "--out", str(tmp_path / "bf16"), "--dtype", "bf16"]) == 0
    assert json.loads((tmp_path / "bf16/config.json").read_text())["dtype"] == "bfloat16"
    from_checkpoint = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "bf16")
    assert from_checkpoint.lm_head.weight.dtype == torch.bfloat16
    assert torch.equal(from_checkpoint.lm_head.weight, trained["4.output.weight"].bfloat16())
    index = json.loads((tmp_path / "bf16/model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == [f"model-0000{k}-of-00005.safetensors" for k in range(1, 6)]


def export_locally(layers, out, dtype=None):
    """What ``export_hf`` and ``raypipe export`` run, without a trainer: each built layer's
    state written as its shard, then the index and config. Returns the modules."""
    from raypipe.models.hf.export import describe_llama, prepare_output, write_index_and_config, write_layer_shard

    modules = [layer.build() for layer in layers]
    prepare_output(str(out))
    shards = [write_layer_shard(str(out), index, len(modules) - 2, module.state_dict(), dtype)
              for index, module in enumerate(modules)]
    write_index_and_config(str(out), describe_llama(layers), dtype, shards)
    return modules


def raypipe_loss(modules, tokens: torch.Tensor) -> float:
    with torch.no_grad():
        return float(llama_loss(torch.nn.Sequential(*modules)(tokens[:, :-1]), tokens[:, 1:]))


def test_export_defaults_to_the_trained_fp32_weights_and_reloads_to_the_same_loss(tmp_path):
    """With no dtype asked, the files hold the fp32 main weights and config.json says float32, so
    transformers' default (dtype "auto": the config's) computes what raypipe did; bf16 only when
    asked: half the bytes, config bfloat16, and a loss that moved."""
    save(hf_model(), tmp_path / "hf")
    layers = from_pretrained(tmp_path / "hf")
    tokens = rows()
    modules = export_locally(layers, tmp_path / "fp32")
    config = json.loads((tmp_path / "fp32/config.json").read_text())
    assert config["dtype"] == config["torch_dtype"] == "float32"
    reloaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "fp32").eval()  # no dtype: as recorded
    assert reloaded.lm_head.weight.dtype == torch.float32
    assert torch.equal(reloaded.model.layers[2].mlp.up_proj.weight, modules[3].feed_forward.w3.weight)
    trained = raypipe_loss(modules, tokens)
    assert relative(hf_loss(reloaded, tokens), trained) < 1e-6
    n_parameters = sum(p.numel() for m in modules for p in m.parameters())
    size = json.loads((tmp_path / "fp32/model.safetensors.index.json").read_text())["metadata"]["total_size"]
    assert size == 4 * n_parameters

    export_locally(layers, tmp_path / "bf16", dtype="bf16")
    config = json.loads((tmp_path / "bf16/config.json").read_text())
    assert config["dtype"] == config["torch_dtype"] == "bfloat16"
    halved = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "bf16").eval()
    assert halved.lm_head.weight.dtype == torch.bfloat16
    assert torch.equal(halved.lm_head.weight, modules[-1].output.weight.bfloat16())
    assert json.loads((tmp_path / "bf16/model.safetensors.index.json").read_text())["metadata"]["total_size"] \
        == 2 * n_parameters
    # the rounding alone moves the loss (the weights evaluated in fp32) by far more than 1e-6
    assert relative(hf_loss(halved.float(), tokens), trained) > 1e-6


def test_export_as_trained_refuses_mixed_dtypes(tmp_path):
    from raypipe.models.hf.export import write_index_and_config

    save(hf_model(), tmp_path / "hf")
    layers = from_pretrained(tmp_path / "hf")
    with pytest.raises(ValueError, match="trained in different dtypes"):
        write_index_and_config(str(tmp_path), {"llama_config": dataclasses.asdict(layers[0].args[0])}, None,
                               [{"file": f"model-0000{k + 1}-of-00005.safetensors", "tensors": [], "bytes": 0,
                                 "dtype": "float32" if k else "bfloat16"} for k in range(5)])


def test_from_pretrained_without_max_seq_len_shares_one_rotary_table_per_stage(tmp_path, monkeypatch):
    """Tables for max_position_embeddings (64 here), built once and shared by every block
    (not buffers: nothing in the state dict, nothing a checkpoint saves); results bitwise
    those of tables sized by max_seq_len."""
    import raypipe.models.rotary as rotary
    from raypipe.executor.per_step_worker import _saves_buffers

    source = hf_model()
    save(source, tmp_path / "hf")
    layers = from_pretrained(tmp_path / "hf")
    assert layers[0].args[0].max_seq_len == 64
    rotary.clear_shared_rotary_tables()
    built = []
    real = rotary.rotary_tables
    monkeypatch.setattr(rotary, "rotary_tables", lambda *a, **k: built.append(a) or real(*a, **k))
    stage = torch.nn.ModuleList(layer.build() for layer in layers)
    tokens = rows()
    with torch.no_grad():
        logits = torch.nn.Sequential(*stage)(tokens[:, :-1])
    blocks = [module.attention for module in stage[1:-1]]
    assert len(built) == 1 and built[0][:2] == (16, 64)  # head_dim, positions: one table for the stage
    assert all(block.rope_cos is blocks[0].rope_cos and block.rope_sin is blocks[0].rope_sin for block in blocks)
    assert blocks[0].rope_cos.shape == (64, 8)
    assert not _saves_buffers(stage) and not any("rope" in key for key in stage.state_dict())
    assert relative(float(llama_loss(logits, tokens[:, 1:])), hf_loss(source, tokens)) < 1e-5
    sized = torch.nn.Sequential(*(layer.build() for layer in from_pretrained(tmp_path / "hf", max_seq_len=SEQ_LEN)))
    assert sized[1].attention.rope_cos.shape == (SEQ_LEN, 8)  # smaller tables when asked
    with torch.no_grad():
        assert torch.equal(sized(tokens[:, :-1]), logits)


def test_from_pretrained_without_max_position_embeddings_asks_for_max_seq_len(tmp_path):
    save(hf_model(), tmp_path / "hf")
    path = tmp_path / "hf/config.json"
    path.write_text(json.dumps({k: v for k, v in json.loads(path.read_text()).items()
                                if k != "max_position_embeddings"}))
    with pytest.raises(ConfigError, match="config.json max_position_embeddings.*pass max_seq_len"):
        from_pretrained(tmp_path / "hf")
    assert from_pretrained(tmp_path / "hf", max_seq_len=SEQ_LEN)[0].args[0].max_seq_len == SEQ_LEN


def test_exported_llama3_config_keeps_the_scaling(tmp_path):
    save(hf_model(LLAMA3), tmp_path / "hf")
    written = json.loads((tmp_path / "hf/config.json").read_text())
    from raypipe.models.hf.config import hf_config_from_llama, llama_config_from_hf

    config = llama_config_from_hf(written, max_seq_len=SEQ_LEN)
    assert config.rope_scaling == {k: float(v) for k, v in LLAMA3.items() if k != "rope_type"}
    again = hf_config_from_llama(config, "float32", written)
    assert llama_config_from_hf(again, max_seq_len=SEQ_LEN) == config
    assert transformers.LlamaConfig(**again).rope_parameters["rope_type"] == "llama3"


def test_single_file_checkpoint_imports(tmp_path):
    source = hf_model()
    save(source, tmp_path / "hf", shard="10GB")
    assert (tmp_path / "hf/model.safetensors").exists() and not (tmp_path / "hf/model.safetensors.index.json").exists()
    tokens = rows()
    assert relative(local_loss(from_pretrained(tmp_path / "hf", max_seq_len=SEQ_LEN), tokens),
                    hf_loss(source, tokens)) < 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ranged_reads_equal_safetensors(tmp_path, dtype):
    """What s3:// and gs:// use (header, then each tensor's byte range), here on pyarrow's local
    filesystem, against safetensors' own reader."""
    from pyarrow import fs as pafs
    from safetensors import safe_open

    from raypipe.models.hf.weights import read_tensor_ranges

    save(hf_model().to(dtype), tmp_path / "hf")
    for shard in sorted((tmp_path / "hf").glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as handle:
            expected = {name: handle.get_tensor(name) for name in handle.keys()}
        got = read_tensor_ranges(pafs.LocalFileSystem(), str(shard), sorted(expected))
        assert expected and all(torch.equal(got[name], tensor) and got[name].dtype == dtype
                                for name, tensor in expected.items())
        # a tensor-parallel rank's part: a range of rows (its bytes only) or of columns
        matrices = [name for name, tensor in expected.items() if tensor.dim() == 2]
        for region in [(slice(1, 3),), (slice(None), slice(2, 5))]:
            parts = read_tensor_ranges(pafs.LocalFileSystem(), str(shard), matrices, dict.fromkeys(matrices, region))
            assert all(torch.equal(parts[name], expected[name][region]) for name in matrices)
    with pytest.raises(KeyError, match="has no tensor nope"):
        read_tensor_ranges(pafs.LocalFileSystem(), str(shard), ["nope"])


def test_tied_embeddings_refused_by_name_or_untied_on_request(tmp_path):
    source = hf_model(tie=True)
    save(source, tmp_path / "hf")
    with pytest.raises(ConfigError, match="tie_word_embeddings.*untie_embeddings=True"):
        from_pretrained(tmp_path / "hf", max_seq_len=SEQ_LEN)
    layers = from_pretrained(tmp_path / "hf", max_seq_len=SEQ_LEN, untie_embeddings=True)
    assert layers[-1].tensors["output.weight"][0] == "model.embed_tokens.weight"
    tokens = rows()
    assert relative(local_loss(layers, tokens), hf_loss(source, tokens)) < 1e-5


def test_driver_reads_no_weights(tmp_path):
    """Counting parameters (what the trainer's partition does) builds on the meta device:
    with every shard gone it still works; building for real names the missing file."""
    save(hf_model(), tmp_path / "hf")
    layers = from_pretrained(tmp_path / "hf", max_seq_len=SEQ_LEN)
    for shard in (tmp_path / "hf").glob("*.safetensors"):
        shard.unlink()
    assert sum(layer.num_parameters() for layer in layers) == sum(p.numel() for p in hf_model().parameters())
    with pytest.raises(Exception, match="safetensors"):
        layers[1].build()


@pytest.mark.parametrize("change, field", [
    ({"attention_bias": True}, "attention_bias"),
    ({"mlp_bias": True}, "mlp_bias"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"model_type": "mistral"}, "model_type"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}}, "rope_scaling"),
    ({"rope_parameters": None, "rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_scaling"),
    ({"head_dim": 32}, "head_dim"),
    ({"attention_dropout": 0.1}, "attention_dropout"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    ({"quantization_config": {"quant_method": "bitsandbytes"}}, "quantization_config"),
])
def test_unsupported_config_refused_by_name(tmp_path, change, field):
    save(hf_model(), tmp_path / "hf")
    path = tmp_path / "hf/config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **change}))
    with pytest.raises(ConfigError, match=f"config.json {field}"):
        from_pretrained(tmp_path / "hf", max_seq_len=SEQ_LEN)


def test_missing_tensor_and_bad_shape_named(tmp_path):
    save(hf_model(), tmp_path / "hf")
    index_path = tmp_path / "hf/model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    del index["weight_map"]["model.layers.2.mlp.up_proj.weight"]
    index_path.write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"model.layers.2.mlp.up_proj.weight \(pipeline layer 3\)"):
        from_pretrained(tmp_path / "hf", max_seq_len=SEQ_LEN)
    shutil.rmtree(tmp_path / "hf")
    save(hf_model(), tmp_path / "hf")
    config_path = tmp_path / "hf/config.json"
    config_path.write_text(json.dumps({**json.loads(config_path.read_text()), "intermediate_size": 80}))
    with pytest.raises(ValueError, match=r"mlp.down_proj.weight has shape \(64, 96\), config.json implies \(64, 80\)"):
        from_pretrained(tmp_path / "hf", max_seq_len=SEQ_LEN)[1].build()


def test_export_refuses_other_models_and_used_directories(tmp_path, capsys):
    """Only a LLaMA's pipeline layers are described (what export_hf needs); an export never mixes
    with files already in its directory."""
    from raypipe.models.hf.export import check_dtype, describe_llama, prepare_output
    from raypipe.models.llama import get_config, llama_layers

    config = get_config("tiny")
    assert describe_llama(llama_layers(config))["llama_config"]["dim"] == config.dim
    assert describe_llama([torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)]) is None
    assert describe_llama(llama_layers(config)[:-1]) is None  # no head
    (tmp_path / "used").mkdir()
    (tmp_path / "used/config.json").write_text("{}")
    with pytest.raises(FileExistsError, match="not empty"):
        prepare_output(str(tmp_path / "used"))
    with pytest.raises(ValueError, match="export dtype 'int8'"):
        check_dtype("int8")
    assert cli_main(["export", "--checkpoint", str(tmp_path / "none"), "--out", str(tmp_path / "o")]) == 2
    assert f"no complete checkpoint under {tmp_path / 'none'}" in capsys.readouterr().err


def test_run_starts_from_a_checkpoint_on_data_of_its_tokenizer(ray_cluster, tmp_path):
    """`init_from` + `tokenizer` through the run config (what --init-from / --tokenizer set): the
    first step's loss is transformers' on the same rows, read from data the tokenizer prepared."""
    from raypipe.data import TokenDataset, prepare
    from raypipe.data.tokenizer import HFTokenizer

    tokenizer = train_tokenizer(tmp_path / "tok", vocab_size=300, config={"eos_token": "</s>", "bos_token": "<s>"})
    source = hf_model(vocab_size=300)
    save(source, tmp_path / "hf")
    prepare(tmp_path / "data", corpus=stdlib_slice(3), seq_len=16, tokenizer=HFTokenizer(tokenizer))
    run = RunConfig(init_from=str(tmp_path / "hf"), tokenizer=str(tokenizer), data=str(tmp_path / "data"),
                    prepare_if_missing=False, seq_len=16, steps=2, micro_batch_size=2, eval_every=2, eval_steps=1,
                    out=str(tmp_path / "run"), progress=False, pipeline={"num_stages": 2, "num_micro_batches": 2})
    summary = train(run)
    dataset = TokenDataset(tmp_path / "data", "train", 2, 2, seed=0, vocab_size=300)
    inputs, targets = (torch.cat(parts) for parts in zip(*(dataset.get(0, g) for g in range(2))))
    with torch.no_grad():
        expected = float(torch.nn.functional.cross_entropy(source(input_ids=inputs).logits.flatten(0, 1),
                                                           targets.flatten()))
    assert relative(summary["initial_loss"], expected) < 1e-5
    assert summary["steps"] == 2 and summary["final_eval_loss"] < 10
    prepare(tmp_path / "bytes", corpus=stdlib_slice(1), seq_len=16)
    with pytest.raises(ValueError, match="prepared with tokenizer 'byte'.*raypipe prepare --tokenizer"):
        train(RunConfig(**{**run.__dict__, "data": str(tmp_path / "bytes")}))
    with pytest.raises(ValueError, match="needs seq_len"):
        train(RunConfig(**{**run.__dict__, "seq_len": None}))


def test_train_7b_flags_reach_the_run_config(capsys):
    from tests.test_config import load_job

    job = load_job("train_7b")
    args = job["parse_args"](["--preset", "tiny", "--init-from", "s3://b/llama", "--seq-len", "4096",
                              "--untie-embeddings", "--tokenizer", "tok"])
    run = job["run_config"](args)
    assert (run.init_from, run.untie_embeddings, run.tokenizer, run.seq_len) == ("s3://b/llama", True, "tok", 4096)
    from raypipe.data.cache import default_dataset_dir

    assert run.data == str(default_dataset_dir(4096, tokenizer="hf:tok"))  # not the byte-tokenized default
    assert run.data != str(default_dataset_dir(4096))
    with pytest.raises(SystemExit):
        job["parse_args"](["--preset", "tiny", "--untie-embeddings"])
    assert "--untie-embeddings only applies with --init-from" in capsys.readouterr().err


def test_from_pretrained_is_the_hf_packages_and_its_old_path_says_so():
    with pytest.raises(ImportError, match=r"^raypipe.models.llama.from_pretrained is now raypipe.models.hf.from_pretrained"):
        from raypipe.models.llama import from_pretrained as old  # noqa: F401
