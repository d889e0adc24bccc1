"""Loopback tier: peer sockets (``Config.peer_sockets``, ``ltp/endpoint.py``, "Peer sockets").

An endpoint that receives from named peers opens, for each, a socket bound to its own port and connected to that
peer, so the kernel finds the peer's datagrams by early demux. What must hold: every message still arrives exact;
the peer's datagrams do arrive on its own socket; peers still see one address; no other socket can bind the
port; the cap and the off switch hold; a peer whose socket cannot be made still gets through; a dead peer's ICMP
report, which the kernel queues on the peer socket, still fails a send to it at once.
"""

from __future__ import annotations

import asyncio
import os
import socket
import sys
import time

import pytest

import ltp
from ltp.config import PEER_SOCKETS_MAX
from ltp.errors import LocalProtocolError, PeerUnreachable

pytestmark = [pytest.mark.timeout(60),
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="peer sockets are Linux-only")]

SIZE = 1_500_000


async def _gather_rounds(rx, txs, rounds: int, *, size: int = SIZE) -> None:
    """``rounds`` gathers at ``rx`` of one reliable message from each of ``txs``; every message must be exact."""
    host = rx.local_addr[0]
    peers = [(host if host not in ("0.0.0.0", "::") else "127.0.0.1", t.local_addr[1]) for t in txs]
    if ":" in host:
        peers = [(host if host != "::" else "::1", p) for _, p in peers]
    dest = (peers[0][0], rx.local_addr[1])
    for rnd in range(rounds):
        data = [os.urandom(size) for _ in txs]
        bufs = [bytearray(size) for _ in txs]
        g = asyncio.ensure_future(rx.gather(peers, bufs, tag=rnd, timeout=20))
        sends = await asyncio.gather(*(t.send(dest, d, reliable=True, tag=rnd, timeout=20) for t, d in zip(txs, data)))
        reports = await g
        assert [s.delivered_fraction for s in sends] == [1.0] * len(txs)
        assert [r.delivered_fraction for r in reports] == [1.0] * len(txs)
        assert all(bytes(b) == d for b, d in zip(bufs, data)), f"round {rnd}: a message arrived changed"


async def _close(*endpoints) -> None:
    for e in endpoints:
        await e.close()


def _bind_fails(addr) -> None:
    """No socket of another program may bind ``addr``, with ``SO_REUSEPORT`` or without."""
    family = socket.AF_INET6 if ":" in addr[0] else socket.AF_INET
    for reuse in (1, 0):
        s = socket.socket(family, socket.SOCK_DGRAM)
        try:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, reuse)
            with pytest.raises(OSError) as info:
                s.bind(addr[:2])
            assert info.value.errno == 98  # EADDRINUSE
        finally:
            s.close()


@pytest.mark.parametrize("host", ["127.0.0.1", "0.0.0.0", "::1"])
async def test_each_gathered_peer_gets_its_own_socket_and_every_message_arrives_exact(host):
    peer_host = "::1" if ":" in host else "127.0.0.1"
    rx = await ltp.open_endpoint((host, 0))
    txs = [await ltp.open_endpoint((peer_host, 0)) for _ in range(3)]
    try:
        await _gather_rounds(rx, txs, rounds=3)
        socks = rx.peer_sockets
        assert sorted(p[1] for p in socks) == sorted(t.local_addr[1] for t in txs)  # one per peer, not per round
        for peer, stats in socks.items():
            assert stats["datagrams_in"] > SIZE * 3 // 1500, f"{peer}'s DATA did not arrive on its peer socket"
        assert rx.io_stats["datagrams_in"] == 0  # nothing of theirs took the endpoint's own socket
        # the senders saw one address: every ACK came from the port they sent to
        assert all(t.stats.dropped.get("unknown_flow", 0) == 0 for t in txs)
        _bind_fails(rx.local_addr)
    finally:
        await _close(rx, *txs)


async def test_the_port_stays_closed_to_other_sockets_before_and_after_peer_sockets():
    rx = await ltp.open_endpoint(("127.0.0.1", 0))
    tx = await ltp.open_endpoint(("127.0.0.1", 0))
    try:
        _bind_fails(rx.local_addr)
        await _gather_rounds(rx, [tx], rounds=1)
        assert len(rx.peer_sockets) == 1
        _bind_fails(rx.local_addr)
        for s in (rx._sock, *(r.sock for r in rx._peer_readers.values())):
            assert s.getsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT) == 0
    finally:
        await _close(rx, tx)
    # closed: the port is free again, peer sockets included
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind(rx.local_addr)
    s.close()


