"""Transfer reports returned by every send and receive."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["SendReport", "RecvReport", "EndpointStats"]


@dataclass(frozen=True)
class SendReport:
    """What happened to one sent message."""

    peer: tuple
    tag: int
    total_bytes: int
    delivered_bytes: int
    delivered_fraction: float
    packets_sent: int
    retransmitted_packets: int
    duration_s: float
    #: "acked" (every segment acknowledged) or the receiver's STOP reason:
    #: "complete", "early", "deadline", "cancelled"
    close_reason: str
    rtprop_s: float
    #: the path's BtlBw estimate in **bytes**/s (the unit on the wire), a growing lower bound while in STARTUP
    btlbw_bps: float
    reliable: bool
    lost_packets: int = 0
    #: loss verdicts that the acknowledgements later proved wrong (the transmission had arrived: the path
    #: reordered, or the ACKs were late); each cost a resend unless its ACK came first
    spurious_losses: int = 0
    #: of those, the tail-loss timer's (it fired while the ACKs were late: a peer or this process starved of CPU);
    #: the rest were the reordering rules' (the path reordered)
    spurious_timeouts: int = 0


@dataclass(frozen=True)
class RecvReport:
    """What arrived of one received message; missing bytes are zero-filled ``bubbles``."""

    peer: tuple | None
    tag: int | None
    total_bytes: int
    received_bytes: int
    delivered_fraction: float
    #: zero-filled byte ranges (packet bubbles), half-open, sorted
    bubbles: list
    critical_complete: bool
    #: "complete", "early", "deadline", "cancelled" or "timeout" (never registered)
    regime: str
    duration_s: float
    duplicates: int
    #: the sender's estimates as carried in its packet headers (BtlBw in **bytes**/s; 0 = unknown: RTprop
    #: before the sender's first RTT sample, BtlBw until it stopped growing)
    rtprop_s: float
    btlbw_bps: float
    #: Early Close thresholds, in seconds from the start of the receive group (its first
    #: registration: for a gather the start of the batch synchronisation, else this flow's)
    lt_threshold_s: float | None
    deadline_s: float | None
    reliable: bool = False
    #: bytes of each packet's room left unused so no element is split (padding bubble)
    padding_bytes_per_packet: int = 0
    #: why a "timeout" regime ended the receive (peer silent or unreachable, caller's timeout), else ""
    cause: str = ""


@dataclass
class EndpointStats:
    """Counters of an endpoint (monotonic)."""

    datagrams_in: int = 0
    datagrams_out: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    flows_sent: int = 0
    flows_received: int = 0
    #: dropped datagrams by reason ("truncated", "bad_token", "unknown_flow", ...)
    dropped: dict = field(default_factory=dict)
    #: refused registrations by reason ("unauthenticated", "stale", "replayed", "too_many_flows",
    #: "too_many_host_flows", "too_many_pending", "out_of_memory", "too_large", ...)
    refused: dict = field(default_factory=dict)
    #: REG datagrams for a flow already registered, open or closed (a round's other copies,
    #: ``Config.reg_copies``, or a repeat that crossed its answer): answered again, not dropped
    reg_repeats: int = 0
    #: REG answers not sent because an ACK with entries or a STOP of the same flow went out with them
    #: (:func:`ltp.admission.fold_reg_answers`)
    reg_answers_folded: int = 0
    #: ACKs and STOPs for sends that had already finished (the receiver's STOP behind the ACK that completed a
    #: send, or a repeat): one of our tokens, so not counted as drops
    late_answers: int = 0
    #: registrations that expired before their first DATA came and were revived by it (a sender slower than its
    #: path, :data:`ltp.admission.LAPSED_TTL_S`) instead of being answered RESET "unregistered"
    revived_registrations: int = 0
    #: RESET "unregistered" answers received for open sends (each may make the send register again)
    reregistrations: int = 0
    #: RESET "stale" answers that made an open send register again with a fresh stamp (``sender.STALE_RETRIES``)
    stale_retries: int = 0
    #: ICMP unreachable reports fed in by the adapter (Engine.peer_unreachable)
    unreachable_reports: int = 0
    #: timers that ran more than ``liveness.OWN_STALL_S`` late: this process did not run (SIGSTOP, a blocked
    #: loop), and every peer's silence was counted afresh (the own-stall rule, :mod:`ltp.liveness`)
    own_stalls: int = 0
    #: inputs over ``liveness.OWN_PAUSE_S`` late while receives (or a receive group's clock) or sends were open: this
    #: process paused, and their Early Close clocks and the sends' dead-peer clocks moved on by the pause (the
    #: own-pause rule, :mod:`ltp.liveness`)
    own_pauses: int = 0
    #: datagrams this endpoint's socket dropped for want of room (the kernel's count, ``SO_RXQ_OVFL``, as the
    #: adapter last read it): a receiver slower than its senders
    socket_drops: int = 0

    def drop(self, reason: str, n: int = 1) -> None:
        """Count ``n`` dropped datagrams under ``reason``."""
        self.dropped[reason] = self.dropped.get(reason, 0) + n
