"""Protocol thresholds the data-path kernels share, named once.

Both ``ltp_ext._datapath`` and its twin ``ltp_ext._datapath_py`` read them
from here (the compiled module copies them into C variables at import).
"""

from __future__ import annotations

__all__ = ["PACKET_REORDER_THRESHOLD", "SEND_BATCH_MIN", "SEND_PACE_CREDIT_S", "SEND_THREADS_MAX", "SEND_QUEUE_DEPTH",
           "SPREAD_PART_MIN", "STREAM_COPY_MIN"]

#: packet-reordering threshold (packets): a transmission is declared lost once this many
#: transmissions sent after it have been acknowledged (the "3 out of order" rule of TCP/QUIC).
#: LTP's paths do not reorder, so 3 only absorbs the rare reordering of a multi-queue NIC.
PACKET_REORDER_THRESHOLD = 3

#: a send window's first table of send batches (one entry per ``SendWindow.build`` call: its send time and
#: delivery-rate snapshot), doubled as needed
SEND_BATCH_MIN = 64

#: most sender threads one ``UdpIO`` runs (``send_threads``; ``Config.send_threads``)
SEND_THREADS_MAX = 8

#: packets: the smallest lane (part) of a batch that ``Config.spread_sends`` gives a sender thread of its own
#: (``ltp.path.spread_parts``: a batch of ``n`` packets is built in ``min(send_threads, n // SPREAD_PART_MIN)``
#: lanes, or in one below two); a part that small is still a few full GSO messages
SPREAD_PART_MIN = 128

#: batches (``UdpIO.send_segments`` calls) one sender thread holds queued; the next call to it waits for one to
#: finish (16 pacing ticks of sends: the thread is never starved, and the caller never runs far ahead of the wire)
SEND_QUEUE_DEPTH = 16

#: seconds: a sender thread pacing a batch (``send_segments(pace_rate=...)``) that runs behind its timeline sends
#: at once, back to back, until it has caught up by at most this much time; lateness beyond it is forgiven. A
#: thread on a busy host is descheduled for longer than a sub-burst's gap (0.2 ms), and without credit each such
#: delay is rate lost for good: the sender's delivery-rate samples fall below its pacing rate and BBR's BtlBw
#: spirals down (measured on the lab's tbf path with a credit of one sub-burst: 0.19-0.55 Gbit/s of 1).  One
#: loop tick of credit is the burst the event loop's own pacer would have sent anyway.
SEND_PACE_CREDIT_S = 0.001

#: bytes: a receive window at least this large copies payloads into its message with streaming (non-temporal)
#: stores where the CPU has them (x86-64).  A message this size does not stay in the caches until it is read,
#: and an ordinary store first reads every destination line from memory (a read for ownership); a streaming
#: store writes whole lines without reading them.  Smaller messages are copied through the caches, where the
#: reader will find them.
STREAM_COPY_MIN = 8 << 20
