"""MLfabric's PS controller driven by a virtual-clock asynchronous-SGD simulation (no sockets).

Workers compute for a random time, announce their update (NodeReady with the version they pulled), the
controller batches and grants; the simulated PS applies commits in grant order at their predicted arrival,
checks every update's staleness against tau_max, and reports TransferDone; a worker pulls the newest version
when its update is applied or dropped and computes again.  Host rates are redrawn every t_lag.
"""

from __future__ import annotations

import heapq
import random
from collections import deque

import pytest

from ltp_ps.schedules.base import World
from ltp_ps.schedules.mlfabric_controller import BATCH_WINDOW_S, MLfabricController, MLfabricSchedule, grant_timeout
from ltp_ps.schedules.mlfabric_links import FabricNetwork
from ltp_ps.schedules.mlfabric_replica import DEFAULT_MAX_BACKLOG, divergence_bound, history_bound
from ltp_ps.schedules.program import (SLOT_GRAD, Grant, NodeFailed, NodeReady, Program, RoundPlan, TransferDone, server,
                                      worker)
from ltp_ps.schedules.topology import Topology

pytestmark = pytest.mark.timeout(120)

PS = server(0)
REPLICA = "replica"
GAMMA = 0.9
MBIT = 1e6 / 8
RATES_MBIT = (10, 25, 50, 100)
WEIGHTS = (0.2, 0.2, 0.2, 0.4)


def _rates(rng, hosts):
    return {h: rng.choices(RATES_MBIT, WEIGHTS)[0] * MBIT for h in hosts}


def _programs_of(grants) -> RoundPlan:
    """Each grant is one stage of its node's program: the batch's sends and receives must pair up."""
    progs: dict = {}
    for g in grants:
        if g.drop:
            continue
        p = progs.get(g.node) or Program(g.node)
        progs[g.node] = Program(g.node, p.stages + (g.steps,))
    return RoundPlan("mlfabric", 0, progs)


