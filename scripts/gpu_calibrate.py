"""Calibrate the step-time predictor on one GPU: measured against predicted.

Measures, on one GPU in bf16 (flash-attn when it imports, else SDPA):

- a LLaMA 1B's per-layer times for one micro-batch: the forward (F), the gradient of
  the layer's input (I) and of its weights (W), each as a worker's split backward runs it
  (:mod:`raypipe.stage.split_backward`), for the embedding, one block and the head with
  the cross entropy; and the host's time to issue the forward (when it is near F's, the
  layer is launch-bound: the device waits for the host);
- the whole model's forward and backward on one GPU, as MFU (the model's flops of one
  training pass / time / the precision's peak);
- host <-> device copy bandwidth with pinned host memory (what a snapshot's copy runs at);

and prints each beside what :mod:`raypipe.planning.predict` assumes for the same shapes on
the card's cluster preset (``planning/clusters/h100.json`` or ``h200.json``: the layers'
flops at ``peak x achievable_fraction``, the host copy at ``host_copy_bytes_per_s``).
The ratio measured / predicted is the correction a plan on that card needs.

    python scripts/gpu_calibrate.py [--cluster h100|h200] [--out FILE]
    python scripts/gpu_calibrate.py --model llama3-8b --seq-len 8192   # another shape (default: a LLaMA 1B at 2048)
    python scripts/gpu_calibrate.py --cpu   # the CPU path: a tiny LLaMA in fp32 (a dry run)

With ``--tensor-parallel N`` (N GPUs of one node, NCCL; on ``--cpu`` N processes over gloo, a
dry run) it times one block split over the N ranks as a stage splits it (the LLaMA's plan,
:func:`raypipe.models.tensor_parallel.parallelize_layer`, sequence parallel unless
``--no-sequence-parallel``): each rank's F, I and W against the predictor's (the block's flops
/ N at the preset's rate, plus its collectives on the node's link, as
:mod:`raypipe.planning.pipeline_prediction` adds them), and the block's collectives alone
(all-gather and reduce-scatter, or all-reduce, of one micro-batch's hidden state) against
:func:`raypipe.planning.tensor_parallel_collectives.collective_seconds`:

    python scripts/gpu_calibrate.py --tensor-parallel 2            # two GPUs of one node
    python scripts/gpu_calibrate.py --cpu --tensor-parallel 2      # the CPU path (gloo): a dry run

``scripts/gpu_check.sh --calibrate`` runs it (at most ~4 minutes on an H100/H200; the
tensor-parallel part only where two GPUs exist).
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, installed or not

from raypipe.models.llama import get_config, llama_layers, llama_loss  # noqa: E402
from raypipe.models.llama_costs import llama_layer_cost, llama_layer_costs  # noqa: E402
from raypipe.models.layers import build_layer  # noqa: E402
from raypipe.planning.cluster_spec import load_cluster  # noqa: E402
from raypipe.planning.tensor_parallel_collectives import collective_seconds, llama_layer_collectives  # noqa: E402
from raypipe.stage.split_backward import input_gradient  # noqa: E402

GPU_SHAPE = {"model": "llama-1b", "micro_batch_size": 1, "seq_len": 2048, "precision": "bf16"}
CPU_SHAPE = {"model": "tiny", "micro_batch_size": 2, "seq_len": 64, "precision": "fp32"}
REPEATS, WARMUPS = 5, 2
CPU_REPEATS, CPU_WARMUPS = 2, 1  # the CPU path checks that everything runs, not the figures


class Clock:
    """Seconds of a piece of work: CUDA events on a GPU (the host only queues the
    kernels), the host's clock on a CPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.repeats, self.warmups = (REPEATS, WARMUPS) if self.cuda else (CPU_REPEATS, CPU_WARMUPS)

    def seconds(self, work: Callable[[], Any]) -> tuple[float, Any]:
        elapsed, _, result = self.timed(work)
        return elapsed, result

    def timed(self, work: Callable[[], Any]) -> tuple[float, float, Any]:
        """(seconds, the host's seconds to issue the work, result). On a GPU the two agree when the
        host issues kernels no faster than the device runs them: the work is launch-bound."""
        if not self.cuda:
            start = time.perf_counter()
            result = work()
            elapsed = time.perf_counter() - start
            return elapsed, elapsed, result
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        issued = time.perf_counter()
        result = work()
        issued = time.perf_counter() - issued
        end.record()
        end.synchronize()
        return begin.elapsed_time(end) / 1e3, issued, result


