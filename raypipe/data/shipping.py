"""A local dataset for workers that cannot open it: its shard files, put in
Ray's object store by the driver."""
from __future__ import annotations

import copy

import numpy as np
import ray

from raypipe.data.dataset import TokenDataset
from raypipe.data.shards import read_file
from raypipe.filesystem import filesystem_for


def shard_bytes(dataset: TokenDataset) -> int:
    """The size of the split's shard files: what shipping puts in the object store."""
    filesystem, base = filesystem_for(dataset.uri)
    return sum(info.size for info in filesystem.get_file_info([f"{base}/{s['file']}" for s in dataset.shards]))


def ship(dataset: TokenDataset) -> TokenDataset:
    """A copy of ``dataset`` that reads its shards from Ray's object store.

    The files go in once, one at a time, with ``ray.put`` from this process, so
    the driver owns them: they live as long as the driver holds the copy, which
    outlives every stage worker (a worker that dies does not take them along, as
    it would objects it owned), and go when the run drops it (a detached actor
    would outlive the job). Readers fetch a shard when a micro-batch needs it and
    check it against the manifest as they would the file.
    """
    filesystem, base = filesystem_for(dataset.uri)
    refs = [ray.put(np.frombuffer(read_file(filesystem, f"{base}/{shard['file']}"), dtype=np.uint8))
            for shard in dataset.shards]
    shipped = copy.copy(dataset)
    shipped.shipped_shards = refs
    shipped.reset_caches()
    return shipped
