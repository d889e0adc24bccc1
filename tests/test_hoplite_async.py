"""Hoplite's asynchronous half-batch PS (ltp_ps.schedules.hoplite_async), in memory with a virtual clock.

``AsyncRun`` plays every node: grants run in order per node (one stage each), a send posts its data at once,
a receive completes when the data is there or its sender is dead; a worker that holds every chunk of version
``v`` computes for its own (seeded) time and reports ``NodeReady(version=v)``; the PS's Apply takes the mean of
the partial, steps ``params -= LR * mean`` and reports ``UpdateApplied``.  Gradients are a known function of
(worker, version), so every applied mean can be checked exactly.
"""

import collections
import heapq
import random

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from ltp_ps.schedules.hoplite import parse_chunk_slot
from ltp_ps.schedules.hoplite_async import (MAX_STALENESS, AsyncHalfBatchController, UpdateApplied,
                                            batch_of_slot, half_batch, params_key, parse_params_key)
from ltp_ps.schedules.partial import Partial
from ltp_ps.schedules.program import ChunkArrived, NodeFailed, NodeReady, TransferDone, server, worker
from ltp_ps.schedules.tags import PHASE_PUSH, pack, unpack

LR = 0.1


def grad_of(rank: int, version: int, n: int) -> np.ndarray:
    return (np.arange(n, dtype=np.float32) % 7 + rank + 0.25 * version).astype(np.float32)


class AsyncRun:
    def __init__(self, n=6, n_elems=1000, chunk_elems=128, compute=None, updates=20, seed=0, **kw):
        self.n, self.n_elems = n, n_elems
        self.workers = [worker(r) for r in range(n)]
        self.c = AsyncHalfBatchController([(0, n_elems)], chunk_bytes=chunk_elems * 4, updates=updates,
                                          rng=random.Random(seed), **kw)
        self.compute = compute or {w: 1.0 for w in self.workers}
        self.now = 0.0
        self.q = collections.defaultdict(collections.deque)
        self.entered = {}
        self.mail = {}
        self.dead = set()
        self.params = np.zeros(n_elems, np.float32)
        self.snap = {0: self.params.copy()}
        self.flat = {w: np.zeros(n_elems, np.float32) for w in self.workers}
        self.have = {w: {} for w in self.workers}
        self.base = {}  # worker -> version it computes on
        self.slots = {x: {} for x in self.workers + [server(0)]}
        self.timers = []
        self.seq = 0
        self.applied = []  # (update, contributors, mean)
        self.ready_log = []  # (time, worker, version)
        self.computed_on = []  # (worker, version, params equal to the PS snapshot)
        self.before_applied = {}  # update -> callable run just before the controller hears it was applied
        self.feed(self.c.start(0, self.workers, now=0.0))

    def feed(self, grants):
        for g in grants:
            self.q[g.node].append(g)

    def event(self, ev):
        if isinstance(ev, UpdateApplied) and ev.batch in self.before_applied:  # a test's hook
            self.before_applied.pop(ev.batch)()
        self.feed(self.c.on_event(ev, now=self.now))

    def kill(self, node):
        self.dead.add(node)
        self.q.pop(node, None)
        for key in [k for k in self.mail if k[0] == node]:
            del self.mail[key]
        self.event(NodeFailed(node))

    def revive(self, node):
        """``node`` (killed earlier) joins again: a fresh process state, taken back by the controller.  A compute
        it started before its death may still finish (a paused worker resumed): its gradient is stale."""
        self.dead.discard(node)
        self.have[node] = {}
        self.slots[node] = {}
        self.entered.pop(node, None)
        self.feed(self.c.admit(node, now=self.now))

    def _grad_partial(self, w):
        r = int(w.split(":")[1])
        return Partial.of_gradient(grad_of(r, self.base[w], self.n_elems), samples=1, loss=1.0)

    def run(self, until=lambda run: run.c.done(), max_time=1e4):
        while not until(self) and self.now < max_time:
            self._drain()
            if until(self) or not self.timers:
                break
            self.now, _, w, v = heapq.heappop(self.timers)
            if w in self.dead:
                continue
            self.slots[w]["grad"] = self._grad_partial(w)
            self.ready_log.append((self.now, w, v))
            self.event(NodeReady(w, v, version=v))
        self._drain()

    def _drain(self):
        progress = True
        while progress:
            progress = False
            for n in sorted(self.q):
                if n in self.dead or not self.q[n]:
                    continue
                g = self.q[n][0]
                if self.entered.get(n) is not g:
                    self.entered[n] = g
                    progress = True
                    self._post(n, g)
                recvs = [s for s in g.steps if s.op == "recv"]
                if any((s.peer, n, s.tag) not in self.mail and s.peer not in self.dead for s in recvs):
                    continue
                self.q[n].popleft()
                progress = True
                self._run_grant(n, g)

    def _run_grant(self, n, g):
        events = []
        for s in g.steps:
            if s.op == "recv":
                msg = self.mail.pop((s.peer, n, s.tag), None)
                if msg is None:
                    events.append(TransferDone(s.peer, n, s.tag, ok=False))
                    continue
                if s.payload == "params":
                    k, _ = parse_chunk_slot(s.slot)
                    v = unpack(s.tag).iteration
                    self.flat[n][s.lo:s.hi] = msg
                    self.have[n].setdefault(v, set()).add((s.lo, s.hi))
                    events.append(ChunkArrived(n, params_key(k, v), s.lo, s.hi))
                    if sum(b - a for a, b in self.have[n][v]) == self.n_elems:
                        self.base[n] = v
                        self.computed_on.append((n, v, np.array_equal(self.flat[n], self.snap[v])))
                        self.slots[n] = {}  # the role clears its partials when new parameters are complete
                        self.seq += 1
                        heapq.heappush(self.timers, (self.now + self.compute[n], self.seq, n, v))
                else:
                    self.slots[n].setdefault(s.slot, {})[(s.lo, s.hi)] = msg
                events.append(TransferDone(s.peer, n, s.tag, ok=True))
            elif s.op == "combine":
                acc = self.slots[n].setdefault(s.dst, {}).setdefault((s.lo, s.hi), Partial(s.hi - s.lo, lo=s.lo))
                src = self.slots[n].get(s.src)
                part = src.slice(s.lo, s.hi) if isinstance(src, Partial) else (src or {}).get((s.lo, s.hi))
                if part is not None:
                    acc.merge(part)
            elif s.op == "apply":
                u = batch_of_slot(s.slot)
                acc = self.slots[n].get(s.slot, {}).get((s.lo, s.hi))
                mean = None
                if acc is not None and acc.contributors:
                    mean = acc.mean()
                    self.params[s.lo:s.hi] -= LR * mean
                self.applied.append((u, acc.contributors if acc is not None else 0, mean,
                                     set(self.c.contributions(u))))
                self.snap[u + 1] = self.params.copy()
                events.append(UpdateApplied(u))
        for ev in events:
            self.event(ev)

    def _post(self, n, g):
        for s in g.steps:
            if s.op not in ("send", "forward"):
                continue
            if s.payload == "params":
                if n.startswith("server:"):
                    v = int(s.slot.rsplit("@", 1)[1])  # the PS sends from its snapshot of that version
                    self.mail[(n, s.peer, s.tag)] = self.snap[v][s.lo:s.hi].copy()
                else:
                    self.mail[(n, s.peer, s.tag)] = self.flat[n][s.lo:s.hi].copy()
            else:
                self.mail[(n, s.peer, s.tag)] = self.slots[n][s.slot][(s.lo, s.hi)].copy()


