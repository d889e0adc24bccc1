"""Hoplite: directory, receiver-driven broadcast (Fig 4), reduce chains (a,d,c,b; 2D), faults, controller."""

import collections
import random

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from ltp_ps.schedules.fluid import FluidNetwork, simulate
from ltp_ps.schedules.hoplite import (CHUNK_BYTES, MAX_REDUCE_PIECES, Broadcast, HopliteController, ObjectDirectory,
                                      ReduceChain, broadcast_flows, params_slot, parse_chunk_slot, partition, reduce_flows, t_1d,
                                      t_2d, use_2d)
from ltp_ps.schedules.partial import Partial, assemble
from ltp_ps.schedules.program import ChunkArrived, NodeFailed, NodeReady, TransferDone, server, worker

MB = 1e6
GBIT = 1e9


# --------------------------------------------------------------------------- directory + Fig 4

def test_directory_prefers_complete_then_earliest_and_lends_one_at_a_time():
    d = ObjectDirectory()
    d.create("x", 10)
    d.publish("x", "p1", complete=False)
    d.publish("x", "c1", complete=True)
    d.publish("x", "c2", complete=True)
    assert d.query("x", "r1") == "c1"
    assert d.query("x", "r2") == "c2"
    assert d.query("x", "r3") == "p1"
    assert d.query("x", "r4") is None and d.waiting("x") == ["r4"]
    d.put_back("x", "c1")
    assert d.locations("x") == {"c1": True}
    with pytest.raises(KeyError, match="create it first"):
        d.query("nope", "r")


def test_fig4_broadcast_sequence():
    """§4.3 Fig 4: R1 fetches from S; R2 from the partial R1 (S is busy); after R1 completes the directory
    holds S (complete) and R2 (partial); R3 then chooses S."""
    b = Broadcast("x", 3 * CHUNK_BYTES, "S")
    assert b.n_chunks == 3
    (f1,) = b.get("R1", now=0.0)
    assert (f1.src, f1.dst, f1.chunks) == ("S", "R1", (0, 1, 2))
    assert b.dir.locations("x") == {"R1": False}  # S is serving, R1 is a partial location
    (f2,) = b.get("R2", now=0.1)
    assert (f2.src, f2.dst) == ("R1", "R2")
    assert b.dir.locations("x") == {"R2": False}
    for i in range(3):
        b.on_chunk("R1", i, now=0.2)
    b.on_done("S", "R1", ok=True, now=0.2)
    assert b.complete("R1")
    assert b.dir.locations("x") == {"R2": False, "S": True}  # R1 still sends to R2
    (f3,) = b.get("R3", now=0.3)
    assert (f3.src, f3.dst) == ("S", "R3")
    assert b.log == [("fetch", "S", "R1", "complete"), ("fetch", "R1", "R2", "partial"),
                     ("fetch", "S", "R3", "complete")]


def test_stalled_sender_receiver_refetches_only_missing_chunks():
    b = Broadcast("x", 8 * CHUNK_BYTES, "S", stall_timeout_s=0.5)
    b.get("R1", now=0.0)
    for i in range(8):
        b.on_chunk("R1", i, now=0.01)
    b.on_done("S", "R1", ok=True, now=0.01)
    (f,) = b.get("R2", now=0.02)
    assert f.src == "R1"  # both complete: the earliest published location (R1 published when it started)
    (g,) = b.get("R3", now=0.02)
    assert g.src == "S"
    for i in range(3):
        b.on_chunk("R2", i, now=0.1)
    assert b.next_deadline() == pytest.approx(0.52)
    assert b.on_timer(now=0.3) == []
    # R1 stalls: at the deadline R2 gives up on it and re-queries; S serves R3, so R2 streams the rest from
    # R3's partial copy -- only the five chunks it lacks
    b.on_chunk("R3", 0, now=0.55)
    out = b.on_timer(now=0.61)
    assert ("stalled", "R1", "R2") in b.log
    assert [(x.src, x.dst, x.chunks) for x in out] == [("R3", "R2", (3, 4, 5, 6, 7))]
    assert "R1" not in b.dir.locations("x") and "R1" in b.suspect
    # the stalled node is never handed out again
    for i in range(8):
        b.on_chunk("R3", i, now=0.7)
    b.on_done("S", "R3", ok=True, now=0.7)
    (h,) = b.get("R4", now=0.8)
    assert h.src == "S"


def test_a_receiver_never_fetches_from_its_own_downstream_copy():
    """R2 streams from R1, R3 from R2.  R1 stalls; the only free location is R3's partial copy, which holds
    nothing R2 did not pass it: R2 must wait for a real source (a cycle R2 <- R3 <- R2 held nothing until the
    stall bound, and a round with a dead relay failed on it), and gets S once S is free."""
    b = Broadcast("x", 4 * CHUNK_BYTES, "S", stall_timeout_s=0.5)
    assert [f.src for f in b.get("R0", now=0.0)] == ["S"]
    assert [f.src for f in b.get("R1", now=0.0)] == ["R0"]
    assert [f.src for f in b.get("R2", now=0.0)] == ["R1"]
    assert [f.src for f in b.get("R3", now=0.0)] == ["R2"]
    b.on_chunk("R2", 0, now=0.3)
    b.on_chunk("R3", 0, now=0.4)
    for n in ("R0", "R1"):
        b.on_chunk(n, 0, now=0.55)
        b.on_chunk(n, 1, now=0.55)  # R1 holds chunk 1, which it never passes on to R2
    assert b.on_timer(now=0.81) == []  # R2 gave up on R1 and waits: R3 is downstream of it
    assert ("stalled", "R1", "R2") in b.log and "R2" in b.dir.waiting("x")
    assert all(f.src != "R3" for f in b.active.values() if f.dst == "R2")
    for i in range(4):
        b.on_chunk("R0", i, now=0.9)
    out = b.on_done("S", "R0", ok=True, now=0.9)
    assert [(f.src, f.dst, f.chunks) for f in out] == [("S", "R2", (1, 2, 3))]


