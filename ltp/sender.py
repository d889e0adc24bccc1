"""The sending side of one flow (one message).

Theory of operation. A flow starts by queueing a REG datagram (repeated with
exponential back-off until the receiver answers with any ACK or STOP) and its
segments: critical ones into the **Critical Queue (CQ)**, the rest into the
**Normal Queue (NQ)**, both FIFO in segment order. :meth:`take` hands the path
scheduler up to *n* segments to transmit, always CQ first, then NQ, and the
**Retransmit Queue (RQ)** only once CQ and NQ are empty. Loss detection lives
in the :class:`SendWindow` kernel (three later transmissions acknowledged, or
the tail-loss timer); a lost critical segment goes back into CQ, a lost
normal one into RQ. The same machine serves both modes: in reliable mode the
receiver never stops early, so the flow ends only when every segment is
acknowledged; in loss-tolerant mode it also ends when the receiver sends STOP.

States: ``OPEN`` (sending) → ``DONE`` (all acked or STOP) or ``FAILED``
(RESET, idle timeout, abort). Nothing here reads a clock: every input carries
``now``.
"""

from __future__ import annotations

from collections import deque

import numpy as np

from ltp_ext import load as _load

from . import wire
from .admission import reg_mac
from .bubbles import critical_mask
from .errors import LocalProtocolError

_dp = _load("datapath")
SEG_ACKED = _dp.SEG_ACKED
SEG_LOST = _dp.SEG_LOST

__all__ = ["FlowSender", "OPEN", "DONE", "FAILED"]

OPEN = "open"
DONE = "done"
FAILED = "failed"


#: a receiver that lost (expired) our registration asks again this many times before the flow fails
MAX_REREGISTRATIONS = 8

#: the longest wait between two registration rounds (seconds)
REG_GAP_MAX_S = 1.0

#: a REG refused as ``stale`` is stamped afresh and sent again this many times before the flow fails: a process
#: that stopped (SIGSTOP, a long pause) between taking ``now`` and sending, on either side, makes one REG look
#: old; a clock that is really off draws ``stale`` every time and fails after these few round trips
STALE_RETRIES = 2


def holds_objects(obj, mv: memoryview) -> bool:
    """True when buffer ``mv`` of ``obj`` holds Python object pointers (a numpy ``dtype=object`` array)."""
    dtype = getattr(obj, "dtype", None)
    return bool(getattr(dtype, "hasobject", False)) or mv.format == "O"


