"""The controller driver (ltp_ps.schedules.driver): control messages, rate monitor, grant delivery over memory."""

from __future__ import annotations

import asyncio
import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from ltp_ps.schedules.driver import (CONTROL_BYTES, DOWN, MIN_RATE_SAMPLE_BYTES, UP, ControlChannel,
                                     ControlDecodeError, ControllerDriver, GrantFollower, RateMonitor, control_tag,
                                     decode_message, encode_message, event_from_json, event_to_json,
                                     grant_uses_gradient, params_tag)
from ltp_ps.schedules.executor import Executor, Slots
from ltp_ps.schedules.partial import Partial
from ltp_ps.schedules.program import (Combine, Controller, Grant, NodeFailed, NodeReady, Recv, Send, TransferDone,
                                      server, worker)
from ltp_ps.schedules import tags
from ltp_ps.transport.base import RecvReport, SendReport
from ltp_ps.transport.memory import MemoryNetwork

pytestmark = pytest.mark.timeout(60)


# -- control messages -------------------------------------------------------------------------------------------------

def test_message_roundtrip_and_alignment():
    for msg in ({"stop": True}, {"grant": {"node": "worker:1", "steps": [], "start_at": 1.5}}, {"x": "é" * 7}):
        raw = encode_message(msg)
        assert len(raw) % 4 == 0
        buf = bytearray(CONTROL_BYTES)
        buf[:len(raw)] = raw
        assert decode_message(buf, len(raw)) == msg


def test_oversized_message_names_the_fix():
    with pytest.raises(ValueError, match="CONTROL_BYTES"):
        encode_message({"x": "a" * CONTROL_BYTES})


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=64))
def test_garbage_only_raises_control_decode_error(raw):
    buf = bytearray(max(len(raw), 4))
    buf[:len(raw)] = raw
    try:
        d = decode_message(buf, len(raw))
    except ControlDecodeError:
        return
    assert isinstance(d, dict)


def test_events_roundtrip_and_spoofing_is_refused():
    evs = [NodeReady("worker:2", 5, 0, 17, 1.25), TransferDone("worker:1", "worker:2", 99, False, 0.5)]
    for ev in evs:
        assert event_from_json(event_to_json(ev), "worker:2") == ev
    with pytest.raises(ControlDecodeError, match="reported an event of"):
        event_from_json(event_to_json(evs[0]), "worker:3")
    for bad in ({}, {"ready": {"node": "worker:2"}}, {"done": "x"}, {"ready": None}):
        with pytest.raises(ControlDecodeError):
            event_from_json(bad, "worker:2")


def test_control_and_params_tags_are_distinct_streams():
    a, b, c = control_tag(3, DOWN), control_tag(3, UP), params_tag(3)
    assert len({a, b, c}) == 3
    assert tags.unpack(a).phase == tags.PHASE_CONTROL and tags.unpack(c).phase == tags.PHASE_PULL
    assert control_tag(tags.MAX_ITERATION + 4, DOWN) == control_tag(3, DOWN)  # wraps, never raises


def test_grant_uses_gradient():
    assert grant_uses_gradient(Grant("worker:0", (), drop=True))
    assert grant_uses_gradient(Grant("worker:0", (Send("server:0", "grad", 0, 4, 1),)))
    assert grant_uses_gradient(Grant("worker:0", (Combine("mlf:0:1:acc", "grad", 0, 4),)))
    assert not grant_uses_gradient(Grant("worker:0", (Recv("worker:1", "mlf:0:in:worker:1", 0, 4, 1),)))


# -- rate monitor ---------------------------------------------------------------------------------------------------

@dataclasses.dataclass
class _Raw:
    btlbw_bps: float
    rtprop_s: float = 0.0


def _recv(nbytes, dur, raw=None):
    return RecvReport(("h", 1), 0, nbytes, nbytes, 1.0, duration_s=dur, raw=raw)


