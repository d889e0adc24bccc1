"""RSGCM: Alg 1's search space, the state tensor, MCTS against brute force, the real environment, replanning."""

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ltp_ps.schedules import costmodel as cm
from ltp_ps.schedules.costmodel import Link, Network
from ltp_ps.schedules.rsgcm import (Action, PlanningError, RewardList, RingPlan, RingSet, RsgcmPlanner, SearchParams,
                                    allreduce_reward, apply_action, as_network, build_search_space,
                                    construct_action, exhaustive_search, exploration_weight, factor_list,
                                    fallback_ring, initial_state, is_done, plan, rerank)
from ltp_ps.schedules.topology import Topology

MB = 1e6


def random_network(n, seed, p=0.8):
    r = random.Random(seed)
    links = {}
    for u in range(n):
        for v in range(u + 1, n):
            if r.random() < p:
                links[(u, v)] = Link(r.uniform(1e-4, 1e-3), r.uniform(1e-9, 1e-8))
    return Network(n, links)


def assert_valid_plan(p: RingPlan, net: Network, *, failed_links=(), failed_devices=()):
    """Every step is a valid action (eq 1) on live links, and the steps complete the all-reduce (eq 6)."""
    dead = {tuple(sorted(x)) for x in failed_links}
    state = initial_state(p.devices, p.blocks)
    for a in p.steps:
        assert a.violations() == []
        assert sorted(rs.block for rs in a.ring_sets) == sorted(set(rs.block for rs in a.ring_sets))
        for c in a.connections():
            assert net.connected(*c) and c not in dead
        assert not (a.devices() & set(failed_devices))
        state = apply_action(state, a)
        assert state is not None
    assert is_done(state)


# ---------------------------------------------------------------- search space (Alg 1)

def test_factor_list():
    assert factor_list(8, 0) == [4, 8]
    assert factor_list(8, 1) == [3, 4, 8]  # 9's factor 3 joins
    assert factor_list(9, 0) == [3, 9]
    assert factor_list(9, 1, upper=9) == [3, 5]  # 10's factor 5; U = 9 excludes 9
    assert factor_list(5, 0) == [5]
    assert factor_list(5, 1) == [3, 5]
    assert factor_list(2, 3) == []


def test_fig4_rings():
    """The paper's Fig 4: 2x4 torus, m=3, S=2, f=4, I=1, P=2 -> r0 = [1,5,6,2], [0,3,7,4]; r1 empty."""
    net = Network.torus(2, 4, 1.0, 0.0)
    assert net.max_degree() == 3
    sets = construct_action(net, 4, 1, 2, sets=2, devices=range(8))
    assert sets == [[(1, 5, 6, 2), (0, 3, 7, 4)], []]


def test_alg1_builds_rows_then_columns_on_a_torus():
    """3x3 torus, f = 3: ring-set 0 takes the rows; the second ring-set, on the connections left, the columns."""
    net = Network.torus(3, 3, 1.0, 0.0)
    sets = construct_action(net, 3, 0, 0, sets=2, devices=range(9))
    assert [sorted(r) for r in sets[0]] == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    assert [sorted(r) for r in sets[1]] == [[0, 3, 6], [1, 4, 7], [2, 5, 8]]


def test_adjacency_prefers_cheap_links():
    # 4 devices fully connected; links to device 1 are expensive: the ring from 0 avoids starting with it
    links = {(u, v): Link(1e-3 if 1 in (u, v) else 1e-6, 0.0) for u in range(4) for v in range(u + 1, 4)}
    net = Network(4, links)
    sets = construct_action(net, 3, 0, 0, sets=1, devices=range(4))
    assert sets == [[(0, 2, 3)]]


def test_search_space_actions_are_distinct_and_block_orders_included():
    net = Network.torus(3, 3, 1.0, 0.0)
    space = build_search_space(net, sets=2)
    keys = [a.key() for a in space]
    assert len(keys) == len(set(keys))
    rows = {tuple(sorted(r)) for r in [(0, 1, 2), (3, 4, 5), (6, 7, 8)]}
    blocks_for_rows = {rs.block for a in space for rs in a.ring_sets
                       if {tuple(sorted(r)) for r in rs.rings} == rows}
    assert blocks_for_rows == {0, 1}