def test_a_silently_dead_receiver_never_costs_the_broadcast_its_source():
    """R1 dies (no word of it yet) while it fetches from S; R2 streams from R1, R3 from R2.  A fetch from the
    source that stalls is the receiver's doing (the source is the PS running this controller): R1 is set
    aside and S serves the others.  R3's source R2 holds nothing R3 lacks (it starves behind R1), so R2 is not
    blamed.  Before: S was suspected at the first stall, never handed out again, and R2 and R3 waited until
    the workers' pull timeout (a lab run with a killed worker stalled 80 s)."""
    b = Broadcast("x", 4 * CHUNK_BYTES, "S", stall_timeout_s=0.5)
    assert [f.src for f in b.get("R1", now=0.0)] == ["S"]
    assert [f.src for f in b.get("R2", now=0.0)] == ["R1"]
    assert [f.src for f in b.get("R3", now=0.0)] == ["R2"]
    out = b.on_timer(now=0.6)
    assert "S" not in b.suspect and "R2" not in b.suspect and "R1" in b.suspect
    assert ("receiver stalled", "S", "R1") in b.log
    assert [(f.src, f.dst) for f in out] == [("S", "R2")]
    t = 0.6
    for i in range(4):  # R2 streams from S, R3 from R2 again once R2 holds what it lacks
        t += 0.1
        b.on_chunk("R2", i, now=t)
        out += b.on_timer(now=t)
    b.on_done("S", "R2", ok=True, now=t)
    for i in range(4):
        b.on_chunk("R3", i, now=t)
    assert b.complete("R2") and b.complete("R3") and "R2" not in b.suspect
    # R1 is tried again after the hold-off; it stays silent; then it is reported dead: the broadcast is done
    t += 1.0
    later = b.on_timer(now=t)
    assert [f.dst for f in later] == ["R1"] and b.complete(later[0].src)  # from a complete copy
    b.on_failed("R1", now=t + 0.1)
    for f in [x for x in b.active.values()]:
        b.on_done(f.src, f.dst, ok=True, now=t + 0.2)
    assert b.done() and "S" not in b.suspect


def test_a_set_aside_receiver_that_shows_life_fetches_again_at_once():
    """A receiver set aside after a stalled fetch from the source (a paused process) that reports a chunk again
    (the source's sends reached it after all) fetches what it still lacks at once."""
    b = Broadcast("x", 4 * CHUNK_BYTES, "S", stall_timeout_s=0.5)
    b.get("R1", now=0.0)
    assert b.on_timer(now=0.6) == [] and b.active == {}
    out = b.on_chunk("R1", 0, now=0.7)
    assert [(f.src, f.dst, f.chunks) for f in out] == [("S", "R1", (1, 2, 3))]


def test_dead_receiver_gives_its_sender_back():
    b = Broadcast("x", 2 * CHUNK_BYTES, "S")
    b.get("R1", now=0)
    assert b.get("R2", now=0)[0].src == "R1"
    out = b.on_failed("R1", now=0.1)  # R2's partial source died: R2 re-queries and gets S back
    assert [(f.src, f.dst) for f in out] == [("S", "R2")]


# --------------------------------------------------------------------------- reduce chains

def test_paper_chain_adcb():
    """§4.3: D reduces a, b, c, d; arrivals a, d, c, b give A->C, C->B, B->D."""
    rc = ReduceChain(["A", "B", "C", "D"], "D", receiver_input=True, two_d=False)
    assert rc.ready("A") == []
    assert rc.ready("D") == []
    (h1,) = rc.ready("C")
    assert (h1.src, h1.dst) == ("A", "C")
    rc.hop_done("A", "C", ok=True)
    (h2,) = rc.ready("B")
    assert (h2.src, h2.dst) == ("C", "B")
    (h3,) = rc.hop_done("C", "B", ok=True)
    assert (h3.src, h3.dst, h3.final) == ("B", "D", True)
    rc.hop_done("B", "D", ok=True)
    assert rc.closed and rc.contributions() == {"A", "B", "C", "D"}
    assert [(h.src, h.dst) for h in rc.hops] == [("A", "C"), ("C", "B"), ("B", "D")]


def test_hop_waits_for_the_senders_incoming_hop():
    rc = ReduceChain(["A", "B", "C"], "R", two_d=False)
    rc.ready("A")
    (h,) = rc.ready("B")
    assert (h.src, h.dst) == ("A", "B")
    assert rc.ready("C") == []  # B is still receiving from A: B -> C waits
    (h2,) = rc.hop_done("A", "B", ok=True)
    assert (h2.src, h2.dst) == ("B", "C")


