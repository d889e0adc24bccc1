"""Mergeable partial aggregates: a sum plus per-element contributor counts.

Theory of operation
-------------------
The PS's unbiased mean divides each element by the number of workers that
delivered *that element*.  When gradients are summed on the way (a ring hop,
a tree aggregator, a chain node), the intermediate result must keep enough to
finish that division exactly at the end.  A :class:`Partial` over elements
``[lo, lo + n)`` holds:

* ``sum``          float32[n], the sum of every included contribution
                   (lost elements count as 0);
* ``contributors`` how many contributions (worker gradients) it includes;
* ``deficit``      int32[n] or ``None`` (= all zeros): per element, how many of
                   those contributors did *not* deliver it.

So ``counts = contributors - deficit``.  Invariants:

1. ``merge(a, b)``: ``sum = a.sum + b.sum``, ``contributors = a.c + b.c``,
   ``deficit = a.d + b.d`` -- associative and commutative, so any tree, chain or
   ring order gives the same counts and (up to float rounding) the same sum.
2. A partial that crossed a lossy link with element ranges ``lost``: those
   elements arrive zero-filled and *all* its contributors miss them
   (``deficit = contributors`` there, ``sum = 0``) -- :meth:`drop_ranges`.
3. ``mean("unbiased") = sum / counts`` (0 where ``counts == 0``), exactly the
   direct PS's :class:`ltp_ps.aggregate.Aggregator`; ``mean("zero_fill") =
   sum / contributors``.

On the wire (:meth:`encode_into` / :meth:`decode`) the deficit travels as a
compact table of runs ``(start, end, deficit)`` (elements relative to ``lo``),
capped at :data:`MAX_DEFICIT_RUNS`.  Beyond the cap, neighbouring runs are
merged across the smallest gaps and the merged span is *dropped* (sum 0,
deficit = contributors): that loses data but never biases the mean, because
the division still uses the true count (0 contributions there).
"""

from __future__ import annotations

import dataclasses
import struct
from typing import Iterable, Sequence

import numpy as np

from ..aggregate import MODES, merge_ranges

PARTIAL_HEADER_BYTES = 64
MAX_DEFICIT_RUNS = 4096  # runs in one message's deficit table
_RUN = np.dtype([("start", "<i8"), ("end", "<i8"), ("deficit", "<i8")])
RUN_BYTES = _RUN.itemsize  # 24
ELEM = 4  # bytes per float32


class PartialDecodeError(ValueError):
    """A partial-aggregate message that cannot be decoded (wrong magic, sizes that do not fit)."""


@dataclasses.dataclass(frozen=True)
class PartialHeader:
    MAGIC = b"LTPA"
    # magic, version, kind, origin, lo, n, iteration, contributors, n_runs, samples, loss_sum
    _S = struct.Struct("<4sHHiqqqIIqd")
    kind: int
    origin: int  # rank that sent it (-1: a PS shard)
    lo: int
    n: int
    iteration: int
    contributors: int
    n_runs: int
    samples: int = 0
    loss_sum: float = 0.0

    def pack_into(self, buf) -> None:
        mv = memoryview(buf).cast("B")
        mv[:PARTIAL_HEADER_BYTES] = bytes(PARTIAL_HEADER_BYTES)
        self._S.pack_into(mv, 0, self.MAGIC, 1, self.kind, self.origin, self.lo, self.n, self.iteration,
                          self.contributors, self.n_runs, self.samples, self.loss_sum)

    @classmethod
    def unpack(cls, buf) -> "PartialHeader | None":
        mv = memoryview(buf).cast("B")
        if mv.nbytes < PARTIAL_HEADER_BYTES:
            return None
        magic, _ver, kind, origin, lo, n, it, c, nr, samples, loss_sum = cls._S.unpack_from(mv, 0)
        if magic != cls.MAGIC:
            return None
        return cls(kind, origin, lo, n, it, c, nr, samples, loss_sum)


def message_capacity(n: int, max_runs: int = MAX_DEFICIT_RUNS) -> int:
    """Bytes a receive buffer needs for a partial over ``n`` elements."""
    return PARTIAL_HEADER_BYTES + ELEM * n + RUN_BYTES * max_runs


