"""REG copies (``Config.reg_copies``): one lost registration datagram must not cost a message.

A receiver drops DATA of a flow it holds no registration for (it commits no memory on a peer's say-so), so
before REG copies a single lost REG threw away the whole first flight: DATA drew RESET ``unregistered``, the
sender waited for its REG back-off, and a receive group's deadline could pass first. In a 4-host ring of
30 kB steps at 10 % loss (every datagram size, as on a real lossy link) that cut flows to 5 % delivered and
stretched a step to 40 one-way delays. Each registration round now sends ``reg_copies`` (default 2) copies
back to back, each with its own attempt byte and MAC, and each copy is answered.
"""

from __future__ import annotations

import hmac
import random

import numpy as np
import pytest

from ltp import wire
from ltp.admission import reg_mac
from ltp.config import REG_COPIES_MAX, Config
from ltp.engine import Engine
from ltp.errors import LocalProtocolError
from ltp.sender import FlowSender

KEY = b"job-secret"
A = ("10.0.0.1", 7447)
B = ("10.0.0.2", 7447)
T0 = 1_790_000_000.0


def _out(eng, now):
    return [bytes(d) for tx in eng.datagrams_to_send(now) for d in tx.datagrams()]


def _is_reg(d) -> bool:
    return d[0] & 0x0F == wire.T_REG


@pytest.mark.parametrize("copies", [1, 2, 3])
def test_each_round_sends_its_copies_first_each_with_its_own_attempt_and_mac(copies):
    a = Engine(Config(job_key=KEY, reg_copies=copies), rng=random.Random(1), local_addr=A, wall_offset=T0)
    a.send(B, np.ones(5000, np.float32), now=0.0)
    out = _out(a, 0.0)
    regs = [d for d in out if _is_reg(d)]
    assert len(regs) == copies and out[:copies] == regs  # before any DATA: the first flight finds them there
    attempts = [wire.unpack_header(r)[4] for r in regs]
    assert attempts == list(range(1, copies + 1))
    for r in regs:  # every copy is signed on its own (a replay cache refuses identical bytes)
        end = len(r) - wire.MAC_SIZE
        assert hmac.compare_digest(r[end:], reg_mac(KEY, A, r[:end]))
    assert len({r[-wire.MAC_SIZE:] for r in regs}) == copies
    again, now = [], 0.0
    while not again and now < 1.0:  # unanswered: the next round, the same number of copies
        now = a.get_timer()
        a.handle_timer(now)
        again = [d for d in _out(a, now) if _is_reg(d)]
    assert [wire.unpack_header(r)[4] for r in again] == list(range(copies + 1, 2 * copies + 1))


def test_every_copy_is_admitted_once_and_answered():
    a = Engine(Config(job_key=KEY), rng=random.Random(1), local_addr=A, wall_offset=T0)
    b = Engine(Config(job_key=KEY), rng=random.Random(2), local_addr=B, wall_offset=T0)
    a.send(B, np.ones(5000, np.float32), now=0.0)
    regs = [d for d in _out(a, 0.0) if _is_reg(d)]
    assert len(regs) == 2
    for r in regs:
        b.receive_datagram(r, A, 0.001)
    assert len(b._pending) == 1 and b.stats.refused == {} and b.stats.dropped == {} and b.stats.reg_repeats == 1
    answers = [d for d in _out(b, 0.001) if d[0] & 0x0F == wire.T_ACK]
    assert len(answers) == 2  # a lost answer is as unlikely as a lost REG


def test_the_back_off_counts_rounds_not_copies():
    f = FlowSender(handle=1, peer=B, flow_id=5, token=9, data=bytes(4000), element_size=4, segment_size=1456,
                   reliable=False, critical=(), tag=0, now=0.0, reg_copies=3)
    f.reg_datagrams(0.0, 0, 0.010, 0)
    assert f.reg_next == pytest.approx(0.010) and f.reg_attempts == 3
    f.reg_datagrams(0.010, 0, 0.010, 0)
    assert f.reg_next == pytest.approx(0.030) and f.reg_attempts == 6


