"""``ring``: the naive ring all-reduce in rank order (reduce-scatter, then all-gather).

Theory of operation
-------------------
``N`` workers in rank order form a ring (position ``p``, right neighbour
``p+1``, left ``p-1``, mod ``N``); the model is cut into ``N`` contiguous
chunks of near-equal size.  Worker ``p`` starts with its own gradient as a
partial (:mod:`.partial`) in slot ``acc``::

    reduce-scatter, step k = 0 .. N-2   (tolerant; header, deficit table, tensor ends critical)
        send chunk (p-k) mod N of "acc" to the right
        recv chunk (p-k-1) mod N from the left, Combine it into "acc"
    -> worker p holds chunk (p+1) mod N reduced over all N workers
    all-gather, step k = 0 .. N-2        (reliable)
        send chunk (p+1-k) mod N ("acc" at k = 0, then what arrived in "ag") to the right
        recv chunk (p-k) mod N from the left into "ag"
    Adopt every chunk's mean; Apply the optimizer on every worker

Loss in the reduce-scatter only removes contributions (the partial's counts
say which), so the mean is the direct PS's unbiased mean.  The all-gather is
reliable: every worker must apply the *same* gradient or the replicas
diverge.  No PS process takes part (``needs_servers = False``); every worker
builds the same plan from the same world (rank 0 is the coordinator that
publishes the membership).  Tags: ``(i, PHASE_REDUCE_SCATTER | PHASE_ALL_GATHER,
k, chunk, KIND_PARTIAL)``.
"""

from __future__ import annotations

from .base import Schedule, World
from .program import (APPLY_AT_WORKERS, RELIABLE, SLOT_ACC, TOLERANT, Adopt, Apply, Combine, Compute, Program, Recv,
                      RoundPlan, Send, worker)
from .tags import PHASE_ALL_GATHER, PHASE_REDUCE_SCATTER, pack

KIND_PARTIAL = 5  # ltp_ps.wire.KIND_PARTIAL
SLOT_AG = "ag"
SLOT_MEAN = "mean"


def chunk_ranges(n_elems: int, parts: int) -> list[tuple]:
    """``parts`` contiguous near-equal ranges covering ``[0, n_elems)`` (the first ones one larger)."""
    base, extra = divmod(n_elems, parts)
    out, lo = [], 0
    for i in range(parts):
        hi = lo + base + (1 if i < extra else 0)
        out.append((lo, hi))
        lo = hi
    return out


def ring_programs(order, chunks, iteration: int, *, critical=lambda lo, hi: ()) -> dict:
    """Programs of one ring all-reduce over ``order`` (ranks) and ``chunks`` (one per position).

    Reusable by other ring planners (RSGCM rings over a subset of chunks).
    """
    n = len(order)
    if len(chunks) != n:
        raise ValueError(f"a ring of {n} needs {n} chunks, got {len(chunks)}")
    progs = {}
    for p, rank in enumerate(order):
        me, right, left = worker(rank), worker(order[(p + 1) % n]), worker(order[(p - 1) % n])
        stages = [(Compute(SLOT_ACC),)]
        for k in range(n - 1):
            cs, cr = (p - k) % n, (p - k - 1) % n
            (slo, shi), (rlo, rhi) = chunks[cs], chunks[cr]
            slot = f"rs:{k}"
            stages.append((Send(right, SLOT_ACC, slo, shi, pack(iteration, PHASE_REDUCE_SCATTER, k, cs, KIND_PARTIAL),
                                TOLERANT, "partial", critical=critical(slo, shi), detach=True),
                           Recv(left, slot, rlo, rhi, pack(iteration, PHASE_REDUCE_SCATTER, k, cr, KIND_PARTIAL),
                                TOLERANT, "partial")))
            stages.append((Combine(SLOT_ACC, slot, rlo, rhi),))
        for k in range(n - 1):
            cs, cr = (p + 1 - k) % n, (p - k) % n
            (slo, shi), (rlo, rhi) = chunks[cs], chunks[cr]
            stages.append((Send(right, SLOT_ACC if k == 0 else SLOT_AG, slo, shi,
                                pack(iteration, PHASE_ALL_GATHER, k, cs, KIND_PARTIAL), RELIABLE, "partial",
                                detach=True),
                           Recv(left, SLOT_AG, rlo, rhi, pack(iteration, PHASE_ALL_GATHER, k, cr, KIND_PARTIAL),
                                RELIABLE, "partial")))
        own = (p + 1) % n
        adopt = tuple(Adopt(SLOT_ACC if c == own or n == 1 else SLOT_AG, lo, hi) for c, (lo, hi) in enumerate(chunks))
        total = (chunks[0][0], chunks[-1][1])
        stages.append(adopt + (Apply(SLOT_MEAN, *total),))
        progs[me] = Program(me, tuple(stages))
    return progs


class RingSchedule(Schedule):
    """Ring all-reduce in rank order; every worker applies the optimizer."""

    name = "ring"
    apply_at = APPLY_AT_WORKERS
    needs_servers = False

    def __init__(self, world: World, *, rng=None, edge_elems: int = 1, max_critical_ranges: int = 120):
        super().__init__(world, rng=rng)
        self.edge_elems = edge_elems
        self.max_critical_ranges = max_critical_ranges

    def _critical(self, lo: int, hi: int) -> tuple:
        if not self.world.layout:
            return ()
        from ..aggregate import critical_ranges

        byte = critical_ranges(self.world.layout, header_bytes=0, shard=(lo, hi), edge_elems=self.edge_elems,
                               max_ranges=self.max_critical_ranges)
        return tuple((lo + a // 4, lo + -(-b // 4)) for a, b in byte)

    def chunks(self) -> list[tuple]:
        return chunk_ranges(self.world.n_elems, len(self.world.workers))

    def plan(self, iteration: int) -> RoundPlan:
        order = list(self.world.workers)
        progs = ring_programs(order, self.chunks(), iteration, critical=self._critical)
        return RoundPlan(self.name, iteration, progs, self.apply_at,
                         notes={"ring": [worker(r) for r in order], "chunks": [list(c) for c in self.chunks()]})

    def predict_s(self, nbytes: int | None = None) -> float | None:
        from .estimate import predict_round_s

        return predict_round_s(self.plan(0), self.world, nbytes)


SCHEDULE = RingSchedule
