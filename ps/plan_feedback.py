"""Live feedback for adaptive PS-less schedules (RSGCM): failures and round times -> every worker's planner.

Theory of operation
-------------------
A PS-less job (``ps/allreduce.py``) has no central process that watches the
rounds, yet an adaptive planner (``RsgcmSchedule.observe`` / ``observe_round``)
must see the same evidence on every worker, in the same order, or the
deterministic planners would build different plans and the rings would not
close.  So every round ends with one exchange through the job's coordinator
(rank 0 / the rendezvous store):

1. each worker publishes its :class:`RoundOutcome`: did it get every reduced
   chunk (``ok``), how long its reduce took, which peers did not deliver a
   receive (``missed``), which peers a send failed to (``send_failed``), and
   whether some of its sends had nothing to send because an earlier receive
   delivered nothing (``starved``: the failure is upstream, not on its links);
2. the coordinator waits for all outcomes (a worker that publishes nothing
   within the bound is a failed device) and :func:`decide` turns them into one
   :class:`Decision`: link reports (``LinkReport`` with ``ok=False`` for the
   failed pairs, ``ok=True`` for every pair that delivered), the round's time
   (the slowest worker's reduce) and ``retry`` (somebody lacks a chunk);
3. every worker feeds the *same* decision to its own planner
   (``observe(reports)``, then ``observe_round(seconds)`` if the round was
   complete) and, on ``retry``, runs the round's reduce again with the new plan
   on the gradient it already computed.  The optimizer step is applied only
   once a round is complete everywhere, so replicas stay identical and no
   round's gradient is lost: a failure costs a retry, never a round.

Blame: a failure cascades.  A receive that waits out its bound on a blocked
link delays everything downstream, so the next hops time out too, and a
worker whose input never arrived has nothing to send (``starved``).  So only
the *earliest* evidence counts: among the missing receives ``x <- y`` (``y``
not starved towards ``x``, and ``y`` missing nothing itself in an earlier
stage: else ``y`` was late because of its own upstream) and failed sends, those of the lowest program
stage name the failed pairs (stages are aligned across workers: every
worker's program of one plan has the same stage count, step ``k`` of every
ring in stage ``k``).  A second failure in the same round shows in the retry.

:func:`decide` is sans-IO (plain data in and out).  :class:`StoreFeedback`
carries outcomes through a rendezvous store (keys ``fb/<seq>/<rank>`` and
``fb/<seq>/decision``, HMAC-signed like the rest of the job's keys);
:class:`MemoryFeedback` is the in-process hub the tests use.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Callable, Sequence

from .schedules.base import LinkReport
from .schedules.program import worker as worker_node

FEEDBACK_POLL_S = 0.005  # seconds between looks at the store while outcomes arrive
FEEDBACK_TIMEOUT_S = 60.0  # seconds the coordinator waits for a worker's outcome before failing its device
MAX_RETRIES = 4  # attempts of one round's reduce after the first (then the job fails)


@dataclasses.dataclass
class RoundOutcome:
    """What one worker saw in one attempt of a round (plain data; JSON round-trips)."""

    rank: int
    seq: int  # attempt number (the same on every worker)
    ok: bool  # every reduced chunk arrived
    reduce_s: float  # seconds from the end of Compute to the end of the program
    missed: tuple = ()  # (rank, stage): a receive from rank in that stage got nothing
    send_failed: tuple = ()  # (rank, stage): a send to rank in that stage raised
    starved: tuple = ()  # ranks this worker could not send to: its input never arrived
    delivered: tuple = ()  # ranks that delivered every receive

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> "RoundOutcome":
        return cls(rank=int(d["rank"]), seq=int(d["seq"]), ok=bool(d["ok"]), reduce_s=float(d["reduce_s"]),
                   missed=tuple(tuple(x) for x in d.get("missed", ())),
                   send_failed=tuple(tuple(x) for x in d.get("send_failed", ())),
                   starved=tuple(d.get("starved", ())), delivered=tuple(d.get("delivered", ())))


@dataclasses.dataclass
class Decision:
    """The coordinator's verdict on one attempt; every worker applies it identically."""

    seq: int
    retry: bool
    round_s: float | None  # the round's measured all-reduce time (None: the round was not complete)
    failed_pairs: tuple = ()  # (a, b) ranks, a < b
    ok_pairs: tuple = ()
    dead: tuple = ()  # ranks that published no outcome

    def link_reports(self) -> list:
        """The decision as the schedule layer's ``LinkReport`` list (worker node names)."""
        out = [LinkReport(worker_node(a), worker_node(b), 0, 0.0, ok=True) for a, b in self.ok_pairs]
        out += [LinkReport(worker_node(a), worker_node(b), 0, 0.0, delivered_fraction=0.0, ok=False)
                for a, b in self.failed_pairs]
        return out

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        d["failed_pairs"] = [list(p) for p in self.failed_pairs]
        d["ok_pairs"] = [list(p) for p in self.ok_pairs]
        return d

    @classmethod
    def from_json(cls, d: dict) -> "Decision":
        return cls(seq=int(d["seq"]), retry=bool(d["retry"]), round_s=d["round_s"],
                   failed_pairs=tuple(tuple(p) for p in d["failed_pairs"]),
                   ok_pairs=tuple(tuple(p) for p in d["ok_pairs"]), dead=tuple(d["dead"]))


