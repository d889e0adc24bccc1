"""Scapy layer for the LTP wire format (docs/protocol.md), version 1.

Theory of operation
    One class, :class:`LTPT` ("LTP transport"; scapy's own ``LTP`` is the Licklider
    Transmission Protocol and is left alone), covers the 16-byte common header and all five
    packet types. The two type-specific header words and the body are ConditionalFields keyed
    on ``type``, so a packet shows exactly the fields of its type:

        DATA  seq(24) attempt(8) | rtprop(uf16) btlbw(uf16) | payload (scapy Raw)
        REG   seq(24, always 0) attempt(8) | rtprop btlbw | total(64) segment_size(16)
              element_size(16) segment_count(32) tag(64) mode(8) reserved(8)
              range_count(16) timestamp(64, µs since the Unix epoch)
              ranges[range_count] (first(32), end(32)) [mac(16 B) if flag MAC]
        ACK   held(32) | ack_delay(uf16) count(16) | [grant(uf16, bytes/s) grant_reserved(16) if flag
              GRANT] entries[count] (u32: seq << 8 | attempt)
        STOP  held(32) | close_reason(8) reserved(24)
        RESET reset_reason(32) | reset_attempt(32: for stale, the refused REG's attempt; else 0)

    ``count`` and ``range_count`` are computed when left as None. ``uf16`` fields hold the
    raw 16-bit code; :func:`uf16_encode`/:func:`uf16_decode` convert, and the fields display
    the decoded value. UDP port 7447 in either direction dissects as LTPT.
"""
from __future__ import annotations

from scapy.fields import (BitEnumField, BitField, ByteEnumField, ByteField, ConditionalField, FieldLenField,
                          FieldListField, FlagsField, IntEnumField, IntField, LongField, PacketListField,
                          ShortField, XIntField, XStrFixedLenField)
import struct

from scapy.error import Scapy_Exception
from scapy.layers.inet import UDP
from scapy.packet import Packet, bind_layers

LTP_PORT = 7447
HEADER_LEN = 16  # bytes
MAC_LEN = 16  # bytes (HMAC-SHA256 truncated)
HEADER_LEN = 16  # bytes: the common header, words 1-4 (docs/protocol.md)
REG_BODY_LEN = 36  # bytes of a REG after the header, before its ranges and MAC
MAX_ACK_ENTRIES = 364
MAX_CRITICAL_RANGES = 160

TYPES = {0: "REG", 1: "DATA", 2: "ACK", 3: "STOP", 4: "RESET"}
REG, DATA, ACK, STOP, RESET = 0, 1, 2, 3, 4
FLAG_NAMES = ["CRITICAL", "RELIABLE", "MAC", "GRANT", "bit4", "bit5", "bit6", "bit7"]
FLAG_CRITICAL, FLAG_RELIABLE, FLAG_MAC, FLAG_GRANT = 0x01, 0x02, 0x04, 0x08
MODES = {0: "loss-tolerant", 1: "reliable"}
CLOSE_REASONS = {1: "complete", 2: "early", 3: "deadline", 4: "cancelled"}
RESET_REASONS = {1: "too_large", 2: "too_many_flows", 3: "out_of_memory", 4: "unauthenticated",
                 5: "bad_registration", 6: "cancelled", 7: "shutdown", 8: "stale", 9: "unregistered"}

UF16_MAX = 2047 << 31


def uf16_encode(value: int) -> int:
    """Encode a non-negative integer as uf16 (5-bit exponent e, 11-bit mantissa m, value m << e), rounding down.

    Values above the range saturate to 0xFFFF (2047 * 2**31).
    """
    value = int(value)
    if value < 0:
        raise ValueError(f"uf16 encodes non-negative values, got {value}")
    if value >= UF16_MAX:
        return 0xFFFF
    e = max(0, value.bit_length() - 11)
    return (e << 11) | (value >> e)


def uf16_decode(code: int) -> int:
    """Decode a 16-bit uf16 code: ``(code & 0x7FF) << (code >> 11)``."""
    if not 0 <= code <= 0xFFFF:
        raise ValueError(f"uf16 code must fit 16 bits, got {code}")
    return (code & 0x7FF) << (code >> 11)


class UF16Field(ShortField):
    """A 16-bit uf16 code; displayed as its decoded value."""

    def i2repr(self, pkt, x):
        return "None" if x is None else f"{uf16_decode(x)} (uf16 0x{x:04x})"


