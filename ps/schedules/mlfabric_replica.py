"""MLfabric's bounded-divergence replication (paper §3.3, §5.3, eq 10-11), an option of the batch planner.

Theory of operation
-------------------
Workers send a second copy of their updates to a replica PS, and the
scheduler orders those copies exactly like the primary's (so the replica
applies the same sequence; §3.3 shows any reordering diverges with
momentum).  It only promises *bounded* consistency: when the batch's last
update is committed at the primary (``T_last``), the replica may lag by some
updates as long as ``||w_s - w_r|| <= Div_max``.

Divergence estimate (eq 10-11, generalised from the paper's two-update case).
With momentum ``h_t = gamma h_{t-1} + u_t`` and ``w_t = w_{t-1} + h_t``, a
primary that is ``L`` updates ahead of the replica's common state
``(w, h)`` is ahead by ``c_0 h + sum_l c_l u_l`` with
``c_0 = gamma + ... + gamma^L`` and ``c_l = 1 + gamma + ... + gamma^(L-l)``
(``L = 2`` gives eq 10's ``(gamma + gamma^2) h + (1 + gamma) u_1 + u_2``).
Cauchy-Schwarz on every cross term, as eq 11 does, turns the squared norm
into ``(c_0 ||h|| + sum_l c_l ||u_l||)^2``: the bound needs only the norms
the workers report.  (Eq 11 as printed lists ``a_6 ||u_1|| ||h^0||`` twice
and omits ``||u_2|| ||h^0||``; the expansion above has every pair.)  The
replica's ``||h||`` after applying updates is bounded the same way:
``||h_t|| <= gamma ||h_{t-1}|| + ||u_t||``.

Algorithm (§5.3): (1) the *tentative* replica schedule is Alg 3 with the
replica as destination, its own ``k'`` aggregators, on the network that
already holds the primary's schedule, over the replica order
``backlog + this batch's applied updates``; (2) with ``j`` the replica's
applied prefix at ``T_last``: if the bound holds, replica transfers that
commit by ``T_last`` are frozen and the rest are *punted* to the next batch
(their reservations released; the next batch's backlog); (3) otherwise the
primary's *last* transfer is delayed to start once the replica has committed
the shortest prefix ``e`` whose lead satisfies the bound (always exists: a
replica fully caught up has divergence 0), prefix ``e`` is frozen and the
rest punted.  Prefixes are counted at replica commit boundaries (an
aggregate commits all its members at once).
"""

from __future__ import annotations

import dataclasses
import random
from typing import Sequence

from .mlfabric import BatchPlan, Hop, Ordered, Ordering, Update, aggregate, pick_aggregators
from .mlfabric_links import FabricNetwork, ReservationTable


def lead_coefficients(lead: int, gamma: float) -> tuple:
    """``(c_0, (c_1, ..., c_L))`` of eq 10 generalised to a lead of ``L`` updates."""
    c0 = sum(gamma ** i for i in range(1, lead + 1))
    cs = tuple(sum(gamma ** i for i in range(0, lead - l + 1)) for l in range(1, lead + 1))
    return c0, cs


def divergence_bound(history_norm: float, lead_norms: Sequence[float], gamma: float) -> float:
    """Eq 11: an upper bound on ``||w_s - w_r||`` when the primary leads by updates of ``lead_norms``."""
    c0, cs = lead_coefficients(len(lead_norms), gamma)
    return c0 * history_norm + sum(c * n for c, n in zip(cs, lead_norms))


def history_bound(history_norm: float, norms: Sequence[float], gamma: float) -> float:
    """Bound on ``||h||`` after applying updates of ``norms``: ``||h_t|| <= gamma ||h_{t-1}|| + ||u_t||``."""
    h = history_norm
    for n in norms:
        h = gamma * h + n
    return h


@dataclasses.dataclass(frozen=True)
class ReplicaCommit:
    """One apply step at the replica: an update or an aggregate of ``members`` (in order)."""

    group: int
    source: str
    members: tuple  # Update
    hops: tuple  # Hop: worker -> replica, or worker -> aggregator ... and aggregator -> replica last
    arrive: float
    apply_at: float


