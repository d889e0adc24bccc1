"""Transports of ltp_ps: kernel TCP (loopback) and the in-memory LTP-like fake."""

from __future__ import annotations

import asyncio
import socket

import numpy as np
import pytest

from ltp_ps.errors import ConfigError, TransportError, TransportTimeout
from ltp_ps.transport import (CANCELLED, COMPLETE, TIMEOUT, MemoryNetwork, TcpTransport,
                              available_congestion_controls)
from ltp_ps.transport.tcp import TCP_CONGESTION

pytestmark = pytest.mark.timeout(30)


async def _pair(cc="cubic"):
    a = await TcpTransport.open(cc=cc)
    b = await TcpTransport.open(cc=cc)
    return a, b


async def test_tcp_send_recv_bit_exact_and_tag_matching():
    a, b = await _pair()
    try:
        x = np.random.default_rng(0).standard_normal(300_000).astype(np.float32)
        await a.send(b.local_addr, np.zeros(4, np.float32), tag=1)
        rep_s = await a.send(b.local_addr, x, tag=2)
        assert rep_s.delivered_fraction == 1.0 and rep_s.total_bytes == x.nbytes
        into = np.empty_like(x)
        rep = await b.recv(into, peer=a.local_addr, tag=2)  # tag 1 arrived first and waits
        assert rep.regime == COMPLETE and rep.bubbles == () and rep.delivered_fraction == 1.0
        assert rep.peer == a.local_addr and rep.tag == 2
        np.testing.assert_array_equal(into, x)
        small = np.empty(4, np.float32)
        rep1 = await b.recv(small, tag=None)
        assert rep1.tag == 1
        with pytest.raises(TransportTimeout):
            await b.recv(small, tag=3, timeout=0.1)
    finally:
        await a.close()
        await b.close()


async def test_tcp_message_too_big_for_buffer_is_an_error():
    a, b = await _pair()
    try:
        await a.send(b.local_addr, np.zeros(10, np.float32), tag=0)
        with pytest.raises(TransportError, match="does not fit"):
            await b.recv(np.zeros(5, np.float32), tag=0, timeout=5)
    finally:
        await a.close()
        await b.close()


async def test_tcp_gather_reports_timeout_and_closed_peers_without_raising():
    ps = await TcpTransport.open()
    ws = [await TcpTransport.open() for _ in range(3)]
    try:
        await ws[0].send(ps.local_addr, np.full(8, 1, np.float32), tag=5)
        # worker 1 connects (sends another tag) then dies: its gather slot must close at once
        await ws[1].send(ps.local_addr, np.zeros(1, np.float32), tag=4)
        await asyncio.sleep(0.05)
        await ws[1].close()
        bufs = [np.zeros(8, np.float32) for _ in ws]
        t0 = asyncio.get_running_loop().time()
        reps = await ps.gather([w.local_addr for w in ws], bufs, tag=5, timeout=0.5)
        elapsed = asyncio.get_running_loop().time() - t0
        assert [r.regime for r in reps] == [COMPLETE, CANCELLED, TIMEOUT]
        assert [r.delivered_fraction for r in reps] == [1.0, 0.0, 0.0]
        assert not reps[2].critical_complete and reps[2].bubbles == ((0, 32),)
        assert 0.4 < elapsed < 2.0
        np.testing.assert_array_equal(bufs[0], 1)
    finally:
        for t in [ps, *ws]:
            await t.close()


async def test_tcp_broadcast_to_dead_peer_returns_the_exception():
    ps = await TcpTransport.open()
    w = await TcpTransport.open()
    dead = await TcpTransport.open()
    dead_addr = dead.local_addr
    await dead.close()
    try:
        reps = await ps.broadcast([w.local_addr, dead_addr], np.arange(4, dtype=np.float32), tag=9, timeout=5)
        assert reps[0].delivered_fraction == 1.0
        assert isinstance(reps[1], TransportError)
        got = np.zeros(4, np.float32)
        await w.recv(got, tag=9, timeout=5)
        np.testing.assert_array_equal(got, np.arange(4))
    finally:
        await ps.close()
        await w.close()


