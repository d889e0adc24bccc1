"""Machine-wide CPU time from ``/proc/stat``: every core, user + system + softirq.

Why: kernel TCP's transmit work is partly charged to softirq context and to the
receiving process (ACK-clocked), and the lab's forwarding path (veth, bridge,
tbf, nftables) runs in whichever context touches the packet.  Per-process
``getrusage`` therefore misleads when two transports are compared; the honest
figure is the CPU the whole machine spent while the transfer ran.
``/proc/stat`` is global (namespaces do not isolate it), so a process in any
lab namespace can take the snapshot.

Counted states: user, nice, system, irq, softirq, steal.  Not counted: idle,
iowait, and guest/guest_nice (already included in user/nice).  Resolution is
one clock tick (``SC_CLK_TCK``, usually 10 ms), so use transfers of a second
or more.  Anything else running on the machine is counted too: measure on a
quiet machine and compare only figures taken side by side.
"""

from __future__ import annotations

import os

__all__ = ["machine_cpu_s", "cpu_s_per_gb", "PROC_STAT"]

PROC_STAT = "/proc/stat"
_BUSY_FIELDS = (0, 1, 2, 5, 6, 7)  # user nice system irq softirq steal (indices after the "cpu" label)


def machine_cpu_s(path: str = PROC_STAT) -> float | None:
    """Busy CPU-seconds of all cores since boot, or None where ``/proc/stat`` is unreadable."""
    try:
        with open(path) as f:
            line = f.readline()
    except OSError:
        return None
    parts = line.split()
    if not parts or parts[0] != "cpu":
        return None
    ticks = [int(x) for x in parts[1:]]
    busy = sum(ticks[i] for i in _BUSY_FIELDS if i < len(ticks))
    return busy / os.sysconf("SC_CLK_TCK")


def cpu_s_per_gb(cpu_s: float | None, delivered_bytes: int) -> float | None:
    """CPU-seconds per delivered gigabyte (10^9 bytes); None when either figure is missing."""
    if cpu_s is None or delivered_bytes <= 0:
        return None
    return cpu_s / (delivered_bytes / 1e9)
