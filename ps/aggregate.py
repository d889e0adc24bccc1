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

Soundness with partial gradients (issue 7):

* An element that *no* worker delivered carries no information: the mean is 0
  there, but it must not be *applied* as a zero gradient (momentum would decay
  towards 0 and weight decay would act on it). :meth:`Aggregator.applied_mask`
  names the elements that have at least one contributor; the PS steps only
  those (``FlatOptimizer.step(grad, mask=...)``) and, with error feedback,
  asks the workers to re-send exactly the uncovered ranges.
* With the unbiased mean, an element delivered by ``k`` of ``n`` workers is
  already an unbiased estimate of the full mean, so re-sending it later (error
  feedback) would count it twice; only ranges with zero contributors are
  re-sent (:func:`feedback_ranges`). With the zero-filled mean every lost range
  is re-sent (classic error feedback: the sum over rounds is exact).
* A contribution with a non-finite value (NaN/inf: a diverged worker or a
  corrupted buffer) is refused whole and counted in ``Aggregator.rejected``;
  one bad worker never poisons the model.
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
        self._mean: np.ndarray | None = None  # result()'s buffer, reused every round
        self.reset()

    def reset(self) -> None:
        self._sum[:] = 0
        self.contributors = 0
        self.rejected = 0  # contributions refused for non-finite values
        # the lost element ranges of every contribution (starts, ends: int64 arrays), kept as ranges: a dense
        # per-element count (cumsum over an n+1 int64 array) cost the PS seconds per VGG-16 round in page faults
        # and memory traffic, on its event loop
        self._lost_s: list = []
        self._lost_e: list = []
        self._short_ranges: list | None = None  # _short()'s answer until the next add

    def add(self, grad: np.ndarray, lost: Sequence[tuple] = (), weight: float = 1.0) -> bool:
        """Add one worker's gradient; ``lost`` are element ranges it did not deliver.

        Returns False (and counts it in ``rejected``) when a delivered element
        is NaN or infinite: the contribution is left out whole. ``lost`` may
        overlap itself (bubbles that overlap, a critical range reported inside
        a bubble) and reach outside ``[0, n_elems)``: it is clipped and merged
        first, so every element is counted as lost at most once. The lost
        elements' values are never read (no copy of ``grad`` is made: only the
        delivered ranges are added).
        """
        if grad.shape != (self.n_elems,):
            raise ValueError(f"gradient has {grad.shape} elements, the aggregator {self.n_elems}")
        lost = merge_ranges((max(0, s), min(self.n_elems, e)) for s, e in lost)
        if not _finite(grad, lost):
            self.rejected += 1
            return False
        w = None if weight == 1.0 else np.float32(weight)
        if not lost:
            self._sum += grad if w is None else grad * w
        else:
            total = self._sum
            prev = 0
            for a, b in [*lost, (self.n_elems, self.n_elems)]:  # the delivered ranges between the lost ones
                if a > prev:
                    total[prev:a] += grad[prev:a] if w is None else grad[prev:a] * w
                prev = b
            self._lost_s.append(np.fromiter((a for a, _ in lost), np.int64, len(lost)))
            self._lost_e.append(np.fromiter((b for _, b in lost), np.int64, len(lost)))
        self.contributors += 1
        self._short_ranges = None
        return True

    def _deficit(self):
        """The lost ranges as a step function: ``(bounds, missing)``, elements ``bounds[i]..bounds[i+1]`` lack
        ``missing[i]`` contributions (``missing[-1]`` is 0); None when nothing was lost."""
        if not self._lost_s:
            return None
        starts, ends = np.concatenate(self._lost_s), np.concatenate(self._lost_e)
        keys = np.concatenate((starts, ends))
        step = np.concatenate((np.ones(starts.shape[0], np.int64), np.full(ends.shape[0], -1, np.int64)))
        order = np.argsort(keys, kind="stable")
        keys, level = keys[order], np.cumsum(step[order])
        last = np.append(keys[1:] != keys[:-1], True)  # the level after every event at one position
        return keys[last], level[last]

    def _short(self):
        """``(a, b, delivered)`` for every range that fewer than all contributors delivered (computed once per
        round: the PS asks for the mask, the uncovered ranges and the mean)."""
        if self._short_ranges is None:
            d = self._deficit()
            if d is None:
                self._short_ranges = []
            else:
                bounds, missing = d
                idx = np.flatnonzero(missing[:-1] > 0)
                self._short_ranges = [(int(bounds[i]), int(bounds[i + 1]), self.contributors - int(missing[i]))
                                      for i in idx]
        return self._short_ranges

    def counts(self) -> np.ndarray:
        """Per element: how many workers delivered it."""
        c = np.full(self.n_elems, self.contributors, dtype=np.int64)
        for a, b, k in self._short():
            c[a:b] = k
        return c

    def applied_mask(self) -> np.ndarray | None:
        """Elements with at least one contributor (bool), or None when that is every element."""
        if not self.contributors:
            return np.zeros(self.n_elems, dtype=bool)
        gaps = self.uncovered()
        if not gaps:
            return None
        m = np.ones(self.n_elems, dtype=bool)
        for a, b in gaps:
            m[a:b] = False
        return m

    def uncovered(self) -> list[tuple]:
        """Element ranges no worker delivered this round (never applied)."""
        if not self.contributors:
            return [(0, self.n_elems)] if self.n_elems else []
        return merge_ranges((a, b) for a, b, k in self._short() if k == 0)

    def result(self, out: np.ndarray | None = None) -> np.ndarray:
        """The mean of this round's contributions, into ``out`` or, without it, into the aggregator's own buffer
        (made once: the next ``result()`` overwrites it; use the mean before then or pass ``out``). A fresh
        model-sized array per round cost the PS's event loop its page faults every round (0.25 s for
        ResNet-50 on a loaded 2-core host, between the gather and the next broadcast)."""
        if out is None:
            if self._mean is None:
                self._mean = np.empty(self.n_elems, dtype=np.float32)
            out = self._mean
        if self.contributors == 0:
            out[:] = 0
            return out
        np.divide(self._sum, np.float32(self.contributors), out=out)
        if self.mode == "zero_fill":
            return out
        for a, b, k in self._short():  # unbiased: each element over the workers that delivered it
            if k:
                np.divide(self._sum[a:b], np.float32(k), out=out[a:b])
            else:
                out[a:b] = 0
        return out