class FlowSender:
    """Sender state machine of one message to one peer."""

    def __init__(self, *, handle: int, peer, flow_id: int, token: int, data, element_size: int,
                 segment_size: int, reliable: bool, critical, tag: int, now: float,
                 job_key: bytes | None = None, source=None, reg_copies: int = 1) -> None:
        try:
            mv = memoryview(data)
        except TypeError:
            raise LocalProtocolError("data must support the buffer protocol (bytes, bytearray, numpy array)") from None
        if not mv.c_contiguous:
            raise LocalProtocolError("data must be C-contiguous; pass numpy.ascontiguousarray(x)")
        if holds_objects(data, mv):
            raise LocalProtocolError("data holds Python objects (dtype object): its bytes are this process's memory "
                                     "addresses, meaningless to the peer; send a numeric array or serialized bytes")
        mv = mv.cast("B") if (mv.format != "B" or mv.ndim != 1) else mv
        total = mv.nbytes
        if total == 0:
            raise LocalProtocolError("cannot send an empty message; send at least one element")
        if element_size <= 0 or total % element_size:
            raise LocalProtocolError(
                f"message of {total} bytes is not a multiple of element_size={element_size}; "
                "pad it or pass the right element_size (4 for float32)")
        if not 0 <= tag < 1 << 64:
            raise LocalProtocolError("tag must be an integer in [0, 2**64)")
        self.handle = handle
        self.peer = peer
        self.flow_id = flow_id
        self.token = token
        self.tag = tag
        self.reliable = reliable
        self.element_size = element_size
        self.total = total
        self.seg_size = segment_size
        mask, runs = critical_mask(critical, total, segment_size)
        if len(runs) > wire.MAX_RANGES:
            raise LocalProtocolError(
                f"{len(runs)} critical ranges after merging; at most {wire.MAX_RANGES} fit a registration — merge them")
        self.critical_runs = runs
        flags = wire.F_RELIABLE if reliable else 0
        self.window = _dp.SendWindow(mv, total, segment_size, flow_id, token, flags, mask)
        self.payload = mv  # the message bytes, for gather sends (SegmentTransmit)
        n = self.window.seg_count
        if n - 1 > wire.MAX_SEQ:
            raise LocalProtocolError(f"message needs {n} segments; at most {wire.MAX_SEQ + 1} fit one flow — split it")
        self.seg_count = n
        if runs:
            self.cq: deque = deque(np.flatnonzero(mask).tolist())
            self.normal = np.flatnonzero(mask == 0).astype(np.int64)
        else:  # nothing critical (most messages): every segment is normal, in order
            self.cq = deque()
            self.normal = np.arange(n, dtype=np.int64)
        self.nq_pos = 0
        self.rq: deque = deque()
        self.state = OPEN
        self.close_reason = ""
        self.error: Exception | None = None
        self.started = now
        self.finished: float | None = None
        self.last_heard = now
        #: the dead-peer rule's clock: last_heard moved on by this process's own pauses since (liveness.pause_credit)
        self.silence_from = now
        self.receiver_count = 0
        # registration: every copy is stamped and MACed afresh (see ltp/admission.py)
        self._reg_fields = (total, segment_size, element_size, n, tag, 1 if reliable else 0, runs)
        self._reg_flags = flags | (wire.F_MAC if job_key else 0)
        self._job_key = job_key
        self.source = source  # our address as the peer sees it (bound into the MAC)
        self.reregistrations = 0
        self.stale_retries = 0
        self._stale_retry_round = -1  # the round whose refusal the latest retry_stale answered
        self.reg_sent_at = now
        self.reg_confirmed = False
        self.reg_attempts = 0  # REG datagrams sent (each copy is an attempt: its own stamp, MAC and attempt byte)
        self.reg_rounds = 0  # registration rounds (reg_copies copies each); the back-off counts these
        self.reg_copies = reg_copies
        self.reg_next: float = now
        self.hold_data = False  # the receiver answered DATA with RESET unregistered: wait for a REG's answer
        self.rack_rtt: float | None = None  # RTT of the newest transmission acknowledged (RACK; Path.on_ack)
        #: DATA was refused as unregistered (it overtook its REG, or the REG was lost): whatever is in flight
        #: when a REG is next answered was dropped there, and goes again at once (``resend_refused``)
        self.data_refused = False

    # -- registration ---------------------------------------------------
    def reg_datagrams(self, now: float, est_word: int, rto: float, wall_us: int,
                      max_gap: float = REG_GAP_MAX_S) -> list:
        """The REG datagrams to (re)send now, ``reg_copies`` of them, each stamped ``wall_us`` with its own
        attempt byte (so each has its own MAC: a receiver's replay cache refuses identical bytes, and each
        copy is answered); schedules the next round: ``rto`` doubled per round, at most ``max_gap`` (the engine
        passes a fraction of the dead-peer limit, ``liveness.reg_gap_max``) and :data:`REG_GAP_MAX_S`."""
        self.reg_rounds += 1
        self.reg_sent_at = now
        self.reg_next = now + min(rto * (2 ** min(self.reg_rounds - 1, 8)), max_gap, REG_GAP_MAX_S)
        out = []
        for _ in range(self.reg_copies):
            self.reg_attempts += 1
            head = wire.pack_header(wire.T_REG, self._reg_flags, self.flow_id, self.token,
                                    self.reg_attempts & 0xFF, est_word)
            signed = head + wire.pack_reg_body(*self._reg_fields, timestamp_us=max(0, int(wall_us)))
            out.append(signed + reg_mac(self._job_key, self.source, signed) if self._job_key else signed)
        return out

    def reregister(self, now: float, min_interval: float) -> bool:
        """The receiver says it holds no registration of ours: send REG again now.

        While our REG is unanswered the answer means that REG was lost (a
        full queue drops it like any datagram) or overtaken by DATA: DATA is
        held until a REG is answered — every DATA datagram would only draw
        another RESET, and the tail-loss timer would send it all again into
        the same full queue — and REG goes out again now rather than at the
        back-off's next step, at most once per ``min_interval``.
        False once the receiver forgot us more than MAX_REREGISTRATIONS times."""
        if not self.reg_confirmed:
            self.hold_data = True
            self.data_refused = True
            if now - self.reg_sent_at >= min_interval:
                self.reg_next = min(self.reg_next, now)
            return True
        if now - self.reg_sent_at < min_interval:
            return True
        self.reregistrations += 1
        if self.reregistrations > MAX_REREGISTRATIONS:
            return False
        self.reg_confirmed = False
        self.data_refused = True
        self.reg_next = now
        return True

    def resend_refused(self, now: float) -> np.ndarray:
        """A REG was answered after DATA had been refused as unregistered: the segments still in flight were
        sent before the receiver knew the flow and were dropped there. They are declared lost now (and go
        again at once) instead of at the tail-loss timer, whose backed-off wait on a reordering path outlasts
        the receiver's pending registration, which then expires and refuses the resent DATA again."""
        self.data_refused = False
        return self.window.expire(now)

    def answers_latest_reg(self, echoed_attempt: int) -> bool:
        """True when a RESET ``stale`` echoing ``echoed_attempt`` refers to a copy of our latest REG round (0: a
        peer that echoes nothing, taken as the latest).  An answer to an older round's copy, one that sat in a
        queue or a stopped peer's socket buffer past the window, says nothing about the copies stamped since."""
        return echoed_attempt == 0 or (self.reg_attempts - echoed_attempt) & 0xFF < self.reg_copies

    def retry_stale(self, now: float) -> bool:
        """The receiver refused our REG as ``stale``: register again now with a fresh stamp, holding DATA until
        a REG is answered.  False after :data:`STALE_RETRIES` such retries (the clocks really differ).  The
        copies of one round draw one refusal each: a retry already waiting for its round counts once."""
        if self._stale_retry_round == self.reg_rounds:
            return True
        if self.stale_retries >= STALE_RETRIES:
            return False
        self._stale_retry_round = self.reg_rounds
        self.stale_retries += 1
        self.reg_confirmed = False
        self.hold_data = True
        self.reg_next = now
        return True

    # -- sending --------------------------------------------------------
    def has_sendable(self) -> bool:
        """True when a segment is waiting in CQ, NQ or RQ."""
        if self.state != OPEN or self.hold_data:
            return False
        return bool(self.cq) or self.nq_pos < self.normal.shape[0] or bool(self.rq)

    def queued_segments(self) -> int:
        """Segments waiting in CQ, NQ and RQ (RQ may hold already-acknowledged ones)."""
        return len(self.cq) + (self.normal.shape[0] - self.nq_pos) + len(self.rq)

    def take(self, n: int) -> np.ndarray:
        """Up to ``n`` segments to transmit next: CQ, then NQ, then RQ, in that strict order.

        A short final segment ends the batch (one GSO batch may only end with a
        short datagram), so queue order is never bent to fit the batch.
        """
        out = []
        state = self.window.state
        last = self.seg_count - 1 if self.window.last_len != self.seg_size else -1
        while self.cq and len(out) < n:
            s = self.cq.popleft()
            if state[s] != SEG_ACKED:
                out.append(s)
                if s == last:
                    return np.array(out, np.int64)
        room = n - len(out)
        if room > 0 and self.nq_pos < self.normal.shape[0]:
            tail = self.normal[self.nq_pos:self.nq_pos + room]
            self.nq_pos += tail.shape[0]
            seqs = np.concatenate((np.array(out, np.int64), tail)) if out else tail
            if tail[-1] == last or seqs.shape[0] >= n:
                return seqs
            out = seqs.tolist()
            room = n - len(out)
        while room > 0 and self.rq:
            s = self.rq.popleft()
            if state[s] == SEG_LOST:
                out.append(s)
                room -= 1
                if s == last:
                    break
        return np.array(out, np.int64)

    def requeue_lost(self, lost) -> None:
        """Route newly lost segments: critical back into CQ, normal into RQ."""
        crit = self.window.critical
        for s in lost.tolist():
            (self.cq if crit[s] else self.rq).append(s)

    # -- inputs ------------------------------------------------------------
    def on_heard(self, now: float) -> None:
        """Any valid datagram of this flow arrived."""
        self.last_heard = self.silence_from = now
        self.reg_confirmed = True
        self.hold_data = False

    def all_acked(self) -> bool:
        """True when every segment has been acknowledged."""
        return self.window.acked_count >= self.seg_count

    def finish(self, now: float, reason: str, receiver_count: int | None = None) -> None:
        """Enter DONE with ``reason`` ("acked" or the STOP reason)."""
        if self.state != OPEN:
            return
        if receiver_count is not None:
            self.receiver_count = max(self.receiver_count, receiver_count)
        self.state = DONE
        self.close_reason = reason
        self.finished = now

    def fail(self, now: float, error: Exception) -> None:
        """Enter FAILED with ``error``."""
        if self.state != OPEN:
            return
        self.state = FAILED
        self.error = error
        self.finished = now

    def delivered_segments(self) -> int:
        """Segments known delivered (ACKed, or counted by the receiver's STOP)."""
        return max(self.window.acked_count, min(self.receiver_count, self.seg_count))