def _pair(a: int, b: int) -> tuple:
    return (a, b) if a < b else (b, a)


def decide(seq: int, outcomes: Sequence[RoundOutcome], ranks: Sequence[int]) -> Decision:
    """The verdict on attempt ``seq`` from the outcomes that arrived (``ranks``: every live worker)."""
    by_rank = {o.rank: o for o in outcomes}
    dead = tuple(r for r in ranks if r not in by_rank)
    first_miss = {o.rank: min((st for _, st in o.missed), default=None) for o in outcomes}
    evidence, ok = [], set()
    for o in outcomes:
        for y, stage in o.missed:
            src = by_rank.get(y)
            if src is None or o.rank in src.starved:
                continue  # y had nothing to send (its upstream failed) or is silent: not this link's fault
            if first_miss.get(y) is not None and first_miss[y] < stage:
                continue  # y was itself waiting on a failure upstream when it should have sent: a cascade
            evidence.append((stage, _pair(o.rank, y)))
        for y, stage in o.send_failed:
            if y in by_rank:
                evidence.append((stage, _pair(o.rank, y)))
        for y in o.delivered:
            ok.add(_pair(o.rank, y))
    first = min((st for st, _ in evidence), default=None)
    failed = {p for st, p in evidence if st == first}
    for d in dead:  # a silent device: every pair through it failed (the planner sees a failed device)
        failed.update(_pair(d, r) for r in ranks if r != d)
    ok -= failed
    complete = not dead and all(o.ok for o in outcomes)
    round_s = max((o.reduce_s for o in outcomes), default=None) if complete else None
    return Decision(seq=seq, retry=not complete, round_s=round_s, failed_pairs=tuple(sorted(failed)),
                    ok_pairs=tuple(sorted(ok)), dead=dead)


def apply_decision(planner, decision: Decision) -> None:
    """Feed ``decision`` to an adaptive ``planner`` (the same calls, in the same order, on every worker)."""
    reports = decision.link_reports()
    if decision.failed_pairs:
        planner.observe(reports)
    if decision.round_s is not None and decision.round_s > 0 and not decision.failed_pairs:
        observe_round = getattr(planner, "observe_round", None)
        if observe_round is not None:
            observe_round(decision.round_s)


def wants_feedback(planner) -> bool:
    """True for planners that learn from observations (they override ``observe`` or have ``observe_round``)."""
    from .schedules.base import Schedule

    return type(planner).observe is not Schedule.observe or hasattr(planner, "observe_round")


class MemoryFeedback:
    """In-process coordinator for workers of one event loop (tests, single-process jobs)."""

    def __init__(self, ranks: Sequence[int], *, timeout_s: float = FEEDBACK_TIMEOUT_S):
        self.ranks = list(ranks)
        self.timeout_s = timeout_s
        self._outcomes: dict = {}
        self._decisions: dict = {}
        self._cond = asyncio.Condition()
        self.decisions: list = []  # every decision, in order (for inspection)

    async def exchange(self, outcome: RoundOutcome) -> Decision:
        """Publish ``outcome``; return the coordinator's decision for its attempt."""
        seq = outcome.seq
        async with self._cond:
            self._outcomes.setdefault(seq, {})[outcome.rank] = outcome
            self._cond.notify_all()
            if outcome.rank == self.ranks[0]:
                try:
                    await asyncio.wait_for(self._cond.wait_for(
                        lambda: len(self._outcomes[seq]) == len(self.ranks)), self.timeout_s)
                except asyncio.TimeoutError:
                    pass
                d = decide(seq, list(self._outcomes[seq].values()), self.ranks)
                self._decisions[seq] = d
                self.decisions.append(d)
                self.ranks = [r for r in self.ranks if r not in d.dead]
                self._cond.notify_all()
                return d
            await self._cond.wait_for(lambda: seq in self._decisions)
            return self._decisions[seq]


