"""The data-path kernels ``ltp_ext._datapath`` (compiled) and ``ltp_ext._datapath_py`` (twin).

The twin is the specification. Unit tests run against both implementations
(the compiled parameter fails, not skips, when the extension did not build,
unless ``LTP_NO_EXTENSIONS`` is set); the differential tests then drive a
twin window and a compiled window with the same random operations and require
identical return values and identical observable state after every step.
"""

from __future__ import annotations

import struct

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from ext_helpers import compiled

import ltp_ext._datapath_py as twin
from ltp.errors import LocalProtocolError
from ltp_ext.constants import STREAM_COPY_MIN
from ltp_ext._wire_py import F_CRITICAL, F_MAC, F_RELIABLE, HEADER_SIZE, T_ACK, T_DATA, pack_header

H = HEADER_SIZE


def _compiled():
    return compiled("datapath")


@pytest.fixture(params=["compiled", "twin"])
def dp(request):
    return _compiled() if request.param == "compiled" else twin


@pytest.fixture(scope="module")
def comp():
    return _compiled()


def test_compiled_module_is_loaded_by_default(comp):
    import ltp_ext

    if ltp_ext.extensions_disabled():
        pytest.skip("LTP_NO_EXTENSIONS is set")
    assert ltp_ext.load("datapath") is comp


def test_constants(dp):
    assert (dp.SEG_PENDING, dp.SEG_INFLIGHT, dp.SEG_ACKED, dp.SEG_LOST) == (0, 1, 2, 3)


# ---------------------------------------------------------------- helpers

def message(total: int, seed: int = 1) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, total, dtype=np.uint8).tobytes()


