"""Detached sends (ps/schedules/executor.py): a partial's send finishes beside the later stages.

A reliable LTP send ends when the last byte is acknowledged, a round trip after it left; a ring step that waited
for it took about 2.3 one-way delays instead of one (4 lab workers behind 200 ms: 2.8 s a round over LTP, TCP's
1.2 s). The transport below delivers at once and acknowledges ``ack_s`` later, checking meanwhile that nobody
changed the bytes it was given (a send's buffer is the sender's until the send ends).
"""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from ltp_ps.schedules import World, create
from ltp_ps.schedules.executor import Executor, Slots
from ltp_ps.schedules.program import worker
from ltp_ps.transport.base import as_bytes_view
from ltp_ps.transport.memory import MemoryNetwork, MemoryTransport
from test_executor import RingRole


class SlowAckTransport(MemoryTransport):
    """Delivers at once; the send returns ``ack_s`` later, after checking its bytes did not change."""

    def __init__(self, net, addr, ack_s: float, changed: list):
        super().__init__(net, addr)
        self.ack_s = ack_s
        self.changed = changed
        self.in_flight = 0
        self.most_in_flight = 0

    async def send(self, peer, data, **kw):
        before = bytes(as_bytes_view(data))
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            rep = await super().send(peer, data, **kw)
            await asyncio.sleep(self.ack_s)
        finally:
            self.in_flight -= 1
        if bytes(as_bytes_view(data)) != before:
            self.changed.append((self.local_addr, peer, kw.get("tag")))
        return rep


async def _ring(n, size, *, ack_s, loss=0.0, seed=0, schedule="ring"):
    net = MemoryNetwork(loss=loss, segment_size=64, seed=seed)
    changed: list = []
    eps = []
    for _ in range(n):
        ep = net.endpoint()
        slow = SlowAckTransport(net, ep.local_addr, ack_s, changed)
        net.endpoints[ep.local_addr] = slow
        eps.append(slow)
    addrs = {worker(r): eps[r].local_addr for r in range(n)}
    rng = np.random.default_rng(seed)
    grads = ([np.full(size, float(10 ** w), np.float32) for w in range(n)] if loss
             else [rng.standard_normal(size).astype(np.float32) for _ in range(n)])
    plan = create(schedule, World(workers=range(n), n_elems=size)).plan(3)
    roles = [RingRole(g) for g in grads]
    exes = [Executor(eps[r], worker(r), addrs, timeout_s=10.0) for r in range(n)]
    t0 = time.monotonic()
    results = await asyncio.gather(*(exes[r].run(plan.program(worker(r)), Slots(), roles[r], iteration=3)
                                     for r in range(n)))
    took = time.monotonic() - t0
    for r, res in enumerate(results):  # every transfer has its report when run() returns
        steps = plan.program(worker(r)).steps()
        for st, rep in zip(steps, res.reports):
            if st.op in ("send", "forward", "recv"):
                assert rep is not None and not isinstance(rep, BaseException), (r, st, rep)
    return took, roles, results, grads, changed, eps


@pytest.mark.parametrize("n", [3, 4, 6])
def test_a_ring_step_does_not_wait_for_its_sends_acknowledgement(n):
    ack_s = 0.15
    took, roles, results, grads, changed, eps = asyncio.run(_ring(n, 999, ack_s=ack_s))
    steps = 2 * (n - 1)
    assert took < 0.5 * steps * ack_s, f"{took:.2f} s: the steps waited for the acknowledgements"
    assert took >= ack_s  # run() still returns only once every send has ended
    assert not changed, changed  # no buffer changed under a send in flight
    assert max(e.most_in_flight for e in eps) > 1
    want = np.mean(grads, axis=0)
    for role in roles:
        np.testing.assert_allclose(role.applied, want, rtol=1e-5, atol=1e-6)