def test_action_violations_detected():
    bad_dev = Action((RingSet(0, ((0, 1, 2), (2, 3, 4))),))
    assert any("ring-set 0 uses devices" in v for v in bad_dev.violations())
    bad_conn = Action((RingSet(0, ((0, 1, 2),)), RingSet(1, ((1, 0, 3),))))
    assert any("reuses connections" in v for v in bad_conn.violations())
    bad_blocks = Action((RingSet(0, ((0, 1, 2),)), RingSet(0, ((3, 4, 5),))))
    assert any("same block" in v for v in bad_blocks.violations())


# ---------------------------------------------------------------- state tensor (eq 5-6)

def test_state_tensor_eq5_eq6_and_pruning():
    s0 = initial_state(range(4), 2)
    assert s0 == {0: (1, 1), 1: (2, 2), 2: (4, 4), 3: (8, 8)}  # data[i][j][k] = 1 iff i == j
    assert not is_done(s0)
    a = Action((RingSet(0, ((0, 1, 2, 3),)), RingSet(1, ())))
    s1 = apply_action(s0, a)
    assert s1[2] == (15, 4)
    assert apply_action(s1, a) is None  # would count every contribution twice
    b = Action((RingSet(1, ((0, 1), (2, 3))),))
    s2 = apply_action(s1, b)
    assert s2[0] == (15, 3) and s2[3] == (15, 12)
    c = Action((RingSet(1, ((0, 2), (1, 3))),))
    s3 = apply_action(s2, c)
    assert is_done(s3)  # eq 6
    assert apply_action(s3, Action((RingSet(0, ()),))) is None  # adds nothing
    assert apply_action(s0, Action((RingSet(0, ((0, 9, 1),)),))) is None  # device outside the all-reduce


# ---------------------------------------------------------------- MCTS pieces

def test_reward_is_rank_in_the_time_list():
    r = RewardList([8.3, 6.5, 4.7])
    assert r.as_list() == [0, 8.3, 6.5, 4.7]
    assert r.reward(6.5) == 2
    assert r.as_list() == [0, 8.3, 6.5, 4.7]
    assert r.reward(5.4) == 3
    assert r.as_list() == [0, 8.3, 6.5, 5.4, 4.7]
    assert r.reward(1.0) == 5 and r.reward(99.0) == 1


def test_lambda_decays_per_eq14():
    assert exploration_weight(0, 100) == 10.0
    assert exploration_weight(50, 100) == pytest.approx(5.0)
    assert exploration_weight(100, 100) == 0.0
    assert exploration_weight(500, 100) == 0.0
    assert exploration_weight(25, 100, 4.0, 2.0) == pytest.approx(3.5)


def test_planner_needs_a_seeded_rng():
    with pytest.raises(ValueError, match="random.Random"):
        RsgcmPlanner(Network.full_mesh(4, 1e-3, 1e-9), 1000)


BRUTE_CASES = [
    ("full mesh 6, S=1", Network.full_mesh(6, 1e-3, 1e-8), 1),
    ("full mesh 6, S=2", Network.full_mesh(6, 1e-3, 1e-8), 2),
    ("2x3 torus, S=2", Network.torus(2, 3, 1e-4, 1e-8), 2),
    ("random 6 (seed 1), S=2", random_network(6, 1), 2),
    ("random 6 (seed 2), S=2", random_network(6, 2), 2),
    ("random 5 (seed 3), S=2", random_network(5, 3), 2),
    ("random 6 (seed 2), S=1", random_network(6, 2), 1),
]


@pytest.mark.parametrize("name,net,S", BRUTE_CASES, ids=[c[0] for c in BRUTE_CASES])
def test_mcts_finds_the_brute_force_optimum(name, net, S):
    best = exhaustive_search(net, 4 * MB, sets=S)
    assert best is not None
    assert_valid_plan(best, net)
    hits = 0
    for seed in range(10):
        p = RsgcmPlanner(net, 4 * MB, params=SearchParams(sets=S), rng=random.Random(seed))
        p.search()
        got = p.best_plan()
        assert got is not None
        assert_valid_plan(got, net)
        assert got.predicted_s >= best.predicted_s * (1 - 1e-12)  # nothing beats the optimum of the space
        hits += got.predicted_s <= best.predicted_s * (1 + 1e-12)
    assert hits >= 9, f"{name}: MCTS found the optimum in {hits}/10 seeds"


