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


def _spread_transfer(harness, floats, *, lanes_built: bool, loss: float, seed: int = 3, learn: bool = False):
    """A 6 MB reliable transfer between two gather-send engines with ``Config.spread_sends`` (two sender threads)
    on a simulated 10 Gbit/s path whose network sends each batch's parts interleaved, last part first. With
    ``lanes_built`` False the path builds every batch in one lane while the network still interleaves its halves:
    loss detection before lanes. Returns (report, retransmitted packets, batches sent in parts)."""
    # ACKs every 512 packets and bursts of 256 or more: batches large enough to be built in two lanes (the
    # simulator pumps an engine on every arrival, where an event loop gathers what arrived in a tick)
    cfg = Config(spread_sends=True, send_threads=2, ack_every=512, min_burst_packets=256, learn_reordering=learn)
    h = harness(seed=seed, config=cfg, gather_send=True, interleave_parts=True)
    h.link(0, 1, rate=1.25e9, delay_s=0.0002, loss=loss, loss_min_size=200)
    h.link(1, 0, rate=1.25e9, delay_s=0.0002)
    spread = []
    real_poll = None
    if not lanes_built:
        from ltp.path import Path
        real_poll = Path.poll

        def one_lane_poll(self, now, *, fresh=False, spread=True):
            tx = real_poll(self, now, fresh=fresh, spread=False)
            if tx is not None and hasattr(tx, "parts"):
                tx.parts = 2 if len(tx) >= 256 else 1  # the threads still cut it
            return tx
        Path.poll = one_lane_poll
    try:
        in_order = h.net._in_wire_order

        def counted(tx):  # note each batch's parts on its way out
            spread.append(getattr(tx, "parts", 1))
            return in_order(tx)
        h.net._in_wire_order = counted
        rep, _ = _reliable_transfer(h, floats(1_500_000, seed), timeout_s=30)
        return rep, rep.retransmitted_packets, sum(p > 1 for p in spread)
    finally:
        if real_poll is not None:
            from ltp.path import Path
            Path.poll = real_poll


@pytest.mark.parametrize("loss", [0.0, 0.02])
def test_interleaved_parts_of_a_batch_built_in_lanes_cost_no_spurious_resends(harness, floats, loss):
    """Sender threads send a spread batch's parts side by side, so they interleave on the wire. Loss detection
    counts each lane apart: with no loss nothing is resent, with 2 % loss about the lost packets are (each lost
    packet once or a little more). Built in one lane, the same interleaving trips the 3-out-of-order rule on a
    clean path. (Measured, both implementations: 0 of 4,121 packets resent at 0 %, 86 of 4,207 at 2 %; in one
    lane 496 of 4,617 at 0 %.)"""
    rep, resent, spread = _spread_transfer(harness, floats, lanes_built=True, loss=loss)
    assert spread > 10, spread  # most batches went out in two interleaved parts
    n = rep.packets_sent - rep.retransmitted_packets
    if loss:
        assert 0.5 * loss * n <= resent <= 2.0 * loss * n, (resent, n)
    else:
        assert resent == 0, rep
    assert rep.spurious_losses == 0, rep
    if not loss:  # one lane: the interleaving is reordering, which the sender learns from its wrong verdicts
        one, resent_one_lane, spread = _spread_transfer(harness, floats, lanes_built=False, loss=0.0)
        assert spread > 10 and resent_one_lane > 0.05 * n and one.spurious_losses > 0, one


def test_a_path_that_proved_to_reorder_costs_a_fraction_of_the_resends(harness, floats):
    """The same interleaving built in one lane is a path that reorders. Once ACKs prove its first loss verdicts
    wrong, a sender with ``Config.learn_reordering`` turns the packet-count rule off and widens the RACK window
    (ltp/reordering.py): 126 of 4,247 packets resent (both implementations), against 496 when it does not learn
    (the default). The transfer is exact either way."""
    learned, resent_learned, _ = _spread_transfer(harness, floats, lanes_built=False, loss=0.0, learn=True)
    blind, resent_blind, _ = _spread_transfer(harness, floats, lanes_built=False, loss=0.0)
    assert resent_learned < 0.5 * resent_blind, (resent_learned, resent_blind)
    assert learned.spurious_losses < 0.5 * blind.spurious_losses, (learned, blind)


