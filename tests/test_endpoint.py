"""Loopback socket tier: real UDP sockets through the asyncio adapter and the blocking wrapper."""

from __future__ import annotations

import asyncio
import random

import numpy as np
import pytest

import ltp
from ltp.config import Config
from ltp.errors import LocalProtocolError, TransferTimeout
from net_helpers import blocking_exchange, ipv6_loopback

pytestmark = pytest.mark.timeout(120)


class LossyIO:
    """Wraps the adapter's UdpIO: drops data-sized datagrams with probability ``loss`` (seeded)."""

    def __init__(self, io, loss: float, seed: int) -> None:
        self._io = io
        self.loss = loss
        self.rng = random.Random(seed)
        self.dropped = 0

    def __getattr__(self, name):
        return getattr(self._io, name)

    def send(self, addr, data, segment_size):
        mv = memoryview(data)
        for i in range(0, len(mv), segment_size):
            d = mv[i:i + segment_size]
            if len(d) > 200 and self.rng.random() < self.loss:
                self.dropped += 1
                continue
            if self._io.send(addr, d, len(d)) < len(d):
                return i
        return len(mv)

    def send_segments(self, addr, headers, payload, seqs, seg_size, total, background=True, pace_rate=0.0,
                      pace_quantum=0, parts=1):  # packet by packet: the parts of a batch are moot
        hv = memoryview(headers)
        for k in range(len(seqs)):
            if min(seg_size, total - int(seqs[k]) * seg_size) > 200 and self.rng.random() < self.loss:
                self.dropped += 1
                continue
            if self._io.send_segments(addr, hv[16 * k:16 * k + 16], payload, seqs[k:k + 1], seg_size, total,
                                      background=background, pace_rate=pace_rate, pace_quantum=pace_quantum) < 1:
                return k
        return len(seqs)


async def _pair(loss=0.0, seed=0, **cfg):
    a = await ltp.open_endpoint(("127.0.0.1", 0), config=Config(**cfg))
    b = await ltp.open_endpoint(("127.0.0.1", 0), config=Config(**cfg))
    if loss:
        a._io = LossyIO(a._io, loss, seed)
    return a, b


async def test_send_recv_reliable_bit_exact_and_reports():
    a, b = await _pair()
    async with a, b:
        data = np.random.default_rng(1).standard_normal(500_000).astype(np.float32)
        out = np.zeros_like(data)
        s, r = await asyncio.gather(a.send(b.local_addr, data, reliable=True, tag=3),
                                    b.recv(out, peer=a.local_addr, tag=3))
        assert np.array_equal(out, data)
        assert s.close_reason in ("acked", "complete") and s.delivered_fraction == 1.0 and s.reliable
        assert r.regime == "complete" and r.peer == a.local_addr and r.tag == 3 and r.bubbles == []
        assert s.rtprop_s > 0 and s.btlbw_bps > 0
        assert b.stats.flows_received == 1 and sum(b.stats.dropped.values()) == 0


async def test_reliable_mode_over_lossy_loopback_is_exact():
    a, b = await _pair(loss=0.05, seed=3)
    async with a, b:
        data = np.random.default_rng(2).standard_normal(300_000).astype(np.float32)
        out = np.zeros_like(data)
        s, r = await asyncio.gather(a.send(b.local_addr, data, reliable=True), b.recv(out))
        assert a._io.dropped > 0 and s.retransmitted_packets >= a._io.dropped * 0.9
        assert np.array_equal(out, data)


