"""Helpers shared by the socket tests: what this machine's loopback offers, and a blocking send/recv exchange."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import threading

import pytest


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


def run_in_fresh_netns(script: str, *args: str, tools: tuple[str, ...] = ("unshare",),
                       setup_errors: tuple[str, ...] = ("unshare",), timeout: float = 60) -> subprocess.CompletedProcess:
    """Run ``python -c script *args`` in a new, empty network namespace (``unshare -n``); its CompletedProcess.

    Skips (naming what is missing) without root or one of ``tools``, or when the child failed with a
    namespace set-up error: its stderr names one of ``setup_errors``."""
    if any(shutil.which(t) is None for t in tools) or os.geteuid() != 0:
        pytest.skip(f"needs root and {', '.join(tools)} for a network namespace")
    proc = subprocess.run(["unshare", "-n", sys.executable, "-c", script, *args],
                          capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0 and any(e in proc.stderr for e in setup_errors):
        pytest.skip(f"cannot set up the namespace: {proc.stderr.strip()[-200:]}")
    return proc


def blocking_exchange(sender, receiver, data, out, *, tag: int):
    """``sender.send`` ``data`` to ``receiver`` (two blocking ``ltp.Socket``s) while a thread runs ``receiver.recv``
    into ``out``; return both reports."""
    box = {}
    t = threading.Thread(target=lambda: box.setdefault("r", receiver.recv(out, tag=tag)))
    t.start()
    rep = sender.send(receiver.local_addr, data, tag=tag, reliable=True)
    t.join(30)
    return rep, box.get("r")
