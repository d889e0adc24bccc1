"""RACK time threshold (RFC 8985) beside the 3-out-of-order rule: a loss among a message's last packets.

The packet-threshold rule needs three later transmissions acknowledged, which the last two packets of a flight
never have; before this rule their loss waited for the tail-loss timer, re-armed by every ACK (about 2.5 round
trips from the send). Now a transmission that a later one overtook is lost one round trip (the newest acknowledged
transmission's) plus a reordering window (RTprop / 4) after it was sent, by the ACK that shows it or by the
``REORDER`` timer. Deterministic: the simulator with a virtual clock and a filter that drops chosen packets.
"""

from __future__ import annotations

import numpy as np
import pytest

from ltp import wire
from ltp.config import Config
from ltp.timers import Timer

GBIT = 125e6


def _drop_first_copy_of(seqs):
    left = set(seqs)

    def drop(d) -> bool:
        if d[0] & 0x0F == wire.T_DATA:
            w2 = wire.unpack_header(memoryview(d))[4]
            if w2 >> 8 in left and w2 & 0xFF == 1:
                left.discard(w2 >> 8)
                return True
        return False
    return drop


def _message_time(harness, floats, *, one_way, lost_from_end, reliable, warm=True):
    """Seconds from send to the receiver's completion of a 21-packet message whose packet ``lost_from_end``
    from its end loses its first copy (after ``warm`` messages taught the path its RTT)."""
    h = harness(seed=2, config=Config())
    h.link(1, 0, rate=GBIT, delay_s=one_way)
    data = floats(7500)  # 30 kB: 21 packets of 1456 bytes
    n = -(-data.nbytes // 1456)
    a, b = h.engines
    for tag in range(3 if warm else 0):  # a clean path: RTT and RTprop known
        h.link(0, 1, rate=GBIT, delay_s=one_way)
        s = a.send(h.addrs[1], data, now=h.now, tag=tag, reliable=reliable)
        r = b.post_receive([(h.addrs[0], tag, np.zeros_like(data))], now=h.now)
        h.wait([(0, s), (1, r)])
    h.link(0, 1, rate=GBIT, delay_s=one_way, drop_if=_drop_first_copy_of([n - 1 - lost_from_end]))
    t0 = h.now
    buf = np.zeros_like(data)
    s = a.send(h.addrs[1], data, now=t0, tag=99, reliable=reliable)
    r = b.post_receive([(h.addrs[0], 99, buf)], now=t0)
    (got,) = h.wait([(1, r)])
    took = h.now - t0
    h.wait([(0, s)])
    return took, got.reports[0], buf, data


@pytest.mark.parametrize("one_way", [0.001, 0.010, 0.040])
@pytest.mark.parametrize("lost_from_end", [1, 2])
def test_a_loss_among_the_last_packets_is_resent_a_round_trip_after_it_was_sent(harness, floats, one_way,
                                                                                 lost_from_end):
    took, rep, buf, data = _message_time(harness, floats, one_way=one_way, lost_from_end=lost_from_end,
                                         reliable=True)
    assert rep.delivered_fraction == 1.0 and np.array_equal(buf, data)
    rtt = 2 * one_way
    # sent at ~0, its successor's ACK back at 1 RTT, declared lost at 1 RTT + RTprop/4 (+ ACK delay and a
    # pacing tick), the copy arrives a one-way later: 1.85-2.0 RTT in all. The tail-loss timer alone took
    # 2.9-4.0 RTT (this bound fails then at every delay here).
    bound = 1.5 * rtt + one_way + Config().ack_delay_s + 0.002
    assert took <= bound, (took, bound)


def test_the_reorder_timer_is_armed_while_an_overtaken_transmission_waits(harness, floats):
    h = harness(seed=2, config=Config())
    one_way = 0.010
    h.link(1, 0, rate=GBIT, delay_s=one_way)
    h.link(0, 1, rate=GBIT, delay_s=one_way)
    a, b = h.engines
    data = floats(7500)
    for tag in range(2):
        s = a.send(h.addrs[1], data, now=h.now, tag=tag, reliable=True)
        r = b.post_receive([(h.addrs[0], tag, np.zeros_like(data))], now=h.now)
        h.wait([(0, s), (1, r)])
    h.link(0, 1, rate=GBIT, delay_s=one_way, drop_if=_drop_first_copy_of([19]))
    t0 = h.now
    a.send(h.addrs[1], data, now=t0, tag=5, reliable=True)
    b.post_receive([(h.addrs[0], 5, np.zeros_like(data))], now=t0)
    seen = None
    while h.now < t0 + 0.1:  # step the clock until the ACK that shows 20 overtook 19 has arrived
        h.net.run(until=h.now + 0.0005)
        at = a.timers().get(Timer.REORDER)
        if at is not None:
            seen = at
            break
    assert seen is not None, "no REORDER timer while segment 19 was overtaken"
    flow = next(iter(a._tx.values()))
    assert seen == pytest.approx(flow.window.sent_time[19] + flow.rack_rtt + a._paths[h.addrs[1]].reorder_window(flow))


def test_a_clean_path_declares_nothing_lost(harness, floats):
    """No loss, no reordering: once the path knows its RTT, RACK never fires (no spurious loss). (The first
    message's start-up probe timeout, 8 ms before any RTT sample, is older than this rule and not RACK's.)"""
    h = harness(seed=4, config=Config())
    h.links(rate=GBIT, delay_s=0.005, jitter_s=0.0)
    a, b = h.engines
    data = floats(200_000)
    for tag in range(4):
        s = a.send(h.addrs[1], data, now=h.now, tag=tag, reliable=True)
        r = b.post_receive([(h.addrs[0], tag, np.zeros_like(data))], now=h.now)
        sent, _ = h.wait([(0, s), (1, r)])
        assert sent.report.retransmitted_packets == 0, sent.report
        assert tag == 0 or sent.report.lost_packets == 0, sent.report