def test_rate_monitor_reads_ltps_btlbw_in_the_unit_ltp_reports_it(harness):
    """LTP's ``btlbw_bps`` is bytes/s (its wire's unit, docs/protocol.md); the monitor once divided it by 8 as if it
    were bit/s, so MLfabric's controller and the PS's deadline rule saw every LTP path 8x slower than it was."""
    h = harness(seed=5)
    h.links(rate=10e6, delay_s=0.001)  # 10 MB/s
    data = np.zeros(3_000_000, np.uint8)
    (done,) = h.wait([(0, h.engines[0].send(h.addrs[1], data, now=h.now, reliable=True))])
    rate, _ = RateMonitor.sample(SendReport(("h", 1), 0, data.size, data.size, 1.0, raw=done.report))
    assert rate == pytest.approx(10e6, rel=0.15), rate


def test_a_small_transfers_btlbw_is_a_lower_bound_that_never_lowers_the_estimate(harness):
    """A 20 kB message over a 40 ms path measures a fraction of a 100 MB/s link (it never filled the pipe); taken
    as the rate, MLfabric's planner (no propagation delay in its model) charged each such transfer its round trip
    as link time and aggregated to avoid a PS link it thought congested."""
    h = harness(seed=3)
    h.links(rate=100e6, delay_s=0.02)
    small = np.zeros(20_000, np.uint8)
    for i in range(2):  # the first on a fresh path has no BtlBw yet (goodput), the second has one
        (done,) = h.wait([(0, h.engines[0].send(h.addrs[1], small, now=h.now, reliable=True))])
        assert (done.report.btlbw_bps > 0) == (i == 1)
        rep = SendReport(("h", 1), 0, small.size, small.size, 1.0, duration_s=done.report.duration_s,
                         raw=done.report)
        rate, bound = RateMonitor.sample(rep)
        assert rate < 10e6 and bound, (i, rate)  # latency-bound, and flagged so
    big = np.zeros(20_000_000, np.uint8)  # 5 BDPs: the pipe is full for most of it
    (done,) = h.wait([(0, h.engines[0].send(h.addrs[1], big, now=h.now, reliable=True))])
    rate_big, bound_big = RateMonitor.sample(SendReport(("h", 1), 0, big.size, big.size, 1.0, raw=done.report))
    assert rate_big == pytest.approx(100e6, rel=0.2) and not bound_big
    m = RateMonitor(1.0, now=0.0)
    m.observe(rep, src="worker:0", dst="server:0")
    assert m.samples == 1 and m.lower_bounds == 1
    assert m.take(1.0) is None  # a lower bound alone makes no estimate
    m.observe(_recv(20_000_000, 0.3, _Raw(80e6, 0.04)), src="worker:0", dst="server:0")  # fills the pipe: a rate
    m.observe(_recv(20_000, 0.04, _Raw(0.5e6, 0.04)), src="worker:0", dst="server:0")  # lower: no news
    assert m.take(2.0)[0]["worker:0"] == pytest.approx(80e6)
    m.observe(_recv(20_000, 0.04, _Raw(120e6, 0.04)), src="worker:0", dst="server:0")  # a higher bound raises it
    assert m.take(3.0)[0]["worker:0"] == pytest.approx(100e6)


def test_rate_monitor_uses_btlbw_then_goodput_and_refreshes_every_t_lag():
    m = RateMonitor(1.0, now=0.0)
    m.observe(_recv(100, 0.001, _Raw(10e6)), src="worker:0", dst="server:0")  # BtlBw: 10 MB/s (bytes/s, as on the wire)
    m.observe(_recv(100, 1e-6), src="worker:1", dst="server:0")  # too small to say anything
    m.observe(SendReport(("h", 1), 0, 2 * MIN_RATE_SAMPLE_BYTES, 2 * MIN_RATE_SAMPLE_BYTES, 1.0, duration_s=0.01),
              src="server:0", dst="worker:2")
    assert m.take(0.5) is None  # before t_lag
    up, down = m.take(1.0)
    assert up["worker:0"] == pytest.approx(10e6) and "worker:1" not in up
    assert down["worker:2"] == pytest.approx(2 * MIN_RATE_SAMPLE_BYTES / 0.01)
    assert m.next_deadline() == pytest.approx(2.0)
    m.observe(_recv(100, 0.001, _Raw(5e6)), src="worker:0", dst="server:0")  # smoothed
    assert m.take(2.0)[0]["worker:0"] == pytest.approx(7.5e6)
    with pytest.raises(ValueError):
        RateMonitor(0)


