"""A port a server binds later, drawn between Ray's worker ports and the ephemeral range (where
Ray's start-up may take a port-0 draw first), checked free on IPv4 and IPv6."""

from __future__ import annotations

import errno
import random
import socket

PORT_RANGE = (20000, 32000)
"""Half-open range the draws come from: above Ray's worker ports, below the ephemeral range."""


def free_port(draws: int = 200) -> int:
    rng = random.SystemRandom()
    for _ in range(draws):
        port = rng.randrange(*PORT_RANGE)
        if _bindable(socket.AF_INET, "0.0.0.0", port) and _bindable(socket.AF_INET6, "::", port):
            return port
    raise RuntimeError(f"no free port in {PORT_RANGE} after {draws} draws")


def _bindable(family: socket.AddressFamily, host: str, port: int) -> bool:
    try:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.bind((host, port))
    except OSError as exc:
        # A host without IPv6 cannot bind [::] at all; that says nothing about the port.
        return family == socket.AF_INET6 and exc.errno == errno.EAFNOSUPPORT
    return True
