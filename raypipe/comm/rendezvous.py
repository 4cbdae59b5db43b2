"""Where a run's process group meets: an address and a free port on the node of its first worker."""
from __future__ import annotations

import socket


def rendezvous_address() -> tuple[str, int]:
    """An address and free port on this node for the group's rendezvous."""
    import ray

    with socket.socket() as sock:
        sock.bind(("", 0))
        return ray.util.get_node_ip_address(), sock.getsockname()[1]
