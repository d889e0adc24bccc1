"""Endpoint configuration (one frozen dataclass, validated on creation)."""

from __future__ import annotations

from dataclasses import dataclass

from ltp_ext.constants import SEND_THREADS_MAX

from .errors import LocalProtocolError

__all__ = ["Config", "DCN", "WAN", "REG_COPIES_MAX", "PEER_SOCKETS_MAX"]

_GiB = 1 << 30
_MiB = 1 << 20
#: most REG copies per registration attempt (Config.reg_copies)
REG_COPIES_MAX = 4
#: the most peer sockets one endpoint may open (``Config.peer_sockets``): each is a file descriptor
PEER_SOCKETS_MAX = 1024


@dataclass(frozen=True)
class Config:
    """Tunables of an LTP endpoint. Times are seconds, sizes bytes, rates bytes/s.

    The defaults suit a data-centre network (Early Close slack ``C`` = 30 ms);
    :data:`WAN` sets ``C`` = 100 ms as in the paper.
    """

    #: link MTU; the segment size is ``mtu - 28 - 16`` rounded down to the element size
    mtu: int = 1500
    #: explicit payload bytes per DATA packet (overrides the MTU rule; a multiple of the element size)
    segment_size: int | None = None
    #: Early Close: fraction of a flow that must have arrived to close between LT threshold and deadline
    lt_fraction: float = 0.8
    #: Early Close: the constant C added to the largest LT threshold to make the deadline
    deadline_slack_s: float = 0.030
    #: how many recent full deliveries of a (link, size) the LT threshold is the minimum of
    lt_window: int = 32
    #: receive caps: one flow, flows per peer, memory of buffered (not yet posted) messages + bitmaps
    max_flow_bytes: int = 4 * _GiB
    max_flows_per_peer: int = 64
    max_receive_memory: int = 1 * _GiB
    max_peers: int = 4096
    #: smallest segment size a peer may register (bounds the per-segment bitmap)
    min_segment_size: int = 64
    #: receive caps per source host (its IP, any port): open + pending flows, and memory
    #: (None = the total cap; lower it where peers you do not trust share this receiver)
    max_flows_per_host: int = 256
    max_receive_memory_per_host: int | None = None
    #: registrations admitted but still waiting for their first DATA (no memory committed yet)
    max_pending_registrations: int = 1024
    #: job key: REG packets carry HMAC-SHA256(key) over source address + every REG byte;
    #: unauthenticated, stale or replayed ones are refused (see ltp/admission.py)
    job_key: bytes | None = None
    #: with a job key: a REG's timestamp must be within this of the receiver's wall clock
    #: (sender and receiver clocks must agree this well, e.g. NTP)
    reg_freshness_s: float = 10.0
    #: with a job key: MACs of accepted REGs remembered to refuse replays (bounded memory)
    replay_cache_entries: int = 32768
    #: congestion control start-up guesses until the first samples arrive
    initial_cwnd_packets: int = 10
    initial_rtt_s: float = 0.001
    #: ACKs: one datagram per this many entries, or when the oldest entry waited ack_delay_s
    ack_every: int = 32
    ack_delay_s: float = 0.0005
    #: BBR's ACK-aggregation allowance is capped at this much time at BtlBw
    aggregation_cap_s: float = 0.002
    #: pacing timer granularity and smallest burst (see ltp/pacing.py)
    pacing_granularity_s: float = 0.001
    min_burst_packets: int = 8
    #: loss recovery: smallest probe timeout; REG retransmission starts at this times two
    min_pto_s: float = 0.004
    #: REG datagrams per registration attempt, sent back to back, each stamped afresh. A receiver drops
    #: DATA of a flow it holds no registration for, so a lost REG costs the whole first flight and at
    #: least a round trip; two copies make that p^2 instead of p at random loss p (and each copy is
    #: answered, so a lost answer is p^2 too). 1 sends one; at most REG_COPIES_MAX. A *clean* path (one that
    #: lost nothing in its last ltp.path.CLEAN_PATH_PACKETS packets) sends one whatever this says, and its
    #: receivers leave out the guard STOP behind a completing ACK (docs/protocol.md, REG).
    reg_copies: int = 2
    #: a transfer fails when the peer has been silent this long (upper bound of the dead-peer rule)
    idle_timeout_s: float = 10.0
    #: dead-peer rule: a send fails after max(this, PEER_SILENCE_RTTS x smoothed RTT) of silence
    #: from the peer (capped by idle_timeout_s); ICMP unreachable reports fail it at once
    peer_silence_min_s: float = 1.0
    #: closed receive flows are remembered (to repeat STOP) this long, and at most this many
    closed_flow_ttl_s: float = 10.0
    max_closed_flows: int = 8192
    #: a complete message nobody has posted a receive for yet is kept this long (its memory counts
    #: against the receive caps), then discarded and counted (``unclaimed_message``). The sender saw
    #: it acknowledged, so this must outlast any plausible delay before the application posts the
    #: receive (a process still importing torch or building its model on a loaded host).
    unclaimed_ttl_s: float = 120.0
    #: BBR: how often RTprop must be refreshed before PROBE_RTT, and how long that lasts
    probe_rtt_interval_s: float = 10.0
    probe_rtt_duration_s: float = 0.2
    #: socket buffers requested by the asyncio adapter
    socket_buffer_bytes: int = 64 * _MiB
    #: datagrams per recvmmsg/GRO batch in the adapter
    io_batch: int = 64
    #: this host's link rate in wire bytes/s (e.g. 125e6 for 1 Gbit/s; None = unknown, the default). When
    #: set, every ACK grants its sender an equal share of it and the endpoint splits it among the paths it
    #: sends on, so N senders into one link (a PS's gather) do not overflow its queue (ltp/link_share.py)
    link_rate: float | None = None
    #: with ``link_rate``: also split it among this endpoint's own sends (False where only the inbound side of the
    #: link runs at ``link_rate``: its receivers still grant; ``ltp-ps --inbound-rate``, launch's lab)
    share_egress: bool = True
    #: adapters send DATA by gather (header + segment straight from the message: one copy, by the kernel)
    gather_send: bool = True
    #: the asyncio adapter reads a socket that wakes it several times a loop tick (a bulk or paced stream
    #: into an endpoint with no send open) on its timer instead, once a tick, as NAPI polls a busy NIC;
    #: see ltp/endpoint.py
    receive_polling: bool = True
    #: threads that make the asyncio adapter's DATA sends (``UdpIO`` sender threads: the kernel's per-packet
    #: send path, and on a veth path the receiving side's softirq too, runs beside the event loop instead
    #: of inside it); 0 sends from the event loop's thread. One destination is served by one thread, except the
    #: parts of a spread batch (``spread_sends``)
    send_threads: int = 2
    #: with sender threads, one peer's DATA may be paced by a sender thread in sub-bursts of at most this much
    #: time at the path's BBR pacing rate (``UdpIO.send_segments(pace_rate=...)``), where the event loop's timer
    #: sends a tick's worth in one burst at memory speed; 0 (the default) turns it off. A shaper with a shallow
    #: burst (a token bucket's: the lab's tbf takes 200 us of line rate) then passes the packets without
    #: queueing them: 0.0002 took the lab's tbf row from 0.89-0.92 to 0.93-0.94 Gbit/s. It is off by default
    #: because on a host whose cores are all busy (a PS and its workers sharing two) the parameter server's
    #: rounds took 1.2-1.3x as long with it (docs/performance.md, "Change 15"). Paths paced by a receiver's grant
    #: (ltp/link_share.py) and sends to several peers are never thread-paced.
    thread_pacing_s: float = 0.0
    #: with two or more sender threads, one peer's large DATA batches (at least ``2 x SPREAD_PART_MIN`` packets) are
    #: built in lanes and go out in contiguous parts that the threads send side by side
    #: (``UdpIO.send_segments(parts=)``): one flow's kernel path (on a veth lab, the receiving host's softirq too)
    #: then runs on several cores, where it would saturate one. The parts interleave on the wire; each keeps its
    #: order, and loss detection counts each lane apart (``SendWindow.build(lanes=)``), so the interleaving resends
    #: nothing. See docs/performance.md, "Change 17", for what it gains and costs here
    spread_sends: bool = False
    #: learn from loss verdicts the ACKs prove wrong that the path reorders, and wait for late packets (the
    #: packet-count rule off, a wider RACK window: ltp/reordering.py). Off by default: it cuts the resends of a
    #: path that reorders (simulator, 2 ms +- jitter: 28 against 1,028 per 8 MB), but on the lab's 2 ms +- 2 ms path
    #: the late packets it waits for stay in flight against BBR's window (2 x BtlBw x the jittered path's minimum
    #: RTT), and it moved 1.05-1.25 Gbit/s against 1.69-1.76 without it (docs/performance.md, "Session 51")
    learn_reordering: bool = False
    #: Linux: the asyncio adapter of an endpoint that serves several peers opens, for each of up to this many peers
    #: a receive names (``recv(peer=)``, ``gather``, ``expect``), a *peer socket*: one more UDP socket bound to the
    #: endpoint's own address and port and connected to that peer, so the kernel finds that peer's socket by an
    #: exact match (early demux; no wildcard socket lookup) and queues its datagrams apart from the other peers'
    #: (each socket's receive queue has its own lock, which the senders' softirqs no longer contend for). Peers see
    #: one address; the engine is the same. 0 turns it off.
    #: See ltp/endpoint.py, "Peer sockets", and docs/performance.md, "Change 23"
    peer_sockets: int = 64

    def __post_init__(self) -> None:
        if not 576 <= self.mtu <= 65535:
            raise LocalProtocolError(f"mtu={self.mtu}: use a value between 576 and 65535")
        if self.segment_size is not None and not 1 <= self.segment_size <= 65507 - 16:
            raise LocalProtocolError("segment_size must be between 1 and 65491 bytes")
        if self.segment_size is not None and self.segment_size < self.min_segment_size:
            # a peer refuses a message of several segments smaller than its min_segment_size (bad_registration)
            raise LocalProtocolError(f"segment_size={self.segment_size} is below min_segment_size="
                                     f"{self.min_segment_size}, which receivers refuse for multi-packet messages; "
                                     "use a larger segment_size (or lower min_segment_size on every endpoint)")
        if not 0.0 < self.lt_fraction <= 1.0:
            raise LocalProtocolError("lt_fraction must be in (0, 1]; 0.8 is the paper's default")
        if self.deadline_slack_s < 0:
            raise LocalProtocolError("deadline_slack_s must be >= 0 (30 ms for DCN, 100 ms for WAN)")
        if self.max_receive_memory_per_host is not None and self.max_receive_memory_per_host <= 0:
            raise LocalProtocolError("max_receive_memory_per_host must be positive (or None for the total cap)")
        if self.link_rate is not None and not (isinstance(self.link_rate, (int, float))
                                               and not isinstance(self.link_rate, bool) and self.link_rate > 0
                                               and self.link_rate < float("inf")):
            raise LocalProtocolError(f"link_rate={self.link_rate!r}: pass the link's rate in bytes/s "
                                     "(125e6 for 1 Gbit/s), or None when it is unknown")
        if isinstance(self.reg_copies, bool) or not isinstance(self.reg_copies, int) or \
                not 1 <= self.reg_copies <= REG_COPIES_MAX:
            raise LocalProtocolError(f"reg_copies={self.reg_copies!r}: pass an int from 1 to {REG_COPIES_MAX} "
                                     "(2, the default, survives one lost REG)")
        if self.job_key is not None and not isinstance(self.job_key, (bytes, bytearray)):
            raise LocalProtocolError("job_key must be bytes (e.g. secret.encode())")
        if isinstance(self.send_threads, bool) or not isinstance(self.send_threads, int) or \
                not 0 <= self.send_threads <= SEND_THREADS_MAX:
            raise LocalProtocolError(f"send_threads={self.send_threads!r}: pass an int from 0 (send from the "
                                     f"event loop) to {SEND_THREADS_MAX}")
        if isinstance(self.thread_pacing_s, bool) or not isinstance(self.thread_pacing_s, (int, float)) or \
                not 0 <= self.thread_pacing_s <= self.pacing_granularity_s:
            raise LocalProtocolError(f"thread_pacing_s={self.thread_pacing_s!r}: pass seconds from 0 (no thread "
                                     f"pacing, the default) to pacing_granularity_s ({self.pacing_granularity_s}), "
                                     "e.g. 0.0002")
        if not isinstance(self.spread_sends, bool):
            raise LocalProtocolError(f"spread_sends={self.spread_sends!r}: pass True or False")
        if isinstance(self.peer_sockets, bool) or not isinstance(self.peer_sockets, int) or \
                not 0 <= self.peer_sockets <= PEER_SOCKETS_MAX:
            raise LocalProtocolError(f"peer_sockets={self.peer_sockets!r}: pass an int from 0 (one socket for every "
                                     f"peer) to {PEER_SOCKETS_MAX}")
        if not isinstance(self.learn_reordering, bool):
            raise LocalProtocolError(f"learn_reordering={self.learn_reordering!r}: pass True or False")
        for name in ("max_flow_bytes", "max_flows_per_peer", "max_receive_memory", "lt_window",
                     "initial_cwnd_packets", "min_burst_packets", "io_batch", "max_closed_flows", "ack_every",
                     "max_flows_per_host", "max_pending_registrations", "replay_cache_entries",
                     "reg_freshness_s", "peer_silence_min_s", "idle_timeout_s", "unclaimed_ttl_s"):
            if getattr(self, name) <= 0:
                raise LocalProtocolError(f"{name} must be positive")

    @property
    def host_memory_cap(self) -> int:
        """Receive memory one source host may hold (bytes)."""
        h = self.max_receive_memory_per_host
        return self.max_receive_memory if h is None else min(h, self.max_receive_memory)

    def segment_size_for(self, element_size: int) -> int:
        """Payload bytes per DATA packet for elements of ``element_size`` bytes (padding-bubble rule)."""
        if isinstance(element_size, bool) or not isinstance(element_size, int) or element_size <= 0:
            raise LocalProtocolError(
                f"element_size={element_size!r}: pass a positive int, the bytes per element (4 for float32)")
        raw = self.segment_size if self.segment_size is not None else self.mtu - 28 - 16
        seg = raw - raw % element_size
        if seg <= 0:
            raise LocalProtocolError(
                f"element_size={element_size} does not fit a {raw}-byte segment; raise the MTU")
        return seg


#: data-centre defaults (C = 30 ms)
DCN = Config()
#: wide-area defaults (C = 100 ms)
WAN = Config(deadline_slack_s=0.100)