async def test_loss_tolerant_gather_with_bubbles_over_lossy_loopback():
    ps = await ltp.open_endpoint(("127.0.0.1", 0), config=Config(deadline_slack_s=0.002))
    workers = [await ltp.open_endpoint(("127.0.0.1", 0)) for _ in range(3)]
    for i, w in enumerate(workers):
        w._io = LossyIO(w._io, 0.2, seed=i)
    try:
        data = [np.full(200_000, i + 1, np.float32) for i in range(3)]
        for it in range(3):
            outs = [np.full(200_000, -1.0, np.float32) for _ in range(3)]
            reps, *sends = await asyncio.gather(
                ps.gather([w.local_addr for w in workers], outs, tag=it, timeout=10),
                *[w.send(ps.local_addr, d, tag=it, critical=[(0, 1456)]) for w, d in zip(workers, data)])
            for rep, out, i in zip(reps, outs, range(3)):
                assert rep.critical_complete and out[0] == i + 1
                assert set(np.unique(out).tolist()) <= {0.0, float(i + 1)}  # only data or zero bubbles
                zeros = sum(b - a for a, b in rep.bubbles)
                assert zeros == int((out == 0).sum()) * 4
                assert rep.regime in ("complete", "early", "deadline")
    finally:
        for e in [ps, *workers]:
            await e.close()


async def test_broadcast_reaches_every_peer_exactly():
    ps = await ltp.open_endpoint(("127.0.0.1", 0))
    workers = [await ltp.open_endpoint(("127.0.0.1", 0)) for _ in range(3)]
    try:
        params = np.arange(100_000, dtype=np.float32)
        outs = [np.zeros_like(params) for _ in workers]
        reps, *recvs = await asyncio.gather(ps.broadcast([w.local_addr for w in workers], params, tag=9),
                                            *[w.recv(o, tag=9) for w, o in zip(workers, outs)])
        assert len(reps) == 3 and all(r.delivered_fraction == 1.0 for r in reps)
        assert all(np.array_equal(o, params) for o in outs)
    finally:
        for e in [ps, *workers]:
            await e.close()


async def test_broadcast_with_a_mute_peer_runs_every_send_to_its_end():
    """One peer that never answers: the live peer still gets the exact message, the broadcast ends
    once (one peer timeout, not one per peer) and names the failed peer; ``return_exceptions``
    gives one outcome per peer instead."""
    import socket
    import time

    from ltp.errors import BroadcastError

    ps = await ltp.open_endpoint(("127.0.0.1", 0))  # a silent peer fails after peer_silence_min_s = 1 s
    w = await ltp.open_endpoint(("127.0.0.1", 0))
    mute = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    mute.bind(("127.0.0.1", 0))
    try:
        params = np.arange(50_000, dtype=np.float32)
        for return_exceptions, tag in ((False, 31), (True, 32)):
            out = np.zeros_like(params)
            peers = [mute.getsockname(), w.local_addr]
            t0 = time.monotonic()
            res, rep = await asyncio.gather(
                ps.broadcast(peers, params, tag=tag, timeout=5.0, return_exceptions=return_exceptions),
                w.recv(out, peer=ps.local_addr, tag=tag, timeout=10), return_exceptions=True)
            took = time.monotonic() - t0
            assert not isinstance(rep, BaseException) and rep.delivered_fraction == 1.0
            np.testing.assert_array_equal(out, params)
            if return_exceptions:
                assert isinstance(res[0], ltp.LTPError) and res[1].delivered_fraction == 1.0, res
            else:
                assert isinstance(res, BroadcastError), res
                assert list(res.failed) == [mute.getsockname()] and res.delivered == [w.local_addr]
                assert res.outcomes[1].delivered_fraction == 1.0
                assert "1 of 2 peers" in str(res) and "return_exceptions=True" in str(res)
            assert took < 4.5, took  # ended on the dead-peer rule, not on the caller's timeout
    finally:
        mute.close()
        for e in (ps, w):
            await e.close()


async def test_a_send_the_kernel_refuses_fails_the_transfer_not_the_loop(caplog):
    """A broadcast address (EACCES without SO_BROADCAST): the send fails with PeerUnreachable at once and nothing
    is raised into the event loop (before: PermissionError from sendmmsg escaped into a timer callback)."""
    import logging
    import time

    ep = await ltp.open_endpoint(("0.0.0.0", 0))
    try:
        caplog.set_level(logging.ERROR, logger="asyncio")
        t0 = time.monotonic()
        with pytest.raises(ltp.PeerUnreachable, match="refused to send"):
            await ep.send(("255.255.255.255", 5000), b"x" * 100, timeout=3)
        assert time.monotonic() - t0 < 1.0
        assert ep.loop_stats.get("send_refused", 0) >= 1
        await asyncio.sleep(0.05)
        assert not [r for r in caplog.records if "Exception in callback" in r.getMessage()]
    finally:
        await ep.close()


