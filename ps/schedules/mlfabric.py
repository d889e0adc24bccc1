"""MLfabric's batch planner: ordering with delay bounds (paper Alg 1-2) and in-network aggregation (Alg 3).

Theory of operation
-------------------
The PS-side scheduler batches the updates that workers announced (worker,
size, model version, norm) and plans the whole batch at once, on a
:class:`~ltp_ps.schedules.mlfabric_links.ReservationTable` that already holds
the reservations of earlier batches' transfers still in flight:

1. **Ordering** (:func:`order_updates`, Alg 2; Alg 1 when ``tau_max`` is None).
   Positions are 1-based like the paper's loop index; position ``p`` is the
   ``p``-th update the PS will apply from this batch, and dropped updates take
   no position.  The deadline of update ``g`` is eq 9,
   ``dl(g) = v(g) + tau_max - v_init``: the last position it may take.  At
   position ``p``: an update whose deadline is ``p`` is taken (several: the
   one with the earliest ``t_en``); otherwise the one with the earliest
   ``t_en`` (shortest-transfer-first, ``t_en`` on the path's time-varying
   residual bottleneck rate).  Look-ahead (Alg 2 lines 10-11): with the pick
   reserved, the update position ``p + 1`` would take is computed; if it
   would finish *before* the pick, the pick is dropped at its worker (the PS
   would otherwise idle or the bound break), and position ``p`` is offered
   again.  Updates with ``dl < 1`` are dropped before ordering (stale), and
   an update whose deadline position passes without it is dropped (several
   sharing one deadline).  Ties in ``t_en`` break by arrival ``seq`` then node.

   Staleness as the PS measures it (its version at apply time minus the
   update's version) of an update applied at position ``p`` is
   ``v_init + p - 1 - v(g) <= tau_max - 1`` -- eq 9 read literally keeps one
   version in hand; ``tau_max`` must therefore be >= 1.

2. **Aggregation** (:func:`aggregate`, Alg 3).  ``k`` aggregators are
   pre-assigned to groups 1..k at random (seeded ``random.Random``).  For every
   ``n`` in ``0..|O|`` (one case each, on a fresh copy of the pre-batch table):
   the first ``n`` ordered updates go straight to the PS (reserved in order,
   ``t_max`` = the latest of their arrivals); the following ones are streamed
   to aggregator 1 while their arrival there is ``<= t_max``; when one is not,
   aggregator 1 closes -- its sum (as large as its largest input) is reserved
   to the PS from the moment its last input has arrived, ``t_max`` becomes
   that arrival -- and filling moves to aggregator 2, and so on.  An empty
   aggregator takes the next update whatever its arrival (else the ``n = 0``
   case could never start), and the ``k``-th aggregator takes every update
   left (``k + 1`` groups in all).  The case whose last arrival at the PS is
   earliest wins; on ties (within ``TIME_TIE_S``) the one with more direct
   updates.  Case ``n = |O|`` is exactly the ordering's schedule, so
   aggregation never makes a batch slower than the plan without it.

3. **Commits.**  The PS applies in order: group 0 update by update, then each
   aggregate as one step worth as many versions as it holds gradients.  An
   aggregate is applied at the version after everything before it in the
   order, so its members' staleness is at most what it would have been
   without aggregation.  Predicted apply times are the running maximum of
   arrivals in that order (a later item that arrives early waits).

Everything here is pure: inputs are plain data and ``now``; the only
randomness is the aggregator pre-assignment, drawn from the ``rng`` passed in.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Sequence

from .mlfabric_links import INF, FabricNetwork, Reservation, ReservationTable

TIME_TIE_S = 1e-9  # seconds: completion times closer than this are a tie (float noise)

DROP_STALE = "stale"  # dl(g) < 1: too old before the batch starts
DROP_DEADLINE = "deadline"  # its last allowed position was taken by another update
DROP_LOOKAHEAD = "lookahead"  # Alg 2 l.11: the next update would be applied first; dropped at the worker
DROP_UNREACHABLE = "unreachable"  # no capacity (or a blocked pair) between its worker and the PS
DROP_REASONS = (DROP_STALE, DROP_DEADLINE, DROP_LOOKAHEAD, DROP_UNREACHABLE)


@dataclasses.dataclass(frozen=True)
class Update:
    """One worker update announced to the scheduler (``push(server, update, norm)``)."""

    node: str  # the worker holding it ("worker:3")
    nbytes: int  # message size on the wire
    version: int  # model version it was computed on
    norm: float = 0.0  # ||u||_2 (bounded-divergence replication)
    seq: int = 0  # arrival order at the scheduler (tie-break)

    def __post_init__(self):
        if self.nbytes < 0:
            raise ValueError(f"update of {self.node}: nbytes must be >= 0, got {self.nbytes}")

    @property
    def key(self) -> tuple:
        return (self.seq, self.node, self.version)


def deadline(update: Update, tau_max: int, v_init: int) -> int:
    """Eq 9: ``dl(g) = v(g) + tau_max - v_init`` -- the last 1-based position ``g`` may take in the batch."""
    return update.version + tau_max - v_init


@dataclasses.dataclass(frozen=True)
class Drop:
    update: Update
    reason: str  # DROP_*


@dataclasses.dataclass(frozen=True)
class Ordered:
    """An update placed at ``position`` (1-based); ``start``/``end`` of its direct transfer to the PS."""

    update: Update
    position: int
    deadline: int | None
    start: float
    end: float


@dataclasses.dataclass(frozen=True)
class Ordering:
    order: tuple  # Ordered, by position
    drops: tuple  # Drop
    table: ReservationTable  # the input table plus the direct transfers of ``order``

    @property
    def t_end(self) -> float:
        return max((o.end for o in self.order), default=self.table.now)


def _check_tau(tau_max) -> None:
    if tau_max is not None and (int(tau_max) != tau_max or tau_max < 1):
        raise ValueError(f"tau_max={tau_max!r}: use an integer >= 1 (eq 9 with 1-based positions keeps one "
                         "version in hand, so tau_max=0 would drop every update), or None for no delay bound")


def order_updates(updates: Sequence[Update], table: ReservationTable, net: FabricNetwork, server: str, *,
                  tau_max: int | None = None, v_init: int = 0, now: float) -> Ordering:
    """Order a batch (Alg 2; with ``tau_max=None`` plain shortest-transfer-first, Alg 1).

    ``table`` is not modified; the returned ordering holds a copy with the
    direct transfers of the ordered updates reserved from ``now``.
    """
    _check_tau(tau_max)
    nw = table.copy()
    nw.advance(now)
    nw.add_links(net.capacities())
    drops: list = []
    dl: dict = {}
    cands: list = []
    for u in sorted(updates, key=lambda u: u.key):
        if not net.reachable(u.node, server) or nw.finish_time(net.path(u.node, server), u.nbytes, now) == INF:
            drops.append(Drop(u, DROP_UNREACHABLE))
            continue
        if tau_max is not None:
            dl[u] = deadline(u, tau_max, v_init)
            if dl[u] < 1:
                drops.append(Drop(u, DROP_STALE))
                continue
        cands.append(u)
    paths = {u: net.path(u.node, server) for u in cands}
    order: list = []

    memo: dict = {}  # update -> t_en on ``nw`` as it is now (cleared whenever nw changes)

    def pick(p: int, pool: list):
        """ShrtDLine(p) on ``nw``: the update due at position p, else the shortest; with its t_en."""
        due = [u for u in pool if dl.get(u) == p] if tau_max is not None else []
        best, best_t = None, INF
        for u in (due or pool):
            t = memo.get(u)
            if t is None:
                t = memo[u] = nw.finish_time(paths[u], u.nbytes, now)
            if best is None or t < best_t:  # pool is in key order, so '<' keeps the earlier key on ties
                best, best_t = u, t
        return best, best_t

    while cands:
        p = len(order) + 1
        if tau_max is not None:
            expired = [u for u in cands if dl[u] < p]
            for u in expired:
                drops.append(Drop(u, DROP_DEADLINE))
            if expired:
                cands = [u for u in cands if dl[u] >= p]
                if not cands:
                    break
        g, t_g = pick(p, cands)
        cands.remove(g)
        snap = nw.snapshot(paths[g])
        saved = dict(memo)
        res = nw.reserve(paths[g], g.nbytes, now)
        memo.clear()
        if tau_max is not None and cands:
            pool = [u for u in cands if dl[u] >= p + 1]
            nxt, t_next = pick(p + 1, pool)
            if nxt is not None and t_g > t_next:  # Alg 2 l.11: the next one would land first; drop g
                nw.restore(snap)
                memo.clear()
                memo.update(saved)
                drops.append(Drop(g, DROP_LOOKAHEAD))
                continue
        order.append(Ordered(g, p, dl.get(g), res.start, res.end))
    return Ordering(tuple(order), tuple(drops), nw)


# -- aggregation (Alg 3) ----------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Hop:
    """One planned transfer: ``nbytes`` from ``src`` to ``dst`` over ``[start, end]`` with its reservation."""

    src: str
    dst: str
    nbytes: int
    start: float
    end: float
    reservation: Reservation | None = None


@dataclasses.dataclass(frozen=True)
class Group:
    """Group ``index`` of the partition: 0 = straight to the PS, i >= 1 = through ``aggregator``."""

    index: int
    aggregator: str | None
    members: tuple  # Ordered, in order
    inbound: tuple  # Hop per member (to the PS for group 0, to the aggregator otherwise)
    outbound: Hop | None  # the aggregate to the PS (None for group 0)

    @property
    def arrive(self) -> float:
        """When this group's last bytes reach the PS."""
        if self.outbound is not None:
            return self.outbound.end
        return max((h.end for h in self.inbound), default=0.0)


