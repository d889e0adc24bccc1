"""Where the kernel dropped datagrams on a clean path: UDP socket buffers and the per-CPU input backlog.

Why: on an emulated path without configured loss, a transport can still see loss the lab did not make. A
receiving socket whose buffer is full drops the datagram (``RcvbufErrors`` in ``/proc/net/snmp``, counted per
network namespace: read it from a process inside the receiver's namespace); a veth hands every packet to the
receiving CPU's input backlog, which drops past ``net.core.netdev_max_backlog`` when softirq work falls
behind (the second column of ``/proc/net/softnet_stat``, global over namespaces). On a 2-core machine both
happen when the processes starve the kernel's packet work or the reverse. A benchmark that counts resends
must count these beside them, or it blames the transport's loss detection for real drops.

Both files are Linux only; elsewhere (or unreadable) the readers return None.
"""

from __future__ import annotations

__all__ = ["udp_drops", "backlog_drops", "delta", "PROC_SNMP", "PROC_SOFTNET"]

PROC_SNMP = "/proc/net/snmp"
PROC_SOFTNET = "/proc/net/softnet_stat"
#: the ``/proc/net/snmp`` ``Udp:`` counters read, under the names :func:`udp_drops` returns
_UDP_FIELDS = {"RcvbufErrors": "udp_rcvbuf_errors", "SndbufErrors": "udp_sndbuf_errors",
               "InErrors": "udp_in_errors"}


def udp_drops(path: str = PROC_SNMP) -> dict[str, int] | None:
    """This network namespace's UDP drop counters since it was made: receive buffer full, send buffer full, and
    every input error (``InErrors`` includes the receive-buffer drops); None where the file is unreadable."""
    try:
        with open(path) as f:
            rows = [line.split() for line in f if line.startswith("Udp:")]
    except OSError:
        return None
    if len(rows) < 2:
        return None
    values = dict(zip(rows[0][1:], rows[1][1:]))
    try:
        return {name: int(values[field]) for field, name in _UDP_FIELDS.items()}
    except (KeyError, ValueError):
        return None


def backlog_drops(path: str = PROC_SOFTNET) -> int | None:
    """Packets every CPU's input backlog dropped since boot (all namespaces); None where unreadable."""
    try:
        with open(path) as f:
            return sum(int(line.split()[1], 16) for line in f if line.strip())
    except (OSError, IndexError, ValueError):
        return None


def delta(before: dict[str, int] | None, after: dict[str, int] | None) -> dict[str, int] | None:
    """``after - before`` per counter, or None when either snapshot is missing."""
    if before is None or after is None:
        return None
    return {k: after[k] - before[k] for k in after if k in before}
