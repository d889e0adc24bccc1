"""Exceptions of LTP, shared by the compiled modules and their pure-Python twins.

Two families, as in h11: :class:`LocalProtocolError` means *this* program used
the API wrongly (the message says what to change); errors caused by the peer or
the network are either dropped and counted (malformed datagrams, see
:class:`WireError`) or surface as a failed transfer (:class:`TransferRefused`,
:class:`TransferTimeout`).

The four base classes (:class:`LTPError`, :class:`LocalProtocolError`,
:class:`RemoteProtocolError`, :class:`WireError`) are defined in
:mod:`ltp_ext.errors`, because the compiled codecs and their twins raise them
and ``ltp_ext`` imports nothing from ``ltp``; they are re-exported here.
"""

from __future__ import annotations

from ltp_ext.errors import LocalProtocolError, LTPError, RemoteProtocolError, WireError

__all__ = [
    "LTPError",
    "LocalProtocolError",
    "RemoteProtocolError",
    "WireError",
    "TransferRefused",
    "TransferTimeout",
    "TransferAborted",
    "PeerUnreachable",
    "BroadcastError",
]

_REFUSAL_HINTS = {
    "unauthenticated": "the job keys differ, or the peer sees this host at another address than the one it "
                       "signs (NAT?): REG MACs bind the source address",
    "stale": "the clocks of this host and the peer differ by more than the peer's Config.reg_freshness_s; "
             "synchronise them (NTP)",
    "out_of_memory": "the receiver's Config.max_receive_memory (or max_receive_memory_per_host) is taken by "
                     "messages nobody received yet; post receives earlier or raise the cap",
    "too_many_flows": "the receiver holds too many flows from this address or host (Config.max_flows_per_peer, "
                      "max_flows_per_host, max_pending_registrations); wait for some to finish",
    "too_large": "the message exceeds the receiver's Config.max_flow_bytes or the buffer it posted",
    "unregistered": "the receiver kept forgetting this registration; it may have restarted",
}


class TransferRefused(LTPError):
    """The peer refused the flow registration (``reason`` says why)."""

    def __init__(self, reason: str) -> None:
        hint = _REFUSAL_HINTS.get(reason)
        super().__init__(f"transfer refused by peer: {reason}" + (f" ({hint})" if hint else ""))
        self.reason = reason


class TransferTimeout(LTPError, TimeoutError):
    """The transfer did not finish in time, or the peer stopped answering."""


class TransferAborted(LTPError):
    """The endpoint was closed while the transfer was running."""


class PeerUnreachable(LTPError, ConnectionError):
    """The peer is gone: the network reported it unreachable (ICMP) or it fell silent.

    ``peer`` is its ``(host, port)``; ``cause`` says what was observed.
    """

    def __init__(self, peer, cause: str) -> None:
        super().__init__(f"peer {peer} is unreachable: {cause}")
        self.peer = peer
        self.cause = cause


class BroadcastError(LTPError):
    """A reliable broadcast reached some peers and not others.

    Raised by :meth:`ltp.Endpoint.broadcast` only after *every* peer's send ended, so
    nothing is left running behind it.  ``outcomes`` holds one entry per peer, in the
    order given: the peer's :class:`~ltp.reports.SendReport`, or the exception its
    send ended with.  ``failed`` maps each failed peer to its exception;
    ``delivered`` lists the peers that got the whole message.  Pass
    ``return_exceptions=True`` to get ``outcomes`` back instead of this error.
    """

    def __init__(self, peers, outcomes) -> None:
        self.peers = list(peers)
        self.outcomes = list(outcomes)
        self.failed = {p: o for p, o in zip(self.peers, self.outcomes) if isinstance(o, BaseException)}
        self.delivered = [p for p, o in zip(self.peers, self.outcomes) if not isinstance(o, BaseException)]
        first = next(iter(self.failed.items()), None)
        detail = f"; first: {first[0]}: {first[1]}" if first else ""
        super().__init__(f"broadcast reached {len(self.delivered)} of {len(self.peers)} peers, "
                         f"{len(self.failed)} failed{detail} (the exception's .failed maps each failed peer to "
                         "its error; pass return_exceptions=True to get one outcome per peer instead)")
