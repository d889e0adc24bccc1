"""Gather send: DATA packets go out as header + segment straight from the message (issue 8).

The engine builds only the 16-byte headers (``SendWindow.build(..., headers_only=True)``)
and returns a :class:`ltp.path.SegmentTransmit`; ``UdpIO.send_segments`` hands the
kernel one iovec pair per packet, so the payload is copied once (by the kernel), as
with TCP.  These tests pin that the bytes on the wire are exactly those of the
contiguous path, for both implementations of both modules.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ltp.config import Config
from ltp.engine import Engine
from ltp.path import SegmentTransmit
from test_udpio import Sockets, _load, drain  # noqa: E402 (tests/ is on sys.path)


@pytest.fixture(params=["compiled", "twin"])
def mod(request):
    return _load(request.param)


@pytest.fixture
def socks():
    s = Sockets()
    yield s
    s.close()


def _expected(headers: bytes, payload: bytes, seqs, seg: int, total: int) -> list[bytes]:
    return [headers[16 * k:16 * k + 16] + payload[q * seg:min(total, (q + 1) * seg)] for k, q in enumerate(seqs)]


def _headers(n: int) -> bytes:
    return b"".join(bytes([0x11, k & 0xFF]) + k.to_bytes(14, "big") for k in range(n))


@pytest.mark.parametrize("gro", [True, False])
@pytest.mark.parametrize("gso", [True, False])
def test_wire_bytes_equal_the_assembled_packets(mod, socks, gso, gro):
    a, b = socks.make(), socks.make()
    rx, tx = mod.UdpIO(a, gro=gro), mod.UdpIO(b, gso=gso)
    seg, total = 1456, 1456 * 150 + 300          # 151 segments, the last one short
    pay = np.random.default_rng(1).integers(0, 256, total, dtype=np.uint8)
    # out of order, a retransmission, more than one GSO batch, the short segment last
    seqs = np.array(list(range(3, 120)) + [0, 2, 1, 5] + list(range(120, 151)), np.int64)
    hdr = _headers(len(seqs))
    assert tx.send_segments(a.getsockname(), hdr, pay, seqs, seg, total) == len(seqs)
    got = [d for d, _ in drain(rx, len(seqs))]
    assert got == _expected(hdr, pay.tobytes(), seqs.tolist(), seg, total)


def test_short_segment_in_the_middle_ends_its_gso_batch(mod, socks):
    a, b = socks.make(), socks.make()
    rx, tx = mod.UdpIO(a), mod.UdpIO(b)
    seg, total = 1000, 1000 * 9 + 10
    pay = bytes(range(256)) * 40
    seqs = np.array([0, 1, 9, 2, 3, 4], np.int64)     # segment 9 (10 bytes) between full ones
    hdr = _headers(len(seqs))
    assert tx.send_segments(a.getsockname(), hdr, pay, seqs, seg, total) == 6
    got = [d for d, _ in drain(rx, 6)]
    assert got == _expected(hdr, pay, seqs.tolist(), seg, total)


def test_plain_send_after_a_gather_send_is_unharmed(mod, socks):
    """Regression: the gather send once rewired the shared send headers, garbling later plain sends."""
    a, b = socks.make(), socks.make()
    rx, tx = mod.UdpIO(a), mod.UdpIO(b)
    pay = bytes(5000)
    tx.send_segments(a.getsockname(), _headers(3), pay, np.array([0, 1, 2], np.int64), 1000, 5000)
    tx.send(a.getsockname(), b"plain-one", 100)
    tx.send(a.getsockname(), b"x" * 250, 100)
    got = [d for d, _ in drain(rx, 7)]
    assert got[3:] == [b"plain-one", b"x" * 100, b"x" * 100, b"x" * 50]


def test_bad_arguments_raise_the_same_errors(mod, socks):
    a, b = socks.make(), socks.make()
    tx = mod.UdpIO(b)
    dst = a.getsockname()
    pay = bytes(4000)
    with pytest.raises(ValueError, match="headers hold"):
        tx.send_segments(dst, bytes(16), pay, np.array([0, 1], np.int64), 1000, 4000)
    with pytest.raises(ValueError, match="outside a 4000-byte message"):
        tx.send_segments(dst, bytes(32), pay, np.array([0, 4], np.int64), 1000, 4000)
    with pytest.raises(ValueError, match="total=5000"):
        tx.send_segments(dst, bytes(16), pay, np.array([0], np.int64), 1000, 5000)
    with pytest.raises(ValueError, match="seg_size"):
        tx.send_segments(dst, bytes(16), pay, np.array([0], np.int64), 0, 4000)
    assert tx.send_segments(dst, b"", pay, np.array([], np.int64), 1000, 4000) == 0


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_random_layouts_roundtrip(mod, data):
    s = Sockets()
    try:
        a, b = s.make(), s.make()
        rx, tx = mod.UdpIO(a), mod.UdpIO(b, gso=data.draw(st.booleans()))
        seg = data.draw(st.integers(1, 3000))
        n_seg = data.draw(st.integers(1, 200))
        total = (n_seg - 1) * seg + data.draw(st.integers(1, seg))
        seqs = data.draw(st.lists(st.integers(0, n_seg - 1), min_size=1, max_size=150))
        pay = np.random.default_rng(seg).integers(0, 256, total, dtype=np.uint8)
        hdr = _headers(len(seqs))
        assert tx.send_segments(a.getsockname(), hdr, pay, np.array(seqs, np.int64), seg, total) == len(seqs)
        got = [d for d, _ in drain(rx, len(seqs))]
        assert got == _expected(hdr, pay.tobytes(), seqs, seg, total)
    finally:
        s.close()


def _engine_datagrams(gather: bool, critical) -> tuple[list[bytes], set]:
    eng = Engine(Config(), rng=random.Random(5), gather_send=gather)
    msg = np.arange(30_011, dtype=np.float32)
    eng.send(("10.0.0.2", 7447), msg, now=0.0, critical=critical)
    out, kinds, now = [], set(), 0.0
    for _ in range(40):
        for tx in eng.datagrams_to_send(now):
            kinds.add(type(tx))
            assert tx.nbytes == len(tx.data)
            out += tx.datagrams()
        now += 0.01
        eng.handle_timer(now)
    return out, kinds


@pytest.mark.parametrize("critical", [(), [(0, 4096), (60_000, 64_000)]])
def test_engine_gather_and_contiguous_paths_emit_identical_datagrams(critical):
    a, kinds_a = _engine_datagrams(True, critical)
    b, kinds_b = _engine_datagrams(False, critical)
    assert SegmentTransmit in kinds_a and SegmentTransmit not in kinds_b
    assert len(a) > 20 and a == b


def test_segment_transmit_assembles_like_a_transmit():
    pay = memoryview(bytes(range(256)) * 10)
    seqs = np.array([2, 0, 9], np.int64)
    hdr = memoryview(_headers(3))
    tx = SegmentTransmit(("h", 1), hdr, pay, seqs, 256, 2500, nbytes=16 * 3 + 256 + 256 + 196)
    assert tx.segment_size == 272 and len(tx) == 3
    assert tx.datagrams() == _expected(bytes(hdr), bytes(pay), [2, 0, 9], 256, 2500)
    assert tx.nbytes == len(tx.data)
    assert tx.assemble(1) == b"".join(_expected(bytes(hdr), bytes(pay), [2, 0, 9], 256, 2500)[1:])


@pytest.mark.parametrize("threads", [0, 2])
@pytest.mark.parametrize("stage", [True, False], ids=["staged", "unstaged"])
@pytest.mark.parametrize("gso", [True, False])
def test_a_batch_many_stages_long_arrives_exact_and_in_order_staged_or_not(mod, socks, threads, stage, gso):
    """Staged sends (``stage_sends``): a batch several times the stage (LTP_STAGE_BYTES, 256 kB), out of order,
    with a retransmission and the short segment in the middle, puts the same bytes on the wire in the same order
    as the unstaged one, from the caller and through sender threads."""
    a, b = socks.make(), socks.make()
    rx = mod.UdpIO(a)
    tx = mod.UdpIO(b, gso=gso, send_threads=threads, stage_sends=stage)
    assert tx.stage_sends is stage
    seg, n_seg = 1456, 700
    total = seg * (n_seg - 1) + 99
    pay = np.random.default_rng(11).integers(0, 256, total, dtype=np.uint8)
    seqs = np.array(list(range(40, 300)) + [n_seg - 1, 7, 3] + list(range(300, n_seg - 1)) + list(range(0, 40)),
                    np.int64)
    assert len(seqs) * (16 + seg) > 3 * 256 * 1024
    hdr = _headers(len(seqs))
    want = _expected(hdr, pay.tobytes(), seqs.tolist(), seg, total)
    assert tx.send_segments(a.getsockname(), hdr, pay, seqs, seg, total, background=threads > 0) == len(seqs)
    if threads:
        tx.wait_sent()
    assert [d for d, _ in drain(rx, len(seqs), timeout=5.0)] == want
    st = tx.stats
    assert st["datagrams_out"] == len(seqs) and st["errors"] == {}
    if threads:
        tx.stop_send_threads()


def test_staged_sends_are_the_default(mod, socks):
    assert mod.UdpIO(socks.make()).stage_sends is True