def send_window(dp, total=1000, seg=100, crit=None, flow_id=7, token=0xDEADBEEF, flags=0):
    n = -(-total // seg)
    mask = np.zeros(n, np.uint8) if crit is None else np.asarray(crit, np.uint8)
    return dp.SendWindow(message(total), total, seg, flow_id, token, flags, mask)


def build(w, seqs, now=0.0, delivered=0, dtime=0.0, first=0.0, est=0):
    out = bytearray(len(seqs) * (H + w.seg_size))
    n = w.build(np.asarray(seqs, np.int64), now, delivered, dtime, first, est, out)
    return out, n


def acks(*pairs):
    return np.array([(s << 8) | a for s, a in pairs], np.uint32)


def ack(w, pairs, now=1.0, delivered=0, dtime=0.0):
    return w.on_ack(acks(*pairs), now, delivered, dtime)


# ---------------------------------------------------------------- SendWindow

def test_send_window_geometry(dp):
    w = send_window(dp, total=950, seg=100)
    assert (w.seg_count, w.last_len, w.total, w.seg_size) == (10, 50, 950, 100)
    assert w.seg_len(9) == 50 and w.seg_len(0) == 100
    for name, dtype in (("state", np.uint8), ("attempt", np.uint8), ("critical", np.uint8),
                        ("sent_time", np.float64), ("sent_idx", np.int64), ("tx_batch", np.int32),
                        ("first_batch", np.int32), ("first_tx_time", np.float64), ("snap_delivered", np.int64)):
        arr = getattr(w, name)
        assert isinstance(arr, np.ndarray) and arr.dtype == dtype and arr.shape == (10,)
    assert (w.head, w.tail, w.log_base) == (0, 0, 0)
    assert w.log_seq.shape[0] == 64


def test_build_writes_headers_and_payload(dp):
    data = message(950)
    crit = np.zeros(10, np.uint8)
    crit[1] = 1
    w = dp.SendWindow(data, 950, 100, 0x1234, 0xCAFEBABE, F_RELIABLE, crit)
    out = bytearray(3 * (H + 100))
    n = w.build(np.array([0, 1, 9], np.int64), 2.5, 10, 1.5, 0.5, 0x01020304, out)
    assert n == 2 * (H + 100) + H + 50
    for k, seq in enumerate((0, 1, 9)):
        off = k * (H + 100)
        flags = F_RELIABLE | (F_CRITICAL if seq == 1 else 0)
        assert bytes(out[off:off + H]) == pack_header(T_DATA, flags, 0x1234, 0xCAFEBABE, (seq << 8) | 1, 0x01020304)
        ln = 50 if seq == 9 else 100
        assert bytes(out[off + H:off + H + ln]) == data[seq * 100:seq * 100 + ln]
    assert w.state.tolist() == [1, 1, 0, 0, 0, 0, 0, 0, 0, 1]
    assert w.attempt[0] == 1 and w.sent_time[9] == 2.5
    assert w.snap_delivered[1] == 10 and w.snap_delivered_time[1] == 1.5 and w.snap_first_sent[1] == 0.5
    assert w.sent_idx[[0, 1, 9]].tolist() == [0, 1, 2]
    assert w.log_seq[:3].tolist() == [0, 1, 9]
    assert (w.packets_sent, w.inflight_count, w.inflight_bytes, w.retransmits) == (3, 3, 3 * H + 250, 0)


def test_a_build_call_is_one_send_batch_and_the_batch_table_grows_intact(dp):
    """Send time and rate snapshot are kept once per ``build`` call (8 bytes per segment, not 40): every
    segment of a call shares its batch, an empty call opens none, and the table survives growing past
    ``SEND_BATCH_MIN`` with each segment's values as they were sent."""
    from ltp_ext.constants import SEND_BATCH_MIN

    w = send_window(dp, total=100 * (2 * SEND_BATCH_MIN + 10), seg=100)
    assert w.batches == 1 and w.tx_batch.itemsize == w.first_batch.itemsize == w.tx_index.itemsize == 4
    assert w.log_seq.itemsize == 4 and w.sent_idx.tolist() == [-1] * w.seg_count
    build(w, [], now=9.0)
    assert w.batches == 1
    build(w, [0, 1, 2], now=1.0, delivered=5, dtime=0.5, first=0.25)
    assert w.batches == 2 and w.tx_batch[:4].tolist() == [1, 1, 1, 0]
    for k in range(3, 2 * SEND_BATCH_MIN + 10):  # one segment per call: the table doubles twice
        build(w, [k], now=1.0 + k, delivered=100 * k, dtime=0.5 + k, first=0.25 + k)
    assert w.batches == 2 + (2 * SEND_BATCH_MIN + 7)  # batch 0, the three-segment call, one per later call
    k = np.arange(3, 2 * SEND_BATCH_MIN + 10)
    assert w.sent_time[:3].tolist() == [1.0] * 3 and np.array_equal(w.sent_time[3:], 1.0 + k)
    assert np.array_equal(w.snap_delivered[3:], 100 * k) and np.array_equal(w.snap_first_sent[3:], 0.25 + k)
    assert np.array_equal(w.first_tx_time, w.sent_time)
    build(w, [1], now=500.0)  # a retransmission: a new latest batch, the first one kept
    assert w.sent_time[1] == 500.0 and w.first_tx_time[1] == 1.0 and w.tx_batch[1] == w.batches - 1
    r = ack(w, [(2, 1)], now=600.0)  # the rate sample reads segment 2's batch
    assert r[4] == 599.0 and r[5:9] == (5, 0.5, 0.25, 1.0)


def test_build_retransmission_counts(dp):
    w = send_window(dp)
    build(w, [0, 1])
    build(w, [0])
    assert w.attempt[0] == 2 and w.retransmits == 1
    assert (w.inflight_count, w.inflight_bytes, w.packets_sent, w.tail) == (2, 2 * (H + 100), 3, 3)
    assert w.sent_idx[0] == 2


def test_build_attempt_wraps(dp):
    w = send_window(dp)
    for _ in range(256):
        out, _n = build(w, [3])
    assert w.attempt[3] == 0
    assert out[8:12] == bytes([0, 0, 3, 0])


def test_build_out_of_range_after_partial_batch(dp):
    w = send_window(dp)
    with pytest.raises(LocalProtocolError, match="segment 10 out of range"):
        build(w, [2, 10, 3])
    assert w.state[2] == dp.SEG_INFLIGHT and w.state[3] == dp.SEG_PENDING and w.packets_sent == 1
    with pytest.raises(LocalProtocolError, match="segment -1 out of range"):
        build(w, [-1])


def test_build_generic_sequence_types(dp):
    w1, w2 = send_window(dp), send_window(dp)
    out1, out2 = bytearray(2 * 116), np.zeros(2 * 116, np.uint8)
    assert w1.build([4, 5], 1.0, 0, 0.0, 0.0, 9, out1) == w2.build(np.array([4, 5], np.int32), 1.0, 0, 0.0, 0.0, 9,
                                                                   out2)
    assert bytes(out1) == out2.tobytes()


def test_build_rejects_read_only_out(dp):
    w = send_window(dp)
    with pytest.raises(LocalProtocolError, match="read-only"):
        w.build(np.array([0], np.int64), 0.0, 0, 0.0, 0.0, 0, bytes(200))


def test_build_out_too_short(dp):
    w = send_window(dp)
    with pytest.raises(struct.error):
        w.build(np.array([0, 1], np.int64), 0.0, 0, 0.0, 0.0, 0, bytearray(120))
    assert w.packets_sent == 1 and w.attempt[1] == 1   # the twin's partial update
    with pytest.raises(ValueError):
        w.build(np.array([2], np.int64), 0.0, 0, 0.0, 0.0, 0, bytearray(50))


def test_constructor_errors(dp):
    with pytest.raises(LocalProtocolError):
        dp.SendWindow(bytes(10), 11, 4, 1, 1, 0, np.zeros(3, np.uint8))
    with pytest.raises(LocalProtocolError):
        dp.SendWindow(bytes(10), 10, 0, 1, 1, 0, np.zeros(3, np.uint8))
    with pytest.raises(LocalProtocolError, match="one entry per segment"):
        dp.SendWindow(bytes(10), 10, 4, 1, 1, 0, np.zeros(2, np.uint8))
    with pytest.raises(LocalProtocolError, match="C-contiguous"):
        dp.SendWindow(np.zeros(20, np.uint8)[::2], 10, 4, 1, 1, 0, np.zeros(3, np.uint8))
    with pytest.raises(LocalProtocolError, match="buffer protocol"):
        dp.SendWindow(object(), 10, 4, 1, 1, 0, np.zeros(3, np.uint8))
    with pytest.raises(LocalProtocolError, match="read-only"):
        dp.RecvWindow(bytes(10), 10, 4, 1, 1, None)
    with pytest.raises(LocalProtocolError, match="one entry per segment"):
        dp.RecvWindow(bytearray(10), 10, 4, 1, 1, np.zeros(4, np.uint8))


def test_three_acks_declare_one_loss(dp):
    w = send_window(dp)
    build(w, range(10))
    r = ack(w, [(1, 1), (2, 1), (3, 1)])
    assert r[9].dtype == np.int64 and r[9].tolist() == [0]
    assert w.state[0] == dp.SEG_LOST and w.lost_events == 1
    assert (w.head, w.acked_in_window) == (4, 0)
    assert w.inflight_count == 6


def test_acks_after_gap_declare_every_earlier_loss(dp):
    w = send_window(dp)
    build(w, range(10))
    assert ack(w, [(3, 1), (4, 1)])[9].tolist() == []
    assert w.acked_in_window == 2 and w.head == 0
    assert ack(w, [(5, 1)])[9].tolist() == [0, 1, 2]
    assert ack(w, [(6, 1), (7, 1), (8, 1), (9, 1)])[9].tolist() == []
    assert (w.head, w.tail, w.acked_in_window, w.inflight_count) == (10, 10, 0, 0)
    assert w.state.tolist() == [3, 3, 3] + [2] * 7


def test_on_ack_rtt_and_rate_sample(dp):
    w = send_window(dp, total=950)
    build(w, [0], now=1.0, delivered=100, dtime=0.5, first=0.25)
    build(w, [9], now=2.0, delivered=200, dtime=1.5, first=0.75)
    r = w.on_ack(acks((9, 1), (0, 1)), 3.0, 1000, 2.9)
    newly, nbytes, delivered, dtime, rtt, pd, pt, fs, ss, lost = r
    assert (newly, nbytes) == (2, 100 + 50 + 2 * H)
    assert (delivered, dtime) == (1000 + 150 + 2 * H, 3.0)
    assert rtt == 1.0
    assert (pd, pt, fs, ss) == (200, 1.5, 0.75, 2.0)
    assert lost.tolist() == []
    assert (w.acked_count, w.acked_bytes, w.inflight_count, w.inflight_bytes) == (2, 150, 0, 0)


def test_on_ack_nothing_new(dp):
    w = send_window(dp)
    r = w.on_ack(np.zeros(0, np.uint32), 5.0, 77, 1.25)
    assert r[:9] == (0, 0, 77, 1.25, -1.0, -1, 0.0, 0.0, 0.0)
    assert r[9].shape == (0,) and r[9].dtype == np.int64


def test_an_older_attempts_ack_gives_no_rate_sample_and_only_the_first_gives_an_rtt(dp):
    """Attempt 1's send time is kept (``first_tx_time``): its ACK, after the segment was sent again, is an exact
    RTT. A later attempt's send time is overwritten by the next one, so its late ACK gives no RTT; neither gives a
    delivery-rate sample (the snapshot is the latest transmission's)."""
    w = send_window(dp)
    build(w, [0, 1], now=1.0)
    w.expire(1.0)
    assert w.state[0] == dp.SEG_LOST
    build(w, [0, 1], now=2.0)
    assert w.first_tx_time[:2].tolist() == [1.0, 1.0] and w.sent_time[:2].tolist() == [2.0, 2.0]
    r = ack(w, [(0, 1)], now=3.0)        # the first transmission arrived after all
    assert r[0] == 1 and r[4] == 2.0 and r[5] == -1
    assert w.state[0] == dp.SEG_ACKED and w.inflight_count == 1 and w.acked_in_window == 0
    w.expire(2.0)
    build(w, [1], now=4.0)               # attempt 3
    r = ack(w, [(1, 2)], now=5.0)        # attempt 2, sent at 2.0: its time is gone
    assert r[0] == 1 and r[4] == -1.0 and r[5] == -1
    assert w.oldest_inflight_time() == -1.0


def test_late_ack_of_lost_segment(dp):
    w = send_window(dp)
    build(w, [0, 1], now=1.0)
    assert w.expire(1.0).tolist() == [0, 1]
    r = ack(w, [(0, 1)], now=2.0)
    assert r[0] == 1 and r[4] == 1.0 and w.inflight_count == 0 and w.state[0] == dp.SEG_ACKED


def test_duplicate_and_bad_acks(dp):
    w = send_window(dp)
    build(w, [0, 1])
    ack(w, [(0, 1), (0, 1), (5, 1), (10, 1), (0xFFFFFF, 7)])
    assert (w.dup_acks, w.bad_acks, w.acked_count) == (1, 3, 1)
    ack(w, [(0, 2)])
    assert w.dup_acks == 2


def test_on_ack_accepts_generic_entries(dp):
    w = send_window(dp)
    build(w, [0, 1, 2])
    r = w.on_ack([(1 << 8) | 1, 2 << 8 | 1, 1 << 40], 1.0, 0, 0.0)
    assert r[0] == 2 and w.bad_acks == 1


def test_expire_cutoff_and_oldest(dp):
    w = send_window(dp)
    for t in range(5):
        build(w, [t], now=float(t))
    ack(w, [(1, 1)], now=5.0)
    assert w.oldest_inflight_time() == 0.0
    lost = w.expire(2.0)
    assert lost.dtype == np.int64 and lost.tolist() == [0, 2]
    assert w.oldest_inflight_time() == 3.0
    assert (w.head, w.acked_in_window, w.lost_events, w.inflight_count) == (3, 0, 2, 2)
    assert w.expire(2.5).tolist() == []
    assert w.expire(10.0).tolist() == [3, 4]
    assert w.oldest_inflight_time() == -1.0


def test_a_lane_counts_only_its_own_later_transmissions_for_loss(dp):
    """A batch built in lanes goes out as contiguous parts that may interleave on the wire (sender threads side
    by side). Packets 0-3 are lane 0 and 4-7 lane 1 of one batch: three acknowledgements in lane 1 declare
    nothing in lane 0 lost; three later ones in lane 0 do. Built in one lane, the same ACKs would have declared
    0-3 lost at once (the 3-out-of-order rule over the whole log)."""
    for lanes, lost_first in ((2, []), (1, [0, 1, 2, 3])):
        w = send_window(dp)
        out = bytearray(8 * H)
        w.build(np.arange(8, dtype=np.int64), 0.0, 0, 0.0, 0.0, 0, out, True, lanes)
        assert w.log_lane[:8].tolist() == ([0] * 4 + [1] * 4 if lanes == 2 else [0] * 8)
        assert ack(w, [(4, 1), (5, 1), (6, 1)])[9].tolist() == lost_first
        if lanes == 2:
            assert w.rack_candidate_time() == -1.0  # 0's lane has no later acknowledgement: RACK waits too
            assert w.detect_reordered(10.0).tolist() == []
            assert w.oldest_inflight_time() == 0.0
            assert ack(w, [(1, 1), (2, 1), (3, 1)])[9].tolist() == [0]
            assert ack(w, [(7, 1)])[9].tolist() == []


def test_lanes_cut_a_batch_as_the_sender_threads_do(dp):
    """Lane k of an m-packet batch in L lanes: packets m*k//L to m*(k+1)//L (UdpIO.send_segments(parts=L))."""
    for m, lanes in ((7, 3), (9, 2), (2, 3), (8, 8)):
        w = send_window(dp, total=100 * m, seg=100)
        out = bytearray(m * H)
        w.build(np.arange(m, dtype=np.int64), 0.0, 0, 0.0, 0.0, 0, out, True, lanes)
        want = [k for k in range(lanes) for _ in range(m * k // lanes, m * (k + 1) // lanes)]
        assert w.log_lane[:m].tolist() == want


@pytest.mark.parametrize("lanes", [0, 9, -1, 2.0, True, None, 2 ** 70])
def test_bad_lane_counts_raise_and_leave_the_buffer_free(dp, lanes):
    w = send_window(dp)
    out = bytearray(2 * H)
    with pytest.raises(LocalProtocolError, match="lanes must be 1..8"):
        w.build(np.arange(2, dtype=np.int64), 0.0, 0, 0.0, 0.0, 0, out, True, lanes)
    assert w.packets_sent == 0 and w.tail == 0
    out.extend(b"x")  # not still exported by the failed call


def test_detect_reordered_declares_only_overtaken_transmissions_old_enough(dp):
    """RACK's time threshold: lost = in flight, sent at or before the cutoff, with a later transmission in the
    send log already acknowledged. A message's last packets have fewer than three successors, so the
    3-out-of-order rule never sees their loss."""
    w = send_window(dp)
    for t in range(5):
        build(w, [t], now=float(t))
    assert ack(w, [(3, 1)], now=5.0)[9].tolist() == []  # one successor acknowledged: not 3
    assert w.acked_in_window == 1 and w.oldest_inflight_time() == 0.0
    assert w.detect_reordered(0.5).tolist() == [0]      # sent at 0.0 <= 0.5, overtaken by 3
    assert w.detect_reordered(1.5).tolist() == [1]
    assert w.detect_reordered(10.0).tolist() == [2]     # 4 was sent after the newest acknowledged (3): kept
    assert w.inflight_count == 1 and w.oldest_inflight_time() == 4.0 and w.acked_in_window == 0
    assert w.detect_reordered(10.0).tolist() == []
    assert w.expire(10.0).tolist() == [4]               # only the tail-loss timer takes the last one


def test_send_log_compacts_then_grows(dp):
    w = send_window(dp, total=40, seg=10)       # 4 segments: log capacity 64
    for t in range(64):
        build(w, [t % 4], now=float(t))
    assert (w.log_base, w.head, w.tail) == (0, 0, 64)
    assert w.expire(59.0).tolist() == []      # only the last transmission of each segment counts
    assert (w.head, w.tail) == (60, 64)
    build(w, [0], now=64.0)                   # 4 live entries <= 32: compacted in place
    assert (w.log_base, w.head, w.tail) == (60, 60, 65)
    assert w.log_seq.shape[0] == 64 and w.log_seq[:5].tolist() == [0, 1, 2, 3, 0]
    for t in range(65, 124):
        build(w, [t % 4], now=float(t))
    assert (w.log_base, w.head, w.tail, w.log_seq.shape[0]) == (60, 60, 124, 64)
    build(w, [0], now=124.0)                  # 64 live entries > 32: doubled
    assert (w.log_base, w.head, w.tail, w.log_seq.shape[0]) == (60, 60, 125, 128)
    assert w.log_seq[:65].tolist() == [t % 4 for t in range(60, 125)]


def test_arrays_share_memory_with_the_kernel(dp):
    w = send_window(dp)
    state = w.state
    build(w, [3])
    assert state[3] == dp.SEG_INFLIGHT
    rw = dp.RecvWindow(bytearray(100), 100, 10, 1, 2, None)
    bitmap, acks_arr = rw.bitmap, rw.acks
    buf = pack_header(T_DATA, 0, 1, 2, 4 << 8 | 1, 0) + bytes(10)
    rw.ingest(memoryview(buf), np.array([0]), np.array([len(buf)]), 0, 1)
    assert bitmap[4] == 1 and acks_arr[0] == (4 << 8 | 1)


# ---------------------------------------------------------------- RecvWindow

def datagrams(pkts):
    """Concatenate ``pkts`` into one buffer; return (memoryview, offsets, lengths)."""
    offsets, lengths, parts, pos = [], [], [], 0
    for p in pkts:
        offsets.append(pos)
        lengths.append(len(p))
        parts.append(p + b"\xee" * 3)     # gaps between datagrams
        pos += len(p) + 3
    return memoryview(bytearray(b"".join(parts))), np.array(offsets, np.int64), np.array(lengths, np.int64)


def data_pkt(seq, payload, fid=7, token=0xDEADBEEF, attempt=1, flags=0, w3=0x00010002, ptype=T_DATA):
    return pack_header(ptype, flags, fid, token, (seq << 8) | attempt, w3) + payload


def recv_window(dp, total=950, seg=100, crit=None, cap=4096):
    return dp.RecvWindow(bytearray(total), total, seg, 7, 0xDEADBEEF, crit, cap)


def test_ingest_reassembles(dp):
    data = message(950)
    w = recv_window(dp, crit=np.eye(1, 10, 9, dtype=np.uint8)[0])
    pkts = [data_pkt(s, data[s * 100:s * 100 + 100], attempt=s + 1, w3=s) for s in (9, 0, 3)]
    mv, off, ln = datagrams(pkts)
    assert w.ingest(mv, off, ln, 0, 3) == 3
    assert bytes(w.dest[:100]) == data[:100] and bytes(w.dest[900:950]) == data[900:]
    assert w.bitmap.tolist() == [1, 0, 0, 1, 0, 0, 0, 0, 0, 1]
    assert w.take_acks().tolist() == [9 << 8 | 10, 0 << 8 | 1, 3 << 8 | 4]
    assert w.n_acks == 0 and w.take_acks().dtype == np.uint32
    assert (w.received, w.received_bytes, w.duplicates, w.last_word3) == (3, 250, 0, 3)
    assert (w.critical_total, w.critical_received) == (1, 1)


@pytest.mark.parametrize("bad", [
    data_pkt(1, bytes(100), fid=8),
    data_pkt(1, bytes(100), token=1),
    data_pkt(1, bytes(100), ptype=T_ACK),
    bytes([0x21]) + data_pkt(1, bytes(100))[1:],        # version 2
    data_pkt(1, bytes(100), flags=0x08),                 # unknown flag
    data_pkt(1, bytes(100))[:15],                        # shorter than a header
])
def test_ingest_stops_at_foreign_datagram(dp, bad):
    w = recv_window(dp)
    mv, off, ln = datagrams([data_pkt(0, bytes(100)), bad, data_pkt(2, bytes(100))])
    assert w.ingest(mv, off, ln, 0, 3) == 1
    assert w.ingest(mv, off, ln, 1, 3) == 1
    assert w.ingest(mv, off, ln, 2, 3) == 3
    assert w.received == 2


def test_ingest_accepts_known_flags(dp):
    w = recv_window(dp)
    mv, off, ln = datagrams([data_pkt(0, bytes(100), flags=F_CRITICAL | F_RELIABLE | F_MAC)])
    assert w.ingest(mv, off, ln, 0, 1) == 1 and w.received == 1


def test_ingest_counts_bad_seq_and_length(dp):
    w = recv_window(dp)
    mv, off, ln = datagrams([data_pkt(10, bytes(100)), data_pkt(1, bytes(99)), data_pkt(9, bytes(100)),
                             data_pkt(9, bytes(50)), data_pkt(0x10000, bytes(100))])
    assert w.ingest(mv, off, ln, 0, 5) == 5
    assert (w.bad_seq, w.bad_length, w.received, w.n_acks) == (2, 2, 1, 1)


def test_ingest_duplicates_are_acked(dp):
    w = recv_window(dp)
    mv, off, ln = datagrams([data_pkt(2, b"a" * 100, attempt=1), data_pkt(2, b"b" * 100, attempt=2)])
    assert w.ingest(mv, off, ln, 0, 2) == 2
    assert w.take_acks().tolist() == [2 << 8 | 1, 2 << 8 | 2]
    assert (w.received, w.duplicates) == (1, 1)
    assert bytes(w.dest[200:300]) == b"a" * 100


def test_ingest_stops_when_ack_queue_is_full(dp):
    w = recv_window(dp, cap=2)
    mv, off, ln = datagrams([data_pkt(s, bytes(100)) for s in range(3)] + [data_pkt(20, bytes(100))])
    assert w.ingest(mv, off, ln, 0, 4) == 2
    assert w.acks.shape[0] == 2 and w.n_acks == 2 and w.received == 2
    assert w.take_acks().tolist() == [0 << 8 | 1, 1 << 8 | 1]
    assert w.ingest(mv, off, ln, 2, 4) == 4
    assert w.bad_seq == 1


def test_ingest_empty_range_and_long_run(dp):
    w = recv_window(dp, total=4000, seg=100)
    mv, off, ln = datagrams([data_pkt(s, bytes([s]) * 100) for s in range(40)])
    assert w.ingest(mv, off, ln, 5, 5) == 5
    assert w.ingest(mv, off, ln, 0, 40) == 40          # long enough to run without the GIL
    assert w.received == 40 and bytes(w.dest[3900:4000]) == bytes([39]) * 100


def test_ingest_index_past_arrays(dp):
    w = recv_window(dp)
    mv, off, ln = datagrams([data_pkt(0, bytes(100))])
    with pytest.raises(IndexError):
        w.ingest(mv, off, ln, 0, 2)
    assert w.received == 1


def test_ingest_generic_offsets(dp):
    w = recv_window(dp)
    mv, off, ln = datagrams([data_pkt(0, bytes(100)), data_pkt(1, bytes(100))])
    assert w.ingest(bytes(mv), off.tolist(), ln.astype(np.int32), 0, 2) == 2


def test_ingest_datagram_outside_buffer_is_refused(comp):
    w = recv_window(comp)
    mv, off, ln = datagrams([data_pkt(0, bytes(100))])
    with pytest.raises(LocalProtocolError, match="outside the buffer"):
        w.ingest(mv, off, ln + 10, 0, 1)
    with pytest.raises(LocalProtocolError):
        w.ingest(mv, off - 1, ln, 0, 1)
    assert w.received == 0


def test_missing_runs_and_zero_fill(dp):
    w = recv_window(dp)
    w.dest[:] = b"\xff" * 950
    assert w.missing_runs() == [(0, 10)]
    mv, off, ln = datagrams([data_pkt(s, b"\x01" * 100) for s in (0, 3, 4, 8)])
    w.ingest(mv, off, ln, 0, 4)
    runs = w.missing_runs()
    assert runs == [(1, 3), (5, 8), (9, 10)] and all(type(x) is int for r in runs for x in r)
    assert w.zero_fill_missing() == 200 + 300 + 50
    dest = bytes(w.dest)
    assert dest[100:300] == bytes(200) and dest[500:800] == bytes(300) and dest[900:] == bytes(50)
    assert dest[:100] == b"\x01" * 100 and dest[300:500] == b"\x01" * 200
    mv, off, ln = datagrams([data_pkt(s, bytes(100)) for s in (1, 2, 5, 6, 7)] + [data_pkt(9, bytes(50))])
    w.ingest(mv, off, ln, 0, 6)
    assert w.missing_runs() == [] and w.zero_fill_missing() == 0


# A window of STREAM_COPY_MIN bytes or more copies with streaming stores in the compiled module (x86-64): an
# ordinary head up to 16-byte alignment, 16-byte streaming stores, an ordinary tail. These check that every byte
# lands, and nothing around it moves, for payload sizes and destination alignments that exercise each part.

def _large_window_case(dp, seg, base, seqs):
    total = STREAM_COPY_MIN + seg // 2 + 1          # the last segment is short
    n = -(-total // seg)
    data = message(total, seed=seg + base)
    backing = bytearray(base + total + 64)
    w = dp.RecvWindow(memoryview(backing)[base:base + total], total, seg, 7, 0xDEADBEEF, None, 4096)
    seqs = [s % n for s in seqs]
    pkts = [data_pkt(s, data[s * seg:min(total, s * seg + seg)]) for s in seqs]
    assert w.ingest(*datagrams(pkts), 0, len(pkts)) == len(pkts)
    got = np.frombuffer(backing, np.uint8)
    want = np.zeros(len(backing), np.uint8)
    for s in set(seqs):
        lo = s * seg
        hi = min(total, lo + seg)
        want[base + lo:base + hi] = np.frombuffer(data[lo:hi], np.uint8)
    assert np.array_equal(got, want)              # every payload byte in place, nothing else written
    assert (w.received, w.duplicates) == (len(set(seqs)), len(seqs) - len(set(seqs)))
    return w


@pytest.mark.parametrize("seg", [1456, 8972, 1, 17, 63, 4101])
@pytest.mark.parametrize("base", [0, 3, 16, 61])
def test_large_window_copies_every_byte_and_nothing_else(dp, seg, base):
    rng = np.random.default_rng(seg * 100 + base)
    n = -(-(STREAM_COPY_MIN + seg // 2 + 1) // seg)
    seqs = [0, n - 1, n - 2] + rng.integers(0, n, 200).tolist() + [0, n - 1]     # first, last, shuffled, dups
    w = _large_window_case(dp, seg, base, seqs)
    assert w.bitmap[0] == 1 and w.bitmap[n - 1] == 1


@pytest.mark.parametrize("which", ["compiled", "twin"])
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seg=st.integers(1, 9000), base=st.integers(0, 63),
       seqs=st.lists(st.integers(0, 2**40), min_size=1, max_size=40))
def test_large_window_copy_property(which, seg, base, seqs):
    _large_window_case(_compiled() if which == "compiled" else twin, seg, base, seqs)


def test_streaming_stores_only_in_the_compiled_module_on_x86_64(comp):
    import platform

    assert comp.STREAMING_STORES == (platform.machine().lower() in ("x86_64", "amd64"))
    assert twin.STREAMING_STORES is False


def test_negative_ack_entry_is_a_bad_ack(dp):
    """A negative entry (only possible from a signed array) must not acknowledge a segment."""
    w = send_window(dp, total=950)
    build(w, [9])
    w.on_ack(np.array([-1], np.int64), 1.0, 0, 0.0)
    assert w.state[9] == dp.SEG_INFLIGHT and w.bad_acks == 1


# ---------------------------------------------------------------- differential

def _same(a, b) -> bool:
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return (isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and a.dtype == b.dtype
                and a.shape == b.shape and np.array_equal(a, b))
    if isinstance(a, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, float) or isinstance(b, float):
        return isinstance(a, (int, float)) and isinstance(b, (int, float)) and float(a) == float(b)
    return type(a) is type(b) and a == b


def _outcome(fn, *args):
    try:
        return ("ok", fn(*args))
    except Exception as exc:  # noqa: BLE001 - the type is what we compare
        return ("raise", type(exc))


SEND_ARRAYS = ("state", "attempt", "critical", "sent_time", "first_tx_time", "sent_idx", "snap_delivered", "snap_delivered_time",
               "snap_first_sent", "log_acked", "tx_batch", "first_batch", "tx_index", "reorder_verdict")
#: arrays compared up to the log's tail only (the rest is stale)
SEND_LOG_ARRAYS = ("log_lane",)
SEND_COUNTERS = ("total", "seg_size", "seg_count", "last_len", "log_base", "head", "tail", "acked_in_window",
                 "acked_count", "acked_bytes", "inflight_count", "inflight_bytes", "packets_sent", "retransmits",
                 "lost_events", "bad_acks", "dup_acks", "batches", "spurious_losses", "spurious_reorder_losses",
                 "reorder_threshold")


def send_snapshot(w) -> dict:
    snap = {k: getattr(w, k) for k in SEND_COUNTERS}
    snap.update({k: getattr(w, k).copy() for k in SEND_ARRAYS})
    snap["log_seq"] = w.log_seq[:w.tail - w.log_base].copy()   # the rest is np.empty garbage
    for k in SEND_LOG_ARRAYS:
        snap[k] = getattr(w, k)[:w.tail - w.log_base].copy()
    snap["log_cap"] = w.log_seq.shape[0]
    snap["oldest"] = w.oldest_inflight_time()
    snap["rack_candidate"] = w.rack_candidate_time()
    return snap


def assert_same_snapshot(a: dict, b: dict) -> None:
    for k in a:
        assert _same(a[k], b[k]), (k, a[k], b[k])


@st.composite
def send_scenarios(draw):
    n = draw(st.integers(1, 24))
    seg = draw(st.integers(1, 40))
    total = (n - 1) * seg + draw(st.integers(1, seg))
    crit = draw(st.lists(st.integers(0, 1), min_size=n, max_size=n))
    ops = []
    for _ in range(draw(st.integers(1, 60))):
        kind = draw(st.sampled_from(["build", "build", "build", "ack", "ack", "ack", "expire", "reordered",
                                     "threshold"]))
        dt = draw(st.sampled_from([0.0, 0.001, 0.01, 0.5]))
        if kind == "build":
            seqs = draw(st.lists(st.integers(0, n - 1), max_size=12))
            if draw(st.integers(0, 30)) == 0:
                seqs.insert(draw(st.integers(0, len(seqs))), draw(st.sampled_from([-1, n, n + 5])))
            short = draw(st.integers(0, 25)) == 0
            form = draw(st.sampled_from(["i64", "i64", "i64", "list", "i32", "strided"]))
            ops.append(("build", dt, seqs, short, form, draw(st.integers(0, 2 ** 32 - 1)),
                        draw(st.integers(0, 10 ** 9)), draw(st.sampled_from([1, 1, 1, 2, 3, 8, 0, 9]))))
        elif kind == "ack":
            entries = []
            for _ in range(draw(st.integers(0, 14))):
                seq = draw(st.integers(0, n + 2))
                entries.append((seq, draw(st.sampled_from(["cur", "cur", "cur", "old", "rand"])),
                                draw(st.integers(0, 255))))
            form = draw(st.sampled_from(["u32", "u32", "u32", "list", "i64"]))
            ops.append(("ack", dt, entries, form, draw(st.integers(0, 10 ** 9))))
        elif kind == "threshold":
            ops.append((kind, dt, draw(st.sampled_from([0, 1, 2, 3, 5, -1]))))
        else:
            ops.append((kind, dt, draw(st.sampled_from([0.0, 0.001, 0.01, 0.02, 1.0]))))
    return total, seg, crit, ops


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(send_scenarios())
def test_send_window_matches_twin(comp, scenario):
    total, seg, crit, ops = scenario
    data = message(total, seed=total)
    mask = np.array(crit, np.uint8)
    ws = [mod.SendWindow(data, total, seg, 0x0102, 0xA0B0C0D0, F_RELIABLE, mask) for mod in (twin, comp)]
    assert_same_snapshot(send_snapshot(ws[0]), send_snapshot(ws[1]))
    now = 0.0
    for op in ops:
        now += op[1]
        results = []
        for w in ws:
            if op[0] == "build":
                _k, _dt, seqs, short, form, est, delivered, lanes = op
                stride = H + seg
                size = len(seqs) * stride - (stride // 2 + 1 if short and seqs else 0)
                out = bytearray(b"\x5a" * max(size, 0))
                arg = {"i64": lambda s: np.array(s, np.int64), "list": list,
                       "i32": lambda s: np.array(s, np.int32),
                       "strided": lambda s: np.repeat(np.array(s, np.int64), 2)[::2]}[form](seqs)
                res = _outcome(w.build, arg, now, delivered, now / 2, now / 3, est, out, True, lanes)
                results.append((res, bytes(out)))
            elif op[0] == "ack":
                _k, _dt, entries, form, delivered = op
                vals = []
                for seq, how, a in entries:
                    cur = int(w.attempt[seq]) if seq < w.seg_count else a
                    att = cur if how == "cur" else (cur - 1) & 0xFF if how == "old" else a
                    vals.append((seq << 8) | att)
                arg = {"u32": lambda v: np.array(v, np.uint32), "list": list,
                       "i64": lambda v: np.array(v, np.int64)}[form](vals)
                results.append(_outcome(w.on_ack, arg, now, delivered, now / 4))
            elif op[0] == "threshold":
                results.append(_outcome(setattr, w, "reorder_threshold", op[2]))
            else:
                results.append(_outcome(w.expire if op[0] == "expire" else w.detect_reordered, now - op[2]))
        assert _same(results[0], results[1]), (op, results)
        assert_same_snapshot(send_snapshot(ws[0]), send_snapshot(ws[1]))


RECV_COUNTERS = ("total", "seg_size", "seg_count", "last_len", "critical_total", "critical_received", "received",
                 "received_bytes", "duplicates", "bad_seq", "bad_length", "last_word3", "n_acks")


def recv_snapshot(w) -> dict:
    snap = {k: getattr(w, k) for k in RECV_COUNTERS}
    snap["bitmap"] = w.bitmap.copy()
    snap["critical"] = w.critical.copy()
    snap["acks"] = w.acks[:w.n_acks].copy()
    snap["ack_cap"] = w.acks.shape[0]
    snap["dest"] = bytes(w.dest)
    snap["runs"] = w.missing_runs()
    return snap


@st.composite
def recv_scenarios(draw):
    n = draw(st.integers(1, 20))
    seg = draw(st.integers(1, 40))
    total = (n - 1) * seg + draw(st.integers(1, seg))
    crit = draw(st.one_of(st.none(), st.lists(st.integers(0, 1), min_size=n, max_size=n)))
    cap = draw(st.sampled_from([1, 3, 8, 4096]))
    pkts = []
    for _ in range(draw(st.integers(0, 50))):
        seq = draw(st.integers(0, n - 1))
        ln = total - seq * seg if seq == n - 1 else seg
        kind = draw(st.sampled_from(["ok"] * 8 + ["flow", "token", "type", "version", "flags", "seq", "len",
                                                   "short", "empty"]))
        fid, token, ptype, flags = 7, 0xDEADBEEF, T_DATA, draw(st.sampled_from([0, 1, 2, 3, 7]))
        if kind == "seq":
            seq = draw(st.integers(n, (1 << 24) - 1))
        elif kind == "len":
            ln = draw(st.integers(0, 2 * seg + 1).filter(lambda x: x != ln))
        elif kind == "flow":
            fid = draw(st.integers(0, 0xFFFF).filter(lambda x: x != 7))
        elif kind == "token":
            token = draw(st.integers(0, 2 ** 32 - 1).filter(lambda x: x != 0xDEADBEEF))
        elif kind == "type":
            ptype = draw(st.sampled_from([0, 2, 3, 4, 5, 15]))
        elif kind == "flags":
            flags = draw(st.integers(8, 255))
        pkt = data_pkt(seq, draw(st.binary(min_size=ln, max_size=ln)), fid=fid, token=token,
                       attempt=draw(st.integers(0, 255)), flags=flags, w3=draw(st.integers(0, 2 ** 32 - 1)),
                       ptype=ptype)
        if kind == "version":
            pkt = bytes([draw(st.sampled_from([0x01, 0x21, 0xF1]))]) + pkt[1:]
        elif kind == "short":
            pkt = pkt[:draw(st.integers(1, 15))]
        elif kind == "empty":
            pkt = b""
        pkts.append(pkt)
        if pkts and draw(st.integers(0, 5)) == 0:
            pkts.append(pkts[draw(st.integers(0, len(pkts) - 1))])   # duplicate
    steps = draw(st.lists(st.tuples(st.integers(1, 70), st.booleans()), min_size=1, max_size=30))
    return total, seg, crit, cap, pkts, steps


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(recv_scenarios())
def test_recv_window_matches_twin(comp, scenario):
    total, seg, crit, cap, pkts, steps = scenario
    mask = None if crit is None else np.array(crit, np.uint8)
    ws = [mod.RecvWindow(bytearray(b"\x77" * total), total, seg, 7, 0xDEADBEEF, mask, cap) for mod in (twin, comp)]
    mv, off, ln = datagrams(pkts)
    count = len(pkts)
    i = 0
    for run, take in steps:
        stop = min(count, i + run)
        res = [w.ingest(mv, off, ln, i, stop) for w in ws]
        assert res[0] == res[1]
        assert_same_snapshot(recv_snapshot(ws[0]), recv_snapshot(ws[1]))
        j = res[0]
        if take or ws[0].n_acks >= ws[0].acks.shape[0]:
            assert _same(ws[0].take_acks(), ws[1].take_acks())
        elif j == i and i < count:
            i += 1          # the engine's general path takes the foreign datagram
        i = max(i, j)
        if i >= count:
            break
    assert ws[0].zero_fill_missing() == ws[1].zero_fill_missing()
    assert_same_snapshot(recv_snapshot(ws[0]), recv_snapshot(ws[1]))


def test_a_loss_verdict_proved_wrong_is_counted_by_its_rule(dp):
    """``spurious_losses`` counts verdicts whose transmission is acknowledged after all: before the resend is
    built (state LOST) or as an older attempt after it. ``spurious_reorder_losses`` counts the ones the reordering
    rules made (packet count, RACK time), not the tail-loss timer's (``expire``)."""
    w = send_window(dp)
    build(w, range(10), now=1.0)
    assert ack(w, [(1, 1), (2, 1), (3, 1)])[9].tolist() == [0]  # the packet-count rule
    ack(w, [(0, 1)])  # ...but segment 0 arrived: before its resend was built
    assert (w.spurious_losses, w.spurious_reorder_losses, w.dup_acks) == (1, 1, 0)
    assert w.expire(1.0).tolist() == [4, 5, 6, 7, 8, 9]  # the timer
    build(w, [4, 5], now=2.0)  # attempt 2 of 4 and 5 leave
    ack(w, [(4, 1), (6, 1)])  # attempt 1 of 4 arrives after its resend left; 6 was never resent
    assert (w.spurious_losses, w.spurious_reorder_losses) == (3, 1)
    ack(w, [(4, 2), (5, 2)])  # 4's resend is a duplicate now; 5's resend was needed
    assert (w.spurious_losses, w.spurious_reorder_losses, w.dup_acks) == (3, 1, 1)
    assert w.reorder_verdict[:10].tolist() == [1, 0, 0, 0, 0, 0, 0, 0, 0, 0]


def test_a_window_with_the_packet_count_rule_off_waits_for_the_time_rule(dp):
    w = send_window(dp)
    assert w.reorder_threshold == dp.PACKET_REORDER_THRESHOLD == 3
    w.reorder_threshold = 0
    build(w, range(10), now=1.0)
    assert ack(w, [(k, 1) for k in range(1, 10)], now=1.1)[9].tolist() == []  # nine overtook it: no verdict
    assert w.detect_reordered(1.0).tolist() == [0]  # the RACK time rule still declares it
    w2 = send_window(dp)
    w2.reorder_threshold = 5
    build(w2, range(10), now=1.0)
    assert ack(w2, [(k, 1) for k in range(1, 5)])[9].tolist() == []
    assert ack(w2, [(5, 1)])[9].tolist() == [0]


@pytest.mark.parametrize("bad", [-1, 1.5, True, "3", None, 1 << 31])
def test_a_bad_reorder_threshold_is_refused(dp, bad):
    w = send_window(dp)
    with pytest.raises(LocalProtocolError, match="reorder_threshold must be an int"):
        w.reorder_threshold = bad
    assert w.reorder_threshold == 3
