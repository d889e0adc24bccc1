"""The scapy layer and the ltp codec check each other: real engine datagrams dissect, scapy builds decode."""

from __future__ import annotations

import random

import numpy as np
import pytest

pytest.importorskip("scapy")

from ltp import wire  # noqa: E402
from ltp.config import Config  # noqa: E402
from ltp.engine import Engine  # noqa: E402
from ltp_tools.dissector import LTPT, LTPTRange  # noqa: E402

PEER = ("10.0.0.2", 7447)


def _engine_datagrams(job_key=None):
    """REG and DATA from a sender engine, ACK and STOP from a receiver engine."""
    snd = Engine(Config(job_key=job_key), rng=random.Random(1), local_addr=("10.0.0.1", 7447))
    rcv = Engine(Config(job_key=job_key), rng=random.Random(2), local_addr=PEER)
    data = np.arange(1800, dtype=np.float32)  # 5 packets: within the first burst of a new path
    snd.send(PEER, data, now=0.0, critical=[(0, 100), (6000, 7000)], tag=77, reliable=False)
    out = []
    for k in range(5):  # a short critical last segment ends the first GSO batch; drain the rest
        out += [bytes(d) for tx in snd.datagrams_to_send(k * 1e-4) for d in tx.datagrams()]
    rcv.post_receive([(None, None, np.zeros_like(data))], now=0.0)
    for d in out:
        rcv.receive_datagram(d, ("10.0.0.1", 7447), 0.001)
    back = [bytes(d) for tx in rcv.datagrams_to_send(0.002) for d in tx.datagrams()]
    return out, back


@pytest.mark.parametrize("job_key", [None, b"job-secret"])
def test_engine_datagrams_dissect_field_by_field(job_key):
    out, back = _engine_datagrams(job_key)
    reg = LTPT(out[0])
    ptype, flags, fid, token, w2, w3 = wire.unpack_header(out[0])
    assert ptype == wire.T_REG and reg.type == 0 and reg.flow_id == fid and reg.token == token
    body = wire.unpack_reg_body(out[0], 16, bool(flags & wire.F_MAC))
    assert (reg.total, reg.segment_size, reg.element_size, reg.segment_count, reg.tag, reg.mode) == body[:6]
    assert [(r.first, r.end) for r in reg.ranges] == body[6] and reg.timestamp == body[9]
    if job_key:
        assert reg.mac == body[7]
    copies = sum(1 for raw in out if raw[0] & 0x0F == wire.T_REG)
    assert copies == Config().reg_copies and all(raw[0] & 0x0F == wire.T_REG for raw in out[:copies])
    for raw in out[copies:]:
        pkt = LTPT(raw)
        _, flags, _, _, w2, w3 = wire.unpack_header(raw)
        assert pkt.type == wire.T_DATA and pkt.seq == w2 >> 8 and pkt.attempt == w2 & 0xFF
        assert bool(pkt.flags & wire.F_CRITICAL) == bool(flags & wire.F_CRITICAL)
        assert bytes(pkt.payload) == raw[16:]
    kinds = {LTPT(raw).type for raw in back}
    assert wire.T_ACK in kinds and wire.T_STOP in kinds
    for raw in back:
        pkt = LTPT(raw)
        _, _, _, _, w2, w3 = wire.unpack_header(raw)
        if pkt.type == wire.T_ACK:
            assert list(pkt.entries) == wire.unpack_ack_entries(raw, w3).tolist()
            assert pkt.held == w2
        else:
            assert pkt.close_reason == w3 >> 24 and pkt.held == w2
        assert bytes(pkt) == raw  # re-building the dissected packet gives the same bytes


def test_scapy_built_packets_decode_with_the_codec():
    reg = LTPT(type=0, flags=0, flow_id=9, token=0xABCDEF01, attempt=1, total=10_000, segment_size=1000,
               element_size=4, segment_count=10, tag=5, mode=1, ranges=[LTPTRange(first=0, end=1),
                                                                         LTPTRange(first=9, end=10)])
    raw = bytes(reg)
    ptype, flags, fid, token, w2, w3 = wire.unpack_header(raw)
    assert (ptype, fid, token, w2) == (wire.T_REG, 9, 0xABCDEF01, 1)
    assert wire.unpack_reg_body(raw, 16, False)[:7] == (10_000, 1000, 4, 10, 5, 1, [(0, 1), (9, 10)])
    ack = LTPT(type=2, flow_id=9, token=1, held=3, count=None, entries=[0x100, 0x201, 0x302])
    raw = bytes(ack)
    _, _, _, _, w2, w3 = wire.unpack_header(raw)
    assert w2 == 3 and wire.unpack_ack_entries(raw, w3).tolist() == [0x100, 0x201, 0x302]
    data = LTPT(type=1, flags=1, flow_id=9, token=1, seq=7, attempt=2, rtprop=wire.uf16_encode(150),
                btlbw=wire.uf16_encode(125_000_000)) / (b"\x01" * 64)
    raw = bytes(data)
    ptype, flags, _, _, w2, w3 = wire.unpack_header(raw)
    assert (ptype, flags, w2) == (wire.T_DATA, wire.F_CRITICAL, (7 << 8) | 2)
    rt, bw = wire.split_estimates(w3)
    assert rt == 150 and abs(bw - 125_000_000) <= 125_000_000 / 1024


def test_a_granted_ack_dissects_with_its_grant_and_rebuilds_the_same_bytes():
    raw = wire.pack_ack(5, 0xDEAD, 12, 300, [0x100, 0x201], grant=15_600_000)
    pkt = LTPT(raw)
    assert not pkt.malformed and int(pkt.flags) == wire.F_GRANT
    assert pkt.grant == wire.uf16_encode(15_600_000) and pkt.grant_reserved == 0
    assert list(pkt.entries) == [0x100, 0x201] and pkt.held == 12
    assert "grant=" in pkt.mysummary()
    assert bytes(pkt) == raw
    built = LTPT(type=2, flags="GRANT", flow_id=5, token=0xDEAD, held=12, ack_delay=wire.uf16_encode(300),
                 grant=wire.uf16_encode(15_600_000), entries=[0x100, 0x201])
    assert bytes(built) == raw
    ptype, flags, _, _, _, w3 = wire.unpack_header(bytes(built))
    assert wire.ack_grant(bytes(built), flags) == wire.uf16_decode(wire.uf16_encode(15_600_000))
    assert LTPT(raw[:-4]).malformed  # a granted ACK cut short says so
