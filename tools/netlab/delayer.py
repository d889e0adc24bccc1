"""Build and start the C NFQUEUE delayer (``delayer.c``).

Theory of operation
    ``delayer.c`` is compiled on first use with gcc into ``$LTP_LAB_CACHE`` (default
    ``~/.cache/ltp-lab/``); the binary's name carries a hash of the source, so an edited
    source is rebuilt and concurrent builders never see a half-written file (build to a
    temporary name, then rename). :func:`start_delayer` runs it inside a namespace, bound to
    one queue number, and waits until it prints ``ready`` — only then may the caller add the
    iptables rule that feeds the queue (a queue without a listener drops every packet).
"""
from __future__ import annotations

import hashlib
import os
import select
import subprocess
import tempfile
import time
from pathlib import Path

SOURCE = Path(__file__).with_name("delayer.c")


def cache_dir() -> Path:
    return Path(os.environ.get("LTP_LAB_CACHE", Path.home() / ".cache" / "ltp-lab"))


def build_delayer() -> Path:
    """Return the path of the compiled delayer, compiling it first if needed.

    Raises :class:`~ltp_tools.netlab.support.LabUnsupported` with the compiler's message when
    gcc or libnetfilter_queue is missing.
    """
    from .support import LabUnsupported

    src = SOURCE.read_bytes()
    digest = hashlib.sha256(src).hexdigest()[:12]
    out = cache_dir() / f"ltp-delayer-{digest}"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=".build-")
    os.close(fd)
    cmd = ["gcc", "-O2", "-Wall", "-o", tmp, str(SOURCE), "-lnetfilter_queue", "-lnfnetlink"]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    except FileNotFoundError as e:
        os.unlink(tmp)
        raise LabUnsupported("gcc not found; apt-get install gcc libnetfilter-queue-dev") from e
    if r.returncode != 0:
        os.unlink(tmp)
        raise LabUnsupported(
            f"building the NFQUEUE delayer failed ({' '.join(cmd)}):\n{r.stderr.strip()}\n"
            "fix: apt-get install gcc libnetfilter-queue-dev libnfnetlink-dev")
    os.chmod(tmp, 0o755)
    os.replace(tmp, out)
    return out


def start_delayer(netns: str, queue: int, delay_s: float, jitter_s: float = 0.0,
                  maxlen: int = 100_000, seed: int = 1, ready_timeout_s: float = 5.0) -> subprocess.Popen:
    """Start a delayer bound to NFQUEUE ``queue`` inside ``netns``; return once it is ready."""
    binary = build_delayer()
    argv = ["ip", "netns", "exec", netns, str(binary), "--queue", str(queue),
            "--delay-us", f"{delay_s * 1e6:.3f}", "--jitter-us", f"{jitter_s * 1e6:.3f}",
            "--maxlen", str(maxlen), "--seed", str(seed)]
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    deadline = time.monotonic() + ready_timeout_s
    line = b""
    while time.monotonic() < deadline:
        r, _, _ = select.select([p.stdout], [], [], max(0.0, deadline - time.monotonic()))
        if r:
            line = p.stdout.readline()
            break
    if line.strip() != b"ready":
        p.kill()
        _, err = p.communicate(timeout=5)
        raise RuntimeError(f"delayer in {netns} (queue {queue}) did not start: {err.decode(errors='replace').strip()}")
    return p
