"""Queue discipline of the sender: CQ first, then NQ, RQ only when both are empty."""

from __future__ import annotations

import numpy as np

from ltp.sender import FlowSender


def _flow(n_segments=10, critical=()):
    seg = 100
    return FlowSender(handle=1, peer=("h", 1), flow_id=1, token=2, data=bytes(seg * n_segments), element_size=4,
                      segment_size=seg, reliable=False, critical=critical, tag=0, now=0.0)


def _send(flow, seqs, now=0.0):
    out = bytearray(len(seqs) * 116)
    flow.window.build(np.asarray(seqs, np.int64), now, 0, 0.0, 0.0, 0, out)


def test_order_cq_nq_then_rq_and_lost_critical_goes_back_to_cq():
    f = _flow(10, critical=[(300, 500)])  # segments 3 and 4
    first = f.take(4).tolist()
    assert first == [3, 4, 0, 1]
    _send(f, first)
    # ACK transmissions 2 and 3 and 1 (seqs 0, 1 and 4): seq 3 (sent first) has three later ACKs -> lost
    res = f.window.on_ack(np.array([0 << 8 | 1, 1 << 8 | 1, 4 << 8 | 1], np.uint32), 0.01, 0, 0.0)
    lost = res[-1]
    assert lost.tolist() == [3]
    f.requeue_lost(lost)
    nxt = f.take(3).tolist()
    assert nxt == [3, 2, 5]  # lost critical first (CQ), then NQ continues
    _send(f, nxt)
    rest = f.take(100).tolist()
    assert rest == [6, 7, 8, 9]
    _send(f, rest)
    # normal segment 2 lost: retransmitted from RQ only once CQ and NQ are empty
    res = f.window.on_ack(np.array([(s << 8) | 1 for s in (5, 6, 7, 8)], np.uint32), 0.02, 0, 0.0)
    # 3 (retransmitted just before 2) and 2 each have four later ACKs now
    assert sorted(res[-1].tolist()) == [2, 3]
    f.requeue_lost(res[-1])
    assert f.take(10).tolist() == [3, 2]  # critical 3 from CQ first, normal 2 from RQ


def test_short_last_segment_ends_its_batch_without_reordering():
    seg = 100
    # the short last segment is critical: it leaves first (CQ) and ends that batch
    f = FlowSender(handle=1, peer=("h", 1), flow_id=1, token=2, data=bytes(seg * 5 + 40), element_size=4,
                   segment_size=seg, reliable=False, critical=[(520, 540)], tag=0, now=0.0)
    assert f.take(10).tolist() == [5]
    assert f.take(10).tolist() == [0, 1, 2, 3, 4]
    # the short last segment is normal: the batch ends with it even when RQ has work
    g = FlowSender(handle=1, peer=("h", 1), flow_id=1, token=2, data=bytes(seg * 5 + 40), element_size=4,
                   segment_size=seg, reliable=False, critical=(), tag=0, now=0.0)
    _send(g, g.take(2).tolist())
    g.requeue_lost(g.window.expire(1.0))
    assert g.take(10).tolist() == [2, 3, 4, 5]
    assert g.take(10).tolist() == [0, 1]


def test_acked_segments_are_not_retransmitted_from_rq():
    f = _flow(5)
    _send(f, f.take(5).tolist())
    res = f.window.on_ack(np.array([(s << 8) | 1 for s in (1, 2, 3, 4)], np.uint32), 0.01, 0, 0.0)
    f.requeue_lost(res[-1])
    assert res[-1].tolist() == [0]
    # a late ACK for the original transmission arrives before the retransmission
    f.window.on_ack(np.array([0 << 8 | 1], np.uint32), 0.02, 0, 0.0)
    assert f.take(5).tolist() == [] and f.all_acked()
