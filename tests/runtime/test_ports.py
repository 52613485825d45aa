"""free_port: a port outside the ephemeral and Ray worker ranges, never one that is bound."""

from __future__ import annotations

import socket

from runtime.ports import PORT_RANGE, free_port


def _ephemeral_range() -> tuple[int, int]:
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        low, high = (int(x) for x in f.read().split())
    return low, high


def test_drawn_ports_sit_outside_the_ranges_others_take_and_can_be_bound() -> None:
    low, high = _ephemeral_range()
    for _ in range(20):
        port = free_port()
        assert PORT_RANGE[0] <= port < PORT_RANGE[1]
        assert not low <= port <= high
        assert not 10002 <= port <= 19999  # Ray's default worker ports
        with socket.socket() as s:
            s.bind(("0.0.0.0", port))


def test_a_bound_port_is_never_drawn() -> None:
    held: list[socket.socket] = []
    try:
        # Hold every port of a narrowed range; every draw from it must fail or land elsewhere.
        for port in range(PORT_RANGE[0], PORT_RANGE[0] + 200):
            s = socket.socket()
            try:
                s.bind(("0.0.0.0", port))
            except OSError:
                s.close()
                continue
            held.append(s)
        taken = {s.getsockname()[1] for s in held}
        for _ in range(200):
            assert free_port() not in taken
    finally:
        for s in held:
            s.close()
