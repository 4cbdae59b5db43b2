"""Split a list of layers into contiguous pipeline stages."""
from __future__ import annotations

from collections.abc import Sequence


def partition_by_cost(costs: Sequence[float], num_stages: int) -> list[int]:
    """Layers per stage for a contiguous split minimizing the largest stage cost.

    Every stage gets at least one layer. Ties favour earlier stages taking fewer
    layers. Exact dynamic programme, O(stages * layers^2): fine for the few
    hundred layers a pipeline has.
    """
    num_layers = len(costs)
    if not 1 <= num_stages <= num_layers:
        raise ValueError(f"cannot split {num_layers} layers into {num_stages} stages")
    prefix = [0.0]
    for cost in costs:
        prefix.append(prefix[-1] + float(cost))
    inf = float("inf")
    # best[s][i]: smallest max-stage-cost putting the first i layers on s stages
    best = [[inf] * (num_layers + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (num_layers + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for stages in range(1, num_stages + 1):
        for end in range(stages, num_layers + 1):
            for start in range(stages - 1, end):
                candidate = max(best[stages - 1][start], prefix[end] - prefix[start])
                if candidate < best[stages][end]:
                    best[stages][end], cut[stages][end] = candidate, start
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