def _finite(grad: np.ndarray, lost: Sequence[tuple]) -> bool:
    """True if every delivered element of ``grad`` is finite (one float32 reduction, no copy).

    The sum is NaN/inf exactly when an element is (or when values are so large,
    > 1e38 in total, that the contribution is garbage anyway); lost ranges are
    zero-filled by the transport, and checked only when the fast test fails.
    """
    if np.isfinite(grad.sum(dtype=np.float32)):
        return True
    if not lost:
        return False
    keep = np.ones(grad.shape[0], dtype=bool)
    for s, e in lost:
        keep[s:e] = False
    return bool(np.isfinite(grad[keep]).all()) and np.isfinite(grad[keep].sum(dtype=np.float32))


def intersect_ranges(a: Sequence[tuple], b: Sequence[tuple]) -> list[tuple]:
    """Intersection of two lists of half-open ranges (each merged first)."""
    a, b = merge_ranges(a), merge_ranges(b)
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        s, e = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if e > s:
            out.append((s, e))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def feedback_ranges(mode: str, lost: Sequence[tuple], uncovered: Sequence[tuple]) -> list[tuple]:
    """What a worker should re-send next round (error feedback) given the aggregation ``mode``.

    ``zero_fill``: everything it lost (the PS counted it as 0). ``unbiased``:
    only what nobody delivered, since every other element was already estimated
    from the workers that delivered it; re-sending those would count them twice.
    """
    if mode == "zero_fill":
        return merge_ranges(lost)
    return intersect_ranges(lost, uncovered)