@dataclasses.dataclass(frozen=True)
class ReplicaPlan:
    frozen: tuple  # ReplicaCommit that happen in this batch
    punted: tuple  # Update: the replica's backlog for the next batch (already applied at the primary)
    divergence: float  # the bound at the primary's last commit
    delayed: bool  # the primary's last transfer was delayed to meet Div_max
    t_last: float  # the primary's last commit (after any delay)
    server_last: Hop | None  # the primary's last transfer, re-reserved, when delayed
    history_norm: float  # bound on the replica's ||h|| after the frozen commits
    aggregators: tuple
    table: ReservationTable  # primary's schedule + frozen replica transfers (+ the moved last transfer)


def plan_replica(server_plan: BatchPlan, backlog: Sequence[Update], net: FabricNetwork, server: str, replica: str,
                 *, div_max: float, gamma: float, history_norm: float, aggregators: Sequence[str] = (),
                 k: int = 0, rng: random.Random | None = None) -> ReplicaPlan:
    """Replica transfers for one batch whose primary schedule is ``server_plan`` (§5.3).

    ``backlog``: updates punted by earlier batches (applied at the primary,
    not yet at the replica), oldest first.  ``history_norm``: ``||h||`` of the
    replica's momentum at its current state.  ``server_plan`` is not modified.
    """
    if div_max < 0:
        raise ValueError(f"div_max={div_max!r}: use a divergence bound >= 0")
    if not 0.0 <= gamma < 1.0:
        raise ValueError(f"gamma={gamma!r}: momentum must be in [0, 1)")
    if k > 0 and rng is None:
        raise ValueError("plan_replica with k > 0 needs rng=random.Random(seed)")
    now = server_plan.now
    order_r = list(backlog) + [m.update for c in server_plan.commits for m in c.members]
    tab = server_plan.table.copy()
    tab.add_links(net.capacities())
    t_last = server_plan.commits[-1].apply_at if server_plan.commits else now
    if not order_r:
        return ReplicaPlan((), (), 0.0, False, t_last, None, history_norm, (), tab)
    aggs = pick_aggregators([a for a in aggregators if a not in (server, replica)], k, rng) if k > 0 else ()
    ordering = Ordering(tuple(Ordered(u, i + 1, None, now, now) for i, u in enumerate(order_r)), (), tab)
    agg = aggregate(ordering, tab, net, replica, aggs, now=now)
    tab = agg.table
    commits: list = []
    applied_at = now
    for g in agg.groups:
        if g.index == 0:
            for m, h in zip(g.members, g.inbound):
                applied_at = max(applied_at, h.end)
                commits.append(ReplicaCommit(0, m.update.node, (m.update,), (h,), h.end, applied_at))
        else:
            applied_at = max(applied_at, g.outbound.end)
            commits.append(ReplicaCommit(g.index, g.aggregator, tuple(m.update for m in g.members),
                                         tuple(g.inbound) + (g.outbound,), g.outbound.end, applied_at))
    norms = [u.norm for u in order_r]
    cum = [0]
    for c in commits:
        cum.append(cum[-1] + len(c.members))

    def div_at(count: int) -> float:
        return divergence_bound(history_bound(history_norm, norms[:count], gamma), norms[count:], gamma)

    n_frozen = sum(1 for c in commits if c.apply_at <= t_last)  # commits done by T_last (apply times are sorted)
    delay = div_at(cum[n_frozen]) > div_max and bool(server_plan.commits)
    if delay:  # the shortest replica prefix that meets the bound (a caught-up replica has divergence 0)
        n_frozen = next(i for i in range(n_frozen, len(commits) + 1) if div_at(cum[i]) <= div_max)
    for c in commits[n_frozen:]:  # punted: their transfers do not happen in this batch
        for h in c.hops:
            if h.reservation is not None:
                tab.release(h.reservation)
    delayed, server_last = False, None
    last = server_plan.commits[-1] if server_plan.commits else None
    if delay and n_frozen > 0 and last.reservation is not None:
        start = max(commits[n_frozen - 1].apply_at, last.start)
        tab.release(last.reservation)
        res = tab.reserve(last.reservation.links, last.nbytes, start)
        server_last = Hop(last.source, server, last.nbytes, res.start, res.end, res)
        t_last = max(res.end, server_plan.commits[-2].apply_at if len(server_plan.commits) > 1 else now)
        delayed = True
    div = div_at(cum[n_frozen])
    frozen = tuple(commits[:n_frozen])
    return ReplicaPlan(frozen, tuple(order_r[cum[n_frozen]:]), div, delayed, t_last, server_last,
                       history_bound(history_norm, norms[:cum[n_frozen]], gamma), aggs, tab)