@pytest.mark.parametrize("cc", ["cubic", "reno", "bbr"])
async def test_tcp_congestion_control_is_set_per_socket(cc):
    if cc not in available_congestion_controls():
        pytest.skip(f"kernel offers {available_congestion_controls()}, not {cc}")
    a, b = await _pair(cc)
    try:
        await a.send(b.local_addr, np.zeros(4, np.float32), tag=0)
        sock = a._out[tuple(b.local_addr)]
        got = sock.getsockopt(socket.IPPROTO_TCP, TCP_CONGESTION, 16).rstrip(b"\0").decode()
        assert got == cc
    finally:
        await a.close()
        await b.close()


async def test_tcp_unknown_congestion_control_says_how_to_fix():
    with pytest.raises(ConfigError, match="--cc"):
        await TcpTransport.open(cc="no-such-cc")


async def test_memory_transport_loss_spares_critical_and_reports_bubbles():
    net = MemoryNetwork(loss=0.3, segment_size=64, seed=3)
    a, b = net.endpoint(), net.endpoint()
    x = np.arange(1, 4097, dtype=np.float32)  # 16 KiB = 256 segments
    crit = [(0, 64), (x.nbytes - 4, x.nbytes)]
    srep = await a.send(b.local_addr, x, critical=crit, tag=1)
    into = np.zeros_like(x)
    rep = await b.recv(into, tag=1)
    assert 0.5 < rep.delivered_fraction < 0.9
    assert srep.delivered_fraction == pytest.approx(rep.delivered_fraction)
    assert rep.bubbles and all(s >= 64 and e <= x.nbytes - 64 for s, e in rep.bubbles)
    mask = np.ones(x.size, bool)
    for s, e in rep.bubbles:
        mask[s // 4:e // 4] = False
    np.testing.assert_array_equal(into[mask], x[mask])
    assert not into[~mask].any()  # bubble-filled with zeros
    # reliable sends are never cut
    await a.send(b.local_addr, x, reliable=True, tag=2)
    rep2 = await b.recv(into, tag=2)
    assert rep2.bubbles == () and np.array_equal(into, x)


async def test_memory_kill_makes_peer_unreachable():
    net = MemoryNetwork()
    a, b = net.endpoint(), net.endpoint()
    net.kill(b.local_addr)
    with pytest.raises(TransportError):
        await a.send(b.local_addr, np.zeros(1, np.float32))
    reps = await a.gather([b.local_addr], [np.zeros(1, np.float32)], tag=0, timeout=0.2)
    assert reps[0].regime in (CANCELLED, TIMEOUT) and reps[0].delivered_fraction == 0


# -- the LTP adapter against a strict fake of docs/api.md ----------------------------------
class _FakeErrors:
    class LTPError(Exception):
        pass

    class LocalProtocolError(LTPError, ValueError):
        pass

    class TransferTimeout(LTPError, TimeoutError):
        pass


class _Rep:
    def __init__(self, **kw):
        self.__dict__.update(kw)


class _FakeEndpoint:
    """Only the documented signatures; keyword-only where the doc says so."""

    def __init__(self, inner):
        self.inner = inner
        self.local_addr = ("0.0.0.0", inner.local_addr[1])
        self.calls = []

    async def send(self, peer, data, *, reliable=False, critical=(), element_size=4, tag=0, timeout=None):
        self.calls.append(("send", reliable, list(critical), element_size, tag))
        r = await self.inner.send(("mem", peer[1]), data, reliable=reliable, critical=critical, tag=tag)
        return _Rep(peer=peer, tag=tag, total_bytes=r.total_bytes, delivered_bytes=r.delivered_bytes,
                    delivered_fraction=r.delivered_fraction, packets_sent=1, retransmitted_packets=0,
                    duration_s=0.0, close_reason="acked", rtprop_s=0.0, btlbw_bps=0.0, reliable=reliable)

    def _rrep(self, r):
        return _Rep(peer=("127.0.0.1", r.peer[1]), tag=r.tag, total_bytes=r.total_bytes,
                    received_bytes=r.received_bytes, delivered_fraction=r.delivered_fraction,
                    bubbles=list(r.bubbles), critical_complete=True, regime=r.regime, duration_s=0.0, duplicates=0,
                    rtprop_s=0.0, btlbw_bps=0.0, lt_threshold_s=0.0, deadline_s=0.0)

    async def recv(self, into, *, peer=None, tag=None, timeout=None):
        return self._rrep(await self.inner.recv(into, peer=None if peer is None else ("mem", peer[1]), tag=tag,
                                                timeout=timeout))

    async def gather(self, peers, into, *, tag=None, timeout=None, clock="first"):
        self.calls.append(("gather", len(peers), tag))
        return [self._rrep(r) for r in await self.inner.gather([("mem", p[1]) for p in peers], into, tag=tag,
                                                                 timeout=timeout, clock=clock)]

    async def broadcast(self, peers, data, *, tag=0, critical=(), element_size=4, timeout=None):
        self.calls.append(("broadcast", len(peers), tag))
        if any(("mem", p[1]) in self.inner.net.dead for p in peers):
            raise _FakeErrors.TransferTimeout("peer stopped answering")
        return [await self.send(p, data, reliable=True, tag=tag) for p in peers]

    async def close(self):
        await self.inner.close()


def _fake_ltp(net):
    import types

    mod = types.SimpleNamespace(errors=_FakeErrors, configs=[])

    def Config(**kw):
        mod.configs.append(kw)
        return kw

    async def open_endpoint(local_addr=("0.0.0.0", 0), *, config=None, rng=None):
        return _FakeEndpoint(net.endpoint())

    mod.Config, mod.open_endpoint = Config, open_endpoint
    return mod


async def test_ltp_adapter_speaks_the_documented_api(monkeypatch):
    import sys

    from ltp_ps.transport import LtpTransport

    net = MemoryNetwork(loss=0.2, segment_size=64, seed=1)
    fake = _fake_ltp(net)
    monkeypatch.setitem(sys.modules, "ltp", fake)
    ps = await LtpTransport.open("0.0.0.0", 0, job_key=b"k")
    w1 = await LtpTransport.open("0.0.0.0", 0, job_key=b"k")
    w2 = await LtpTransport.open("0.0.0.0", 0, job_key=b"k")
    assert fake.configs == [{"job_key": b"k"}] * 3
    assert ps.local_addr[0] == "127.0.0.1"  # 0.0.0.0 is not dialable
    x = np.arange(1, 1025, dtype=np.float32)
    bufs = [np.zeros(1024, np.float32), np.zeros(1024, np.float32)]
    reps, *_ = await asyncio.gather(ps.gather([w1.local_addr, w2.local_addr], bufs, tag=5, timeout=5),
                                    w1.send(ps.local_addr, x, critical=[(0, 64)], tag=5),
                                    w2.send(ps.local_addr, x, critical=[(0, 64)], tag=5))
    assert w1._ep.calls[0] == ("send", False, [(0, 64)], 4, 5)
    assert all(isinstance(b, tuple) for r in reps for b in r.bubbles) and any(r.bubbles for r in reps)
    assert all(r.raw is not None and 0 < r.delivered_fraction < 1 for r in reps)
    # broadcast: one reliable send per peer (not ep.broadcast, which fails as a whole), naming the dead peer
    net.kill(("mem", w2.local_addr[1]))
    breps = await ps.broadcast([w1.local_addr, w2.local_addr], x, tag=6, timeout=5)
    assert not isinstance(breps[0], BaseException) and isinstance(breps[1], TransportError)
    assert not [c for c in ps._ep.calls if c[0] == "broadcast"]
    for t in (ps, w1, w2):
        await t.close()


# -- the TCP baseline reads payloads in place and commits no memory on a peer's say-so ------------------------------
def _raw_peer(addr, host=b"10.9.8.7", port=4242):
    """A hand-driven TCP peer speaking the transport's framing (HELLO, then frames), for byte-level control."""
    import struct

    s = socket.create_connection(tuple(addr))
    s.sendall(b"LTPH" + struct.pack("!H", len(host)) + host + struct.pack("!H", port))
    return s, (host.decode(), port)


def _frame_head(tag, length):
    import struct

    return struct.pack("!4sQQ", b"LTPF", tag, length)


async def _post_then_send_part(b, s, into, tag, timeout, part):
    """Post ``b.recv(into, tag)``, then (so the receive claims the message: read in place) have the raw peer ``s``
    send a frame of ``into.nbytes`` bytes carrying only ``part``; returns the receive's task."""
    posted = asyncio.ensure_future(b.recv(into, tag=tag, timeout=timeout))
    await asyncio.sleep(0.05)  # posted before the header arrives
    await asyncio.to_thread(s.sendall, _frame_head(tag, into.nbytes) + bytes(part))
    return posted


async def _until_dropped(t, reason):
    """Wait up to 1 s for transport ``t`` to count a drop for ``reason``."""
    for _ in range(100):
        if t.dropped[reason]:
            return
        await asyncio.sleep(0.01)


async def test_tcp_receives_in_place_large_and_small_frames_and_several_per_read():
    from ltp_ps.transport.tcp import STAGE_BYTES

    a, b = await _pair()
    try:
        big = np.random.default_rng(1).integers(0, 255, 3 * STAGE_BYTES + 17, dtype=np.uint8)
        smalls = [np.full(n, n % 251, np.uint8) for n in (1, 7, 100, 4096)]
        into_big = np.zeros(big.nbytes + 100, np.uint8)  # larger than the message: the rest is left alone
        into_big[-100:] = 9
        posted = asyncio.ensure_future(b.recv(into_big, peer=a.local_addr, tag=50, timeout=10))
        await asyncio.sleep(0.05)  # the receive is posted before the header arrives: read in place
        await asyncio.gather(*(a.send(b.local_addr, m, tag=60 + i, element_size=1) for i, m in enumerate(smalls)))
        await a.send(b.local_addr, big, tag=50, element_size=1)
        rep = await posted
        assert rep.total_bytes == big.nbytes and (into_big[:big.nbytes] == big).all() and (into_big[-100:] == 9).all()
        for i, m in enumerate(smalls):  # arrived before anyone asked: buffered, then matched
            got = np.zeros(m.nbytes, np.uint8)
            assert (await b.recv(got, tag=60 + i, timeout=5)).total_bytes == m.nbytes
            assert (got == m).all()
    finally:
        await a.close()
        await b.close()


async def test_tcp_a_receive_that_timed_out_mid_message_is_never_written_again_and_the_message_survives():
    b = await TcpTransport.open()
    s, peer = await asyncio.to_thread(_raw_peer, b.local_addr)
    try:
        msg = np.random.default_rng(2).integers(0, 255, 1 << 20, dtype=np.uint8)
        into = np.zeros(msg.nbytes, np.uint8)
        posted = await _post_then_send_part(b, s, into, 7, 0.4, msg[:300_000])
        with pytest.raises(TransportTimeout):
            await posted
        assert (into[:300_000] == msg[:300_000]).all() and not into[300_000:].any()  # placed there, in place
        into[:] = 0xEE  # the caller reuses its buffer at once
        await asyncio.to_thread(s.sendall, msg[300_000:].tobytes())
        again = np.zeros(msg.nbytes, np.uint8)
        rep = await b.recv(again, tag=7, timeout=5)  # the whole message, buffered after its receive gave up
        assert rep.total_bytes == msg.nbytes and rep.peer == peer and (again == msg).all()
        assert (into == 0xEE).all()  # never written after the receive returned
    finally:
        s.close()
        await b.close()


async def test_tcp_a_frame_beyond_the_memory_bound_is_refused_before_any_buffer_is_made():
    b = await TcpTransport.open(max_receive_memory=1 << 20)
    s, _ = await asyncio.to_thread(_raw_peer, b.local_addr)
    try:
        await asyncio.to_thread(s.sendall, _frame_head(1, 1 << 60))  # "an exabyte follows"
        await _until_dropped(b, "too_large")
        assert b.dropped["too_large"] == 1
        s.settimeout(2)
        assert await asyncio.to_thread(s.recv, 1) == b""  # the connection was closed
    finally:
        s.close()
        await b.close()


async def test_tcp_unasked_messages_over_the_bound_are_dropped_and_the_connection_goes_on():
    a = await TcpTransport.open()
    b = await TcpTransport.open(max_receive_memory=100_000)
    try:
        for tag in (1, 2, 3):  # nobody asked: 60 kB buffered, the next two would pass the 100 kB bound
            await a.send(b.local_addr, np.full(60_000, tag, np.uint8), tag=tag, element_size=1)
        got = np.zeros(10, np.uint8)
        await a.send(b.local_addr, np.arange(10, dtype=np.uint8), tag=4, element_size=1)
        assert (await b.recv(got, tag=4, timeout=5)).total_bytes == 10 and (got == np.arange(10)).all()
        assert b.dropped["memory"] == 2
        first = np.zeros(60_000, np.uint8)
        assert (await b.recv(first, tag=1, timeout=5)).total_bytes == 60_000 and (first == 1).all()
    finally:
        await a.close()
        await b.close()


async def test_tcp_a_receive_from_any_peer_outlives_a_peer_that_died_mid_message():
    a = await TcpTransport.open()
    b = await TcpTransport.open()
    s, _ = await asyncio.to_thread(_raw_peer, b.local_addr)
    try:
        into = np.zeros(200_000, np.uint8)
        posted = await _post_then_send_part(b, s, into, 5, 10, b"\1" * 50_000)
        await asyncio.sleep(0.1)
        s.close()  # died mid-message: its message never completes
        await asyncio.sleep(0.1)
        assert not posted.done()
        await a.send(b.local_addr, np.full(200_000, 3, np.uint8), tag=5, element_size=1)
        rep = await posted
        assert rep.peer == a.local_addr and (into == 3).all()
    finally:
        await a.close()
        await b.close()


@pytest.mark.parametrize("hello", [b"LTPH\0\0", b"LTPH\xff\xff", b"HTTP/1.1 GET"])
async def test_tcp_a_bad_hello_is_counted_and_closed(hello):
    b = await TcpTransport.open()
    try:
        s = await asyncio.to_thread(socket.create_connection, tuple(b.local_addr))
        await asyncio.to_thread(s.sendall, hello + b"\0" * 20)
        await _until_dropped(b, "bad_hello")
        assert b.dropped["bad_hello"] == 1
        s.close()
    finally:
        await b.close()


async def test_tcp_a_send_after_the_peer_restarted_redials_instead_of_writing_into_the_dead_connection():
    a = await TcpTransport.open()
    b = await TcpTransport.open()
    port = b.local_addr[1]
    try:
        await a.send(b.local_addr, np.ones(10, np.uint8), tag=1, element_size=1)
        await b.close()  # the peer restarts on the same port
        await asyncio.sleep(0.05)
        b = await TcpTransport.open(port=port)
        await a.send(b.local_addr, np.full(10, 2, np.uint8), tag=2, element_size=1)
        got = np.zeros(10, np.uint8)
        assert (await b.recv(got, tag=2, timeout=5)).total_bytes == 10 and (got == 2).all()
    finally:
        await a.close()
        await b.close()


async def test_tcp_closing_mid_message_leaves_the_receive_buffer_alone():
    b = await TcpTransport.open()
    s, _ = await asyncio.to_thread(_raw_peer, b.local_addr)
    try:
        into = np.zeros(1 << 20, np.uint8)
        posted = await _post_then_send_part(b, s, into, 3, 10, b"\1" * 100_000)
        await asyncio.sleep(0.1)
        await b.close()
        with pytest.raises(TransportError):
            await posted
        into[:] = 7
        try:
            await asyncio.to_thread(s.sendall, b"\2" * 100_000)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the closed transport's kernel may refuse the rest
        await asyncio.sleep(0.1)
        assert (into == 7).all()
    finally:
        s.close()
        await b.close()


# -- placement hints (expect): an early message lands in the buffer its receive will use --------------------------
async def test_tcp_an_expected_message_that_arrives_early_lands_in_place_and_takes_no_mailbox_memory():
    a, b = await _pair()
    try:
        msg = np.random.default_rng(5).integers(0, 255, 2_000_003, dtype=np.uint8)
        into = np.zeros(msg.nbytes, np.uint8)
        await b.expect(a.local_addr, into, tag=9)
        await a.send(b.local_addr, msg, tag=9, element_size=1)
        for _ in range(200):  # arrived, before anyone asked: in the hint's buffer, not in a private one
            if (into == msg).all():
                break
            await asyncio.sleep(0.01)
        assert (into == msg).all()
        assert b._mailbox._arrived_bytes == 0 and b._mailbox._reserved == 0
        rep = await b.recv(into, peer=a.local_addr, tag=9, timeout=5)
        assert rep.total_bytes == msg.nbytes and rep.delivered_fraction == 1.0 and (into == msg).all()
        # a hint is used once: the same tag again is an ordinary message
        again = np.zeros(msg.nbytes, np.uint8)
        await a.send(b.local_addr, msg[::-1].copy(), tag=9, element_size=1)
        assert (await b.recv(again, tag=9, timeout=5)).total_bytes == msg.nbytes
        assert (again == msg[::-1]).all() and (into == msg).all()
    finally:
        await a.close()
        await b.close()


@pytest.mark.parametrize("case", ["other buffer", "hint too small", "hint of a finished round"])
async def test_tcp_a_hint_that_cannot_be_used_still_delivers_the_message_whole(case):
    a, b = await _pair()
    try:
        msg = np.random.default_rng(6).integers(0, 255, 300_000, dtype=np.uint8)
        hint = np.zeros(msg.nbytes if case != "hint too small" else msg.nbytes - 1, np.uint8)
        await b.expect(a.local_addr, hint, tag=20)
        if case == "hint of a finished round":
            b.discard_before(21)
        await a.send(b.local_addr, msg, tag=20, element_size=1)
        await asyncio.sleep(0.1)
        into = np.zeros(msg.nbytes, np.uint8)
        rep = await b.recv(into, tag=20, timeout=5)
        assert rep.total_bytes == msg.nbytes and (into == msg).all()
        if case == "other buffer":
            assert (hint == msg).all()  # it was read into the hint, then copied to the receive's buffer
        else:
            assert not hint.any()  # never written: too small, or dropped with its round
    finally:
        await a.close()
        await b.close()


@pytest.mark.parametrize("same_buffer", [True, False])
async def test_tcp_a_receive_posted_while_its_hinted_message_is_read_then_timing_out_frees_the_hint_buffer(
        same_buffer):
    """The hinted message is half read when its receive is posted: on the hint's buffer the receive takes the read
    over (in place); on another, the rest goes to a private copy. Either way, once the receive timed out, neither
    buffer is written again, and the message is then received whole."""
    b = await TcpTransport.open()
    s, peer = await asyncio.to_thread(_raw_peer, b.local_addr)
    try:
        msg = np.random.default_rng(7).integers(0, 255, 1 << 20, dtype=np.uint8)
        hint = np.zeros(msg.nbytes, np.uint8)
        await b.expect(peer, hint, tag=3)
        await asyncio.to_thread(s.sendall, _frame_head(3, msg.nbytes) + msg[:300_000].tobytes())
        for _ in range(200):
            if hint[299_999] == msg[299_999]:
                break
            await asyncio.sleep(0.01)
        assert (hint[:300_000] == msg[:300_000]).all()
        into = hint if same_buffer else np.zeros(msg.nbytes, np.uint8)
        with pytest.raises(TransportTimeout):
            await b.recv(into, peer=peer, tag=3, timeout=0.3)
        hint[:] = 0xEE
        into[:] = 0xEE  # the caller reuses its buffers at once
        await asyncio.to_thread(s.sendall, msg[300_000:].tobytes())
        again = np.zeros(msg.nbytes, np.uint8)
        rep = await b.recv(again, tag=3, timeout=5)
        assert rep.total_bytes == msg.nbytes and rep.peer == peer and (again == msg).all()
        assert (hint == 0xEE).all() and (into == 0xEE).all()
    finally:
        s.close()
        await b.close()


async def test_tcp_expect_refuses_a_read_only_buffer():
    b = await TcpTransport.open()
    try:
        with pytest.raises(ValueError, match="writable"):
            await b.expect(("127.0.0.1", 1), bytes(10), tag=1)
    finally:
        await b.close()
