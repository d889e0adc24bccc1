"""Error feedback on the worker: re-send next time what the PS did not receive (sans-IO).

Who knows what was lost: an LTP sender only learns ``delivered_fraction``; the
PS's receive report has the exact bubbles.  The PS therefore piggy-backs each
worker's lost element ranges on the next (reliable) parameter broadcast (see
``ltp_ps.wire``).  The worker keeps a copy of the gradient it pushed, and when
the broadcast for iteration ``i+1`` names ranges lost in iteration ``i`` it adds
those elements to its residual; the residual is added to the next gradient.

A worker whose whole message was missed (timeout) is reported with one range
covering its shard, so its entire gradient is carried over.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np


class ErrorFeedback:
    def __init__(self, n_elems: int, *, decay: float = 1.0):
        self.residual = np.zeros(n_elems, dtype=np.float32)
        self._last = np.zeros(n_elems, dtype=np.float32)
        self._last_iteration: int | None = None
        self.decay = decay  # 1.0: keep everything that was lost
        self.carried_elements = 0

    def compensate(self, grad: np.ndarray, iteration: int) -> np.ndarray:
        """Return ``grad + residual`` (the message to push) and remember it."""
        out = grad + self.residual
        self.residual[:] = 0
        self._last[:] = out
        self._last_iteration = iteration
        return out

    def lost(self, iteration: int, ranges: Sequence[tuple]) -> None:
        """The PS reports that element ``ranges`` of iteration ``iteration`` were lost."""
        self.lost_shard(iteration, ranges)
        self.commit()

    def lost_shard(self, iteration: int, ranges: Sequence[tuple]) -> None:
        """Like :meth:`lost` for one shard's ranges; call :meth:`commit` after all shards."""
        if iteration != self._last_iteration:
            return  # feedback about a push we no longer hold (e.g. after a rejoin)
        for s, e in ranges:
            self.residual[s:e] += self.decay * self._last[s:e]
            self.carried_elements += e - s

    def commit(self) -> None:
        """The feedback for the last push is complete; later reports about it are ignored."""
        self._last_iteration = None
