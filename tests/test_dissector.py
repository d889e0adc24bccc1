"""Scapy LTPT layer against the byte layout of docs/protocol.md (built by hand with struct)."""
import io
import struct

import pytest
from hypothesis import given, settings, strategies as st
from scapy.layers.inet import IP, UDP
from scapy.packet import Raw
from scapy.utils import wrpcap

from ltp_tools.dissector import (ACK, DATA, LTP_PORT, LTPT, REG, RESET, STOP, LTPTRange, dissect_pcap,
                                 uf16_decode, uf16_encode)

pytestmark = pytest.mark.timeout(60)


def hdr(typ, flags, flow, token, w2, w3, version=1):
    return struct.pack("!BBHIII", (version << 4) | typ, flags, flow, token, w2, w3)


def test_uf16_known_values():
    assert uf16_encode(0) == 0
    assert uf16_encode(2047) == 2047                       # e = 0: exact
    assert uf16_encode(2048) == (1 << 11) | 1024           # 1024 << 1
    assert uf16_encode(10000) == (3 << 11) | 1250          # 1250 << 3 = 10000
    assert uf16_encode(10001) == (3 << 11) | 1250          # rounds down
    assert uf16_decode(0xFFFF) == 2047 << 31
    assert uf16_encode(10**15) == 0xFFFF                   # saturates
    with pytest.raises(ValueError):
        uf16_encode(-1)


@given(st.integers(min_value=0, max_value=(2047 << 31)))
def test_uf16_roundtrip_rounds_down_within_precision(v):
    d = uf16_decode(uf16_encode(v))
    assert d <= v
    assert v - d <= v / 1024 if v >= 2048 else d == v


def test_data_bytes():
    p = LTPT(type=DATA, flags="CRITICAL", flow_id=0x0102, token=0xDEADBEEF, seq=0x123456, attempt=7,
             rtprop=uf16_encode(10_000), btlbw=uf16_encode(125_000_000)) / b"payload"
    want = hdr(1, 0x01, 0x0102, 0xDEADBEEF, (0x123456 << 8) | 7,
               (uf16_encode(10_000) << 16) | uf16_encode(125_000_000)) + b"payload"
    assert bytes(p) == want
    q = LTPT(want)
    assert (q.version, q.type, int(q.flags), q.flow_id, q.token) == (1, DATA, 1, 0x0102, 0xDEADBEEF)
    assert (q.seq, q.attempt, uf16_decode(q.rtprop)) == (0x123456, 7, 10_000)
    assert bytes(q[Raw]) == b"payload"
    assert "DATA" in q.mysummary() and "seq=1193046" in q.mysummary() and "len=7" in q.mysummary()


def test_reg_bytes_with_ranges_and_mac():
    mac = bytes(range(16))
    p = LTPT(type=REG, flags="RELIABLE+MAC", flow_id=9, token=0x01020304, attempt=2,
             total=100_000, segment_size=1456, element_size=4, segment_count=69, tag=42, mode=1,
             ranges=[LTPTRange(first=0, end=3), LTPTRange(first=10, end=12)], mac=mac,
             timestamp=1_790_000_000_123_456)
    body = struct.pack("!QHHIQBBHQ", 100_000, 1456, 4, 69, 42, 1, 0, 2, 1_790_000_000_123_456) + \
        struct.pack("!IIII", 0, 3, 10, 12)
    want = hdr(0, 0x06, 9, 0x01020304, 2, 0) + body + mac
    assert bytes(p) == want
    q = LTPT(want)
    assert q.range_count == 2 and [(r.first, r.end) for r in q.ranges] == [(0, 3), (10, 12)]
    assert q.mac == mac and q.segment_count == 69 and q.tag == 42 and q.mode == 1
    assert q.timestamp == 1_790_000_000_123_456 and "ts=1790000000123456" in q.mysummary()
    assert len(q.payload) == 0   # the MAC ends the packet


def test_reg_without_mac_has_no_mac_field():
    p = LTPT(type=REG, flow_id=1, token=2, total=10, segment_size=8, element_size=4, segment_count=2)
    raw = bytes(p)
    assert len(raw) == 16 + 36
    assert raw[16:] == struct.pack("!QHHIQBBHQ", 10, 8, 4, 2, 0, 0, 0, 0, 0)
    q = LTPT(raw)
    assert q.mac is None and len(q.payload) == 0


def test_ack_bytes_and_entries():
    p = LTPT(type=ACK, flow_id=7, token=0xAABBCCDD, held=3, ack_delay=uf16_encode(250),
             entries=[(5 << 8) | 1, (6 << 8) | 2, (0xFFFFFF << 8) | 255])
    want = hdr(2, 0, 7, 0xAABBCCDD, 3, (uf16_encode(250) << 16) | 3) + struct.pack("!III", 0x501, 0x602, 0xFFFFFFFF)
    assert bytes(p) == want
    q = LTPT(want)
    assert q.count == 3 and q.acked() == [(5, 1), (6, 2), (0xFFFFFF, 255)]
    assert "n=3" in q.mysummary() and "5/1" in q.mysummary()
    empty = LTPT(hdr(2, 0, 7, 1, 0, 0))  # N = 0 confirms a registration
    assert empty.count == 0 and empty.acked() == []


