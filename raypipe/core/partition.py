"""Split a list of layers into contiguous pipeline stages, and place them on workers."""
from __future__ import annotations

from collections.abc import Callable, Sequence

from raypipe.core.ops import LOOPED, virtual_stage


def partition_by_cost(costs: Sequence[float], num_stages: int) -> list[int]:
    """Layers per stage for a contiguous split minimizing the largest stage cost
    (:func:`min_max_partition` with no memory limit, over the costs as floats).

    Every stage gets at least one layer. Ties favour earlier stages taking fewer
    layers.
    """
    return min_max_partition([float(cost) for cost in costs], num_stages)


def min_max_partition(times: Sequence[float], num_stages: int,
                      fits: Callable[[int, int, int], bool] | None = None,
                      stage_weights: Sequence[float] | None = None) -> list[int]:
    """Layers per stage of the contiguous split minimising the largest stage's summed time,
    among those where ``fits(stage_index, first, end)`` holds for every stage (None: all).
    ``stage_weights``: each stage's summed time is multiplied by its weight (a stage on a
    worker that runs ``w`` times slower; None: 1 each).

    Every stage gets at least one layer; ties favour earlier stages taking fewer layers.
    Raises ValueError when no split fits.
    """
    num_layers = len(times)
    if not 1 <= num_stages <= num_layers:
        raise ValueError(f"cannot split {num_layers} layers into {num_stages} stages")
    if stage_weights is not None and len(stage_weights) != num_stages:
        raise ValueError(f"{len(stage_weights)} stage weights for {num_stages} stages")
    prefix = [0]
    for time in times:
        prefix.append(prefix[-1] + time)
    inf = float("inf")
    # best[s][e]: the smallest bottleneck putting the first e layers on s stages (inf: none fits)
    best = [[inf] * (num_layers + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (num_layers + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0
    for stages in range(1, num_stages + 1):
        previous = best[stages - 1]
        # only starts the earlier stages can reach: any other gives an infinite bottleneck, which
        # never wins (the search is over once only those are left), so it is not looked at
        reachable = [start for start in range(stages - 1, num_layers) if previous[start] != inf]
        # the layers after ``end`` must leave one for each later stage; the last stage ends at the
        # last layer (no other end of it is read back)
        first_end = num_layers if stages == num_stages else stages
        weight = 1.0 if stage_weights is None else stage_weights[stages - 1]
        for end in range(first_end, num_layers - (num_stages - stages) + 1):
            # the smallest bottleneck, then the smallest start; with ``fits``, the first of that
            # order which fits, a stage's memory asked only until one does. The smallest pair is
            # the first in that order: most often it fits, and the rest need not be made and sorted
            chosen = None
            for start in reachable:  # in increasing order: the first of equal bottlenecks is kept
                if start >= end:
                    break
                bottleneck = max(previous[start], weight * (prefix[end] - prefix[start]))
                if chosen is None or bottleneck < chosen[0]:
                    chosen = (bottleneck, start)
            if chosen is None:
                continue
            if chosen[0] == inf:  # no finite bottleneck: the cell stays unreachable
                continue
            if fits is not None and not fits(stages - 1, chosen[1], end):
                pairs = [(max(previous[start], weight * (prefix[end] - prefix[start])), start)
                         for start in reachable if start < end]
                chosen = None
                for pair in sorted(pairs)[1:]:
                    if pair[0] == inf:
                        break
                    if fits(stages - 1, pair[1], end):
                        chosen = pair
                        break
                if chosen is None:
                    continue
            best[stages][end], cut[stages][end] = chosen
    if best[num_stages][num_layers] == inf:
        raise ValueError(f"no contiguous split of {num_layers} layers into {num_stages} stages fits")
    sizes, end = [], num_layers
    for stages in range(num_stages, 0, -1):
        start = cut[stages][end]
        sizes.append(end - start)
        end = start
    return sizes[::-1]


def stage_layer_ranges(balance: Sequence[int]) -> list[range]:
    """Global layer indices of each stage, from layers-per-stage."""
    ranges, start = [], 0
    for size in balance:
        ranges.append(range(start, start + size))
        start += size
    return ranges


def worker_chunks(balance: Sequence[int], num_workers: int, placement: str = LOOPED) -> list[list[range]]:
    """Each worker's model chunks, as global layer indices in chunk order, from layers per
    virtual stage (``balance``: ``num_workers x v`` entries in model order; one entry per worker
    is the plain pipeline), placed by ``placement`` (see :data:`raypipe.core.ops.PLACEMENTS`)."""
    ranges = stage_layer_ranges(balance)
    num_chunks, rest = divmod(len(ranges), num_workers)
    if rest or not num_chunks:
        raise ValueError(f"{len(ranges)} virtual stages do not make {num_workers} workers' chunks")
    return [[ranges[virtual_stage(worker, chunk, num_workers, placement)] for chunk in range(num_chunks)]
            for worker in range(num_workers)]


def worker_layers(balance: Sequence[int], num_workers: int, placement: str = LOOPED) -> list[list[int]]:
    """Each worker's global layer indices, its chunks one after the other (:func:`worker_chunks`)."""
    return [[index for chunk in chunks for index in chunk] for chunks in worker_chunks(balance, num_workers, placement)]
