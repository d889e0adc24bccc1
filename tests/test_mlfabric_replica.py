"""MLfabric's bounded-divergence replication (§5.3, eq 10-11) and model distribution trees (§10.3)."""

from __future__ import annotations

import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ltp_ps.schedules.mlfabric import Update, plan_batch
from ltp_ps.schedules.mlfabric_links import FabricNetwork, ReservationTable
from ltp_ps.schedules.mlfabric_replica import divergence_bound, history_bound, lead_coefficients, plan_replica
from ltp_ps.schedules.mlfabric_trees import plan_distribution, reversed_network

pytestmark = pytest.mark.timeout(120)

PS = "server:0"
REP = "replica"


# -- eq 10-11 ---------------------------------------------------------------------------------------------------------

def test_lead_of_two_has_eq10_coefficients():
    g = 0.9
    c0, cs = lead_coefficients(2, g)
    assert c0 == pytest.approx(g + g * g) and cs == pytest.approx((1 + g, 1.0))
    assert lead_coefficients(0, g) == (0, ())
    assert divergence_bound(3.0, [], g) == 0.0  # a caught-up replica


@settings(max_examples=150, deadline=None)
@given(st.integers(0, 6), st.integers(0, 6), st.floats(0.0, 0.95), st.integers(0, 2**31 - 1))
def test_property_the_bound_holds_for_real_momentum_sgd(n_common, lead, gamma, seed):
    # the primary applies n_common + lead updates, the replica the first n_common; both start from (w0, h0)
    rng = np.random.default_rng(seed)
    dim = 5
    h0 = rng.normal(size=dim)
    us = [rng.normal(size=dim) * rng.uniform(0.1, 3.0) for _ in range(n_common + lead)]

    def run(updates):
        w, h = np.zeros(dim), h0.copy()
        for u in updates:
            h = gamma * h + u
            w = w + h
        return w

    true = float(np.linalg.norm(run(us) - run(us[:n_common])))
    norms = [float(np.linalg.norm(u)) for u in us]
    h_common = history_bound(float(np.linalg.norm(h0)), norms[:n_common], gamma)
    assert true <= divergence_bound(h_common, norms[n_common:], gamma) + 1e-9


# -- the replica plan -------------------------------------------------------------------------------------------------

def replica_setup():
    hosts = [PS, REP, "worker:1", "worker:2", "worker:3"]
    up = {h: 1.0 for h in hosts}
    down = dict(up)
    down[REP] = 0.5  # the replica sits behind a slower link
    net = FabricNetwork(up, down)
    ups = [Update(f"worker:{i}", 1, 0, norm=1.0, seq=i) for i in range(1, 4)]
    plan = plan_batch(ups, ReservationTable.for_network(net, now=0.0), net, PS, now=0.0, tau_max=None, v_init=0)
    return net, plan


def test_loose_bound_punts_what_has_not_committed_by_t_last():
    net, sp = replica_setup()
    assert [c.apply_at for c in sp.commits] == [1.0, 2.0, 3.0]
    rp = plan_replica(sp, [], net, PS, REP, div_max=100.0, gamma=0.5, history_norm=1.0)
    # replica: w1 arrives at 3 (its uplink is busy with the primary copy until 1, then 1 B at 0.5 B/s)
    assert [(c.members[0].node, c.apply_at) for c in rp.frozen] == [("worker:1", 3.0)]
    assert [u.node for u in rp.punted] == ["worker:2", "worker:3"]
    # lead (w2, w3) over h = 0.5 * 1 + 1 = 1.5: (0.5 + 0.25) * 1.5 + 1.5 * 1 + 1 * 1
    assert rp.divergence == pytest.approx(3.625) and not rp.delayed and rp.t_last == 3.0
    assert rp.history_norm == pytest.approx(1.5)
    rp.table.check()
    # the punted transfers' reservations are gone: only the primary's three and w1's replica copy remain
    assert len(rp.table.reservations) == 4


def test_tight_bound_delays_the_last_primary_update():
    net, sp = replica_setup()
    rp = plan_replica(sp, [], net, PS, REP, div_max=2.5, gamma=0.5, history_norm=1.0)
    assert [c.members[0].node for c in rp.frozen] == ["worker:1", "worker:2"]
    assert [u.node for u in rp.punted] == ["worker:3"]
    assert rp.divergence == pytest.approx(0.5 * 1.75 + 1.0) and rp.divergence <= 2.5
    # w3's primary transfer now starts when the replica has committed w2 (t = 4)
    assert rp.delayed and (rp.server_last.start, rp.server_last.end) == (4.0, 5.0) and rp.t_last == 5.0
    rp.table.check()


def test_zero_bound_is_strict_consistency():
    net, sp = replica_setup()
    rp = plan_replica(sp, [], net, PS, REP, div_max=0.0, gamma=0.9, history_norm=2.0)
    assert rp.punted == () and rp.divergence == 0.0 and rp.delayed
    assert rp.t_last >= rp.frozen[-1].apply_at
    rp.table.check()


def test_backlog_goes_first_and_aggregators_can_carry_replica_copies():
    net, sp = replica_setup()
    net = FabricNetwork({**net.up, "ra": 4.0}, {**net.down, "ra": 4.0})
    backlog = [Update("worker:2", 1, 0, norm=0.5, seq=-1)]
    rp = plan_replica(sp, backlog, net, PS, REP, div_max=0.0, gamma=0.5, history_norm=0.0, aggregators=["ra"],
                      k=1, rng=random.Random(0))
    applied = [u for c in rp.frozen for u in c.members]
    assert applied[0] is backlog[0] and len(applied) == 4 and rp.punted == ()
    rp.table.check()


