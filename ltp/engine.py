"""The sans-IO LTP endpoint: every flow this host sends and receives.

Theory of operation. :class:`Engine` is a plain object driven by four kinds
of input, each carrying an explicit ``now`` (seconds, any monotonic origin):

* commands: :meth:`send`, :meth:`post_receive`, :meth:`cancel`, :meth:`close`;
* datagrams: :meth:`receive_datagram` (one) or :meth:`receive_batch` (a run of
  datagrams from one address, the fast path that lets the per-flow kernel
  consume consecutive DATA packets without returning to Python);
* timers: :meth:`handle_timer` when :meth:`get_timer` has passed.

It produces two kinds of output: :meth:`datagrams_to_send` returns
:class:`~ltp.path.Transmit` batches (control datagrams first — REG, ACK, STOP,
RESET — then paced DATA from each path) and :meth:`next_event` returns
:class:`SendDone` / :class:`ReceiveDone` events. It never reads a clock,
sleeps, touches a socket or imports asyncio; randomness (flow ids, tokens,
BBR's probe phase) comes from the injected ``random.Random``.

One concern per module: the engine owns the flows (send flows per
:class:`~ltp.path.Path`, receive flows by ``(peer, flow id)``) and routes
each input to the object that decides —

* :class:`~ltp.admission.Admission`: whether a REG may cost this host memory
  (MAC, freshness, replay, caps), pending registrations, receive-memory
  accounting, and the answers to late DATA/REGs (STOP again, STOP ``deadline``
  for an expired tag, rate-limited RESET ``unregistered``);
* :class:`~ltp.matching.ReceiveMatcher`: which posted receive slot a message
  fills, unexpected messages, slot expiry and when a group is done;
* :class:`~ltp.placement.PlacementHints`: the caller's buffer for a message
  expected before its receive is posted (:meth:`expect`);
* :class:`~ltp.early_close.EarlyClose`: when a receive flow closes (LT
  threshold, group deadline, progress evidence) and what it teaches the LT
  thresholds;
* :mod:`ltp.liveness`: the dead-peer and idle-sender rules (limits and the
  errors' wording);
* :mod:`ltp.timers`: the named timer kinds; :meth:`timers` reports the
  earliest deadline of each and :meth:`get_timer` is their minimum;
* :mod:`ltp.regimes`: how transfers end (:class:`~ltp.regimes.Regime`,
  :class:`~ltp.regimes.CloseReason`).

Invariants:

1. Nothing a peer sends can raise out of :meth:`receive_datagram` /
   :meth:`receive_batch`: malformed, unauthenticated, unknown, duplicate or
   out-of-range datagrams are dropped and counted in ``stats.dropped`` by
   reason; registrations beyond the configured caps are refused with RESET.
2. Memory allocated on a peer's say-so (bitmaps, buffers for messages that no
   receive was posted for) is bounded by ``Config.max_receive_memory`` in total
   and ``Config.host_memory_cap`` per source host, and is committed only on
   evidence: a REG that passes admission (``ltp.admission``: MAC over source
   address and every REG byte, freshness, replay cache, caps) becomes a small
   pending registration; the flow's bitmap and buffer are allocated when its
   first DATA with the right token arrives. Pending registrations that see no
   DATA expire after a few RTTs and lapse: a late first DATA still revives one
   for ``admission.LAPSED_TTL_S`` (a sender starved of CPU); DATA of a flow this
   host does not know is answered (rate-limited) with RESET ``unregistered`` so
   its sender registers again. Every refusal is counted in ``stats.refused`` by reason.
3. ACKs are batched: one ACK datagram carries the entries of ``ack_every``
   received packets, or fewer once the oldest has waited ``ack_delay_s`` (a
   timer), or when the flow closes. At high rates one input batch yields one
   ACK; at low rates the sender is not woken once per packet. ``ack_delay_s``
   is a maximum: an adapter whose timer is coarser sends due ACKs early
   (:meth:`flush_acks`).
5. Dead peers: a send fails with :class:`PeerUnreachable` as soon as the
   adapter reports an ICMP unreachable for the peer (:meth:`peer_unreachable`),
   and with :class:`TransferTimeout` once the peer has been silent for
   ``max(Config.peer_silence_min_s, PEER_SILENCE_RTTS x srtt)`` (at most
   ``idle_timeout_s``). Receive flows whose sender is silent for
   ``idle_timeout_s`` close with regime ``timeout``. Every such error states the
   peer, the elapsed time and the cause.
4. A closed receive flow is remembered (token, close reason) for
   ``closed_flow_ttl_s`` so DATA that is still in flight is answered with
   STOP again, at most once per probe interval, and never re-opens the flow.
"""

from __future__ import annotations

import dataclasses
import random
from collections import OrderedDict, deque
from dataclasses import dataclass

import numpy as np

from . import liveness, wire
from .admission import Admission, PendingRegistration, fold_reg_answers, stop_datagram
from .buffer_pool import SPARE_MIN_BYTES, BufferPool
from .config import Config
from .early_close import EarlyClose, GroupClock
from .errors import (LocalProtocolError, LTPError, PeerUnreachable, TransferAborted, TransferRefused,
                     TransferTimeout, WireError)
from .link_share import SHARE_REFRESH_S, datagram_share, on_loopback
from .liveness import PEER_SILENCE_RTTS  # noqa: F401  (re-exported: the dead-peer rule's constant)
from .matching import CLAIM_STEP_BYTES, ReceiveMatcher
from .path import Path, Transmit
from .placement import PlacementHints, overlap, overlapping_pair
from .receiver import FlowReceiver, RecvGroup, RecvSlot
from .regimes import CloseReason, Regime, stop_reason
from .reports import EndpointStats, SendReport
from .sender import OPEN, FlowSender, holds_objects
from .timers import TimerTable

__all__ = ["Engine", "SendDone", "ReceiveDone"]

_DATA_B0 = (wire.VERSION << 4) | wire.T_DATA
_ONE = np.zeros(1, np.int64)
#: :meth:`Engine.flush_acks`: pending entries an early ACK needs, except during a flow's first
#: QUICKACK_SEGMENTS received segments (a cold path's slow-start rounds wait for every ACK)
EARLY_ACK_MIN_ENTRIES = 4
QUICKACK_SEGMENTS = 256
#: new data runs a *reliable* receive's Early Close check at most once per this many seconds (a check on
#: each ``recvmmsg`` batch cost a bulk receive about 11,000 checks per GB). ``early_close.decide`` never
#: closes a reliable flow before it is complete, so a check between two of these only refreshed its
#: reported LT threshold and deadline; completion is still seen on the batch that completes it.
RELIABLE_CHECK_INTERVAL_S = 0.001
#: :meth:`Engine.close`: the flows this endpoint closed as a receiver in the last CLOSING_STOP_WINDOW_S seconds
#: (the newest CLOSING_STOPS_MAX of its closed-flow records) get their STOP once more as the endpoint closes. A
#: complete one's completing ACK may have been lost; on a clean path no guard STOP followed it, and the sender's
#: probe would meet a closed port (an ICMP unreachable fails a send whose message arrived whole). A second more
#: than covers a probe timeout and its back-off on the paths LTP is built for; a STOP for a send that already
#: finished is counted as a late answer.
CLOSING_STOP_WINDOW_S = 1.0
CLOSING_STOPS_MAX = 256
_add_reduce = np.add.reduce  # a batch's byte count: the ufunc directly, without np.sum's dispatch


@dataclass(frozen=True)
class SendDone:
    """A send finished: ``report`` on success, ``error`` otherwise."""

    handle: int
    report: SendReport | None
    error: Exception | None = None


@dataclass(frozen=True)
class ReceiveDone:
    """A posted receive group finished: one report per slot, in order."""

    handle: int
    reports: list
    error: Exception | None = None


def _writable_view(buf) -> memoryview:
    try:
        mv = memoryview(buf)
    except TypeError:
        raise LocalProtocolError("receive buffer must support the buffer protocol (bytearray, numpy array)") from None
    if mv.readonly:
        raise LocalProtocolError("receive buffer is read-only; pass a bytearray or a writable numpy array")
    if not mv.c_contiguous:
        raise LocalProtocolError("receive buffer must be C-contiguous; use numpy.ascontiguousarray")
    if holds_objects(buf, mv):
        raise LocalProtocolError("receive buffer holds Python objects (dtype object): writing a peer's bytes over "
                                 "object pointers would crash this process; receive into a numeric array or bytearray")
    return mv.cast("B") if (mv.format != "B" or mv.ndim != 1) else mv


