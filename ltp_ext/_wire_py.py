"""LTP wire codec, pure-Python twin of ``ltp_ext._wire`` (see docs/protocol.md).

Theory of operation: every datagram starts with a 16-byte header
``(version|type, flags, flow_id, token, word2, word3)``. The functions here only
translate between bytes and integers and validate what can be validated
without protocol state; they raise :class:`ltp_ext.errors.WireError` whose
``reason`` is the drop counter key. Nothing here allocates more than the
datagram it is given.
"""

from __future__ import annotations

import struct

import numpy as np

from .errors import WireError

VERSION = 1
HEADER_SIZE = 16
T_REG = 0
T_DATA = 1
T_ACK = 2
T_STOP = 3
T_RESET = 4
F_CRITICAL = 0x01
F_RELIABLE = 0x02
F_MAC = 0x04
F_KNOWN = F_CRITICAL | F_RELIABLE | F_MAC
F_GRANT = 0x08  # ACK only: a grant word (the receiver's rate grant to this sender) follows the header
MAC_SIZE = 16
REG_FIXED_SIZE = 36
MAX_ACK_ENTRIES = 364
MAX_RANGES = 160
MAX_SEQ = (1 << 24) - 1

_HDR = struct.Struct("!BBHIII")
_REG = struct.Struct("!QHHIQBBHQ")
_RANGE = struct.Struct("!II")
_GRANT = struct.Struct("!I")


def uf16_encode(value: int) -> int:
    """Encode a non-negative integer as the 16-bit mini-float (rounds down, saturates)."""
    v = int(value)
    if v <= 0:
        return 0
    if v < 2048:
        return v
    e = v.bit_length() - 11
    if e > 31:
        return 0xFFFF
    return (e << 11) | (v >> e)


def uf16_decode(code: int) -> int:
    """Decode the 16-bit mini-float."""
    code = int(code) & 0xFFFF
    return (code & 0x7FF) << (code >> 11)


def pack_header(ptype: int, flags: int, flow_id: int, token: int, word2: int, word3: int) -> bytes:
    """Return the 16-byte header."""
    return _HDR.pack((VERSION << 4) | ptype, flags, flow_id, token, word2, word3)


def pack_header_into(buf, offset: int, ptype: int, flags: int, flow_id: int, token: int,
                     word2: int, word3: int) -> None:
    """Write the 16-byte header into ``buf`` at ``offset``."""
    _HDR.pack_into(buf, offset, (VERSION << 4) | ptype, flags, flow_id, token, word2, word3)


def unpack_header(buf, offset: int = 0) -> tuple:
    """Decode a header: ``(type, flags, flow_id, token, word2, word3)``.

    Raises WireError ``truncated``, ``bad_version``, ``bad_type`` or ``bad_flags``.
    """
    if len(buf) - offset < HEADER_SIZE:
        raise WireError("truncated", "shorter than the 16-byte header")
    b0, flags, flow_id, token, word2, word3 = _HDR.unpack_from(buf, offset)
    if b0 >> 4 != VERSION:
        raise WireError("bad_version", f"version {b0 >> 4}")
    ptype = b0 & 0x0F
    if ptype > T_RESET:
        raise WireError("bad_type", f"type {ptype}")
    if flags & ~(F_KNOWN | F_GRANT) or (flags & F_GRANT and ptype != T_ACK):
        raise WireError("bad_flags", f"flags {flags:#x}")
    return ptype, flags, flow_id, token, word2, word3


def estimates_word(rtprop_us: int, btlbw_bps: int) -> int:
    """Word 3 of DATA/REG: RTprop (µs) and BtlBw (bytes/s) as two uf16."""
    return (uf16_encode(rtprop_us) << 16) | uf16_encode(btlbw_bps)


def split_estimates(word3: int) -> tuple:
    """Inverse of :func:`estimates_word`: ``(rtprop_us, btlbw_bps)``."""
    return uf16_decode(word3 >> 16), uf16_decode(word3 & 0xFFFF)


def pack_reg_body(total: int, segment_size: int, element_size: int, segment_count: int,
                  tag: int, mode: int, ranges, timestamp_us: int = 0) -> bytes:
    """Encode the REG body without the MAC (append it separately when keyed).

    ``timestamp_us`` is the sender's wall clock (µs since the Unix epoch) when
    this copy of the REG was sent: the freshness the MAC binds (docs/protocol.md).
    """
    ranges = list(ranges)
    if len(ranges) > MAX_RANGES:
        raise WireError("too_many_ranges", f"{len(ranges)} > {MAX_RANGES}")
    parts = [_REG.pack(total, segment_size, element_size, segment_count, tag, mode, 0, len(ranges),
                       timestamp_us)]
    parts.extend(_RANGE.pack(a, b) for a, b in ranges)
    return b"".join(parts)