def test_mcts_under_a_small_budget_still_returns_valid_plans():
    net = random_network(6, 1)
    p = RsgcmPlanner(net, 4 * MB, params=SearchParams(sets=2, episodes=40), rng=random.Random(0))
    assert p.search() == 40
    assert not p.exhausted
    assert p.search() == 0  # Ep spent
    assert p.search(10) == 10  # keep searching on request
    assert_valid_plan(p.current_plan(), net)


def test_search_is_deterministic_per_seed():
    net = random_network(6, 2)
    plans = []
    for _ in range(2):
        p = RsgcmPlanner(net, 4 * MB, params=SearchParams(sets=2, episodes=60), rng=random.Random(7))
        p.search()
        plans.append((p.best_plan().key(), p.episodes_run, [c.key() for c in p.candidates()]))
    assert plans[0] == plans[1]


@pytest.mark.parametrize("tl,tb,want", [(0.1, 0.01, "mesh"), (0.01, 0.1, "double ring"),
                                        (0.009, 0.039, "double ring")])
def test_eq18_crossover_found_by_the_search(tl, tb, want):
    """3x3 torus, S=2, D=32 MB: LBR 10 MB picks the 2D-mesh, LBR 0.1 MB the double ring (paper's Table 6)."""
    net = Network.torus(3, 3, tl, tb)
    got = plan(net, 32, params=SearchParams(sets=2), rng=random.Random(0))
    assert_valid_plan(got, net)
    if want == "mesh":
        assert [sorted(len(r) for r in a.rings()) for a in got.steps] == [[3] * 6, [3] * 6]
        assert got.predicted_s == pytest.approx(cm.mesh_2d(32, 3, 3, tl, tb).total)
    else:
        assert [sorted(len(r) for r in a.rings()) for a in got.steps] == [[9, 9]]
        assert got.predicted_s == pytest.approx(cm.double_ring(32, 9, tl, tb).total)


# ---------------------------------------------------------------- real environment (eq 13)

def test_allreduce_reward_eq13():
    assert allreduce_reward(32, 8, 2.0) == 32 * 7 * 8 / 2.0
    with pytest.raises(ValueError, match="> 0"):
        allreduce_reward(32, 8, 0.0)


def _measure_penalising(link):
    """A pure stand-in for the executor: predicted time, tripled for plans that use ``link``."""
    return lambda p: p.predicted_s * (3.0 if p.uses_link(*link) else 1.0)


def test_rerank_by_measured_time():
    net = Network.full_mesh(6, 1e-3, 1e-8)
    planner = RsgcmPlanner(net, 4 * MB, params=SearchParams(sets=1), rng=random.Random(0))
    planner.search()
    cands = planner.candidates()
    assert 2 <= len(cands) <= 5
    assert [c.predicted_s for c in cands] == sorted(c.predicted_s for c in cands)
    assert cands[-1].predicted_s <= 1.25 * cands[0].predicted_s  # only plans worth a measured round
    bad = sorted(cands[0].steps[0].connections())[0]
    measure = _measure_penalising(bad)
    chosen = rerank(cands, measure)
    assert not chosen.uses_link(*bad)
    assert chosen.measured_s == pytest.approx(measure(chosen))
    # the same through the planner's sans-IO protocol: measure each candidate as a round would
    rounds = 0
    while (nxt := planner.next_to_measure()) is not None:
        planner.record_measurement(nxt, measure(nxt))
        rounds += 1
    assert rounds == len(cands)
    cur = planner.current_plan()
    assert cur.source == "measured" and cur.key() == chosen.key()