@dataclasses.dataclass(frozen=True)
class Aggregation:
    n_direct: int
    groups: tuple  # Group; group 0 first (possibly empty)
    t_end: float  # when the last group's bytes reach the PS
    table: ReservationTable
    cases: tuple  # (n, t_end) of every case tried (Alg 3 lines 21-23)


def _reserve_hop(tab: ReservationTable, net: FabricNetwork, src: str, dst: str, nbytes: int, start: float) -> Hop:
    res = tab.reserve(net.path(src, dst), nbytes, start)
    return Hop(src, dst, nbytes, res.start, res.end, res)


def _det_agg(order: Sequence[Ordered], n: int, tab: ReservationTable, net: FabricNetwork, server: str,
             aggs: Sequence[str], direct: list, t_max: float, now: float, paths: dict):
    """DetAgg(n) on ``tab`` (mutated) whose first ``n`` direct hops are already reserved (``direct``).

    ``paths`` caches ``(src, dst) -> links`` (None: unreachable) across cases.
    """
    groups = [Group(0, None, tuple(order[:n]), tuple(direct), None)]
    i = n
    aid = 0
    members: list = []
    hops: list = []

    def close() -> bool:
        """Reserve the aggregate to the PS from its last input's arrival; False if it can never get there."""
        nonlocal t_max
        agg = aggs[aid]
        ready = max(h.end for h in hops)
        size = max(m.update.nbytes for m in members)
        if tab.finish_time(net.path(agg, server), size, ready) == INF:
            return False
        out = _reserve_hop(tab, net, agg, server, size, ready)
        t_max = max(t_max, out.end)
        groups.append(Group(aid + 1, agg, tuple(members), tuple(hops), out))
        return True

    while i < len(order):
        g = order[i]
        agg = aggs[aid]
        last = aid == len(aggs) - 1
        path = paths.get((g.update.node, agg), False)
        if path is False:
            ok = net.reachable(g.update.node, agg) and net.reachable(agg, server)
            path = paths[(g.update.node, agg)] = net.path(g.update.node, agg) if ok else None
        t_arr = INF if path is None else tab.finish_time(path, g.update.nbytes, now)
        if not last and (t_arr == INF or (members and t_arr > t_max)):  # Alg 3 l.10: close, next aggregator
            if members and not close():
                return INF, groups
            aid += 1
            members, hops = [], []
            continue
        if t_arr == INF:
            return INF, groups  # the last aggregator cannot take it: this case is infeasible
        res = tab.reserve(path, g.update.nbytes, now)
        hops.append(Hop(g.update.node, agg, g.update.nbytes, res.start, res.end, res))
        members.append(g)
        i += 1
    if members and not close():
        return INF, groups
    return t_max, groups


