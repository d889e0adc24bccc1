"""Message layouts between workers and PS shards (little-endian, 64-byte headers).

Gradient (worker -> PS shard), sent loss-tolerant; the header is critical::

    GradHeader (64 B) | float32 grad[shard_len]

Parameters (PS shard -> workers), sent reliably (bit-exact)::

    ParamsHeader (64 B) | float32 params[shard_len] | Bubble[n_bubbles]

``Bubble = (u32 worker_rank, u32 pad, i64 start, i64 end)``: element ranges of
the *previous* gather that the PS did not receive from that worker.  This is
how error feedback learns what was lost: an LTP sender only knows its
``delivered_fraction``, the PS knows the exact bubbles, and the broadcast is
reliable, so the PS piggy-backs every worker's bubbles on the next parameter
broadcast (one buffer for all workers, as ``broadcast`` requires).  The table
is capped (``MAX_BUBBLES``); beyond it the ranges are coarsened (merged), which
can only over-report loss.

Tags: structured ``(iteration, phase, step, chunk, kind)`` packed by
``ltp_ps.schedules.tags`` (the only place that packs them); ``tag_of(i, kind)``
is the push-phase tag of round ``i``.  A header whose magic is wrong (e.g. a
zero-filled header of a worker that never sent) means "nothing usable".
"""

from __future__ import annotations

import dataclasses
import struct

import numpy as np

from .schedules import tags as _tags

HEADER_BYTES = 64
ELEM = 4  # bytes per float32
MAX_BUBBLES = 16384
_BUBBLE = np.dtype([("rank", "<u4"), ("pad", "<u4"), ("start", "<i8"), ("end", "<i8")])
BUBBLE_BYTES = _BUBBLE.itemsize  # 24

KIND_GRAD = 1
KIND_PARAMS = 2
KIND_STOP = 3
KIND_READY = 4  # tiny reliable "my gradient is computed" note before each push (DirectSchedule ready_handshake only)
KIND_PARTIAL = 5  # a partial aggregate (sum + counts) between workers/aggregators (ltp_ps.schedules.partial)
KIND_GRANT = 6  # a controller's grant (dynamic schedules), reliable JSON
KIND_PLAN = 7  # a round plan distributed by the coordinator, reliable JSON
READY_BYTES = 8


def tag_of(iteration: int, kind: int) -> int:
    """The push-phase tag of ``kind`` in round ``iteration`` (see ``ltp_ps.schedules.tags``)."""
    return _tags.pack(iteration, _tags.PHASE_PUSH, 0, 0, kind)


@dataclasses.dataclass(frozen=True)
class GradHeader:
    MAGIC = b"LTPG"
    # magic, ver, kind, rank, shard, iteration, version, samples, loss, compute seconds
    _S = struct.Struct("<4sHHIIqqqdd")
    rank: int
    shard: int
    iteration: int
    model_version: int
    samples: int
    loss: float
    compute_s: float = 0.0

    def pack_into(self, buf) -> None:
        mv = memoryview(buf).cast("B")
        mv[:HEADER_BYTES] = bytes(HEADER_BYTES)
        self._S.pack_into(mv, 0, self.MAGIC, 1, KIND_GRAD, self.rank, self.shard, self.iteration,
                          self.model_version, self.samples, self.loss, self.compute_s)

    @classmethod
    def unpack(cls, buf) -> "GradHeader | None":
        mv = memoryview(buf).cast("B")
        magic, ver, kind, rank, shard, it, v, samples, loss, cs = cls._S.unpack_from(mv, 0)
        if magic != cls.MAGIC or kind != KIND_GRAD:
            return None
        return cls(rank, shard, it, v, samples, loss, cs)


@dataclasses.dataclass(frozen=True)
class ParamsHeader:
    MAGIC = b"LTPP"
    # magic, ver, kind, shard, iteration, version, n_elems, n_bubbles, epoch, round_bound_ms
    _S = struct.Struct("<4sHHIqqqIII")
    kind: int
    shard: int
    iteration: int
    model_version: int
    n_elems: int
    n_bubbles: int
    epoch: int = 0
    #: tree rounds: the PS's bound (ms) for the round's partials, from its parameter send; 0 = not given.
    #: Aggregating workers wait for their children's partials a share of it (``program_roles``)
    round_bound_ms: int = 0

    def pack_into(self, buf) -> None:
        mv = memoryview(buf).cast("B")
        mv[:HEADER_BYTES] = bytes(HEADER_BYTES)
        self._S.pack_into(mv, 0, self.MAGIC, 1, self.kind, self.shard, self.iteration,
                          self.model_version, self.n_elems, self.n_bubbles, self.epoch,
                          min(self.round_bound_ms, 0xFFFFFFFF))

    @classmethod
    def unpack(cls, buf) -> "ParamsHeader":
        from .errors import RemoteError

        mv = memoryview(buf).cast("B")
        magic, ver, kind, shard, it, v, n, nb, epoch, bound_ms = cls._S.unpack_from(mv, 0)
        if magic != cls.MAGIC:
            raise RemoteError(f"parameter message with bad magic {magic!r}: is the peer an ltp-ps server?")
        return cls(kind, shard, it, v, n, nb, epoch, bound_ms)

    def nbytes(self) -> int:
        return HEADER_BYTES + self.n_elems * ELEM + self.n_bubbles * BUBBLE_BYTES


def params_message_capacity(n_elems: int) -> int:
    return HEADER_BYTES + n_elems * ELEM + MAX_BUBBLES * BUBBLE_BYTES


def encode_bubbles(per_rank: dict, max_entries: int = MAX_BUBBLES) -> np.ndarray:
    """``{rank: [(start, end), ...]}`` -> structured array, coarsened to ``max_entries``."""
    items = []
    for rank, ranges in sorted(per_rank.items()):
        items.extend((rank, s, e) for s, e in ranges)
    if len(items) > max_entries:
        # Coarsen per rank: merge neighbouring ranges until the table fits.
        out = []
        budget = max(1, max_entries // max(1, len(per_rank)))
        for rank, ranges in sorted(per_rank.items()):
            ranges = sorted(ranges)
            step = -(-len(ranges) // budget)
            for i in range(0, len(ranges), step):
                chunk = ranges[i:i + step]
                out.append((rank, chunk[0][0], chunk[-1][1]))
        items = out[:max_entries]
    arr = np.zeros(len(items), dtype=_BUBBLE)
    for i, (r, s, e) in enumerate(items):
        arr[i] = (r, 0, s, e)
    return arr


def decode_bubbles(raw: bytes | memoryview, n: int) -> dict:
    arr = np.frombuffer(raw, dtype=_BUBBLE, count=n)
    out: dict = {}
    for r, _, s, e in arr.tolist():
        out.setdefault(int(r), []).append((int(s), int(e)))
    return out
