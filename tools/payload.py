"""The benchmarks' test message: what a sender sends and how a receiver checks it.

Every bulk benchmark (``ltp-bench`` over LTP or kernel TCP, the broadcast benchmark) moves the same
kind of data the same way: the sender fills one message-sized buffer before its clock starts and sends
from it; the receiver posts one message-sized buffer, faulted in before the clock, and every byte is
checked after the clock stops.  The message is a little-endian uint64 counter, so a byte in the wrong
place (reordering, a duplicate, a stale retransmit) fails the check, not just a missing one.

Moving data between cold, message-sized buffers on both transports is what makes their CPU per byte
comparable: a training job's gradients and models do not fit in a cache, and a baseline that resends
one small hot block (and reads into another) skips the memory traffic the other transport pays.
"""

from __future__ import annotations

__all__ = ["pattern", "verify"]

#: bytes checked per step (no message-sized temporaries)
VERIFY_STEP = 1 << 24


def pattern(size: int, start: int = 0):
    """Bytes ``start .. start+size`` of the test message (a numpy uint8 view of a uint64 counter)."""
    import numpy as np

    skip = start % 8
    n8 = (skip + size + 7) // 8
    return np.arange(start // 8, start // 8 + n8, dtype="<u8").view(np.uint8)[skip:skip + size]


def verify(buf, bubbles=(), step: int = VERIFY_STEP) -> bool:
    """Whether ``buf`` holds the test message outside ``bubbles`` (half-open byte ranges, in order) and zeros
    inside them."""
    import numpy as np

    size = len(buf)
    edges = [0]
    for lo, hi in bubbles:
        if not 0 <= lo <= hi <= size or lo < edges[-1]:
            return False  # a report that names bytes outside the message, or out of order, is wrong
        edges += [lo, hi]
    edges.append(size)
    for k in range(0, len(edges) - 1):
        lo, hi, hole = edges[k], edges[k + 1], k % 2 == 1
        for i in range(lo, hi, step):
            j = min(hi, i + step)
            chunk = buf[i:j]
            if hole:
                if chunk.any():
                    return False
            elif not np.array_equal(chunk, pattern(j - i, i)):
                return False
    return True
