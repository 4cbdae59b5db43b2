"""TokenDataset: deterministic, resumable batches of a prepared split."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from raypipe.core.packed import document_targets, make_packed
from raypipe.data.decoded import open_decoded
from raypipe.data.packing import CODES_SUFFIX, check_boundaries, rows_of_codes, read_boundaries, token_codes
from raypipe.data.shards import (SPLITS, check_split_files, check_vocabulary, decode_rows, read_file, read_manifest,
                                 verify_shard)
from raypipe.filesystem import filesystem_for


class TokenDataset:
    """Deterministic, resumable batches of one split of a prepared dataset.

    ``get(step, micro_batch)`` returns ``(inputs, targets)`` int64 tensors of
    shape ``(micro_batch_size, seq_len)``, targets shifted by one. A step is
    ``num_micro_batches`` micro-batches in all, whoever runs them: with ``d``
    pipeline replicas of ``m`` micro-batches each, ``num_micro_batches = m x d``
    and replica ``r`` reads micro-batches ``r*m .. r*m + m - 1``, so the rows of
    a step do not depend on how many replicas share it. Each epoch visits every
    row at most once in a permutation seeded by ``(seed, epoch)``.

    Opening reads the manifest and lists the split's shards: each must exist,
    with the size the manifest records. It reads no shard, so opening a corpus
    of terabytes in object storage costs one listing, not a download. A shard's
    checksum, schema and row count are checked where it is first decoded (once
    per node, in the reading stage, ahead of the step that needs it), and its
    token ids against ``vocab_size`` (default: the manifest's) in every process
    that reads it; a bad shard raises there, naming the file. A shard is decoded
    once per node, into a file memory-mapped by every reader there (see
    :mod:`raypipe.data.decoded`), so a reader's memory does not grow with the
    split. The object is small to pickle: its mapped shards are rebuilt lazily
    after unpickling. A local ``path`` is made absolute here, so every process
    that gets the object reads the same path, whatever its working directory.

    A *packed* dataset (``prepare(pack=True)``) gives as inputs one int64 tensor
    ``(micro_batch_size, 3, seq_len)`` of tokens, positions and document ids
    (:mod:`raypipe.core.packed`), and as targets the shifted rows with every target
    that crosses into another document (or is padding) set to -100, so a loss that
    ignores -100 and ``loss_count_fn`` counting the rest give the exact per-token mean.
    Rows and their order are those of the same corpus unpacked. Each shard's
    boundaries are decoded once per node beside its tokens.

    A *shipped* copy (:func:`raypipe.data.shipping.ship`) reads the shard files'
    bytes from Ray's object store instead of the filesystem, for workers on
    nodes that cannot open the driver's local path; each is fetched once per
    node, when its decoded copy is first written.
    """

    def __init__(
        self,
        path: str | Path,
        split: str = "train",
        micro_batch_size: int = 4,
        num_micro_batches: int = 4,
        seed: int = 0,
        vocab_size: int | None = None,
    ) -> None:
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        for name, value in (("micro_batch_size", micro_batch_size), ("num_micro_batches", num_micro_batches)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        self.uri = str(path) if "://" in str(path) else str(Path(path).expanduser().resolve())
        self.split = split
        self.micro_batch_size = micro_batch_size
        self.num_micro_batches = num_micro_batches
        self.seed = int(seed)
        manifest = read_manifest(path)
        self.tokenizer_name: str = manifest["tokenizer"]["name"]
        self.seq_len: int = manifest["seq_len"]
        self.packed: bool = bool(manifest.get("packed", False))
        self.vocab_size: int = manifest["vocab_size"] if vocab_size is None else int(vocab_size)
        self.shards: list[dict[str, Any]] = manifest["splits"][split]["shards"]
        self.num_rows: int = sum(shard["num_rows"] for shard in self.shards)
        self.rows_per_step = micro_batch_size * num_micro_batches
        if self.num_rows < self.rows_per_step:
            raise ValueError(
                f"the {split} split of {path} has {self.num_rows} rows, fewer than one step needs "
                f"({micro_batch_size} x {num_micro_batches} micro-batches)"
            )
        self.steps_per_epoch = self.num_rows // self.rows_per_step
        self.next_step = 0
        self.shipped_shards: list[Any] | None = None  # object references of the shard files, when shipped
        self._offsets = np.cumsum([0] + [shard["num_rows"] for shard in self.shards])
        check_split_files(path, manifest, split)
        self.reset_caches()

    def reset_caches(self) -> None:
        """Drop what this process memory-mapped or permuted (a copy read elsewhere builds its own)."""
        self._mapped: dict[int, np.ndarray] = {}  # shard index -> its decoded rows, memory-mapped
        self._mapped_codes: dict[int, np.ndarray] = {}  # packed: shard index -> its rows' token codes
        self._permutation: tuple[int, np.ndarray] | None = None

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        del state["_mapped"], state["_mapped_codes"], state["_permutation"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.reset_caches()

    @property
    def tokens_per_step(self) -> int:
        """Input tokens in one optimizer step, over all micro-batches and replicas."""
        return self.rows_per_step * self.seq_len

    @property
    def epoch(self) -> int:
        """The epoch that ``next_step`` falls in."""
        return self.next_step // self.steps_per_epoch

    def row_indices(self, step: int, micro_batch: int) -> np.ndarray:
        """Split-wide row numbers of ``(step, micro_batch)``."""
        if not isinstance(step, (int, np.integer)) or step < 0:
            raise ValueError(f"step must be a non-negative int, got {step!r}")
        if not 0 <= micro_batch < self.num_micro_batches:
            raise ValueError(f"micro_batch must be in [0, {self.num_micro_batches}), got {micro_batch}")
        epoch, step_in_epoch = divmod(int(step), self.steps_per_epoch)
        start = step_in_epoch * self.rows_per_step + micro_batch * self.micro_batch_size
        return self._epoch_permutation(epoch)[start:start + self.micro_batch_size]

    def get(self, step: int, micro_batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(inputs, targets)`` of one micro-batch: int64, ``(micro_batch_size, seq_len)``
        (packed: inputs ``(micro_batch_size, 3, seq_len)``, see the class)."""
        indices = self.row_indices(step, micro_batch)
        rows = torch.from_numpy(self._gather(indices, self._shard).astype(np.int64))
        if not self.packed:
            return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()
        positions, document_ids, padding = (torch.from_numpy(part) for part in
                                            rows_of_codes(self._gather(indices, self._codes)))
        inputs = make_packed(rows[:, :-1], positions[:, :-1], document_ids[:, :-1])
        return inputs, document_targets(rows, document_ids, padding)

    def global_batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Every micro-batch of ``step``, concatenated in order."""
        parts = [self.get(step, micro_batch) for micro_batch in range(self.num_micro_batches)]
        return torch.cat([inputs for inputs, _ in parts]), torch.cat([targets for _, targets in parts])

    def advance(self) -> int:
        """Mark ``next_step`` as consumed; returns the new ``next_step``."""
        self.next_step += 1
        return self.next_step

    def state_dict(self) -> dict[str, Any]:
        """The reader's position: small and JSON-serializable."""
        return {
            "next_step": self.next_step,
            "seed": self.seed,
            "split": self.split,
            "rows_per_step": self.rows_per_step,
            "num_rows": self.num_rows,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from :meth:`state_dict`; refuses a position from a different layout."""
        for key in ("rows_per_step", "num_rows"):
            if key in state and state[key] != getattr(self, key):
                raise ValueError(
                    f"cannot resume: the saved data position has {key}={state[key]}, this reader has "
                    f"{getattr(self, key)}; the same rows would not come back in the same order"
                )
        next_step = state["next_step"]
        if not isinstance(next_step, int) or next_step < 0:
            raise ValueError(f"next_step must be a non-negative int, got {next_step!r}")
        self.next_step = next_step
        self.seed = int(state.get("seed", self.seed))
        self._permutation = None

    def _epoch_permutation(self, epoch: int) -> np.ndarray:
        if self._permutation is None or self._permutation[0] != epoch:
            generator = np.random.default_rng(np.random.SeedSequence([self.seed, epoch]))
            self._permutation = (epoch, generator.permutation(self.num_rows))
        return self._permutation[1]

    def _gather(self, rows: np.ndarray, shard: Any) -> np.ndarray:
        shard_of_row = np.searchsorted(self._offsets, rows, side="right") - 1
        out = np.empty((len(rows), self.seq_len + 1), dtype=np.int32)
        for shard_index in np.unique(shard_of_row):
            chosen = shard_of_row == shard_index
            out[chosen] = shard(int(shard_index))[rows[chosen] - self._offsets[shard_index]]
        return out

    def _shard(self, index: int) -> np.ndarray:
        if index not in self._mapped:
            source = self._source(index)
            tokens = open_decoded(self.shards[index]["sha256"], self.seq_len + 1,
                                  lambda: self._decode(index, source), source)
            check_vocabulary(source, tokens, self.vocab_size)  # another reader may have decoded it for another model
            self._mapped[index] = tokens
        return self._mapped[index]

    def _codes(self, index: int) -> np.ndarray:
        """Packed: shard ``index``'s per-token codes (:func:`~raypipe.data.packing.token_codes`), memory-mapped."""
        if index not in self._mapped_codes:
            source = self._source(index)
            self._mapped_codes[index] = open_decoded(self.shards[index]["sha256"] + CODES_SUFFIX, self.seq_len + 1,
                                                     lambda: self._decode_codes(index, source), source)
        return self._mapped_codes[index]

    def _decode(self, index: int, source: str) -> np.ndarray:
        """Shard ``index`` read from ``source``, checked against the manifest, decoded."""
        return decode_rows(source, self._verified(index, source), self.seq_len + 1, self.vocab_size)

    def _decode_codes(self, index: int, source: str) -> np.ndarray:
        """Shard ``index``'s boundaries, checked, as per-token codes."""
        offsets, lengths, starts = read_boundaries(source, self._verified(index, source))
        check_boundaries(source, None, offsets, lengths, starts, None, self.seq_len + 1)
        return token_codes(offsets, lengths, starts, len(offsets) - 1, self.seq_len + 1)

    def _verified(self, index: int, source: str) -> Any:
        """Shard ``index``'s bytes, read from ``source`` (or the object store) and checked against the manifest."""
        if self.shipped_shards is not None:
            import pyarrow as pa
            import ray

            data = pa.py_buffer(ray.get(self.shipped_shards[index]))
        else:
            data = read_file(filesystem_for(self.uri)[0], source)
        verify_shard(source, data, self.shards[index], self.seq_len + 1)
        return data

    def _source(self, index: int) -> str:
        """Shard ``index``'s file (the path it is read from, unless shipped), as errors name it."""
        name = self.shards[index]["file"]
        if self.shipped_shards is not None:
            return f"{self.uri}/{name} (shipped)"
        return f"{filesystem_for(self.uri)[1]}/{name}"

    def __repr__(self) -> str:
        return (
            f"TokenDataset({self.uri!r}, split={self.split!r}, rows={self.num_rows}, seq_len={self.seq_len}, "
            f"micro_batch_size={self.micro_batch_size}, num_micro_batches={self.num_micro_batches}, "
            f"{'packed, ' if self.packed else ''}"
            f"next_step={self.next_step}{', shipped' if self.shipped_shards is not None else ''})"
        )
