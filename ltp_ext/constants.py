"""Protocol thresholds the data-path kernels share, named once.

Both ``ltp_ext._datapath`` and its twin ``ltp_ext._datapath_py`` read them
from here (the compiled module copies them into C variables at import).
"""

from __future__ import annotations

__all__ = ["PACKET_REORDER_THRESHOLD", "SEND_BATCH_MIN"]

#: packet-reordering threshold (packets): a transmission is declared lost once this many
#: transmissions sent after it have been acknowledged (the "3 out of order" rule of TCP/QUIC).
#: LTP's paths do not reorder, so 3 only absorbs the rare reordering of a multi-queue NIC.
PACKET_REORDER_THRESHOLD = 3

#: a send window's first table of send batches (one entry per ``SendWindow.build`` call: its send time and
#: delivery-rate snapshot), doubled as needed
SEND_BATCH_MIN = 64
