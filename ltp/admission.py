"""Admission of registrations: who may make this host commit memory, and when.

Theory of operation. A REG is a request to reserve receive state. Three layers
decide whether it is honoured, each sans-IO (the caller passes ``wall`` = its
wall clock in seconds since the Unix epoch, derived from ``now``):

1. **Authenticity** (with a job key). The REG MAC is HMAC-SHA256 truncated to
   16 bytes over a domain label, the *source address* of the datagram (as the
   receiver sees it: packed IP + port) and **every byte of the REG** before the
   MAC (all 16 header bytes and the body, which carries the sender's wall-clock
   timestamp). A REG replayed from another address, or with any bit changed,
   fails the MAC (``unauthenticated``).
2. **Freshness** (with a job key). The timestamp must lie within
   ``Config.reg_freshness_s`` of the receiver's wall clock (``stale``), and its
   MAC must not be in the :class:`ReplayCache` of MACs accepted in that window
   (``replayed``). The cache is bounded: when full it forgets its oldest entry
   and raises a *floor*: REGs stamped at or before the floor are refused
   (``replayed``), so forgetting never re-admits a replay. Every copy of a REG
   the sender repeats carries a fresh timestamp (and so a fresh MAC).
3. **Evidence** (always). An admitted REG creates only a small
   :class:`PendingRegistration` (no bitmap, no buffer); memory is committed
   when the first DATA of the flow with the right token arrives from the same
   address. Pending registrations expire after a few RTTs
   (:func:`pending_lifetime`) and are capped per source address, per source
   host (IP, any port) and in total. An expired registration *lapses*: it
   no longer counts against any cap, but its first DATA, should it still come
   with the right token, revives it (if the caps allow it then) instead of
   drawing RESET ``unregistered``. The life is counted in network round trips,
   and a sender starved of CPU answers slower than its path: with every
   turnaround longer than the life, each re-registration expired before its
   DATA came, and the send failed ``unregistered`` after nine of them (found
   by CI: a torchrun rank, three training processes on two cores).

Without a job key, layers 1-2 are off (anyone can register: there is no secret
to tell a peer from an attacker) and layer 3 still bounds what a REG can cost.

A REG for a flow id that a *pending* registration of another token holds
supersedes it (counted as ``superseded_registration``): no DATA ever committed
the older one, and a REG proves nothing, so the newer is as likely genuine (a
corrupted or forged copy took the id, or the sender restarted). Before, it was
dropped as a collision: a mutated copy of a REG that took a sender's *next*
flow id and claimed a 1 s round trip held that id for the registration's whole
life, and the sender's genuine message failed at its dead-peer limit (found by
``test_onpath_mutation``'s hypothesis test). A committed flow of another token
still wins (``flow_id_collision``): it has had DATA with its token.

:class:`Admission` applies the three layers for an engine and keeps every
count they need: pending registrations (and their expiry heap), open + pending
flows per source address and per source host, receive memory in total and per
source host, the replay cache, the rate budget of RESET ``unregistered``
answers, and what this host says to DATA that arrives too late:

* a *closed flow* (token, STOP code, segments received) is remembered for
  ``Config.closed_flow_ttl_s``; its DATA and repeated REGs are answered with
  the same STOP again (at most once per :data:`STOP_REPEAT_S`), never by
  re-opening the flow;
* an *expired tag* (a posted receive for ``(peer, tag)`` that passed its
  deadline or timeout with nothing registered) is remembered as long: a REG for
  it is answered with STOP ``deadline`` at once, so the sender stops instead of
  sending a message nobody will read -- until a receive for that ``(peer, tag)``
  is posted again (:meth:`Admission.want_tag`): the application waits for it
  once more (a control stream reads its next message again after a timeout),
  and a message for it must not be turned away;
* DATA of a flow this host holds nothing for (not even a lapsed
  registration) is answered with RESET ``unregistered`` (at most
  :data:`UNREGISTERED_RESETS_PER_S`), so a sender whose REG was lost registers
  again.

Every REG copy is answered with an ACK (no entries), so that a lost answer
costs nothing while another copy's answer arrives. An answer is folded away
only where it says nothing new: :func:`fold_reg_answers` drops, from control
datagrams about to go out together, the REG answers of a flow for which an ACK
with entries or a STOP goes out beside them (each confirms the registration,
carries the same grant and at least the same count). A one-datagram message
whose REG copies and DATA were read together is then answered with its ACK and
STOP alone: four datagrams back became two.

An answer to a REG of a small message (at most :data:`HOLD_ANSWER_MAX_SEGMENTS`
segments) waits for that company as an ACK entry does: it is *held*
(:attr:`Admission.held`) until ``Config.ack_delay_s`` after its REG was read,
and goes out with the first control datagrams of its flow that confirm the
registration (folded away there) or alone once due (:meth:`Admission.release_answers`,
called by the engine as it collects what to send; its due time arms the engine's
``ACK_DELAY`` timer). The sender needs the answer only to stop repeating its
REG, which it does a probe timeout later at the earliest (``Config.min_pto_s``,
8x the hold), and it sends its DATA without waiting for it. Before session 60
the answers went out at once; where a sender's REG copies and its DATA were read
in separate wake-ups (a broadcast whose DATA leaves through sender threads after
the REGs of every peer), each REG copy cost a datagram each way more.

It writes its answers (ACK, RESET, STOP datagrams) to the engine's control
queue and its counts to the engine's :class:`~ltp.reports.EndpointStats`;
the engine owns the flows and receive slots and tells it what it needs to
know about them (an open flow with the same key, the waiting slot a REG would
fill, a flow's memory when it closes).
"""