@pytest.mark.parametrize("n,two", [(2, False), (6, False), (7, True), (16, True)])
def test_section_6_1_one_or_two_dimensions(n, two):
    # 1 MB objects, 10 Gbit/s, 125 us: 2D when reducing more than 6 objects
    assert use_2d(n, 1 * MB, 10 * GBIT, 125e-6) is two
    rc = ReduceChain([f"n{i}" for i in range(n)], "R", size_bytes=1 * MB, bandwidth_bps=10 * GBIT,
                     latency_s=125e-6, rng=random.Random(1))
    assert rc.dimensions == (2 if two else 1)


def test_appendix_a_condition_is_where_1d_and_2d_cross():
    S, B, L = 1 * MB, 10 * GBIT, 125e-6
    for n in range(2, 64):
        if (np.sqrt(n) - 1) ** 2 > S * 8 / (B * L) * 1.3:
            assert t_2d(n, S, B, L) < t_1d(n, S, B, L)
        if n * B * L < S * 8 * 0.7:
            assert t_1d(n, S, B, L) <= t_2d(n, S, B, L)


def test_partition_sqrt_subsets_seeded():
    nodes = [f"n{i}" for i in range(16)]
    p1 = partition(nodes, random.Random(3))
    assert len(p1) == 4 and sorted(x for s in p1 for x in s) == sorted(nodes)
    assert p1 == partition(nodes, random.Random(3))
    assert p1 != partition(nodes, random.Random(4))


def test_two_d_reduce_chains_subset_results():
    n = 16
    nodes = [f"n{i}" for i in range(n)]
    rc = ReduceChain(nodes, "PS", size_bytes=1 * MB, bandwidth_bps=10 * GBIT, latency_s=125e-6,
                     rng=random.Random(0))
    subsets = rc.subsets()
    assert len(subsets) == 4 and all(len(s) == 4 for s in subsets)
    pending = collections.deque()
    for x in nodes:
        pending.extend(rc.ready(x))
    while pending:
        h = pending.popleft()
        pending.extend(rc.hop_done(h.src, h.dst, ok=True))
    assert rc.closed and rc.contributions() == set(nodes)
    # chain length: 3 hops inside each subset + 3 between subset results + 1 to the PS = 2 sqrt(n)
    depth = {x: 0 for x in nodes}
    for h in rc.hops:
        depth[h.dst] = max(depth.get(h.dst, 0), depth[h.src] + 1)
    assert depth["PS"] == 2 * 4 - 1
    assert len(rc.hops) == n


def test_two_d_recurses_until_chains_are_short():
    # tiny objects: m B L > S even for m = 4 -> subsets split again (a 3-level reduce)
    rc = ReduceChain([f"n{i}" for i in range(64)], "PS", size_bytes=1000, bandwidth_bps=10 * GBIT,
                     latency_s=125e-6, rng=random.Random(0))
    assert rc.dimensions >= 3


def test_dead_tail_gives_the_chain_back_to_its_predecessor():
    rc = ReduceChain(["A", "B", "C", "D"], "PS", two_d=False)
    rc.ready("A")
    (h,) = rc.ready("B")
    rc.hop_done("A", "B", ok=True)
    assert rc.failed("B") == []  # B held a+b; A still holds a and becomes the tail again
    (h2,) = rc.ready("C")
    assert (h2.src, h2.dst) == ("A", "C")
    rc.hop_done("A", "C", ok=True)
    (h3,) = rc.ready("D")
    (h4,) = rc.hop_done("C", "D", ok=True)
    assert h4.final and h4.src == "D"
    rc.hop_done("D", "PS", ok=True)
    assert rc.closed and rc.contributions() == {"A", "C", "D"}


def test_dead_sender_mid_hop_predecessor_resends():
    rc = ReduceChain(["A", "B", "C"], "PS", two_d=False)
    rc.ready("A")
    rc.ready("B")
    rc.hop_done("A", "B", ok=True)
    (h,) = rc.ready("C")
    assert (h.src, h.dst) == ("B", "C")
    (r,) = rc.failed("B")  # B dies while sending to C: A re-sends a to C
    assert (r.src, r.dst) == ("A", "C")
    (f,) = rc.hop_done("A", "C", ok=True)
    assert f.final and f.src == "C"
    rc.hop_done("C", "PS", ok=True)
    assert rc.contributions() == {"A", "C"}


def test_worker_dead_before_ready_is_missed_and_the_round_closes():
    rc = ReduceChain(["A", "B", "C"], "PS", two_d=False)
    rc.ready("A")
    (h,) = rc.ready("C")
    rc.hop_done("A", "C", ok=True)
    (f,) = rc.failed("B")
    assert f.final and f.src == "C"
    rc.hop_done("C", "PS", ok=True)
    assert rc.closed and rc.missed == {"B"} and rc.lost() == {"B"}


# --------------------------------------------------------------------------- the controller, in memory