@pytest.mark.parametrize("cap", [0, 2])
async def test_the_cap_holds_and_the_other_peers_use_the_endpoints_socket(cap):
    rx = await ltp.open_endpoint(("127.0.0.1", 0), config=ltp.Config(peer_sockets=cap))
    txs = [await ltp.open_endpoint(("127.0.0.1", 0)) for _ in range(4)]
    try:
        await _gather_rounds(rx, txs, rounds=2, size=400_000)
        assert len(rx.peer_sockets) == cap
        assert rx.io_stats["datagrams_in"] > 0  # the peers beyond the cap
        assert all(s["datagrams_in"] > 0 for s in rx.peer_sockets.values())
    finally:
        await _close(rx, *txs)


async def test_recv_and_expect_from_a_peer_open_its_socket_and_a_connected_endpoint_opens_none():
    rx = await ltp.open_endpoint(("127.0.0.1", 0))
    tx = await ltp.open_endpoint(("127.0.0.1", 0))
    solo = await ltp.open_endpoint(("127.0.0.1", 0), peer=tx.local_addr)
    try:
        buf = bytearray(1000)
        await rx.expect(tx.local_addr, buf, tag=5)
        assert list(rx.peer_sockets) == [tx.local_addr]
        payload = os.urandom(1000)
        t = asyncio.ensure_future(tx.send(rx.local_addr, payload, reliable=True, tag=5, timeout=10))
        rep = await rx.recv(buf, peer=tx.local_addr, tag=5, timeout=10)
        await t
        assert rep.delivered_fraction == 1.0 and bytes(buf) == payload
        assert list(rx.peer_sockets) == [tx.local_addr]  # the receive found the one the hint made

        t = asyncio.ensure_future(tx.send(solo.local_addr, payload, reliable=True, tag=6, timeout=10))
        await solo.recv(buf, peer=tx.local_addr, tag=6, timeout=10)
        await t
        assert solo.peer_sockets == {}  # already connected to its one peer
    finally:
        await _close(rx, tx, solo)


async def test_a_peer_socket_that_cannot_be_made_is_counted_and_its_peer_still_gets_through(monkeypatch):
    rx = await ltp.open_endpoint(("127.0.0.1", 0))
    tx = await ltp.open_endpoint(("127.0.0.1", 0))
    real = socket.socket

    def no_descriptors(*args, **kwargs):
        raise OSError(24, "Too many open files")

    try:
        monkeypatch.setattr(ltp.endpoint.socket, "socket", no_descriptors)
        await _gather_rounds(rx, [tx], rounds=2, size=300_000)
        monkeypatch.setattr(ltp.endpoint.socket, "socket", real)
        await _gather_rounds(rx, [tx], rounds=1, size=300_000)  # not tried again: one failure per peer
        assert rx.loop_stats["peer_socket_errors"] == 1
        assert rx.peer_sockets == {} and rx.io_stats["datagrams_in"] > 0
    finally:
        monkeypatch.setattr(ltp.endpoint.socket, "socket", real)
        await _close(rx, tx)


async def test_a_dead_peers_icmp_report_on_its_peer_socket_fails_a_send_at_once():
    rx = await ltp.open_endpoint(("127.0.0.1", 0))
    tx = await ltp.open_endpoint(("127.0.0.1", 0))
    try:
        await _gather_rounds(rx, [tx], rounds=1, size=100_000)
        gone = tx.local_addr
        await tx.close()
        t0 = time.monotonic()
        with pytest.raises(PeerUnreachable):
            await rx.send(gone, os.urandom(200_000), reliable=True, timeout=10)
        # the ICMP report, read from the peer socket's error queue: not the dead-peer rule's 1 s of silence
        assert time.monotonic() - t0 < 0.5
        assert rx.loop_stats["readable"] < 1000  # and the report did not leave the socket signalling an error
    finally:
        await _close(rx, tx)


@pytest.mark.parametrize("bad", [-1, True, 1.5, PEER_SOCKETS_MAX + 1])
def test_a_bad_peer_sockets_setting_names_the_fix(bad):
    with pytest.raises(LocalProtocolError, match="peer_sockets"):
        ltp.Config(peer_sockets=bad)


async def test_a_peer_socket_whose_connect_fails_leaves_the_port_closed_to_other_sockets():
    """``connect`` to a broadcast address is refused (EACCES without SO_BROADCAST) after the bind succeeded:
    the half-made socket is closed, the failure counted, and ``SO_REUSEPORT`` cleared on every socket left."""
    rx = await ltp.open_endpoint(("0.0.0.0", 0))
    tx = await ltp.open_endpoint(("127.0.0.1", 0))
    try:
        await _gather_rounds(rx, [tx], rounds=1, size=50_000)  # one good peer socket first
        await rx.expect(("255.255.255.255", 9), bytearray(100), tag=1)
        assert rx.loop_stats["peer_socket_errors"] == 1 and len(rx.peer_sockets) == 1
        for s in (rx._sock, *(r.sock for r in rx._peer_readers.values())):
            assert s.getsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT) == 0
        _bind_fails(("127.0.0.1", rx.local_addr[1]))
        await _gather_rounds(rx, [tx], rounds=1, size=50_000)  # still serving
    finally:
        await _close(rx, tx)
