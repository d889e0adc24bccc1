"""REG copies (``Config.reg_copies``): one lost registration datagram must not cost a message.

A receiver drops DATA of a flow it holds no registration for (it commits no memory on a peer's say-so), so
before REG copies a single lost REG threw away the whole first flight: DATA drew RESET ``unregistered``, the
sender waited for its REG back-off, and a receive group's deadline could pass first. In a 4-host ring of
30 kB steps at 10 % loss (every datagram size, as on a real lossy link) that cut flows to 5 % delivered and
stretched a step to 40 one-way delays. Each registration round now sends ``reg_copies`` (default 2) copies
back to back, each with its own attempt byte and MAC, and each copy is answered -- unless an ACK with entries or
a STOP of the same flow goes out beside the answers and confirms the registration for them
(``ltp.admission.fold_reg_answers``).
"""

from __future__ import annotations

import hmac
import random

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ltp import wire
from ltp.admission import fold_reg_answers, reg_mac
from ltp.config import REG_COPIES_MAX, Config
from ltp.engine import Engine, ReceiveDone, SendDone
from ltp.errors import LocalProtocolError
from ltp.sender import FlowSender
from ltp.timers import Timer

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
    hold = Config().ack_delay_s
    assert _out(b, 0.001) == []  # held for company (an ACK or STOP of the flow), as ACK entries are
    answers = [d for d in _out(b, 0.001 + hold) if d[0] & 0x0F == wire.T_ACK]
    assert len(answers) == 2  # a lost answer is as unlikely as a lost REG


def _is_answer(d) -> bool:
    """Whether ``d`` is a REG answer: an ACK without entries."""
    return d[0] & 0x0F == wire.T_ACK and not wire.unpack_header(d)[5] & 0xFFFF


def _answers(ds) -> list:
    """The REG answers among ``ds``."""
    return [d for d in ds if _is_answer(d)]


@pytest.mark.parametrize("reliable", [True, False])
def test_a_message_read_whole_with_its_regs_is_answered_by_its_ack_and_stop_alone(reliable):
    """Both REG copies and the one DATA of a small message read in one go: the ACK with the DATA's entry and the
    STOP confirm the registration, so the two REG answers that would go out beside them are folded away."""
    a = Engine(Config(job_key=KEY), rng=random.Random(1), local_addr=A, wall_offset=T0)
    b = Engine(Config(job_key=KEY), rng=random.Random(2), local_addr=B, wall_offset=T0)
    out = bytearray(1000)
    b.post_receive([(A, 5, out)], now=0.0)
    a.send(B, np.arange(1000, dtype=np.uint8), now=0.0, reliable=reliable, tag=5)
    sent = _out(a, 0.0)
    assert sum(map(_is_reg, sent)) == 2 and len(sent) == 3
    for d in sent:
        b.receive_datagram(d, A, 0.001)
    back = _out(b, 0.001)
    assert [d[0] & 0x0F for d in back] == [wire.T_ACK, wire.T_STOP] and _answers(back) == []
    assert b.stats.reg_answers_folded == 2 and b.stats.reg_repeats == 1
    for d in back:
        a.receive_datagram(d, B, 0.002)
    assert isinstance(a.next_event(), SendDone) and isinstance(b.next_event(), ReceiveDone)
    assert bytes(out) == bytes(range(256)) * 3 + bytes(range(232))


def test_regs_whose_data_was_lost_are_each_answered():
    """Without the DATA (lost), nothing else confirms the registration: every copy is answered, as before."""
    a = Engine(Config(job_key=KEY), rng=random.Random(1), local_addr=A, wall_offset=T0)
    b = Engine(Config(job_key=KEY), rng=random.Random(2), local_addr=B, wall_offset=T0)
    b.post_receive([(A, 5, bytearray(1000))], now=0.0)
    a.send(B, np.zeros(1000, np.uint8), now=0.0, tag=5)
    for d in _out(a, 0.0):
        if _is_reg(d):
            b.receive_datagram(d, A, 0.001)
    assert b.get_timer() == pytest.approx(0.001 + Config().ack_delay_s)  # the answers' hold arms the ACK timer
    assert b.timers().get(Timer.ACK_DELAY) == b.get_timer()
    back = _out(b, b.get_timer())
    assert len(_answers(back)) == 2 and b.stats.reg_answers_folded == 0


