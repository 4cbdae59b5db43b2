"""Stopping a process for a test, and waiting for one it stopped or killed to be gone."""
from __future__ import annotations

import os
import signal
import time
from pathlib import Path

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


def stop(pid: int, timeout_s: float = 10.0) -> None:
    """SIGSTOP process ``pid`` and return once every thread of it has stopped. The signal stops
    the process a little after ``kill`` returns (one of its threads must take it first): on a
    loaded machine a thread already woken, such as one answering a call, can still run for
    milliseconds and answer one more; a test that means "hung from now on" waits for the stop."""
    os.kill(pid, signal.SIGSTOP)
    start = time.monotonic()
    while not all(_thread_state(task) in ("T", "t", None) for task in Path(f"/proc/{pid}/task").iterdir()):
        assert time.monotonic() - start < timeout_s, f"process {pid} has not stopped after {timeout_s:g}s"
        time.sleep(0.005)


def _thread_state(task: Path) -> str | None:
    """The state letter of one thread (``/proc/PID/task/TID/stat``), None if it has exited."""
    try:
        return task.joinpath("stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return None
