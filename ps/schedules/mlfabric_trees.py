"""MLfabric's model distribution trees (paper §10.3): the pull side of Alg 3, planned by time reversal.

Theory of operation
-------------------
Answering every pull with its own copy makes the PS's *up*link the
bottleneck.  The paper batches pull requests, answers a batch with one model
version, and earmarks ``k`` distributors; a variant of Alg 3 (``t_en`` taken
as server->distributor and distributor->worker times) partitions the
requests; the model goes first to the ``k``-th distributor, then to the
earlier ones ("proceed backwards"), and the first group is served directly.

Our reading: distribution is aggregation run backwards in time.  Reverse
every link (a host's downlink plays its uplink and vice versa, rack uplinks
likewise) and the pull batch becomes a push batch of model-sized "updates"
from the requesting workers to the PS: Alg 1 orders it and Alg 3 partitions
it (:func:`~ltp_ps.schedules.mlfabric.aggregate`, same code).  Played
backwards, the last transfer of that schedule -- the ``k``-th aggregator's sum
to the PS -- becomes the first: the PS's copy to the ``k``-th distributor, then
the ``k-1``-th, ..., then the direct group, last-ordered first; each
distributor forwards to its group as soon as its copy has arrived.

The reversed problem is planned on the *current* residual rates (the table's
residual at ``now`` on every link, held constant: a reversed clock cannot see
the forward reservations).  The partition is then realised forward on the
real reservation table in that priority order, and compared with serving
every request directly (Alg 1 on the real table); the faster one is kept, so
a distribution tree is never slower than direct answers under the model.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Sequence

from .mlfabric import Hop, Update, aggregate, order_updates, pick_aggregators
from .mlfabric_links import (INF, LINK_DOWN, LINK_RACK_DOWN, LINK_RACK_UP, LINK_UP, FabricNetwork,
                             ReservationTable)

_REVERSE_KIND = {LINK_UP: LINK_DOWN, LINK_DOWN: LINK_UP, LINK_RACK_UP: LINK_RACK_DOWN, LINK_RACK_DOWN: LINK_RACK_UP}


def reversed_network(net: FabricNetwork) -> FabricNetwork:
    """Every link reversed: ``path(a, b)`` here crosses the reverses of ``net.path(b, a)``."""
    return dataclasses.replace(net, up=dict(net.down), down=dict(net.up), rack_up=dict(net.rack_down),
                               rack_down=dict(net.rack_up))


@dataclasses.dataclass(frozen=True)
class Delivery:
    """How one requesting worker gets the model: from the PS directly (``via`` None) or through a distributor."""

    worker: str
    via: str | None
    group: int
    hop: Hop  # the transfer that lands the model at the worker


@dataclasses.dataclass(frozen=True)
class DistributionPlan:
    deliveries: tuple  # Delivery, one per request, in request order
    copies: tuple  # Hop: PS -> distributor, in the order the PS sends them
    distributors: tuple  # the pre-assignment used (group i -> distributors[i-1])
    n_direct: int
    t_end: float  # when the last worker has the model
    t_direct: float  # when it would, answering every request directly
    reversed_t_end: float  # the reversed plan's own estimate (constant rates)
    table: ReservationTable  # the input table plus this batch's reservations

    def delivery_of(self, worker: str) -> Delivery:
        for d in self.deliveries:
            if d.worker == worker:
                return d
        raise KeyError(f"{worker} did not request the model in this batch")


def _frozen_residual(table: ReservationTable, net: FabricNetwork, now: float) -> ReservationTable:
    """A table of the reversed network whose capacities are the forward table's residuals at ``now``."""
    caps = {}
    for link in table.links():
        kind, key = link
        caps[(_REVERSE_KIND[kind], key)] = table.residual(link, now)
    return ReservationTable(caps, now=now)