class MemoryRun:
    """Drives a HopliteController: nodes run their grants in order (one stage each); a send posts its
    data at once, a receive completes when the data is there (TransferDone ok) or its sender is dead
    (TransferDone not ok); params receives report ChunkArrived.  A killed node drops everything it has
    not delivered."""

    def __init__(self, ctrl, workers, shards, grads, n_elems, init):
        self.c = ctrl
        self.workers = [worker(r) for r in workers]
        self.shards = shards
        self.n_elems = n_elems
        self.q = collections.defaultdict(collections.deque)
        self.entered = {}
        self.mail = {}
        self.dead = set()
        self.slots = {n: {} for n in self.workers + [server(k) for k in range(len(shards))]}
        for r in workers:
            self.slots[worker(r)]["grad"] = Partial.of_gradient(grads[r])
            self.slots[worker(r)]["acc"] = {}
        for k in range(len(shards)):
            self.slots[server(k)]["params"] = init.copy()
            self.slots[server(k)]["acc"] = {}
        self.applied = {}
        self.counts = {}
        self.max_parallel_sends = 0
        self.recv_ok = {}  # (node, hop receive slot) -> every range arrived
        self.combined = set()  # (node, hop receive slot) combined into its running sum
        self.sent = collections.defaultdict(set)  # node -> tags its continuations sent
        self.continuations = self.dropped_continuations = 0

    def feed(self, grants):
        for g in grants:
            self.q[g.node].append(g)

    def event(self, ev):
        self.feed(self.c.on_event(ev, now=0.0))

    def kill(self, node):
        self.dead.add(node)
        self.q.pop(node, None)
        for key in [k for k in self.mail if k[0] == node]:
            del self.mail[key]
        self.event(NodeFailed(node))

    def run(self, until=None):
        progress = True
        while progress:
            progress = False
            for n in sorted(self.q):
                if n in self.dead or not self.q[n]:
                    continue
                g = self.q[n][0]
                if g.after is not None:  # a continuation: as the worker role runs it (Grant.after)
                    self.q[n].popleft()
                    progress = True
                    tags = {s.tag for s in g.steps if s.op == "send"}
                    if not self.recv_ok.get((n, g.after)) or tags <= self.sent[n]:
                        self.dropped_continuations += 1
                        continue
                    for s in g.steps:
                        if s.op == "combine" and (n, s.src) not in self.combined:
                            self._combine(n, s)
                    self.combined.add((n, g.after))
                    self.sent[n] |= tags
                    self.continuations += 1
                    self._post(n, g)
                    continue
                if self.entered.get(n) is not g:
                    self.entered[n] = g
                    progress = True
                    self._post(n, g)
                recvs = [s for s in g.steps if s.op == "recv"]
                if any((s.peer, n, s.tag) not in self.mail and s.peer not in self.dead for s in recvs):
                    continue
                self.q[n].popleft()
                progress = True
                events = []
                for s in g.steps:
                    if s.op == "recv":
                        msg = self.mail.pop((s.peer, n, s.tag), None)
                        if msg is None:
                            events.append(TransferDone(s.peer, n, s.tag, ok=False))
                            continue
                        if s.payload == "params":
                            k, _ = parse_chunk_slot(s.slot)
                            held = self.slots[n].setdefault(params_slot(k), np.zeros(self.n_elems, np.float32))
                            held[s.lo:s.hi] = msg
                            events.append(ChunkArrived(n, f"params:{k}", s.lo, s.hi))
                        else:
                            self.slots[n].setdefault(s.slot, {})[(s.lo, s.hi)] = msg
                        events.append(TransferDone(s.peer, n, s.tag, ok=True))
                    elif s.op == "combine":
                        self._combine(n, s)
                    elif s.op == "apply":  # one partial, or the pieces' (a reduce in pieces)
                        accs = self.slots[n]["acc"]
                        acc = accs.get((s.lo, s.hi)) or assemble(
                            {r: q for r, q in accs.items() if s.lo <= r[0] and r[1] <= s.hi}, s.lo, s.hi - s.lo)
                        self.slots[n]["params"][s.lo:s.hi] = acc.mean()
                        self.applied[(s.lo, s.hi)] = acc.contributors
                        self.counts[(s.lo, s.hi)] = acc.counts()
                for s in recvs:
                    if s.payload == "partial":
                        self.recv_ok[(n, s.slot)] = all(e.ok for e in events if isinstance(e, TransferDone))
                for ev in events:
                    self.event(ev)
                if until is not None and until(self):
                    return

    def _combine(self, n, s):
        """As the executor: into the exact range, else a slice of a cover."""
        acc = self._acc(n, s.lo, s.hi) or Partial(s.hi - s.lo, lo=s.lo)
        src = self.slots[n].get(s.src)
        part = src.slice(s.lo, s.hi) if isinstance(src, Partial) else (src or {}).get((s.lo, s.hi))
        if part is not None:
            acc.merge(part)
        self.slots[n]["acc"][(s.lo, s.hi)] = acc

    def _post(self, n, g):
        sends = [s for s in g.steps if s.op in ("send", "forward")]
        self.max_parallel_sends = max(self.max_parallel_sends, len({s.peer for s in sends if s.payload == "partial" and not s.peer.startswith("server:")}))
        for s in sends:
            if s.payload == "params":  # the role binds chunk slots to views of its parameters
                k, _ = parse_chunk_slot(s.slot)
                buf = self.slots[n]["params"] if n.startswith("server:") else self.slots[n][params_slot(k)]
                self.mail[(n, s.peer, s.tag)] = buf[s.lo:s.hi].copy()
            else:
                self.mail[(n, s.peer, s.tag)] = self._acc(n, s.lo, s.hi).copy()

    def _acc(self, n, lo, hi):
        accs = self.slots[n]["acc"]
        if (lo, hi) in accs:
            return accs[(lo, hi)].copy()
        cover = next((q for (a, b), q in accs.items() if a <= lo and hi <= b), None)
        return None if cover is None else cover.slice(lo, hi)