async def test_broadcast_misuse_sends_nothing():
    """A bad address anywhere in ``peers`` raises before any peer is sent to."""
    ps = await ltp.open_endpoint(("127.0.0.1", 0))
    w = await ltp.open_endpoint(("127.0.0.1", 0))
    try:
        with pytest.raises(LocalProtocolError, match="port"):
            await ps.broadcast([w.local_addr, ("127.0.0.1", 0)], b"abcd" * 100, tag=3)
        with pytest.raises(TransferTimeout):
            await w.recv(bytearray(400), tag=3, timeout=0.3)
    finally:
        for e in (ps, w):
            await e.close()


async def test_recv_timeout_and_misuse_errors():
    a, b = await _pair()
    async with a, b:
        with pytest.raises(TransferTimeout):
            await b.recv(bytearray(100), timeout=0.05)
        with pytest.raises(LocalProtocolError, match="one buffer per peer"):
            await b.gather([a.local_addr], [bytearray(4), bytearray(4)])
        with pytest.raises(LocalProtocolError, match="more than once"):  # it waited forever for a second message
            await b.gather([a.local_addr, a.local_addr], [bytearray(4), bytearray(4)], timeout=1)
        with pytest.raises(LocalProtocolError, match="multiple of element_size"):
            await a.send(b.local_addr, b"123", element_size=4)
    with pytest.raises(LocalProtocolError, match="closed"):
        await a.send(b.local_addr, b"1234")


async def test_garbage_datagrams_are_dropped_not_raised():
    import socket

    a, b = await _pair()
    async with a, b:
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        for blob in (b"", b"x", bytes(15), bytes([0x11]) + bytes(40), bytes([0x10]) + bytes(60), b"\xff" * 1500):
            s.sendto(blob, b.local_addr)
        s.close()
        data = np.ones(1000, np.float32)
        out = np.zeros_like(data)
        await asyncio.gather(a.send(b.local_addr, data), b.recv(out))
        assert np.array_equal(out, data)
        assert sum(b.stats.dropped.values()) >= 5


def test_blocking_socket_api():
    with ltp.Socket(("127.0.0.1", 0)) as a, ltp.Socket(("127.0.0.1", 0)) as b:
        data = np.arange(50_000, dtype=np.float32)
        out = np.zeros_like(data)
        rep, rrep = blocking_exchange(a, b, data, out, tag=1)
        assert rep.delivered_fraction == 1.0 and rrep.regime == "complete"
        assert np.array_equal(out, data)
        assert a.local_addr[0] == "127.0.0.1"
    with pytest.raises(LocalProtocolError, match="closed"):
        a.send(b.local_addr, data)


def test_hostname_peers_resolve():
    async def main():
        a, b = await _pair()
        async with a, b:
            data = np.ones(100, np.float32)
            out = np.zeros_like(data)
            await asyncio.gather(a.send(("localhost", b.local_addr[1]), data), b.recv(out))
            return np.array_equal(out, data)

    assert ltp.run(main())


def test_ip_literal_peers_are_checked_once_and_the_memory_of_them_is_bounded(monkeypatch):
    import ltp.endpoint as E

    monkeypatch.setattr(E, "LITERAL_PEER_CACHE", 3)

    async def main():
        ep = await ltp.open_endpoint(("127.0.0.1", 0))
        async with ep:
            first = [await ep._resolve(("127.0.0.1", p)) for p in (1000, 1001)]
            again = [await ep._resolve(("127.0.0.1", p)) for p in (1000, 1001)]
            assert first == again == [("127.0.0.1", 1000), ("127.0.0.1", 1001)]
            for p in range(2000, 2010):  # never more than the bound remembered
                assert await ep._resolve(("10.0.0.7", p)) == ("10.0.0.7", p)
                assert len(ep._literal_peers) <= 3
            # a remembered address never skips the checks of a different spelling or a bad port
            with pytest.raises(LocalProtocolError, match="IPv6"):
                await ep._resolve(("::1", 1000))
            with pytest.raises(LocalProtocolError, match="port"):
                await ep._resolve(("127.0.0.1", 70000))
            assert await ep._resolve(("localhost", 1000)) in (("127.0.0.1", 1000), ("::1", 1000))
            assert ("localhost", 1000) not in ep._literal_peers  # names are resolved every time

    ltp.run(main())