def test_candidate_slack():
    net = random_network(6, 1)
    wide = RsgcmPlanner(net, 4 * MB, params=SearchParams(sets=2, candidate_slack=100.0, top_k=50),
                        rng=random.Random(0))
    wide.search()
    tight = RsgcmPlanner(net, 4 * MB, params=SearchParams(sets=2, candidate_slack=1.0, top_k=50),
                         rng=random.Random(0))
    tight.search()
    best = wide.candidates()[0].predicted_s
    assert len(wide.candidates()) > len(tight.candidates()) >= 1
    assert all(c.predicted_s == best for c in tight.candidates())
    with pytest.raises(ValueError, match="candidate_slack"):
        SearchParams(candidate_slack=0.5)


def test_plan_with_measure_callback():
    net = Network.full_mesh(5, 1e-3, 1e-8)
    free = plan(net, MB, rng=random.Random(1))
    bad = sorted(free.steps[0].connections())[0]
    got = plan(net, MB, rng=random.Random(1), measure=_measure_penalising(bad))
    assert not got.uses_link(*bad)


# ---------------------------------------------------------------- replanning

REPLAN_CASES = [
    ("full mesh 6, S=1", Network.full_mesh(6, 1e-3, 1e-8), 1),
    ("full mesh 6, S=2", Network.full_mesh(6, 1e-3, 1e-8), 2),
    ("full mesh 8, S=1", Network.full_mesh(8, 1e-3, 1e-8), 1),
    ("2x4 torus, S=1", Network.torus(2, 4, 1e-4, 1e-8), 1),
    ("racks 2x3 interleaved, S=1", None, 1),
    ("racks 2x3 interleaved, S=2", None, 2),
]


def racks_network():
    topo = Topology.uniform([f"h{i}" for i in range(6)], rate_bps=100e6, latency_s=1e-3, racks=[3, 3],
                            uplink_bps=100e6)
    return as_network(topo, names=["h0", "h3", "h1", "h4", "h2", "h5"])


@pytest.mark.parametrize("name,net,S", REPLAN_CASES, ids=[c[0] for c in REPLAN_CASES])
def test_broken_link_replans_within_1_2x(name, net, S):
    net = net or racks_network()
    p = RsgcmPlanner(net, 4 * MB, params=SearchParams(sets=S), rng=random.Random(0))
    p.search()
    before = p.current_plan()
    for link in sorted(before.steps[0].connections())[:3]:
        q = RsgcmPlanner(net, 4 * MB, params=SearchParams(sets=S), rng=random.Random(0))
        q.search()
        q.fail_link(*link)
        meanwhile = q.current_plan()  # no round lost: something valid to run right away
        assert_valid_plan(meanwhile, net, failed_links=[link])
        q.search()
        after = q.current_plan()
        assert_valid_plan(after, net, failed_links=[link])
        assert after.predicted_s <= 1.2 * before.predicted_s, (name, link, after.predicted_s / before.predicted_s)


def test_double_ring_torus_failure_costs_what_the_space_allows():
    """On a 3x3 torus the double ring uses all 18 connections: after a failure the best the space holds
    (brute force over the degraded space) is what the planner finds -- here 2x, not within 1.2x."""
    net = Network.torus(3, 3, 0.01, 0.1)
    p = RsgcmPlanner(net, 32, params=SearchParams(sets=2), rng=random.Random(0))
    p.search()
    before = p.current_plan()
    p.fail_link(0, 1)
    p.search()
    after = p.current_plan()
    assert_valid_plan(after, net, failed_links=[(0, 1)])
    live = [a for a in p.space if (0, 1) not in a.connections()]
    best = exhaustive_search(net.without(links=[(0, 1)]), 32, sets=2, space=live)
    assert after.predicted_s == pytest.approx(best.predicted_s)
    assert after.predicted_s > 1.2 * before.predicted_s


def test_device_failure_falls_back_then_searches_survivors():
    net = Network.full_mesh(6, 1e-3, 1e-8)
    p = RsgcmPlanner(net, 4 * MB, params=SearchParams(sets=2), rng=random.Random(3))
    p.search()
    p.fail_device(4)
    meanwhile = p.current_plan()
    assert meanwhile.source == "fallback" and meanwhile.devices == (0, 1, 2, 3, 5)
    assert_valid_plan(meanwhile, net, failed_devices=[4])
    p.search()
    after = p.current_plan()
    assert after.source != "fallback"
    assert_valid_plan(after, net, failed_devices=[4])
    assert after.predicted_s <= meanwhile.predicted_s
    with pytest.raises(ValueError, match="not one of"):
        p.fail_device(17)