class LTPTRange(Packet):
    """A critical range of a REG: half-open segment range [first, end)."""

    name = "LTPT critical range"
    fields_desc = [IntField("first", 0), IntField("end", 0)]

    def extract_padding(self, s):
        return b"", s


def _is(*types):
    return lambda p: p.type in types


class LTPT(Packet):
    """LTP (loss-tolerant transport) datagram: common header plus the fields of its type."""

    name = "LTP transport"
    fields_desc = [
        BitField("version", 1, 4),
        BitEnumField("type", DATA, 4, TYPES),
        FlagsField("flags", 0, 8, FLAG_NAMES),
        ShortField("flow_id", 0),
        XIntField("token", 0),
        # word 2
        ConditionalField(BitField("seq", 0, 24), _is(DATA, REG)),
        ConditionalField(ByteField("attempt", 0), _is(DATA, REG)),
        ConditionalField(IntField("held", 0), _is(ACK, STOP)),
        ConditionalField(IntEnumField("reset_reason", 0, RESET_REASONS), _is(RESET)),
        # word 3
        ConditionalField(UF16Field("rtprop", 0), _is(DATA, REG)),
        ConditionalField(UF16Field("btlbw", 0), _is(DATA, REG)),
        ConditionalField(UF16Field("ack_delay", 0), _is(ACK)),
        ConditionalField(FieldLenField("count", None, fmt="H", count_of="entries"), _is(ACK)),
        ConditionalField(ByteEnumField("close_reason", 0, CLOSE_REASONS), _is(STOP)),
        ConditionalField(BitField("stop_reserved", 0, 24), _is(STOP)),
        ConditionalField(IntField("reset_attempt", 0), _is(RESET)),
        # REG body
        ConditionalField(LongField("total", 0), _is(REG)),
        ConditionalField(ShortField("segment_size", 0), _is(REG)),
        ConditionalField(ShortField("element_size", 1), _is(REG)),
        ConditionalField(IntField("segment_count", 0), _is(REG)),
        ConditionalField(LongField("tag", 0), _is(REG)),
        ConditionalField(ByteEnumField("mode", 0, MODES), _is(REG)),
        ConditionalField(ByteField("reg_reserved", 0), _is(REG)),
        ConditionalField(FieldLenField("range_count", None, fmt="H", count_of="ranges"), _is(REG)),
        ConditionalField(LongField("timestamp", 0), _is(REG)),
        ConditionalField(PacketListField("ranges", [], LTPTRange, count_from=lambda p: p.range_count), _is(REG)),
        ConditionalField(XStrFixedLenField("mac", b"\x00" * MAC_LEN, MAC_LEN),
                         lambda p: p.type == REG and int(p.flags) & FLAG_MAC),
        # ACK body: the receiver's rate grant (flag GRANT), then the entries
        ConditionalField(UF16Field("grant", 0), lambda p: p.type == ACK and int(p.flags) & FLAG_GRANT),
        ConditionalField(ShortField("grant_reserved", 0), lambda p: p.type == ACK and int(p.flags) & FLAG_GRANT),
        ConditionalField(FieldListField("entries", [], XIntField("entry", 0), count_from=lambda p: p.count),
                         _is(ACK)),
    ]

    malformed: str | None = None  # why the bytes did not parse (truncated, absurd counts); None when they did

    def do_dissect(self, s):
        """As scapy's, but a truncated or absurd datagram never raises (as LTP's own codec drops and counts it): the
        fields parsed so far stay, the rest of the bytes become the payload, ``malformed`` says why."""
        try:
            rest = super().do_dissect(s)
        except (struct.error, Scapy_Exception) as exc:
            self.malformed = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            return s if isinstance(s, bytes) else b""
        need = self._wire_length()  # scapy stops quietly at the end of the bytes, leaving defaults: say so
        if len(s) < need:
            self.malformed = f"truncated: {len(s)} of {need} bytes"
        return rest

    def _wire_length(self) -> int:
        """Bytes this datagram's header and body take on the wire (DATA: the header only)."""
        n = HEADER_LEN
        if self.type == REG:
            n += REG_BODY_LEN + 8 * (self.range_count or 0) + (MAC_LEN if int(self.flags) & FLAG_MAC else 0)
        elif self.type == ACK:
            n += 4 * (self.count or 0) + (4 if int(self.flags) & FLAG_GRANT else 0)
        return n

    def acked(self) -> list[tuple[int, int]]:
        """ACK entries as (seq, attempt) pairs."""
        return [(e >> 8, e & 0xFF) for e in (self.entries or [])] if self.type == ACK else []

    def mysummary(self):
        t = TYPES.get(self.type, f"type{self.type}")
        fl = f" [{self.sprintf('%flags%')}]" if int(self.flags) else ""
        head = f"LTPT {t} flow={self.flow_id} token={self.token:#010x}{fl}"
        if self.version != 1:
            head += f" version={self.version}"
        if self.malformed:
            return f"{head} MALFORMED ({self.malformed})"
        if self.type == DATA:
            n = len(self.payload) if self.payload else 0
            return f"{head} seq={self.seq} att={self.attempt} len={n}"
        if self.type == REG:
            return (f"{head} att={self.attempt} total={self.total} seg={self.segment_size} "
                    f"elem={self.element_size} nseg={self.segment_count} tag={self.tag} "
                    f"mode={MODES.get(self.mode, self.mode)} ranges={len(self.ranges or [])} "
                    f"ts={self.timestamp}")
        if self.type == ACK:
            ents = self.acked()
            shown = " ".join(f"{s}/{a}" for s, a in ents[:8]) + (" ..." if len(ents) > 8 else "")
            grant = f" grant={uf16_decode(self.grant)}B/s" if int(self.flags) & FLAG_GRANT else ""
            return (f"{head} held={self.held} delay={uf16_decode(self.ack_delay)}us{grant} n={len(ents)} "
                    f"[{shown}]")
        if self.type == STOP:
            return f"{head} held={self.held} reason={CLOSE_REASONS.get(self.close_reason, self.close_reason)}"
        if self.type == RESET:
            return f"{head} reason={RESET_REASONS.get(self.reset_reason, self.reset_reason)}"
        return head

    def guess_payload_class(self, payload):
        from scapy.packet import Padding, Raw
        return Raw if self.type == DATA else Padding