def test_a_path_that_reorders_and_loses_still_resends_every_lost_packet(harness, floats):
    """With the packet-count rule off (the path proved to reorder), real losses are found by the RACK time rule
    and the tail-loss timer: the transfer is exact (``_spread_transfer`` checks every byte) and the path did learn."""
    rep, resent, _ = _spread_transfer(harness, floats, lanes_built=False, loss=0.02, learn=True)
    n = rep.packets_sent - resent
    assert rep.spurious_losses > 0 and resent >= 0.5 * 0.02 * n, rep


def _jittery_transfer(harness, floats, *, jitter_s, loss, seed, learn):
    """A 8 MB reliable transfer over 1 Gbit/s, 2 ms one way, with up to ``jitter_s`` of random extra delay per
    packet (which reorders them) and ``loss`` on the DATA: (report, seconds)."""
    h = harness(seed=seed, config=Config(learn_reordering=learn))
    h.link(0, 1, rate=1.25e8, delay_s=0.002, jitter_s=jitter_s, loss=loss, loss_min_size=200)
    h.link(1, 0, rate=1.25e8, delay_s=0.002)
    return _reliable_transfer(h, floats(2_000_000, seed), timeout_s=60)


def _reliable_transfer(h, data, *, timeout_s):
    """Send ``data`` reliably from engine 0 to engine 1 of the harness ``h`` and check every byte arrived: (the
    sender's report, seconds from send to both ends done)."""
    out = np.zeros_like(data)
    a, b = h.engines
    t0 = h.now
    s = a.send(h.addrs[1], data, now=t0, reliable=True, tag=5)
    r = b.post_receive([(h.addrs[0], 5, out)], now=t0)
    sent, _ = h.wait([(0, s), (1, r)], timeout=timeout_s)
    assert np.array_equal(out, data)
    return sent.report, h.now - t0


@pytest.mark.parametrize("jitter_s,loss,seed", [(0.0005, 0.0, 1), (0.002, 0.0, 2), (0.002, 0.01, 3), (0.004, 0.03, 4)])
def test_a_jittery_path_is_learned_and_costs_few_resends(harness, floats, jitter_s, loss, seed):
    """Random per-packet delay reorders a path as multipath routing does. Learning from its wrong verdicts
    (``Config.learn_reordering``, ltp/reordering.py), the sender resends about the lost packets (and what its
    tail-loss timer resends when the jitter outlasts it); blind to them (the default) it resends about a sixth of
    the message. Resends learning / blind, of about 5,500 packets (both implementations): 6 / 284 (0.5 ms
    jitter, 0 %), 28 / 1,028 (2 ms, 0 %),
    110 / 1,059 (2 ms, 1 %), 286 / 1,337 (4 ms, 3 %); learning took 0.080-0.102 s, at most 2 % longer than
    blind (4 ms, 3 %) and 8 % shorter at 2 ms, 1 %."""
    learned, t_learned = _jittery_transfer(harness, floats, jitter_s=jitter_s, loss=loss, seed=seed, learn=True)
    blind, t_blind = _jittery_transfer(harness, floats, jitter_s=jitter_s, loss=loss, seed=seed, learn=False)
    n = learned.packets_sent - learned.retransmitted_packets
    assert learned.retransmitted_packets <= 3 * loss * n + 0.01 * n, learned
    assert learned.retransmitted_packets < 0.5 * blind.retransmitted_packets, (learned, blind)
    assert t_learned <= 1.05 * t_blind, (t_learned, t_blind)
