"""The DDP hook without a parameter server: each gradient bucket is all-reduced by a ring (or RSGCM) schedule program.

Theory of operation
-------------------
With ``ltp_ps.ddp.register(model, schedule="ring" | "rsgcm")`` no rank serves
buckets: every rank opens one endpoint on the hook's loop thread, publishes
its address in the process group's store, and round ``r`` (the ``r``-th
bucket this process hooked; DDP launches buckets in the same order on every
rank) runs this rank's program of :func:`ltp_ps.collectives.schedule_program`
on the executor of :mod:`ltp_ps.schedules`:

1. *Attempt* (tags of iteration ``2r``): a **loss-tolerant** reduce-scatter
   (each chunk travels around the ring as a partial aggregate: sums plus
   per-element contributor counts; a lost packet removes the contributions it
   carried from those elements, never adds zeros; the bucket's first and last
   element of every parameter are critical) and a **reliable** all-gather of
   every reduced chunk, counts included.
2. *Verdict* (:func:`judge`, pure): after the all-gather every rank holds the
   same bits for every chunk (sums and counts), so every rank reaches the same
   verdict with no extra message: ``full`` (every element has all ``world``
   contributions), ``lossy`` (some are missing, at least ``min_fraction`` of
   all contributions arrived and every element has at least one: the unbiased
   per-element mean is used, as the PS does), or ``repair``.
3. *Repair* (tags of iteration ``2r + 1``): the same program with every
   transfer reliable, on the same gradient: an exact mean.  So a bucket with
   no contribution for some element is never applied as zeros, and a round
   below ``min_fraction`` is never averaged.

Errors: a reliable transfer that fails (a dead or stuck neighbour, after the
executor's timeout ``timeout_s``) ends the round on this rank at once with
:class:`~ltp_ps.backend.LtpBackendError` naming rank, bucket, round, the step
and the neighbour; its neighbours then fail the same way (a ring has no spare
path), so no rank waits forever.  Counters and rate-limited warnings are those
of the PS hook (:class:`ltp_ps.ddp.HookStats`).

Compared with the PS hook, no process receives ``world`` buckets: each rank
sends and receives ``2 (world-1)/world`` of a bucket per round, the traffic of
a ring all-reduce.  The verdict has no "cut without loss" rule (the PS hook
resends a contribution whose tail was cut on a path that lost nothing): on a
ring the receiver alone sees the cut, and the verdict must be the same on
every rank; such a cut shows up as a ``lossy`` round (see docs/ddp.md).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from . import collectives as C
from .ddp import ELEM, HDR, MIN_FRACTION, LtpHookState
from .schedules.executor import Executor, Slots
from .schedules.partial import MAX_DEFICIT_RUNS, Partial
from .schedules.program import Program, worker
from .schedules.tags import MAX_ITERATION

FULL, LOSSY, REPAIR = "full", "lossy", "repair"


@dataclasses.dataclass(frozen=True)
class ScheduleVerdict:
    """What every rank does with a round's reduced chunks, and why."""

    action: str  # FULL | LOSSY | REPAIR
    fraction: float  # delivered contributions / (world x elements)
    reason: str = ""


def judge(pieces: list, n: int, world: int, min_fraction: float) -> ScheduleVerdict:
    """The verdict on a round from its reduced chunks (``Partial`` s covering ``[0, n)``), the same on every rank.

    Rules, in order: a chunk missing, or an element with no contribution ->
    repair; a deficit table at its size limit (the owner's and the others'
    copies could differ) -> repair; all contributions -> full; fewer than
    ``min_fraction`` of them -> repair; otherwise lossy.
    """
    if not 0.0 <= min_fraction <= 1.0:  # as RoundPolicy: 0 accepts any lossy round (uncovered elements still repair)
        raise ValueError(f"min_fraction must be in [0, 1], got {min_fraction}")
    covered = sum(p.n for p in pieces)
    if covered != n:
        return ScheduleVerdict(REPAIR, 0.0, f"the reduced chunks cover {covered} of {n} elements")
    delivered = 0
    for p in pieces:
        c = p.counts()
        if p.n and int(c.min()) <= 0:
            return ScheduleVerdict(REPAIR, 0.0, f"elements of [{p.lo}, {p.hi}) reached no rank's contribution")
        if len(p.deficit_runs()) >= MAX_DEFICIT_RUNS:
            return ScheduleVerdict(REPAIR, 0.0, f"chunk [{p.lo}, {p.hi}) lost in too many places to describe")
        delivered += int(c.sum())
    f = delivered / (world * n) if n else 1.0
    if delivered >= world * n:
        return ScheduleVerdict(FULL, 1.0)
    if f < min_fraction:
        return ScheduleVerdict(REPAIR, f, f"only {f:.1%} of the contributions arrived (< {min_fraction:.0%})")
    return ScheduleVerdict(LOSSY, f, f"{f:.1%} of the contributions arrived")


class _Pieces:
    """Executor handler: this rank's gradient in (``Compute``), the reduced chunks out (``Adopt``)."""

    def __init__(self, grads: np.ndarray):
        self.grads = grads
        self.pieces: dict = {}
        self.missing: list = []

    def compute(self, step, slots):
        slots.put_partial(step.slot, Partial.of_gradient(self.grads))

    def adopt(self, step, slots):
        p = slots.partial(step.slot, step.lo, step.hi)
        if p is None:
            self.missing.append((step.lo, step.hi))
        else:
            self.pieces[(step.lo, step.hi)] = p

    def apply(self, step, slots):
        return None

    def ordered(self) -> list:
        return [self.pieces[k] for k in sorted(self.pieces)]


