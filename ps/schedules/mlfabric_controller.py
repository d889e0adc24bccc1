"""MLfabric's run-time controller (the PS side) and its :class:`Schedule` face.

Theory of operation
-------------------
MLfabric is dynamic: nothing is known before workers finish computing, so
the schedule is a :class:`~ltp_ps.schedules.program.Controller`, not a fixed
round plan.  The executor feeds it events and sends every returned
:class:`~ltp_ps.schedules.program.Grant` reliably to its node; grants to one
node are one stage each and run in the order they were issued.

* ``NodeReady(worker, nbytes, version, norm)`` -- an update is ready (the
  paper's ``push`` intercepted).  It joins the pending batch; the first
  update of a batch arms the batch timer ``BATCH_WINDOW_S`` later (the paper
  batches every 100 ms).
* timer -- the pending batch is planned (:func:`~ltp_ps.schedules.mlfabric.plan_batch`:
  Alg 2 ordering, Alg 3 aggregation) on the reservation table that still
  holds earlier batches' transfers.  Grants out: a drop, or a send to the
  next hop (the PS or an aggregator) at a start time, to each worker; receive,
  combine and forward to each aggregator; receive then apply, in commit
  order, to the PS.  The batch's ``v_init`` is the PS version once every
  earlier planned commit is applied (eq 9).
* ``TransferDone`` -- a granted transfer ended.  A failed transfer to the PS
  (or to an aggregator) takes its gradients out of the expected version
  count, so later deadlines stay exact; the PS's receive times out
  (``grant_timeout``) and the apply step sees fewer contributors.
* ``NodeFailed`` -- the node leaves the worker and aggregator sets; its
  pending update is dropped; planned commits it feeds are written off.
* :meth:`MLfabricController.update_rates` -- the network monitor's report
  every ``t_lag``: capacities are replaced, running reservations carried over.

Version bookkeeping: the PS's version counts gradients applied (an aggregate
of ``c`` gradients counts ``c``), so a batch's ``v_init`` is the previous
batch's ``v_init + applied``, minus any written-off gradients.

The controller never reads a clock: every call takes ``now``.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Mapping, Sequence

from ..wire import KIND_PARTIAL
from . import tags as _tags
from .base import Schedule, World
from .mlfabric import BatchPlan, Update, plan_batch
from .mlfabric_links import FabricNetwork, ReservationTable
from .program import (SLOT_GRAD, TOLERANT, Apply, Combine, Controller, Grant, NodeFailed,
                      NodeReady, Recv, RoundPlan, Send, TransferDone, parse_node, server)

BATCH_WINDOW_S = 0.1  # seconds: updates announced within this window are planned together (paper §7: 100 ms)
GRANT_TIMEOUT_MIN_S = 1.0  # seconds: shortest receive timeout granted
GRANT_TIMEOUT_FACTOR = 3.0  # a receive times out after this many times its predicted duration (+ the minimum)
DEFAULT_TAU_MAX = 8  # versions, when the world does not say



def grant_timeout(now: float, arrive: float) -> float:
    """Receive timeout (seconds) for a transfer predicted to arrive at ``arrive``."""
    return GRANT_TIMEOUT_MIN_S + GRANT_TIMEOUT_FACTOR * max(0.0, arrive - now)


@dataclasses.dataclass
class _Pending:
    """A planned PS-bound commit not yet confirmed."""

    batch: int
    source: str
    tag: int
    members: list  # worker nodes whose gradients it carries
    lost: set = dataclasses.field(default_factory=set)


class MLfabricController(Controller):
    """The PS-side MLfabric scheduler: batches announced updates, plans them, issues grants."""

    def __init__(self, net: FabricNetwork, server_node: str, *, n_elems: int, lo: int = 0, tau_max: int | None = DEFAULT_TAU_MAX,
                 k: int = 0, aggregators: Sequence[str] | None = None, rng: random.Random | None = None,
                 batch_window_s: float = BATCH_WINDOW_S, v_init: int = 0):
        if batch_window_s < 0:
            raise ValueError("batch_window_s must be >= 0 seconds")
        if k < 0:
            raise ValueError("k (aggregators per batch) must be >= 0")
        self.net = net
        self.server = server_node
        self.lo, self.hi = int(lo), int(lo) + int(n_elems)  # the model elements every update carries
        self.tau_max = tau_max
        self.k = int(k)
        self.candidates = None if aggregators is None else list(aggregators)  # None: every live worker
        self.rng = rng or random.Random(0)
        self.batch_window_s = float(batch_window_s)
        self.workers: list = []
        self.table: ReservationTable | None = None
        self.pending: dict = {}  # node -> Update (announced, not yet planned)
        self._seq = 0
        self._batch_due: float | None = None
        self.batch = 0
        self.v_next = int(v_init)  # PS version once every planned commit is applied (next batch's v_init)
        self.outstanding: dict = {}  # (source, tag) -> _Pending
        self._member_hop: dict = {}  # (worker, aggregator, tag) -> (source, tag) of the aggregate it feeds
        self.plans: list = []  # BatchPlan of every batch (bounded: the last ``PLAN_HISTORY``)
        self.ignored: dict = {}  # reason -> count (events that named unknown nodes, duplicates, ...)
        self.stats = {"planned": 0, "dropped": 0, "aggregated": 0, "batches": 0, "written_off": 0}

    PLAN_HISTORY = 64

    # -- Controller interface -------------------------------------------------------------------------------------
    def start(self, iteration: int, nodes: Sequence[str], *, now: float) -> list[Grant]:
        """Begin serving ``nodes`` (the workers; the PS is ``server_node``).  No grants until updates arrive."""
        self.workers = [n for n in nodes if n != self.server]
        for n in self.workers:
            parse_node(n)
        if self.table is None:
            self.table = ReservationTable.for_network(self.net, now=now)
        return []

    def on_event(self, event, *, now: float) -> list[Grant]:
        if self.table is None:
            raise RuntimeError("MLfabricController.on_event before start(); call start(iteration, nodes, now=...)")
        if isinstance(event, NodeReady):
            return self._on_ready(event, now)
        if isinstance(event, TransferDone):
            return self._on_done(event, now)
        if isinstance(event, NodeFailed):
            return self._on_failed(event, now)
        self._ignore("unknown_event")
        return []

    def next_deadline(self) -> float | None:
        return self._batch_due

    def on_timer(self, *, now: float) -> list[Grant]:
        if self._batch_due is None or now < self._batch_due:
            return []
        return self.flush(now=now)

    def done(self) -> bool:
        return not self.pending and not self.outstanding

    # -- monitor ----------------------------------------------------------------------------------------------------
    def update_rates(self, up: Mapping | None = None, down: Mapping | None = None, *, now: float) -> None:
        """New host rates (bytes/s) from the network monitor (every ``t_lag``); running reservations kept."""
        self.net = self.net.with_rates(up, down)
        if self.table is None:
            self.table = ReservationTable.for_network(self.net, now=now)
        else:
            self.table = self.table.rerate(self.net.capacities(), now=now)

    # -- events -----------------------------------------------------------------------------------------------------
    def _ignore(self, reason: str) -> None:
        self.ignored[reason] = self.ignored.get(reason, 0) + 1

    def _on_ready(self, ev: NodeReady, now: float) -> list[Grant]:
        if ev.node not in self.workers:
            self._ignore("ready_from_unknown_node")
            return []
        if ev.node in self.pending:
            self._ignore("second_update_before_grant")
            return []
        self.pending[ev.node] = Update(ev.node, int(ev.nbytes), int(ev.version), float(ev.norm), self._seq)
        self._seq += 1
        if self._batch_due is None:
            self._batch_due = now + self.batch_window_s
        return []

    def _write_off(self, key, worker: str | None = None) -> None:
        p = self.outstanding.get(key)
        if p is None:
            return
        lost = [m for m in p.members if (worker is None or m == worker) and m not in p.lost]
        p.lost.update(lost)
        self.v_next -= len(lost)
        self.stats["written_off"] += len(lost)

    def _on_done(self, ev: TransferDone, now: float) -> list[Grant]:
        key = (ev.src, ev.tag)
        if ev.dst == self.server and key in self.outstanding:
            if not ev.ok:
                self._write_off(key)
            del self.outstanding[key]
            return []
        feed = self._member_hop.pop((ev.src, ev.dst, ev.tag), None)
        if feed is not None:
            if not ev.ok:
                self._write_off(feed, ev.src)
            return []
        self._ignore("done_for_unknown_transfer")
        return []

    def _on_failed(self, ev: NodeFailed, now: float) -> list[Grant]:
        node = ev.node
        if node in self.workers:
            self.workers.remove(node)
        if self.candidates is not None and node in self.candidates:
            self.candidates.remove(node)
        self.pending.pop(node, None)
        if not self.pending:
            self._batch_due = None
        for key, p in list(self.outstanding.items()):
            if p.source == node:  # its transfer to the PS (a direct update or an aggregate) will not come
                self._write_off(key)
                del self.outstanding[key]
        for mk in [mk for mk in self._member_hop if mk[0] == node or mk[1] == node]:
            feed = self._member_hop.pop(mk)
            if mk[0] == node:  # its gradient had not reached the aggregator yet: the aggregate comes without it
                self._write_off(feed, node)
        return []

    # -- planning ---------------------------------------------------------------------------------------------------
    def flush(self, *, now: float) -> list[Grant]:
        """Plan the pending batch now and return its grants (the timer calls this)."""
        self._batch_due = None
        if not self.pending:
            return []
        updates = list(self.pending.values())
        self.pending.clear()
        cands = self.candidates if self.candidates is not None else self.workers
        plan = plan_batch(updates, self.table, self.net, self.server, now=now, tau_max=self.tau_max,
                          v_init=self.v_next, aggregators=[c for c in cands if c in self.workers], k=self.k,
                          rng=self.rng)
        self.table = plan.table
        self.v_next = plan.v_init + plan.applied
        self.plans.append(plan)
        del self.plans[:-self.PLAN_HISTORY]
        self.stats["batches"] += 1
        self.stats["planned"] += plan.applied
        self.stats["dropped"] += len(plan.drops)
        self.stats["aggregated"] += sum(len(c.members) for c in plan.commits if c.group > 0)
        grants = self.grants_for(plan, self.batch, now=now)
        self.batch += 1
        return grants

    def _tag(self, batch: int, step: int, chunk: int, kind: int) -> int:
        return _tags.pack(batch % (_tags.MAX_ITERATION + 1), _tags.PHASE_PUSH, min(step, _tags.MAX_STEP),
                          chunk % (_tags.MAX_CHUNK + 1), kind)

    def grants_for(self, plan: BatchPlan, batch: int, *, now: float) -> list[Grant]:
        """The grants that carry out ``plan``: workers first, then aggregators, then the PS in commit order."""
        lo, hi = self.lo, self.hi
        out: list = []
        agg_grants: list = []
        ps_grants: list = []
        for c in plan.commits:
            first = c.members[0].position
            if c.group == 0:
                m = c.members[0]
                tag = self._tag(batch, first, 0, KIND_PARTIAL)
                out.append(Grant(m.update.node, (Send(self.server, SLOT_GRAD, lo, hi, tag, TOLERANT, "partial"),),
                                 start_at=c.start))
                self.outstanding[(m.update.node, tag)] = _Pending(batch, m.update.node, tag, [m.update.node])
            else:
                agg = c.source
                acc = f"mlf:{batch}:{c.group}:acc"
                tag_out = self._tag(batch, first, c.group, KIND_PARTIAL)
                recvs, combines = [], []
                for m in c.members:
                    g = plan.grant_of(m.update.node)
                    tag_in = self._tag(batch, m.position, c.group, KIND_PARTIAL)
                    slot = f"mlf:{batch}:in:{m.update.node}"
                    out.append(Grant(m.update.node, (Send(agg, SLOT_GRAD, lo, hi, tag_in, TOLERANT, "partial"),),
                                     start_at=g.start))
                    recvs.append(Recv(m.update.node, slot, lo, hi, tag_in, TOLERANT, "partial",
                                      group=f"mlf:{batch}:{c.group}", timeout_s=grant_timeout(now, g.arrive)))
                    combines.append(Combine(acc, slot, lo, hi))
                    self._member_hop[(m.update.node, agg, tag_in)] = (agg, tag_out)
                agg_grants.append(Grant(agg, tuple(recvs), reason=f"aggregate group {c.group}"))
                agg_grants.append(Grant(agg, tuple(combines)))
                agg_grants.append(Grant(agg, (Send(self.server, acc, lo, hi, tag_out, TOLERANT, "partial"),),
                                        start_at=c.start))
                self.outstanding[(agg, tag_out)] = _Pending(batch, agg, tag_out, [m.update.node for m in c.members])
            src = c.source
            tag = self._tag(batch, first, c.group, KIND_PARTIAL)
            slot = f"mlf:{batch}:{c.group}:{first}"
            ps_grants.append(Grant(self.server, (Recv(src, slot, lo, hi, tag, TOLERANT, "partial",
                                                      timeout_s=grant_timeout(now, c.arrive)),),
                                   reason=f"position {first} ({len(c.members)} gradients)"))
            ps_grants.append(Grant(self.server, (Apply(slot, lo, hi),)))
        for g in plan.grants:
            if g.drop:
                out.append(Grant(g.update.node, (), drop=True, reason=g.reason))
        return out + agg_grants + ps_grants


class MLfabricSchedule(Schedule):
    """``--schedule mlfabric``: asynchronous PS with MLfabric's ordering, delay bounds and aggregation.

    Dynamic: :meth:`plan` has no fixed transfers; :meth:`controller` gives the
    PS-side controller.  One PS shard (the paper's §5 assumes a single server).
    """

    name = "mlfabric"

    def __init__(self, world: World, *, rng: random.Random | None = None, tau_max: int | None = DEFAULT_TAU_MAX,
                 k: int = 1, batch_window_s: float = BATCH_WINDOW_S):
        super().__init__(world, rng=rng)
        if len(world.shards) != 1:
            raise ValueError(f"mlfabric plans for one PS shard (paper §5), the world has {len(world.shards)}; "
                             "launch it with one shard")
        self.tau_max = tau_max
        self.k = int(k)
        self.batch_window_s = batch_window_s

    def network(self) -> FabricNetwork:
        """The world's topology as MLfabric's link model (node ids as hosts)."""
        return FabricNetwork.from_topology(self.world.effective_topology())

    def plan(self, iteration: int) -> RoundPlan:
        return RoundPlan(self.name, iteration, {}, notes={"dynamic": "controller", "tau_max": self.tau_max,
                                                          "k": self.k})

    def controller(self) -> MLfabricController:
        lo, hi = self.world.shards[0]
        c = MLfabricController(self.network(), server(0), n_elems=hi - lo, lo=lo, tau_max=self.tau_max, k=self.k,
                               rng=self.rng, batch_window_s=self.batch_window_s)
        return c


__all__ = ["MLfabricController", "MLfabricSchedule", "BATCH_WINDOW_S", "grant_timeout"]