from __future__ import annotations

import hmac
import ipaddress
from collections import OrderedDict
from dataclasses import dataclass

from . import wire
from .config import REG_COPIES_MAX
from .link_share import datagram_share, on_loopback
from .regimes import CloseReason
from .timers import DeadlineHeap

__all__ = ["Admission", "reg_mac", "address_bytes", "fold_reg_answers", "ReplayCache", "PendingRegistration",
           "pending_lifetime", "stop_datagram", "PENDING_RTTS", "PENDING_MIN_S", "PENDING_MAX_S", "STOP_REPEAT_S",
           "UNREGISTERED_RESETS_PER_S", "LAPSED_TTL_S"]

_MAC_LABEL = b"LTP1-REG"
MAC_SIZE = 16

#: a pending registration lives this many RTTs without DATA ...
PENDING_RTTS = 8
#: ... but never less than this (seconds; covers a sender's first pacing gap) ...
PENDING_MIN_S = 0.05
#: ... nor more than this (seconds), which is also its life when neither side knows the RTT yet (a first
#: REG on a path, before the sender's first RTT sample; its header carries RTprop from then on): a guessed short life
#: expires every registration on a path whose one-way delay exceeds it, since DATA held for the REG's
#: answer arrives one round trip after the REG (measured: 50 ms one-way, 10 Mbit/s -- every re-registration
#: expired, and the sends failed "unregistered")
PENDING_MAX_S = 1.0
#: a lapsed (expired) registration may be revived by its first DATA for this long after it expired (seconds);
#: at most ``Config.max_pending_registrations`` are kept, the oldest forgotten first. A sender that takes longer is
#: one the dead-peer rule gives up on anyway (``Config.peer_silence_min_s``, 1 s by default)
LAPSED_TTL_S = 2.0
#: DATA of a closed flow is answered with its STOP again at most once per this interval (seconds)
STOP_REPEAT_S = 0.002
#: RESET ``unregistered`` answers to DATA of unknown flows: at most this many per second (and burst)
UNREGISTERED_RESETS_PER_S = 1000.0
#: REG answers wait for company only for messages of at most this many segments (the small messages whose
#: answers were a third of the datagrams they drew back). A bulk message's answers go at once: they are a few
#: datagrams among thousands, and in the simulator's 8-sender incast (``tests/test_engine.py``, 6 seeds x 4
#: rounds) holding them raised the shared queue's drops from 27.6 % to 32.4 % of the packets sent (session 60)
HOLD_ANSWER_MAX_SEGMENTS = 256
#: a flow told RESET ``unregistered`` has its next REG answered at once, not held (its sender holds its DATA
#: until that answer comes, so no company will come), for this long after the RESET (seconds; the sender's
#: registration rounds are at most ``sender.REG_GAP_MAX_S`` = 1 s apart)
UNREGISTERED_MEMORY_S = 1.0


#: at most this many source addresses keep their canonical MAC bytes (``address_bytes``); the table is emptied
#: when full, so a flood of source addresses costs the parse again, never memory
ADDRESS_BYTES_CACHE = 1024
_address_bytes_cache: dict = {}


def address_bytes(addr) -> bytes:
    """Canonical bytes of a ``(host, port)`` source address for the MAC.

    IPv4 and IPv4-mapped IPv6 give the same 4 bytes; other hosts (names used in
    simulations) are their UTF-8 text. The port is 2 bytes, big-endian. Every REG
    is MACed and checked over its source (four times per message with two copies),
    and parsing the host literal was most of a MAC's cost: the answer is remembered
    per ``(host, port)``.
    """
    key = (addr[0], addr[1])
    try:
        return _address_bytes_cache[key]
    except KeyError:
        pass
    except TypeError:  # an unhashable host: not cached
        return _address_bytes(addr[0], addr[1])
    out = _address_bytes(addr[0], addr[1])
    if len(_address_bytes_cache) >= ADDRESS_BYTES_CACHE:
        _address_bytes_cache.clear()
    _address_bytes_cache[key] = out
    return out