# -- the driver over the memory transport ------------------------------------------------------------------------------

class _Scripted(Controller):
    """A controller that returns scripted grants and records every call (virtual-clock free)."""

    def __init__(self, script, deadline=None):
        self.script = script  # event type name -> grants
        self.events: list = []
        self.timer_calls: list = []
        self.rates: list = []
        self.deadline = deadline

    def start(self, iteration, nodes, *, now):
        self.nodes = list(nodes)
        return list(self.script.get("start", []))

    def on_event(self, event, *, now):
        self.events.append((now, event))
        return list(self.script.pop(type(event).__name__, []))

    def next_deadline(self):
        return self.deadline

    def on_timer(self, *, now):
        self.timer_calls.append(now)
        self.deadline = None
        return list(self.script.pop("timer", []))

    def update_rates(self, up=None, down=None, *, now):
        self.rates.append((now, up, down))

    def done(self):
        return not self.script


def _nodes(net, n):
    nodes = [server(0)] + [worker(r) for r in range(n)]
    eps = {x: net.endpoint() for x in nodes}
    addrs = {x: eps[x].local_addr for x in nodes}
    return nodes, eps, {x: Executor(eps[x], x, addrs, timeout_s=5.0) for x in nodes}


async def test_grants_reach_nodes_in_order_not_before_start_and_receives_become_events():
    net = MemoryNetwork(segment_size=512, seed=1)
    nodes, eps, exes = _nodes(net, 2)
    g = np.arange(64, dtype=np.float32)
    wslots = {w: Slots() for w in nodes[1:]}
    for w in nodes[1:]:
        wslots[w].put_partial("grad", Partial.of_gradient(g + int(w[-1])))
    t_tag = tags.pack(0, tags.PHASE_PUSH, 1, 0, 5)
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    script = {"start": [Grant(worker(0), (Send(worker(1), "grad", 0, 64, t_tag),), start_at=t0 + 0.3),
                        Grant(worker(1), (Recv(worker(0), "in", 0, 64, t_tag),)),
                        Grant(worker(1), (Combine("acc", "in", 0, 64), Combine("acc", "grad", 0, 64)))]}
    ctrl = _Scripted(script)
    reports: list = []
    drv_chans = {w: ControlChannel(exes[server(0)], w, out_dir=DOWN, in_dir=UP) for w in nodes[1:]}
    drv = ControllerDriver(ctrl, exes[server(0)], Slots(),
                           deliver=lambda node, gr: drv_chans[node].send({"grant": gr.to_json()}))
    fols = {w: GrantFollower(ControlChannel(exes[w], server(0), out_dir=UP, in_dir=DOWN), wslots[w], timeout_s=5.0,
                             after_grant=lambda gr, reps: reports.append(gr)) for w in nodes[1:]}
    tasks = [asyncio.ensure_future(f.run()) for f in fols.values()]

    async def listen(w):
        ch = drv_chans[w]
        while True:
            msg = await ch.recv(5.0)
            if msg is None:
                return
            drv.feed(event_from_json(msg, w))

    listeners = [asyncio.ensure_future(listen(w)) for w in nodes[1:]]
    drv.start(nodes[1:])
    while not any(isinstance(e, TransferDone) for _, e in ctrl.events):
        await asyncio.sleep(0.01)
    while len(reports) < 3:
        await asyncio.sleep(0.01)
    done = [e for _, e in ctrl.events if isinstance(e, TransferDone)]
    assert done == [TransferDone(worker(0), worker(1), t_tag, True, done[0].duration_s)]
    assert ctrl.events[0][0] >= t0 + 0.3  # the send was granted at its start time, not before
    acc = wslots[worker(1)].partial("acc", 0, 64)
    assert acc.contributors == 2
    np.testing.assert_allclose(acc.mean("unbiased"), g + 0.5)
    assert [gr.node for gr in reports].count(worker(1)) == 2  # worker 1's two grants, in issue order
    for ch in drv_chans.values():
        await ch.send({"stop": True})
    assert all(isinstance(r, dict) for r in await asyncio.gather(*tasks))
    for t in listeners:
        t.cancel()
    await asyncio.gather(*listeners, return_exceptions=True)
    await drv.close()


