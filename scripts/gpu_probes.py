"""One-process probes of raypipe's GPU paths, run by scripts/gpu_check.sh.

Each probe returns a dict of what it measured and raises when what it checks does not
hold. ``--cpu`` runs the probes that have a CPU path on the CPU, at small shapes (the
check script's ``--dry-run``), so the probes themselves are exercised where no GPU is.

    python scripts/gpu_probes.py [--cpu] [--only NAME ...] [--out results.json]

Probes:
  nccl_world1     NCCL (gloo on --cpu) at world size 1: join, all-reduce, abort, rejoin, all-reduce
  bf16_stage      a bf16 LLaMA stage with recompute and offload, one step, under
                  torch.cuda.set_sync_debug_mode("warn") (counts the host syncs it warns of)
  flash_vs_sdpa   attention at 7B shapes: flash-attn and SDPA agree, and each one's backward,
                  run twice, is bitwise the same (SDPA under torch.use_deterministic_algorithms)
  ray_p1          a Ray run at p=1, step time with snapshot_every=1 and 0
"""
from __future__ import annotations

import argparse
import collections
import json
import math
import os
import socket
import statistics
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

# the probes import raypipe lazily: from the checkout this script is in, installed or not
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PROBES: dict[str, Callable[[bool], dict[str, Any]]] = {}