def _setup(n=6, K=2, n_elems=3000, seed=0, chunk_elems=256, latency_s=125e-6, piece_bytes=None, cut_through=False):
    shards = [(round(n_elems * k / K), round(n_elems * (k + 1) / K)) for k in range(K)]
    rng = np.random.default_rng(seed)
    grads = {r: rng.standard_normal(n_elems).astype(np.float32) for r in range(n)}
    init = np.arange(n_elems, dtype=np.float32)
    ctrl = HopliteController(shards, chunk_bytes=chunk_elems * 4, rng=random.Random(seed), latency_s=latency_s,
                             reduce_piece_bytes=piece_bytes, cut_through_hops=cut_through)
    run = MemoryRun(ctrl, range(n), shards, grads, n_elems, init)
    return ctrl, run, grads, init, shards


# one chain over the shards (store-and-forward hops), ~250-element pieces (cut-through reduce), and pieces whose
# hops are granted as continuations of the sender's incoming receive (no round trip per hop)
PIECES = [pytest.param((None, False), id="whole"), pytest.param((1000, False), id="pieces"),
          pytest.param((1000, True), id="continuations")]


@pytest.mark.parametrize("pieces", PIECES)
def test_controller_round_broadcasts_then_reduces_to_the_mean(pieces):
    piece_bytes, cut = pieces
    ctrl, run, grads, init, shards = _setup(piece_bytes=piece_bytes, cut_through=cut)
    assert len(ctrl.reduces or [None]) >= 1
    run.feed(ctrl.start(0, [worker(r) for r in range(6)], now=0.0))
    run.run()
    for r in range(6):  # every worker got every shard's parameters through the receiver-driven broadcast
        for k, (lo, hi) in enumerate(shards):
            np.testing.assert_array_equal(run.slots[worker(r)][params_slot(k)][lo:hi], init[lo:hi])
    for r in (3, 0, 5, 1, 4, 2):
        run.event(NodeReady(worker(r), 0))
        run.run()
    assert ctrl.done() and ctrl.contributions() == {worker(r) for r in range(6)}
    want = np.mean([grads[r] for r in range(6)], axis=0)
    for k, (lo, hi) in enumerate(shards):
        np.testing.assert_allclose(run.slots[server(k)]["params"][lo:hi], want[lo:hi], rtol=1e-5, atol=1e-6)
    assert run.max_parallel_sends == 1  # one reduce send to one chain peer at a time per node
    if piece_bytes:  # 3000 elements in 2 shards of 1500 = 6000 bytes: 6 pieces each, every chain the same order
        assert len(ctrl.reduces) == 12 and len({tuple(h.dst for h in rc.hops) for rc in ctrl.reduces}) == 1
        assert all(len(r) == 1 for r in ctrl._chain_ranges)


def test_pieces_tile_each_shard_and_are_bounded():
    c = HopliteController([(0, 1000), (1000, 1001)], reduce_piece_bytes=256)  # 64 elements per piece
    c.start(0, [worker(0), worker(1)], now=0.0)
    ranges = [r[0] for r in c._chain_ranges]
    assert ranges[0] == (0, 0, 62) and ranges[-2] == (0, 937, 1000) and ranges[-1] == (1, 1000, 1001)
    assert len(ranges) == 17  # ceil(1000 / 64) = 16 pieces of shard 0, the 1-element shard 1 whole
    big = HopliteController([(0, 10 ** 7)], reduce_piece_bytes=4)
    big.start(0, [worker(0)], now=0.0)
    assert len(big.reduces) == MAX_REDUCE_PIECES
    whole = HopliteController([(0, 10), (10, 20)])  # no pieces: one chain carries both shards
    whole.start(0, [worker(0)], now=0.0)
    assert whole._chain_ranges == [((0, 0, 10), (1, 10, 20))]


