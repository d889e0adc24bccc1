"""Per-flow data-path kernels, pure-Python twin of ``ltp_ext._datapath``.

Theory of operation.

:class:`SendWindow` is the per-flow bookkeeping of a sender. Each segment has a
state (PENDING → INFLIGHT → ACKED, or INFLIGHT → LOST → INFLIGHT again when
retransmitted), an 8-bit attempt counter (echoed by the receiver so an ACK
names one exact transmission), its send time and the delivery-rate snapshot
taken when it was sent. Every transmission is appended to the *send log* in
the order packets actually left. Loss detection walks the log from its head
(the oldest unresolved transmission): the head is lost when at least ``PACKET_REORDER_THRESHOLD`` (3)
transmissions sent after it have been acknowledged (``acked_in_window`` counts
the acknowledged entries between head and tail, so the test is O(1)); acked,
stale (segment retransmitted since) and already-resolved entries are skipped.
Because the head has at least as many acknowledged successors as any later
entry, stopping at the first head that does not qualify is exact.
:meth:`SendWindow.expire` is the tail-loss timer's counterpart: it declares
lost every in-flight transmission sent before a cutoff.
:meth:`SendWindow.detect_reordered` is the RACK time threshold (RFC 8985): it
declares lost every in-flight transmission sent before a cutoff that has an
acknowledged successor in the log (``acked_in_window`` > 0 at the head), which
catches a loss among a message's last packets, where fewer than three
successors exist, a round trip and a reordering window after it was sent.
``reorder_threshold`` (default ``PACKET_REORDER_THRESHOLD``; 0: off) is the
packet-count rule's threshold, set by the sender per path (``ltp.reordering``).
A verdict is proved wrong when its transmission is acknowledged after all
(before the resend was built, or as an older attempt after it):
``spurious_losses`` counts those, ``spurious_reorder_losses`` the ones the
reordering rules made (``reorder_verdict`` remembers per segment which kind of
rule made its latest verdict).

:class:`RecvWindow` is the per-flow state of a receiver: it validates each DATA
datagram of its flow, copies the payload straight into the destination buffer
at ``seq × segment_size``, sets the segment's bitmap byte and queues one ACK
entry (``seq << 8 | attempt``) per datagram, duplicates included, so the
sender learns about every transmission. It stops at the first datagram that
is not a DATA packet of this flow and leaves it to the caller's general path.

Byte accounting: in-flight and delivered bytes count whole datagrams (payload
plus the 16-byte header), which is what occupies the network.
"""

from __future__ import annotations

import numpy as np

from .constants import PACKET_REORDER_THRESHOLD, SEND_BATCH_MIN, SEND_THREADS_MAX
from .errors import LocalProtocolError
from ._wire_py import F_CRITICAL, F_KNOWN, HEADER_SIZE, T_DATA, VERSION, pack_header_into

#: the compiled module copies large receive windows with streaming stores where the CPU has them; the twin
#: always copies with ordinary slice assignment (the bytes that land are the same)
STREAMING_STORES = False

_I32_MAX = 0x7FFFFFFF  # the send log, tx_index and the batch numbers are int32 (as the compiled window's)

SEG_PENDING = 0
SEG_INFLIGHT = 1
SEG_ACKED = 2
SEG_LOST = 3
_DATA_B0 = (VERSION << 4) | T_DATA


def _as_bytes_view(buf, writable: bool) -> memoryview:
    try:
        mv = memoryview(buf)
    except TypeError:
        raise LocalProtocolError("buffer must support the buffer protocol (bytes, bytearray, numpy array)") from None
    if not mv.c_contiguous:
        raise LocalProtocolError("buffer must be C-contiguous; pass numpy.ascontiguousarray(x)")
    if writable and mv.readonly:
        raise LocalProtocolError("receive buffer is read-only; pass a bytearray or a writable numpy array")
    return mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv


class _Geometry:
    """Message geometry shared by both windows: sizes, segment count, the flow's identity."""

    def _init_geometry(self, buf_len: int, what: str, total: int, seg_size: int, flow_id: int, token: int) -> int:
        if total > buf_len or total <= 0 or seg_size <= 0:
            raise LocalProtocolError(f"total must be in 1..len({what}) and seg_size positive")
        self.total = total
        self.seg_size = seg_size
        self.seg_count = n = (total + seg_size - 1) // seg_size
        self.last_len = total - (n - 1) * seg_size
        self.flow_id = flow_id
        self.token = token
        return n


class SendWindow(_Geometry):
    """Sender-side per-segment state, packet building, ACK processing and loss detection.

    A transmission's send time and delivery-rate snapshot are the same for every packet of one
    :meth:`build` call, so they are kept once per call (a *batch*) and each segment holds the batch of
    its latest transmission (``tx_batch``) and of its first (``first_batch``). Batch 0 is "never sent"
    (all zero). The send log and ``tx_index`` (1 + a segment's latest send index, 0: never) are int32 for
    the same reason. ``sent_time``, ``first_tx_time``, ``sent_idx`` and the ``snap_*`` arrays are per-segment
    views built on demand.
    """

    def __init__(self, data, total: int, seg_size: int, flow_id: int, token: int, flags: int, critical) -> None:
        self.data = _as_bytes_view(data, False)
        n = self._init_geometry(len(self.data), "data", total, seg_size, flow_id, token)
        self.flags = flags
        self.critical = np.ascontiguousarray(critical, dtype=np.uint8)
        if self.critical.shape[0] != n:
            raise LocalProtocolError("critical mask must have one entry per segment")
        if n > _I32_MAX:
            raise LocalProtocolError("too many segments for one message")
        self.state = np.zeros(n, np.uint8)
        self.attempt = np.zeros(n, np.uint8)
        self.tx_batch = np.zeros(n, np.int32)
        self.first_batch = np.zeros(n, np.int32)  # attempt 1's batch: an ACK echoing it is an exact RTT sample
        self.reorder_verdict = np.zeros(n, np.uint8)  # per segment: its latest loss verdict came from a reordering rule
        self.tx_index = np.zeros(n, np.int32)  # 1 + the send index of the latest transmission (0: never)
        # per batch: send time, and the path's delivered bytes, delivered time and first-sent time at send
        self._b_time = np.zeros(SEND_BATCH_MIN, np.float64)
        self._b_d = np.zeros(SEND_BATCH_MIN, np.int64)
        self._b_dt = np.zeros(SEND_BATCH_MIN, np.float64)
        self._b_fs = np.zeros(SEND_BATCH_MIN, np.float64)
        self.batches = 1  # batch 0: never sent
        cap = max(64, n + n // 4)
        self.log_seq = np.empty(cap, np.int32)
        self.log_acked = np.zeros(cap, np.uint8)
        self.log_lane = np.zeros(cap, np.uint8)  # per entry: the lane (part of its batch) it was sent in
        self._lane_acked = [0] * SEND_THREADS_MAX  # per lane: acknowledged entries from head on
        self.log_base = 0  # send index of log_seq[0]
        self.head = 0  # oldest unresolved send index
        self.tail = 0  # next send index
        self.acked_in_window = 0
        self.acked_count = 0
        self.acked_bytes = 0
        self.inflight_count = 0
        self.inflight_bytes = 0
        self.packets_sent = 0
        self.retransmits = 0
        self.lost_events = 0
        self.spurious_losses = 0
        self.spurious_reorder_losses = 0
        self.bad_acks = 0
        self.dup_acks = 0
        self._reorder_threshold = PACKET_REORDER_THRESHOLD

    @property
    def reorder_threshold(self) -> int:
        """How many later transmissions of its lane must be acknowledged before :meth:`on_ack` declares one lost
        (``PACKET_REORDER_THRESHOLD`` by default); 0 turns that rule off, leaving the RACK time rule
        (:meth:`detect_reordered`) and the tail-loss timer (:meth:`expire`): the sender sets it per path, and turns
        it off where the path proved to reorder (``ltp.reordering``)."""
        return self._reorder_threshold

    @reorder_threshold.setter
    def reorder_threshold(self, value: int) -> None:
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= _I32_MAX:
            raise LocalProtocolError(f"reorder_threshold must be an int in 0..{_I32_MAX} (0: off), got {value!r}")
        self._reorder_threshold = value

    def seg_len(self, seq: int) -> int:
        """Payload bytes of segment ``seq``."""
        return self.last_len if seq == self.seg_count - 1 else self.seg_size

    def _batch_open(self, now: float, delivered: int, delivered_time: float, first_sent_time: float) -> int:
        b = self.batches
        if b >= self._b_time.shape[0]:
            cap = self._b_time.shape[0] * 2
            if cap > _I32_MAX:
                raise LocalProtocolError("too many send batches for one message")
            for name in ("_b_time", "_b_d", "_b_dt", "_b_fs"):
                old = getattr(self, name)
                new = np.zeros(cap, old.dtype)
                new[:b] = old[:b]
                setattr(self, name, new)
        self._b_time[b] = now
        self._b_d[b] = delivered
        self._b_dt[b] = delivered_time
        self._b_fs[b] = first_sent_time
        self.batches = b + 1
        return b

    @property
    def sent_idx(self) -> np.ndarray:
        """Per segment: the send index of its latest transmission (-1: never sent)."""
        return self.tx_index.astype(np.int64) - 1

    @property
    def sent_time(self) -> np.ndarray:
        """Per segment: when its latest transmission left (0.0: never sent)."""
        return self._b_time[self.tx_batch]

    @property
    def first_tx_time(self) -> np.ndarray:
        """Per segment: when its first transmission left (0.0: never sent)."""
        return self._b_time[self.first_batch]

    @property
    def snap_delivered(self) -> np.ndarray:
        """Per segment: the path's delivered bytes when its latest transmission left."""
        return self._b_d[self.tx_batch]

    @property
    def snap_delivered_time(self) -> np.ndarray:
        """Per segment: the path's delivered time when its latest transmission left."""
        return self._b_dt[self.tx_batch]

    @property
    def snap_first_sent(self) -> np.ndarray:
        """Per segment: the path's first-sent time when its latest transmission left."""
        return self._b_fs[self.tx_batch]

    def _log_append(self, seq: int, lane: int = 0) -> int:
        if self.tail >= _I32_MAX - 1:
            raise LocalProtocolError("too many transmissions for one message")
        pos = self.tail - self.log_base
        if pos >= self.log_seq.shape[0]:
            keep = self.tail - self.head
            start = self.head - self.log_base
            if keep * 2 > self.log_seq.shape[0]:
                new_seq = np.empty(self.log_seq.shape[0] * 2, np.int32)
                new_acked = np.zeros(self.log_seq.shape[0] * 2, np.uint8)
                new_lane = np.zeros(self.log_seq.shape[0] * 2, np.uint8)
            else:
                new_seq, new_acked, new_lane = self.log_seq, self.log_acked, self.log_lane
            new_seq[:keep] = self.log_seq[start:start + keep]
            new_acked[:keep] = self.log_acked[start:start + keep]
            new_lane[:keep] = self.log_lane[start:start + keep]
            new_acked[keep:] = 0
            self.log_seq, self.log_acked, self.log_lane = new_seq, new_acked, new_lane
            self.log_base = self.head
            pos = self.tail - self.log_base
        self.log_seq[pos] = seq
        self.log_acked[pos] = 0
        self.log_lane[pos] = lane
        idx = self.tail
        self.tail += 1
        return idx

    def build(self, seqs, now: float, delivered: int, delivered_time: float, first_sent_time: float,
              est_word: int, out, headers_only: bool = False, lanes: int = 1) -> int:
        """Write DATA packets for ``seqs`` into ``out`` at a stride of ``16 + seg_size``.

        Only the last packet may be short (the caller puts the final segment
        last). Returns the number of wire bytes of the packets built.  With
        ``headers_only`` only the 16-byte headers are written, packed at a
        stride of 16 (the payload stays in the message, for a gather send).

        ``lanes`` (1..``SEND_THREADS_MAX``): the batch goes out as that many
        contiguous parts that may interleave on the wire (part ``k``: packets
        ``m*k//lanes`` to ``m*(k+1)//lanes`` of ``m``; ``UdpIO.send_segments(parts=)``).
        Loss detection then counts, for a transmission, only the later ones of
        its own lane: each part keeps its order, the parts do not.
        """
        if not isinstance(lanes, int) or isinstance(lanes, bool) or not 1 <= lanes <= SEND_THREADS_MAX:
            raise LocalProtocolError(f"lanes must be 1..{SEND_THREADS_MAX}, got {lanes!r}")
        mv = _as_bytes_view(out, True)
        stride = HEADER_SIZE + self.seg_size
        written = 0
        batch = self._batch_open(now, delivered, delivered_time, first_sent_time) if len(seqs) else 0
        m = len(seqs)
        lane, cut = 0, m // lanes
        for k in range(m):
            while k >= cut:
                lane += 1
                cut = m * (lane + 1) // lanes
            seq = int(seqs[k])
            if seq < 0 or seq >= self.seg_count:
                raise LocalProtocolError(f"segment {seq} out of range")
            a = (int(self.attempt[seq]) + 1) & 0xFF
            self.attempt[seq] = a
            st = self.state[seq]
            if st != SEG_PENDING:
                self.retransmits += 1
            else:
                self.first_batch[seq] = batch
            if st == SEG_INFLIGHT:
                self.inflight_count -= 1
                self.inflight_bytes -= self.seg_len(seq) + HEADER_SIZE
            length = self.seg_len(seq)
            off = k * HEADER_SIZE if headers_only else k * stride
            flags = self.flags | (F_CRITICAL if self.critical[seq] else 0)
            pack_header_into(mv, off, T_DATA, flags, self.flow_id, self.token, (seq << 8) | a, est_word)
            if not headers_only:
                start = seq * self.seg_size
                mv[off + HEADER_SIZE:off + HEADER_SIZE + length] = self.data[start:start + length]
            self.state[seq] = SEG_INFLIGHT
            self.inflight_count += 1
            self.inflight_bytes += length + HEADER_SIZE
            self.tx_batch[seq] = batch
            self.tx_index[seq] = self._log_append(seq, lane) + 1
            self.packets_sent += 1
            written = k * stride + HEADER_SIZE + length
        return written

    def on_ack(self, entries, now: float, delivered: int, delivered_time: float) -> tuple:
        """Process ACK entries (``seq << 8 | attempt``).

        Returns ``(newly_acked, newly_acked_bytes, delivered, delivered_time,
        rtt, prior_delivered, prior_time, first_sent, sample_sent, lost)``:
        ``rtt`` is the smallest RTT sample (-1.0 if none), the ``prior_*``,
        ``first_sent`` and ``sample_sent`` describe the most recently sent
        newly acknowledged transmission (``prior_delivered`` = -1 if none) and
        ``lost`` is an int64 array of segments newly declared lost.
        """
        newly = 0
        newly_bytes = 0
        rtt = -1.0
        best_idx = -1
        best_seq = -1
        n = self.seg_count
        for k in range(len(entries)):
            e = int(entries[k])
            seq = e >> 8
            a = e & 0xFF
            if e < 0 or seq >= n:
                self.bad_acks += 1
                continue
            st = self.state[seq]
            if st == SEG_ACKED:
                self.dup_acks += 1
                continue
            if st == SEG_PENDING:
                self.bad_acks += 1
                continue
            if st == SEG_LOST or a != self.attempt[seq]:
                # a transmission this window had declared lost arrived after all (its resend is not built yet,
                # or an older attempt is acknowledged after the resend left): the verdict was wrong
                self.spurious_losses += 1
                self.spurious_reorder_losses += int(self.reorder_verdict[seq])
            wire = self.seg_len(seq) + HEADER_SIZE
            if st == SEG_INFLIGHT:
                self.inflight_count -= 1
                self.inflight_bytes -= wire
            if a == self.attempt[seq]:
                r = now - self._b_time[self.tx_batch[seq]]
                if rtt < 0.0 or r < rtt:
                    rtt = r
                idx = int(self.tx_index[seq]) - 1
                if idx >= self.head:
                    self.log_acked[idx - self.log_base] = 1
                    self.acked_in_window += 1
                    self._lane_acked[self.log_lane[idx - self.log_base]] += 1
                if idx > best_idx:
                    best_idx = idx
                    best_seq = seq
            elif a == 1:
                # the first transmission, acknowledged after the segment was sent again (a probe timeout that
                # fired before the path's first RTT was known): its send time is kept, so the RTT is exact
                r = now - self._b_time[self.first_batch[seq]]
                if rtt < 0.0 or r < rtt:
                    rtt = r
            self.state[seq] = SEG_ACKED
            self.acked_count += 1
            self.acked_bytes += wire - HEADER_SIZE
            newly += 1
            newly_bytes += wire
        if newly:
            delivered += newly_bytes
            delivered_time = now
        if best_seq >= 0:
            b = int(self.tx_batch[best_seq])
            prior_delivered = int(self._b_d[b])
            prior_time = float(self._b_dt[b])
            first_sent = float(self._b_fs[b])
            sample_sent = float(self._b_time[b])
        else:
            prior_delivered, prior_time, first_sent, sample_sent = -1, 0.0, 0.0, 0.0
        lost = self._detect(self._reorder_threshold, -1.0) if self._reorder_threshold else np.empty(0, np.int64)
        return (newly, newly_bytes, delivered, delivered_time, rtt, prior_delivered, prior_time,
                first_sent, sample_sent, lost)

    def expire(self, cutoff: float) -> np.ndarray:
        """Declare lost every in-flight transmission sent at or before ``cutoff`` (tail-loss timer)."""
        return self._detect(0, cutoff)

    def detect_reordered(self, cutoff: float) -> np.ndarray:
        """Declare lost every in-flight transmission sent at or before ``cutoff`` that a later transmission
        overtook: one sent after it was acknowledged (the RACK time threshold, RFC 8985)."""
        return self._detect(-1, cutoff)

    def _detect(self, threshold: int, cutoff: float) -> np.ndarray:
        lost = []
        while self.head < self.tail:
            i = self.head - self.log_base
            seq = int(self.log_seq[i])
            if self.log_acked[i]:
                self.acked_in_window -= 1
                self._lane_acked[self.log_lane[i]] -= 1
                self.head += 1
                continue
            if self.tx_index[seq] != self.head + 1 or self.state[seq] != SEG_INFLIGHT:
                self.head += 1
                continue
            later = self._lane_acked[self.log_lane[i]]  # acknowledged transmissions after it, in its lane
            if ((threshold > 0 and later >= threshold)
                    or (threshold == 0 and self._b_time[self.tx_batch[seq]] <= cutoff)
                    or (threshold < 0 and later > 0 and self._b_time[self.tx_batch[seq]] <= cutoff)):
                self.state[seq] = SEG_LOST
                self.reorder_verdict[seq] = threshold != 0
                self.inflight_count -= 1
                self.inflight_bytes -= self.seg_len(seq) + HEADER_SIZE
                self.lost_events += 1
                lost.append(seq)
                self.head += 1
                continue
            break
        return np.array(lost, dtype=np.int64)

    def oldest_inflight_time(self) -> float:
        """Send time of the oldest unresolved in-flight transmission, or -1.0."""
        return self._oldest(False)

    def rack_candidate_time(self) -> float:
        """Send time of the oldest unresolved in-flight transmission if a later one of its lane was acknowledged
        (what :meth:`detect_reordered` would declare lost once its cutoff passes that time), else -1.0."""
        return self._oldest(True)

    def _oldest(self, overtaken: bool) -> float:
        h = self.head
        while h < self.tail:
            i = h - self.log_base
            seq = int(self.log_seq[i])
            if not self.log_acked[i] and self.tx_index[seq] == h + 1 and self.state[seq] == SEG_INFLIGHT:
                if overtaken and self._lane_acked[self.log_lane[i]] <= 0:
                    return -1.0
                return float(self._b_time[self.tx_batch[seq]])
            h += 1
        return -1.0


class RecvWindow(_Geometry):
    """Receiver-side per-flow state: validation, in-place reassembly, bitmap and ACK entries."""

    def __init__(self, dest, total: int, seg_size: int, flow_id: int, token: int, critical,
                 ack_capacity: int = 4096) -> None:
        self.dest = _as_bytes_view(dest, True)
        n = self._init_geometry(len(self.dest), "dest", total, seg_size, flow_id, token)
        self.bitmap = np.zeros(n, np.uint8)
        if critical is None:
            self.critical = np.zeros(n, np.uint8)
        else:
            self.critical = np.ascontiguousarray(critical, dtype=np.uint8)
            if self.critical.shape[0] != n:
                raise LocalProtocolError("critical mask must have one entry per segment")
        self.critical_total = int(np.count_nonzero(self.critical))
        self.critical_received = 0
        self.received = 0
        self.received_bytes = 0
        self.duplicates = 0
        self.bad_seq = 0
        self.bad_length = 0
        self.last_word3 = 0
        self.acks = np.empty(ack_capacity, np.uint32)
        self.n_acks = 0

    def ingest(self, buf, offsets, lengths, start: int, stop: int) -> int:
        """Consume DATA datagrams of this flow from index ``start``; return the first index not consumed."""
        mv = buf if isinstance(buf, memoryview) else memoryview(buf)
        n = self.seg_count
        cap = self.acks.shape[0]
        for i in range(start, stop):
            o = int(offsets[i])
            length = int(lengths[i])
            if length < HEADER_SIZE or mv[o] != _DATA_B0:
                return i
            flags = mv[o + 1]
            if (mv[o + 2] << 8 | mv[o + 3]) != self.flow_id or flags & ~F_KNOWN:
                return i
            if int.from_bytes(mv[o + 4:o + 8], "big") != self.token:
                return i
            w2 = int.from_bytes(mv[o + 8:o + 12], "big")
            seq = w2 >> 8
            if seq >= n:
                self.bad_seq += 1
                continue
            plen = length - HEADER_SIZE
            if plen != (self.last_len if seq == n - 1 else self.seg_size):
                self.bad_length += 1
                continue
            if self.n_acks >= cap:
                return i
            self.acks[self.n_acks] = w2
            self.n_acks += 1
            self.last_word3 = int.from_bytes(mv[o + 12:o + 16], "big")
            if self.bitmap[seq]:
                self.duplicates += 1
                continue
            start_b = seq * self.seg_size
            self.dest[start_b:start_b + plen] = mv[o + HEADER_SIZE:o + length]
            self.bitmap[seq] = 1
            self.received += 1
            self.received_bytes += plen
            if self.critical[seq]:
                self.critical_received += 1
        return stop

    def take_acks(self) -> np.ndarray:
        """Return and clear the queued ACK entries."""
        out = self.acks[:self.n_acks].copy()
        self.n_acks = 0
        return out

    def missing_runs(self) -> list:
        """Half-open segment ranges that have not arrived, in order."""
        missing = np.flatnonzero(self.bitmap == 0)
        if missing.size == 0:
            return []
        breaks = np.flatnonzero(np.diff(missing) != 1)
        starts = np.concatenate(([missing[0]], missing[breaks + 1]))
        ends = np.concatenate((missing[breaks] + 1, [missing[-1] + 1]))
        return [(int(a), int(b)) for a, b in zip(starts, ends)]

    def zero_fill_missing(self) -> int:
        """Write zeros over every missing segment (packet bubbles); return bytes zeroed."""
        zeroed = 0
        for a, b in self.missing_runs():
            lo = a * self.seg_size
            hi = min(b * self.seg_size, self.total)
            self.dest[lo:hi] = bytes(hi - lo)
            zeroed += hi - lo
        return zeroed
