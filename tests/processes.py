"""Waiting for a process the test stopped or killed to be gone."""
from __future__ import annotations

import time

import psutil


def seconds_until_gone(pid: int, timeout_s: float = 10.0) -> float:
    """Seconds until process ``pid`` has exited (a zombie counts: it runs no more);
    fails after ``timeout_s``."""
    start = time.monotonic()
    while True:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                break
        except psutil.NoSuchProcess:
            break
        assert time.monotonic() - start < timeout_s, f"process {pid} is still running after {timeout_s:g}s"
        time.sleep(0.02)
    return time.monotonic() - start