def test_a_node_dying_between_pieces_keeps_each_pieces_mean_exact():
    """Pieces pass a node at different times: a node killed after piece 0 went on but before the other
    pieces did is in piece 0's sum only; every element's mean is over the contributions of its piece."""
    n = 4
    ctrl, run, grads, init, shards = _setup(n=n, K=1, n_elems=1000, seed=3, latency_s=1e-9, piece_bytes=1000)
    ctrl.auto_get = False
    run.feed(ctrl.start(0, [worker(r) for r in range(n)], now=0.0))
    for r in (0, 1, 2):
        run.event(NodeReady(worker(r), 0))
    first, last = ctrl.reduces[0], ctrl.reduces[-1]
    run.run(until=lambda _: worker(1) in first.contents.get(worker(2), ()))
    assert worker(1) not in last.contents.get(worker(2), ())  # the later pieces have not passed it yet
    run.kill(worker(1))
    run.run()
    run.event(NodeReady(worker(3), 0))
    run.run()
    assert ctrl.done()
    lo, hi = shards[0]
    got = run.slots[server(0)]["params"][lo:hi]
    saw_both = set()
    for rc, ((_, a, b),) in zip(ctrl.reduces, ctrl._chain_ranges):
        members = sorted(int(x.split(":")[1]) for x in rc.contributions())
        saw_both.add(1 in members)
        assert set(members) >= {0, 2, 3}
        want = np.mean([grads[r][a:b] for r in members], axis=0)
        np.testing.assert_allclose(got[a:b], want, rtol=1e-5, atol=1e-6)
        assert (run.counts[(lo, hi)][a - lo:b - lo] == len(members)).all()
    assert saw_both == {True, False}
    assert ctrl.contributions() == {worker(r) for r in range(n)}  # in at least one piece


