"""The executor runs round programs over a transport: ring and direct over the in-memory transport,
with seeded loss; every schedule's result equals the direct unbiased mean of what was delivered."""

import asyncio
import dataclasses

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from ltp_ps.aggregate import Aggregator
from ltp_ps.schedules import World, create
from ltp_ps.schedules.executor import STOP, Executor, ExecutorError, Slots, describe_missing
from ltp_ps.schedules.partial import Partial, message_capacity
from ltp_ps.schedules.program import Forward, Program, Recv, Send, worker
from ltp_ps.transport.memory import MemoryNetwork, MemoryTransport


class RingRole:
    """Worker-side handlers of a ring program (the same maths ltp_ps.worker uses)."""

    def __init__(self, grad, lo=0):
        self.grad = grad
        self.mean = np.full(grad.size, np.nan, np.float32)
        self.applied = None
        self.counts = np.zeros(grad.size, np.int64)

    def compute(self, step, slots):
        slots.clear_partials()
        slots.put_partial(step.slot, Partial.of_gradient(self.grad))

    def adopt(self, step, slots):
        p = slots.partial(step.slot, step.lo, step.hi)
        assert p is not None, f"chunk [{step.lo},{step.hi}) never arrived"
        p.mean("unbiased", out=self.mean[step.lo:step.hi])
        self.counts[step.lo:step.hi] = p.counts()

    def apply(self, step, slots):
        self.applied = self.mean.copy()


async def run_ring(grads, *, loss, seed, layout=()):
    n = len(grads)
    net = MemoryNetwork(loss=loss, segment_size=64, seed=seed)
    eps = [net.endpoint() for _ in range(n)]
    addrs = {worker(r): eps[r].local_addr for r in range(n)}
    world = World(workers=range(n), n_elems=grads[0].size, layout=layout)
    sched = create("ring", world)
    plan = sched.plan(7)
    plan.check()
    roles = [RingRole(g) for g in grads]
    exes = [Executor(eps[r], worker(r), addrs, timeout_s=5.0) for r in range(n)]
    results = await asyncio.gather(*(exes[r].run(plan.program(worker(r)), Slots(), roles[r], iteration=7)
                                     for r in range(n)))
    return roles, results, eps


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(1, 6), st.integers(1, 300), st.sampled_from([0.0, 0.05, 0.3]), st.integers(0, 10_000))
def test_ring_equals_direct_unbiased_mean(n, size, loss, seed):
    rng = np.random.default_rng(seed)
    grads = [rng.standard_normal(size).astype(np.float32) for _ in range(n)]
    roles, results, _ = asyncio.run(run_ring(grads, loss=loss, seed=seed, layout=((0, size),)))
    # every worker applies the same bits (all-gather is reliable)
    for r in roles[1:]:
        np.testing.assert_array_equal(r.applied, roles[0].applied)
    counts = roles[0].counts
    assert counts.max() <= n
    if loss == 0:
        assert (counts == n).all()
        np.testing.assert_allclose(roles[0].applied, np.mean(grads, axis=0), rtol=1e-5, atol=1e-6)
    else:
        # Direct PS on the same delivery pattern: element e of worker w arrived iff ...; reconstruct from the
        # partial sums: mean * counts must be a sum of exactly `counts` of the workers' values.
        tot = roles[0].applied * counts
        assert np.isfinite(tot).all()
        assert (roles[0].applied[counts == 0] == 0).all()
    # the first and last element of the tensor are critical: always every contribution
    assert counts[0] == n and counts[-1] == n