def _direct_forward(requests: Sequence[str], nbytes: int, table: ReservationTable, net: FabricNetwork, server: str,
                    now: float):
    """Alg 1 on the real table: every request answered by the PS, shortest first."""
    tab = table.copy()
    pending = list(requests)
    out = {}
    while pending:
        best, best_t = None, INF
        for w in pending:
            t = tab.finish_time(net.path(server, w), nbytes, now)
            if best is None or t < best_t:
                best, best_t = w, t
        pending.remove(best)
        if best_t == INF:
            raise ValueError(f"the PS cannot reach {best}: no capacity on {net.path(server, best)}")
        res = tab.reserve(net.path(server, best), nbytes, now)
        out[best] = Delivery(best, None, 0, Hop(server, best, nbytes, res.start, res.end, res))
    return out, tab


def plan_distribution(requests: Sequence[str], model_bytes: int, table: ReservationTable, net: FabricNetwork,
                      server: str, *, now: float, distributors: Sequence[str] = (), k: int = 0,
                      rng: random.Random | None = None) -> DistributionPlan:
    """Plan one batch of pull requests (each worker gets ``model_bytes``) over ``k`` distributors.

    ``table`` is not modified.  Raises ``ValueError`` for a worker the PS
    cannot reach at all, and when ``k > 0`` without a seeded ``rng``.
    """
    if len(set(requests)) != len(requests):
        raise ValueError("a worker appears twice in one pull batch; batch each request once")
    if k > 0 and rng is None:
        raise ValueError("plan_distribution with k > 0 needs rng=random.Random(seed) for the pre-assignment")
    for w in requests:
        if not net.reachable(server, w):
            raise ValueError(f"the PS cannot reach {w} (blocked pair); drop it from the batch")
    base = table.copy()
    base.advance(now)
    base.add_links(net.capacities())
    direct, direct_tab = _direct_forward(requests, model_bytes, base, net, server, now)
    t_direct = max((d.hop.end for d in direct.values()), default=now)
    dists = pick_aggregators([d for d in distributors if d != server], k, rng) if k > 0 else ()
    direct_plan = DistributionPlan(tuple(direct[w] for w in requests), (), (), len(requests), t_direct, t_direct,
                                   t_direct, direct_tab)
    if not dists or not requests:
        return direct_plan

    rnet = reversed_network(net)
    rtab = _frozen_residual(base, net, now)
    ups = [Update(w, model_bytes, 0, seq=i) for i, w in enumerate(requests)]
    ordering = order_updates(ups, rtab, rnet, server, tau_max=None, now=now)
    if ordering.drops:  # a path with no residual capacity now: serve directly
        return direct_plan
    agg = aggregate(ordering, rtab, rnet, server, dists, now=now)
    if agg.n_direct == len(requests) or agg.t_end == INF:
        return direct_plan

    # realise it forward: copies to the distributors (last group first), then the direct group (last first),
    # then each distributor's deliveries (last member first) once its copy is there
    tab = base.copy()
    copies, copy_at, deliveries = [], {}, {}
    tree_groups = [g for g in agg.groups if g.index > 0]
    for g in reversed(tree_groups):
        if tab.finish_time(net.path(server, g.aggregator), model_bytes, now) == INF:
            return direct_plan
        res = tab.reserve(net.path(server, g.aggregator), model_bytes, now)
        hop = Hop(server, g.aggregator, model_bytes, res.start, res.end, res)
        copies.append(hop)
        copy_at[g.index] = hop.end
    for m in reversed(agg.groups[0].members):
        w = m.update.node
        res = tab.reserve(net.path(server, w), model_bytes, now)
        deliveries[w] = Delivery(w, None, 0, Hop(server, w, model_bytes, res.start, res.end, res))
    for g in reversed(tree_groups):
        for m in reversed(g.members):
            w = m.update.node
            path = net.path(g.aggregator, w)
            if not net.reachable(g.aggregator, w) or tab.finish_time(path, model_bytes, copy_at[g.index]) == INF:
                return direct_plan
            res = tab.reserve(path, model_bytes, copy_at[g.index])
            deliveries[w] = Delivery(w, g.aggregator, g.index,
                                     Hop(g.aggregator, w, model_bytes, res.start, res.end, res))
    t_end = max(d.hop.end for d in deliveries.values())
    if t_end > t_direct + 1e-9:
        return direct_plan
    return DistributionPlan(tuple(deliveries[w] for w in requests), tuple(copies), dists, agg.n_direct, t_end,
                            t_direct, agg.t_end, tab)
