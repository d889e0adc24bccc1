"""Sequential messages on rate-limited paths (issue 8: the ring all-reduce's transfer pattern).

A ring all-reduce over N hosts is 2(N-1) steps; in each, every host sends one
message to its right neighbour and receives one from its left, and the next
step starts when both are done. These tests drive that pattern on the
deterministic simulator (virtual clock, seeded loss) and pin what the
transport gets right today — the path's BBR state outlives each message, so a
message after the first pays no start-up and takes close to its wire time —
and bound what it costs when every host link carries data one way and ACKs the
other (docs/performance.md, "Sequential messages on rate-limited links": the
ACKs wait in the receiver's own uplink queue behind its data). The lab
reproduction is ``python -m ltp_tools.seq_messages`` (tested at the end).
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from ltp import wire as wire_mod
from ltp.bbr import STARTUP
from ltp.config import Config
from ltp.sender import FlowSender
from ltp.sim import SimLink
from ltp_tools import seq_messages

RATE = 12.5e6  # bytes/s: a 100 Mbit/s tbf
QUEUE = 62_500  # bytes: the lab's tbf queue at 100 Mbit/s (5 ms)
DELAY = 0.0001  # one-way propagation, s
SIZE = 667_000 - 667_000 % 4  # one ring step of a 4 MB all-reduce over 6 hosts
SEG = 1456  # payload bytes per datagram at MTU 1500
RTT = 2 * DELAY + 0.001  # propagation both ways plus the ACK delay and a pacing-timer period


def _wire_s(size: int) -> float:
    """Time one message occupies a RATE link: payload plus LTP, UDP and IP headers (the simulator adds 28)."""
    return (size + -(-size // SEG) * (16 + 28)) / RATE


def _one_way(harness, *, reliable: bool, count: int, seed: int, post_late_s: float = 0.0, gap_s: float = 0.0):
    h = harness(n_hosts=2, seed=seed, config=Config())
    h.link(0, 1, rate=RATE, delay_s=DELAY, queue_bytes=QUEUE)
    h.link(1, 0, rate=RATE, delay_s=DELAY, queue_bytes=QUEUE)
    data = np.arange(SIZE // 4, dtype=np.float32)
    times, states = [], []
    for k in range(count):
        t0 = h.now
        buf = np.zeros_like(data)
        s = h.engines[0].send(h.addrs[1], data, now=t0, reliable=reliable, tag=k,
                              critical=() if reliable else [(0, 64)])
        if post_late_s:
            h.net.run(until=t0 + post_late_s)  # the receiver is still busy with the previous step
        r = h.engines[1].post_receive([(h.addrs[0], k, buf)], now=h.now)
        sent, got = h.wait([(0, s), (1, r)], timeout=10)
        assert sent.error is None and got.error is None
        rep = got.reports[0]
        assert rep.delivered_fraction == 1.0 and np.array_equal(buf, data)
        times.append(h.now - t0)
        states.append(h.engines[0]._paths[h.addrs[1]].bbr.state)
        if gap_s:
            h.net.run(until=h.now + gap_s)
    return times, states, h


@pytest.mark.parametrize("reliable", [True, False])
@pytest.mark.parametrize("seed", [0, 1])
def test_sequential_messages_each_take_wire_time(harness, reliable, seed):
    """After the first, every message takes <= 1.3 x its wire time + 1 RTT: no start-up per message."""
    times, states, h = _one_way(harness, reliable=reliable, count=6, seed=seed)
    wire = _wire_s(SIZE)
    assert max(times[1:]) <= 1.3 * wire + RTT, [round(t / wire, 3) for t in times]
    assert STARTUP not in states[1:]  # the path's model outlived each message
    assert len(h.engines[0]._paths) == 1


@pytest.mark.parametrize("post_late_s", [0.003, 0.030])
def test_receive_posted_after_the_data_started(harness, post_late_s):
    """The receiver posts its receive late (a ring neighbour still in the previous step): no re-registration
    round trip, the message is buffered and delivered, and the time stays near the wire time."""
    times, _, h = _one_way(harness, reliable=False, count=4, seed=2, post_late_s=post_late_s)
    wire = _wire_s(SIZE)
    assert max(times[1:]) <= 1.3 * wire + RTT + post_late_s * 0  # the send does not wait for the post
    assert h.engines[0].stats.reregistrations == 0
    assert h.engines[1].stats.dropped.get("unknown_flow", 0) == 0


def test_idle_gaps_between_messages_keep_the_model(harness):
    """A second of idle time between messages (an evaluation pause) does not send the path back to STARTUP."""
    times, states, _ = _one_way(harness, reliable=True, count=3, seed=4, gap_s=1.0)
    wire = _wire_s(SIZE)
    assert STARTUP not in states and max(times[1:]) <= 1.3 * wire + RTT


@pytest.mark.parametrize("size, delay_s", [(20_000, 0.04), (153_000, 0.04), (153_000, 0.01), (600_000, 0.02)])
def test_one_flight_messages_on_a_long_path_are_sent_once_and_not_paced_out_over_round_trips(harness, size,
                                                                                          delay_s):
    """A PS's gradients and parameters over a WAN: each message fits in one flight and the path idles between
    them. Two faults made such messages slow or wasteful: the first flight's ACKs gave no RTT sample (the
    start-up probe timeout had resent it), so every 20 kB message went out ~4x; and, once the RTT was learned,
    app-limited rounds ended STARTUP, so messages were paced at the BtlBw they themselves had shown (2.1 round
    trips each for 153 kB at 80 ms)."""
    h = harness(n_hosts=2, seed=7, config=Config())
    h.links(rate=125e6, delay_s=delay_s)  # 1 Gbit/s
    rtt = 2 * delay_s
    segs = -(-size // SEG)
    times, sent = [], 0
    for i in range(20):
        (done,) = h.wait([(0, h.engines[0].send(h.addrs[1], np.zeros(size, np.uint8), now=h.now, reliable=True,
                                                tag=i))])
        times.append(done.report.duration_s)
        sent += done.report.packets_sent
        h.net.run(until=h.now + 0.05)  # the worker computes
    assert sent <= 1.1 * 20 * segs, sent / (20 * segs)
    wire = (size + segs * (16 + 28)) / 125e6
    assert np.median(times[5:]) <= 1.65 * rtt + wire, [round(t / rtt, 2) for t in times]


def _ring(harness, n, *, steps, seed):
    """``n`` hosts in a ring; host i's one uplink carries its data to i+1 and its ACKs to i-1 (one FIFO)."""
    h = harness(n_hosts=n, seed=seed, config=Config())
    ups = [SimLink(rate=RATE, delay_s=DELAY, queue_bytes=QUEUE) for _ in range(n)]
    for i in range(n):
        for j in range(n):
            if i != j:
                h.net.links[(h.addrs[i], h.addrs[j])] = ups[i]
    data = [np.full(SIZE // 4, i + 1, np.float32) for i in range(n)]
    bufs = [np.zeros(SIZE // 4, np.float32) for _ in range(n)]
    times, fractions = [], []
    for step in range(steps):
        reliable = (step % (2 * (n - 1))) >= n - 1  # reduce-scatter tolerant, all-gather reliable
        t0 = h.now
        handles = [(i, h.engines[i].post_receive([(h.addrs[(i - 1) % n], step, bufs[i])], now=t0))
                   for i in range(n)]
        handles += [(i, h.engines[i].send(h.addrs[(i + 1) % n], data[i], now=t0, reliable=reliable, tag=step,
                                          critical=() if reliable else [(0, 64)])) for i in range(n)]
        events = h.wait(handles, timeout=30)
        for ev in events[:n]:
            assert ev.error is None
            rep = ev.reports[0]
            fractions.append(rep.delivered_fraction)
            if reliable:
                assert rep.delivered_fraction == 1.0
        for ev in events[n:]:
            assert ev.error is None
        times.append(h.now - t0)
    return times, sum(u.stats["queue_drop"] for u in ups), fractions


@pytest.mark.parametrize("n,seed", [(2, 0), (2, 3), (3, 1), (3, 2), (6, 0)])
def test_ring_steps_with_acks_sharing_the_uplink(harness, n, seed):
    """Ring steps whose ACKs share each host's uplink with its data: a bound, not the target.

    Measured (8 steps, seeds 0-5, 2 and 3 hosts): the slowest step 1.24-1.58x the wire time,
    5-18% of the data packets dropped at the uplink queues (LTP's BtlBw reads up to 1.8x the
    link rate from ACKs that waited behind the peer's data). The issue's target, 1.3x + 1 RTT
    for every step, is not met here; docs/performance.md says why and what was tried.
    Two hosts, seed 0 is the case that found the registration storm: the REG of step 3 was
    dropped at the sender's full uplink queue, the receiver answered 1558 DATA datagrams with
    RESET ``unregistered``, the sender kept sending (and the tail-loss timer re-sent it all) and
    the step took 4.5x its wire time (2699 datagrams for 459 segments)."""
    times, drops, fractions = _ring(harness, n, steps=2 * (n - 1) if n > 2 else 4, seed=seed)
    wire = _wire_s(SIZE)
    assert max(times[1:]) <= 1.8 * wire + RTT, [round(t / wire, 2) for t in times]
    assert min(fractions) >= 0.9


def _first_message_with_regs_lost(harness, lost_regs: int):
    """One SIZE message on a fresh RATE path whose first ``lost_regs`` REGs are dropped: (send, receiver engine)."""
    h = harness(n_hosts=2, seed=0, config=Config())
    h.link(0, 1, rate=RATE, delay_s=DELAY, queue_bytes=QUEUE)
    h.link(1, 0, rate=RATE, delay_s=DELAY, queue_bytes=QUEUE)
    left = [lost_regs]
    transmit = h.net._transmit

    def drop_regs(src, dst, data):
        if left[0] and src == h.addrs[0] and data[0] & 0xF == wire_mod.T_REG:
            left[0] -= 1
            return
        transmit(src, dst, data)

    h.net._transmit = drop_regs
    data = np.arange(SIZE // 4, dtype=np.float32)
    buf = np.zeros_like(data)
    r = h.engines[1].post_receive([(h.addrs[0], 7, buf)], now=0.0)
    s = h.engines[0].send(h.addrs[1], data, now=0.0, reliable=True, tag=7)
    sent, got = h.wait([(0, s), (1, r)])
    assert left[0] == 0 and sent.error is None and np.array_equal(buf, data)
    return sent, h.engines[1]


@pytest.mark.parametrize("lost_regs", [1, 2, 3])
def test_lost_registration_holds_data_until_a_reg_is_answered(harness, lost_regs):
    """The first REGs of a message are dropped: DATA the receiver cannot place is not sent on and on.

    The receiver answers DATA of a flow it does not know with RESET ``unregistered``; the sender
    holds its DATA from then until a repeated REG is answered. Before, it kept sending: 57, 171,
    399 DATA datagrams (1, 2, 3 REGs lost) were dropped as unknown and all of them sent again.
    The sends are held against the same message with no REG lost: STARTUP's own overshoot into this
    shallow queue is not the registration's doing (session 55: 65 of 524 packets, at the pacing
    floor Linux's BBR also keeps)."""
    baseline, _ = _first_message_with_regs_lost(harness, 0)
    sent, receiver = _first_message_with_regs_lost(harness, lost_regs)
    initial = Config().initial_cwnd_packets
    segs = -(-SIZE // SEG)
    assert receiver.stats.dropped.get("unknown_flow", 0) <= 2 * initial
    assert sent.report.packets_sent <= baseline.report.packets_sent + 2 * initial
    assert baseline.report.packets_sent <= segs + 8 * initial


def test_reset_unregistered_before_the_reg_was_answered_holds_data():
    """FlowSender: RESET ``unregistered`` while its REG is unanswered holds DATA and brings the REG forward."""
    f = FlowSender(handle=1, peer=("10.0.0.2", 1), flow_id=5, token=9, data=bytes(10_000), element_size=1,
                   segment_size=1000, reliable=True, critical=(), tag=0, now=0.0)
    f.reg_datagrams(0.0, 0, 0.020, 0)  # next REG by back-off at 0.020
    assert f.has_sendable() and f.reg_next == pytest.approx(0.020)
    assert f.reregister(0.001, 0.008)  # too soon after the REG: hold DATA, keep the back-off
    assert not f.has_sendable() and f.reg_next == pytest.approx(0.020) and f.reregistrations == 0
    assert f.reregister(0.010, 0.008)  # 10 ms after the REG: send it again now
    assert f.reg_next == pytest.approx(0.010) and not f.has_sendable()
    f.on_heard(0.013)  # the REG's ACK
    assert f.has_sendable() and f.reg_confirmed
    # a receiver that forgot a confirmed registration: re-register (DATA keeps flowing)
    assert f.reregister(0.05, 0.008) and f.reregistrations == 1 and not f.reg_confirmed and f.has_sendable()


# -- the lab reproduction tool --------------------------------------------------------------------


def test_ring_order_alternates_racks_and_counts_shared_uplinks():
    order = seq_messages._ring_order([3, 3])
    assert order == [0, 3, 1, 4, 2, 5]  # the order ltp-lab schedules gives the rank-order ring
    rack_of = [0, 0, 0, 1, 1, 1]
    assert seq_messages._flows_per_bottleneck(order, rack_of) == 3
    assert seq_messages._flows_per_bottleneck([0, 1, 2, 3, 4, 5], rack_of) == 1  # rack-aware: 2 crossings
    assert seq_messages._flows_per_bottleneck(list(range(4)), [0] * 4) == 1
    assert seq_messages._ring_order([2, 3]) == [0, 2, 1, 3, 4]


def test_config_overrides_parse_numbers():
    assert seq_messages._overrides(["ack_every=8", "aggregation_cap_s=0.01", "x=abc"]) == \
        {"ack_every": 8, "aggregation_cap_s": 0.01, "x": "abc"}
    assert seq_messages._overrides(None) == {}


def _lab_problem():
    from ltp_tools.netlab import check_support

    return check_support()


@pytest.mark.netns
@pytest.mark.timeout(60)
def test_seq_messages_tool_runs_in_the_lab():
    problem = _lab_problem()
    if problem is not None:
        pytest.skip(f"network lab unavailable: {problem}")
    r = subprocess.run([sys.executable, "-m", "ltp_tools.seq_messages", "--hosts", "2", "--steps", "2",
                        "--size", "100000", "--rate", "100e6", "--mode", "ring"],
                       capture_output=True, text=True, timeout=50)
    assert r.returncode == 0, r.stderr[-2000:]
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    assert summary["hosts"] == 2 and summary["rcs"] == [0, 0]
    assert summary["wire_s"] == pytest.approx(100_000 * 8 / 100e6, rel=1e-3)
    assert 0.5 < summary["median_over_wire"] < 50
    assert summary["median_step_s"] > 0


@pytest.mark.parametrize("busy_s", [0.005, 0.02])
def test_a_large_message_after_tiny_ones_is_not_paced_at_their_rate(harness, busy_s):
    """A path that has carried only tiny messages whose ACKs came late (a barrier, a 144-byte broadcast to a rank
    busy in torch) has a BtlBw of a few kB/s from app-limited samples and is still in STARTUP. The next large
    message must not be paced at 2.89x that (``BBR.startup_floor_rate``). The torch backend's 400 kB parameter
    broadcast after DDP's 144-byte one took 0.2-2.4 s on loopback before the floor (docs/performance.md, session
    55); here, without it, 24 ms and 133 ms instead of 4 ms on a 1 Gbit/s, 60 us path."""
    h = harness(2, seed=3)
    h.links(rate=125e6, delay_s=0.00003)
    a, b = h.engines
    for tag in range(4):  # tiny messages, each one flight, each read by a receiver busy for busy_s
        small = np.full(36, tag, np.float32)
        out = np.zeros_like(small)
        r = b.post_receive([(h.addrs[0], tag, out)], now=h.now)
        s = a.send(h.addrs[1], small, now=h.now, reliable=True, tag=tag)
        h.net.stall(h.addrs[1], busy_s)
        h.wait([(0, s), (1, r)])
    path = a._paths[h.addrs[1]]
    assert path.bbr.state == STARTUP and path.bbr.btlbw < 50_000  # bytes/s: 144 B per late round trip
    data = np.arange(100_601, dtype=np.float32)  # 402,404 bytes: the broadcast of the trace
    out = np.zeros_like(data)
    r = b.post_receive([(h.addrs[0], 9, out)], now=h.now)
    s = a.send(h.addrs[1], data, now=h.now, reliable=True, tag=9)
    sent, _ = h.wait([(0, s), (1, r)], timeout=10.0)
    assert sent.error is None and np.array_equal(out, data)
    # the wire time is 3.3 ms; STARTUP's rounds on a 60 us path add little once the pacer is not the bound
    assert sent.report.duration_s < 0.015, sent.report.duration_s
