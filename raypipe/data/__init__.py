"""Parquet token shards: ``prepare`` a text corpus once, read batches deterministically.

``prepare`` tokenizes documents, wraps each in <bos>/<eos>, concatenates them
and cuts fixed rows of ``seq_len + 1`` tokens (inputs are a row's first
``seq_len`` tokens, targets its last ``seq_len``). Rows go to Parquet shards of
a train and a validation split, described by ``manifest.json`` (tokenizer,
vocabulary size, row counts, the size and sha256 of every shard).

:class:`TokenDataset` reads those shards. The rows of ``(step, micro_batch,
replica)`` come from a seeded permutation of the split per epoch, so any
process computes the same batch from the same arguments and a restart resumes
exactly from :meth:`TokenDataset.state_dict`.

``prepare(pack=True)`` also stores each row's document boundaries
(:mod:`raypipe.data.packing`); the reader then yields packed micro-batches whose
documents attend only to themselves (:mod:`raypipe.core.packed`).
"""
from raypipe.data.corpus import corpus_files, stdlib_corpus_files
from raypipe.data.dataset import TokenDataset
from raypipe.data.prepare import add_prepare_arguments, ensure_prepared, prepare, run_prepare
from raypipe.data.shards import COLUMN, FORMAT, MANIFEST, SPLITS, VERSION, read_manifest

__all__ = ["TokenDataset", "add_prepare_arguments", "corpus_files", "ensure_prepared", "prepare", "run_prepare",
           "stdlib_corpus_files", "read_manifest", "COLUMN", "FORMAT", "MANIFEST", "SPLITS", "VERSION"]