def _check_invariants(run, quota, max_staleness=MAX_STALENESS, dead=()):
    live_members = []
    for i, (u, contributors, mean, members) in enumerate(run.applied):
        assert u == i, "updates are applied in order, one version each"
        if mean is not None:  # the exact mean of the contributors' gradients on their versions
            st = run.c.staleness[u]
            exp = np.mean([grad_of(int(w.split(":")[1]), u - st[w], run.n_elems) for w in members], axis=0)
            np.testing.assert_allclose(mean, exp, rtol=1e-6)
            assert contributors == len(members)
        live_members.append(members)
    for u, st in run.c.staleness.items():
        assert all(0 <= s <= max_staleness for s in st.values()), (u, st)
    assert all(ok for _, _, ok in run.computed_on), "every worker computed on exactly the PS's version"
    return live_members


def test_half_batch_quota():
    assert [half_batch(n) for n in (1, 2, 3, 5, 6, 16)] == [1, 1, 2, 3, 3, 8]
    with pytest.raises(ValueError, match="max_staleness"):
        AsyncHalfBatchController([(0, 10)], max_staleness=0)
    with pytest.raises(ValueError, match="quota"):
        AsyncHalfBatchController([(0, 10)], quota=0)
    assert parse_params_key(params_key(2, 17)) == (2, 17) and parse_params_key("params:2") is None
    assert batch_of_slot("acc@12") == 12 and batch_of_slot("in@3:worker:1:7") == 3 and batch_of_slot("acc") is None


