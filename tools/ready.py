"""Child-process start-up handshake: a benchmark's helper process prints ``READY`` once it can serve."""

from __future__ import annotations

import selectors
import time

__all__ = ["wait_ready"]


def wait_ready(p, timeout_s: float, what: str, error: type[Exception] = RuntimeError) -> None:
    """Wait until process ``p`` (a text stdout pipe) prints ``READY``.

    Raises ``error`` naming ``what``, its exit status and the tail of its stderr when it exits, or says nothing
    within ``timeout_s`` seconds (enforced: a silent child does not block the caller)."""
    t_end = time.monotonic() + timeout_s
    with selectors.DefaultSelector() as sel:
        sel.register(p.stdout, selectors.EVENT_READ)
        while True:
            left = t_end - time.monotonic()
            if left <= 0 or not sel.select(left):
                break
            line = p.stdout.readline()
            if not line:
                break
            if line.strip() == "READY":
                return
    err = ""
    if p.poll() is not None and p.stderr is not None:
        err = p.stderr.read()[-2000:]
    raise error(f"{what} did not start within {timeout_s:g} s (exit {p.poll()}): {err.strip() or 'no output'}")