def test_replica_misuse_is_refused():
    net, sp = replica_setup()
    with pytest.raises(ValueError, match="div_max"):
        plan_replica(sp, [], net, PS, REP, div_max=-1, gamma=0.5, history_norm=0.0)
    with pytest.raises(ValueError, match="gamma"):
        plan_replica(sp, [], net, PS, REP, div_max=1, gamma=1.0, history_norm=0.0)
    with pytest.raises(ValueError, match="rng"):
        plan_replica(sp, [], net, PS, REP, div_max=1, gamma=0.5, history_norm=0.0, aggregators=["x"], k=1)


def test_seeded_replica_batches_meet_div_max_and_capacity():
    for seed in range(40):
        rng = random.Random(seed)
        workers = [f"worker:{i}" for i in range(rng.randint(1, 8))]
        hosts = [PS, REP] + workers
        net = FabricNetwork({h: rng.choice([1.0, 2.0, 5.0]) for h in hosts},
                            {h: rng.choice([0.5, 1.0, 5.0]) for h in hosts})
        ups = [Update(w, rng.randint(1, 4), 0, norm=rng.uniform(0.1, 2.0), seq=i) for i, w in enumerate(workers)]
        sp = plan_batch(ups, ReservationTable.for_network(net, now=0.0), net, PS, now=0.0, tau_max=None, v_init=0,
                        aggregators=workers, k=rng.randint(0, 2), rng=random.Random(seed))
        div_max = rng.choice([0.0, 0.5, 2.0, 100.0])
        rp = plan_replica(sp, [], net, PS, REP, div_max=div_max, gamma=0.9, history_norm=rng.uniform(0, 1),
                          aggregators=workers, k=rng.randint(0, 2), rng=random.Random(seed))
        assert rp.divergence <= div_max + 1e-9
        assert [u for c in rp.frozen for u in c.members] + list(rp.punted) == [m.update for c in sp.commits
                                                                               for m in c.members]
        assert all(c.apply_at <= rp.t_last + 1e-9 for c in rp.frozen)
        rp.table.check()


# -- distribution trees (§10.3) ---------------------------------------------------------------------------------------

def test_reversed_network_swaps_directions():
    net = FabricNetwork({"a": 1.0, "b": 2.0}, {"a": 3.0, "b": 4.0}, rack_of={"a": 0, "b": 1},
                        rack_up={0: 5.0, 1: 6.0}, rack_down={0: 7.0, 1: 8.0})
    r = reversed_network(net)
    assert (r.up, r.down, r.rack_up, r.rack_down) == (net.down, net.up, net.rack_down, net.rack_up)


def test_fig2_mirrored_distribution_tree_serves_4_workers_by_3():
    hosts = [PS, "worker:1", "worker:2", "worker:3", "worker:4", "dist"]
    net = FabricNetwork({h: 1.0 for h in hosts}, {h: 1.0 for h in hosts})
    reqs = [f"worker:{i}" for i in range(1, 5)]
    plan = plan_distribution(reqs, 1, ReservationTable.for_network(net, now=0.0), net, PS, now=0.0,
                             distributors=["dist"], k=1, rng=random.Random(0))
    assert plan.t_direct == 4.0 and plan.t_end == 3.0 and plan.n_direct == 2
    # the PS sends to the distributor first, then the direct group last-ordered first
    assert [(c.dst, c.start, c.end) for c in plan.copies] == [("dist", 0.0, 1.0)]
    got = {d.worker: (d.via, d.hop.start, d.hop.end) for d in plan.deliveries}
    assert got == {"worker:2": (None, 1.0, 2.0), "worker:1": (None, 2.0, 3.0),
                   "worker:4": ("dist", 1.0, 2.0), "worker:3": ("dist", 2.0, 3.0)}
    plan.table.check()


def test_distribution_without_distributors_answers_directly():
    net = FabricNetwork({PS: 2.0, "worker:1": 1.0}, {PS: 2.0, "worker:1": 1.0})
    plan = plan_distribution(["worker:1"], 2, ReservationTable.for_network(net, now=0.0), net, PS, now=0.0)
    assert plan.t_end == plan.t_direct == 2.0 and plan.delivery_of("worker:1").via is None
    with pytest.raises(ValueError, match="twice"):
        plan_distribution(["worker:1", "worker:1"], 2, ReservationTable.for_network(net, now=0.0), net, PS, now=0.0)


def test_seeded_distribution_batches_serve_everyone_once_never_slower_than_direct():
    for seed in range(60):
        rng = random.Random(seed)
        workers = [f"worker:{i}" for i in range(rng.randint(1, 10))]
        hosts = [PS] + workers
        net = FabricNetwork({h: rng.choice([1.0, 2.0, 10.0]) for h in hosts},
                            {h: rng.choice([1.0, 2.0, 10.0]) for h in hosts})
        tab = ReservationTable.for_network(net, now=0.0)
        if rng.random() < 0.5:  # some traffic already in flight
            tab.reserve(net.path(workers[0], PS), 5.0, 0.0)
        reqs = rng.sample(workers, rng.randint(1, len(workers)))
        plan = plan_distribution(reqs, rng.randint(1, 5), tab, net, PS, now=0.0, distributors=workers,
                                 k=rng.randint(0, 3), rng=random.Random(seed))
        assert [d.worker for d in plan.deliveries] == reqs
        assert plan.t_end <= plan.t_direct + 1e-9
        copies = {c.dst: c.end for c in plan.copies}
        for d in plan.deliveries:
            if d.via is not None:
                assert d.hop.start >= copies[d.via] - 1e-12
        plan.table.check()