def test_six_workers_each_update_reduces_the_first_three_ready():
    compute = {worker(r): 1.0 + 0.05 * r for r in range(6)}
    run = AsyncRun(n=6, compute=compute, updates=20)
    run.run()
    assert run.c.done() and len(run.applied) == 20
    members = _check_invariants(run, 3)
    assert all(len(m) == 3 for m in members)
    # the first update takes the three fastest; the others' gradients (staleness 1) make the second
    assert members[0] == {worker(0), worker(1), worker(2)} and members[1] == {worker(3), worker(4), worker(5)}
    assert set(run.c.staleness[0].values()) == {0} and set(run.c.staleness[1].values()) == {1}
    # after the first update only its members got new parameters; the others kept computing on version 0
    assert [v for w, v, _ in run.computed_on if w == worker(5)][:2] == [0, 2]


def test_a_slow_worker_is_waited_for_at_the_staleness_bound():
    compute = {worker(r): 1.0 for r in range(6)}
    compute[worker(5)] = 7.0  # ~7 updates per gradient of it without a bound
    for bound in (1, 2, 3):
        run = AsyncRun(n=6, compute=compute, updates=30, max_staleness=bound)
        run.run()
        assert run.c.done()
        _check_invariants(run, 3, bound)
        slow = [u for u, st in run.c.staleness.items() if worker(5) in st]
        assert len(slow) >= 2, "the slow worker is not starved"
        assert max(run.c.staleness[u][worker(5)] for u in slow) == bound
        assert run.c.counters["overdue_waits"] > 0


def test_killed_worker_mid_run_the_updates_go_on_with_the_rest():
    run = AsyncRun(n=5, compute={worker(r): 1.0 + 0.1 * r for r in range(5)}, updates=16)
    run.run(until=lambda r: len(r.applied) >= 4)
    run.kill(worker(1))
    run.run()
    assert run.c.done()
    members = _check_invariants(run, 3)
    assert all(worker(1) not in m for m in members[6:])
    assert all(len(m) == 2 for m in members[6:])  # ceil(4 / 2)


@pytest.mark.parametrize("n,kill_at,back_at", [(5, 4, 8), (3, 2, 3), (6, 0, 1), (2, 3, 6), (4, 5, 5)])
def test_a_worker_written_off_and_taken_back_contributes_again(n, kill_at, back_at):
    """Killed after ``kill_at`` updates, back after ``back_at``: it is live again at once (the quota counts it),
    gets the next version with that update's members, and its gradients are applied again -- exactly, within
    the staleness bound, on the PS's own version."""
    run = AsyncRun(n=n, compute={worker(r): 1.0 + 0.1 * r for r in range(n)}, updates=30)
    w = worker(1)
    run.run(until=lambda r: len(r.applied) >= kill_at)
    run.kill(w)
    run.run(until=lambda r: len(r.applied) >= back_at)
    k = len(run.applied)
    run.revive(w)
    assert w in run.c.live and run.c.quota() == half_batch(n) and run.c.counters["taken_back"] == 1
    run.run()
    assert run.c.done()
    members = _check_invariants(run, half_batch(n))
    assert any(w in m for m in members[k:]), members[k:]
    assert all(len(m) >= half_batch(n) for m in members[-4:])
    assert [v for x, v, _ in run.computed_on if x == w and v > k]  # it computed on a version after its return
    assert run.c.admit(w, now=run.now) == []  # already live: nothing happens
    assert run.c.counters["taken_back"] == 1


def test_a_returning_workers_gradient_waits_for_an_update_that_has_it_as_an_input():
    """The open update began without the returning worker: its first gradient is parked, then chained into the
    next update (never dropped while within the bound); a ready from before its return is stale."""
    run = AsyncRun(n=4, compute={worker(r): 1.0 for r in range(4)}, updates=20)
    w = worker(3)
    run.run(until=lambda r: len(r.applied) >= 2)
    run.kill(w)
    run.run(until=lambda r: len(r.applied) >= 4)
    u = run.c.applied
    # back after update u met its quota (u + 1 is open, begun without it) but before u is applied: version
    # u + 1 reaches it, and its gradient on that version finds no update with it as an input until u + 2 opens

    def back():
        assert run.c.open == u + 1 and w not in run.c.batches[u + 1].reduce.pending()
        run.compute[w] = 0.05  # fast: ready while update u + 1 still collects
        run.revive(w)
    run.before_applied[u] = back
    run.run(until=lambda r: w in r.c.parked)
    assert run.c.counters["parked"] == 1 and run.c.parked[w] == u + 1
    run.event(NodeReady(w, 0, version=0))  # a gradient from before it was written off
    assert run.c.counters["stale_ready"] == 1
    run.run()
    assert run.c.done()
    _check_invariants(run, 2)
    assert not run.c.parked and run.c.staleness[u + 2][w] == 1  # chained into u + 2, one update stale
    assert run.c.counters["parked_too_stale"] == 0


