"""Free ports for the tests' servers and process groups, chosen below the kernel's ephemeral range.

A port the kernel hands out as free (``bind(0)``) comes from its ephemeral range, the same range
it draws from for every outgoing connection: between choosing it and a server binding it, any
process on the machine (a Ray worker, the other pytest process) can take it, and the server fails
with EADDRINUSE. Below that range (and above Ray's worker ports, 10002-19999) only servers that
chose their port on purpose bind, so a port found free here stays free."""
from __future__ import annotations

import random
import socket
from pathlib import Path

_RAY_WORKER_PORTS_END = 19999
_SYSTEM_RANDOM = random.SystemRandom()  # not the tests' seeded generator: two pytest processes must not pick alike


def _ephemeral_start() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def _bindable(port: int, host: str) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """``count`` different ports, each free on ``host`` now and outside the ephemeral range."""
    low, high = _RAY_WORKER_PORTS_END + 1, _ephemeral_start() - 1
    chosen: list[int] = []
    for _ in range(1000 * count):
        port = _SYSTEM_RANDOM.randint(low, high)
        if port not in chosen and _bindable(port, host) and _bindable(port, "0.0.0.0"):
            chosen.append(port)
            if len(chosen) == count:
                return chosen
    raise RuntimeError(f"no {count} free ports between {low} and {high}")


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on ``host`` now and outside the ephemeral range."""
    return free_ports(1, host)[0]