def payload_range(n: int) -> tuple[int, int]:
    """Byte range of the float32 sum inside a partial message (the loss-tolerant part)."""
    return PARTIAL_HEADER_BYTES, PARTIAL_HEADER_BYTES + ELEM * n


class Partial:
    """Sum and per-element contributor counts of gradient elements ``[lo, lo + n)``."""

    __slots__ = ("lo", "sum", "contributors", "deficit", "samples", "loss_sum")

    def __init__(self, n: int, *, lo: int = 0):
        if n < 0:
            raise ValueError("a partial needs n >= 0 elements")
        self.lo = int(lo)
        self.sum = np.zeros(n, dtype=np.float32)
        self.contributors = 0
        self.deficit: np.ndarray | None = None
        self.samples = 0
        self.loss_sum = 0.0

    # -- construction ------------------------------------------------------
    @property
    def n(self) -> int:
        return self.sum.size

    @property
    def hi(self) -> int:
        return self.lo + self.n

    @classmethod
    def of_gradient(cls, grad: np.ndarray, lost: Sequence[tuple] = (), *, lo: int = 0, samples: int = 0,
                    loss: float = 0.0) -> "Partial":
        """One worker's gradient (``lost``: element ranges it did not deliver, relative to ``lo``)."""
        p = cls(int(np.asarray(grad).size), lo=lo)
        p.add_gradient(grad, lost, samples=samples, loss=loss)
        return p

    def reset(self) -> None:
        self.sum[:] = 0
        self.contributors = 0
        self.deficit = None
        self.samples = 0
        self.loss_sum = 0.0

    def copy(self) -> "Partial":
        p = Partial(0, lo=self.lo)
        p.sum = self.sum.copy()
        p.contributors = self.contributors
        p.deficit = None if self.deficit is None else self.deficit.copy()
        p.samples, p.loss_sum = self.samples, self.loss_sum
        return p

    def _deficit(self) -> np.ndarray:
        if self.deficit is None:
            self.deficit = np.zeros(self.n, dtype=np.int32)
        return self.deficit

    # -- arithmetic --------------------------------------------------------
    def add_gradient(self, grad: np.ndarray, lost: Sequence[tuple] = (), *, samples: int = 0,
                     loss: float = 0.0) -> None:
        """Include one worker's gradient; elements in ``lost`` count as not delivered."""
        grad = np.asarray(grad, dtype=np.float32)
        if grad.shape != (self.n,):
            raise ValueError(f"gradient has shape {grad.shape}, the partial {self.n} elements")
        lost = merge_ranges(lost)
        if lost:
            grad = grad.copy()
            d = self._deficit()
            for s, e in lost:
                grad[s:e] = 0
                d[s:e] += 1
        self.sum += grad
        self.contributors += 1
        self.samples += int(samples)
        self.loss_sum += float(loss)

    def drop_ranges(self, lost: Iterable[tuple]) -> None:
        """Elements in ``lost`` (relative to ``lo``) did not arrive: no contributor delivered them."""
        lost = merge_ranges((max(0, s), min(self.n, e)) for s, e in lost)
        if not lost:
            return
        d = self._deficit()
        for s, e in lost:
            self.sum[s:e] = 0
            d[s:e] = self.contributors

    def merge(self, other: "Partial", lost: Sequence[tuple] = ()) -> None:
        """Add ``other`` (same element range); ``lost``: its element ranges that did not arrive."""
        if other.lo != self.lo or other.n != self.n:
            raise ValueError(f"cannot merge partial [{other.lo}, {other.hi}) into [{self.lo}, {self.hi}); "
                             f"merge partials of the same element range (slice first)")
        if lost:
            other = other.copy()
            other.drop_ranges(lost)
        self.sum += other.sum
        self.contributors += other.contributors
        if other.deficit is not None:
            self._deficit()[:] += other.deficit
        self.samples += other.samples
        self.loss_sum += other.loss_sum

    def slice(self, lo: int, hi: int) -> "Partial":
        """A copy restricted to absolute elements ``[lo, hi)``."""
        if not self.lo <= lo <= hi <= self.hi:
            raise ValueError(f"slice [{lo}, {hi}) is outside the partial [{self.lo}, {self.hi})")
        p = Partial(0, lo=lo)
        p.sum = self.sum[lo - self.lo:hi - self.lo].copy()
        p.contributors = self.contributors
        p.deficit = None if self.deficit is None else self.deficit[lo - self.lo:hi - self.lo].copy()
        p.samples, p.loss_sum = self.samples, self.loss_sum
        return p

    def counts(self) -> np.ndarray:
        """Per element: how many contributors delivered it."""
        c = np.full(self.n, self.contributors, dtype=np.int64)
        if self.deficit is not None:
            c -= self.deficit
        return c

    def mean(self, mode: str = "unbiased", out: np.ndarray | None = None) -> np.ndarray:
        """The mean gradient: per-element counts (``unbiased``) or all contributors (``zero_fill``)."""
        if mode not in MODES:
            raise ValueError(f"unknown aggregation {mode!r}; use one of {MODES}")
        out = np.empty(self.n, dtype=np.float32) if out is None else out
        if self.contributors == 0:
            out[:] = 0
            return out
        if mode == "zero_fill" or self.deficit is None or not self.deficit.any():
            np.divide(self.sum, np.float32(self.contributors), out=out)
            return out
        c = self.counts()
        np.divide(self.sum, np.maximum(c, 1).astype(np.float32), out=out)
        out[c == 0] = 0
        return out

    def deficit_runs(self) -> list[tuple]:
        """``[(start, end, deficit), ...]`` runs of nonzero deficit (elements relative to ``lo``)."""
        if self.deficit is None or self.n == 0:
            return []
        d = self.deficit
        change = np.flatnonzero(np.diff(d)) + 1
        starts = np.concatenate(([0], change))
        ends = np.concatenate((change, [self.n]))
        return [(int(s), int(e), int(d[s])) for s, e in zip(starts, ends) if d[s] != 0]

    # -- wire ----------------------------------------------------------------
    def encode_into(self, buf: np.ndarray, *, kind: int, origin: int, iteration: int,
                    max_runs: int = MAX_DEFICIT_RUNS) -> memoryview:
        """Write header | sum | deficit runs into ``buf``; returns the view to send.

        Runs beyond ``max_runs`` are merged across the smallest gaps and the
        merged spans sent as dropped (see the module docstring).
        """
        runs = self.deficit_runs()
        sums = self.sum
        if len(runs) > max_runs:
            runs, sums = _coarsen(runs, self.sum, self.contributors, max_runs)
        need = PARTIAL_HEADER_BYTES + ELEM * self.n + RUN_BYTES * len(runs)
        mv = memoryview(buf).cast("B")
        if mv.nbytes < need:
            raise ValueError(f"buffer of {mv.nbytes} bytes cannot hold a {need}-byte partial; "
                             f"size it with message_capacity(n)")
        PartialHeader(kind, origin, self.lo, self.n, iteration, self.contributors, len(runs), self.samples,
                      self.loss_sum).pack_into(mv)
        arr = np.frombuffer(mv, dtype=np.uint8, count=need)
        arr[PARTIAL_HEADER_BYTES:PARTIAL_HEADER_BYTES + ELEM * self.n].view(np.float32)[:] = sums
        if runs:
            table = np.array(runs, dtype=np.int64).ravel()
            arr[PARTIAL_HEADER_BYTES + ELEM * self.n:need].view(np.int64)[:] = table
        return mv[:need]

    @staticmethod
    def critical_bytes(n: int, n_runs: int) -> tuple:
        """Byte ranges of an encoded partial (``n`` elements, ``n_runs`` runs) that must arrive: header + table."""
        end = PARTIAL_HEADER_BYTES + ELEM * n
        return ((0, PARTIAL_HEADER_BYTES),) + (((end, end + RUN_BYTES * n_runs),) if n_runs else ())

    @classmethod
    def decode(cls, buf, lost_bytes: Iterable[tuple] = ()) -> "Partial":
        """The partial in ``buf``; ``lost_bytes``: zero-filled byte ranges (transport bubbles).

        Raises :class:`PartialDecodeError` when the header or the run table is
        unusable (a lost header, a table outside the message); lost bytes of
        the sum become dropped elements.
        """
        mv = memoryview(buf).cast("B")
        h = PartialHeader.unpack(mv)
        if h is None:
            raise PartialDecodeError("not a partial-aggregate message (bad magic or short header)")
        end = PARTIAL_HEADER_BYTES + ELEM * h.n
        need = end + RUN_BYTES * h.n_runs
        if h.n < 0 or need > mv.nbytes:
            raise PartialDecodeError(f"partial of {h.n} elements and {h.n_runs} runs does not fit {mv.nbytes} bytes")
        lost_bytes = merge_ranges(lost_bytes)
        for s, e in lost_bytes:
            if s < PARTIAL_HEADER_BYTES or (e > end and s < need):
                raise PartialDecodeError("the partial's header or deficit table was not delivered")
        arr = np.frombuffer(mv, dtype=np.uint8, count=need)
        p = cls(0, lo=h.lo)
        p.sum = arr[PARTIAL_HEADER_BYTES:end].view(np.float32).copy()
        p.contributors = h.contributors
        p.samples, p.loss_sum = h.samples, h.loss_sum
        if h.n_runs:
            table = arr[end:need].view(np.int64).reshape(-1, 3)
            d = p._deficit()
            for s, e, k in table.tolist():
                if not (0 <= s <= e <= h.n and 0 <= k <= h.contributors):
                    raise PartialDecodeError(f"deficit run ({s}, {e}, {k}) is outside the partial")
                d[s:e] = k
        lost_elems = []
        for s, e in lost_bytes:
            s2, e2 = max(s, PARTIAL_HEADER_BYTES), min(e, end)
            if e2 > s2:
                lost_elems.append(((s2 - PARTIAL_HEADER_BYTES) // ELEM, -(-(e2 - PARTIAL_HEADER_BYTES) // ELEM)))
        p.drop_ranges(lost_elems)
        return p


def _coarsen(runs: list, sums: np.ndarray, contributors: int, max_runs: int):
    """Merge runs across the smallest gaps until ``max_runs`` remain; merged spans are dropped."""
    gaps = sorted(range(len(runs) - 1), key=lambda i: (runs[i + 1][0] - runs[i][1], i))
    close = set(gaps[:len(runs) - max_runs])
    out = [list(runs[0])]
    merged = [False]
    for i in range(1, len(runs)):
        if i - 1 in close:
            out[-1][1] = runs[i][1]
            merged[-1] = True
        else:
            out.append(list(runs[i]))
            merged.append(False)
    sums = sums.copy()
    for r, m in zip(out, merged):
        if m:
            r[2] = contributors
            sums[r[0]:r[1]] = 0
    return [tuple(r) for r in out], sums


def mean_of(partials: Iterable[Partial], mode: str = "unbiased") -> np.ndarray:
    """Merge partials of one range and return their mean (test and planner helper)."""
    it = iter(partials)
    first = next(it).copy()
    for p in it:
        first.merge(p)
    return first.mean(mode)


def assemble(pieces: dict, lo: int, n: int) -> "Partial":
    """One partial over ``[lo, lo + n)`` from reduced pieces (``{(a, b): Partial or None}``) that tile it (a
    piece may be None or absent: nothing came, its elements count 0); per-element counts are kept, the loss and
    samples are those of the piece with the most contributors."""
    full = Partial(n, lo=lo)
    got = [q for q in pieces.values() if q is not None and q.contributors > 0]
    if not got:
        return full
    top = max(got, key=lambda q: q.contributors)
    full.contributors = top.contributors
    full.samples, full.loss_sum = top.samples, top.loss_sum
    deficit = np.full(n, top.contributors, dtype=np.int32)
    for (a, b), q in pieces.items():
        if q is None or q.contributors == 0:
            continue
        full.sum[a - lo:b - lo] = q.sum
        deficit[a - lo:b - lo] -= q.counts().astype(np.int32)
    full.deficit = deficit if deficit.any() else None
    return full
