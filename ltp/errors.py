"""Exceptions of LTP, shared by the compiled modules and their pure-Python twins.

Two families, as in h11: :class:`LocalProtocolError` means *this* program used
the API wrongly (the message says what to change); errors caused by the peer or
the network are either dropped and counted (malformed datagrams, see
:class:`WireError`) or surface as a failed transfer (:class:`TransferRefused`,
:class:`TransferTimeout`).
"""

from __future__ import annotations

__all__ = [
    "LTPError",
    "LocalProtocolError",
    "RemoteProtocolError",
    "WireError",
    "TransferRefused",
    "TransferTimeout",
    "TransferAborted",
    "PeerUnreachable",
]


class LTPError(Exception):
    """Base class of every LTP error."""


class LocalProtocolError(LTPError, ValueError):
    """The caller misused the API; the message names the fix."""


class RemoteProtocolError(LTPError):
    """The peer violated the protocol."""


class WireError(RemoteProtocolError, ValueError):
    """A datagram could not be decoded. ``reason`` is the drop-counter key."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


class TransferRefused(LTPError):
    """The peer refused the flow registration (``reason`` says why)."""

    def __init__(self, reason: str) -> None:
        super().__init__(f"transfer refused by peer: {reason}")
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