def test_regs_read_before_their_data_are_answered_by_its_ack_and_stop_alone():
    """The REG copies are read in one wake-up and the DATA in a later one (a broadcast's DATA leaves through
    sender threads after every peer's REGs): the answers wait for the DATA's ACK and STOP and are folded into
    them, two datagrams back instead of four. Before session 60 the answers went out at once."""
    a = Engine(Config(job_key=KEY), rng=random.Random(1), local_addr=A, wall_offset=T0)
    b = Engine(Config(job_key=KEY), rng=random.Random(2), local_addr=B, wall_offset=T0)
    out = bytearray(1000)
    b.post_receive([(A, 5, out)], now=0.0)
    a.send(B, np.arange(1000, dtype=np.uint8), now=0.0, tag=5, reliable=True)
    sent = _out(a, 0.0)
    for d in sent:
        if _is_reg(d):
            b.receive_datagram(d, A, 0.001)
    assert _out(b, 0.001) == []
    for d in sent:
        if not _is_reg(d):
            b.receive_datagram(d, A, 0.0012)  # within the hold
    back = _out(b, 0.0012)
    assert [d[0] & 0x0F for d in back] == [wire.T_ACK, wire.T_STOP] and not _answers(back)
    assert b.stats.reg_answers_folded == 2 and bytes(out) == bytes(range(256)) * 3 + bytes(range(232))
    assert _out(b, 0.01) == []  # nothing held is left to go out later
    for d in back:
        a.receive_datagram(d, B, 0.0013)
    ev = a.next_event()
    assert isinstance(ev, SendDone) and ev.error is None and ev.report.delivered_fraction == 1.0


def test_a_reg_after_reset_unregistered_is_answered_at_once():
    """A sender told RESET ``unregistered`` holds its DATA until a REG is answered: no DATA will come to fold the
    answer into, so that REG is answered at once, not held (and a later registration of the flow id is held
    again)."""
    a = Engine(Config(job_key=KEY), rng=random.Random(1), local_addr=A, wall_offset=T0)
    b = Engine(Config(job_key=KEY), rng=random.Random(2), local_addr=B, wall_offset=T0)
    b.post_receive([(A, 5, bytearray(1000))], now=0.0)
    a.send(B, np.zeros(1000, np.uint8), now=0.0, tag=5)
    sent = _out(a, 0.0)
    for d in sent:  # every REG lost: the DATA meets no registration
        if not _is_reg(d):
            b.receive_datagram(d, A, 0.001)
    back = _out(b, 0.001)
    assert [wire.unpack_header(d)[0] for d in back] == [wire.T_RESET]
    for d in back:
        a.receive_datagram(d, B, 0.002)
    t = 0.002
    regs = [d for d in _out(a, t) if _is_reg(d)]
    if not regs:  # the RESET brought the next registration round forward: it goes at its timer
        t = a.get_timer()
        a.handle_timer(t)
        regs = [d for d in _out(a, t) if _is_reg(d)]
    assert len(regs) == 2
    now = t + 0.0001
    b.receive_datagram(regs[0], A, now)
    assert len(_answers(_out(b, now))) == 1  # at once
    b.receive_datagram(regs[1], A, now)
    assert _answers(_out(b, now)) == []  # the next copy's answer is held as usual
    assert len(_answers(_out(b, now + Config().ack_delay_s))) == 1


def _ctl(kind: str, fid: int, token: int = 7, entries: int = 0) -> bytes:
    if kind == "ack":
        return wire.pack_ack(fid, token, entries, 0, list(range(entries)))
    if kind == "stop":
        return wire.pack_header(wire.T_STOP, 0, fid, token, 0, wire.STOP_CODES["complete"] << 24)
    return wire.pack_header(wire.T_RESET, 0, fid, token, 1, 0)


def test_only_answers_of_a_flow_confirmed_beside_them_to_the_same_address_are_folded():
    from collections import deque

    q = deque([(_ctl("ack", 1), A), (bytearray(_ctl("ack", 1)), A),  # two answers of flow 1 (one a bytearray)
               (_ctl("ack", 2), A),  # flow 2: nothing confirms it here
               (_ctl("ack", 1), B),  # flow 1's id at another address: another flow
               (_ctl("ack", 3, token=8), A),  # flow 3, token 8: the STOP below is for token 9
               (_ctl("ack", 1, entries=2), A), (_ctl("stop", 3, token=9), A), (_ctl("reset", 2), A),
               (_ctl("stop", 4), A), (_ctl("ack", 4), A)])  # an answer after its flow's STOP goes too
    want = [q[2], q[3], q[4], q[5], q[6], q[7], q[8]]
    assert fold_reg_answers(q) == 3
    assert list(q) == want
    assert fold_reg_answers(q) == 0 and list(q) == want


_KINDS = st.sampled_from(["ack", "ack+", "stop", "reset"])


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(_KINDS, st.integers(1, 3), st.integers(7, 8), st.sampled_from([A, B])), max_size=12))
def test_folding_drops_exactly_the_answers_of_flows_confirmed_beside_them(items):
    from collections import deque

    q = deque((_ctl(k.rstrip("+"), fid, token, 2 if k == "ack+" else 0), addr) for k, fid, token, addr in items)
    confirmed = {(addr, fid, token) for k, fid, token, addr in items if k in ("ack+", "stop")}
    keep = [(_ctl(k.rstrip("+"), fid, token, 2 if k == "ack+" else 0), addr) for k, fid, token, addr in items
            if not (k == "ack" and (addr, fid, token) in confirmed)]
    assert fold_reg_answers(q) == len(items) - len(keep)
    assert list(q) == keep  # everything else, in its order


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


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 10_000), reg_loss=st.sampled_from([0.0, 0.5, 0.9, 1.0]),
       answer_loss=st.sampled_from([0.0, 0.5, 1.0]), data_loss=st.sampled_from([0.0, 0.1, 0.4]),
       reset_loss=st.sampled_from([0.0, 0.5]), one_way=st.sampled_from([0.0002, 0.005, 0.03]),
       reliable=st.booleans(), size=st.sampled_from([4, 30_000, 300_000]))
