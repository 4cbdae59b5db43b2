"""A Hugging Face tokenizer directory (trained here with the `tokenizers` package on a
slice of the stdlib corpus) preparing a dataset."""
from __future__ import annotations

import json

import numpy as np
import pyarrow.parquet as pq
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from raypipe.cli import main as cli_main
from raypipe.data import TokenDataset, prepare, read_manifest, stdlib_corpus_files
from raypipe.data.tokenizer import HFTokenizer, get_tokenizer

SPECIALS = ["<pad>", "<s>", "</s>"]


def stdlib_slice(count: int = 3) -> list:
    return sorted(stdlib_corpus_files())[:count]


def train_tokenizer(directory, vocab_size: int = 400, config: dict | None = None):
    """A byte-level BPE tokenizer saved as a Hugging Face directory."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = __import__("tokenizers").decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train([str(path) for path in stdlib_slice()], trainer)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    if config is not None:
        (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    return train_tokenizer(tmp_path_factory.mktemp("tok"), config={"eos_token": "</s>", "bos_token": "<s>",
                                                                   "pad_token": {"content": "<pad>"}})


def test_special_ids_come_from_the_tokenizer(tokenizer_dir, tmp_path):
    tokenizer = HFTokenizer(tokenizer_dir)
    assert (tokenizer.pad_id, tokenizer.bos_id, tokenizer.eos_id) == (0, 1, 2)
    assert tokenizer.vocab_size == 400
    text = "def main():\n    return 42  # é\n"
    assert tokenizer.decode(tokenizer.encode(text)) == text
    assert len(tokenizer.encode(text)) < len(text.encode())  # merges, not bytes
    assert get_tokenizer(tokenizer.name).eos_id == 2  # the manifest's name finds it again
    # without tokenizer_config.json the usual names are found; padding falls back to eos
    bare = train_tokenizer(tmp_path / "bare")
    assert (HFTokenizer(bare).bos_id, HFTokenizer(bare).eos_id) == (1, 2)


def test_prepare_with_hf_tokenizer_writes_its_ids(tokenizer_dir, tmp_path):
    tokenizer = HFTokenizer(tokenizer_dir)
    out = prepare(tmp_path / "data", corpus=stdlib_slice(2), seq_len=32, tokenizer=tokenizer, val_fraction=0.0)
    manifest = read_manifest(out)
    assert manifest["tokenizer"] == {"name": tokenizer.name, "bos_id": 1, "eos_id": 2, "pad_id": 0}
    assert manifest["vocab_size"] == 400
    rows = np.concatenate([np.stack(pq.read_table(out / shard["file"])["tokens"].to_numpy(zero_copy_only=False))
                           for shard in manifest["splits"]["train"]["shards"]])
    first_document = stdlib_slice(2)[0].read_text()
    expected = [1] + tokenizer.encode(first_document)
    assert rows.reshape(-1)[:200].tolist() == expected[:200]  # <bos> then the first document's ids
    assert (rows == 2).sum() >= 1  # an <eos> closes a document
    batch = TokenDataset(out, micro_batch_size=2, num_micro_batches=1, vocab_size=400).get(0, 0)
    assert batch[0].shape == (2, 32)


def test_prepare_cli_takes_a_tokenizer_directory(tokenizer_dir, tmp_path, capsys):
    corpus = stdlib_slice(1)[0]
    assert cli_main(["prepare", "--corpus", str(corpus), "--out", str(tmp_path / "d"), "--seq-len", "16",
                     "--tokenizer", str(tokenizer_dir)]) == 0
    assert f"tokenizer hf:{tokenizer_dir}" in capsys.readouterr().out
    assert cli_main(["prepare", "--corpus", str(corpus), "--out", str(tmp_path / "e"),
                     "--tokenizer", str(tmp_path / "nowhere")]) == 2
    assert "nowhere/tokenizer.json does not exist" in capsys.readouterr().err


def test_declared_token_missing_from_the_vocabulary_is_named(tmp_path):
    directory = train_tokenizer(tmp_path / "t", config={"eos_token": "<|eot|>"})
    with pytest.raises(ValueError, match=r"eos_token '<\|eot\|>'"):
        HFTokenizer(directory)