def critical_elements(byte_ranges, n: int) -> list:
    """The hook's critical byte ranges (PS message layout: ``HDR`` header, then float32s) as element ranges."""
    out = []
    for a, b in byte_ranges:
        lo, hi = max(0, (a - HDR) // ELEM), min(n, -(-(b - HDR) // ELEM))
        if b > HDR and hi > lo:
            out.append((lo, hi))
    return out


@dataclasses.dataclass
class ScheduleHookState(LtpHookState):
    """Hook state of the PS-less hook (``schedule`` ``"ring"`` or ``"rsgcm"``); ``stats`` as for the PS hook."""

    schedule: str = "ring"
    min_fraction: float = MIN_FRACTION
    nodes: dict = dataclasses.field(default_factory=dict)  # worker node id -> address, every rank
    ring_plan: object = None  # the RSGCM plan (schedule "rsgcm")
    verdicts: list = dataclasses.field(default_factory=list)  # recent ScheduleVerdicts (bounded)

    async def _run(self, r: int, index: int, it: int, grads, crit, exact: bool) -> _Pieces:
        n = grads.size
        clip = (lambda lo, hi: tuple((max(a, lo), min(b, hi)) for a, b in crit if min(b, hi) > max(a, lo)))
        prog = C.schedule_program(self.schedule, self.rank, self.world_size, n, it & MAX_ITERATION,
                                  ring_plan=self.ring_plan, exact=exact, critical=clip)
        ex = Executor(self.transport, worker(self.rank), self.nodes, timeout_s=self.timeout_s)
        slots, into = Slots(), _Pieces(grads)
        done, total = 0, len(prog.steps())
        for stage in prog.stages:  # stage by stage: a failed reliable transfer ends the round at once
            res = await ex.run(Program(prog.node, (stage,)), slots, into, iteration=it & MAX_ITERATION)
            for k, (st, rep) in enumerate(zip(stage, res.reports)):
                if st.op == "send" and rep is not None and not isinstance(rep, BaseException):
                    self._note_loss(rep)  # this rank's sends: its path loss (``stats.max_path_loss``)
                if st.op not in ("send", "recv") or st.mode != "reliable":
                    continue  # a tolerant transfer that lost data shows in the counts
                bad = _reliable_failure(st, rep)
                if bad is not None:
                    peer = st.peer.partition(":")[2]
                    raise self._fail(r, index, f"{self.schedule} step {done + k + 1}/{total} ({st.op} elements "
                                               f"[{st.lo}, {st.hi}) {'from' if st.op == 'recv' else 'to'} rank "
                                               f"{peer}) failed: {bad}; rank {peer} is dead or stuck, or its network "
                                               f"is down (timeout {self.timeout_s:g} s)")
            done += len(stage)
        return into

    async def exchange(self, r: int, index: int, grads: np.ndarray, critical: list) -> np.ndarray:
        n = grads.size
        crit = critical_elements(critical, n)
        exact = self.min_fraction >= 1.0
        got = await self._run(r, index, 2 * r, grads, crit, exact=exact)
        self.stats.max_path_loss = max(self.stats.max_path_loss, self.path_loss())
        verdict = judge(got.ordered(), n, self.world_size, self.min_fraction)
        if verdict.action == REPAIR:
            got = await self._run(r, index, 2 * r + 1, grads, crit, exact=True)
            final = judge(got.ordered(), n, self.world_size, 1.0)
            if final.action != FULL:
                raise self._fail(r, index, f"the reliable repair of the bucket was incomplete: {final.reason}")
        self.verdicts.append(verdict)
        del self.verdicts[:-self.HISTORY]
        self._count_verdict(verdict)
        out = np.empty(n, dtype=np.float32)
        for p in got.ordered():
            p.mean("unbiased", out=out[p.lo:p.hi])
        return out

    def _count_verdict(self, v: ScheduleVerdict) -> None:
        s = self.stats
        s.rounds += 1
        s.min_delivered_fraction = min(s.min_delivered_fraction, v.fraction)
        if v.action == FULL:
            s.full_rounds += 1
        elif v.action == LOSSY:
            s.lossy_rounds += 1
            self.warner.warn("lossy", f"{s.lossy_rounds} of {s.rounds} rounds averaged partially delivered buckets "
                                      f"(lowest delivered fraction {s.min_delivered_fraction:.1%}); see state.stats")
        else:
            s.repaired_rounds += 1
            s.repaired_contributions += 1
            key = v.reason.split(" (")[0]
            s.reasons[key] = s.reasons.get(key, 0) + 1
            self.warner.warn("repaired", f"{s.repaired_rounds} of {s.rounds} rounds were reduced again reliably "
                                         f"({v.reason}); see state.stats")


def _reliable_failure(st, rep) -> str | None:
    if isinstance(rep, BaseException):
        return f"{type(rep).__name__}: {rep}"
    if rep is None:
        return "the executor ran no transfer"
    if st.op == "recv":
        if rep.received_bytes == 0 or rep.received_bytes < rep.total_bytes or rep.bubbles:
            return f"received {rep.received_bytes} of {rep.total_bytes or '?'} bytes ({rep.regime})"
        return None
    if rep.delivered_bytes < rep.total_bytes:
        return f"acknowledged {rep.delivered_bytes} of {rep.total_bytes} bytes ({rep.close_reason})"
    return None


__all__ = ["FULL", "LOSSY", "REPAIR", "ScheduleHookState", "ScheduleVerdict", "critical_elements", "judge"]
