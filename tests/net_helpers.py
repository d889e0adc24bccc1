"""Helpers shared by the socket tests: what this machine's loopback offers."""

from __future__ import annotations

import socket


def ipv6_loopback() -> bool:
    """Whether a UDP socket can bind ``::1`` here (the IPv6 socket tests skip when it cannot)."""
    if not socket.has_ipv6:
        return False
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_DGRAM) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False