def test_fallback_ring_and_its_failure():
    net = Network.torus(2, 4, 1.0, 0.0)
    ring = fallback_ring(net, range(8))
    assert sorted(ring) == list(range(8))
    assert all(net.connected(ring[k], ring[(k + 1) % 8]) for k in range(8))
    line = Network.from_edges(3, [(0, 1), (1, 2)], 1.0, 0.0)  # no ring through 3 devices
    assert fallback_ring(line, range(3)) is None
    p = RsgcmPlanner(line, MB, rng=random.Random(0))
    with pytest.raises(PlanningError, match="no ring connects"):
        p.current_plan()


# ---------------------------------------------------------------- adapters

def test_topology_adapter_prices_shared_links():
    net = racks_network()
    assert net.n == 6 and len(net.links) == 15
    assert net.hop_resources[(0, 1)] == ("up:h0", "uplink_up:0", "uplink_down:1", "down:h3")
    naive = cm.ring_seconds(net, tuple(range(6)), 4 * MB)  # rank order crosses racks on every hop
    best = plan(net, 4 * MB, rng=random.Random(0))
    assert_valid_plan(best, net)
    assert best.predicted_s <= 0.5 * naive
    failed = Topology.uniform(["a", "b", "c"]).with_failed([("a", "c")])
    assert not as_network(failed).connected(0, 2)


def test_matrix_adapter():
    G = [[0, 1, 1], [1, 0, (1e-3, 1e-9)], [1, (1e-3, 1e-9), 0]]
    net = as_network(G, alpha=5e-4, beta=1e-8)
    assert net.link(0, 1) == Link(5e-4, 1e-8) and net.link(1, 2) == Link(1e-3, 1e-9)
    with pytest.raises(ValueError, match="symmetric"):
        as_network([[0, 1], [0, 0]])
    with pytest.raises(ValueError, match="square"):
        as_network([[0, 1]])
    with pytest.raises(TypeError, match="Network, a Topology"):
        as_network(42)


def test_plan_json():
    got = plan(Network.full_mesh(4, 1e-3, 1e-8), MB, params=SearchParams(sets=2), rng=random.Random(0))
    d = got.to_json()
    assert d["schedule"] == "rsgcm" and d["blocks"] == 2 and d["devices"] == [0, 1, 2, 3]
    assert all({"block", "rings"} <= set(rs) for step in d["steps"] for rs in step)


# ---------------------------------------------------------------- properties

@st.composite
def graphs(draw):
    n = draw(st.integers(3, 7))
    seed = draw(st.integers(0, 10_000))
    p = draw(st.sampled_from([0.5, 0.7, 1.0]))
    return random_network(n, seed, p)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(net=graphs(), S=st.sampled_from([1, 2]))
def test_every_action_in_the_space_is_valid(net, S):
    for a in build_search_space(net, sets=S):
        assert a.violations() == []
        assert sorted(rs.block for rs in a.ring_sets) == list(range(S))
        for c in a.connections():
            assert net.connected(*c)
        assert all(len(r) >= 3 for r in a.rings())


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(net=graphs(), S=st.sampled_from([1, 2]), seed=st.integers(0, 100), episodes=st.integers(1, 60),
       fail=st.integers(0, 1000))
def test_every_returned_plan_is_valid(net, S, seed, episodes, fail):
    p = RsgcmPlanner(net, MB, params=SearchParams(sets=S, episodes=episodes), rng=random.Random(seed))
    p.search()
    for c in p.candidates():
        assert_valid_plan(c, net)
    links = sorted(net.links)
    if not links:
        return
    link = links[fail % len(links)]
    p.fail_link(*link)
    p.search(episodes)
    try:
        cur = p.current_plan()
    except PlanningError:
        assert fallback_ring(net.without(links=[link]), range(net.n)) is None
        return
    assert_valid_plan(cur, net, failed_links=[link])