def aggregate(ordering: Ordering, base: ReservationTable, net: FabricNetwork, server: str,
              aggregators: Sequence[str], *, now: float) -> Aggregation:
    """Alg 3: partition the ordered updates into ``len(aggregators) + 1`` groups; keep the fastest case.

    ``aggregators`` is the pre-assigned sequence (group 1 -> ``aggregators[0]``,
    ...).  ``base`` is the table *before* the ordering's reservations; it is
    not modified.
    """
    order = list(ordering.order)
    aggs = list(aggregators)
    if server in aggs:
        raise ValueError(f"the PS {server!r} cannot be its own aggregator; pick worker hosts")
    prefix = base.copy()
    prefix.advance(now)
    prefix.add_links(net.capacities())
    paths: dict = {}
    direct: list = []
    t_pref = now
    best = None
    cases = []
    n_max = len(order)
    for n in range(n_max + 1):
        if n > 0:
            g = order[n - 1]
            h = _reserve_hop(prefix, net, g.update.node, server, g.update.nbytes, now)
            direct.append(h)
            t_pref = max(t_pref, h.end)
        if n < n_max and not aggs:
            cases.append((n, INF))
            continue
        tab = prefix.copy() if n < n_max else prefix
        t_end, groups = _det_agg(order, n, tab, net, server, aggs, list(direct), t_pref, now, paths)
        cases.append((n, t_end))
        if best is None or t_end <= best[0] + TIME_TIE_S:  # later n wins ties: more direct, fewer hops
            best = (t_end, n, groups, tab)
    t_end, n, groups, tab = best
    return Aggregation(n, tuple(groups), t_end, tab, tuple(cases))