def probe(function: Callable[[bool], dict[str, Any]]) -> Callable[[bool], dict[str, Any]]:
    PROBES[function.__name__.removeprefix("probe_")] = function
    return function


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@probe
def probe_nccl_world1(cpu: bool) -> dict[str, Any]:
    """Join, all-reduce, abort (never a waiting destroy), rejoin under a fresh rendezvous."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _abort_process_group

    backend = "gloo" if cpu else "nccl"
    device = torch.device("cpu") if cpu else torch.device("cuda", torch.cuda.current_device())
    results: dict[str, Any] = {"backend": backend}
    for attempt in ("join", "rejoin"):
        start = time.perf_counter()
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1,
                                device_id=None if cpu else device)
        value = torch.full((1024,), 3.0, device=device)
        dist.all_reduce(value)
        if not torch.equal(value.cpu(), torch.full((1024,), 3.0)):
            raise AssertionError(f"{attempt}: all-reduce at world size 1 changed the tensor")
        pending = dist.all_reduce(value, async_op=True)  # abort with work possibly in flight
        abort_start = time.perf_counter()
        _abort_process_group()
        results[f"{attempt}_seconds"] = round(abort_start - start, 3)
        results[f"{attempt}_abort_seconds"] = round(time.perf_counter() - abort_start, 3)
        del pending
    if dist.is_initialized():
        raise AssertionError("the default group is still initialized after abort")
    return results


def _tiny_llama():
    from raypipe.models.llama import get_config

    return get_config("tiny").replace(max_seq_len=128)


@probe
def probe_bf16_stage(cpu: bool) -> dict[str, Any]:
    """One step of a bf16 LLaMA stage (recompute always, activations offloaded)."""
    import ray

    import raypipe
    from raypipe.models.llama import llama_layers, llama_loss
    from raypipe.stage.spec import WorkerSpec
    from raypipe.stage.worker import StageWorker

    started_ray = not ray.is_initialized()
    if started_ray:
        ray.init(address="local", num_cpus=1, include_dashboard=False, logging_level="ERROR")
    try:
        model = _tiny_llama() if cpu else _tiny_llama().replace(dim=1024, n_heads=8, ffn_dim=2816, n_layers=2,
                                                                 max_seq_len=1024)
        layers = llama_layers(model)
        config = raypipe.PipelineConfig(num_stages=1, num_micro_batches=2, precision="bf16",
                                        activation_checkpoint="always", offload_activations=True)
        spec = WorkerSpec(0, 1, tuple(layers), tuple(range(len(layers))), config, use_gpu=not cpu,
                          loss_fn=llama_loss, optimizer_factory=lambda p: torch.optim.AdamW(p, lr=1e-4))
        worker = StageWorker(spec)
        generator = torch.Generator().manual_seed(0)
        batch, seq_len = (2, 64) if cpu else (4, model.max_seq_len)
        tokens = torch.randint(0, model.vocab_size, (2, batch, seq_len + 1), generator=generator)

        def step(number: int) -> tuple[Any, float]:
            start = time.perf_counter()
            for micro_batch in range(2):
                worker.forward(micro_batch, tokens[micro_batch, :, :-1], tokens[micro_batch, :, 1:], 0.5, number,
                               read_loss=False)  # as the per-step loop runs it: the loss is read with the norm
            for micro_batch in range(2):
                worker.backward(micro_batch, None, 1.0)
            report = worker.commit(False, worker.finish_backward())
            return report, time.perf_counter() - start

        step(0)  # warm-up: allocator, kernels, flash-attn's first call
        syncs: list[str] = []
        sites: collections.Counter[str] = collections.Counter()

        def record_sync(message, category, filename, lineno, file=None, line=None) -> None:
            if "synchroniz" in str(message).lower():  # the warning is raised in the frame that called torch
                syncs.append(str(message).splitlines()[0])
                sites[_raypipe_site(traceback.extract_stack()[:-1])] += 1

        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = record_sync  # restored on leaving the block
            if not cpu:
                torch.cuda.set_sync_debug_mode("warn")
            try:
                report, seconds = step(1)
            finally:
                if not cpu:
                    torch.cuda.set_sync_debug_mode("default")
        if report.decision.skipped or not math.isfinite(report.decision.loss):
            raise AssertionError(f"the bf16 step did not step: {report.decision}")
        stats = report.stats
        return {"loss": round(report.decision.loss, 4), "step_seconds": round(seconds, 4),
                "busy_seconds": round(stats.busy_seconds, 4), "offloaded_bytes": stats.offloaded_bytes,
                "device_peak_bytes": stats.device_peak_bytes,
                "host_syncs_warned": len(syncs), "host_sync_kinds": sorted(set(syncs))[:5],
                "host_sync_sites": dict(sites.most_common())}
    finally:
        if started_ray:
            ray.shutdown()


def _raypipe_site(stack: traceback.StackSummary) -> str:
    """Where in raypipe a host sync was asked for: the innermost raypipe frame and the
    raypipe frame that called it (the probe's own frames when raypipe has none)."""
    ours = [frame for frame in stack if f"{os.sep}raypipe{os.sep}" in frame.filename] or \
        [frame for frame in stack if frame.filename.endswith("gpu_probes.py")]
    described = [f"{Path(frame.filename).parent.name}/{Path(frame.filename).name}:{frame.lineno} {frame.name}"
                 for frame in ours[-2:]]
    return " <- ".join(reversed(described)) or "outside raypipe"


def _attention_gradients(attend: Callable, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grad: torch.Tensor):
    for tensor in (q, k, v):
        tensor.grad = None
    out = attend(q, k, v)
    out.backward(grad)
    return out.detach(), [tensor.grad.clone() for tensor in (q, k, v)]


def _bitwise_twice(attend: Callable, q, k, v, grad) -> tuple[bool, torch.Tensor, float]:
    start = time.perf_counter()
    out, first = _attention_gradients(attend, q, k, v, grad)
    _, second = _attention_gradients(attend, q, k, v, grad)
    if q.is_cuda:
        torch.cuda.synchronize()
    return all(torch.equal(a, b) for a, b in zip(first, second)), out, (time.perf_counter() - start) / 2


@probe
def probe_flash_vs_sdpa(cpu: bool) -> dict[str, Any]:
    """LLaMA-2 7B attention shapes (32 heads of 128, T=4096, bf16): flash-attn against SDPA."""
    import torch.nn.functional as F

    from raypipe.models import attention

    if cpu:
        batch, seq_len, heads, head_dim, dtype, device = 1, 128, 4, 32, torch.float32, "cpu"
    else:
        batch, seq_len, heads, head_dim, dtype, device = 1, 4096, 32, 128, torch.bfloat16, "cuda"
    generator = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(batch, seq_len, heads, head_dim, device=device, dtype=dtype, generator=generator)
               .requires_grad_(True) for _ in range(3))
    grad = torch.randn(batch, seq_len, heads, head_dim, device=device, dtype=dtype, generator=generator)

    def sdpa(q, k, v):
        return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                              is_causal=True).transpose(1, 2)

    results: dict[str, Any] = {"shape": [batch, seq_len, heads, head_dim], "dtype": str(dtype)}
    # for the record: whether SDPA's default backward (atomics in its CUDA kernels) repeats itself
    results["sdpa_default_backward_bitwise"] = _bitwise_twice(sdpa, q, k, v, grad)[0]
    deterministic_before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)  # SDPA's CUDA backward kernels read it when they run
    try:
        same, sdpa_out, seconds = _bitwise_twice(sdpa, q, k, v, grad)
    finally:
        torch.use_deterministic_algorithms(deterministic_before)
    results.update(sdpa_deterministic_backward_bitwise=same, sdpa_seconds=round(seconds, 4))
    if not same:
        raise AssertionError("SDPA's backward under use_deterministic_algorithms(True) differs between two runs")
    reason = attention.flash_unavailable_reason(q)
    results["flash_attn"] = reason or "runs"
    if reason is None:
        same, flash_out, seconds = _bitwise_twice(attention.causal_attention, q, k, v, grad)
        difference = (flash_out.float() - sdpa_out.float()).abs().max().item()
        results.update(flash_backward_bitwise=same, flash_seconds=round(seconds, 4),
                       flash_vs_sdpa_max_abs_difference=difference)
        if not same:
            raise AssertionError("flash-attn's backward (deterministic=True) differs between two runs")
        if difference > 2e-2:
            raise AssertionError(f"flash-attn and SDPA differ by {difference} (bf16 allows ~1e-2)")
    elif not cpu:
        results["flash_attn_skipped"] = True
    return results


