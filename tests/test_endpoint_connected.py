"""Connected endpoints (``open_endpoint(peer=...)``): one peer, its datagrams demultiplexed by the kernel.

Loopback socket tier. A connected endpoint moves data exactly like any other, both ways and through the
compiled bulk drain; the kernel drops every other host's datagrams before they reach it; and every call that
names another peer raises, naming the fix, before anything is sent.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

import ltp
from ltp.errors import LocalProtocolError, LTPError, TransferTimeout
from net_helpers import blocking_exchange

pytestmark = pytest.mark.timeout(120)


async def _connected_to(peer_ep):
    return await ltp.open_endpoint(("127.0.0.1", 0), peer=peer_ep.local_addr)


async def test_a_connected_endpoint_sends_and_receives_exactly():
    b = await ltp.open_endpoint(("127.0.0.1", 0))
    a = await _connected_to(b)
    async with a, b:
        assert a.peer == b.local_addr and b.peer is None
        assert a.local_addr[0] == "127.0.0.1"
        rng = np.random.default_rng(7)
        for sender, receiver in ((a, b), (b, a)):
            data = rng.standard_normal(1_000_000).astype(np.float32)
            out = np.zeros_like(data)
            s, r = await asyncio.gather(sender.send(receiver.local_addr, data, reliable=True, tag=1),
                                        receiver.recv(out, tag=1))
            assert np.array_equal(out, data)
            assert s.delivered_fraction == 1.0 and r.regime == "complete" and r.peer == sender.local_addr


async def test_a_connected_receiver_drains_a_bulk_transfer():
    s = await ltp.open_endpoint(("127.0.0.1", 0))
    r = await _connected_to(s)
    async with s, r:
        data = np.random.default_rng(3).integers(0, 255, 24_000_000, dtype=np.uint8)
        out = np.zeros_like(data)
        rep, _ = await asyncio.gather(s.send(r.local_addr, data, reliable=True), r.recv(out))
        assert np.array_equal(out, data) and rep.delivered_fraction == 1.0
        assert r.loop_stats["drained"] > 0
        assert sum(r.stats.dropped.values()) == 0


async def test_the_kernel_keeps_other_hosts_datagrams_from_a_connected_endpoint():
    s = await ltp.open_endpoint(("127.0.0.1", 0))
    r = await _connected_to(s)
    x = await ltp.open_endpoint(("127.0.0.1", 0))
    async with s, r, x:
        with pytest.raises(LTPError):  # refused by the kernel (ICMP port unreachable) or never answered
            await x.send(r.local_addr, np.ones(10_000, np.float32), reliable=True, timeout=2.0)
        with pytest.raises(TransferTimeout):
            await r.recv(np.zeros(10_000, np.float32), timeout=0.3)
        assert r.stats.flows_received == 0 and r.io_stats["datagrams_in"] == 0
        data = np.arange(10_000, dtype=np.float32)
        out = np.zeros_like(data)
        await asyncio.gather(s.send(r.local_addr, data, reliable=True), r.recv(out))  # its own peer still gets in
        assert np.array_equal(out, data)


async def test_a_connected_endpoint_refuses_every_other_peer_naming_the_fix():
    s = await ltp.open_endpoint(("127.0.0.1", 0))
    r = await _connected_to(s)
    x = await ltp.open_endpoint(("127.0.0.1", 0))
    async with s, r, x:
        other = x.local_addr
        with pytest.raises(LocalProtocolError, match="connected to .*without peer="):
            await r.send(other, b"1234")
        with pytest.raises(LocalProtocolError, match="connected to"):
            await r.recv(bytearray(4), peer=other, timeout=0.1)
        with pytest.raises(LocalProtocolError, match="connected to"):
            await r.gather([s.local_addr, other], [bytearray(4), bytearray(4)], timeout=0.1)
        with pytest.raises(LocalProtocolError, match="connected to"):
            await r.broadcast([s.local_addr, other], b"1234", timeout=0.5)
        assert r.engine.stats.flows_sent == 0  # nothing of the broadcast went out, not even to its own peer
        with pytest.raises(TransferTimeout):  # its own peer is fine, by name too
            await r.recv(bytearray(4), peer=("localhost", s.local_addr[1]), timeout=0.05)


@pytest.mark.parametrize("peer, match", [
    ("127.0.0.1", "must be a \\(host, port\\) tuple"),
    (("127.0.0.1", 0), "port must be an int in 1..65535"),
    (("::1", 9), "IPv6 but this endpoint is bound to IPv4"),
    (("no-such-host.invalid", 9), "cannot resolve"),
])
async def test_a_bad_peer_fails_open_endpoint_and_leaves_no_socket(peer, match):
    import gc
    import warnings

    with pytest.raises(LocalProtocolError, match=match):
        await ltp.open_endpoint(("127.0.0.1", 0), peer=peer)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ResourceWarning)  # a socket left open would warn when collected
        gc.collect()


def test_a_blocking_socket_can_be_connected():
    with ltp.Socket(("127.0.0.1", 0)) as b, ltp.Socket(("127.0.0.1", 0)) as x:
        with ltp.Socket(("127.0.0.1", 0), peer=b.local_addr) as a:
            assert a.peer == b.local_addr and b.peer is None
            data = np.arange(50_000, dtype=np.float32)
            out = np.zeros_like(data)
            rep, rrep = blocking_exchange(a, b, data, out, tag=2)
            assert rep.delivered_fraction == 1.0 and rrep.regime == "complete"
            assert np.array_equal(out, data)
            with pytest.raises(LocalProtocolError, match="connected to"):
                a.send(x.local_addr, data)