def _address_bytes(host, port) -> bytes:
    try:
        ip = ipaddress.ip_address(host.split("%", 1)[0] if isinstance(host, str) else host)
    except ValueError:
        hb = str(host).encode()
    else:
        if ip.version == 6 and ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped
        hb = ip.packed
    return bytes([len(hb)]) + hb + (int(port) & 0xFFFF).to_bytes(2, "big")


_ACK_B0 = (wire.VERSION << 4) | wire.T_ACK
_STOP_B0 = (wire.VERSION << 4) | wire.T_STOP


def _entries(data) -> int:
    """The entry count of an ACK datagram (header word 3, low 16 bits): 0 for a REG answer."""
    return data[14] << 8 | data[15]


def _confirmed_flows(ctrl) -> set:
    """``(addr, flow id and token bytes)`` of every flow with an ACK with entries or a STOP in ``ctrl``."""
    confirmed = set()
    for data, addr in ctrl:
        b0 = data[0]
        if b0 == _STOP_B0 or (b0 == _ACK_B0 and _entries(data)):
            confirmed.add((addr, bytes(data[2:8])))  # flow id and token
    return confirmed


def fold_reg_answers(ctrl) -> int:
    """Drop from ``ctrl`` -- a deque of ``(datagram, addr)`` control datagrams about to go out together -- every
    REG answer (an ACK without entries) of a flow that also has an ACK with entries or a STOP among them, to the
    same address; returns how many were dropped. What is kept keeps its order."""
    answers = sum(1 for data, _ in ctrl if data[0] == _ACK_B0 and not _entries(data))
    if not answers:
        return 0
    confirmed = _confirmed_flows(ctrl)
    if not confirmed:
        return 0
    kept = [(d, a) for d, a in ctrl
            if not (d[0] == _ACK_B0 and not _entries(d) and (a, bytes(d[2:8])) in confirmed)]
    folded = len(ctrl) - len(kept)
    if folded:
        ctrl.clear()
        ctrl.extend(kept)
    return folded


def reg_mac(key: bytes, source, signed: bytes) -> bytes:
    """The 16-byte REG MAC over the source address and ``signed`` (every REG byte before the MAC)."""
    # hmac.digest: OpenSSL's one-shot HMAC, no HMAC object per call (a message costs four MACs)
    return hmac.digest(key, _MAC_LABEL + address_bytes(source) + signed, "sha256")[:MAC_SIZE]


class ReplayCache:
    """MACs of recently accepted REGs, bounded in memory (see layer 2 above)."""

    def __init__(self, capacity: int, window_s: float) -> None:
        self.capacity = capacity
        self.window_s = window_s
        self._seen: OrderedDict = OrderedDict()  # mac -> timestamp (s), in insertion order
        self.floor = float("-inf")  # REGs stamped at or before this are refused

    def __len__(self) -> int:
        return len(self._seen)

    def check(self, mac: bytes, stamp: float, wall: float) -> str | None:
        """Return the refusal reason for a REG stamped ``stamp`` (seconds), or None and remember it."""
        if abs(stamp - wall) > self.window_s:
            return "stale"
        self._expire(wall)
        if stamp <= self.floor or mac in self._seen:
            return "replayed"
        self._seen[mac] = stamp
        while len(self._seen) > self.capacity:
            _, old = self._seen.popitem(last=False)
            self.floor = max(self.floor, old)
        return None

    def _expire(self, wall: float) -> None:
        # anything stamped before wall - window is refused as stale anyway
        seen = self._seen
        limit = wall - self.window_s
        while seen:
            mac, stamp = next(iter(seen.items()))
            if stamp >= limit:
                break
            seen.popitem(last=False)


@dataclass
class PendingRegistration:
    """An admitted REG waiting for its first DATA (no memory committed yet)."""

    key: tuple
    peer: tuple
    flow_id: int
    token: int
    total: int
    seg_size: int
    element_size: int
    seg_count: int
    tag: int
    reliable: bool
    ranges: list
    est: tuple
    registered: float  # when the first copy of the REG arrived (the flow's Early Close start)
    expires: float
    copies: int = 1  # REG copies of this registration read (more than one: its sender's path shows loss)


def pending_lifetime(rtt_s: float | None) -> float:
    """How long a registration may wait for its first DATA, from a round-trip estimate (seconds; None:
    unknown, the longest life)."""
    if not rtt_s:
        return PENDING_MAX_S
    return min(PENDING_MAX_S, max(PENDING_MIN_S, PENDING_RTTS * rtt_s))


def stop_datagram(fid: int, token: int, code: int, count: int) -> bytes:
    """A STOP for flow ``fid``: ``code`` is the wire STOP code, ``count`` the segments received."""
    return wire.pack_header(wire.T_STOP, 0, fid, token, count & 0xFFFFFFFF, code << 24)