def test_stop_and_reset_bytes():
    s = LTPT(type=STOP, flow_id=1, token=2, held=69, close_reason=2)
    assert bytes(s) == hdr(3, 0, 1, 2, 69, 2 << 24)
    assert "reason=early" in LTPT(bytes(s)).mysummary()
    r = LTPT(type=RESET, flow_id=1, token=2, reset_reason=5)
    assert bytes(r) == hdr(4, 0, 1, 2, 5, 0)
    assert "bad_registration" in LTPT(bytes(r)).mysummary()


def test_udp_binding_both_ports():
    ack = LTPT(type=ACK, flow_id=1, token=2, entries=[0x100])
    built = IP(src="10.0.0.1", dst="10.0.0.2") / UDP(sport=40000) / ack
    assert IP(bytes(built))[UDP].dport == LTP_PORT
    back = IP(bytes(IP(src="10.0.0.2", dst="10.0.0.1") / UDP(sport=LTP_PORT, dport=40001) / Raw(bytes(ack))))
    assert LTPT in back and back[LTPT].acked() == [(1, 0)]
    other = IP(bytes(IP() / UDP(sport=1000, dport=2000) / Raw(bytes(ack))))
    assert LTPT not in other


def test_dissect_pcap_and_cli(tmp_path, capsys):
    pkts = [IP(src="10.77.0.2", dst="10.77.0.1") / UDP(sport=40000, dport=LTP_PORT) /
            LTPT(type=DATA, flow_id=3, token=9, seq=i, attempt=1) / (b"x" * 100) for i in range(3)]
    pkts.append(IP(src="10.77.0.1", dst="10.77.0.2") / UDP(sport=LTP_PORT, dport=40000) /
                LTPT(type=ACK, flow_id=3, token=9, held=3, entries=[0x001, 0x101, 0x201]))
    pkts.append(IP() / UDP(sport=53, dport=53) / Raw(b"not ltp"))
    path = tmp_path / "cap.pcap"
    wrpcap(str(path), pkts)
    buf = io.StringIO()
    assert dissect_pcap(str(path), out=buf) == 4
    lines = buf.getvalue().splitlines()
    assert len(lines) == 4 and "DATA" in lines[0] and "seq=2" in lines[2] and "ACK" in lines[3]
    assert "10.77.0.2:40000 > 10.77.0.1:7447" in lines[0]
    from ltp_tools.cli import main
    assert main(["dissect", str(path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 4 and "n=3" in out[3]


def test_reset_reasons_of_admission():
    for code, name in ((8, "stale"), (9, "unregistered")):
        raw = bytes(LTPT(type=RESET, flow_id=1, token=2, reset_reason=code))
        assert raw[8:12] == code.to_bytes(4, "big") and f"reason={name}" in LTPT(raw).mysummary()


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=80))
def test_any_bytes_dissect_without_raising(b):
    """Truncated or absurd datagrams never raise (as LTP's own codec, which drops and counts them): the summary
    says MALFORMED instead (before: struct.error from scapy's fields on 1,429 of 3,000 short inputs)."""
    p = LTPT(b)
    line = p.mysummary()
    repr(p)
    p.show(dump=True)
    assert (p.malformed is None) == ("MALFORMED" not in line)


def test_a_truncated_datagram_in_a_capture_is_shown_and_counted(tmp_path):
    whole = IP(src="10.0.0.1", dst="10.0.0.2") / UDP(sport=40000, dport=LTP_PORT) / LTPT(type=REG, total=1000)
    from scapy.utils import PcapWriter

    pcap = tmp_path / "t.pcap"
    with PcapWriter(str(pcap), linktype=228) as w:  # raw IPv4 frames, written as bytes (not rebuilt by scapy)
        w.write(bytes(whole))
        w.write(bytes(whole)[:20 + 8 + 10])  # a capture whose snap length cut the REG short
    out, stats = io.StringIO(), {}
    assert dissect_pcap(str(pcap), out=out, stats=stats) == 2
    assert stats["malformed"] == 1 and "MALFORMED" in out.getvalue().splitlines()[1]


def test_dissect_refuses_what_is_not_a_capture(tmp_path):
    junk = tmp_path / "junk.pcap"
    junk.write_bytes(b"not a capture at all")
    with pytest.raises(ValueError, match="not a pcap"):
        dissect_pcap(str(junk))
    with pytest.raises(ValueError, match="not a UDP port"):
        dissect_pcap(str(junk), port=70000)
