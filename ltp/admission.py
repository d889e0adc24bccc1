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
   host (IP, any port) and in total.

Without a job key, layers 1-2 are off (anyone can register: there is no secret
to tell a peer from an attacker) and layer 3 still bounds what a REG can cost.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
from collections import OrderedDict
from dataclasses import dataclass

__all__ = ["reg_mac", "address_bytes", "ReplayCache", "PendingRegistration", "pending_lifetime",
           "PENDING_RTTS", "PENDING_MIN_S", "PENDING_MAX_S"]

_MAC_LABEL = b"LTP1-REG"
MAC_SIZE = 16

#: a pending registration lives this many RTTs without DATA ...
PENDING_RTTS = 8
#: ... but never less than this (seconds; covers a sender's first pacing gap) ...
PENDING_MIN_S = 0.05
#: ... nor more than this (seconds)
PENDING_MAX_S = 1.0


def address_bytes(addr) -> bytes:
    """Canonical bytes of a ``(host, port)`` source address for the MAC.

    IPv4 and IPv4-mapped IPv6 give the same 4 bytes; other hosts (names used in
    simulations) are their UTF-8 text. The port is 2 bytes, big-endian.
    """
    host, port = addr[0], addr[1]
    try:
        ip = ipaddress.ip_address(host.split("%", 1)[0] if isinstance(host, str) else host)
    except ValueError:
        hb = str(host).encode()
    else:
        if ip.version == 6 and ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped
        hb = ip.packed
    return bytes([len(hb)]) + hb + (int(port) & 0xFFFF).to_bytes(2, "big")


def reg_mac(key: bytes, source, signed: bytes) -> bytes:
    """The 16-byte REG MAC over the source address and ``signed`` (every REG byte before the MAC)."""
    return hmac.new(key, _MAC_LABEL + address_bytes(source) + signed, hashlib.sha256).digest()[:MAC_SIZE]


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


def pending_lifetime(rtt_s: float) -> float:
    """How long a registration may wait for its first DATA, from a round-trip estimate (seconds)."""
    return min(PENDING_MAX_S, max(PENDING_MIN_S, PENDING_RTTS * rtt_s))
