"""Choosing a port that a server binds later (torch.distributed's store, Serve's proxies).

A port drawn with a port-0 bind comes from the kernel's ephemeral range (32768-60999 by
default), where every outgoing connection and every other port-0 bind lands too, and Ray's
workers take 10002-19999. Between the draw and the server's bind, Ray's own start-up can take
such a port (CI saw a Serve gRPC proxy fail "Failed to bind to address [::]:44227"). So the
port is drawn from the gap between the two ranges instead, and checked free on IPv4 and IPv6.
"""

from __future__ import annotations

import errno
import random
import socket

PORT_RANGE = (20000, 32000)
"""Half-open range the draws come from: above Ray's worker ports, below the ephemeral range."""


def free_port(draws: int = 200) -> int:
    """A port in ``PORT_RANGE`` that nothing on this host has bound at the moment of the call."""
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
