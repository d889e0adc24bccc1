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
  combine and forward to each aggregator (an aggregator that is itself a
  member combines its own gradient without a transfer); receive then apply,
  in commit order, to the PS.  The batch's ``v_init`` is the PS version once every
  earlier planned commit is applied (eq 9).
* ``TransferDone`` -- a granted transfer ended.  A failed transfer to the PS
  (or to an aggregator) takes its gradients out of the expected version
  count, so later deadlines stay exact; the PS's receive times out
  (``grant_timeout``) and the apply step sees fewer contributors.
* ``NodeFailed`` -- the node leaves the worker and aggregator sets; its
  pending update is dropped; planned commits it feeds are written off.
* :meth:`MLfabricController.update_rates` -- the network monitor's report
  every ``t_lag``: capacities are replaced, running reservations carried over.

Replica option (§5.3): with ``replica=`` a node id and ``div_max``, every
batch's primary plan is followed by :func:`~ltp_ps.schedules.mlfabric_replica.plan_replica`:
each granted worker also keeps its gradient in ``mlf:keep:<seq>`` (a Combine
after its send), replica copies are granted from that slot to the replica
(or its aggregators) in the primary's order, updates that cannot reach the
replica by the batch's last commit are punted to the next batch (the
``backlog``), and when the bound would break the primary's last transfer is
granted a later start.  The replica's ``||h||`` is tracked with
``history_bound`` from zero.

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
from .mlfabric_replica import DEFAULT_MAX_BACKLOG, ReplicaPlan, plan_replica
from .partial import payload_range
from .mlfabric_links import FabricNetwork, ReservationTable
from .program import (SLOT_GRAD, TOLERANT, Apply, Combine, Controller, Grant, NodeFailed, NodeReady, Program,
                      Recv, RoundPlan, Send, TransferDone, parse_node, server)

