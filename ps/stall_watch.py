"""Did this process run?  Telling another process's silence from our own stall.

Theory of operation
-------------------
A process judges a peer dead after a silence (no control message for
``SILENT_S``).  If the judging process itself did not run for part of that
window (SIGSTOP, a hung host, a loop blocked in one call), the silence is its
own: the peer's messages wait in the socket, and on resume every timer fires
at once, so a PS paused for 15 s used to write off every worker.

:class:`StallWatch` is a ticker on the event loop: every :data:`TICK_S` it
notes the time; a gap between two ticks longer than :data:`STALL_GAP_S` is a
stall.  :meth:`StallWatch.stalled_since` answers "did this process stall since
``t0``?", also when the ticker has not yet run after the stall (its last tick
is older than the gap: the loop has only just resumed).  A silence judged over
a window that overlaps a stall gets a fresh window instead.

One watch per event loop (:func:`watch`), started on first use.
"""

from __future__ import annotations

import asyncio
import time

TICK_S = 0.25  # seconds between the watch's ticks
STALL_GAP_S = 1.5  # seconds between two ticks beyond which this process is taken to have stalled


class StallWatch:
    """Ticks on the running loop; remembers when the last stall of this process ended."""

    def __init__(self, clock=time.monotonic, loop: asyncio.AbstractEventLoop | None = None):
        self.clock = clock
        self.loop = loop  # the loop it ticks on (:func:`watch`)
        self.last_tick: float | None = None
        self.last_stall_end = float("-inf")
        self.stalls = 0
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        if self._task is None or self._task.done():
            self.last_tick = self.clock()
            self._task = asyncio.get_running_loop().create_task(self._run())

    def tick(self) -> None:
        """One tick (the loop calls it every ``TICK_S``; tests call it directly)."""
        now = self.clock()
        if self.last_tick is not None and now - self.last_tick > STALL_GAP_S:
            self.last_stall_end = now
            self.stalls += 1
        self.last_tick = now

    async def _run(self) -> None:
        while True:
            self.tick()
            await asyncio.sleep(TICK_S)

    def stalled_since(self, t0: float) -> bool:
        """True if this process did not run for more than ``STALL_GAP_S`` at some point after ``t0``."""
        now = self.clock()
        pending = self.last_tick is not None and now - self.last_tick > STALL_GAP_S  # resumed, not ticked yet
        return pending or self.last_stall_end >= t0


_watches: dict = {}


def watch() -> StallWatch:
    """The running loop's watch, started if needed."""
    loop = asyncio.get_running_loop()
    w = _watches.get(id(loop))
    if w is None or w.loop is not loop:
        for k in [k for k, v in _watches.items() if v.loop.is_closed()]:
            del _watches[k]
        w = _watches[id(loop)] = StallWatch(loop=loop)
    w.start()
    return w
