"""ltp.matching.ReceiveMatcher on its own: FIFO matching, wildcards, sizes, expiry and settling."""

from __future__ import annotations

from ltp.matching import ReceiveMatcher, empty_report, expiry_cause
from ltp.receiver import FlowReceiver, RecvGroup, RecvSlot
from ltp.regimes import Regime

A = ("10.0.0.1", 7447)
B = ("10.0.0.2", 7447)


def _group(handle, specs, now=0.0, timeout_at=None):
    g = RecvGroup(handle, now, timeout_at)
    for i, (peer, tag, n) in enumerate(specs):
        g.slots.append(RecvSlot(g, i, peer, tag, memoryview(bytearray(b"\x07" * n))))
    return g


def _flow(peer, tag, total, start=0.0, fid=1):
    return FlowReceiver(key=(peer, fid), peer=peer, flow_id=fid, token=1, total=total, seg_size=1000,
                        element_size=1, tag=tag, reliable=False, critical_runs=[], dest=bytearray(total),
                        internal=True, now=start, est=(0, 0), padding=0)


def test_waiting_slots_are_taken_oldest_first_with_wildcards():
    m = ReceiveMatcher()
    g1 = _group(1, [(None, 4, 10), (A, None, 10)])
    g2 = _group(2, [(A, 4, 10)])
    for g in (g1, g2):
        m.add(g)
        for s in g.slots:
            m.wait(s)
    assert m.waiting_slot(A, 4) is g1.slots[0]  # any peer, tag 4: posted first
    assert m.waiting_slot(B, 9) is None
    m.unwait(g1.slots[0])
    m.bind(g1.slots[0], _flow(A, 4, 10))
    assert m.waiting_slot(A, 4) is g1.slots[1]  # A, any tag
    assert m.waiting_for(A) == [g1.slots[1], g2.slots[0]] and m.waiting_for(B) == []


def test_unexpected_messages_wait_for_a_slot_that_can_hold_them():
    m = ReceiveMatcher()
    big, small = _flow(A, 1, 5000, fid=1), _flow(A, 1, 100, fid=2)
    m.add_unexpected(big)
    m.add_unexpected(small)
    g = _group(1, [(A, 1, 200)])
    slot = g.slots[0]
    assert m.find_unexpected(slot) is small  # the older one does not fit
    m.bind(slot, small)
    assert slot.flow is small and small.slot is slot and g.t0 == small.start
    small.close(1.0, Regime.COMPLETE)
    small.dest[:] = b"\x01" * 100  # what the flow's kernel would have written
    m.claim(small)
    assert bytes(slot.dest[:100]) == b"\x01" * 100 and slot.report is small.report
    assert list(m.unexpected) == [big]


def test_a_slot_for_one_peer_and_tag_sees_an_unexpected_message_too_big_for_it():
    m = ReceiveMatcher()
    big = _flow(A, 1, 5000, fid=1)
    m.add_unexpected(big)
    exact = _group(1, [(A, 1, 200)]).slots[0]
    assert m.find_unexpected(exact) is None and m.unfit_unexpected(exact) is big
    assert m.unfit_unexpected(_group(2, [(A, 2, 200)]).slots[0]) is None      # another tag
    assert m.unfit_unexpected(_group(3, [(None, 1, 200)]).slots[0]) is None   # any peer: may still match
    assert m.unfit_unexpected(_group(4, [(A, None, 200)]).slots[0]) is None   # any tag
    assert m.unfit_unexpected(_group(5, [(A, 1, 5000)]).slots[0]) is None     # it fits


def test_group_t0_is_the_first_registration_among_its_slots():
    m = ReceiveMatcher()
    g = _group(1, [(A, 1, 10), (B, 1, 10)])
    m.bind(g.slots[0], _flow(A, 1, 10, start=2.0))
    m.bind(g.slots[1], _flow(B, 1, 10, start=1.5))
    assert g.t0 == 1.5


def test_expired_slot_is_zeroed_with_an_empty_report_and_the_group_settles_once():
    m = ReceiveMatcher()
    g = _group(7, [(A, 1, 8), (None, 2, 4)], now=1.0, timeout_at=1.5)
    m.add(g)
    for s in g.slots:
        m.wait(s)
    m.expire(g.slots[0], 1.5, Regime.TIMEOUT)
    rep = g.slots[0].report
    assert bytes(g.slots[0].dest) == bytes(8) and rep.regime is Regime.TIMEOUT and rep.bubbles == [(0, 8)]
    assert rep.duration_s == 0.5 and "within the 0.5 s timeout" in rep.cause
    assert not m.settled(g)
    m.fail(g.slots[1], ValueError("too big"))
    assert g.slots[1].report.regime is Regime.CANCELLED and m.settled(g)
    assert m.finish(g) == [s.report for s in g.slots] and g.done and not m.groups and not m.waiting
    assert not m.settled(g)  # finished groups never settle again


def test_expiry_cause_names_the_deadline_before_the_timeout():
    g = _group(1, [(None, 1, 4)], now=0.0, timeout_at=10.0)
    assert "any peer" in expiry_cause(g.slots[0], 0.2) and "Early Close deadline" in expiry_cause(g.slots[0], 0.2)
    assert empty_report(g.slots[0], Regime.CANCELLED).duration_s == 0.0


def test_unclaimed_messages_leave_after_the_ttl_head_first():
    m = ReceiveMatcher()
    f1, f2 = _flow(A, 1, 10, fid=1), _flow(A, 2, 10, fid=2)
    m.add_unexpected(f1)
    m.add_unexpected(f2)
    assert m.pop_unclaimed(100.0, 1.0) is None  # still open
    f1.close(1.0, Regime.COMPLETE)
    f2.close(1.0, Regime.COMPLETE)
    assert m.pop_unclaimed(1.5, 1.0) is None
    assert m.pop_unclaimed(2.0, 1.0) is f1 and m.pop_unclaimed(2.0, 1.0) is f2 and not m.unexpected