async def test_undeliverable_grant_reports_node_failed_and_later_grants_to_it_are_skipped():
    net = MemoryNetwork(segment_size=512, seed=1)
    nodes, eps, exes = _nodes(net, 2)
    ctrl = _Scripted({"start": [Grant(worker(1), (), drop=True), Grant(worker(1), (), drop=True)]})
    calls = []

    async def deliver(node, g):
        calls.append(node)
        raise ConnectionError("gone")

    drv = ControllerDriver(ctrl, exes[server(0)], Slots(), deliver=deliver)
    drv.start(nodes[1:])
    for _ in range(100):
        if ctrl.events:
            break
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.05)
    assert [type(e).__name__ for _, e in ctrl.events] == ["NodeFailed"]
    assert calls == [worker(1)] and drv.failed == {worker(1)}
    drv.feed(NodeFailed(worker(1), "again"))  # reported once
    assert len(ctrl.events) == 1
    await drv.close()


async def test_timer_fires_at_the_deadline_and_rates_are_refreshed_every_t_lag():
    net = MemoryNetwork(segment_size=512, seed=1)
    nodes, eps, exes = _nodes(net, 1)
    loop = asyncio.get_running_loop()
    ctrl = _Scripted({}, deadline=loop.time() + 0.15)

    async def deliver(node, g):
        return None

    drv = ControllerDriver(ctrl, exes[server(0)], Slots(), deliver=deliver, t_lag_s=0.1)
    drv.monitor.observe(_recv(100, 0.001, _Raw(1e6)), src=worker(0), dst=server(0))
    t0 = loop.time()
    drv.start(nodes[1:])
    await asyncio.sleep(0.4)
    assert len(ctrl.timer_calls) == 1 and ctrl.timer_calls[0] >= t0 + 0.14
    assert ctrl.rates and ctrl.rates[0][1] == {worker(0): pytest.approx(1e6)}
    assert drv.counters["rate_updates"] == len(ctrl.rates)
    await drv.close()
    assert drv._timer.done()


async def test_host_grants_run_locally_and_feed_transfer_done():
    net = MemoryNetwork(segment_size=512, seed=3)
    nodes, eps, exes = _nodes(net, 1)
    t_tag = tags.pack(1, tags.PHASE_PUSH, 1, 0, 5)
    applied = []

    class H:
        def apply(self, step, slots):
            applied.append(slots.partial(step.slot, step.lo, step.hi).contributors)

    from ltp_ps.schedules.program import Apply

    ctrl = _Scripted({"start": [Grant(server(0), (Recv(worker(0), "in", 0, 32, t_tag),)),
                                Grant(server(0), (Apply("in", 0, 32),))]})
    drv = ControllerDriver(ctrl, exes[server(0)], Slots(), H(), deliver=lambda n, g: asyncio.sleep(0))
    drv.start(nodes[1:])
    ws = Slots()
    ws.put_partial("grad", Partial.of_gradient(np.ones(32, np.float32)))
    from ltp_ps.schedules.program import Program

    await exes[worker(0)].run(Program(worker(0), ((Send(server(0), "grad", 0, 32, t_tag),),)), ws)
    for _ in range(200):
        if applied:
            break
        await asyncio.sleep(0.01)
    assert applied == [1]
    assert [type(e).__name__ for _, e in ctrl.events] == ["TransferDone"] and ctrl.events[0][1].ok
    await drv.close()