class Admission:
    """Who may make this host commit receive memory, and the counts that bound it (see the module comment).

    Sans-IO: every method takes ``now`` (the engine's clock, seconds) and,
    for freshness, ``wall`` (seconds since the epoch). Answers go to ``ctrl``
    (a deque of ``(datagram, addr)``), counts to ``stats``.
    """

    def __init__(self, config, stats, ctrl, *, srtt=None, make_room=None) -> None:
        """``config``: the engine's :class:`~ltp.config.Config`; ``stats``: its
        :class:`~ltp.reports.EndpointStats`; ``ctrl``: its control-datagram queue;
        ``srtt``: ``addr -> smoothed RTT (seconds) or None``, this host's own estimate
        of a peer (a registration's lifetime takes the larger of it and the sender's);
        ``make_room``: ``(host, bytes, now) -> None``, asked to free memory (stale
        unclaimed messages) before a registration or first DATA is refused for memory."""
        self.config = config
        self.stats = stats
        self.ctrl = ctrl
        self._srtt = srtt if srtt is not None else (lambda addr: None)
        self._make_room = make_room if make_room is not None else (lambda host, n, now: None)
        self.pending: dict = {}  # (peer, fid) -> PendingRegistration
        #: (peer, fid) -> (PendingRegistration, revivable until): expired registrations, counted against no cap
        self.lapsed: OrderedDict = OrderedDict()
        self.expiries = DeadlineHeap()  # pending registrations by expiry, lazily cleaned
        self.per_peer: dict = {}  # source address -> open + pending receive flows
        self.link_peers = 0  # how many of those addresses are not loopback (rate grants share the link among them)
        self.per_host: dict = {}  # source host -> open + pending receive flows
        self.memory = 0  # bytes allocated on peers' behalf (bitmaps and internal buffers)
        self.host_memory: dict = {}  # source host -> receive memory held for it
        self.replay = ReplayCache(config.replay_cache_entries, config.reg_freshness_s)
        self._unreg_budget = UNREGISTERED_RESETS_PER_S
        self._unreg_at: float | None = None
        self.closed: OrderedDict = OrderedDict()  # (peer, fid) -> [token, code, count, expiry, last_stop]
        self.expired_tags: OrderedDict = OrderedDict()  # (peer, tag) -> expiry
        #: REG answers waiting for company (see the module docstring): ``(due, datagram, addr)`` in arrival order,
        #: at most ``held_max`` (every copy of a full table of pending registrations)
        self.held: list = []
        self.held_max = config.max_pending_registrations * REG_COPIES_MAX
        #: (peer, fid) -> until when: flows told RESET ``unregistered``, whose next REG is answered at once; as
        #: many as the RESETs' rate limit allows in UNREGISTERED_MEMORY_S
        self.told_unregistered: OrderedDict = OrderedDict()

    # ------------------------------------------------------------------ registrations
    def refuse(self, addr, fid: int, token: int, reason: str, code: str | None = None) -> None:
        """Count a refused registration by ``reason`` and RESET the sender (``code``: the wire reason)."""
        self.stats.refused[reason] = self.stats.refused.get(reason, 0) + 1
        self.ctrl.append((wire.pack_header(wire.T_RESET, 0, fid, token, wire.RESET_CODES[code or reason], 0), addr))

    def on_reg(self, data, addr, flags: int, fid: int, token: int, w3: int, now: float, wall: float, *,
               existing=None, find_slot=None, hinted=None, attempt: int = 0, processed: float | None = None):
        """Admit, repeat-answer or refuse one REG from ``addr`` (layers 1-3).

        ``existing``: the open receive flow with this ``(addr, fid)``, if any;
        ``find_slot(addr, tag)``: the posted receive slot the message would fill,
        or None; ``hinted(addr, tag, total)``: whether, with no slot, the caller
        hinted a buffer of its own for it (``ltp/placement.py``: no internal buffer
        is needed). ``attempt``: the REG's attempt byte (header word 2), echoed in a
        RESET ``stale`` so the sender can tell an answer to its latest copy from
        one to a copy that sat in a queue. Returns None, or ``(slot, total)`` when
        the ``total``-byte message does not fit the slot: the sender was refused
        (``too_large``) and the caller fails the slot. ``now`` is when the REG arrived
        (the registration's time, from which Early Close counts); ``processed`` (default
        ``now``) is when it is read, from which a pending registration's life counts: a
        REG read from a backlog has its first DATA queued right behind it, and must not
        expire before the next read reaches it.
        """
        cfg = self.config
        key = (addr, fid)
        life_from = now if processed is None else max(now, processed)  # a pending registration's life starts
        has_mac = bool(flags & wire.F_MAC)
        (total, seg, elem, count, tag, mode, ranges, mac, mac_end, stamp) = wire.unpack_reg_body(
            data, wire.HEADER_SIZE, has_mac)
        if cfg.job_key is not None:
            good = has_mac and hmac.compare_digest(mac, reg_mac(cfg.job_key, addr, bytes(data[:mac_end])))
            if not good:
                self.stats.drop("unauthenticated")
                self.refuse(addr, fid, token, "unauthenticated")
                return None
            why = self.replay.check(mac, stamp / 1e6, wall)
            if why is not None:
                self.stats.drop(why)
                self.stats.refused[why] = self.stats.refused.get(why, 0) + 1
                if why == "stale":  # a live sender whose clock is off learns why (and which copy); a replay: nothing
                    self.ctrl.append((wire.pack_header(wire.T_RESET, 0, fid, token, wire.RESET_CODES["stale"],
                                                       attempt & 0xFF), addr))
                return None
        pend = self.pending.get(key)
        if existing is not None or pend is not None:
            if (existing or pend).token == token:
                (existing or pend).copies += 1
                received = existing.window.received if existing is not None else 0
                self._answer(key, wire.pack_ack(fid, token, received, 0, (), self.grant(seg, addr)), addr, life_from,
                             count)
                self.stats.reg_repeats += 1
                if pend is not None:
                    pend.expires = max(pend.expires, life_from + pending_lifetime(self._rtt_hint(addr, w3)))
                return None
            if existing is not None:
                self.stats.drop("flow_id_collision")
                return None
            self.drop_pending(pend)  # uncommitted, of another token: the newer REG takes the id (see above)
            self.stats.drop("superseded_registration")
        rec = self.closed.get(key)
        if rec is not None and rec[0] == token:
            self.stats.reg_repeats += 1
            self.ctrl.append((stop_datagram(fid, token, rec[1], rec[2]), addr))
            return None
        if total > cfg.max_flow_bytes:
            self.refuse(addr, fid, token, "too_large")
            return None
        if seg < cfg.min_segment_size and count > 1:
            self.refuse(addr, fid, token, "bad_registration")
            return None
        host = addr[0]
        full = self._cap_reached(addr)
        if full is not None:
            self.refuse(addr, fid, token, *full)
            return None
        expired = self.expired_tags.get((addr, tag))
        if expired is not None and expired > now:
            # the receive this message was meant for already passed its deadline
            deadline = wire.STOP_CODES[CloseReason.DEADLINE]
            self.remember_closed(key, token, deadline, 0, now)
            self.ctrl.append((stop_datagram(fid, token, deadline, 0), addr))
            return None
        slot = find_slot(addr, tag) if find_slot is not None else None
        if slot is not None and total > len(slot.dest):
            self.refuse(addr, fid, token, "too_large")
            return slot, total
        own = slot is None and hinted is not None and hinted(addr, tag, total)
        need = count + (total if slot is None and not own else 0)
        if not self.fits_after_room(host, need, now):
            # what it would cost does not fit now: say so early (memory is still only taken on DATA)
            self.refuse(addr, fid, token, "out_of_memory")
            return None
        pend = PendingRegistration(key=key, peer=addr, flow_id=fid, token=token, total=total, seg_size=seg,
                                   element_size=elem, seg_count=count, tag=tag, reliable=bool(mode),
                                   ranges=ranges, est=wire.split_estimates(w3), registered=now,
                                   expires=life_from + pending_lifetime(self._rtt_hint(addr, w3)))
        self.lapsed.pop(key, None)  # registered afresh: the new registration counts, not an expired one
        self._hold(pend)
        self.expiries.push(pend.expires, key)
        self._answer(key, wire.pack_ack(fid, token, 0, 0, (), self.grant(seg, addr)), addr, life_from, count)
        return None

    def _answer(self, key, ack: bytes, addr, now: float, segments: int) -> None:
        """Hold the answer ``ack`` to a REG of flow ``key`` (a message of ``segments`` segments) read at ``now``
        until ``Config.ack_delay_s`` later (module docstring); at once for a message of more than
        :data:`HOLD_ANSWER_MAX_SEGMENTS`, and where the flow was told RESET ``unregistered`` (its sender holds
        its DATA)."""
        if self.told_unregistered.pop(key, None) is not None or segments > HOLD_ANSWER_MAX_SEGMENTS or \
                len(self.held) >= self.held_max:
            self.ctrl.append((ack, addr))  # (a REG flood does not grow the held list past one answer per copy
            return                         # of a full table of pending registrations: the rest go at once)
        self.held.append((now + self.config.ack_delay_s, ack, addr))

    def next_answer_due(self) -> float | None:
        """When the earliest held REG answer is due, or None when none is held (part of the ``ACK_DELAY`` timer)."""
        return min(due for due, _, _ in self.held) if self.held else None

    def release_answers(self, now: float, *, everything: bool = False, acking=None) -> int:
        """Move to the control queue the held REG answers that are due by ``now`` (all with ``everything``), and
        those whose flow has an ACK with entries or a STOP queued there (:func:`fold_reg_answers` then folds them
        away); the rest stay held. A due answer of a flow in ``acking(addr, fid, token)`` (its DATA arrived and an
        ACK with entries is pending, due within ``ack_delay_s``) is folded at once instead (counted in
        ``stats.reg_answers_folded``): that ACK confirms the registration. Without this the answers of a REG read
        just before its flow's first DATA fell due a moment before that DATA's delayed ACK and went alone. Returns
        how many were moved or folded."""
        held = self.held
        if not held:
            return 0
        confirmed = _confirmed_flows(self.ctrl)
        keep = []
        ctrl = self.ctrl
        for item in held:
            due, ack, addr = item
            if (addr, bytes(ack[2:8])) in confirmed:
                ctrl.append((ack, addr))  # folded away beside its flow's ACK or STOP
            elif everything or due <= now:
                if not everything and acking is not None and acking(addr, ack[2] << 8 | ack[3],
                                                                    int.from_bytes(ack[4:8], "big")):
                    self.stats.reg_answers_folded += 1
                else:
                    ctrl.append((ack, addr))
            else:
                keep.append(item)
        moved = len(held) - len(keep)
        self.held = keep
        return moved

    def _cap_reached(self, addr) -> tuple | None:
        """The refusal (reason, wire code) if one more receive flow from ``addr`` exceeds a cap, else None."""
        cfg = self.config
        if self.per_peer.get(addr, 0) >= cfg.max_flows_per_peer or (
                addr not in self.per_peer and len(self.per_peer) >= cfg.max_peers):
            return "too_many_flows", None
        if self.per_host.get(addr[0], 0) >= cfg.max_flows_per_host:
            return "too_many_host_flows", "too_many_flows"
        if len(self.pending) >= cfg.max_pending_registrations:
            return "too_many_pending", "too_many_flows"
        return None

    def _hold(self, pend: PendingRegistration) -> None:
        """Keep ``pend`` as pending and count it against its address's and host's caps."""
        addr = pend.peer
        self.pending[pend.key] = pend
        if addr not in self.per_peer and not on_loopback(addr):
            self.link_peers += 1
        self.per_peer[addr] = self.per_peer.get(addr, 0) + 1
        self.per_host[addr[0]] = self.per_host.get(addr[0], 0) + 1

    def revive(self, key, token: int, now: float) -> PendingRegistration | None:
        """DATA with ``token`` came for ``key``, which has no pending registration: its lapsed registration, held
        as pending again (the caller commits it at once, :meth:`commit`), or None -- none lapsed with that token
        within :data:`LAPSED_TTL_S`, or a cap is reached now, or the receive it was meant for expired meanwhile
        (the caller answers RESET ``unregistered``, as to any unknown flow, and the sender's next REG hears the
        cap's refusal or STOP ``deadline``)."""
        entry = self.lapsed.get(key)
        if entry is None:
            return None
        pend, until = entry
        if pend.token != token:
            return None
        del self.lapsed[key]
        if until < now or self._cap_reached(pend.peer) is not None:
            return None
        expired = self.expired_tags.get((pend.peer, pend.tag))
        if expired is not None and expired > now:
            return None  # the receive it was meant for passed its deadline meanwhile: its next REG hears so
        self._hold(pend)
        self.stats.revived_registrations += 1
        return pend

    def forget(self, key, token: int) -> bool:
        """The sender of ``key`` gave up (its RESET with ``token``): forget its pending or lapsed registration (its
        late DATA then revives nothing); True if there was one."""
        pend = self.pending_for(key, token)
        if pend is not None:
            self.drop_pending(pend)
            return True
        entry = self.lapsed.get(key)
        if entry is None or entry[0].token != token:
            return False
        del self.lapsed[key]
        return True

    def grant(self, seg_size: int, addr) -> int:
        """The rate grant (datagram bytes/s) for sender ``addr`` of ``seg_size``-byte segments: this host's
        link rate split equally among the peers it holds open or registered flows from, loopback peers left
        out (``ltp/link_share.py``); 0 (no grant) without ``Config.link_rate`` or for a loopback sender."""
        rate = self.config.link_rate
        if rate is None or on_loopback(addr):
            return 0
        return max(1, int(datagram_share(rate, self.link_peers, wire.HEADER_SIZE + seg_size)))

    def _rtt_hint(self, addr, w3: int) -> float | None:
        """Round-trip estimate for a registration: the larger of the sender's advertised RTprop and our own srtt
        to it; None when neither is known (not the configured initial guess: see PENDING_MAX_S)."""
        rt_us = wire.split_estimates(w3)[0]
        ours = self._srtt(addr) or 0.0
        return max(rt_us / 1e6, ours) or None

    def pending_for(self, key, token: int):
        """The pending registration ``key`` if ``token`` is its token (a first DATA), else None."""
        pend = self.pending.get(key)
        return pend if pend is not None and pend.token == token else None

    def first_data(self, key, token: int, now: float):
        """DATA with ``token`` came for ``key``, which has no open flow: the registration it commits (the caller
        :meth:`commit` s it at once) -- the pending one, else a lapsed one revived (:meth:`revive`) -- or None."""
        pend = self.pending_for(key, token)
        if pend is None and self.lapsed:
            pend = self.revive(key, token, now)
        return pend

    def commit(self, pend: PendingRegistration, slot, now: float, *, own_buffer: bool = False) -> int | None:
        """The first DATA of ``pend`` arrived: take its memory, or refuse it.

        ``slot``: the posted receive it fills (None: an internal buffer is
        needed, unless ``own_buffer``: the caller hinted a buffer of its own for it,
        ``ltp/placement.py``). Returns the bytes committed (the caller allocates the flow and
        gives them back with :meth:`release` when the flow is gone), or None when
        the flow was refused: if the slot is too small the caller fails the slot
        with :meth:`refuse` already counted; if memory does not fit the sender
        got RESET ``out_of_memory``. Either way the flow is remembered as
        closed (STOP ``cancelled`` answers its DATA).
        """
        self.pending.pop(pend.key)
        addr, fid, token, total = pend.peer, pend.flow_id, pend.token, pend.total
        if slot is not None and total > len(slot.dest):
            self.uncount(addr)
            self.remember_closed(pend.key, token, wire.STOP_CODES[CloseReason.CANCELLED], 0, now)
            self.refuse(addr, fid, token, "too_large")
            return None
        need = pend.seg_count + (total if slot is None and not own_buffer else 0)
        if not self.fits_after_room(addr[0], need, now):
            self.uncount(addr)
            self.remember_closed(pend.key, token, wire.STOP_CODES[CloseReason.CANCELLED], 0, now)
            self.refuse(addr, fid, token, "out_of_memory")
            return None
        self.take(addr, need)
        return need

    def drop_pending(self, pend: PendingRegistration) -> None:
        """Forget a pending registration (RESET by its sender, expiry, unreachable peer)."""
        if self.pending.pop(pend.key, None) is not None:
            self.uncount(pend.peer)

    def drop_peer(self, peer) -> None:
        """Forget every pending and lapsed registration from ``peer`` (a lapsed one counts against no cap, so
        ``per_peer`` does not show it)."""
        if self.per_peer.get(peer):
            for pend in [p for p in self.pending.values() if p.peer == peer]:
                self.drop_pending(pend)
        if self.lapsed:
            for key in [k for k, (p, _) in self.lapsed.items() if p.peer == peer]:
                del self.lapsed[key]

    def next_expiry(self) -> float | None:
        """When :meth:`expire_pending` next has work: the earliest expiry of a registration still pending. A
        registration whose first DATA came (most of them, within a round trip) arms no timer of its own."""
        return self.expiries.next_time(self.pending.__contains__)

    def expire_pending(self, now: float) -> None:
        """Drop the pending registrations that waited their lifetime for DATA (``registration_expired``)."""
        heap = self.expiries
        while (key := heap.pop_due(now)) is not None:
            pend = self.pending.get(key)
            if pend is None:
                continue
            if pend.expires > now:  # extended by a repeated REG
                heap.push(pend.expires, key)
                continue
            self.drop_pending(pend)
            self.stats.drop("registration_expired")
            self.lapsed[key] = (pend, now + LAPSED_TTL_S)  # its late first DATA may still revive it (revive)
            self.lapsed.move_to_end(key)
            while len(self.lapsed) > self.config.max_pending_registrations:
                self.lapsed.popitem(last=False)

    def clear(self) -> None:
        """The engine is closing: forget every pending registration and give back all receive memory and counts."""
        self.pending.clear()
        self.lapsed.clear()
        self.expiries.clear()
        self.held = []
        self.told_unregistered.clear()
        self.per_peer.clear()
        self.link_peers = 0
        self.per_host.clear()
        self.memory = 0
        self.host_memory.clear()

    # ------------------------------------------------------------------ counts
    def uncount(self, addr) -> None:
        """A receive flow (open or pending) from ``addr`` is gone."""
        left = self.per_peer.get(addr, 1) - 1
        if left:
            self.per_peer[addr] = left
        elif self.per_peer.pop(addr, None) is not None and not on_loopback(addr):
            self.link_peers -= 1
        left = self.per_host.get(addr[0], 1) - 1
        if left:
            self.per_host[addr[0]] = left
        else:
            self.per_host.pop(addr[0], None)

    def fits(self, host, n: int) -> bool:
        """Whether ``n`` more bytes for ``host`` stay within the total and per-host memory caps."""
        cfg = self.config
        return self.memory + n <= cfg.max_receive_memory and self.host_memory.get(host, 0) + n <= cfg.host_memory_cap

    def fits_after_room(self, host, n: int, now: float) -> bool:
        """:meth:`fits`, after asking the owner to free what it may (see ``make_room``)."""
        if self.fits(host, n):
            return True
        self._make_room(host, n, now)
        return self.fits(host, n)

    def take(self, addr, n: int) -> None:
        """Account ``n`` bytes of receive memory to ``addr``'s host."""
        self.memory += n
        self.host_memory[addr[0]] = self.host_memory.get(addr[0], 0) + n

    def release(self, addr, n: int) -> None:
        """Give back ``n`` bytes of receive memory held for ``addr``'s host."""
        self.memory -= n
        left = self.host_memory.get(addr[0], 0) - n
        if left > 0:
            self.host_memory[addr[0]] = left
        else:
            self.host_memory.pop(addr[0], None)

    # ------------------------------------------------------------------ late DATA
    def remember_closed(self, key, token: int, code: int, count: int, now: float) -> None:
        """Remember a closed flow so its late DATA and REGs get STOP ``code`` again."""
        self.closed[key] = [token, code, count, now + self.config.closed_flow_ttl_s, -1.0]
        self.closed.move_to_end(key)
        while len(self.closed) > self.config.max_closed_flows:
            self.closed.popitem(last=False)

    def recent_closed(self, now: float, within_s: float, limit: int) -> list:
        """``(key, token, code, count)`` of the remembered flows closed in the last ``within_s`` seconds, the
        newest ``limit`` of them, newest first: what their STOP says. Records are kept in the order they closed
        (as :meth:`purge` relies on), so the walk back from the newest stops at the first one closed earlier."""
        since = now - within_s + self.config.closed_flow_ttl_s  # a record's expiry is its close time + the TTL
        out = []
        for key in reversed(self.closed):
            token, code, count, expiry, _ = self.closed[key]
            if expiry < since or len(out) >= limit:
                break
            out.append((key, token, code, count))
        return out

    def expire_tag(self, peer, tag: int, now: float) -> None:
        """A posted receive for ``(peer, tag)`` expired unfilled: its REG gets STOP ``deadline``."""
        self.expired_tags[(peer, tag)] = now + self.config.closed_flow_ttl_s
        while len(self.expired_tags) > self.config.max_closed_flows:
            self.expired_tags.popitem(last=False)

    def want_tag(self, peer, tag: int) -> None:
        """A receive for ``(peer, tag)`` is posted again: its REGs are no longer answered as expired."""
        self.expired_tags.pop((peer, tag), None)

    def on_unknown_data(self, key, token: int, now: float, *, open_flow: bool) -> None:
        """DATA for ``key`` with no open flow of that token (``open_flow``: one with another token is open)."""
        rec = self.closed.get(key)
        if rec is not None and rec[0] == token:
            self.stats.drop("closed_flow")
            if now - rec[4] >= STOP_REPEAT_S:
                rec[4] = now
                self.ctrl.append((stop_datagram(key[1], token, rec[1], rec[2]), key[0]))
            return
        if rec is not None or open_flow or key in self.pending:
            self.stats.drop("bad_token")
            return
        self.stats.drop("unknown_flow")
        # tell the sender we hold no registration (it expired, or REG was lost): it registers again
        if self._unreg_at is not None:
            self._unreg_budget = min(UNREGISTERED_RESETS_PER_S,
                                     self._unreg_budget + (now - self._unreg_at) * UNREGISTERED_RESETS_PER_S)
        self._unreg_at = now
        if self._unreg_budget >= 1.0:
            self._unreg_budget -= 1.0
            self.ctrl.append((wire.pack_header(wire.T_RESET, 0, key[1], token, wire.RESET_CODES["unregistered"], 0),
                              key[0]))
            told = self.told_unregistered
            told.pop(key, None)
            told[key] = now + UNREGISTERED_MEMORY_S
            while len(told) > UNREGISTERED_RESETS_PER_S * UNREGISTERED_MEMORY_S:
                told.popitem(last=False)

    def purge(self, now: float) -> None:
        """Forget closed flows and expired tags older than ``closed_flow_ttl_s``, lapsed registrations past
        their :data:`LAPSED_TTL_S`, and flows told RESET ``unregistered`` :data:`UNREGISTERED_MEMORY_S` ago."""
        while self.lapsed:
            key, (pend, until) = next(iter(self.lapsed.items()))
            if until > now:
                break
            self.lapsed.popitem(last=False)
        while self.closed:
            key, rec = next(iter(self.closed.items()))
            if rec[3] > now:
                break
            self.closed.popitem(last=False)
        while self.expired_tags:
            key, exp = next(iter(self.expired_tags.items()))
            if exp > now:
                break
            self.expired_tags.popitem(last=False)
        told = self.told_unregistered
        while told:
            key, until = next(iter(told.items()))
            if until > now:
                break
            told.popitem(last=False)