MAX_TAG = (1 << 64) - 1  # tags travel as an unsigned 64-bit field of the REG (docs/protocol.md)


def _check_tag(tag, what: str, *, wildcard: bool = False) -> None:
    """Refuse a tag that cannot travel: an int in [0, 2**64) (``None`` too where ``wildcard``)."""
    if wildcard and tag is None:
        return
    if not isinstance(tag, int) or isinstance(tag, bool) or not 0 <= tag <= MAX_TAG:
        kind = "an int in [0, 2**64)" + (" or None (any tag)" if wildcard else "")
        raise LocalProtocolError(f"tag={tag!r}: {what} needs {kind}")


class Engine:
    """All LTP state of one endpoint (sans-IO)."""

    def __init__(self, config: Config | None = None, *, rng: random.Random | None = None,
                 local_addr=None, wall_offset: float = 0.0, gather_send: bool = False) -> None:
        """``local_addr``: this host's ``(host, port)`` as peers see it (bound into REG MACs; see
        :meth:`set_source` for per-peer answers). ``wall_offset``: wall clock minus ``now``
        (seconds), used only to stamp and check REG freshness. ``gather_send``: DATA batches
        come out as :class:`~ltp.path.SegmentTransmit` (for an adapter with a gather send)."""
        self.config = config or Config()
        self.gather_send = gather_send
        self.rng = rng if rng is not None else random.Random(0)
        self.local_addr = local_addr
        self.wall_offset = wall_offset
        self._sources: dict = {}  # peer -> our address as that peer sees it
        self._rx_idle_next: float | None = None
        self.stats = EndpointStats()
        self._ctrl: deque = deque()
        self._admission = Admission(self.config, self.stats, self._ctrl, srtt=self._srtt_of,
                                    make_room=self._evict_stale_unclaimed)
        self._pending = self._admission.pending  # (peer, fid) -> PendingRegistration
        self._lapsed = self._admission.lapsed  # (peer, fid) -> expired registration its first DATA may revive
        self._egress_recount_at = float("-inf")  # when the paths sharing the link outbound are next recounted
        self._rx_per_peer = self._admission.per_peer  # source address -> open + pending receive flows
        self._per_host = self._admission.per_host  # source host -> open + pending receive flows
        self._paths: dict = {}
        self._tx: dict = {}  # (peer, fid) -> FlowSender
        #: (peer, fid) -> token of the sends that finished last (at most ``Config.max_closed_flows``): their
        #: receiver's ACKs and STOPs still on the way are late answers, not drops (``EndpointStats.late_answers``)
        self._tx_finished: OrderedDict = OrderedDict()
        self._tx_by_handle: dict = {}
        self._rx: dict = {}  # (peer, fid) -> FlowReceiver
        self._matcher = ReceiveMatcher()  # posted receive groups, waiting slots, unexpected messages
        self._claims: deque = deque()  # closed unexpected messages being copied into their slots (CLAIM_COPY)
        self._claim_at = 0.0  # when the last claim step ran or was queued: CLAIM_COPY is due from then
        self._pool = BufferPool(self.config.max_receive_memory, SPARE_MIN_BYTES)  # spare internal buffers
        self._hints = PlacementHints()  # (peer, tag) -> the caller's buffer for a message not yet received
        self._early = EarlyClose(slack_s=self.config.deadline_slack_s, lt_fraction=self.config.lt_fraction,
                                 window=self.config.lt_window, max_links=self.config.max_peers,
                                 rate_cap=self._granted_payload_rate, rtt_of=self._srtt_of)
        self._thresholds = self._early.thresholds  # LT history per (link, size)
        self._ack_dirty: dict = {}
        self._events: deque = deque()
        self._next_handle = 1
        self._closed_engine = False
        self._bulk_bad: dict = {}  # per flow key: its bad_seq + bad_length when bulk_flows() handed it out
        self._wakes: dict = {}  # (peer, fid) -> when its Early Close decision can change (Timer.EARLY_CLOSE)
        self._due: float | None = None  # the deadline get_timer last gave (the adapter's timer is armed there)
        # when the REGs of a send not yet flushed became due (None: none waiting): a deadline too, until the
        # flush (datagrams_to_send) collects them, so a stall between a send and its flush is seen by an idle engine
        self._ctrl_due: float | None = None
        self._input_at = float("-inf")  # the newest input's now (the own-stall and own-pause rules)
        # when this process last resumed from a pause: a REG that arrived during it (its kernel time) starts its
        # flow's Early Close clock here, as _pause_receives moves the clocks of flows that were open, and an ACK
        # read after it for a transmission sent before it gives no RTT or rate sample (Path.on_ack)
        self._paused_until = float("-inf")
        self._heard_floor = float("-inf")  # silence counts from no earlier than this (the own-stall rule)
        #: the last stall of this process the own-stall rule found (:meth:`_note_stall`): since when it had not run
        #: (the deadline the late timer was armed for), and when it noticed (the ``now`` of the first input after
        #: it); None: never
        self.own_stall_since: float | None = None
        self.own_stall_at: float | None = None

    # ------------------------------------------------------------------ commands
    def send(self, peer, data, *, now: float, reliable: bool = False, critical=(), element_size: int | None = None,
             tag: int = 0) -> int:
        """Start sending one message to ``peer``; returns a handle (see :class:`SendDone`).

        ``element_size`` (bytes; no element is split between packets) defaults to
        the item size of ``data``'s buffer: 8 for float64, 4 for float32, 1 for bytes."""
        self._check_open()
        self._note_stall(now)
        _check_tag(tag, "send()")
        peer = self._norm_addr(peer)
        if element_size is None:
            try:
                element_size = memoryview(data).itemsize
            except TypeError:
                raise LocalProtocolError("data must support the buffer protocol (bytes, bytearray, numpy array)") \
                    from None
        seg = self.config.segment_size_for(element_size)
        source = self._sources.get(peer, self.local_addr)
        if self.config.job_key is not None and source is None:
            raise LocalProtocolError("with a job_key the engine must know its own address: pass "
                                     "Engine(local_addr=...) or call set_source(peer, addr)")
        path = self._paths.get(peer)
        if path is None:
            path = self._paths[peer] = Path(peer, self.config, self.rng, wire.HEADER_SIZE + seg,
                                            gather_send=self.gather_send)
        fid = path.allocate_flow_id()
        for _ in range(1 << 16):
            if (peer, fid) not in self._tx:
                break
            fid = path.allocate_flow_id()
        else:
            raise LocalProtocolError("65536 flows to this peer are open; wait for some to finish")
        token = self.rng.getrandbits(32) or 1
        handle = self._new_handle()
        flow = FlowSender(handle=handle, peer=peer, flow_id=fid, token=token, data=data,
                          element_size=element_size, segment_size=seg, reliable=reliable, critical=critical,
                          tag=tag, now=now, job_key=self.config.job_key, source=source,
                          reg_copies=1 if path.clean else self.config.reg_copies)
        regs = flow.reg_datagrams(now, path.est_word(), path.base_pto(), self._wall_us(now),  # before it is known
                                  liveness.reg_gap_max(self.config, path.srtt))
        if not path.flows:
            path.begin_busy(now)
        path.flows.append(flow)
        self._tx[(peer, fid)] = flow
        self._tx_finished.pop((peer, fid), None)
        self._tx_by_handle[handle] = flow
        self.stats.flows_sent += 1
        self._ctrl.extend((reg, peer) for reg in regs)
        if self._ctrl_due is None:
            # its REGs are due now: until the adapter's flush collects them, a stall of this process counts from
            # here (found by CI: a PS stopped 10 s between a send and its flush, with no timer armed, failed the
            # send at once on resume, "sent nothing for 10.001 s", the stall unseen)
            self._ctrl_due = now
        return handle

    def set_source(self, peer, addr) -> None:
        """Tell the engine the ``(host, port)`` that ``peer`` sees this host at (REG MACs bind it).

        The adapter calls this when it is bound to a wildcard address and the
        kernel's route to ``peer`` picks the source IP."""
        self._sources[self._norm_addr(peer)] = addr

    def _wall_us(self, now: float) -> int:
        return int((now + self.wall_offset) * 1e6)

    def post_receive(self, slots, *, now: float, timeout: float | None = None,
                     clock: GroupClock | str = GroupClock.FIRST) -> int:
        """Post receives: ``slots`` is a list of ``(peer or None, tag or None, buffer)``.

        All slots form one group with one Early Close deadline; a
        :class:`ReceiveDone` with one report per slot follows. ``timeout``
        (seconds) closes whatever is still open at ``now + timeout``.
        ``clock``: where the group's Early Close clock starts (:class:`~ltp.early_close.GroupClock`:
        ``"first"`` registration, the paper's, or ``"all"``: once every slot's message registered).
        """
        self._check_open()
        self._note_stall(now)
        if not slots:
            raise LocalProtocolError("post at least one receive buffer (gather got no peers: pass the peers "
                                     "to receive from and one buffer per peer)")
        if timeout is not None and not timeout >= 0:
            raise LocalProtocolError(f"timeout={timeout!r}: pass None (wait for Early Close) or seconds >= 0")
        try:
            clock = GroupClock(clock)
        except ValueError:
            raise LocalProtocolError(f"clock={clock!r}: pass one of "
                                     f"{', '.join(repr(c.value) for c in GroupClock)}") from None
        handle = self._new_handle()
        group = RecvGroup(handle, now, None if timeout is None else now + timeout, clock)
        for peer, tag, _ in slots:
            _check_tag(tag, "a receive", wildcard=True)
        dests = [_writable_view(buf) for _, _, buf in slots]
        if any(len(d) == 0 for d in dests):
            raise LocalProtocolError("receive buffer is empty; size it to the expected message")
        pair = overlapping_pair(dests)
        if pair is not None:
            raise LocalProtocolError(f"receive buffers {pair[0]} and {pair[1]} share memory: two messages would "
                                     "write the same bytes; pass one separate buffer (or non-overlapping slice) "
                                     "per peer")
        for i, ((peer, tag, _), dest) in enumerate(zip(slots, dests)):
            slot = RecvSlot(group, i, None if peer is None else self._norm_addr(peer), tag, dest)
            group.slots.append(slot)
            if slot.peer is not None and tag is not None:
                self._hints.discard(slot.peer, tag)
                self._admission.want_tag(slot.peer, tag)
        self._matcher.add(group)
        for slot in group.slots:
            if self._match_unexpected(slot, now):
                continue
            unfit = self._matcher.unfit_unexpected(slot)
            if unfit is not None:  # as when the message registers after the slot was posted (``_admit``)
                self._fail_too_small(slot, unfit.total, unfit.peer, now)
                self._refuse_unexpected(unfit, now)
                continue
            self._matcher.wait(slot)
        self._check_group(group, now)
        return handle

    def expect(self, peer, tag: int, buf, *, now: float) -> None:
        """Say where the message ``tag`` from ``peer`` will be received, before its receive is posted.

        If that message registers first, it is written straight into ``buf`` instead of an internal buffer,
        and a receive posted later on the same memory finds it in place: no copy (:mod:`ltp.placement`).
        From now until that receive completes, ``buf`` belongs to the engine. A hint is used once; posting
        the receive drops an unused one. An unclaimed message that an earlier hint placed in ``buf`` is
        cancelled (its sender hears STOP): the buffer now waits for this one."""
        self._check_open()
        _check_tag(tag, "expect()")
        dest = _writable_view(buf)
        if len(dest) == 0:
            raise LocalProtocolError("expect() buffer is empty; size it to the expected message")
        for flow in [f for f in self._matcher.unexpected if f.placed and f.slot is None and overlap(f.dest, dest)]:
            if flow.regime is None:
                self._close_rx(flow, now, Regime.CANCELLED)
            self._matcher.unexpected.remove(flow)
            self._free_internal(flow, now)
            self.stats.drop("placed_message_superseded")
        self._hints.add(self._norm_addr(peer), tag, dest)

    def cancel(self, handle: int, *, now: float) -> None:
        """Cancel a send (RESET to the peer) or a receive group (STOP to the senders)."""
        self._note_stall(now)
        flow = self._tx_by_handle.get(handle)
        if flow is not None and flow.state == OPEN:
            self._ctrl.append((wire.pack_header(wire.T_RESET, 0, flow.flow_id, flow.token,
                                                wire.RESET_CODES["cancelled"], 0), flow.peer))
            flow.fail(now, TransferAborted("send cancelled"))
            self._end_send(flow, now)
            return
        group = self._matcher.groups.get(handle)
        if group is not None and not group.done:
            for slot in group.slots:
                if slot.flow is not None and slot.flow.regime is None:
                    self._close_rx(slot.flow, now, Regime.CANCELLED)
                elif slot.report is None:
                    slot.error = TransferAborted("receive cancelled")
            self._finish_group(group, now, TransferAborted("receive cancelled"))

    def close(self, *, now: float) -> None:
        """Abort everything: RESET every open flow and fail every pending call; the flows closed in the last
        :data:`CLOSING_STOP_WINDOW_S` get their STOP again (their senders may still wait for the last ACK)."""
        if self._closed_engine:
            return
        for flow in list(self._tx.values()):
            if flow.state == OPEN:
                self._ctrl.append((wire.pack_header(wire.T_RESET, 0, flow.flow_id, flow.token,
                                                    wire.RESET_CODES["shutdown"], 0), flow.peer))
                flow.fail(now, TransferAborted("endpoint closed"))
                self._end_send(flow, now)
        for flow in list(self._rx.values()):
            self._ctrl.append((wire.pack_header(wire.T_RESET, 0, flow.flow_id, flow.token,
                                                wire.RESET_CODES["shutdown"], 0), flow.peer))
        for (peer, fid), token, code, count in self._admission.recent_closed(now, CLOSING_STOP_WINDOW_S,
                                                                            CLOSING_STOPS_MAX):
            self._ctrl.append((stop_datagram(fid, token, code, count), peer))
        for group in list(self._matcher.groups.values()):
            if not group.done:
                self._finish_group(group, now, TransferAborted("endpoint closed"))
        self._rx.clear()
        self._matcher.unexpected.clear()  # unclaimed messages' buffers go with the engine
        self._claims.clear()
        self._admission.clear()
        self._pool.clear()
        self._hints.clear()
        self._closed_engine = True

    # ------------------------------------------------------------------ input
    def receive_datagram(self, data, addr, now: float) -> None:
        """Process one datagram from ``addr``."""
        n = len(data)
        lengths = np.array([n], np.int64)
        self.receive_batch(data, _ONE, lengths, 0, 1, addr, now)

    def receive_batch(self, buf, offsets, lengths, start: int, stop: int, addr, now: float, times=None, *,
                      times_offset: float | None = None) -> None:
        """Process datagrams ``start..stop`` of ``buf`` (given by offsets/lengths), all from ``addr``.

        ``times`` (optional, indexed like ``offsets``) are the datagrams' arrival
        times — kernel receive timestamps — on the clock of ``now`` after
        subtracting ``times_offset`` (seconds; None = 0); a negative time means
        unknown (``now`` is used). A batch read late holds ACKs that arrived over a
        stretch of time; timing each one by its own arrival keeps RTT and
        delivery-rate samples honest. Only datagrams that leave the DATA fast path
        read their time, so the adapter passes the kernel's array and offset as is.
        """
        if self._closed_engine:
            return
        self._note_stall(now)
        mv = buf if isinstance(buf, memoryview) else memoryview(buf)
        self.stats.datagrams_in += stop - start
        self.stats.bytes_in += int(_add_reduce(lengths[start:stop]))
        heard = False  # a datagram in the batch carried one of our flows' tokens: the peer is alive
        i = start
        while i < stop:
            o = int(offsets[i])
            length = int(lengths[i])
            if length >= wire.HEADER_SIZE and mv[o] == _DATA_B0:
                key = (addr, mv[o + 2] << 8 | mv[o + 3])
                flow = self._rx.get(key)
                if flow is None and (self._pending or self._lapsed):
                    pend = self._admission.first_data(key, int.from_bytes(mv[o + 4:o + 8], "big"), now)
                    if pend is not None:
                        flow = self._admit(pend, now)  # the first DATA: evidence, commit memory now
                if flow is not None and flow.regime is None:
                    w = flow.window
                    if w.n_acks >= w.acks.shape[0]:
                        self._flush_acks(flow, now)
                    bad = w.bad_seq + w.bad_length
                    j = w.ingest(mv, offsets, lengths, i, stop)
                    if j > i:
                        nbad = w.bad_seq + w.bad_length - bad
                        if nbad:
                            self.stats.drop("bad_seq_or_length", nbad)
                        self._after_ingest(flow, now)
                        heard = True
                        i = j
                        continue
            at = now
            if times is not None:
                t = float(times[i])
                if t >= 0:
                    at = min(now, t - times_offset if times_offset is not None else t)
            try:
                heard |= self._receive_one(mv[o:o + length], addr, at, now)
            except WireError as exc:
                self.stats.drop(exc.reason)
            i += 1
        if heard:  # never for junk or a forged source without a token: neither may keep a dead peer alive
            path = self._paths.get(addr)
            if path is not None:
                path.last_heard = path.silence_from = now

    def bulk_flows(self) -> list:
        """The receives whose DATA an adapter may feed from its socket straight into their windows
        (``UdpIO.drain_flows``), reporting each with :meth:`bulk_ingested`; empty when there are none.

        They are the open receives past their first :data:`QUICKACK_SEGMENTS` segments (bulk
        transfers, whose ACKs and checks may wait for the end of a drain), in no particular order.
        A closed flow, or one still in its first segments, is left out: its datagrams end a drain
        and take :meth:`receive_batch`. Before session 58 only a lone receive was drained, so a
        parameter server's gather, four flows at once, went through :meth:`receive_batch` batch by
        batch: in the lab that cost its receiving process 0.78-0.93 CPU-s per 4 x 100 MB, against
        0.43-0.53 s for one 400 MB flow (``docs/performance.md``, session 58)."""
        if self._closed_engine:
            return []
        out = []
        marks = self._bulk_bad
        marks.clear()
        for flow in self._rx.values():
            w = flow.window
            if flow.regime is not None or w.received <= QUICKACK_SEGMENTS:
                continue
            marks[flow.key] = w.bad_seq + w.bad_length
            out.append(flow)
        return out

    def bulk_flow(self) -> FlowReceiver | None:
        """The lone open receive, when :meth:`bulk_flows` would hand it out; None otherwise."""
        if len(self._rx) != 1:
            return None
        flows = self.bulk_flows()
        return flows[0] if flows else None

    def bulk_ingested(self, flow: FlowReceiver, datagrams: int, nbytes: int, now: float) -> None:
        """Account for ``datagrams`` DATA datagrams (``nbytes`` bytes) of ``flow``, from
        :meth:`bulk_flows`, that the adapter fed straight into its window: the counters, the ACK
        schedule and the flow's checks (as :meth:`receive_batch` does after each run it ingests)."""
        if datagrams <= 0:
            return
        self._note_stall(now)
        mark = self._bulk_bad.get(flow.key)
        if mark is None or self._rx.get(flow.key) is not flow:
            raise LocalProtocolError("bulk_ingested: the flow is not an open receive bulk_flows() returned")
        self.stats.datagrams_in += datagrams
        self.stats.bytes_in += nbytes
        w = flow.window
        bad = w.bad_seq + w.bad_length
        if bad > mark:
            self.stats.drop("bad_seq_or_length", bad - mark)
        self._bulk_bad[flow.key] = bad
        self._after_ingest(flow, now)
        path = self._paths.get(flow.peer)
        if path is not None:
            path.last_heard = path.silence_from = now

    def _receive_one(self, data: memoryview, addr, now: float, processed: float | None = None) -> bool:
        """Process one datagram off the DATA fast path; True when it carried the token of one of our flows
        (the dead-peer rule counts only those as hearing from the peer). ``now``: when it arrived (its kernel
        timestamp where known); ``processed``: when it is processed (the batch's ``now``), which is when a
        pending registration's life starts: a REG read late has its DATA queued right behind it."""
        ptype, flags, fid, token, w2, w3 = wire.unpack_header(data)
        key = (addr, fid)
        if ptype == wire.T_DATA:
            flow = self._rx.get(key)
            if flow is None or flow.token != token:
                self._admission.on_unknown_data(key, token, now, open_flow=key in self._rx)
                return False
            # reaching here means the kernel refused it (bad flags are caught above)
            self.stats.drop("bad_data")
            return True
        elif ptype == wire.T_REG:
            too_small = self._admission.on_reg(data, addr, flags, fid, token, w3, now, now + self.wall_offset,
                                               existing=self._rx.get(key), find_slot=self._matcher.waiting_slot,
                                               hinted=self._hints.fits,
                                               attempt=w2, processed=processed)
            if too_small is not None:
                self._fail_too_small(*too_small, addr, now)
            return False  # a REG proves only that someone can write the peer's address
        elif ptype == wire.T_ACK:
            flow = self._tx.get(key)
            if flow is None or flow.token != token:
                return self._late_or_drop(key, token, flow)
            entries = wire.unpack_ack_entries(data, w3, 0, flags)
            grant = wire.ack_grant(data, flags)  # 0: none; a malformed one raises bad_grant
            confirms = not flow.reg_confirmed
            flow.on_heard(now)
            flow.receiver_count = max(flow.receiver_count, w2)
            path = self._paths[addr]
            if grant:
                path.on_grant(grant, now)
            lost = path.on_ack(flow, entries, now, self._paused_until)
            if lost.shape[0]:
                flow.requeue_lost(lost)
            if confirms and flow.data_refused:
                refused = flow.resend_refused(now)
                if refused.shape[0]:
                    path.note_loss()
                    flow.requeue_lost(refused)
            if flow.all_acked():
                flow.finish(now, CloseReason.ACKED)
                self._end_send(flow, now)
            return True
        elif ptype == wire.T_STOP:
            flow = self._tx.get(key)
            if flow is None or flow.token != token:
                return self._late_or_drop(key, token, flow)
            if len(data) != wire.HEADER_SIZE:
                raise WireError("bad_length", "STOP")
            reason = wire.STOP_REASONS.get(w3 >> 24)
            if reason is None:
                raise WireError("bad_stop", "unknown reason")
            flow.on_heard(now)
            flow.finish(now, reason, w2)
            self._end_send(flow, now)
            return True
        elif ptype == wire.T_RESET:
            reason = wire.RESET_REASONS.get(w2, "unknown")
            flow = self._tx.get(key)
            if flow is not None and flow.token == token:
                if reason == "unregistered" and flow.state == OPEN and \
                        flow.reregister(now, 2 * self._paths[addr].base_pto()):
                    self._paths[addr].note_loss()  # its REG was lost (or overtaken): the next sends take copies
                    flow.reg_copies = self.config.reg_copies
                    self.stats.reregistrations += 1
                    return True
                if reason == "stale" and flow.state == OPEN:
                    if not flow.answers_latest_reg(w3):
                        self.stats.drop("stale_old_copy")  # a newer, fresher copy is on its way or admitted
                        return True
                    before = flow.stale_retries
                    if flow.retry_stale(now):
                        self.stats.stale_retries += flow.stale_retries - before  # a round's second copy: 0
                        return True
                flow.fail(now, TransferRefused(reason))
                self._end_send(flow, now)
                return True
            rflow = self._rx.get(key)
            if rflow is not None and rflow.token == token:
                self._close_rx(rflow, now, Regime.CANCELLED, send_stop=False)
                return True
            if self._admission.forget(key, token):  # a registration still pending or lapsed
                return True
            self.stats.drop("unknown_flow")
        return False

    def _late_or_drop(self, key, token: int, flow) -> bool:
        """An ACK or STOP with no open send of its flow and token: a late answer to a send that finished (the
        STOP behind the ACK that completed it; a repeat), counted in ``stats.late_answers``, or a drop. Either way
        False: it keeps no peer alive (the dead-peer rule counts only what open flows hear, as before)."""
        if flow is None and self._tx_finished.get(key) == token:
            self.stats.late_answers += 1
        else:
            self.stats.drop("unknown_flow" if flow is None else "bad_token")
        return False

    # ------------------------------------------------------------------ registration and matching
    def _granted_payload_rate(self, flow) -> float:
        """The payload bytes/s this host grants ``flow``'s sender now (its share of ``Config.link_rate``), 0 without
        a grant: Early Close's initial LT formula takes no more than this for the sender's BtlBw."""
        g = self._admission.grant(flow.seg_size, flow.peer)
        return g * flow.seg_size / (wire.HEADER_SIZE + flow.seg_size) if g else 0.0

    def _srtt_of(self, addr) -> float | None:
        """This host's smoothed RTT to ``addr`` (seconds), or None."""
        path = self._paths.get(addr)
        return path.srtt if path is not None else None

    def _fail_too_small(self, slot: RecvSlot, total: int, addr, now: float) -> None:
        """A ``total``-byte message from ``addr`` does not fit ``slot`` (its sender was refused)."""
        self._matcher.fail(slot, LTPError(f"a {total}-byte message from {addr} does not fit the "
                                          f"{len(slot.dest)}-byte receive buffer; post a buffer as large as the "
                                          "message"))
        self._check_group(slot.group, now)

    def _refuse_unexpected(self, flow: FlowReceiver, now: float) -> None:
        """The receive for exactly ``flow``'s peer and tag failed because the message does not fit it: the
        message is refused as it is when it registers after such a receive (``_admit``). Still arriving, its
        sender hears RESET ``too_large``; complete, its internal buffer goes. Either way its memory is
        given back now, not when an unclaimed message's TTL ends."""
        if flow.regime is None:
            self._admission.refuse(flow.peer, flow.flow_id, flow.token, "too_large")
            self._close_rx(flow, now, Regime.CANCELLED, send_stop=False)
        else:
            self.stats.drop("unfit_message_discarded")
        self._matcher.abandon_claim(flow)
        self._free_internal(flow, now)

    def _admit(self, pend: PendingRegistration, now: float) -> FlowReceiver | None:
        """The first DATA of a pending registration arrived: allocate the flow (or refuse it)."""
        cfg = self.config
        addr, total = pend.peer, pend.total
        slot = self._matcher.waiting_slot(addr, pend.tag)
        hinted = slot is None and self._hints.fits(addr, pend.tag, total)  # the caller's buffer: no memory taken
        need = self._admission.commit(pend, slot, now, own_buffer=hinted)
        if need is None:
            if slot is not None and total > len(slot.dest):
                self._fail_too_small(slot, total, addr, now)
            return None
        internal = slot is None
        placed = self._hints.take(addr, pend.tag, total) if hinted else None
        if placed is not None:
            dest = placed
        else:  # a spare of this size if one is kept
            dest = self._pool.take(total) if internal else slot.dest
        padding = (cfg.segment_size if cfg.segment_size is not None else cfg.mtu - 44) - pend.seg_size
        # the flow's clock starts at its registration, as if it had been allocated then
        flow = FlowReceiver(key=pend.key, peer=addr, flow_id=pend.flow_id, token=pend.token, total=total,
                            seg_size=pend.seg_size, element_size=pend.element_size, tag=pend.tag,
                            reliable=pend.reliable, critical_runs=pend.ranges, dest=dest, internal=internal,
                            now=max(pend.registered, self._paused_until), est=pend.est, padding=max(0, padding))
        flow.placed = placed is not None
        flow.copies = pend.copies
        self._rx[pend.key] = flow
        if self._rx_idle_next is None:  # the first receive arms the idle scan (handle_timer re-arms it from then on)
            self._rx_idle_next = liveness.next_idle_scan(cfg, now)
        self.stats.flows_received += 1
        if slot is not None:
            self._matcher.unwait(slot)
            if self._matcher.bind(slot, flow):
                self._group_clock_started(slot.group, now)
        else:
            self._matcher.add_unexpected(flow)
        return flow

    def _match_unexpected(self, slot: RecvSlot, now: float) -> bool:
        """Bind a newly posted ``slot`` to the oldest unexpected message it can hold (delivered at
        once if that message is complete or closed)."""
        flow = self._matcher.find_unexpected(slot)
        if flow is None:
            return False
        if self._matcher.bind(slot, flow):
            self._group_clock_started(slot.group, now, skip=flow)
        if flow.report is not None:
            self._deliver_internal(flow, now)
        else:
            self._check_flow(flow, now)  # its Early Close clock runs from now on (the group's)
        return True

    def _deliver_internal(self, flow: FlowReceiver, now: float) -> None:
        """A closed unexpected message has its slot: copy it there, the first step now and the rest on the
        ``CLAIM_COPY`` timer (:mod:`ltp.matching`: the loop must run between steps of a large copy)."""
        if self._matcher.claim(flow, CLAIM_STEP_BYTES):
            self._claimed(flow, now)
        else:
            self._claims.append(flow)
            self._claim_at = now

    def _claimed(self, flow: FlowReceiver, now: float) -> None:
        self._free_internal(flow, now)
        self._check_group(flow.slot.group, now)

    def _free_internal(self, flow: FlowReceiver, now: float, *, keep: bool = True) -> None:
        """A closed unexpected message's internal buffer is no longer needed (claimed, abandoned or discarded):
        give its memory back to the peer's account and, with ``keep``, the buffer to the pool
        (:mod:`ltp.buffer_pool`; not when it is evicted to make room: that memory must really go). A message
        received into a hinted buffer took no memory and gives back none: the buffer is the caller's."""
        if not flow.placed:
            self._admission.release(flow.peer, flow.total)
            if keep:
                self._pool.give(flow.dest, now)
        flow.dest = None

    def _claim_step(self, now: float) -> None:
        """Copy up to ``CLAIM_STEP_BYTES`` of the claims in progress, oldest first (the ``CLAIM_COPY`` timer)."""
        budget = CLAIM_STEP_BYTES
        claims = self._claims
        while claims and budget > 0:
            flow = claims[0]
            if flow.slot.group.done:  # the receive ended meanwhile (cancelled): the copy is not wanted
                claims.popleft()
                self._matcher.abandon_claim(flow)
                self._free_internal(flow, now)
                continue
            before = flow.claimed
            done = self._matcher.claim(flow, budget)
            budget -= flow.claimed - before
            if done:
                claims.popleft()
                self._claimed(flow, now)
        self._claim_at = now

    def _after_ingest(self, flow: FlowReceiver, now: float) -> None:
        flow.last_arrival = now
        if flow.ack_since is None:
            flow.ack_since = now
        self._ack_dirty[flow.key] = flow
        if flow.reliable and now < flow.next_check and not flow.complete:
            return
        flow.next_check = now + RELIABLE_CHECK_INTERVAL_S
        self._check_flow(flow, now)

    # ------------------------------------------------------------------ early close
    def _check_flow(self, flow: FlowReceiver, now: float) -> None:
        if flow.regime is not None:
            return
        if flow.complete:
            self._close_rx(flow, now, Regime.COMPLETE)
            return
        if flow.slot is None or flow.slot.group.t0 is None:
            # unexpected: nobody waits for it yet, so there is no tail to cut; or its group's clock has not
            # started (GroupClock.ALL: a slot still waits for its message). Checked again when it starts.
            self._wakes.pop(flow.key, None)
            return
        regime, wake = self._early.check(flow, now)
        if regime is not None:
            self._close_rx(flow, now, regime)
        elif wake is not None:
            self._wakes[flow.key] = wake
        else:
            self._wakes.pop(flow.key, None)

    def _close_rx(self, flow: FlowReceiver, now: float, regime: Regime, send_stop: bool = True,
                  cause: str = "") -> None:
        self._flush_acks(flow, now)
        report = flow.close(now, regime)
        if cause:
            report = flow.report = dataclasses.replace(report, cause=cause)
        code = wire.STOP_CODES[stop_reason(regime)]
        # A complete flow's last ACK says all: the STOP behind it only guards against that ACK's loss (else the
        # sender's probe timeout asks, and the closed-flow record answers), so it goes where the sender's path
        # showed loss (it sent REG copies), as the REG copies themselves do
        if send_stop and (regime is not Regime.COMPLETE or flow.copies > 1):
            self._ctrl.append((stop_datagram(flow.flow_id, flow.token, code, flow.window.received), flow.peer))
        self._rx.pop(flow.key, None)
        self._wakes.pop(flow.key, None)
        self._ack_dirty.pop(flow.key, None)
        adm = self._admission
        adm.uncount(flow.peer)
        adm.release(flow.peer, flow.seg_count)
        adm.remember_closed(flow.key, flow.token, code, flow.window.received, now)
        self._early.on_close(flow, regime)
        if flow.slot is not None:
            if flow.internal:
                self._deliver_internal(flow, now)
            else:
                flow.slot.report = report
                self._check_group(flow.slot.group, now)

    def _group_clock_started(self, group: RecvGroup, now: float, skip: FlowReceiver | None = None) -> None:
        """``group``'s Early Close clock just started: its open flows, which waited for it
        (:attr:`GroupClock.ALL`), are checked now (``skip``: one its caller checks itself)."""
        for s in group.slots:
            f = s.flow
            if f is not None and f is not skip and f.regime is None:
                self._check_flow(f, now)

    def _check_group(self, group: RecvGroup, now: float) -> None:
        if not group.done and self._matcher.start_clock(group, now):  # GroupClock.ALL: a slot ended unfilled
            self._group_clock_started(group, now)
        if self._matcher.settled(group):
            errors = [s.error for s in group.slots if s.error is not None]
            self._finish_group(group, now, errors[0] if errors else None)
        elif not group.done and group.t0 is not None and any(s.flow is None and s.report is None
                                                               for s in group.slots):
            # a slot changed (a flow closed, a message was claimed) in a group whose clock runs and that still
            # has slots nobody registered for: their deadline may be known only now, so the group's timer is
            # worked out on the next timer turn. Without this, a gather whose registered messages all completed
            # before any timer ran (one-packet messages) waited for an unrelated timer to find its dead peer.
            group.wake = now

    def _finish_group(self, group: RecvGroup, now: float, error: Exception | None) -> None:
        self._events.append(ReceiveDone(group.handle, self._matcher.finish(group), error))

    def _group_timers(self, group: RecvGroup, now: float) -> float | None:
        """Close unregistered slots at the deadline and everything at the caller's timeout."""
        wake = group.timeout_at
        if group.timeout_at is not None and now >= group.timeout_at:
            for s in group.slots:
                if s.flow is not None and s.flow.regime is None:
                    self._close_rx(s.flow, now, Regime.TIMEOUT)
                elif s.report is None and s.flow is None:
                    self._expire_slot(s, now, Regime.TIMEOUT)
            self._check_group(group, now)
            return None
        if group.t0 is not None:
            unregistered = [s for s in group.slots if s.flow is None and s.report is None]
            if unregistered:
                probe = next((s.flow for s in group.slots if s.flow is not None and not s.flow.reliable), None)
                if probe is not None:
                    deadline = self._early.deadline_for(probe, probe.lt, now)
                    if deadline is not None:
                        if now >= deadline:
                            for s in unregistered:
                                self._expire_slot(s, now, Regime.TIMEOUT)
                            self._check_group(group, now)
                        else:
                            wake = deadline if wake is None else min(wake, deadline)
        return wake

    def _expire_slot(self, slot: RecvSlot, now: float, regime: Regime, cause: str = "") -> None:
        self._matcher.expire(slot, now, regime, cause)
        if slot.peer is not None and slot.tag is not None:
            self._admission.expire_tag(slot.peer, slot.tag, now)

    # ------------------------------------------------------------------ sending side
    def _end_send(self, flow: FlowSender, now: float) -> None:
        path = self._paths.get(flow.peer)
        if path is not None:
            try:
                path.flows.remove(flow)
            except ValueError:
                pass
        self._tx.pop((flow.peer, flow.flow_id), None)
        self._tx_by_handle.pop(flow.handle, None)
        finished = self._tx_finished
        finished[(flow.peer, flow.flow_id)] = flow.token
        if len(finished) > self.config.max_closed_flows:
            finished.popitem(last=False)
        if flow.error is not None:
            self._events.append(SendDone(flow.handle, None, flow.error))
            return
        w = flow.window
        segs = flow.delivered_segments()
        delivered = w.acked_bytes if w.acked_count >= segs else min(segs * flow.seg_size, flow.total)
        rt = path.bbr.rtprop if path is not None else None
        report = SendReport(peer=flow.peer, tag=flow.tag, total_bytes=flow.total, delivered_bytes=delivered,
                            delivered_fraction=delivered / flow.total, packets_sent=w.packets_sent,
                            retransmitted_packets=w.retransmits, duration_s=now - flow.started,
                            close_reason=flow.close_reason, rtprop_s=rt or 0.0,
                            btlbw_bps=path.bbr.btlbw if path is not None else 0.0, reliable=flow.reliable,
                            lost_packets=w.lost_events, spurious_losses=w.spurious_losses,
                            spurious_timeouts=w.spurious_losses - w.spurious_reorder_losses)
        self._events.append(SendDone(flow.handle, report))

    # ------------------------------------------------------------------ output
    def _flush_acks(self, flow: FlowReceiver, now: float) -> None:
        w = flow.window
        if w.n_acks == 0:
            return
        entries = w.take_acks()
        delay_us = int((now - flow.ack_since) * 1e6) if flow.ack_since is not None else 0
        flow.ack_since = None
        grant = self._admission.grant(flow.seg_size, flow.peer)  # 0 without Config.link_rate (ltp/link_share.py)
        step = wire.MAX_ACK_ENTRIES - (1 if grant else 0)
        for k in range(0, entries.shape[0], step):
            self._ctrl.append((wire.pack_ack(flow.flow_id, flow.token, w.received, delay_us,
                                             entries[k:k + step], grant), flow.peer))

    def _acking(self, addr, fid: int, token: int) -> bool:
        """Whether receive flow ``(addr, fid)`` of ``token`` holds ACK entries that are yet to go out (an ACK with
        entries is due within ``ack_delay_s``: it confirms the flow's registration, so its REG answers need not)."""
        flow = self._rx.get((addr, fid))
        return flow is not None and flow.token == token and flow.window.n_acks > 0

    def _share_egress(self, now: float) -> None:
        """Split this host's link rate equally among the paths with data to send or in flight (loopback
        paths do not use the link: they are neither counted nor capped)."""
        if now < self._egress_recount_at:
            return
        self._egress_recount_at = now + SHARE_REFRESH_S
        active = [p for p in self._paths.values() if p.flows and not on_loopback(p.peer)]
        rate = self.config.link_rate
        for path in active:
            path.set_egress_share(datagram_share(rate, len(active), path.mss), now)

    def flush_acks(self, now: float, *, due_by: float | None = None) -> int:
        """Queue pending ACKs now instead of at their ACK-delay deadline; returns how many flows.

        ``ack_delay_s`` is the longest an ACK entry may wait, not the shortest. An
        adapter whose timer cannot fire that precisely (an event loop that keeps
        timers in milliseconds) calls this with ``due_by`` = the earliest time its
        timer could fire, and ACKs due by then go out now, early rather than late —
        those holding at least :data:`EARLY_ACK_MIN_ENTRIES` entries, and any of a
        flow still in its first :data:`QUICKACK_SEGMENTS` segments (its sender may be
        in a slow-start round, waiting for them). A lone entry of a slow flow waits
        for company or the timer, and so does a held REG answer (:mod:`ltp.admission`): it has nothing to
        carry but the registration's confirmation. ``due_by`` None: every pending ACK and held answer, now."""
        self._note_stall(now)
        if due_by is None:
            self._admission.release_answers(now, everything=True)
        if not self._ack_dirty:
            return 0
        delay, n = self.config.ack_delay_s, 0
        for key, flow in list(self._ack_dirty.items()):
            w = flow.window
            if due_by is not None:
                if w.n_acks < EARLY_ACK_MIN_ENTRIES and (w.n_acks == 0 or w.received > QUICKACK_SEGMENTS):
                    continue
                if flow.ack_since is not None and flow.ack_since + delay > due_by:
                    continue
            self._flush_acks(flow, now)
            del self._ack_dirty[key]
            n += 1
        return n

    def datagrams_to_send(self, now: float) -> list:
        """Everything to transmit now: control datagrams, then paced DATA batches."""
        self._note_stall(now)
        self._ctrl_due = None  # the REGs that were due go out now
        if self._ack_dirty:
            every, delay = self.config.ack_every, self.config.ack_delay_s
            for key, flow in list(self._ack_dirty.items()):
                # same expression as the timer in get_timer: no float-rounding livelock
                if flow.window.n_acks >= every or flow.ack_since is None or flow.ack_since + delay <= now:
                    self._flush_acks(flow, now)
                    del self._ack_dirty[key]
        if self.config.link_rate is not None and self.config.share_egress:
            self._share_egress(now)
        out = []
        if self._admission.held:  # REG answers that are due, or have company to be folded into
            self._admission.release_answers(now, acking=self._acking)
        if len(self._ctrl) > 1:
            self.stats.reg_answers_folded += fold_reg_answers(self._ctrl)
        while self._ctrl:
            data, addr = self._ctrl.popleft()
            out.append(Transmit(addr, memoryview(data), len(data)))
            self.stats.datagrams_out += 1
            self.stats.bytes_out += len(data)
        # sends to several peers go out in order through the adapter's threads: no batch is built in lanes then
        spread = not self.sending_to_several
        for path in self._paths.values():
            if not path.flows:
                continue
            tx = path.poll(now, spread=spread)
            while tx is not None:
                out.append(tx)
                n = tx.nbytes
                self.stats.datagrams_out += -(-n // tx.segment_size)
                self.stats.bytes_out += n
                # the next flow's turn now, not at the next ACK: with the receiver silent (a busy PS), a flow
                # behind one whose lost segment the tail-loss timer re-queued was never served
                tx = path.poll(now, fresh=True, spread=spread) if path.budget_left else None
            path.wake = path.next_send_time(now)
        return out

    @property
    def sending(self) -> bool:
        """Whether a send is open (its ACKs are the adapter's chances to send more: receive polling waits)."""
        return bool(self._tx)

    @property
    def sending_to_several(self) -> bool:
        """Whether open sends go to two or more peers (an adapter's sender threads then send beside its loop)."""
        peer = None
        for p, _fid in self._tx:
            if peer is None:
                peer = p
            elif p != peer:
                return True
        return False

    @property
    def streaming(self) -> bool:
        """Whether a receive flow past its first :data:`QUICKACK_SEGMENTS` segments is open (a bulk transfer in
        progress: receive polling may read it once a loop tick)."""
        return any(f.window.received > QUICKACK_SEGMENTS for f in self._rx.values())

    @property
    def quickacking(self) -> bool:
        """Whether an open receive flow is still in its first :data:`QUICKACK_SEGMENTS` segments (its sender may be
        in a slow-start round, waiting for every ACK: receive polling waits)."""
        return any(f.window.received <= QUICKACK_SEGMENTS for f in self._rx.values())

    # ------------------------------------------------------------------ timers
    def get_timer(self) -> float | None:
        """The earliest time :meth:`handle_timer` must run, or None (the minimum of :meth:`timers`)."""
        best = None
        for t in self._deadlines():
            if t is not None and (best is None or t < best):
                best = t
        self._due = best
        return best

    def timers(self) -> TimerTable:
        """Every armed timer, by kind (:class:`~ltp.timers.Timer`); the next deadline is their minimum."""
        return TimerTable(self._deadlines())

    def _deadlines(self) -> tuple:
        """The earliest deadline of each timer kind (None: not armed), in :class:`~ltp.timers.Timer` order."""
        # plain local minima: get_timer runs once per event-loop turn, over every open flow
        pacing = reg = tail = silence = reorder = None
        floor = self._heard_floor
        for path in self._paths.values():
            if not path.flows:
                continue
            t = path.wake
            if t is not None and (pacing is None or t < pacing):
                pacing = t
            pto = path.pto()
            limit = self.silence_limit(path)
            for flow in path.flows:
                if not flow.reg_confirmed:
                    t = flow.reg_next
                    if t is not None and (reg is None or t < reg):
                        reg = t
                w = flow.window
                if w.inflight_count:
                    oldest = w.oldest_inflight_time()
                    if oldest >= 0:
                        # re-armed by every ACK, so it only fires when ACKs stop
                        t = max(oldest, flow.last_heard) + pto
                        if tail is None or t < tail:
                            tail = t
                    if w.acked_in_window:
                        t = path.reorder_deadline(flow)
                        if t is not None and (reorder is None or t < reorder):
                            reorder = t
                t = max(flow.silence_from, path.silence_from, floor) + limit
                if silence is None or t < silence:
                    silence = t
        early = min(self._wakes.values()) if self._wakes else None
        ack = self._admission.next_answer_due()  # held REG answers wait as ACK entries do
        if self._ack_dirty:
            delay = self.config.ack_delay_s
            for f in self._ack_dirty.values():
                if f.ack_since is not None:
                    t = f.ack_since + delay
                    if ack is None or t < ack:
                        ack = t
        group_at = None
        for group in self._matcher.groups.values():
            if not group.done:
                t = group.wake
                if t is not None and (group_at is None or t < group_at):
                    group_at = t
                t = group.timeout_at
                if t is not None and (group_at is None or t < group_at):
                    group_at = t
        claim = self._claim_at if self._claims else None  # due at once: a copy step per loop turn
        return (pacing, reg, tail, silence, early, ack, group_at, self._admission.next_expiry(),
                self._rx_idle_next if self._rx else None, claim, self._pool.next_expiry(),
                self._matcher.unclaimed_expiry(self.config.unclaimed_ttl_s), reorder)

    def silence_limit(self, path: Path) -> float:
        """Seconds of silence after which a peer counts as dead (the dead-peer rule, :mod:`ltp.liveness`)."""
        return liveness.silence_limit(self.config, path.srtt)

    def _note_stall(self, now: float) -> None:
        """The own-stall rule's check, run by every input that carries ``now``: a ``now`` over
        ``liveness.OWN_STALL_S`` past the deadline :meth:`get_timer` last gave means this process did not run
        meanwhile, since the adapter's timer would have called :meth:`handle_timer` at that deadline. Every
        peer's silence then counts afresh from ``now``; :attr:`own_stall_since` records the deadline and
        :attr:`own_stall_at` the ``now``.

        Every input checks, not the timer alone: a process that resumes reads its socket before its late timer
        runs, and the flush after that read moves the deadlines (a pacing wake is recomputed from ``now``), so
        the timer that runs next is on time and the stall went unseen (found by CI: a PS stopped for 10 s
        failed a 10 s send, in ``test_pause_launch``). A stall counts once: a deadline from before the moment
        it was noticed (still due after the read, so the late timer runs next) belongs to it. The REGs of a send
        not yet flushed are a deadline too (``_ctrl_due``): an idle engine has no timer armed.

        A shorter lateness, over ``liveness.OWN_PAUSE_S``, is the own-pause rule: the Early Close clocks of the
        open receives (:meth:`_pause_receives`) and the dead-peer clocks of the open sends (:meth:`_pause_sends`)
        move on by it."""
        due = self._due
        if self._ctrl_due is not None and (due is None or self._ctrl_due < due):
            due = self._ctrl_due
        if due is not None and due < self._input_at:
            due = self._input_at  # a deadline already past when it was armed was due at that input, not before
        if now > self._input_at:
            self._input_at = now
        pause = liveness.paused(due, now)
        if not pause:
            return
        self._due = self._ctrl_due = None  # one pause, counted once
        self._paused_until = now
        if self._pause_receives(pause, now) | self._pause_sends(pause, now):
            self.stats.own_pauses += 1
        if liveness.stalled(due, now) and due > self._heard_floor:
            self._heard_floor = now
            self.own_stall_since, self.own_stall_at = due, now
            self.stats.own_stalls += 1

    def _pause_receives(self, seconds: float, now: float) -> bool:
        """The own-pause rule (:mod:`ltp.liveness`): this process did not run for ``seconds`` before ``now``, so
        every open receive's Early Close clock, and its group's, moves on by them. A group whose clock runs counts
        even with no flow open: one of its messages completed before the pause, the others had not registered.
        True when a clock moved."""
        moved = False
        for flow in self._rx.values():
            if flow.regime is None:
                flow.pause(seconds, now)
                moved = True
        for group in self._matcher.groups.values():
            if not group.done and group.t0 is not None:
                group.t0 += seconds
                moved = True
        return moved

    def _pause_sends(self, seconds: float, now: float) -> bool:
        """The own-pause rule, sending side (:mod:`ltp.liveness`): this process did not run for ``seconds`` before
        ``now``, so the dead-peer clock of every path with an open send, and of each such send, moves on by them
        (``liveness.pause_credit``, bounded): what the peer sent meanwhile waited unread, and what we meant to send
        (a registration round) was not sent. True when a send was open."""
        credit = liveness.pause_credit
        moved = False
        for path in self._paths.values():
            if not path.flows:
                continue
            limit = self.silence_limit(path)
            path.silence_from = credit(path.silence_from, path.last_heard, seconds, now, limit)
            for flow in path.flows:
                flow.silence_from = credit(flow.silence_from, flow.last_heard, seconds, now, limit)
            moved = True
        return moved

    def handle_timer(self, now: float) -> None:
        """Run every timer due at ``now`` (REG repeat, tail-loss probe, idle, Early Close).

        A call over ``liveness.OWN_STALL_S`` after the deadline :meth:`get_timer` gave means this process
        did not run meanwhile: every peer's silence counts afresh from ``now`` (the own-stall rule)."""
        self._note_stall(now)
        self._due = None
        for path in list(self._paths.values()):
            pto = path.pto()
            declared = 0  # packets this path's tail-loss timeouts declared lost now
            for flow in list(path.flows):
                if flow.state != OPEN:
                    continue
                heard = max(flow.silence_from, path.silence_from, self._heard_floor)
                limit = self.silence_limit(path)
                if heard + limit <= now:
                    wall = now - max(flow.last_heard, path.last_heard, self._heard_floor)
                    flow.fail(now, TransferTimeout(self._silence_message(flow, path, wall, limit, now,
                                                                         paused=wall - (now - heard))))
                    self._end_send(flow, now)
                    continue
                if not flow.reg_confirmed and now >= flow.reg_next:
                    if flow.reg_rounds:  # a registration unanswered for its timeout: a REG or its answer was lost
                        path.note_loss()
                        flow.reg_copies = self.config.reg_copies
                    self._ctrl.extend((reg, flow.peer) for reg in flow.reg_datagrams(
                        now, path.est_word(), path.base_pto(), self._wall_us(now),
                        liveness.reg_gap_max(self.config, path.srtt)))
                lost = path.reordered(flow, now)  # RACK: overtaken, and a round trip + reordering window old
                if lost.shape[0]:
                    path.note_loss()
                    flow.requeue_lost(lost)
                if flow.window.inflight_count and max(flow.window.oldest_inflight_time(), flow.last_heard) + pto <= now:
                    # a nanosecond of slack so the transmission the timer was armed for is included
                    lost = flow.window.expire(now - pto + 1e-9)
                    if lost.shape[0]:
                        flow.requeue_lost(lost)
                        declared += lost.shape[0]
            if declared:
                path.on_tail_loss(declared)
        for key, wake in list(self._wakes.items()):
            if wake <= now:
                flow = self._rx.get(key)
                self._wakes.pop(key, None)
                if flow is not None:
                    self._check_flow(flow, now)
        for group in list(self._matcher.groups.values()):
            if not group.done:
                group.wake = self._group_timers(group, now)
        self._admission.expire_pending(now)
        if self._rx and (self._rx_idle_next is None or self._rx_idle_next <= now):
            self._expire_idle_receives(now)
        self._purge(now)
        if self._claims:
            self._claim_step(now)

    def _silence_message(self, flow: FlowSender, path: Path, silent: float, limit: float, now: float,
                         paused: float = 0.0) -> str:
        what = "registration unanswered" if not flow.reg_confirmed else \
            f"{flow.window.acked_count}/{flow.seg_count} segments acknowledged"
        return liveness.silence_message(self.config, peer=flow.peer, srtt_s=path.srtt, silent_s=silent, limit_s=limit,
                                        ran_s=now - flow.started, progress=what, paused_s=paused)

    def _expire_idle_receives(self, now: float) -> None:
        """Close receive flows whose sender has been silent for ``idle_timeout_s`` (regime ``timeout``)."""
        limit = self.config.idle_timeout_s
        floor = self._heard_floor
        for flow in [f for f in self._rx.values() if f.regime is None and max(f.last_arrival, floor) + limit <= now]:
            self._close_rx(flow, now, Regime.TIMEOUT, cause=liveness.idle_cause(
                flow.peer, silent_s=now - flow.last_arrival, idle_timeout_s=limit, received=flow.window.received,
                seg_count=flow.seg_count, ran_s=now - flow.start))
        self._rx_idle_next = liveness.next_idle_scan(self.config, now)

    # ------------------------------------------------------------------ network reports
    def peer_unreachable(self, peer, *, now: float, cause: str) -> int:
        """The network reports ``peer`` unreachable (the adapter feeds ICMP errors in).

        Every send to it fails with :class:`PeerUnreachable`, every receive from it
        closes with regime ``timeout`` (cause in the report), pending registrations
        from it are dropped and posted receives waiting only for it expire.
        Returns how many transfers it ended."""
        self._note_stall(now)
        self.stats.unreachable_reports += 1
        n = 0
        path = self._paths.get(peer)
        if path is not None:
            for flow in list(path.flows):
                if flow.state == OPEN:
                    flow.fail(now, PeerUnreachable(peer, f"{cause}; {now - flow.started:.3f} s after this send "
                                                         "started"))
                    self._end_send(flow, now)
                    n += 1
        if self._rx_per_peer.get(peer):
            for flow in [f for f in self._rx.values() if f.peer == peer and f.regime is None]:
                self._close_rx(flow, now, Regime.TIMEOUT, send_stop=False,
                               cause=f"sender {peer} unreachable: {cause} "
                                     f"({now - flow.start:.3f} s after it registered)")
                n += 1
        self._admission.drop_peer(peer)
        for slot in self._matcher.waiting_for(peer):
            self._expire_slot(slot, now, Regime.TIMEOUT, cause=f"peer {peer} unreachable: {cause}")
            self._check_group(slot.group, now)
            n += 1
        return n

    def _evict_stale_unclaimed(self, host, need: int, now: float) -> None:
        """Memory for a new transfer from ``host`` does not fit: discard unclaimed messages that
        waited at least ``closed_flow_ttl_s`` (oldest first, ``host``'s own first), counted as
        ``unclaimed_evicted``, until it fits. Younger ones are never evicted: the new transfer is
        refused instead (its sender hears ``out_of_memory``; an evicted message's sender would not)."""
        adm, cfg = self._admission, self.config
        cutoff = now - cfg.closed_flow_ttl_s
        stale = [f for f in self._matcher.unexpected
                 if f.report is not None and f.slot is None and f.closed_at <= cutoff]
        stale.sort(key=lambda f: f.peer[0] != host)  # stable: oldest first within each half
        for flow in stale:
            if adm.fits(host, need):
                return
            if flow.peer[0] != host and adm.host_memory.get(host, 0) + need > cfg.host_memory_cap:
                return  # only the host's own messages could help, and none is left
            self._matcher.unexpected.remove(flow)
            self._free_internal(flow, now, keep=False)
            self.stats.drop("unclaimed_evicted")

    def _purge(self, now: float) -> None:
        self._admission.purge(now)
        ttl = self.config.unclaimed_ttl_s
        while (flow := self._matcher.pop_unclaimed(now, ttl)) is not None:
            self._free_internal(flow, now)
            self.stats.drop("unclaimed_message")
        self._pool.trim(now)

    def next_event(self):
        """Pop the next :class:`SendDone` / :class:`ReceiveDone`, or None."""
        return self._events.popleft() if self._events else None

    # ------------------------------------------------------------------ helpers
    def _new_handle(self) -> int:
        h = self._next_handle
        self._next_handle += 1
        return h

    def _check_open(self) -> None:
        if self._closed_engine:
            raise LocalProtocolError("endpoint is closed; open a new one")

    @staticmethod
    def _norm_addr(peer):
        if not isinstance(peer, tuple) or len(peer) < 2 or not isinstance(peer[1], int) or \
                isinstance(peer[1], bool) or not 0 <= peer[1] <= 65535:
            raise LocalProtocolError(f"peer must be a (host, port) tuple with a port in 0..65535, got {peer!r}")
        return peer

    @property
    def receive_memory(self) -> int:
        """Bytes currently allocated on peers' behalf (bitmaps and buffered messages)."""
        return self._admission.memory