BATCH_WINDOW_S = 0.1  # seconds: updates announced within this window are planned together (paper §7: 100 ms)
GRANT_TIMEOUT_MIN_S = 1.0  # seconds: shortest receive timeout granted
GRANT_TIMEOUT_FACTOR = 3.0  # a receive times out after this many times its predicted duration (+ the minimum)
DEFAULT_TAU_MAX = 8  # versions, when the world does not say
DEFAULT_AGGREGATORS = 1  # aggregators per batch (Alg 3's k) of ``--schedule mlfabric``
DEFAULT_GAMMA = 0.9  # momentum the divergence bound assumes when none is given
REPLICA_CHUNK_BASE = 1 << 15  # tag chunk field of replica transfers: 2**15 + group (primary ones use the group)



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
    """The PS-side MLfabric scheduler: batches announced updates, plans them, issues grants.

    ``net``: link rates (bytes/s) the plans start from; ``server_node``: the PS;
    every update carries model elements ``[lo, lo + n_elems)``; ``tau_max``:
    the delay bound (None: Alg 1, no drops); ``k`` aggregators per batch drawn
    with ``rng`` from ``aggregators`` (None: the live workers);
    ``batch_window_s``: how long the first update of a batch waits for others;
    ``v_init``: the PS version at start.  Replica option: ``replica`` (node id),
    ``div_max``, ``gamma`` (the optimizer's momentum), ``replica_k``,
    ``replica_max_backlog``.
    """

    def __init__(self, net: FabricNetwork, server_node: str, *, n_elems: int, lo: int = 0,
                 tau_max: int | None = DEFAULT_TAU_MAX,
                 k: int = 0, aggregators: Sequence[str] | None = None, rng: random.Random | None = None,
                 batch_window_s: float = BATCH_WINDOW_S, v_init: int = 0, replica: str | None = None,
                 div_max: float | None = None, gamma: float = DEFAULT_GAMMA, replica_k: int = 0,
                 replica_max_backlog: int | None = DEFAULT_MAX_BACKLOG):
        if batch_window_s < 0:
            raise ValueError("batch_window_s must be >= 0 seconds")
        if k < 0:
            raise ValueError("k (aggregators per batch) must be >= 0")
        if replica is not None and (div_max is None or div_max < 0):
            raise ValueError("replica= needs div_max= (a divergence bound >= 0; 0 is strict consistency)")
        if replica is not None and replica == server_node:
            raise ValueError("the replica must be another node than the primary PS")
        self.net = net
        self.server = server_node
        self.replica = replica
        self.div_max = div_max
        self.gamma = float(gamma)
        self.replica_k = int(replica_k)
        self.replica_max_backlog = replica_max_backlog
        self.backlog: list = []  # updates applied at the primary, not yet at the replica (punted), oldest first
        self.replica_h = 0.0  # bound on the replica's momentum norm
        self.replica_plans: list = []
        self.replica_outstanding: set = set()  # (src, dst, tag) of granted replica transfers
        self.lo, self.hi = int(lo), int(lo) + int(n_elems)  # the model elements every update carries
        self.tau_max = tau_max
        self.k = int(k)
        self.candidates = None if aggregators is None else list(aggregators)  # None: every live worker
        self._aggregators = tuple(self.candidates or ())  # as given (a failed one that joins again is one again)
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
        self.stats = {"planned": 0, "dropped": 0, "aggregated": 0, "batches": 0, "written_off": 0,
                      "replicated": 0, "punted": 0, "delayed": 0, "replica_lost": 0, "replica_bound_missed": 0}

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

    def admit(self, node: str, *, now: float) -> list[Grant]:
        """``node`` (a worker) joined mid-run, or again after it was written off: its updates are planned from now
        on (its earlier ones were written off when it failed).  No grants until it sends one."""
        parse_node(node)
        if node != self.server and node not in self.workers:
            self.workers.append(node)
        if self.candidates is not None and node in self._aggregators and node not in self.candidates:
            self.candidates.append(node)
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
        return not self.pending and not self.outstanding and not self.replica_outstanding

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
        nbytes = int(ev.nbytes) if ev.nbytes > 0 else payload_range(self.hi - self.lo)[1]  # unsized: a dense partial
        self.pending[ev.node] = Update(ev.node, nbytes, int(ev.version), float(ev.norm), self._seq)
        self._seq += 1
        if self._batch_due is None:
            self._batch_due = now + self.batch_window_s
        if self._batch_full():
            self._batch_due = now
        return []

    def _batch_full(self) -> bool:
        """Every live worker's update is in the batch: nothing more can join it, so it need not wait its window."""
        return set(self.pending) >= set(self.workers)

    def _write_off(self, key, worker: str | None = None) -> None:
        p = self.outstanding.get(key)
        if p is None:
            return
        lost = [m for m in p.members if (worker is None or m == worker) and m not in p.lost]
        p.lost.update(lost)
        self.v_next -= len(lost)
        self.stats["written_off"] += len(lost)

    def _on_done(self, ev: TransferDone, now: float) -> list[Grant]:
        if (ev.src, ev.dst, ev.tag) in self.replica_outstanding:
            self.replica_outstanding.discard((ev.src, ev.dst, ev.tag))
            return []
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
        elif self._batch_full():  # the batch waited only for the node just lost
            self._batch_due = now
        for key, p in list(self.outstanding.items()):
            if p.source == node:  # its transfer to the PS (a direct update or an aggregate) will not come
                self._write_off(key)
                del self.outstanding[key]
        lost = [u for u in self.backlog if u.node == node]  # its kept gradients can no longer reach the replica
        if lost:
            self.backlog = [u for u in self.backlog if u.node != node]
            self.stats["replica_lost"] += len(lost)
        self.replica_outstanding = {k for k in self.replica_outstanding if node not in (k[0], k[1])}
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
        rp = None
        if self.replica is not None:
            rp = plan_replica(plan, self.backlog, self.net, self.server, self.replica, div_max=self.div_max,
                              gamma=self.gamma, history_norm=self.replica_h,
                              aggregators=[c for c in cands if c in self.workers], k=self.replica_k, rng=self.rng,
                              max_backlog=self.replica_max_backlog)
            self.table = rp.table
            self.backlog = list(rp.punted)
            self.replica_h = rp.history_norm
            self.replica_plans.append(rp)
            del self.replica_plans[:-self.PLAN_HISTORY]
            self.stats["replicated"] += sum(len(c.members) for c in rp.frozen)
            self.stats["punted"] = len(self.backlog)
            self.stats["delayed"] += int(rp.delayed)
            self.stats["replica_bound_missed"] += int(not rp.bound_met)
        self.v_next = plan.v_init + plan.applied
        self.plans.append(plan)
        del self.plans[:-self.PLAN_HISTORY]
        self.stats["batches"] += 1
        self.stats["planned"] += plan.applied
        self.stats["dropped"] += len(plan.drops)
        self.stats["aggregated"] += sum(len(c.members) for c in plan.commits if c.group > 0)
        grants = self.grants_for(plan, self.batch, now=now, replica_plan=rp)
        self.batch += 1
        return grants

    def _tag(self, batch: int, step: int, chunk: int, kind: int) -> int:
        return _tags.pack(batch % (_tags.MAX_ITERATION + 1), _tags.PHASE_PUSH, min(step, _tags.MAX_STEP),
                          chunk % (_tags.MAX_CHUNK + 1), kind)

    @staticmethod
    def keep_slot(update: Update) -> str:
        """Where a worker keeps a granted gradient until its replica copy is sent (replica option)."""
        return f"mlf:keep:{update.seq}"

    def grants_for(self, plan: BatchPlan, batch: int, *, now: float,
                   replica_plan: ReplicaPlan | None = None) -> list[Grant]:
        """The grants that carry out ``plan``: workers first, then aggregators, then the PS in commit order,
        then (replica option) the replica copies."""
        lo, hi = self.lo, self.hi
        keep = replica_plan is not None
        out: list = []
        agg_grants: list = []
        ps_grants: list = []
        last_i = len(plan.commits) - 1
        for ci, c in enumerate(plan.commits):
            first = c.members[0].position
            start, arrive = c.start, c.arrive
            if keep and replica_plan.delayed and ci == last_i:  # §5.3: the last primary transfer waits
                start, arrive = replica_plan.server_last.start, replica_plan.server_last.end
            if c.group == 0:
                m = c.members[0]
                tag = self._tag(batch, first, 0, KIND_PARTIAL)
                steps = (Send(self.server, SLOT_GRAD, lo, hi, tag, TOLERANT, "partial"),)
                if keep:
                    steps += (Combine(self.keep_slot(m.update), SLOT_GRAD, lo, hi),)
                out.append(Grant(m.update.node, steps, start_at=start))
                self.outstanding[(m.update.node, tag)] = _Pending(batch, m.update.node, tag, [m.update.node])
            else:
                agg = c.source
                acc = f"mlf:{batch}:{c.group}:acc"
                tag_out = self._tag(batch, first, c.group, KIND_PARTIAL)
                recvs, combines = [], []
                for m in c.members:
                    if m.update.node == agg:  # its own update: no transfer, the aggregator combines its gradient
                        combines.append(Combine(acc, SLOT_GRAD, lo, hi))
                        if keep:
                            out.append(Grant(agg, (Combine(self.keep_slot(m.update), SLOT_GRAD, lo, hi),)))
                        continue
                    g = plan.grant_of(m.update.node)
                    tag_in = self._tag(batch, m.position, c.group, KIND_PARTIAL)
                    slot = f"mlf:{batch}:in:{m.update.node}"
                    steps = (Send(agg, SLOT_GRAD, lo, hi, tag_in, TOLERANT, "partial"),)
                    if keep:
                        steps += (Combine(self.keep_slot(m.update), SLOT_GRAD, lo, hi),)
                    out.append(Grant(m.update.node, steps, start_at=g.start))
                    recvs.append(Recv(m.update.node, slot, lo, hi, tag_in, TOLERANT, "partial",
                                      group=f"mlf:{batch}:{c.group}", timeout_s=grant_timeout(now, g.arrive)))
                    combines.append(Combine(acc, slot, lo, hi))
                    self._member_hop[(m.update.node, agg, tag_in)] = (agg, tag_out)
                if recvs:
                    agg_grants.append(Grant(agg, tuple(recvs), reason=f"aggregate group {c.group}"))
                agg_grants.append(Grant(agg, tuple(combines)))
                agg_grants.append(Grant(agg, (Send(self.server, acc, lo, hi, tag_out, TOLERANT, "partial"),),
                                        start_at=start))
                self.outstanding[(agg, tag_out)] = _Pending(batch, agg, tag_out, [m.update.node for m in c.members])
            src = c.source
            tag = self._tag(batch, first, c.group, KIND_PARTIAL)
            slot = f"mlf:{batch}:{c.group}:{first}"
            ps_grants.append(Grant(self.server, (Recv(src, slot, lo, hi, tag, TOLERANT, "partial",
                                                      timeout_s=grant_timeout(now, arrive)),),
                                   reason=f"position {first} ({len(c.members)} gradients)"))
            ps_grants.append(Grant(self.server, (Apply(slot, lo, hi),)))
        for g in plan.grants:
            if g.drop:
                out.append(Grant(g.update.node, (), drop=True, reason=g.reason))
        rep = self._replica_grants(replica_plan, batch, now) if keep else []
        return out + agg_grants + ps_grants + rep

    def _replica_grants(self, rp: ReplicaPlan, batch: int, now: float) -> list[Grant]:
        """Grants of the frozen replica commits, in the replica's order (tags: chunk ``REPLICA_CHUNK_BASE + group``)."""
        lo, hi, rep = self.lo, self.hi, self.replica
        out: list = []
        agg_grants: list = []
        rep_grants: list = []
        i = 0
        for c in rp.frozen:
            first = i + 1
            chunk = REPLICA_CHUNK_BASE + c.group
            if c.group == 0:
                u, hop = c.members[0], c.hops[0]
                tag = self._tag(batch, first, chunk, KIND_PARTIAL)
                out.append(Grant(u.node, (Send(rep, self.keep_slot(u), lo, hi, tag, TOLERANT, "partial"),),
                                 start_at=hop.start, reason="replica copy"))
                self.replica_outstanding.add((u.node, rep, tag))
                src, arrive = u.node, hop.end
            else:
                agg = c.source
                acc = f"mlf:{batch}:r{c.group}:acc"
                tag_out = self._tag(batch, first, chunk, KIND_PARTIAL)
                recvs, combines = [], []
                for j, (u, hop) in enumerate(zip(c.members, c.hops)):
                    if u.node == agg:
                        combines.append(Combine(acc, self.keep_slot(u), lo, hi))
                        continue
                    tag_in = self._tag(batch, first + j, chunk, KIND_PARTIAL)
                    slot = f"mlf:{batch}:rin:{u.seq}"
                    out.append(Grant(u.node, (Send(agg, self.keep_slot(u), lo, hi, tag_in, TOLERANT, "partial"),),
                                     start_at=hop.start, reason="replica copy"))
                    recvs.append(Recv(u.node, slot, lo, hi, tag_in, TOLERANT, "partial",
                                      group=f"mlf:{batch}:r{c.group}", timeout_s=grant_timeout(now, hop.end)))
                    combines.append(Combine(acc, slot, lo, hi))
                    self.replica_outstanding.add((u.node, agg, tag_in))
                if recvs:
                    agg_grants.append(Grant(agg, tuple(recvs), reason=f"replica aggregate group {c.group}"))
                agg_grants.append(Grant(agg, tuple(combines)))
                agg_grants.append(Grant(agg, (Send(rep, acc, lo, hi, tag_out, TOLERANT, "partial"),),
                                        start_at=c.hops[-1].start))
                self.replica_outstanding.add((agg, rep, tag_out))
                src, arrive, tag = agg, c.arrive, tag_out
            slot = f"mlf:{batch}:r:{first}"
            rep_grants.append(Grant(rep, (Recv(src, slot, lo, hi, tag, TOLERANT, "partial",
                                               timeout_s=grant_timeout(now, arrive)),),
                                    reason=f"replica position {first} ({len(c.members)} gradients)"))
            rep_grants.append(Grant(rep, (Apply(slot, lo, hi),)))
            i += len(c.members)
        return out + agg_grants + rep_grants