# -- the whole batch --------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class UpdateGrant:
    """What the PS tells one worker: send to ``hop`` at ``start`` (arriving ``arrive``), or drop."""

    update: Update
    drop: bool
    reason: str = ""
    hop: str | None = None  # the PS or an aggregator
    start: float = 0.0
    arrive: float = 0.0
    position: int = 0  # 1-based position in the order (0: dropped)
    group: int = 0  # 0: direct; i >= 1: aggregator group i


@dataclasses.dataclass(frozen=True)
class Commit:
    """One apply step at the PS: an update (group 0) or an aggregate, in order."""

    group: int
    source: str  # the node whose bytes the PS receives (worker or aggregator)
    members: tuple  # Ordered
    nbytes: int
    start: float  # when the PS-bound transfer starts
    arrive: float  # when its bytes are at the PS
    apply_at: float  # predicted apply time (arrivals in order, running max)
    version_before: int  # PS version just before this step
    staleness: tuple  # per member: version_before - v(g)
    reservation: Reservation | None = None  # the PS-bound transfer's reservation (in ``BatchPlan.table``)


@dataclasses.dataclass(frozen=True)
class BatchPlan:
    """The plan of one batch: per update a grant, the aggregates, the PS's apply steps, predicted times."""

    now: float
    v_init: int
    tau_max: int | None
    grants: tuple  # UpdateGrant, one per input update, in input key order
    aggregators: tuple  # aggregator pre-assignment used (group i -> aggregators[i-1])
    commits: tuple  # Commit, in apply order
    drops: tuple  # Drop
    t_direct: float  # when the ordering alone (no aggregation) would be done
    t_end: float  # when the last commit's bytes are at the PS
    cases: tuple  # Alg 3's (n, t_end) per case
    table: ReservationTable  # the input table plus every reservation of this batch

    @property
    def applied(self) -> int:
        """Gradients this batch applies (the next batch's ``v_init`` is ``v_init + applied``)."""
        return sum(len(c.members) for c in self.commits)

    @property
    def max_staleness(self) -> int:
        return max((s for c in self.commits for s in c.staleness), default=0)

    def grant_of(self, node: str) -> UpdateGrant:
        for g in self.grants:
            if g.update.node == node:
                return g
        raise KeyError(f"no update of {node} in this batch")

    def to_json(self) -> dict:
        """Plain-data view (``ltp-ps plan``, logs)."""
        return {
            "now": self.now, "v_init": self.v_init, "tau_max": self.tau_max, "t_direct": self.t_direct,
            "t_end": self.t_end, "aggregators": list(self.aggregators),
            "grants": [{"node": g.update.node, "version": g.update.version, "nbytes": g.update.nbytes,
                        "drop": g.drop, "reason": g.reason, "hop": g.hop, "start": g.start, "arrive": g.arrive,
                        "position": g.position, "group": g.group} for g in self.grants],
            "commits": [{"group": c.group, "source": c.source, "members": [m.update.node for m in c.members],
                         "arrive": c.arrive, "apply_at": c.apply_at, "version_before": c.version_before,
                         "staleness": list(c.staleness)} for c in self.commits],
        }


