"""Child-process start-up handshake: a benchmark's helper process prints ``READY`` once it can serve."""

from __future__ import annotations

import selectors
import subprocess
import time

__all__ = ["wait_ready", "EXIT_GRACE_S"]

#: seconds a child whose output ended gets to exit before it is reported as alive but silent
EXIT_GRACE_S = 5.0


def wait_ready(p, timeout_s: float, what: str, error: type[Exception] = RuntimeError) -> None:
    """Wait until process ``p`` (a text stdout pipe) prints ``READY``.

    Raises ``error`` naming ``what``, its exit status and the tail of its stderr when it exits, or says nothing
    within ``timeout_s`` seconds (enforced: a silent child does not block the caller)."""
    t_end = time.monotonic() + timeout_s
    closed = False
    with selectors.DefaultSelector() as sel:
        sel.register(p.stdout, selectors.EVENT_READ)
        while True:
            left = t_end - time.monotonic()
            if left <= 0 or not sel.select(left):
                break
            line = p.stdout.readline()
            if not line:
                closed = True
                break
            if line.strip() == "READY":
                return
    if closed:  # its stdout closed: it is exiting; the exit status may lag the end of its output
        try:
            p.wait(timeout=EXIT_GRACE_S)
        except subprocess.TimeoutExpired:
            pass
    rc = p.poll()
    err = p.stderr.read()[-2000:] if rc is not None and p.stderr is not None else ""
    if rc is not None:
        raise error(f"{what} did not start (exit {rc}): {err.strip() or 'no output'}")
    raise error(f"{what} did not start within {timeout_s:g} s (still running"
                f"{', its stdout closed' if closed else ''}): no READY")