class MLfabricSchedule(Schedule):
    """``--schedule mlfabric``: asynchronous PS with MLfabric's ordering, delay bounds and aggregation.

    Dynamic: :meth:`plan` has no fixed transfers; :meth:`controller` gives the
    PS-side controller.  One PS shard (the paper's §5 assumes a single server).
    """

    name = "mlfabric"

    def __init__(self, world: World, *, rng: random.Random | None = None, tau_max: int | None = DEFAULT_TAU_MAX,
                 k: int = DEFAULT_AGGREGATORS, batch_window_s: float = BATCH_WINDOW_S, t_lag_s: float | None = None):
        super().__init__(world, rng=rng)
        if len(world.shards) != 1:
            raise ValueError(f"mlfabric plans for one PS shard (paper §5), the world has {len(world.shards)}; "
                             "launch it with one shard")
        if tau_max is not None and int(tau_max) < 1:
            raise ValueError(f"tau_max must be >= 1 version (eq 9 keeps one in hand) or None (Alg 1, no bound), "
                             f"got {tau_max}")
        if int(k) < 0:
            raise ValueError(f"k (aggregators per batch) must be >= 0, got {k}")
        if not batch_window_s >= 0:
            raise ValueError(f"batch_window_s must be >= 0 seconds, got {batch_window_s}")
        if t_lag_s is not None and not t_lag_s > 0:
            raise ValueError(f"t_lag_s must be > 0 seconds (None: the driver's T_LAG_S), got {t_lag_s}")
        self.tau_max = None if tau_max is None else int(tau_max)
        self.k = int(k)
        self.batch_window_s = float(batch_window_s)
        # the run-time driver's rate refresh period (None: ``schedules.driver.T_LAG_S``); the planner never reads it
        self.t_lag_s = None if t_lag_s is None else float(t_lag_s)

    def network(self) -> FabricNetwork:
        """The world's topology as MLfabric's link model (node ids as hosts)."""
        return FabricNetwork.from_topology(self.world.effective_topology())

    def _one_batch(self, iteration: int, nbytes: int | None = None):
        """The batch where every worker announces an update computed on version ``iteration`` at once."""
        ctrl = self.controller(rng=random.Random(iteration))
        ctrl.v_next = iteration
        ctrl.start(iteration, self.world.worker_nodes, now=0.0)
        size = ctrl.hi - ctrl.lo if nbytes is None else int(nbytes) // 4
        for w in self.world.worker_nodes:
            ctrl.on_event(NodeReady(w, iteration, 4 * size, iteration), now=0.0)
        grants = ctrl.flush(now=0.0)
        return ctrl.plans[-1], grants

    def plan(self, iteration: int) -> RoundPlan:
        """What the controller grants when every worker's update (version ``iteration``) is ready at once.

        MLfabric is dynamic (the controller decides as updates come); this is
        the plan of that one batch, for ``ltp-ps plan`` and for inspection:
        each grant is one stage of its node's program; ``notes`` holds the
        batch plan (order, drops, groups, predicted times).
        """
        batch, grants = self._one_batch(iteration)
        progs: dict = {}
        for g in grants:
            if not g.drop:
                prev = progs.get(g.node)
                progs[g.node] = Program(g.node, (prev.stages if prev else ()) + (g.steps,))
        notes = {"dynamic": "controller", "tau_max": self.tau_max, "k": self.k, "batch": batch.to_json()}
        return RoundPlan(self.name, iteration, progs, notes=notes)

    def predict_s(self, nbytes: int | None = None) -> float | None:
        """Seconds until the last update of an all-at-once batch is at the PS (the planner's model)."""
        batch, _ = self._one_batch(0, nbytes)
        return batch.t_end - batch.now

    def controller(self, rng: random.Random | None = None) -> MLfabricController:
        lo, hi = self.world.shards[0]
        c = MLfabricController(self.network(), server(0), n_elems=hi - lo, lo=lo, tau_max=self.tau_max, k=self.k,
                               rng=rng or self.rng, batch_window_s=self.batch_window_s)
        return c


__all__ = ["MLfabricController", "MLfabricSchedule", "BATCH_WINDOW_S", "grant_timeout"]
