"""Where the lowering puts a step's messages, and what that costs once a message takes time.

A pure computation (no process, no Ray): for each schedule, at the timed-layer benchmark's shape
(``bench_timed_schedules.py``: p = 4 stages of 2 layers, 4 ms a layer's forward, input gradient and
weight gradient), the step's time when every message between two workers takes ``L`` seconds,
three ways:

* **order alone**: the schedule's compute order run eagerly, each op starting once its worker is
  free and its input is in (``L`` after its producer on another worker ended; at once on the same
  worker). No runtime can do better with that order; torch.distributed.pipelining's runtime on
  gloo comes closest (it sends as an op ends and waits for a receive only at the op that uses it);
* **raypipe's list, as gloo runs it**: raypipe's lowered ops (``raypipe.core.lowering.lower``) run as
  its step runner runs them on gloo: a send leaves when its worker reaches it in the list (a send the
  lowering moved after the next compute op, so that NCCL's rendezvous cannot deadlock it, leaves
  that much later), every receive is posted ahead and waited for only by the op that uses it;
* **raypipe's list, as NCCL's batches run it**: ``simulate_timed`` (buffered sends, learned shapes),
  which holds a worker at an EXCHANGE until all of it is in, as one ``batch_isend_irecv`` does.

Where the first two agree, the lowering costs nothing on gloo and a gap to the peer is in the
runtime (its time per op or per message), not in the op list.

    python benchmarks/bench_message_placement.py --micro-batches 8 16 --latency-ms 0 0.2 0.5
"""
from __future__ import annotations

import argparse
from collections.abc import Sequence

from raypipe.core.lowering import LoweredOp, lower
from raypipe.core.ops import COMPUTE, SEND_ACT, SEND_GRAD, boundary_of, virtual_stage, worker_and_chunk
from raypipe.core.schedule import PLACEMENT, SCHEDULES, SINGLE_CHUNK_SCHEDULES, Op, make_schedule
from raypipe.core.timed_simulation import simulate_timed


def run_eagerly(ops: Sequence[Sequence[Op | LoweredOp]], op_seconds: dict[str, float], latency_s: float,
                num_chunks: int, placement: str, sends_in_list: bool) -> float:
    """The step's time of ``ops`` (per worker, in order) where each compute op starts once its worker is
    free and its input is in. A message to another worker arrives ``latency_s`` after it leaves: as
    its producing op ends, or (``sends_in_list``) when its worker reaches its SEND in ``ops``."""
    num_stages = len(ops)
    last = num_stages * num_chunks - 1
    left: dict[tuple[str, int, int], tuple[float, int]] = {}  # (kind, micro-batch, boundary) -> (when, from)
    now, position = [0.0] * num_stages, [0] * num_stages
    remaining = sum(len(worker_ops) for worker_ops in ops)
    while remaining:
        moved = False
        for stage in range(num_stages):
            while position[stage] < len(ops[stage]):
                op = ops[stage][position[stage]]
                if op.kind not in COMPUTE:  # a send (alone or in an EXCHANGE) leaves now; receives wait at their op
                    for part in op.unbatched():
                        if part.kind in (SEND_ACT, SEND_GRAD):
                            key = ("act" if part.kind == SEND_ACT else "grad", part.micro_batch,
                                   boundary_of(stage, part.chunk, part.kind, num_stages, placement))
                            left[key] = (now[stage], stage)
                    position[stage] += 1
                    remaining -= 1
                    moved = True
                    continue
                own = virtual_stage(stage, op.chunk, num_stages, placement)
                needs = []
                if op.kind == "F" and own > 0:
                    needs.append(("act", op.micro_batch, own))
                if op.kind in ("B", "I") and own < last:
                    needs.append(("grad", op.micro_batch, own + 1))
                if any(need not in left for need in needs):
                    break
                start = max([now[stage]] + [when + (latency_s if source != stage else 0.0)
                                            for when, source in (left[need] for need in needs)])
                now[stage] = start + op_seconds[op.kind]
                made = []
                if op.kind == "F" and own < last:
                    made.append((("act", op.micro_batch, own + 1), own + 1))
                if op.kind in ("B", "I") and own > 0:
                    made.append((("grad", op.micro_batch, own), own - 1))
                for key, to in made:
                    if not sends_in_list or worker_and_chunk(to, num_stages, placement)[0] == stage:
                        left[key] = (now[stage], stage)  # handed on as it is made (on this worker: no message)
                position[stage] += 1
                remaining -= 1
                moved = True
        if not moved:
            raise RuntimeError("no worker can move on: an input is never sent")
    return max(now)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", "-p", type=int, default=4)
    parser.add_argument("--micro-batches", "-m", type=int, nargs="+", default=[8, 16])
    parser.add_argument("--layers-per-stage", type=int, default=2)
    parser.add_argument("--layer-ms", type=float, default=4.0,
                        help="each layer's forward, input-gradient and weight-gradient time (default 4)")
    parser.add_argument("--latency-ms", type=float, nargs="+", default=[0.0, 0.2, 0.5],
                        help="a message's time from its send to its receiver (default 0 0.2 0.5)")
    parser.add_argument("--schedules", nargs="+", choices=SCHEDULES,
                        default=["gpipe", "1f1b", "zb_h1", "interleaved_1f1b", "zbv"])
    args = parser.parse_args()
    print("step ms: order alone / raypipe's list as gloo runs it / as NCCL's batches run it")
    print("| schedule, m | " + " | ".join(f"L = {latency:g} ms" for latency in args.latency_ms) + " |")
    print("|---|" + "---|" * len(args.latency_ms))
    for name in args.schedules:
        chunks = 1 if name in SINGLE_CHUNK_SCHEDULES else 2
        layer_s = args.layers_per_stage / chunks * args.layer_ms / 1e3
        op_seconds = {"F": layer_s, "B": 2 * layer_s, "I": layer_s, "W": layer_s}
        placement = PLACEMENT[name]
        for micro_batches in args.micro_batches:
            schedule = make_schedule(name, args.stages, micro_batches, chunks)
            lowered = lower(schedule, placement)
            cells = []
            for latency_ms in args.latency_ms:
                latency_s = latency_ms / 1e3
                alone = run_eagerly(schedule, op_seconds, latency_s, chunks, placement, sends_in_list=False)
                listed = run_eagerly(lowered, op_seconds, latency_s, chunks, placement, sends_in_list=True)
                batched = simulate_timed(lowered, lambda stage, op: op_seconds.get(op.kind, 0.0), latency_s,
                                         buffered_sends=True, placement=placement, boundary_shapes="learned").step_s
                cells.append(f"{1e3 * alone:.1f} / {1e3 * listed:.1f} / {1e3 * batched:.1f}")
            print(f"| {name}, {micro_batches} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