@pytest.mark.skipif(not ipv6_loopback(), reason="no IPv6 loopback on this machine")
@pytest.mark.parametrize("spelling", ["127.0.0.1", "::ffff:127.0.0.1", "::FFFF:127.0.0.1", "::ffff:7f00:1"])
def test_a_dual_stack_endpoint_reaches_an_ipv4_peer_however_its_address_is_written(spelling):
    """'::ffff:7f00:1' was kept as written while the kernel reports the peer as '::ffff:127.0.0.1': every ACK
    then came from an unknown flow and the send timed out."""
    async def main():
        async with await ltp.open_endpoint(("::", 0)) as a, await ltp.open_endpoint(("127.0.0.1", 0)) as b:
            data = np.arange(50_000, dtype=np.float32)
            out = np.zeros_like(data)
            port = b.local_addr[1]
            rep, got = await asyncio.gather(a.send((spelling, port), data, reliable=True, timeout=10),
                                            b.recv(out, tag=0, timeout=10))
            assert rep.delivered_fraction == 1.0 and np.array_equal(out, data)

    ltp.run(main())


@pytest.mark.skipif(not ipv6_loopback(), reason="no IPv6 loopback on this machine")
def test_an_endpoint_bound_to_one_ipv6_address_refuses_an_ipv4_peer_naming_the_fix():
    async def main():
        async with await ltp.open_endpoint(("::1", 0)) as a:
            with pytest.raises(LocalProtocolError, match="'::'"):
                await a.send(("127.0.0.1", 9), b"x" * 8)

    ltp.run(main())


class _SteppedClock:
    """``time`` as ``ltp.endpoint`` sees it, with the wall clock stepped ``step`` seconds (NTP)."""

    def __init__(self, real, step: float) -> None:
        self._real, self.step = real, step

    def __getattr__(self, name):
        return getattr(self._real, name)

    def time(self) -> float:
        return self._real.time() + self.step


class _NoKernelTimes:
    """The adapter's UdpIO without kernel receive times: those read the real, unstepped clock."""

    timestamps_enabled = False

    def __init__(self, io) -> None:
        self._io = io

    def __getattr__(self, name):
        return getattr(self._io, name)


async def test_a_wall_clock_stepped_after_opening_still_stamps_fresh_registrations(monkeypatch):
    """A's wall clock is stepped 30 s after A opened (B, opened after the step, has it right).  REG stamps
    follow the wall clock as it is now, not as it was when the endpoint opened: without that every send of a
    long-running job fails as 'stale' once NTP has stepped its host's clock past the freshness window."""
    import time as real_time

    from ltp import endpoint as ep

    cfg = Config(job_key=b"job-secret")
    a = await ltp.open_endpoint(("127.0.0.1", 0), config=cfg)
    monkeypatch.setattr(ep, "time", _SteppedClock(real_time, 30.0))
    # no peer socket at B: its reads must all go through the wrapped io, whose kernel times are hidden
    b = await ltp.open_endpoint(("127.0.0.1", 0), config=Config(job_key=b"job-secret", peer_sockets=0))
    a._io, b._io = _NoKernelTimes(a._io), _NoKernelTimes(b._io)
    async with a, b:
        data = np.arange(50_000, dtype=np.float32)
        into = np.zeros_like(data)
        sent, got = await asyncio.gather(a.send(b.local_addr, data, reliable=True, tag=3, timeout=10),
                                         b.recv(into, peer=a.local_addr, tag=3, timeout=10))
        assert np.array_equal(into, data) and sent.delivered_fraction == 1.0
        assert b.stats.refused == {} and a.stats.stale_retries == 0