def _layer_times(layer: torch.nn.Module, make_input: Callable[[], torch.Tensor], loss_of: Callable | None,
                 clock: Clock) -> dict[str, float]:
    """Median F, I and W seconds of ``layer`` (I is 0 for an integer input: nothing flows back),
    and F_host: the host's seconds to issue the forward."""
    params = [p for p in layer.parameters() if p.requires_grad]
    times: dict[str, list[float]] = {"F": [], "I": [], "W": [], "F_host": []}
    for repeat in range(clock.warmups + clock.repeats):
        inputs = make_input()
        differentiable = inputs.is_floating_point()
        if differentiable:
            inputs.requires_grad_(True)
        forward_s, forward_host_s, output = clock.timed(
            lambda: layer(inputs) if loss_of is None else loss_of(layer(inputs)))
        seed = torch.ones_like(output) if output.dim() == 0 else torch.randn_like(output)
        # I and W as a worker runs them under a split backward (raypipe.stage.split_backward): W
        # restarts from the gradients I noted where the weights' branches leave the input path,
        # so it does not run I's path again (autograd.grad(output, params) would)
        input_s, (_, pending) = clock.seconds(
            lambda: input_gradient(output, seed, inputs if differentiable else None, params))
        if not differentiable:  # nothing flows back: W runs the whole backward, and there is no I
            input_s = 0.0
        weight_s, _ = clock.seconds(pending.run)
        for param in params:
            param.grad = None
        if repeat >= clock.warmups:
            for key, value in (("F", forward_s), ("I", input_s), ("W", weight_s), ("F_host", forward_host_s)):
                times[key].append(value)
    return {key: statistics.median(values) for key, values in times.items()}


def _predicted(config, kind: str, shape: dict, rate: float) -> dict[str, float]:
    cost = llama_layer_cost(config, kind, shape["seq_len"], shape["precision"])
    batch = shape["micro_batch_size"]
    return {"F": batch * cost.fwd_flops / rate, "I": batch * cost.bwd_input_flops / rate,
            "W": batch * cost.bwd_weight_flops / rate}


