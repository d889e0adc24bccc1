"""The engine's side of a drained bulk receive: :meth:`Engine.bulk_flow` and :meth:`Engine.bulk_ingested`.

An adapter that drains the socket straight into the bulk flow's window (``UdpIO.drain``) must leave the
engine exactly where :meth:`Engine.receive_batch` would have: same bytes, same counters, same reports,
under loss, reordering and duplicates (virtual clock, seeded). The engine below does what the endpoint
does, one datagram at a time: DATA of the bulk flow goes to the window and is reported afterwards.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from ltp.config import Config
from ltp.engine import QUICKACK_SEGMENTS, Engine
from ltp.errors import LocalProtocolError
from ltp.sim import SimNetwork

_ONE = np.zeros(1, np.int64)


class DrainingEngine(Engine):
    """Feeds the bulk flow's DATA into its window itself, as the endpoint's drain does, in runs of ``run``."""

    def __init__(self, *args, run: int = 5, **kw):
        super().__init__(*args, **kw)
        self.run_len = run
        self.held: list = []  # (flow, datagrams, bytes) ingested and not yet reported
        self.drained = 0

    def receive_datagram(self, data, addr, now: float) -> None:
        flow = self.bulk_flow()
        if flow is not None and addr == flow.peer:
            n = len(data)
            if flow.window.ingest(np.frombuffer(bytes(data), np.uint8), _ONE, np.array([n], np.int64), 0, 1) == 1:
                self.drained += 1
                self.held.append(n)
                if len(self.held) >= self.run_len or flow.window.received >= flow.window.seg_count:
                    self._report(flow, now)
                return
        if self.held and flow is not None:
            self._report(flow, now)  # what was drained is accounted for before anything else is processed
        super().receive_datagram(data, addr, now)

    def handle_timer(self, now: float) -> None:
        flow = self.bulk_flow()
        if self.held and flow is not None:
            self._report(flow, now)
        super().handle_timer(now)

    def _report(self, flow, now: float) -> None:
        held, self.held = self.held, []
        self.bulk_ingested(flow, len(held), sum(held), now)


def _run(draining: bool, *, loss: float, seed: int, size: int, reliable: bool, dup: float = 0.0,
         jitter_s: float = 0.0002):
    net = SimNetwork(seed=seed)
    a_addr, b_addr = ("10.0.0.1", 7447), ("10.0.0.2", 7447)
    cfg = Config()
    a = Engine(cfg, rng=random.Random(seed))
    b = (DrainingEngine if draining else Engine)(cfg, rng=random.Random(seed + 1))
    net.add_host(a_addr, a)
    net.add_host(b_addr, b)
    net.set_link(a_addr, b_addr, rate=125e6, delay_s=0.0005, loss=loss, duplicate=dup, jitter_s=jitter_s)
    net.set_link(b_addr, a_addr, rate=125e6, delay_s=0.0005)
    data = np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)
    out = np.zeros(size, np.uint8)
    hs = a.send(b_addr, data, now=net.now, reliable=reliable, tag=1)
    hr = b.post_receive([(a_addr, 1, out)], now=net.now)
    events = {}

    def done():
        for key, eng in (("a", a), ("b", b)):
            while (ev := eng.next_event()) is not None:
                events[(key, ev.handle)] = ev
        return ("a", hs) in events and ("b", hr) in events

    net.run(until=30.0, stop=done)
    assert done(), "the transfer did not finish"
    return data, out, events[("a", hs)], events[("b", hr)], b


@pytest.mark.parametrize("seed", [1, 2])
@pytest.mark.parametrize("loss,dup", [(0.0, 0.0), (0.02, 0.01)])
def test_a_drained_reliable_receive_is_exact_and_accounted_like_the_per_batch_path(seed, loss, dup):
    data, out, _, rep, b = _run(True, loss=loss, dup=dup, seed=seed, size=3_000_000, reliable=True)
    assert np.array_equal(out, data)
    assert b.drained > 0.8 * (3_000_000 // 1456)  # most DATA took the drained path
    # the counters include the drained datagrams: everything the receiver read, nothing twice
    rx = b.stats
    assert b.drained < rx.datagrams_in <= b.drained + 2 * (1 + rx.datagrams_in - b.drained)
    assert rx.bytes_in >= 3_000_000 + 16 * b.drained
    assert rep.error is None and rep.reports[0].delivered_fraction == 1.0
    assert rep.reports[0].regime == "complete"


def test_counters_match_the_per_batch_path_exactly_on_a_lossless_path():
    """No loss, no jitter: both receivers see the same datagrams in the same order, so every counter agrees."""
    _, out, sent_d, _, drained = _run(True, loss=0.0, seed=4, size=2_000_000, reliable=True, jitter_s=0.0)
    _, _, sent_p, _, plain = _run(False, loss=0.0, seed=4, size=2_000_000, reliable=True, jitter_s=0.0)
    assert drained.drained > 1000
    assert drained.stats.datagrams_in == plain.stats.datagrams_in
    assert drained.stats.bytes_in == plain.stats.bytes_in
    assert drained.stats.dropped == plain.stats.dropped
    assert sent_d.report.delivered_bytes == sent_p.report.delivered_bytes == 2_000_000
    assert sent_d.report.retransmitted_packets == 0


def test_a_drained_tolerant_receive_still_closes_early_under_loss():
    data, out, sent, rep, b = _run(True, loss=0.05, seed=3, size=4_000_000, reliable=False)
    assert b.drained > 0
    r = rep.reports[0]
    assert rep.error is None and 0.5 < r.delivered_fraction <= 1.0
    assert r.delivered_fraction == r.received_bytes / r.total_bytes
    assert sent.report.delivered_bytes >= r.received_bytes
    assert r.regime == "early"  # the tail was cut: Early Close ran on the drained flow
    # the same transfer through receive_batch ends the same way (the drain reports per 5 datagrams here)
    _, _, _, ref, plain = _run(False, loss=0.05, seed=3, size=4_000_000, reliable=False)
    assert ref.reports[0].regime == "early"
    assert abs(ref.reports[0].delivered_fraction - r.delivered_fraction) < 0.01
    got = np.flatnonzero(out != 0)
    assert got.size and np.array_equal(out[got], data[got])  # what arrived is exact; bubbles are zeros


def test_bulk_flow_is_the_lone_receive_past_its_first_segments_only():
    net = SimNetwork(seed=0)
    addrs = [("10.0.0.1", 7447), ("10.0.0.2", 7447), ("10.0.0.3", 7447)]
    engs = [Engine(Config(), rng=random.Random(i)) for i in range(3)]
    for addr, e in zip(addrs, engs):
        net.add_host(addr, e)
    for i in range(3):
        for j in range(3):
            if i != j:
                net.set_link(addrs[i], addrs[j], rate=12.5e6, delay_s=0.001)
    rx = engs[2]
    assert rx.bulk_flow() is None  # nothing open
    size = 1456 * (QUICKACK_SEGMENTS + 200)
    outs = [np.zeros(size, np.uint8), np.zeros(size, np.uint8)]
    engs[0].send(addrs[2], np.ones(size, np.uint8), now=0.0, tag=0, reliable=True)
    rx.post_receive([(addrs[0], 0, outs[0])], now=0.0)
    seen = []

    def first_segments():
        flow = next(iter(rx._rx.values()), None)
        if flow is not None:
            seen.append((flow.window.received, rx.bulk_flow() is flow))
        return flow is not None and flow.window.received > QUICKACK_SEGMENTS

    net.run(until=5.0, stop=first_segments)
    assert seen and all(is_bulk == (n > QUICKACK_SEGMENTS) for n, is_bulk in seen)
    assert rx.bulk_flow() is next(iter(rx._rx.values()))
    # a second open receive: every batch goes through receive_batch again
    engs[1].send(addrs[2], np.ones(size, np.uint8), now=net.now, tag=1, reliable=True)
    rx.post_receive([(addrs[1], 1, outs[1])], now=net.now)
    net.run(until=net.now + 5.0, stop=lambda: len(rx._rx) == 2)
    assert len(rx._rx) == 2 and rx.bulk_flow() is None


def test_bulk_ingested_refuses_a_flow_that_is_not_open():
    data, out, _, _, b = _run(True, loss=0.0, seed=5, size=600_000, reliable=True)
    assert b.bulk_flow() is None  # the receive completed and closed

    class Gone:
        key = ("10.0.0.1", 7447, 99)

    with pytest.raises(LocalProtocolError, match="bulk_flow"):
        b.bulk_ingested(Gone(), 3, 300, 1.0)
    b.bulk_ingested(Gone(), 0, 0, 1.0)  # nothing to account for: a no-op
