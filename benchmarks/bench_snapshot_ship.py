"""What a worker's in-memory snapshot costs to ship, as Ray pickles it by default
(``torch.Tensor`` through ``torch.save``) vs as raw bytes
(:func:`raypipe.comm.task_tensors.as_shipped_state`, what ``snapshot()`` returns), CPU.

One actor holds a stage's state: ``--layers`` x Linear(``--width``, 4 x width)
with AdamW state after one step (weights, biases, exp_avg, exp_avg_sq: 3 x 4 x
512 x 2048 x 4 B = 50 MB at the defaults, 17 MB of it weights). Per contender and
step, timed inside the actor:

* ``put``: ``ray.put`` of the state (what Ray does with a task's result: serialize
  it into the object store), the cost the worker pays per snapshot;
* ``get``: ``ray.get`` of that object back into tensors the reader owns (what a
  heal or a snapshot keeper pays).

The two contenders alternate round by round (``alternate.run_rounds``); printed:
each one's median ms and the per-round ratio raw/torch with its spread.

    python benchmarks/bench_snapshot_ship.py --rounds 8 --steps 5
"""
from __future__ import annotations

import argparse
import statistics
import time

import ray
import torch

from alternate import add_round_arguments, command_line, print_table, round_ratios, run_rounds, spread
from raypipe.comm.task_tensors import as_shipped_state

CONTENDERS = ("torch", "raw")


@ray.remote
class StateHolder:
    """A stage's weights and AdamW state, shipped one way or the other."""

    def __init__(self, layers: int, width: int) -> None:
        self.model = torch.nn.ModuleList([torch.nn.Linear(width, 4 * width) for _ in range(layers)])
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        sum(layer(torch.randn(2, width)).sum() for layer in self.model).backward()  # every layer gets state
        self.optimizer.step()

    def state_bytes(self) -> int:
        tensors = list(self.model.state_dict().values())
        tensors += [value for state in self.optimizer.state.values() for value in state.values()]
        return sum(tensor.numel() * tensor.element_size() for tensor in tensors)

    def ship(self, contender: str, count: int) -> list[tuple[float, float]]:
        """``count`` snapshots shipped: (put seconds, get seconds) each."""
        timings = []
        for _ in range(count):
            state = {"layers": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}
            started = time.perf_counter()
            ref = ray.put(as_shipped_state(state) if contender == "raw" else state)
            put = time.perf_counter() - started
            started = time.perf_counter()
            copy = ray.get(ref)
            got = time.perf_counter() - started
            assert torch.equal(copy["layers"]["0.weight"], self.model[0].weight.detach())
            del copy, ref
            timings.append((put, got))
        return timings


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_round_arguments(parser, rounds=8, steps=5, warmup=2)
    parser.add_argument("--layers", type=int, default=4, help="Linear layers in the state (default 4)")
    parser.add_argument("--width", type=int, default=512, help="their input width; output 4x (default 512)")
    args = parser.parse_args()
    print(command_line())
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        holder = StateHolder.remote(args.layers, args.width)
        state_mb = ray.get(holder.state_bytes.remote()) / 1e6
        results = run_rounds({name: (lambda count, name=name: ray.get(holder.ship.remote(name, count)))
                              for name in CONTENDERS}, args.rounds, args.steps, args.warmup)
    finally:
        ray.shutdown()
    rows = []
    for phase, index in (("put", 0), ("get", 1)):
        seconds = {name: [timing[index] for timing in results[name]] for name in CONTENDERS}
        medians = {name: statistics.median(values) * 1e3 for name, values in seconds.items()}
        ratios = round_ratios(seconds["raw"], seconds["torch"], args.steps)
        rows.append([phase, f"{state_mb:.0f}", f"{medians['torch']:.1f}", f"{medians['raw']:.1f}", spread(ratios)])
    print_table(["phase", "state MB", "torch ms", "raw ms", "raw/torch per round"], rows)


if __name__ == "__main__":
    main()