def test_ring_with_loss_matches_aggregator_on_the_same_loss_pattern():
    """Replay: the ring's per-element counts name who was lost; an Aggregator fed the workers' gradients
    with exactly those losses gives the same mean.  Worker w's contribution to chunk c is lost on the hop where
    the partial carrying it crossed a lossy segment, so we rebuild it from the delivered sums."""
    n, size = 4, 400
    rng = np.random.default_rng(1)
    grads = [np.full(size, float(10 ** w), np.float32) for w in range(n)]  # decodable: which workers are in a sum
    roles, _, _ = asyncio.run(run_ring(grads, loss=0.2, seed=3))
    mean, counts = roles[0].applied, roles[0].counts
    agg = Aggregator(size)
    total = np.rint(mean * counts).astype(np.int64)
    for w in range(n):
        present = (total // 10 ** w) % 10 == 1
        lost = [(int(i), int(i) + 1) for i in np.flatnonzero(~present)]
        agg.add(grads[w], lost)
    np.testing.assert_allclose(agg.result(), mean, rtol=1e-6)
    np.testing.assert_array_equal(agg.counts(), counts)
    assert counts.min() < n  # the test exercised loss
    del rng


def test_ring_single_worker_is_its_own_mean():
    g = np.arange(5, dtype=np.float32)
    roles, _, _ = asyncio.run(run_ring([g], loss=0.5, seed=0))
    np.testing.assert_array_equal(roles[0].applied, g)


class DirectServerRole:
    def __init__(self, n):
        self.agg = Aggregator(n)
        self.combined = []

    def combine(self, step, slots):
        self.combined.append(step.src)

    def apply(self, step, slots):
        self.applied = True


@pytest.mark.parametrize("ready_handshake", [False, True])
def test_direct_plan_runs_and_dead_worker_costs_one_bound(ready_handshake):
    """Direct's server program over the executor: a worker that never answers is reported missing within
    one gather bound (with the handshake: the READY bound) and does not hold up the others' gradients."""
    async def main():
        net = MemoryNetwork()
        eps = [net.endpoint() for _ in range(4)]  # server + 3 workers
        addrs = {"server:0": eps[0].local_addr, **{worker(r): eps[r + 1].local_addr for r in range(3)}}
        world = World(workers=range(3), n_elems=16, shards=((0, 16),))
        sched = create("direct", world, ready_handshake=ready_handshake)
        plan = sched.plan(0)
        plan.check()
        s_slots = Slots()
        s_slots.bind("params", np.zeros(64 + 64, np.uint8))
        for r in range(3):
            s_slots.bind(f"ready:worker:{r}", np.zeros(8, np.uint8))
            s_slots.bind(f"in:worker:{r}", np.zeros(64 + 64, np.uint8))

        class W:
            def __init__(self, r):
                self.r = r

            def compute(self, step, slots):
                slots.buffers["out:server:0"][64:] = self.r + 1

        async def run_worker(r):
            sl = Slots()
            sl.bind("params:server:0", np.zeros(128, np.uint8))
            sl.bind("note:server:0", np.zeros(8, np.uint8))
            sl.bind("out:server:0", np.zeros(128, np.uint8))
            ex = Executor(eps[r + 1], worker(r), addrs, timeout_s=2.0)
            return await ex.run(plan.program(worker(r)), sl, W(r), iteration=0)

        role = DirectServerRole(16)
        ex = Executor(eps[0], "server:0", addrs, timeout_s=0.3)
        t0 = asyncio.get_running_loop().time()
        res, *_ = await asyncio.gather(ex.run(plan.program("server:0"), s_slots, role), run_worker(0), run_worker(1))
        took = asyncio.get_running_loop().time() - t0
        return res, s_slots, role, took, plan

    res, slots, role, took, plan = asyncio.run(main())
    got = {k for k in ("in:worker:0", "in:worker:1", "in:worker:2") if slots.buffers[k][64:].any()}
    assert got == {"in:worker:0", "in:worker:1"}
    assert set(role.combined) == {"in:worker:0", "in:worker:1", "in:worker:2"} and role.applied
    assert took < 1.5  # the dead worker cost one bound (0.3 s), not the full default
    if ready_handshake:
        assert res.group_s["ready"] >= 0.29
        assert len(res.missing) >= 2  # worker 2's READY and grad
    else:
        assert "ready" not in res.group_s and res.group_s["grad"] >= 0.29
        assert len(res.missing) == 1  # worker 2's grad
        recvs = [s for st in plan.program("server:0").stages for s in st if s.op == "recv"]
        assert recvs and all(s.clock == "all" and s.group == "grad" for s in recvs)


def test_handler_stop_ends_the_program_and_unknown_slots_name_the_fix():
    async def main():
        net = MemoryNetwork()
        a, b = net.endpoint(), net.endpoint()
        ex = Executor(a, "worker:0", {"worker:1": b.local_addr})

        class H:
            def compute(self, step, slots):
                return STOP

        from ltp_ps.schedules.program import Compute
        prog = Program("worker:0", ((Compute(),), (Send("worker:1", "x", 0, 1, 5, payload="note"),)))
        res = await ex.run(prog, Slots(), H())
        assert res.stopped and res.reports[1] is None
        with pytest.raises(ExecutorError, match="bind"):
            await ex.run(Program("worker:0", ((Send("worker:1", "x", 0, 1, 5, payload="note"),),)), Slots())
        sl = Slots()
        sl.bind("x", np.zeros(8, np.uint8))
        with pytest.raises(ExecutorError, match="address"):
            await ex.run(Program("worker:0", ((Recv("worker:9", "x", 0, 1, 5, payload="note"),),)), sl)
    asyncio.run(main())


def test_an_address_missing_from_the_book_is_resolved_once_and_kept():
    """``resolve`` (the CLI's store look-up for controller schedules) is asked only for nodes the book lacks;
    its answer is kept, and a node it cannot place is still an error naming the address book."""
    asked = []
    ex = Executor(MemoryNetwork().endpoint(), "worker:0", {"server:0": ("h", 1)})

    def resolve(node):
        asked.append(node)
        return ("h", 7) if node == "worker:3" else None

    ex.resolve = resolve
    assert ex.addr("server:0") == ("h", 1) and asked == []
    assert ex.addr("worker:3") == ("h", 7) and ex.addr("worker:3") == ("h", 7) and asked == ["worker:3"]
    with pytest.raises(ExecutorError, match="address book"):
        ex.addr("worker:5")


def test_a_send_that_finds_its_peer_gone_looks_the_peer_up_again():
    """A worker restarted as a new process listens elsewhere: after a send to its old address bounces (PeerGone),
    ``resolve`` is asked again and the next send goes to the address it gives."""
    async def main():
        net = MemoryNetwork()
        a, old, new = net.endpoint(), net.endpoint(), net.endpoint()
        ex = Executor(a, "worker:0", {"worker:1": old.local_addr})
        ex.resolve = lambda node: new.local_addr if node == "worker:1" else None
        sl = Slots()
        sl.bind("x", np.arange(8, dtype=np.uint8))
        send = Program("worker:0", ((Send("worker:1", "x", 0, 8, 5, payload="note"),),))
        await old.close()
        res = await ex.run(send, sl)
        assert type(res.reports[0]).__name__ == "PeerGone" and ex.addr("worker:1") == tuple(new.local_addr)
        res = await ex.run(send, sl)
        assert not isinstance(res.reports[0], BaseException), res.reports
        into = np.zeros(8, np.uint8)
        await new.recv(into, tag=5, timeout=2)
        assert into.tolist() == list(range(8))
    asyncio.run(main())


def test_raw_sends_only_mark_gradient_headers_critical():
    """A reliable note or parameter message carries no critical ranges (LTP refuses ranges outside a short
    buffer); a tolerant raw gradient's 64-byte header is critical."""
    seen = []

    class Spy(MemoryNetwork):
        pass

    async def main():
        net = MemoryNetwork()
        a, b = net.endpoint(), net.endpoint()
        orig = a.send

        async def send(peer, data, **kw):
            seen.append((kw.get("reliable"), tuple(kw.get("critical", ()))))
            return await orig(peer, data, **kw)

        a.send = send
        sl = Slots()
        sl.bind("note", np.zeros(8, np.uint8))
        sl.bind("g", np.zeros(64 + 16, np.uint8))
        ex = Executor(a, "worker:0", {"server:0": b.local_addr})
        prog = Program("worker:0", ((Send("server:0", "note", 0, 0, 1, "reliable", "note"),
                                     Send("server:0", "g", 0, 4, 2, "tolerant", "grad", critical=((3, 4),))),))
        await ex.run(prog, sl)
    asyncio.run(main())
    assert seen[0] == (True, ())
    assert seen[1] == (False, ((0, 64), (76, 80)))


# -- peers that are gone (tree repair, ltp_ps.tree_views) -------------------------------------------------------------

def _pair(net):
    a, b, c = net.endpoint(), net.endpoint(), net.endpoint()
    addrs = {"worker:0": a.local_addr, "worker:1": b.local_addr, "worker:2": c.local_addr}
    return a, b, c, addrs


async def test_abandon_ends_a_waiting_reliable_receive_at_once_and_keeps_the_others():
    net = MemoryNetwork(loss=0.0, segment_size=256, seed=0)
    a, b, c, addrs = _pair(net)
    ex = Executor(a, "worker:0", addrs, timeout_s=30.0)
    sl = Slots()
    sl.bind("p1", np.zeros(64, np.uint8))
    sl.bind("p2", np.zeros(64, np.uint8))
    prog = Program("worker:0", ((Recv("worker:1", "p1", 0, 16, 7, "reliable", "params", group="params"),
                                 Recv("worker:2", "p2", 0, 16, 7, "reliable", "params", group="params")),))
    t0 = asyncio.get_running_loop().time()
    task = asyncio.ensure_future(ex.run(prog, sl))
    await asyncio.sleep(0.05)
    await c.send(a.local_addr, np.arange(64, dtype=np.uint8), reliable=True, tag=7)  # worker 2 delivers
    ex.abandon(["worker:1"])  # worker 1 was declared dead: stop waiting (30 s otherwise)
    res = await asyncio.wait_for(task, 5)
    assert asyncio.get_running_loop().time() - t0 < 2
    assert res.reports[0].received_bytes == 0 and res.reports[0].regime == "cancelled"
    assert res.reports[1].received_bytes == 64
    assert (sl.buffer("p2") == np.arange(64, dtype=np.uint8)).all()
    assert ex.first_missing.startswith("the receive from worker:1 was abandoned after "), ex.first_missing


async def test_a_receive_whose_sender_is_gone_says_so_and_an_abandoned_one_does_not():
    """A receive that ends because its sender's connection closed (TCP's ``PeerClosed``) is a missing report
    with ``peer_gone``: hard evidence a tree worker acts on at once (``program_roles``), where a receive
    abandoned or timed out is only late."""
    from ltp_ps.transport.mailbox import PeerClosed

    net = MemoryNetwork(loss=0.0, segment_size=256, seed=0)
    a, b, c, addrs = _pair(net)

    async def closed_recv(into, *, peer=None, tag=None, timeout=None):
        if peer == b.local_addr:
            raise PeerClosed(f"peer {peer} closed its connection")
        await asyncio.sleep(timeout)
        raise TimeoutError

    a.recv = closed_recv
    ex = Executor(a, "worker:0", addrs, timeout_s=0.2)
    sl = Slots()
    sl.bind("p1", np.zeros(64, np.uint8))
    sl.bind("p2", np.zeros(64, np.uint8))
    prog = Program("worker:0", ((Recv("worker:1", "p1", 0, 16, 7, "reliable", "params", group="params"),
                                 Recv("worker:2", "p2", 0, 16, 7, "reliable", "params", group="params")),))
    res = await asyncio.wait_for(ex.run(prog, sl), 5)
    gone, late = res.reports
    assert gone.received_bytes == 0 and gone.peer_gone and sl.reports["p1"].peer_gone
    assert late.received_bytes == 0 and late.regime == "timeout" and not late.peer_gone
    # what a role's "never arrived" error names: the first empty receive, gone told apart from silent
    assert ex.first_missing.startswith("worker:1 is gone: its connection closed after "), ex.first_missing
    assert describe_missing("worker:2", late).startswith("worker:2 sent nothing for 0.2 s, the whole receive timeout")


def test_describe_missing_tells_every_way_a_receive_ends_empty_apart():
    from ltp_ps.transport.base import missing_report

    peer = ("10.0.0.1", 1)
    said = {describe_missing("worker:3", r) for r in (
        missing_report(peer, 1, 64, "timeout", 60.0), missing_report(peer, 1, 64, "cancelled", 0.5),
        missing_report(peer, 1, 64, "cancelled", 0.0, peer_gone=True), missing_report(peer, 1, 64, "deadline", 2.0),
        ConnectionResetError("reset by peer"))}
    assert len(said) == 5 and all("worker:3" in w for w in said), said
    assert any("60.0 s, the whole receive timeout" in w for w in said)
    assert any("ConnectionResetError" in w for w in said)


async def test_first_missing_names_an_undecodable_partial_and_a_clean_run_clears_it():
    net = MemoryNetwork(loss=0.0, segment_size=256, seed=0)
    a, b, c, addrs = _pair(net)
    ex = Executor(a, "worker:0", addrs, timeout_s=2.0)
    sl = Slots()
    prog = Program("worker:0", ((Recv("worker:1", "acc", 0, 8, 5, "reliable", "partial", group="g"),),))
    cap = message_capacity(8)
    await b.send(a.local_addr, np.full(cap, 0xAB, np.uint8), reliable=True, tag=5)  # not a partial
    await asyncio.wait_for(ex.run(prog, sl), 5)
    assert ex.first_missing.startswith("the partial from worker:1 did not decode"), ex.first_missing
    from ltp_ps.wire import KIND_PARTIAL

    good = Partial.of_gradient(np.ones(8, np.float32), samples=1, loss=0.0)
    msg = good.encode_into(np.zeros(cap, np.uint8), kind=KIND_PARTIAL, origin=1, iteration=0)
    await b.send(a.local_addr, np.frombuffer(msg, np.uint8).copy(), reliable=True, tag=5)
    await asyncio.wait_for(ex.run(prog, sl), 5)
    assert ex.first_missing is None and sl.partial("acc", 0, 8) is not None


async def test_a_send_that_finds_its_peer_gone_skips_the_later_receive_from_it():
    from ltp_ps.errors import PeerGone

    net = MemoryNetwork(loss=0.0, segment_size=256, seed=0)
    a, b, c, addrs = _pair(net)
    await b.close()  # worker 1's process is gone
    ex = Executor(a, "worker:0", addrs, timeout_s=30.0)
    sl = Slots()
    sl.bind("params", np.ones(64, np.uint8))
    prog = Program("worker:0", ((Send("worker:1", "params", 0, 16, 3, "reliable", "params"),),
                                (Recv("worker:1", "in", 0, 16, 4, "tolerant", "partial", group="g"),)))
    res = await asyncio.wait_for(ex.run(prog, sl), 5)
    assert isinstance(res.reports[0], PeerGone)
    assert res.reports[1].received_bytes == 0 and res.reports[1].duration_s == 0.0  # not waited for
    assert res.missing == [(1, "not waited for: excluded (known dead or abandoned)")]


async def test_a_stalled_peer_in_a_send_group_is_not_waited_for_and_groups_add_up_over_stages():
    # a tree node relays to children at two levels (two stages, one group name per level in `rat`; here one name
    # over both stages): it then waits for partials only from the children its sends reached, and a stalled child
    # costs the send's own bound, not the receive's too
    net = MemoryNetwork(loss=0.0, segment_size=256, seed=0)
    a, b, c, addrs = _pair(net)
    net.stall(c.local_addr)  # worker 2 stopped (SIGSTOP): no answer, no error
    ex = Executor(a, "worker:0", addrs, timeout_s=30.0)
    sl = Slots()
    sl.bind("params", np.ones(64, np.uint8))
    prog = Program("worker:0", (
        (Send("worker:1", "params", 0, 16, 3, "reliable", "params", group="down"),),
        (Send("worker:2", "params", 0, 16, 4, "reliable", "params", group="down", timeout_s=0.2),),
        (Recv("worker:1", "in1", 0, 16, 5, "tolerant", "partial", group="up", only_if="down"),
         Recv("worker:2", "in2", 0, 16, 5, "tolerant", "partial", group="up", only_if="down"))))
    task = asyncio.ensure_future(ex.run(prog, sl))
    got = np.zeros(64, np.uint8)
    await b.recv(got, peer=a.local_addr, tag=3, timeout=5)
    part = Partial.of_gradient(np.full(16, 2.0, np.float32))
    buf = np.zeros(message_capacity(16), np.uint8)
    await b.send(a.local_addr, part.encode_into(buf, kind=5, origin=1, iteration=0), tag=5)
    t0 = asyncio.get_running_loop().time()
    res = await asyncio.wait_for(task, 5)
    assert asyncio.get_running_loop().time() - t0 < 2  # not the receive's 30 s for worker 2
    assert res.reports[1].__class__.__name__ == "TransportTimeout"
    assert res.reports[2].received_bytes > 0  # worker 1: reached in stage 0, still waited for after stage 1
    assert res.reports[3].received_bytes == 0 and res.reports[3].duration_s == 0.0
    assert res.missing == [(3, "not waited for: its exchange in group 'down' did not succeed")]


async def test_prepare_transfer_lets_the_role_replace_a_transfer_after_the_stages_before_it():
    net = MemoryNetwork(loss=0.0, segment_size=256, seed=0)
    a, b, c, addrs = _pair(net)
    seen = []

    class Role:
        def prepare_transfer(self, step, slots):
            seen.append((step.op, step.slot))
            if step.op == "forward":  # relay something else, bounded
                slots.bind("other", np.full(8, 9, np.uint8))
                return dataclasses.replace(step, slot="other", timeout_s=1.0)
            return None

    ex = Executor(a, "worker:0", addrs, timeout_s=30.0)
    sl = Slots()
    sl.bind("in", np.zeros(64, np.uint8))
    prog = Program("worker:0", ((Recv("worker:1", "in", 0, 16, 3, "reliable", "params"),),
                                (Forward("worker:2", "in", 0, 16, 4, "reliable", "params"),)))
    task = asyncio.ensure_future(ex.run(prog, sl, Role()))
    await b.send(a.local_addr, np.arange(64, dtype=np.uint8), reliable=True, tag=3)
    got = np.zeros(64, np.uint8)
    rep = await c.recv(got, peer=a.local_addr, tag=4, timeout=5)
    res = await asyncio.wait_for(task, 5)
    assert rep.total_bytes == 8 and (got[:8] == 9).all()
    assert res.reports[1].delivered_bytes == 8
    assert seen == [("recv", "in"), ("forward", "in")]


async def test_leading_send_stages_with_a_head_start_do_not_wait_on_a_stalled_peer():
    # a tree's PS sends to its farthest subtree first (a stage of its own); a stalled child there held the sends to
    # everyone else for the send's whole bound.  With a head start each leading send stage gets that long, then
    # the next starts beside it; the first stage that receives still waits for all of them
    net = MemoryNetwork(loss=0.0, segment_size=256, seed=0)
    a, b, c, addrs = _pair(net)
    net.stall(c.local_addr)
    prog = Program("worker:0", (
        (Send("worker:2", "params", 0, 16, 3, "reliable", "params", timeout_s=1.0),),
        (Send("worker:1", "params", 0, 16, 3, "reliable", "params"),),
        (Recv("worker:1", "in1", 0, 16, 5, "reliable", "partial", group="up"),)))
    loop = asyncio.get_running_loop()
    for head_start, first_by in ((0.1, 0.6), (None, 0.9)):
        ex = Executor(a, "worker:0", addrs, timeout_s=30.0)
        sl = Slots()
        sl.bind("params", np.ones(64, np.uint8))
        t0 = loop.time()
        task = asyncio.ensure_future(ex.run(prog, sl, head_start_s=head_start))
        got = np.zeros(64, np.uint8)
        await b.recv(got, peer=a.local_addr, tag=3, timeout=5)
        reached = loop.time() - t0
        assert (reached < first_by) if head_start else (reached >= first_by), (head_start, reached)
        part = Partial.of_gradient(np.full(16, 2.0, np.float32))
        buf = np.zeros(message_capacity(16), np.uint8)
        await b.send(a.local_addr, part.encode_into(buf, kind=5, origin=1, iteration=0), tag=5)
        res = await asyncio.wait_for(task, 5)
        assert res.reports[0].__class__.__name__ == "TransportTimeout"  # the stalled send still ran to its bound
        assert loop.time() - t0 >= 1.0  # ... and the receiving stage waited for it
        assert res.reports[2].received_bytes > 0


async def test_a_role_s_straggler_bound_cuts_off_the_rest_of_a_reliable_group():
    # a worker holding one parameter relay of the round waits for the others a bounded time, not --pull-timeout:
    # the cut-off peer is abandoned for the rest of the program (its later send is skipped)
    net = MemoryNetwork(loss=0.0, segment_size=256, seed=0)
    a, b, c, addrs = _pair(net)
    net.stall(c.local_addr)
    calls = []

    class Role:
        def straggler_bound(self, steps, slots, arrived=None):
            calls.append(arrived is not None)
            return 0.1 if arrived is not None else None

    ex = Executor(a, "worker:0", addrs, timeout_s=30.0)
    sl = Slots()
    sl.bind("p1", np.zeros(64, np.uint8))
    sl.bind("p2", np.zeros(64, np.uint8))
    sl.bind("out", np.ones(64, np.uint8))
    prog = Program("worker:0", (
        (Recv("worker:1", "p1", 0, 16, 7, "reliable", "params", group="params"),
         Recv("worker:2", "p2", 0, 16, 7, "reliable", "params", group="params")),
        (Send("worker:2", "out", 0, 16, 8, "reliable", "params"),)))
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    task = asyncio.ensure_future(ex.run(prog, sl, Role()))
    await asyncio.sleep(0.05)
    await b.send(a.local_addr, np.arange(64, dtype=np.uint8), reliable=True, tag=7)
    res = await asyncio.wait_for(task, 5)
    assert loop.time() - t0 < 1.0  # not the group's 30 s
    assert calls == [False, True]  # asked at the start (nothing held), then when worker 1's message came
    assert res.reports[0].received_bytes == 64
    assert res.reports[1].received_bytes == 0 and res.reports[1].regime == "cancelled"
    assert isinstance(res.reports[2], ExecutorError) and ex.counters["stragglers_cut"] == 1


async def test_a_program_of_sends_only_with_a_head_start_ends_when_every_send_has():
    net = MemoryNetwork(loss=0.0, segment_size=256, seed=0)
    a, b, c, addrs = _pair(net)
    net.stall(c.local_addr)
    prog = Program("worker:0", ((Send("worker:2", "params", 0, 16, 3, "reliable", "params", timeout_s=0.5),),
                                (Send("worker:1", "params", 0, 16, 3, "reliable", "params"),)))
    ex = Executor(a, "worker:0", addrs, timeout_s=30.0)
    sl = Slots()
    sl.bind("params", np.ones(64, np.uint8))
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    task = asyncio.ensure_future(ex.run(prog, sl, head_start_s=0.05))
    await b.recv(np.zeros(64, np.uint8), peer=a.local_addr, tag=3, timeout=5)
    assert loop.time() - t0 < 0.4  # worker 1 did not wait for the stalled worker 2's send
    res = await asyncio.wait_for(task, 5)
    assert loop.time() - t0 >= 0.5 and res.reports[0].__class__.__name__ == "TransportTimeout"
    assert res.reports[1] is not None and not isinstance(res.reports[1], BaseException)


def test_expect_hints_only_tagged_model_sized_whole_slot_receives():
    """Executor.expect passes the transport one hint per gradient/params receive with a tag, with the slot's
    buffer; partials (scratch buffers), notes, untagged receives and excluded peers get none."""
    calls = []

    class Recording(MemoryTransport):
        async def expect(self, peer, into, *, tag):
            calls.append((peer, into, tag))

    net = MemoryNetwork()
    t = Recording(net, ("me", 1))
    addrs = {worker(r): ("w", r) for r in range(4)}
    ex = Executor(t, "server:0", addrs)
    slots = Slots()
    bufs = {r: np.zeros(8, np.float32) for r in range(4)}
    for r, b in bufs.items():
        slots.bind(f"in:{r}", b)
    slots.bind("note", np.zeros(2, np.float32))
    prog = Program("server:0", (
        (Recv(worker(0), "in:0", 0, 8, 5, payload="grad"), Recv(worker(1), "in:1", 0, 8, 5, payload="grad"),
         Recv(worker(2), "in:2", 0, 8, None, payload="grad"), Recv(worker(3), "in:3", 0, 8, 5, payload="partial"),
         Recv(worker(0), "note", 0, 0, 6, payload="note")),
        (Recv(worker(3), "in:3", 0, 8, 9, payload="params"),)))
    assert asyncio.run(ex.expect(prog, slots, exclude={worker(1)})) == 2
    assert [(p, tag) for p, _, tag in calls] == [(("w", 0), 5), (("w", 3), 9)]
    assert calls[0][1] is bufs[0] and calls[1][1] is bufs[3]


def test_a_hint_that_cannot_be_given_is_counted_and_skipped_never_raised():
    """A peer whose address the transport refuses, or that the address book lacks: the hint is skipped (the
    run meets that peer's fault where it always did), the others are given."""
    calls = []

    class Refusing(MemoryTransport):
        async def expect(self, peer, into, *, tag):
            if peer == ("bad", 0):
                raise ValueError("port 0")
            calls.append(peer)

    t = Refusing(MemoryNetwork(), ("me", 1))
    ex = Executor(t, "server:0", {worker(0): ("bad", 0), worker(1): ("w", 1)})
    slots = Slots()
    for r in range(3):
        slots.bind(f"in:{r}", np.zeros(8, np.float32))
    prog = Program("server:0", (tuple(Recv(worker(r), f"in:{r}", 0, 8, 5, payload="grad") for r in range(3)),))
    assert asyncio.run(ex.expect(prog, slots)) == 1  # worker 2 has no address at all
    assert calls == [("w", 1)] and ex.counters["hints_refused"] == 2