@pytest.mark.parametrize("pieces", PIECES)
def test_killing_a_chain_node_mid_round_closes_with_n_minus_1(pieces):
    n = 6
    ctrl, run, grads, init, shards = _setup(n=n, seed=4, latency_s=1e-9, piece_bytes=pieces[0],
                                            cut_through=pieces[1])  # 1D
    ctrl.auto_get = False
    run.feed(ctrl.start(0, [worker(r) for r in range(n)], now=0.0))
    order = [2, 5, 0, 3, 1, 4]
    for r in order[:3]:
        run.event(NodeReady(worker(r), 0))
        run.run()
    # worker 0 is now the chain's tail, holding g2 + g5 + g0: kill it
    assert ctrl.reduce.dimensions == 1 and ctrl.reduce.root.tail == worker(0)
    run.kill(worker(0))
    for r in order[3:]:
        run.event(NodeReady(worker(r), 0))
        run.run()
    assert ctrl.done()
    alive = [r for r in range(n) if r != 0]
    assert ctrl.contributions() == {worker(r) for r in alive}
    want = np.mean([grads[r] for r in alive], axis=0)
    for k, (lo, hi) in enumerate(shards):
        assert run.applied[(lo, hi)] == n - 1
        np.testing.assert_allclose(run.slots[server(k)]["params"][lo:hi], want[lo:hi], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("cut", [False, True])
def test_a_hop_that_ends_after_its_senders_death_was_handled_is_not_combined(cut):
    """A -> B -> C.  B dies right after its hop to C ended, and the PS hears of the death first: A re-sends its
    sum to C.  B's late TransferDone must not add B's copy too (A's gradient would count twice)."""
    ctrl = HopliteController([(0, 100)], latency_s=1e-9, reduce_piece_bytes=200 if cut else None,
                             cut_through_hops=cut, auto_get=False)
    a, b, c = worker(0), worker(1), worker(2)
    ctrl.start(0, [a, b, c], now=0.0)
    grants = [g for n in (a, b, c) for g in ctrl.on_event(NodeReady(n, 0), now=0.0)]
    rc = ctrl.reduces[0]
    ab = rc.in_flight[(a, b)]
    hop_tags = {s.tag: g.node for g in grants for s in g.steps if s.op == "recv"}
    a_to_b = [t for t, node in hop_tags.items() if node == b]
    for t in a_to_b:  # A's hop into B completes
        grants += ctrl.on_event(TransferDone(a, b, t, ok=True), now=0.1)
    b_to_c = [s.tag for g in grants if g.node == c for s in g.steps if s.op == "recv" and s.peer == b]
    assert b_to_c and (a, b) not in rc.in_flight and ab.seq
    redo = ctrl.on_event(NodeFailed(b), now=0.2)  # B died after sending: its hop to C is replaced by A -> C
    assert (a, c) in rc.in_flight
    late = []
    for t in b_to_c:
        late += ctrl.on_event(TransferDone(b, c, t, ok=True), now=0.3)
    assert not any(st.op == "combine" for g in late for st in g.steps), late
    assert ctrl.superseded == len(ctrl.reduces) and redo


@pytest.mark.parametrize("pieces", PIECES)
def test_killing_a_sender_in_flight_reroutes_from_its_predecessor(pieces):
    n = 5
    ctrl, run, grads, init, shards = _setup(n=n, seed=5, latency_s=1e-9, piece_bytes=pieces[0], cut_through=pieces[1])
    ctrl.auto_get = False
    run.feed(ctrl.start(0, [worker(r) for r in range(n)], now=0.0))
    for r in (0, 1):
        run.event(NodeReady(worker(r), 0))
        run.run()
    run.event(NodeReady(worker(2), 0))  # worker 1 is told to send to worker 2
    # worker 1 dies before anything arrives at worker 2
    run.kill(worker(1))
    run.run()
    for r in (3, 4):
        run.event(NodeReady(worker(r), 0))
        run.run()
    assert ctrl.done() and ctrl.contributions() == {worker(r) for r in (0, 2, 3, 4)}
    want = np.mean([grads[r] for r in (0, 2, 3, 4)], axis=0)
    lo, hi = shards[0]
    np.testing.assert_allclose(run.slots[server(0)]["params"][lo:hi], want[lo:hi], rtol=1e-5, atol=1e-6)


def test_a_piece_that_misses_an_input_on_every_element_is_counted_short():
    """``short_pieces`` (the PS writes it in every hoplite row) counts pieces whose every element lacks the input
    of a live worker, from the PS's per-element counts: the check the killed-worker launch test makes beside
    ``delivered``.  Packets cut from a piece (Early Close) are per-element loss, and a worker that died
    mid-round, its input in some pieces only, loses just its own input: neither is a short piece."""
    ctrl, run, grads, init, shards = _setup(n=3, K=2, n_elems=2000, latency_s=1e-9, piece_bytes=1000)
    run.feed(ctrl.start(0, [worker(r) for r in range(3)], now=0.0))
    for r in range(3):
        run.event(NodeReady(worker(r), 0))
        run.run()
    assert ctrl.done() and ctrl.contributions() == {worker(r) for r in range(3)}
    pieces = [(lo, hi) for ranges in ctrl._chain_ranges for k, lo, hi in ranges if k == 1]
    assert len(pieces) >= 3
    counts = np.full(1000, 3)
    assert ctrl.short_pieces(counts, 1, 1000) == 0
    lo, hi = pieces[1]
    counts[lo - 1000:hi - 1000] = 2  # one input missing from one whole piece
    assert ctrl.short_pieces(counts, 1, 1000) == 1
    lo, hi = pieces[2]
    counts[lo - 1000:hi - 1000] = 0  # a piece whose final hop never arrived
    assert ctrl.short_pieces(counts, 1, 1000) == 2
    counts[:] = 3
    lo, hi = pieces[0]
    counts[lo - 1000:lo - 1000 + 40] = 1  # packets cut from a piece: its other elements have every input
    assert ctrl.short_pieces(counts, 1, 1000) == 0
    assert ctrl.short_pieces(np.full(1000, 1), 1, 1000) == 0  # one input everywhere (the others died) is not short
    assert ctrl.short_pieces(np.zeros(0, dtype=np.int64), 0, 0) == 0
    counts[:] = 3
    lo, hi = pieces[1]
    counts[lo - 1000:hi - 1000] = 2
    for rc in ctrl.reduces:  # worker 2 died mid-round after some pieces carried its input: only its own is lost
        rc.dead.add(worker(2))
    assert ctrl.short_pieces(counts, 1, 1000) == 0
    counts[lo - 1000:hi - 1000] = 1  # ... but a piece missing a live worker's input too is short
    assert ctrl.short_pieces(counts, 1, 1000) == 1


def test_a_late_report_of_a_hop_into_a_relay_is_carried_to_the_sums_the_relay_already_reached():
    """Cut-through: B combines A's hop and its continuation sends on to the PS at once, but the reports come from
    different nodes and the PS's may arrive first.  The bookkeeping of the receiver's inputs must still end with
    A's (before, ``contributions`` lacked it in 2 rounds of 8 in one 3-worker loopback run)."""
    a, b = worker(0), worker(1)
    rc = ReduceChain([a, b], "PS", latency_s=1e-9, two_d=False)
    hops = rc.ready(a) + rc.ready(b)
    assert [(h.src, h.dst) for h in hops] == [(a, b)]
    (final,) = rc.ready("PS") or [h for h in rc.deferred.get(b, [])]
    assert (final.src, final.dst, final.final) == (b, "PS", True)
    rc.hop_done(b, "PS", ok=True)  # the continuation's report first
    assert rc.closed and rc.contributions() == {b}
    rc.hop_done(a, b, ok=True)  # then the relay's own
    assert rc.contributions() == {a, b} and rc.contents[b] == {a, b}


def _all_ready_at_once(cut, kill=None, n=6):
    ctrl, run, grads, init, shards = _setup(n=n, K=1, n_elems=1000, seed=7, latency_s=1e-9, piece_bytes=1000,
                                            cut_through=cut)  # 1D, 4 pieces
    ctrl.auto_get = False
    run.feed(ctrl.start(0, [worker(r) for r in range(n)], now=0.0))
    combines = 0
    for r in range(n):  # every gradient ready before any hop ran: each hop's sender is still receiving
        grants = ctrl.on_event(NodeReady(worker(r), 0), now=0.0)
        combines += sum(g.reason == "hoplite combine" for g in grants)
        run.feed(grants)
    if kill is not None:
        run.kill(worker(kill))
    real_event = run.event

    def counting(ev):
        nonlocal combines
        grants = ctrl.on_event(ev, now=0.0)
        combines += sum(g.reason == "hoplite combine" for g in grants)
        run.feed(grants)
    run.event = counting
    run.run()
    run.event = real_event
    assert ctrl.done()
    alive = [r for r in range(n) if r != kill]
    want = np.mean([grads[r] for r in alive], axis=0)
    lo, hi = shards[0]
    np.testing.assert_allclose(run.slots[server(0)]["params"][lo:hi], want[lo:hi], rtol=1e-5, atol=1e-6)
    assert run.applied[(lo, hi)] == len(alive) and ctrl.contributions() == {worker(r) for r in alive}
    return ctrl, run, combines


def test_continuations_take_the_controller_out_of_every_hop():
    """All gradients ready together: without continuations each of the n - 1 worker hops of every piece waits
    for its sender's receive to be reported and a Combine granted; with them the node combines and sends on by
    itself (same sum, no Combine grant for a worker, one send per hop)."""
    ctrl, run, combines = _all_ready_at_once(cut=False)
    pieces = len(ctrl.reduces)
    assert pieces == 4 and run.continuations == 0 and combines == pieces * 5  # hops 0->1 .. 4->5 into workers
    ctrl, run, combines = _all_ready_at_once(cut=True)
    assert run.continuations == pieces * 5 and run.dropped_continuations == 0  # 1->2 .. 4->5 and 5->PS
    assert combines == 0
    assert run.max_parallel_sends == 1


@pytest.mark.parametrize("victim", [1, 2, 5])
def test_a_dead_node_drops_its_continuations_and_the_round_closes_exactly(victim):
    """A chain node dies before anything moved: hops into it are lost, hops out of it are re-granted from its
    predecessor (again as continuations), and the PS applies the exact mean of the other five."""
    ctrl, run, _ = _all_ready_at_once(cut=True, kill=victim)
    assert run.continuations > 0


@settings(max_examples=60, deadline=None, derandomize=True)
@given(st.integers(2, 12), st.randoms(use_true_random=False), st.integers(0, 3),
       st.sampled_from([(None, False), (160, False), (160, True)]), st.booleans())
def test_any_order_any_deaths_round_closes_with_the_exact_mean(n, rnd, n_dead, pieces, together):
    """``together``: readies (and deaths) land while earlier hops are still in flight, so hops are deferred behind
    their sender's incoming receive (and, with continuations, granted as continuations of it)."""
    ctrl, run, grads, init, shards = _setup(n=n, K=1 + n % 2, n_elems=200, seed=n, piece_bytes=pieces[0],
                                            cut_through=pieces[1],
                                            latency_s=rnd.choice([1e-9, 125e-6]))  # 1D or 2D chains
    ctrl.auto_get = False
    nodes = [worker(r) for r in range(n)]
    run.feed(ctrl.start(0, nodes, now=0.0))
    order = list(range(n))
    rnd.shuffle(order)
    victims = set(rnd.sample(range(n), min(n_dead, n - 1)))
    kill_at = {rnd.randrange(n): v for v in victims}
    for i, r in enumerate(order):
        if i in kill_at and worker(kill_at[i]) not in run.dead:
            run.kill(worker(kill_at[i]))
            if not together or rnd.random() < 0.5:
                run.run()
        if worker(r) not in run.dead:
            run.event(NodeReady(worker(r), 0))
            if not together or rnd.random() < 0.3:
                run.run()
    run.run()
    for v in victims:  # victims never scheduled to die before the end die now
        if worker(v) not in run.dead and not ctrl.done():
            run.kill(worker(v))
            run.run()
    assert ctrl.done()
    got = ctrl.contributions()
    assert got <= set(nodes) - run.dead | {worker(v) for v in victims}
    assert set(nodes) - {worker(v) for v in victims} <= got, "a live worker's gradient was lost"
    contributors = sorted(int(x.split(":")[1]) for x in got)
    want = np.mean([grads[r] for r in contributors], axis=0)
    for k, (lo, hi) in enumerate(shards):
        assert run.applied[(lo, hi)] == len(contributors)
        np.testing.assert_allclose(run.slots[server(k)]["params"][lo:hi], want[lo:hi], rtol=1e-4, atol=1e-5)


# --------------------------------------------------------------------------- fluid flows

@pytest.mark.parametrize("n", [4, 8, 16])
def test_pipelined_broadcast_and_reduce_flows_match_appendix_a(n):
    S, B, L = 100 * MB, 10 * GBIT, 125e-6
    net = FluidNetwork.uniform([n], B, latency_s=L)
    h = net.hosts
    bc = simulate(net, broadcast_flows(h[0], h[1:], S)).completion_s
    assert bc == pytest.approx(t_1d(n, S, B, L), rel=0.01)  # a chain of partial copies: S/B + (n-1) L
    red = simulate(net, reduce_flows(h[1:], h[0], S, bandwidth_bps=B, latency_s=L)).completion_s
    assert red == pytest.approx(t_1d(n, S, B, L), rel=0.01)


def test_schedule_predicts_a_round_from_the_topology():
    from ltp_ps.schedules.base import World
    from ltp_ps.schedules.registry import create
    from ltp_ps.schedules.topology import Topology
    topo = Topology.uniform([f"h{i}" for i in range(7)], rate_bps=100e6, latency_s=25e-6)
    w = World(workers=range(6), n_elems=1_000_000, shards=((0, 1_000_000),), topology=topo)
    sched = create("hoplite", w)
    assert sched.plan(0).programs == {}
    p = sched.predict_s()
    S_over_B = 4e6 * 8 / 100e6
    assert 2 * S_over_B < p < 2 * S_over_B * 1.05  # a pipelined broadcast chain plus a pipelined reduce chain
    assert sched.predict_s(2_000_000) == pytest.approx(p / 2, rel=0.02)
    assert isinstance(sched.controller(), HopliteController)