def pick_aggregators(candidates: Sequence[str], k: int, rng: random.Random) -> tuple:
    """The paper's random pre-assignment of aggregators to groups 1..k (``k`` capped at the candidates)."""
    pool = sorted(set(candidates))
    return tuple(rng.sample(pool, min(int(k), len(pool))))


def plan_batch(updates: Sequence[Update], table: ReservationTable, net: FabricNetwork, server: str, *,
               now: float, tau_max: int | None, v_init: int, aggregators: Sequence[str] = (), k: int = 0,
               rng: random.Random | None = None) -> BatchPlan:
    """Plan one batch: Alg 2 ordering, then Alg 3 over ``k`` aggregators drawn from ``aggregators``.

    ``table`` holds earlier batches' reservations and is not modified.
    ``rng`` is needed only when ``k > 0``.
    """
    seen = set()
    for u in updates:
        if u.node in seen:
            raise ValueError(f"two updates of {u.node} in one batch; a worker has one update in flight at a time")
        seen.add(u.node)
    if k > 0 and rng is None:
        raise ValueError("plan_batch with k > 0 aggregators needs rng=random.Random(seed) for the pre-assignment")
    base = table.copy()
    base.advance(now)
    base.add_links(net.capacities())
    ordering = order_updates(updates, base, net, server, tau_max=tau_max, v_init=v_init, now=now)
    aggs = pick_aggregators([a for a in aggregators if a != server], k, rng) if k > 0 else ()
    agg = aggregate(ordering, base, net, server, aggs, now=now)
    grants: dict = {}
    commits: list = []
    version = v_init
    applied_at = now
    for grp in agg.groups:
        if grp.index == 0:
            for m, h in zip(grp.members, grp.inbound):
                grants[m.update] = UpdateGrant(m.update, False, "", server, h.start, h.end, m.position, 0)
                applied_at = max(applied_at, h.end)
                commits.append(Commit(0, m.update.node, (m,), m.update.nbytes, h.start, h.end, applied_at, version,
                                      (version - m.update.version,), h.reservation))
                version += 1
        else:
            for m, h in zip(grp.members, grp.inbound):
                grants[m.update] = UpdateGrant(m.update, False, "", grp.aggregator, h.start, h.end, m.position,
                                               grp.index)
            out = grp.outbound
            applied_at = max(applied_at, out.end)
            commits.append(Commit(grp.index, grp.aggregator, grp.members, out.nbytes, out.start, out.end, applied_at,
                                  version, tuple(version - m.update.version for m in grp.members), out.reservation))
            version += len(grp.members)
    for d in ordering.drops:
        grants[d.update] = UpdateGrant(d.update, True, d.reason)
    out_grants = tuple(grants[u] for u in sorted(updates, key=lambda u: u.key))
    return BatchPlan(now, v_init, tau_max, out_grants, aggs, tuple(commits), ordering.drops, ordering.t_end,
                     agg.t_end if commits else now, agg.cases, agg.table)