@probe
def probe_ray_p1(cpu: bool) -> dict[str, Any]:
    """A Ray run at p=1 (one worker): median step time with a snapshot every step and without."""
    from torch import nn

    import raypipe

    width, rows, steps = (256, 256, 4) if cpu else (4096, 4096, 6)
    generator = torch.Generator().manual_seed(0)
    x, y = torch.randn(rows, width, generator=generator), torch.randn(rows, width, generator=generator)
    results: dict[str, Any] = {"width": width, "steps": steps}
    for snapshot_every in (1, 0):
        torch.manual_seed(0)
        layers = [nn.Linear(width, width), nn.GELU(), nn.Linear(width, width)]
        config = raypipe.PipelineConfig(num_stages=1, num_micro_batches=2, use_gpu=not cpu,
                                        snapshot_every=snapshot_every)
        with raypipe.PipelineTrainer(layers, nn.functional.mse_loss, lambda p: torch.optim.AdamW(p, lr=1e-4),
                                     config) as trainer:
            times = [trainer.step(x, y).step_time for _ in range(steps)]
        results[f"snapshot_every_{snapshot_every}_step_seconds"] = round(statistics.median(times[1:]), 4)
    results["snapshot_step_time_ratio"] = round(results["snapshot_every_1_step_seconds"]
                                                / results["snapshot_every_0_step_seconds"], 3)
    return results


def run(names: list[str], cpu: bool) -> dict[str, Any]:
    """Every named probe, each one's result or error; a failure does not stop the others."""
    results: dict[str, Any] = {}
    for name in names:
        start = time.perf_counter()
        try:
            outcome = {"ok": True, **PROBES[name](cpu)}
        except Exception as error:  # noqa: BLE001 - report every probe
            outcome = {"ok": False, "error": f"{type(error).__name__}: {error}",
                       "traceback": traceback.format_exc(limit=6)}
        outcome["seconds"] = round(time.perf_counter() - start, 2)
        results[name] = outcome
        print(json.dumps({name: outcome}), flush=True)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="run the CPU path of every probe (no CUDA needed)")
    parser.add_argument("--only", nargs="+", choices=sorted(PROBES), help="run only these probes")
    parser.add_argument("--list", action="store_true", help="name the probes and exit")
    parser.add_argument("--out", help="also write the results here as JSON")
    args = parser.parse_args(argv)
    if args.list:
        print("\n".join(PROBES))
        return 0
    # cuBLAS is deterministic only with a fixed workspace; torch.use_deterministic_algorithms
    # (the SDPA probe) refuses cuBLAS calls without it. Set before the first CUDA call.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    if not args.cpu and not torch.cuda.is_available():
        print("gpu_probes: CUDA is not available here; use --cpu for the CPU path", file=sys.stderr)
        return 2
    names = args.only or list(PROBES)
    print(f"gpu_probes: running {', '.join(names)} of {', '.join(PROBES)}{' (CPU path)' if args.cpu else ''}",
          flush=True)
    results = run(names, args.cpu)
    if args.out:
        with open(args.out, "w") as out:
            json.dump(results, out, indent=2)
    return 0 if all(result["ok"] for result in results.values()) else 1


if __name__ == "__main__":
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    sys.exit(main())