def _copy_bandwidth(device: torch.device, clock: Clock, size_bytes: int) -> dict[str, float]:
    """Pinned host -> device and device -> host bytes/s (median of a few copies)."""
    host = torch.empty(size_bytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    on_device = torch.empty(size_bytes, dtype=torch.uint8, device=device)
    rates = {"host_to_device": [], "device_to_host": []}
    for repeat in range(clock.warmups + clock.repeats):
        up, _ = clock.seconds(lambda: on_device.copy_(host, non_blocking=True))
        down, _ = clock.seconds(lambda: host.copy_(on_device, non_blocking=True))
        if repeat >= clock.warmups:
            rates["host_to_device"].append(size_bytes / up)
            rates["device_to_host"].append(size_bytes / down)
    return {key: statistics.median(values) for key, values in rates.items()}


def calibrate(cpu: bool, cluster_name: str | None = None, shape: dict[str, Any] | None = None,
              whole_model: bool = True) -> dict[str, Any]:
    """Every measurement beside its prediction; see the module's docstring. ``shape``: the
    model, micro-batch size, sequence length and precision (default: the path's own);
    ``whole_model=False`` times the layers alone (a model too large for one device)."""
    shape = {**(CPU_SHAPE if cpu else GPU_SHAPE), **(shape or {})}
    device = torch.device("cpu" if cpu else "cuda")
    dtype = torch.float32 if shape["precision"] == "fp32" else torch.bfloat16
    card = "cpu" if cpu else torch.cuda.get_device_name(device)
    cluster_name = cluster_name or ("h200" if "H200" in card else "h100")
    cluster = load_cluster(cluster_name)
    rate = cluster.flops_per_s(shape["precision"])
    config = get_config(shape["model"]).replace(max_seq_len=max(shape["seq_len"], get_config(shape["model"]).max_seq_len))
    batch, seq_len = shape["micro_batch_size"], shape["seq_len"]
    clock = Clock(device)
    torch.manual_seed(0)
    specs = llama_layers(config)
    with device:  # initialised where they run: a 70B block's weights take minutes to draw on a host's cores
        built = {"embedding": build_layer(specs[0], 0, 0), "block": build_layer(specs[1], 1, 0),
                 "head": build_layer(specs[-1], len(specs) - 1, 0)}
    tokens = lambda: torch.randint(0, config.vocab_size, (batch, seq_len), device=device)  # noqa: E731
    hidden = lambda: torch.randn(batch, seq_len, config.dim, device=device, dtype=dtype)  # noqa: E731
    targets = tokens()
    inputs = {"embedding": (tokens, None), "block": (hidden, None),
              "head": (hidden, lambda logits: llama_loss(logits.float(), targets))}
    layers: dict[str, Any] = {}
    for kind, layer in built.items():
        layer = layer.to(device=device, dtype=dtype)
        measured = _layer_times(layer, *inputs[kind], clock)
        predicted = _predicted(config, kind, shape, rate)
        layers[kind] = {op: {"measured_s": measured[op], "predicted_s": predicted[op],
                             "measured_over_predicted": measured[op] / predicted[op] if predicted[op] else None}
                        for op in ("F", "I", "W")}
        layers[kind]["F"]["host_issue_s"] = measured["F_host"]
        built[kind] = None  # free it before the whole model
        del layer
    results: dict[str, Any] = {"card": card, "cluster": cluster_name, "shape": shape, "layers": layers,
                               "achievable_fraction": cluster.achievable_fraction}
    if whole_model:
        results["whole_model"] = _whole_model(config, specs, shape, device, dtype, clock, cluster)
    size = (16 if cpu else 1024) * 2**20
    bandwidth = _copy_bandwidth(device, clock, size)
    results["host_copy"] = {**{f"{key}_bytes_per_s": value for key, value in bandwidth.items()},
                            "predicted_bytes_per_s": cluster.host_copy_bytes_per_s}
    return results


def _whole_model(config, specs, shape: dict, device: torch.device, dtype: torch.dtype, clock: Clock,
                 cluster) -> dict[str, float]:
    """Forward and backward of every layer on this one device: measured MFU against the
    predictor's (its ``achievable_fraction`` is the MFU it assumes of a busy GPU)."""
    with device:
        model = torch.nn.Sequential(*[build_layer(spec, index, 0) for index, spec in enumerate(specs)]).to(
            device=device, dtype=dtype)
    batch, seq_len = shape["micro_batch_size"], shape["seq_len"]
    tokens = torch.randint(0, config.vocab_size, (batch, seq_len + 1), device=device)

    def train_pass() -> None:
        llama_loss(model(tokens[:, :-1]).float(), tokens[:, 1:]).backward()

    seconds = []
    for repeat in range(clock.warmups + clock.repeats):
        elapsed, _ = clock.seconds(train_pass)
        if repeat >= clock.warmups:
            seconds.append(elapsed)
    step_s = statistics.median(seconds)
    # the shape's sequence length: the specs' own costs are at the model's max_seq_len
    flops = batch * sum(cost.train_flops for cost in llama_layer_costs(config, seq_len, shape["precision"]))
    peak = cluster.peak(shape["precision"])
    predicted_s = flops / cluster.flops_per_s(shape["precision"])
    return {"train_pass_s": step_s, "predicted_s": predicted_s, "mfu": flops / step_s / peak,
            "predicted_mfu": flops / predicted_s / peak, "tokens_per_s": batch * seq_len / step_s}


def calibrate_tensor_parallel(cpu: bool, tensor_parallel: int, cluster_name: str | None = None,
                              shape: dict[str, Any] | None = None, sequence_parallel: bool = True) -> dict[str, Any]:
    """One block split over ``tensor_parallel`` ranks, each a process spawned here (one GPU each,
    NCCL; gloo on ``cpu``): every rank's F, I and W and the block's collectives alone, the
    slowest rank's median of each (a stage's op ends with its slowest rank), beside the
    predictor's. See the module's docstring."""
    shape = {**(CPU_SHAPE if cpu else GPU_SHAPE), **(shape or {})}
    # a fork server that imported torch and raypipe once forks the ranks (no CUDA in it: forked ranks
    # may still initialise their own), instead of each rank importing them again
    multiprocessing.set_forkserver_preload(["torch", "torch.distributed.tensor.parallel", "raypipe.models.llama",
                                            "raypipe.models.tensor_parallel"])
    with tempfile.TemporaryDirectory() as folder:
        torch.multiprocessing.start_processes(
            _tensor_parallel_rank, nprocs=tensor_parallel, join=True, start_method="forkserver",
            args=(tensor_parallel, cpu, cluster_name, shape, sequence_parallel, folder))
        return json.loads((Path(folder) / "results.json").read_text())


def _tensor_parallel_rank(rank: int, tensor_parallel: int, cpu: bool, cluster_name: str | None, shape: dict[str, Any],
                          sequence_parallel: bool, folder: str) -> None:
    """:func:`calibrate_tensor_parallel`'s rank ``rank``; rank 0 writes the results to ``folder``."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    from raypipe.models.tensor_parallel import parallelize_layer

    device = torch.device("cpu") if cpu else torch.device("cuda", rank)
    if not cpu:
        torch.cuda.set_device(device)
    # a file store: no port to choose, so none another process can take first
    store = dist.FileStore(os.path.join(folder, "store"), tensor_parallel)
    dist.init_process_group("gloo" if cpu else "nccl", store=store, rank=rank, world_size=tensor_parallel)
    try:
        mesh = DeviceMesh(device.type, list(range(tensor_parallel)))
        dtype = torch.float32 if shape["precision"] == "fp32" else torch.bfloat16
        model = get_config(shape["model"])
        config = model.replace(max_seq_len=max(shape["seq_len"], model.max_seq_len))
        batch, seq_len, t = shape["micro_batch_size"], shape["seq_len"], tensor_parallel
        spec = llama_layers(config)[1]
        torch.manual_seed(0)
        with device:
            block = build_layer(spec, 1, 0).to(device=device, dtype=dtype)
        parallelize_layer(block, spec.tp_plan, mesh, sequence_parallel=sequence_parallel)
        local_seq = seq_len // t if sequence_parallel else seq_len  # under sequence parallelism a rank holds a shard
        clock = Clock(device)
        measured = _layer_times(block, lambda: torch.randn(batch, local_seq, config.dim, device=device, dtype=dtype),
                                None, clock)
        collectives = _collective_times(device, dtype, clock, (batch, seq_len, config.dim), t, sequence_parallel)
        everyone: list[Any] = [None] * t
        dist.all_gather_object(everyone, {**measured, **collectives})
        if rank == 0:
            card = "cpu" if cpu else torch.cuda.get_device_name(device)
            cluster_name = cluster_name or ("h200" if "H200" in card else "h100")
            slowest = {key: max(times[key] for times in everyone) for key in everyone[0]}
            results = _tensor_parallel_results(config, shape, t, sequence_parallel, load_cluster(cluster_name), slowest)
            results.update(card=card, cluster=cluster_name)
            (Path(folder) / "results.json").write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()


def _collective_times(device: torch.device, dtype: torch.dtype, clock: Clock, hidden_shape: tuple[int, int, int],
                      tensor_parallel: int, sequence_parallel: bool) -> dict[str, float]:
    """Median seconds of the block's collectives on one micro-batch's hidden state: an all-gather
    and a reduce-scatter along the sequence with sequence parallelism, else an all-reduce."""
    import torch.distributed as dist

    whole = torch.randn(*hidden_shape, device=device, dtype=dtype)
    shard = torch.empty(hidden_shape[0] * hidden_shape[1] // tensor_parallel, hidden_shape[2], device=device,
                        dtype=dtype)
    flat = whole.view(-1, hidden_shape[2])
    # torch 2.13 renamed them (*_single); the older names still run on the GPU machines' torch 2.11
    all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    works = ({"all_gather": lambda: all_gather(flat, shard),
              "reduce_scatter": lambda: reduce_scatter(shard, flat)} if sequence_parallel
             else {"all_reduce": lambda: dist.all_reduce(whole)})
    times: dict[str, float] = {}
    for name, work in works.items():
        seconds = []
        for repeat in range(clock.warmups + clock.repeats):
            dist.barrier()  # every rank starts together: the time is the collective's, not a late peer's
            elapsed, _ = clock.seconds(work)
            if repeat >= clock.warmups:
                seconds.append(elapsed)
        times[name] = statistics.median(seconds)
    return times


def _tensor_parallel_results(config, shape: dict[str, Any], tensor_parallel: int, sequence_parallel: bool, cluster,
                             measured: dict[str, float]) -> dict[str, Any]:
    """The slowest rank's ``measured`` times beside the predictor's for the same block and link."""
    t, batch, link = tensor_parallel, shape["micro_batch_size"], cluster.intra_node
    compute = {op: seconds / t for op, seconds in
               _predicted(config, "block", shape, cluster.flops_per_s(shape["precision"])).items()}
    block = llama_layer_collectives(config, shape["seq_len"], shape["precision"],
                                    sequence_parallel=sequence_parallel)[1]
    # a layer's backward collectives belong to its input gradient (I), which waits for them
    communicated = {"F": collective_seconds(block.forward, t, link, batch),
                    "I": collective_seconds(block.backward, t, link, batch), "W": 0.0}
    ops = {op: {"measured_s": measured[op], "predicted_s": compute[op] + communicated[op],
                "predicted_compute_s": compute[op], "predicted_collectives_s": communicated[op],
                "measured_over_predicted": measured[op] / (compute[op] + communicated[op])}
           for op in ("F", "I", "W")}
    hidden_bytes = batch * shape["seq_len"] * config.dim * (4 if shape["precision"] == "fp32" else 2)
    passes = {"all_gather": 1, "reduce_scatter": 1, "all_reduce": 2}
    collectives = {}
    for name in passes.keys() & measured.keys():
        predicted = link.ring_seconds(passes[name], hidden_bytes, t)
        collectives[name] = {"bytes": hidden_bytes, "measured_s": measured[name], "predicted_s": predicted,
                             "measured_over_predicted": measured[name] / predicted}
    return {"tensor_parallel": t, "sequence_parallel": sequence_parallel, "shape": shape,
            "achievable_fraction": cluster.achievable_fraction, "block": ops, "collectives": collectives}


def print_tensor_parallel_table(results: dict[str, Any]) -> None:
    print(f"card {results['card']} x {results['tensor_parallel']} (one block split, sequence parallel "
          f"{'on' if results['sequence_parallel'] else 'off'}); predictor: cluster preset {results['cluster']!r}, "
          f"achievable_fraction {results['achievable_fraction']}; shape {results['shape']}")
    print(f"{'op':<15} {'measured ms':>12} {'predicted ms':>13} {'ratio':>7}  (predicted compute + collectives ms)")
    for op, row in results["block"].items():
        print(f"block {op:<9} {row['measured_s'] * 1e3:>12.3f} {row['predicted_s'] * 1e3:>13.3f} "
              f"{row['measured_over_predicted']:>7.2f}  ({row['predicted_compute_s'] * 1e3:.3f} + "
              f"{row['predicted_collectives_s'] * 1e3:.3f})")
    for name, row in sorted(results["collectives"].items()):
        print(f"{name:<15} {row['measured_s'] * 1e3:>12.3f} {row['predicted_s'] * 1e3:>13.3f} "
              f"{row['measured_over_predicted']:>7.2f}  ({row['bytes'] / 2**20:.1f} MiB)")


def print_table(results: dict[str, Any]) -> None:
    print(f"card {results['card']}; predictor: cluster preset {results['cluster']!r}, "
          f"achievable_fraction {results['achievable_fraction']}; shape {results['shape']}")
    print(f"{'layer':<10} {'op':<3} {'measured ms':>12} {'predicted ms':>13} {'ratio':>7}  host issue ms")
    for kind, ops in results["layers"].items():
        for op, row in ops.items():
            ratio = row["measured_over_predicted"]
            issue = f"{row['host_issue_s'] * 1e3:>14.3f}" if "host_issue_s" in row else ""
            print(f"{kind:<10} {op:<3} {row['measured_s'] * 1e3:>12.3f} {row['predicted_s'] * 1e3:>13.3f} "
                  f"{'-' if ratio is None else f'{ratio:.2f}':>7}{issue}")
    whole = results.get("whole_model")
    if whole is None:
        print("whole model: not run (--layers-only)")
    else:
        print(f"whole model, one train pass: {whole['train_pass_s'] * 1e3:.1f} ms measured, "
              f"{whole['predicted_s'] * 1e3:.1f} ms predicted; MFU {whole['mfu']:.3f} measured, "
              f"{whole['predicted_mfu']:.3f} predicted")
    copy = results["host_copy"]
    print(f"host copy (pinned): H2D {copy['host_to_device_bytes_per_s'] / 1e9:.1f} GB/s, "
          f"D2H {copy['device_to_host_bytes_per_s'] / 1e9:.1f} GB/s; predicted {copy['predicted_bytes_per_s'] / 1e9:.1f} GB/s")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="the CPU path: a tiny LLaMA in fp32 (no CUDA needed)")
    parser.add_argument("--cluster", help="the preset to compare with (default: h200 on an H200, else h100)")
    parser.add_argument("--out", help="also write the results here as JSON")
    parser.add_argument("--model", help=f"the model whose layers are timed (default: {GPU_SHAPE['model']}; "
                                        f"{CPU_SHAPE['model']} on --cpu)")
    parser.add_argument("--seq-len", type=int, help="tokens of a sequence (default: "
                                                    f"{GPU_SHAPE['seq_len']}; {CPU_SHAPE['seq_len']} on --cpu)")
    parser.add_argument("--micro-batch-size", type=int, help="sequences of a micro-batch (default: 1; 2 on --cpu)")
    parser.add_argument("--tensor-parallel", type=int, default=1, metavar="N",
                        help="time one block split over N GPUs of this node (N processes over gloo on --cpu) "
                             "against the predictor, instead of the one-GPU calibration")
    parser.add_argument("--no-sequence-parallel", action="store_true",
                        help="with --tensor-parallel: the block without sequence parallelism (all-reduces)")
    parser.add_argument("--layers-only", action="store_true",
                        help="time the layers alone, not the whole model (one too large for the device)")
    args = parser.parse_args(argv)
    shape = {key: value for key, value in (("model", args.model), ("seq_len", args.seq_len),
                                           ("micro_batch_size", args.micro_batch_size)) if value is not None}
    if "model" in shape:
        try:
            get_config(shape["model"])
        except ValueError as error:
            parser.error(str(error))
    for key in ("seq_len", "micro_batch_size"):
        if key in shape and shape[key] < 1:
            parser.error(f"--{key.replace('_', '-')} must be at least 1, got {shape[key]}")
    if args.tensor_parallel < 1:
        parser.error(f"--tensor-parallel must be at least 1, got {args.tensor_parallel}")
    if not args.cpu and not torch.cuda.is_available():
        print("gpu_calibrate: CUDA is not available here; use --cpu for the CPU path", file=sys.stderr)
        return 2
    if args.tensor_parallel > 1:
        if not args.cpu and torch.cuda.device_count() < args.tensor_parallel:
            print(f"gpu_calibrate: --tensor-parallel {args.tensor_parallel} needs {args.tensor_parallel} GPUs of "
                  f"this node; {torch.cuda.device_count()} here", file=sys.stderr)
            return 2
        seq_len = shape.get("seq_len", (CPU_SHAPE if args.cpu else GPU_SHAPE)["seq_len"])
        if not args.no_sequence_parallel and seq_len % args.tensor_parallel:
            parser.error(f"--seq-len {seq_len} must divide by --tensor-parallel {args.tensor_parallel} "
                         "(sequence parallelism shards the sequence)")
        results = calibrate_tensor_parallel(args.cpu, args.tensor_parallel, args.cluster, shape,
                                            sequence_parallel=not args.no_sequence_parallel)
        print_tensor_parallel_table(results)
    else:
        results = calibrate(args.cpu, args.cluster, shape, whole_model=not args.layers_only)
        print_table(results)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