class StoreFeedback:
    """Coordinator through the job's rendezvous store: rank ``ranks[0]`` decides, everybody reads the decision.

    ``sign(dict) -> str`` and ``verify(bytes, what) -> dict`` are the job's HMAC helpers.
    """

    def __init__(self, store, rank: int, ranks: Sequence[int], *, sign: Callable, verify: Callable,
                 timeout_s: float = FEEDBACK_TIMEOUT_S, poll_s: float = FEEDBACK_POLL_S):
        self.store = store
        self.rank = rank
        self.ranks = list(ranks)
        self.sign = sign
        self.verify = verify
        self.timeout_s = timeout_s
        self.poll_s = poll_s
        self.decisions: list = []

    def _wait(self, keys, timeout_s: float) -> list:
        t_end = time.monotonic() + timeout_s
        while True:
            have = [k for k in keys if self.store.check([k])]
            if len(have) == len(keys) or time.monotonic() > t_end:
                return have
            time.sleep(self.poll_s)

    def _exchange(self, outcome: RoundOutcome) -> Decision:
        seq = outcome.seq
        self.store.set(f"fb/{seq}/{self.rank}", self.sign(outcome.to_json()))
        if self.rank == self.ranks[0]:
            keys = [f"fb/{seq}/{r}" for r in self.ranks]
            have = self._wait(keys, self.timeout_s)
            outs = [RoundOutcome.from_json(self.verify(self.store.get(k), k)) for k in have]
            d = decide(seq, outs, self.ranks)
            self.store.set(f"fb/{seq}/decision", self.sign(d.to_json()))
        else:
            key = f"fb/{seq}/decision"
            if not self._wait([key], 2 * self.timeout_s + 5):
                from .errors import TrainingFailed

                raise TrainingFailed(f"worker {self.rank}: the coordinator (rank {self.ranks[0]}) published no "
                                     f"decision for attempt {seq} within {2 * self.timeout_s + 5:.0f} s")
            d = Decision.from_json(self.verify(self.store.get(key), key))
        self.ranks = [r for r in self.ranks if r not in d.dead]
        self.decisions.append(d)
        return d

    async def exchange(self, outcome: RoundOutcome) -> Decision:
        """Publish ``outcome``; return the coordinator's decision for its attempt."""
        return await asyncio.to_thread(self._exchange, outcome)


def outcome_of(rank: int, seq: int, program, result, *, ok: bool, reduce_s: float, rank_of: Callable) -> RoundOutcome:
    """Summarise one executor ``RunResult`` of ``program`` as this worker's outcome.

    ``rank_of(node) -> int | None`` maps a peer node name to its rank.
    """
    from .schedules.executor import MissingInput

    stage_of = [k for k, stage in enumerate(program.stages) for _ in stage]
    steps = program.steps()
    missing_idx = {i for i, _ in result.missing}
    missed, send_failed, starved, delivered = set(), set(), set(), set()
    for i, s in enumerate(steps):
        if s.op not in ("send", "forward", "recv"):
            continue
        peer = rank_of(s.peer)
        if peer is None:
            continue
        rep = result.reports[i]
        if s.op == "recv":
            if i in missing_idx or isinstance(rep, BaseException):
                missed.add((peer, stage_of[i]))
            else:
                delivered.add(peer)
        elif isinstance(rep, MissingInput):
            starved.add(peer)
        elif isinstance(rep, BaseException):
            send_failed.add((peer, stage_of[i]))
    delivered -= {p for p, _ in missed}
    return RoundOutcome(rank=rank, seq=seq, ok=ok, reduce_s=reduce_s, missed=tuple(sorted(missed)),
                        send_failed=tuple(sorted(send_failed)), starved=tuple(sorted(starved)),
                        delivered=tuple(sorted(delivered)))


__all__ = ["RoundOutcome", "Decision", "decide", "apply_decision", "wants_feedback", "MemoryFeedback",
           "StoreFeedback", "outcome_of", "MAX_RETRIES", "FEEDBACK_TIMEOUT_S"]