# Either port dissects as LTPT. Order matters for building: the last bind_layers decides the
# fields UDP()/LTPT() fills in, and a sender addresses the receiver's well-known port (dport).
bind_layers(UDP, LTPT, sport=LTP_PORT)
bind_layers(UDP, LTPT, dport=LTP_PORT)


def dissect_pcap(path: str, port: int = LTP_PORT, out=None, stats: dict | None = None) -> int:
    """Print one line per LTP packet found in the pcap/pcapng ``path``; return how many were printed.

    A ``port`` other than 7447 is bound for the duration of the call.  Malformed datagrams (truncated by the
    capture's snap length, absurd counts) are printed as such and counted in ``stats["malformed"]``, never
    skipped silently.  A file that is not a capture raises ``ValueError``.
    """
    import sys

    from scapy.layers.inet import IP
    from scapy.utils import PcapReader

    out = out or sys.stdout
    extra = port != LTP_PORT
    if extra:
        bind_layers(UDP, LTPT, sport=port)
        bind_layers(UDP, LTPT, dport=port)
    if not 0 < port < 65536:
        raise ValueError(f"port {port} is not a UDP port (1..65535)")
    n = 0
    stats = stats if stats is not None else {}
    stats.setdefault("malformed", 0)
    try:
        try:
            rd = PcapReader(path)
        except Scapy_Exception as exc:
            raise ValueError(f"{path} is not a pcap or pcapng capture ({exc})") from None
        with rd:
            for i, pkt in enumerate(rd):
                if LTPT not in pkt:
                    continue
                ip = pkt[IP] if IP in pkt else None
                udp = pkt[UDP]
                where = f"{ip.src}:{udp.sport} > {ip.dst}:{udp.dport}" if ip else f"{udp.sport} > {udp.dport}"
                print(f"{i + 1} {float(pkt.time):.6f} {where} {pkt[LTPT].mysummary()}", file=out)
                n += 1
                stats["malformed"] += bool(pkt[LTPT].malformed)
    finally:
        if extra:
            from scapy.packet import split_layers
            split_layers(UDP, LTPT, dport=port)
            split_layers(UDP, LTPT, sport=port)
    return n