def test_a_chunk_resent_while_its_first_send_is_in_flight_is_encoded_into_a_second_buffer():
    """n = 2: the all-gather's only send resends the reduce-scatter's (peer, lo, hi) right after it; with a slow
    acknowledgement the first send still reads its buffer, so the second must not encode into it."""
    took, roles, results, grads, changed, _ = asyncio.run(_ring(2, 257, ack_s=0.1))
    assert not changed, changed
    want = np.mean(grads, axis=0)
    for role in roles:
        np.testing.assert_allclose(role.applied, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("seed", range(4))
def test_detached_sends_under_loss_keep_the_unbiased_mean(seed):
    """Loss on top: every rank applies the same bits, and each element's mean is over exactly the workers whose
    contribution arrived (gradients 10**w make a sum name its contributors)."""
    n, size = 4, 400
    took, roles, results, grads, changed, _ = asyncio.run(_ring(n, size, ack_s=0.02, loss=0.2, seed=seed))
    assert not changed
    for r in roles[1:]:
        np.testing.assert_array_equal(r.applied, roles[0].applied)
    mean, counts = roles[0].applied, roles[0].counts
    assert counts.min() < n  # the loss hit something
    total = np.rint(mean * counts).astype(np.int64)
    present = sum(((total // 10 ** w) % 10 == 1).astype(np.int64) for w in range(n))
    np.testing.assert_array_equal(present, counts)


def test_rsgcm_rings_detach_too():
    took, roles, results, grads, changed, _ = asyncio.run(_ring(5, 1000, ack_s=0.1, schedule="rsgcm"))
    assert not changed and took < 0.5 * 8 * 0.1
    want = np.mean(grads, axis=0)
    for role in roles:
        np.testing.assert_allclose(role.applied, want, rtol=1e-5, atol=1e-6)


def test_leading_send_stages_with_a_head_start_keep_their_sends_within_the_stage():
    """A head start times a leading send-only stage by its sends (a tree's farthest subtree first): a detached
    partial there would end the stage at once and start the next beside it with no head start."""
    from ltp_ps.schedules.partial import Partial
    from ltp_ps.schedules.program import Program, Send

    async def main():
        net = MemoryNetwork(loss=0.0, segment_size=64, seed=0)
        changed: list = []
        eps = []
        for _ in range(3):
            ep = net.endpoint()
            slow = SlowAckTransport(net, ep.local_addr, 0.3, changed)
            net.endpoints[ep.local_addr] = slow
            eps.append(slow)
        starts = []
        orig = eps[0].send

        async def timed(peer, data, **kw):
            starts.append((peer, asyncio.get_running_loop().time()))
            return await orig(peer, data, **kw)

        eps[0].send = timed
        addrs = {worker(r): eps[r].local_addr for r in range(3)}
        prog = Program("worker:0", ((Send("worker:2", "acc", 0, 16, 3, "tolerant", "partial", detach=True),),
                                    (Send("worker:1", "acc", 0, 16, 4, "tolerant", "partial", detach=True),)))
        sl = Slots()
        sl.put_partial("acc", Partial.of_gradient(np.ones(16, np.float32)))
        res = await Executor(eps[0], "worker:0", addrs, timeout_s=5.0).run(prog, sl, head_start_s=0.1)
        assert all(r is not None and not isinstance(r, BaseException) for r in res.reports)
        return starts

    (p2, t2), (p1, t1) = asyncio.run(main())
    assert t1 - t2 >= 0.09, "the second stage started before the first one's head start was over"


def test_only_sends_their_planner_marked_detach():
    """Ring and RSGCM mark their sends; the other schedules' hops end within their stage, as before."""
    from ltp_ps.schedules.program import Program, Send

    assert Send("worker:1", "acc", 0, 4, 1).detach is False
    for name in ("ring", "rsgcm"):
        plan = create(name, World(workers=range(4), n_elems=400)).plan(0)
        sends = [s for node in plan.programs for st in plan.program(node).stages for s in st if s.op == "send"]
        assert sends and all(s.detach for s in sends), name
    prog = Program("worker:0", ((Send("worker:1", "acc", 0, 4, 1, detach=True),),))
    assert Program.from_json(prog.to_json()) == prog  # the mark survives a plan's JSON