async def test_grants_queued_for_one_node_go_in_one_batch_and_a_timed_grant_alone():
    net = MemoryNetwork(segment_size=512, seed=1)
    nodes, eps, exes = _nodes(net, 2)
    t0 = asyncio.get_running_loop().time()
    plain = [Grant(worker(1), (), drop=True, reason=f"g{i}") for i in range(5)]
    timed = Grant(worker(1), (), drop=True, reason="timed", start_at=t0 + 0.05)
    ctrl = _Scripted({"start": [plain[0], plain[1], plain[2], timed, plain[3], plain[4],
                                Grant(worker(0), (), drop=True, reason="w0")]})
    calls = []

    async def deliver(node, g):
        calls.append((node, [g.reason]))
        await asyncio.sleep(0.01)

    async def deliver_batch(node, gs):
        calls.append((node, [g.reason for g in gs]))
        await asyncio.sleep(0.01)

    drv = ControllerDriver(ctrl, exes[server(0)], Slots(), deliver=deliver, deliver_batch=deliver_batch)
    drv.start(nodes[1:])
    for _ in range(100):
        if drv.counters["delivered"] == 7:
            break
        await asyncio.sleep(0.01)
    # what is queued for one node goes in one call, in order; the timed grant breaks the batch and goes alone
    mine = [r for n, r in calls if n == worker(1)]
    assert mine == [["g0", "g1", "g2"], ["timed"], ["g3", "g4"]]
    assert [r for n, r in calls if n == worker(0)] == [["w0"]]
    assert drv.counters["delivered"] == 7
    await drv.close()


def test_transfer_events_count_a_reliable_chunk_cut_short_as_failed():
    """A reliable parameter chunk that stopped short (bytes in, then a timeout) is not 'done': Hoplite's directory
    must re-route it, and the worker must not relay or compute on it; a tolerant partial with bytes is done."""
    from ltp_ps.schedules.driver import transfer_events
    from ltp_ps.schedules.program import RELIABLE, TOLERANT, Recv
    from ltp_ps.transport.base import COMPLETE, TIMEOUT, RecvReport

    whole = RecvReport(("h", 1), 5, 1000, 1000, 1.0)
    cut = RecvReport(("h", 1), 5, 1000, 600, 0.6, bubbles=((600, 1000),), regime=TIMEOUT)
    holes = RecvReport(("h", 1), 5, 1000, 900, 0.9, bubbles=((100, 200),), regime=COMPLETE)
    params = Recv("worker:1", "p", 0, 250, 5, RELIABLE, "params")
    partial = Recv("worker:1", "q", 0, 250, 5, TOLERANT, "partial")
    assert whole.complete and not cut.complete and not holes.complete
    evs = transfer_events("worker:0", [params, params, params, partial], [whole, cut, holes, cut])
    assert [e.ok for e in evs] == [True, False, False, True]


async def test_a_control_send_cancelled_after_taking_its_number_does_not_block_the_stream():
    """Cancelling a ``send`` (the PS's driver closing with a grant on its way) must not leave a hole in the stream:
    the message that took sequence ``k`` still goes, so the peer reads it and then whatever follows (the STOP)
    instead of waiting for ``k`` until its pull timeout."""
    for cancel_after in range(6):  # cancel at each await of the send's way out, the first ones included
        net = MemoryNetwork(segment_size=512, seed=1)
        nodes, eps, exes = _nodes(net, 1)
        ps_ch = ControlChannel(exes[server(0)], worker(0), out_dir=DOWN, in_dir=UP)
        w_ch = ControlChannel(exes[worker(0)], server(0), out_dir=UP, in_dir=DOWN)
        t = asyncio.ensure_future(ps_ch.send({"grant": "g"}, timeout_s=2.0))
        for _ in range(cancel_after):
            await asyncio.sleep(0)
        t.cancel()
        await asyncio.gather(t, return_exceptions=True)
        await asyncio.wait_for(ps_ch.send({"stop": True}, timeout_s=2.0), 3.0)
        got = [await w_ch.recv(1.0), await w_ch.recv(1.0)]
        if ps_ch.out_seq == 1:  # cancelled before it took a number: only the STOP was sent
            assert got[0] == {"stop": True} and got[1] is None, (cancel_after, got)
        else:
            assert got == [{"grant": "g"}, {"stop": True}], (cancel_after, got)
