"""A port for a test launch's rendezvous (``MASTER_PORT``) that no concurrent run can take first."""

import os
import socket


def _ephemeral_floor() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


_NEXT_PORT = [None]


def free_port() -> int:
    """A bindable port below the kernel's ephemeral range, a new one per run. A port the kernel hands out (bind to 0)
    may be taken, between this pick and rank 0's bind, by a concurrent run's gloo connections, which draw from that
    range (seen: EADDRINUSE in rank 0's TCPStore); below it only an explicit bind can collide."""
    floor = _ephemeral_floor()
    low = min(20000, floor - 2000)
    if _NEXT_PORT[0] is None:
        _NEXT_PORT[0] = low + (os.getpid() * 131) % (floor - low)
    for _ in range(floor - low):
        port = _NEXT_PORT[0]
        _NEXT_PORT[0] = low + (port + 1 - low) % (floor - low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {low}..{floor - 1}")