def test_any_loss_of_registrations_and_answers_ends_every_send(harness, seed, reg_loss, answer_loss, data_loss,
                                                               reset_loss, one_way, reliable, size):
    """REGs, their answers, DATA and RESETs each lost at their own rate: every send ends within a few seconds,
    completed (a reliable one with every byte) or failed with an error that names the peer; the receive ends
    too, at the latest at its own timeout. No RESET, re-registration or back-off keeps a send going without end
    (session 53: a registration probe whose refusals counted as hearing the peer did, and this test failed)."""
    rng = random.Random(seed)
    rates = {wire.T_REG: reg_loss, wire.T_DATA: data_loss, wire.T_RESET: reset_loss}
    h = harness(seed=seed, config=Config())
    a, b = h.engines

    def drop(d) -> bool:
        p = answer_loss if _is_answer(d) else rates.get(d[0] & 0x0F, 0.0)
        return rng.random() < p
    h.link(0, 1, rate=125e6, delay_s=one_way, drop_if=drop)
    h.link(1, 0, rate=125e6, delay_s=one_way, drop_if=drop)
    data = np.arange(size // 4, dtype=np.float32)
    buf = np.zeros_like(data)
    hs = a.send(h.addrs[1], data, now=0.0, reliable=reliable, tag=1)
    hr = b.post_receive([(h.addrs[0], 1, buf)], now=0.0, timeout=60.0)
    (sent,) = h.wait([(0, hs)], timeout=120)
    # ended within a few dead-peer limits (1 s on these paths: 64 RTTs is less), whatever was lost
    assert h.now < 5.0, (h.now, sent.error)
    (got,) = h.wait([(1, hr)], timeout=120)
    if sent.error is None:
        assert sent.report.delivered_bytes > 0
        if reliable:
            assert got.error is None and np.array_equal(buf, data)
    else:
        assert h.addrs[1][0] in str(sent.error), sent.error
    assert h.now <= 60.0 + 1e-6, h.now


def test_answers_due_while_the_flows_first_ack_waits_are_folded_into_it():
    """The REGs are read, then the first DATA of a 20 kB message, whose ACK waits ``ack_delay_s`` for company:
    the answers fall due first, and are folded (that ACK confirms the registration) instead of going alone."""
    a = Engine(Config(job_key=KEY), rng=random.Random(1), local_addr=A, wall_offset=T0)
    b = Engine(Config(job_key=KEY), rng=random.Random(2), local_addr=B, wall_offset=T0)
    hold = Config().ack_delay_s
    b.post_receive([(A, 5, bytearray(20_000))], now=0.0)
    a.send(B, np.zeros(20_000, np.uint8), now=0.0, tag=5, reliable=True)
    sent = _out(a, 0.0)
    for d in sent:
        if _is_reg(d):
            b.receive_datagram(d, A, 0.001)
    data = [d for d in sent if not _is_reg(d)]
    assert len(data) >= 3
    for d in data[:3]:
        b.receive_datagram(d, A, 0.001 + hold / 2)
    assert _out(b, 0.001 + hold) == [] and b.stats.reg_answers_folded == 2  # due, and folded
    back = _out(b, 0.001 + hold / 2 + hold)  # the ACK's own delay
    assert [d[0] & 0x0F for d in back] == [wire.T_ACK] and not _answers(back)
    assert wire.unpack_header(back[0])[5] & 0xFFFF == 3  # the three entries


def test_a_bulk_messages_regs_are_answered_at_once():
    """A message of more than ``HOLD_ANSWER_MAX_SEGMENTS`` segments: its answers go at once, as before session 60
    (a bulk transfer's dynamics were tuned with them; they are a few datagrams among thousands)."""
    from ltp.admission import HOLD_ANSWER_MAX_SEGMENTS

    a = Engine(Config(job_key=KEY), rng=random.Random(1), local_addr=A, wall_offset=T0)
    b = Engine(Config(job_key=KEY), rng=random.Random(2), local_addr=B, wall_offset=T0)
    seg = Config().segment_size_for(1)
    for segments, held in ((HOLD_ANSWER_MAX_SEGMENTS, True), (HOLD_ANSWER_MAX_SEGMENTS + 1, False)):
        a.send(B, np.zeros(segments * seg, np.uint8), now=0.0, tag=segments)
        for d in _out(a, 0.0):
            if _is_reg(d):
                b.receive_datagram(d, A, 0.001)
        assert len(_answers(_out(b, 0.001))) == (0 if held else 2), segments
        _out(b, 0.01)
