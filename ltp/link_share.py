"""Receiver-driven rate grants and the sender's egress share: one host's link split among its flows.

Theory of operation. BBR estimates each path's bottleneck on its own. When N
senders share one receiver's link (a parameter server's gather: the incast),
each one's probing sees a link that is briefly free, so together they pace at
a multiple of the line rate into the switch's queue; with a shallow queue that
overflow is loss they inflict on themselves, and Early Close then cuts the
gradients the senders dropped (measured in the lab: 8 workers into a 1 Gbit/s
link with a 32 kB queue at 1 % random loss kept as little as 22 % of one
gradient; docs/performance.md, Change 3). The receiver is the one place that sees every sender, so it
decides (as Homa's and pHost's receivers grant credit):

* **Ingress grants.** An endpoint told its link rate (``Config.link_rate``,
  wire bytes/s) counts the distinct peers it holds open (or registered) flows
  from (admission's per-peer count), and every ACK it sends, from the one
  that confirms a registration on, carries a *grant*: the datagram rate (LTP
  header and payload, bytes/s) one sender may use so that all of them
  together fill :data:`GRANT_UTILIZATION` of the link once the per-datagram
  IP/UDP/Ethernet overhead (:data:`WIRE_OVERHEAD_BYTES`) is counted. The share
  is equal per peer (*choice*: the PS's senders are symmetric; a sender that
  cannot use its share leaves that capacity idle rather than the grants
  chasing measured rates, which would oscillate).
* **Grant use.** A sender paces a path at ``min(BBR's pacing rate, grant,
  egress share)``, and while the grant is what limits it, in bursts of at
  least :data:`GRANTED_MIN_BURST_PACKETS` rather than the configured minimum
  (the granted senders' bursts meet in one shallow queue). BBR still
  measures the path: its delivery-rate samples follow the grant, so its BtlBw
  (and the LT threshold a receiver derives from it) describes the rate the
  flow really gets. A grant is dropped when it has
  not been renewed for :data:`GRANT_TTL_S` (the receiver's set of senders is
  long since different; the next ACK brings a fresh one).
* **Restarts.** A path that starts a message after being idle paces at the
  smallest grant of its last busy period (a provisional grant, dropped after
  :data:`PROVISIONAL_GRANT_S` unless the receiver's own arrives), from a
  random phase of one minimum burst: the grant it ended with was given when
  the other senders had finished, and in the next round they all restart at
  once, each with a bucket the idle time filled.
* **Egress share.** The same endpoint splits its own link among the paths it
  is sending on (a PS broadcasting to N workers), each capped at an equal
  share, so its N paths do not overflow its own uplink's queue either. The
  paths are recounted at most every :data:`SHARE_REFRESH_S`.

Loopback peers (127.0.0.0/8, ::1) are left out of both: their datagrams
never cross the link (a worker colocated with its PS shard), so they get no
grant, take no share and are not counted.

Nothing here reads the clock: callers pass ``now``. Without ``link_rate`` no
grant is sent and no cap is applied (the behaviour before grants); a peer
that sends no grant leaves the sender's pacing to BBR alone.
"""

from __future__ import annotations

import ipaddress
from functools import lru_cache

__all__ = ["GRANT_UTILIZATION", "WIRE_OVERHEAD_BYTES", "SHARE_REFRESH_S", "GRANT_TTL_S", "PROVISIONAL_GRANT_S",
           "GRANTED_MIN_BURST_PACKETS", "datagram_share", "on_loopback"]

#: fraction of the link rate (wire bytes) the grants (or egress shares) add up to: the rest absorbs
#: the senders' pacing error so a shallow switch queue stays short
GRANT_UTILIZATION = 0.95
#: bytes the network adds to every UDP datagram on the wire: Ethernet 14 + IPv4 20 + UDP 8
WIRE_OVERHEAD_BYTES = 42
#: the endpoint recounts its active sending paths at most this often (seconds)
SHARE_REFRESH_S = 0.001
#: a sender forgets a grant not renewed for this long (seconds)
GRANT_TTL_S = 1.0
#: smallest pacing burst of a path its receiver's grant paces (packets; the configured minimum is 8): N
#: granted senders' bursts meet in the receiver's queue, and at a low share (12 senders into 100 Mbit/s)
#: 8-packet bursts from two of them fill a 16 kB queue (simulator: 22 % of packets dropped at 8, 0 at 2)
GRANTED_MIN_BURST_PACKETS = 2
#: a restarting path's provisional grant (its smallest grant of the last busy period) lapses after this
#: long without the receiver's own (seconds; the receiver's arrives within a round trip)
PROVISIONAL_GRANT_S = 0.1


def datagram_share(link_rate: float, senders: int, datagram_bytes: int) -> float:
    """The datagram rate (bytes/s of LTP datagrams) each of ``senders`` may use on a link of ``link_rate``
    wire bytes/s, for datagrams of ``datagram_bytes`` (LTP header included), so that together they fill
    :data:`GRANT_UTILIZATION` of it."""
    on_wire = datagram_bytes / (datagram_bytes + WIRE_OVERHEAD_BYTES)
    return link_rate * GRANT_UTILIZATION * on_wire / max(1, senders)


@lru_cache(maxsize=4096)
def _loopback_host(host) -> bool:
    try:
        return ipaddress.ip_address(str(host).split("%", 1)[0]).is_loopback
    except ValueError:
        return False  # a name (simulations): not loopback


def on_loopback(addr) -> bool:
    """True when the ``(host, port)`` address is a loopback one: its traffic does not use the link."""
    return _loopback_host(addr[0])