def test_killing_the_tail_of_an_open_chain_keeps_its_predecessors_contribution():
    run = AsyncRun(n=6, compute={worker(r): 1.0 + 0.01 * r for r in range(6)}, updates=10, latency_s=1e-9)  # 1D

    def two_chained(r):
        return len(r.applied) >= 2 and len(r.c.batches[r.c.open].reduce.ready_nodes) == 2
    run.run(until=two_chained)
    u = run.c.open
    first, tail = run.c.batches[u].reduce.ready_nodes
    assert run.c.batches[u].reduce.root.tail == tail
    run.kill(tail)
    run.run()
    assert run.c.done()
    members = _check_invariants(run, 3)
    # the dead tail's own gradient is lost, its predecessor's is not; the quota counts live gradients
    assert first in members[u] and tail not in members[u] and len(members[u]) == 3
    assert all(len(m) == 3 for m in members[u + 1:]) and all(tail not in m for m in members[u:])  # ceil(5 / 2)


def test_stale_or_unknown_ready_is_dropped_and_counted():
    run = AsyncRun(n=4, updates=3)
    run.event(NodeReady(worker(0), 0, version=7))  # not the version it was sent
    run.event(NodeReady("worker:99", 0, version=0))  # not a member
    assert run.c.counters["stale_ready"] == 2
    run.event(TransferDone(worker(0), worker(1), tag=pack(999, PHASE_PUSH), ok=True))  # no such update
    assert run.c.counters["unknown_tag"] == 1
    run.run()
    assert run.c.done()


def test_every_worker_dead_before_ready_closes_updates_without_hanging():
    run = AsyncRun(n=2, updates=2, compute={worker(0): 1.0, worker(1): 1.0})
    run.run(until=lambda r: bool(r.timers))
    run.kill(worker(0))
    run.kill(worker(1))
    run.run()
    # the open update closes with nothing and gets an Apply of nothing (versions never skip); no more follow
    assert [(u, c, m) for u, c, _, m in run.applied] == [(0, 0, set())]
    assert not run.c.live and run.c.quota() == 1 and not run.c.done()


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 8), seed=st.integers(0, 10_000), bound=st.integers(1, 3),
       kill=st.booleans(), back=st.booleans())
def test_property_any_speeds_any_death(n, seed, bound, kill, back):
    rnd = random.Random(seed)
    compute = {worker(r): rnd.uniform(0.2, 3.0) for r in range(n)}
    run = AsyncRun(n=n, compute=compute, updates=12, max_staleness=bound, seed=seed)
    if kill and n > 1:
        run.run(until=lambda r: len(r.applied) >= rnd.randrange(0, 4))
        victim = worker(rnd.randrange(n))
        run.kill(victim)
        if back:  # written off while alive: it joins again a few updates later
            run.run(until=lambda r: len(r.applied) >= rnd.randrange(0, 8))
            if not run.c.done():
                run.revive(victim)
    run.run()
    assert run.c.done()
    members = _check_invariants(run, half_batch(n), bound)
    for u, m in enumerate(members):  # at most the quota plus the overdue workers it waited for
        assert 1 <= len(m) <= n
    if not kill:
        assert all(len(m) >= half_batch(n) for m in members)


def test_the_async_ps_keeps_a_snapshot_while_its_own_grants_still_send_from_it():
    """Found under CI load (a worker paused and written off): the PS's own send of version 6, queued behind other
    sends after a receiver was re-routed to it, ran after version 6's broadcast was collected, and the job failed
    ("no buffer is bound to slot 'params:server:0#0@6'").  The role now counts its own grants per version they send
    from, and a snapshot with a grant queued or running is kept until it ran."""
    from ltp_ps.hoplite_roles import _AsyncServerRole
    from ltp_ps.schedules.program import Grant, Recv, Send

    role = object.__new__(_AsyncServerRole)
    role._snapshot_users, role._recv_slots, role.driver_me = {}, {}, server(0)
    g6 = Grant(server(0), (Send(worker(1), "params:server:0#0@6", 0, 10, pack(6, 1), "reliable", "params"),
                           Send(worker(2), "params:server:0#1@6", 10, 20, pack(6, 1), "reliable", "params")))
    g7 = Grant(server(0), (Send(worker(1), "params:server:0#0@7", 0, 10, pack(7, 1), "reliable", "params"),))
    other = Grant(worker(1), (Recv(server(0), "params:server:0#0", 0, 10, pack(6, 1), "reliable", "params"),))
    role._on_grants([g6, g6, g7, other])
    assert role._snapshot_users == {6: 2, 7: 1}
    role.local_grant_done(g6)
    role.local_grant_done(g7)
    assert role._snapshot_users == {6: 1}
    role.local_grant_done(g6)
    assert role._snapshot_users == {}