def simulate(seed: int, *, n: int = 6, k: int = 1, tau: int = 4, duration: float = 30.0, t_lag: float = 2.0,
             nbytes: int = 1_000_000, fail: tuple | None = None, div_max: float | None = None):
    rng = random.Random(seed)
    norm_rng = random.Random(seed + 1000)  # update norms (a stream of their own: the schedule draws stay put)
    workers = [worker(i) for i in range(n)]
    hosts = [PS] + workers + ([REPLICA] if div_max is not None else [])
    net = FabricNetwork(_rates(rng, hosts), _rates(rng, hosts))
    rep_kw = {} if div_max is None else {"replica": REPLICA, "div_max": div_max, "gamma": GAMMA, "replica_k": 1}
    ctrl = MLfabricController(net, PS, n_elems=nbytes // 4, tau_max=tau, k=k, rng=random.Random(seed), **rep_kw)
    assert ctrl.start(0, workers, now=0.0) == []
    heap: list = []  # (time, seq, kind, payload)
    seq = 0

    def push(t, kind, payload):
        nonlocal seq
        heapq.heappush(heap, (t, seq, kind, payload))
        seq += 1

    ps_version = 0
    fifo: deque = deque()  # (commit, tag, lost, arrive, last of its batch) in the PS's grant order
    rfifo: deque = deque()  # (replica commit, src, tag, apply_at) in the replica's grant order
    server_seq: list = []  # updates in the order the PS applied them
    replica_seq: list = []
    divergences: list = []  # the eq 11 bound each time a batch's last commit is applied
    last_rapply = 0.0
    last_apply = 0.0
    alive = set(workers)
    stale = []
    written_off: list = []
    self_aggregated: list = []
    applied = 0
    for w in workers:
        push(rng.uniform(0.05, 0.5), "ready", (w, 0))
    push(t_lag, "rates", None)
    if fail is not None:
        push(fail[0], "fail", fail[1])
    now = 0.0
    while True:
        cands = []
        if heap:
            cands.append(heap[0][0])
        if ctrl.next_deadline() is not None:
            cands.append(ctrl.next_deadline())
        if fifo:
            cands.append(max(fifo[0][3], last_apply))
        if rfifo:
            cands.append(max(rfifo[0][3], last_rapply))
        if not cands:
            break
        now = min(cands)
        if now > duration and not fifo and not rfifo and ctrl.next_deadline() is None:
            break
        if rfifo and max(rfifo[0][3], last_rapply) == now:  # the replica applies first on ties
            rc, src, tag, _ = rfifo.popleft()
            replica_seq.extend(rc.members)
            last_rapply = now
            for key in [key for key in ctrl.replica_outstanding
                        if key == (src, REPLICA, tag) or (key[1] == src and key[0] in {u.node for u in rc.members})]:
                ctrl.on_event(TransferDone(key[0], key[1], key[2]), now=now)
            continue
        if fifo and max(fifo[0][3], last_apply) == now:
            c, tag, lost, _, batch_last = fifo.popleft()
            if c.source not in alive and c.source != PS:
                ctrl.on_event(TransferDone(c.source, PS, tag, ok=False), now=now)
                for m in c.members:
                    if m.update.node in alive:
                        push(now + rng.uniform(0.05, 0.5), "ready", (m.update.node, ps_version))
                continue
            members = [m for m in c.members if m.update.node not in lost]
            written_off.extend(m.update.node for m in c.members if m.update.node in lost)
            for m in members:
                s = ps_version - m.update.version
                stale.append(s)
            ps_version += len(members)
            applied += len(members)
            server_seq.extend(m.update for m in members)
            last_apply = now
            if batch_last and div_max is not None:
                r = min(len(replica_seq), len(server_seq))  # the replica may run ahead into the next batch
                assert replica_seq[:r] == server_seq[:r]  # same order at the replica
                norms = [u.norm for u in server_seq]
                divergences.append(divergence_bound(history_bound(0.0, norms[:r], GAMMA), norms[r:], GAMMA))
            ctrl.on_event(TransferDone(c.source, PS, tag, ok=True), now=now)
            for m in c.members:
                if m.update.node in alive:
                    push(now + rng.uniform(0.05, 0.5), "ready", (m.update.node, ps_version))
            continue
        if ctrl.next_deadline() is not None and ctrl.next_deadline() == now:
            grants = ctrl.on_timer(now=now)
            plan = ctrl.plans[-1]
            _programs_of(grants).check()
            ps_recvs = [g.steps[0] for g in grants if g.node == PS and g.steps[0].op == "recv"]
            ps_applies = [g.steps[0] for g in grants if g.node == PS and g.steps[0].op == "apply"]
            assert len(ps_recvs) == len(ps_applies) == len(plan.commits)
            rp = ctrl.replica_plans[-1] if div_max is not None else None
            for ci, (c, r) in enumerate(zip(plan.commits, ps_recvs)):
                arrive = c.arrive
                if rp is not None and rp.delayed and ci == len(plan.commits) - 1:
                    arrive = rp.server_last.end
                assert r.peer == c.source and r.timeout_s == pytest.approx(grant_timeout(now, arrive))
                entry = (c, r.tag, set(), arrive, ci == len(plan.commits) - 1)
                fifo.append(entry)
                if c.group:  # each member's hop to the aggregator completes (or is lost) at its predicted arrival
                    for m in c.members:
                        if m.update.node == c.source:
                            continue  # the aggregator's own update: no transfer
                        send = next(x.steps[0] for x in grants if x.node == m.update.node
                                    and x.steps[0].slot == SLOT_GRAD)
                        push(plan.grant_of(m.update.node).arrive, "hop", (m.update.node, c.source, send.tag, entry))
            if rp is not None:
                rrecvs = [g.steps[0] for g in grants if g.node == REPLICA and g.steps[0].op == "recv"]
                assert len(rrecvs) == len(rp.frozen)
                for rc, r in zip(rp.frozen, rrecvs):
                    rfifo.append((rc, r.peer, r.tag, rc.apply_at))
            for g in plan.grants:
                mine = [x for x in grants if x.node == g.update.node
                        and (x.drop or (x.steps[0].op == "send" and x.steps[0].slot == SLOT_GRAD))]
                if g.hop == g.update.node:  # it aggregates its own update: combined in place, no send
                    assert not mine and any(s.op == "combine" and s.src == SLOT_GRAD
                                            for x in grants if x.node == g.hop for s in x.steps)
                    self_aggregated.append(g.update.node)
                    continue
                assert len(mine) == 1
                if g.drop:
                    assert mine[0].drop and mine[0].reason == g.reason
                    push(now + rng.uniform(0.05, 0.5), "ready", (g.update.node, ps_version))
                else:
                    start = g.start
                    last = plan.commits[-1]
                    if rp is not None and rp.delayed and last.group == 0 and last.members[0].update is g.update:
                        start = rp.server_last.start  # §5.3: the batch's last primary transfer was delayed
                        assert start >= g.start
                    assert mine[0].steps[0].peer == g.hop and mine[0].start_at == start >= now
            continue
        t, _, kind, payload = heapq.heappop(heap)
        if kind == "ready":
            w, v = payload
            if w in alive and t <= duration:
                ctrl.on_event(NodeReady(w, 0, nbytes, v, norm_rng.uniform(0.2, 2.0)), now=t)
        elif kind == "hop":
            w, agg, tag, entry = payload
            if w in alive:
                ctrl.on_event(TransferDone(w, agg, tag, ok=True), now=t)
            else:
                entry[2].add(w)
        elif kind == "rates":
            ctrl.update_rates(_rates(rng, hosts), _rates(rng, hosts), now=t)
            if t + t_lag <= duration:
                push(t + t_lag, "rates", None)
        elif kind == "fail":
            alive.discard(payload)
            ctrl.on_event(NodeFailed(payload, "test"), now=t)
    ctrl.sim_self_aggregated = self_aggregated  # members whose aggregator was their own host (test coverage)
    ctrl.sim_divergences = divergences
    ctrl.sim_replica_seq = replica_seq
    ctrl.sim_server_seq = server_seq
    return ctrl, ps_version, stale, applied


@pytest.mark.parametrize("seed,n,k,tau", [(0, 6, 1, 4), (1, 6, 2, 3), (2, 3, 0, 1), (3, 10, 3, 6), (4, 2, 1, 2)])
def test_simulated_async_training_never_applies_beyond_tau_max(seed, n, k, tau):
    ctrl, version, stale, applied = simulate(seed, n=n, k=k, tau=tau)
    assert applied > 20 and stale and max(stale) <= tau
    assert ctrl.done()
    assert ctrl.v_next == version  # the controller's version bookkeeping is exact when everything drained
    assert ctrl.stats["planned"] == applied
    if k:
        assert ctrl.stats["aggregated"] > 0 or n <= 2
    if k and n >= 6:  # some aggregator was picked on the host of a member: combined in place, no self-send
        assert ctrl.sim_self_aggregated
    assert not ctrl.ignored


@pytest.mark.parametrize("victim", range(8))
def test_a_worker_or_aggregator_failing_mid_run_is_written_off_exactly(victim):
    # at t = 5 s the victim dies with transfers (its own update, or an aggregate it holds) in flight
    ctrl, version, stale, applied = simulate(7, n=8, k=2, tau=5, fail=(5.0, worker(victim)))
    assert max(stale) <= 5 and applied > 20
    assert ctrl.v_next == version  # written-off gradients are out of the expected version count
    assert worker(victim) not in ctrl.workers
    assert all(worker(victim) not in p.aggregators for p in ctrl.plans if p.now > 5.0)


def test_failure_with_gradients_in_flight_writes_them_off():
    ctrl, version, stale, applied = simulate(7, n=8, k=2, tau=5, fail=(5.0, worker(0)))
    assert ctrl.stats["written_off"] >= 1 and ctrl.v_next == version


def test_a_generous_bound_drops_nothing_and_a_tight_one_drops_to_keep_it():
    loose, _, stale_l, _ = simulate(0, n=6, k=1, tau=16)
    tight, _, stale_t, _ = simulate(0, n=6, k=1, tau=4)
    assert loose.stats["dropped"] == 0 and max(stale_l) > 4  # async staleness here naturally exceeds 4
    assert tight.stats["dropped"] > 0 and max(stale_t) <= 4


def test_events_naming_unknown_nodes_are_counted_not_raised():
    net = FabricNetwork({PS: 10.0, worker(0): 10.0, worker(1): 10.0}, {PS: 10.0, worker(0): 10.0, worker(1): 10.0})
    ctrl = MLfabricController(net, PS, n_elems=4)
    with pytest.raises(RuntimeError, match="start"):
        ctrl.on_event(NodeReady(worker(0), 0, 16, 0), now=0.0)
    ctrl.start(0, [worker(0), worker(1)], now=0.0)
    assert ctrl.on_event(NodeReady(worker(9), 0, 16, 0), now=0.0) == []
    assert ctrl.on_event(TransferDone(worker(0), PS, 12345), now=0.0) == []
    assert ctrl.on_event(NodeReady(worker(0), 0, 16, 0), now=0.0) == []
    assert ctrl.on_event(NodeReady(worker(0), 0, 16, 0), now=0.01) == []
    assert ctrl.ignored == {"ready_from_unknown_node": 1, "done_for_unknown_transfer": 1,
                            "second_update_before_grant": 1}
    assert ctrl.next_deadline() == pytest.approx(BATCH_WINDOW_S)
    assert ctrl.on_timer(now=0.05) == []  # not due yet
    grants = ctrl.on_timer(now=BATCH_WINDOW_S)
    assert [(g.node, g.steps[0].op) for g in grants] == [(worker(0), "send"), (PS, "recv"), (PS, "apply")]
    assert Grant.from_json(grants[0].to_json()) == grants[0]
    assert not ctrl.done()


def test_a_batch_holding_every_live_worker_closes_without_waiting_out_its_window():
    """The window waits for updates that may still join the batch; once every live worker's is in (one worker,
    or the last of n), none can, so the batch is planned at once.  A worker written off shrinks the set."""
    net = FabricNetwork({PS: 10.0, **{worker(i): 10.0 for i in range(3)}},
                        {PS: 10.0, **{worker(i): 10.0 for i in range(3)}})
    ctrl = MLfabricController(net, PS, n_elems=4)
    ctrl.start(0, [worker(0), worker(1), worker(2)], now=0.0)
    ctrl.on_event(NodeReady(worker(0), 0, 16, 0), now=1.0)
    ctrl.on_event(NodeReady(worker(1), 0, 16, 0), now=1.02)
    assert ctrl.next_deadline() == pytest.approx(1.0 + BATCH_WINDOW_S)
    ctrl.on_event(NodeReady(worker(0), 0, 16, 0), now=1.03)  # a second update: ignored, changes nothing
    assert ctrl.next_deadline() == pytest.approx(1.0 + BATCH_WINDOW_S)
    ctrl.on_event(NodeFailed(worker(2), "gone"), now=1.04)  # the batch waited only for worker 2
    assert ctrl.next_deadline() == pytest.approx(1.04)
    solo = MLfabricController(net, PS, n_elems=4)
    solo.start(0, [worker(0), worker(1)], now=0.0)
    solo.on_event(NodeReady(worker(1), 0, 16, 0), now=2.0)
    solo.on_event(NodeReady(worker(0), 0, 16, 0), now=2.01)
    assert solo.next_deadline() == pytest.approx(2.01)
    assert {g.node for g in solo.on_timer(now=2.01)} >= {worker(0), worker(1), PS}


def test_schedule_face_builds_a_controller_from_the_world():
    topo = Topology.uniform(["ps", "a", "b", "c"], rate_bps=80e6)
    world = World(workers=(0, 1, 2), n_elems=1000, shards=((0, 1000),), topology=topo)
    sched = MLfabricSchedule(world, tau_max=3, k=1)
    assert sched.plan(5).notes["dynamic"] == "controller"
    ctrl = sched.controller()
    assert (ctrl.lo, ctrl.hi, ctrl.tau_max, ctrl.k) == (0, 1000, 3, 1)
    assert ctrl.net.up[PS] == 10e6 and ctrl.net.down[worker(2)] == 10e6
    plan = sched.plan(7)
    plan.check()  # every granted send has its receive
    batch = plan.notes["batch"]
    assert batch["v_init"] == 7 and len(batch["grants"]) == 3 and not any(g["drop"] for g in batch["grants"])
    assert {e[1] for e in plan.edges()} <= {PS} | {worker(r) for r in range(3)}
    assert sched.predict_s(4000) == pytest.approx(batch["t_end"])
    assert sched.predict_s(8000) > sched.predict_s(4000) > 0
    from ltp_ps.schedules import create

    assert type(create("mlfabric", world)) is MLfabricSchedule  # the registry finds it
    with pytest.raises(ValueError, match="one PS shard"):
        MLfabricSchedule(World(workers=(0,), n_elems=10, shards=((0, 5), (5, 10))))


@pytest.mark.parametrize("seed,div_max", [(0, 0.0), (1, 3.0), (2, 30.0), (3, 1e9)])
def test_replica_option_keeps_order_and_the_divergence_bound(seed, div_max):
    ctrl, version, stale, applied = simulate(seed, n=6, k=1, tau=8, div_max=div_max, duration=15.0)
    assert applied > 20 and max(stale) <= 8 and ctrl.v_next == version
    assert ctrl.sim_divergences and max(ctrl.sim_divergences) <= div_max + 1e-9
    assert ctrl.stats["replicated"] == len(ctrl.sim_replica_seq) > 0
    assert ctrl.sim_replica_seq == ctrl.sim_server_seq[:len(ctrl.sim_replica_seq)]
    assert ctrl.stats["replicated"] + len(ctrl.backlog) == applied  # every applied update replicated or punted
    if div_max == 0.0:
        assert not ctrl.backlog and ctrl.stats["delayed"] > 0  # strict: the replica never lags a batch's end
    assert all(len(rp.punted) <= DEFAULT_MAX_BACKLOG for rp in ctrl.replica_plans)  # the lag stays bounded


def test_an_unsized_update_is_planned_as_a_dense_partial_of_the_model():
    net = FabricNetwork({PS: 1000.0, worker(0): 1000.0}, {PS: 1000.0, worker(0): 1000.0})
    ctrl = MLfabricController(net, PS, n_elems=250, batch_window_s=0.0)
    ctrl.start(0, [worker(0)], now=0.0)
    ctrl.on_event(NodeReady(worker(0), 0), now=0.0)  # the executor did not say how large it is
    ctrl.on_timer(now=0.0)
    (g,) = ctrl.plans[-1].grants
    assert g.update.nbytes > 250 * 4 and g.arrive == pytest.approx(g.update.nbytes / 1000.0)


def test_a_failed_worker_that_is_admitted_again_is_planned_again():
    """NodeFailed writes a worker off (its updates are ignored); ``admit`` (it joined again) plans them again."""
    net = FabricNetwork({h: 100 * MBIT for h in (PS, worker(0), worker(1))},
                        {h: 100 * MBIT for h in (PS, worker(0), worker(1))})
    ctrl = MLfabricController(net, PS, n_elems=1000, tau_max=4, k=0, rng=random.Random(0))
    ctrl.start(0, [worker(0), worker(1)], now=0.0)
    ctrl.on_event(NodeFailed(worker(1), "test"), now=0.1)
    ctrl.on_event(NodeReady(worker(1), 0, 4000, 0, 1.0), now=0.2)
    assert ctrl.ignored.get("ready_from_unknown_node") == 1 and worker(1) not in ctrl.pending
    assert ctrl.admit(worker(1), now=0.3) == [] and ctrl.admit(worker(1), now=0.3) == []  # idempotent
    assert ctrl.workers.count(worker(1)) == 1
    ctrl.on_event(NodeReady(worker(1), 0, 4000, 0, 1.0), now=0.4)
    grants = ctrl.flush(now=1.0)
    assert any(g.node == worker(1) for g in grants) and ctrl.stats["planned"] == 1
    with pytest.raises(ValueError):
        ctrl.admit("nobody", now=1.0)