def unpack_reg_body(buf, offset: int, has_mac: bool) -> tuple:
    """Decode a REG body at ``offset``.

    Returns ``(total, segment_size, element_size, segment_count, tag, mode,
    ranges, mac, mac_end, timestamp_us)`` where ``mac`` is None without the MAC flag and
    ``mac_end`` is the offset where MAC coverage ends. Validates sizes and the
    range list (sorted, non-overlapping, inside the message); raises WireError
    ``truncated``, ``bad_registration`` or ``trailing_bytes``.
    """
    n = len(buf)
    if n - offset < REG_FIXED_SIZE:
        raise WireError("truncated", "registration body")
    total, seg, elem, count, tag, mode, _res, nr, stamp = _REG.unpack_from(buf, offset)
    pos = offset + REG_FIXED_SIZE
    need = nr * 8 + (MAC_SIZE if has_mac else 0)
    if nr > MAX_RANGES or n - pos < need:
        raise WireError("truncated", "registration ranges")
    if n - pos > need:
        raise WireError("trailing_bytes", "registration")
    if seg == 0 or elem == 0 or seg % elem or total == 0 or mode > 1:
        raise WireError("bad_registration", "sizes or mode")
    if count != (total + seg - 1) // seg or count > MAX_SEQ + 1:
        raise WireError("bad_registration", "segment count")
    ranges = []
    prev = 0
    for _ in range(nr):
        a, b = _RANGE.unpack_from(buf, pos)
        pos += 8
        if a < prev or b <= a or b > count:
            raise WireError("bad_registration", "critical ranges")
        ranges.append((a, b))
        prev = b
    mac = bytes(buf[pos:pos + MAC_SIZE]) if has_mac else None
    return total, seg, elem, count, tag, mode, ranges, mac, pos, stamp


def pack_ack(flow_id: int, token: int, received: int, ack_delay_us: int, entries, grant: int = 0) -> bytes:
    """Encode one ACK datagram; ``entries`` are ``seq << 8 | attempt`` integers (<= 364).

    ``grant`` > 0 (bytes/s, the receiver's rate grant to this sender, sent as ``uf16``)
    sets ``F_GRANT`` and adds the grant word after the header, leaving room for one
    entry fewer (363)."""
    entries = np.asarray(entries, dtype=np.uint32)
    n = int(entries.shape[0])
    g = int(grant)
    cap = MAX_ACK_ENTRIES - 1 if g > 0 else MAX_ACK_ENTRIES
    if n > cap:
        raise WireError("too_many_entries", f"{n} > {cap}")
    word3 = (uf16_encode(ack_delay_us) << 16) | n
    if g > 0:
        return (pack_header(T_ACK, F_GRANT, flow_id, token, received & 0xFFFFFFFF, word3)
                + _GRANT.pack(uf16_encode(g) << 16) + entries.astype(">u4").tobytes())
    return pack_header(T_ACK, 0, flow_id, token, received & 0xFFFFFFFF, word3) + entries.astype(">u4").tobytes()


def ack_grant(buf, flags: int, offset: int = 0) -> int:
    """The rate grant (bytes/s) an ACK carries; 0 without ``F_GRANT``.

    Raises WireError ``truncated`` (no room for the grant word) or ``bad_grant``
    (its reserved low 16 bits are not zero, or it grants nothing)."""
    if not int(flags) & F_GRANT:
        return 0
    start = offset + HEADER_SIZE
    if len(buf) - start < 4:
        raise WireError("truncated", "ACK flagged GRANT without its grant word")
    (word,) = _GRANT.unpack_from(buf, start)
    if word & 0xFFFF:
        raise WireError("bad_grant", "reserved bits of the grant word are set")
    grant = uf16_decode(word >> 16)
    if grant == 0:
        raise WireError("bad_grant", "a zero grant")
    return grant


def unpack_ack_entries(buf, word3: int, offset: int = 0, flags: int = 0) -> np.ndarray:
    """Return the ACK entries as a native uint32 array; checks the length matches the count.

    ``flags`` (the header's): with ``F_GRANT`` the entries start after the grant word."""
    n = word3 & 0xFFFF
    start = offset + HEADER_SIZE + (4 if int(flags) & F_GRANT else 0)
    if n > MAX_ACK_ENTRIES or len(buf) - start != 4 * n:
        raise WireError("bad_length", "ACK entry count does not match datagram length")
    return np.frombuffer(buf, dtype=">u4", count=n, offset=start).astype(np.uint32)