@pytest.mark.parametrize("start", [0, 250])  # 250: the attempt byte wraps within the rounds
def test_a_stale_answer_counts_as_the_latest_for_any_copy_of_the_latest_round(start):
    f = FlowSender(handle=1, peer=B, flow_id=5, token=9, data=bytes(4000), element_size=4, segment_size=1456,
                   reliable=False, critical=(), tag=0, now=0.0, reg_copies=2)
    f.reg_attempts = start
    f.reg_datagrams(0.0, 0, 0.010, 0)
    old = [(start + k) & 0xFF for k in (1, 2)]
    f.reg_datagrams(0.010, 0, 0.010, 0)
    latest = [(start + k) & 0xFF for k in (3, 4)]
    assert all(f.answers_latest_reg(x) for x in latest if x) and f.answers_latest_reg(0)
    assert not any(f.answers_latest_reg(x) for x in old if x)


@pytest.mark.parametrize("bad", [0, REG_COPIES_MAX + 1, True, 1.5, "2"])
def test_reg_copies_out_of_range_names_the_fix(bad):
    with pytest.raises(LocalProtocolError, match="reg_copies"):
        Config(reg_copies=bad)


def _first_reg_only():
    seen = []

    def drop(data) -> bool:
        if _is_reg(data) and not seen:
            seen.append(data)
            return True
        return False
    return drop


@pytest.mark.parametrize("one_way_s", [0.002, 0.02])
def test_a_lost_first_reg_costs_the_message_nothing(harness, floats, one_way_s):
    """The first REG datagram of the first message is lost: its copy registers the flow, the first flight is
    received, and the message takes what it would have without the loss. With one copy the same loss throws
    away the first flight and costs at least another one-way delay (checked below, so the test shows the difference)."""
    def one(copies):
        h = harness(seed=3, config=Config(reg_copies=copies))
        h.link(0, 1, rate=125e6, delay_s=one_way_s, drop_if=_first_reg_only())
        h.link(1, 0, rate=125e6, delay_s=one_way_s)
        data = floats(7500)  # 30 kB: one flight
        buf = np.zeros_like(data)
        hs = h.engines[0].send(h.addrs[1], data, now=0.0)
        hr = h.engines[1].post_receive([(h.addrs[0], 0, buf)], now=0.0)
        (got,) = h.wait([(1, hr)], timeout=10)
        took = h.now
        (sent,) = h.wait([(0, hs)], timeout=10)
        assert sent.error is None and got.error is None and np.array_equal(buf, data)
        return took, h.engines[1].stats.dropped

    t2, dropped2 = one(2)
    assert t2 < 1.5 * one_way_s + 0.001 and "unknown_flow" not in dropped2, (t2, dropped2)
    t1, dropped1 = one(1)
    assert t1 > t2 + one_way_s and dropped1.get("unknown_flow", 0) > 0, (t1, dropped1)


@pytest.mark.parametrize("seed", [0, 2])
def test_a_ring_of_small_messages_at_ten_percent_loss_of_every_datagram_keeps_its_flows(harness, seed):
    """Four hosts pass 30 kB to their right neighbour each step; every datagram (REG and ACK too) is lost
    with probability 0.1. Every flow keeps at least the Early Close fraction less one packet, and no step
    waits for a REG back-off (before REG copies: flows cut to 5 % and steps of 40 one-way delays)."""
    n, one_way = 4, 0.01
    h = harness(n_hosts=n, seed=seed, config=Config())
    h.links(rate=125e6, delay_s=one_way, queue_bytes=625_000, loss=0.1)
    data = np.arange(7500, dtype=np.float32)
    steps, fractions = [], []
    for k in range(16):
        t0 = h.now
        handles = []
        for i in range(n):
            j = (i + 1) % n
            h.engines[i].send(h.addrs[j], data, now=t0, tag=k)
            handles.append((j, h.engines[j].post_receive([(h.addrs[i], k, np.zeros_like(data))], now=t0)))
        evs = h.wait(handles, timeout=10)
        assert all(e.error is None for e in evs)
        fractions += [e.reports[0].delivered_fraction for e in evs]
        steps.append((h.now - t0) / one_way)
    packets = -(-data.nbytes // 1456)
    assert min(fractions) >= Config().lt_fraction - 1 / packets, sorted(fractions)[:5]
    assert max(steps) <= 12, [round(s, 1) for s in steps]
