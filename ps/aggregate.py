"""Aggregation of gradients delivered with bubbles (sans-IO).

Two estimators of the mean gradient over the ``n`` workers that delivered a
usable message (their header arrived):

* ``"zero_fill"`` -- the paper's bubble-filling: lost elements count as 0 and
  the sum is divided by ``n``.  Biased towards 0 where packets were lost.
* ``"unbiased"`` (default) -- each element is divided by the number of
  workers that actually delivered *that element*; an element nobody
  delivered aggregates to 0 (no update).

Byte ranges from transport reports are converted to element ranges of the
payload with :func:`bubbles_to_elements` (a partially covered element counts
as lost; LTP's padding bubbles make that case not arise).
"""

from __future__ import annotations

from typing import Iterable, Sequence

import numpy as np

MODES = ("unbiased", "zero_fill")


def merge_ranges(ranges: Iterable[tuple]) -> list[tuple]:
    out: list = []
    for s, e in sorted((int(s), int(e)) for s, e in ranges if e > s):
        if out and s <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], e))
        else:
            out.append((s, e))
    return out


def bubbles_to_elements(bubbles: Iterable[tuple], *, offset: int, n_elems: int, elem_size: int = 4) -> list[tuple]:
    """Byte ranges of a message -> element ranges of the payload starting at byte ``offset``."""
    out = []
    for s, e in bubbles:
        s2 = max(0, (int(s) - offset) // elem_size)
        e2 = min(n_elems, -(-(int(e) - offset) // elem_size))
        if e2 > s2:
            out.append((s2, e2))
    return merge_ranges(out)


def limit_ranges(ranges: Sequence[tuple], max_ranges: int | None) -> list[tuple]:
    """Merge sorted, disjoint ``ranges`` across their smallest gaps until at most ``max_ranges`` remain.

    A transport caps how many critical ranges fit a registration (LTP: 160);
    closing the smallest gaps marks the fewest extra bytes critical (typically
    small tensors such as biases and norm parameters become wholly critical).
    """
    ranges = merge_ranges(ranges)
    if max_ranges is None or len(ranges) <= max_ranges:
        return ranges
    if max_ranges < 1:
        raise ValueError("max_ranges must be >= 1")
    gaps = sorted(range(len(ranges) - 1), key=lambda i: (ranges[i + 1][0] - ranges[i][1], i))
    close = set(gaps[:len(ranges) - max_ranges])
    out = [ranges[0]]
    for i in range(1, len(ranges)):
        if i - 1 in close:
            out[-1] = (out[-1][0], ranges[i][1])
        else:
            out.append(ranges[i])
    return out


def critical_ranges(layout: Sequence[tuple], *, header_bytes: int, shard: tuple | None = None,
                    elem_size: int = 4, edge_elems: int = 1, max_ranges: int | None = None) -> list[tuple]:
    """The paper's critical bytes: the header plus the first and last elements of every tensor.

    ``layout`` is ``[(offset, numel), ...]`` in elements of the flat model;
    ``shard=(lo, hi)`` restricts to a shard (message element 0 is model
    element ``lo``).  The transport marks every *segment* overlapping a range
    critical, so one element per tensor end suffices.  ``max_ranges`` caps the
    count (see :func:`limit_ranges`).
    """
    lo, hi = shard if shard is not None else (0, sum(n for _, n in layout))
    out = [(0, header_bytes)] if header_bytes else []
    for off, n in layout:
        a, b = max(off, lo), min(off + n, hi)
        if b <= a:
            continue
        k = min(edge_elems, b - a)
        for s, e in ((a, a + k), (b - k, b)):
            out.append((header_bytes + (s - lo) * elem_size, header_bytes + (e - lo) * elem_size))
    return limit_ranges(out, max_ranges)


class Aggregator:
    """Accumulates contributions of one iteration; ``result()`` gives the mean."""

    def __init__(self, n_elems: int, mode: str = "unbiased"):
        if mode not in MODES:
            from .errors import ConfigError

            raise ConfigError(f"unknown aggregation {mode!r}; use one of {MODES}")
        self.n_elems = n_elems
        self.mode = mode
        self._sum = np.zeros(n_elems, dtype=np.float32)
        self.reset()

    def reset(self) -> None:
        self._sum[:] = 0
        self.contributors = 0
        self._diff = None  # count correction, built lazily when bubbles appear

    def add(self, grad: np.ndarray, lost: Sequence[tuple] = (), weight: float = 1.0) -> None:
        """Add one worker's gradient; ``lost`` are element ranges it did not deliver."""
        if grad.shape != (self.n_elems,):
            raise ValueError(f"gradient has {grad.shape} elements, the aggregator {self.n_elems}")
        if lost:
            grad = grad.copy()
            if self._diff is None:
                self._diff = np.zeros(self.n_elems + 1, dtype=np.int64)
            for s, e in lost:
                grad[s:e] = 0
                self._diff[s] -= 1
                self._diff[e] += 1
        self._sum += grad if weight == 1.0 else grad * np.float32(weight)
        self.contributors += 1

    def counts(self) -> np.ndarray:
        """Per element: how many workers delivered it."""
        c = np.full(self.n_elems, self.contributors, dtype=np.int64)
        if self._diff is not None:
            c += np.cumsum(self._diff[:-1])
        return c

    def result(self, out: np.ndarray | None = None) -> np.ndarray:
        out = np.empty(self.n_elems, dtype=np.float32) if out is None else out
        if self.contributors == 0:
            out[:] = 0
            return out
        if self.mode == "zero_fill" or self._diff is None:
            np.divide(self._sum, np.float32(self.contributors), out=out)
            return out
        c = self.counts()
        np.divide(self._sum, np.maximum(c, 1).astype(np.float32), out=out)
        out[c == 0] = 0
        return out
