"""Processes forked from one forkserver that has imported torch, ``torch._dynamo`` and raypipe
once (per test process), for the harnesses that run real gloo groups without Ray
(tests/gloo_pipeline.py, tests/gloo_ranks.py): a process started here costs well under a second of
CPU where a spawned one (or a Ray actor) imports torch again, ~2-3 s on the suite's machines."""
from __future__ import annotations

import multiprocessing

# torch._dynamo: a torch optimizer's first construction imports it (its __init__ is wrapped to keep dynamo
# out), ~1 s of CPU, which each process would pay again
PRELOADED = ["torch", "torch._dynamo", "torch.distributed.tensor", "torch.distributed.tensor.parallel",
             "raypipe.executor.per_step_worker", "raypipe.models.tensor_parallel", "raypipe.models.llama"]
CONTEXT = multiprocessing.get_context("forkserver")
CONTEXT.set_forkserver_preload(PRELOADED)
