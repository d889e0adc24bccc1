"""Bubble filling (§III-C): what a receiver writes where data did not arrive.

* **Packet bubbles**: a segment that was not delivered is filled with zeros,
  exactly its own length (the receiver knows every segment's length from the
  registration, so it never guesses it from neighbouring packets).
* **Padding bubbles**: segment payloads are a whole number of elements, so a
  float is never split across two packets and one lost packet can never
  corrupt half of a value. The few bytes of packet room that do not hold a
  whole element are left unused: that is the padding bubble.

These helpers turn segment runs into exact byte ranges for reports.
"""

from __future__ import annotations

__all__ = ["segment_geometry", "bubble_byte_ranges", "critical_mask"]

import numpy as np

from .errors import LocalProtocolError


def segment_geometry(room: int, element_size: int) -> tuple:
    """``(segment_size, padding)`` for ``room`` payload bytes per packet."""
    if element_size <= 0:
        raise LocalProtocolError("element_size must be a positive number of bytes (4 for float32)")
    seg = room - room % element_size
    if seg <= 0:
        raise LocalProtocolError(f"an element of {element_size} bytes does not fit a packet of {room} bytes")
    return seg, room - seg


def bubble_byte_ranges(missing_runs, segment_size: int, total: int) -> list:
    """Byte ranges ``[(start, end), ...]`` covered by the missing segment runs."""
    out = []
    for a, b in missing_runs:
        out.append((a * segment_size, min(b * segment_size, total)))
    return out


def critical_mask(byte_ranges, total: int, segment_size: int) -> tuple:
    """Segment mask (uint8) and merged segment ranges for critical byte ranges.

    Every segment overlapping a critical byte range is critical. Raises
    LocalProtocolError for a range outside the buffer.
    """
    count = (total + segment_size - 1) // segment_size
    mask = np.zeros(count, np.uint8)
    if isinstance(byte_ranges, (tuple, list)) and not byte_ranges:  # the common case (every gradient, every small message): nothing critical
        return mask, []
    spans = []
    for rng in byte_ranges:
        try:
            raw_start, raw_end = rng
            start, end = int(raw_start), int(raw_end)
        except (TypeError, ValueError, OverflowError):
            raise LocalProtocolError("critical ranges must be (start, end) byte pairs") from None
        if start != raw_start or end != raw_end:  # int() would truncate: (0.5, 10) is not a byte range
            raise LocalProtocolError(f"critical range {tuple(rng)!r} is not whole bytes; pass integer offsets")
        if not 0 <= start < end <= total:
            raise LocalProtocolError(
                f"critical range ({start}, {end}) is outside the {total}-byte buffer; use 0 <= start < end <= len")
        spans.append((start // segment_size, (end - 1) // segment_size + 1))
    # merge the segment spans in Python: a message names a few ranges, and numpy's per-call cost on a
    # mask scan was most of a small message's set-up (docs/performance.md, session 53)
    spans.sort()
    runs = []
    for a, b in spans:
        if runs and a <= runs[-1][1]:  # overlapping or adjacent: one run
            if b > runs[-1][1]:
                runs[-1] = (runs[-1][0], b)
        else:
            runs.append((a, b))
    for a, b in runs:
        mask[a:b] = 1
    return mask, runs
