"""API misuse raises a clear error that names the fix, and never poisons the endpoint (issue 7 section 5)."""

from __future__ import annotations

import asyncio
import gc
import random
import socket

import numpy as np
import pytest

import ltp
from ltp.config import Config
from ltp.engine import Engine
from ltp.errors import LocalProtocolError, TransferTimeout

pytestmark = pytest.mark.timeout(60)


async def _pair():
    return await ltp.open_endpoint(("127.0.0.1", 0)), await ltp.open_endpoint(("127.0.0.1", 0))


@pytest.mark.parametrize("peer", [("127.0.0.1", 70000), ("127.0.0.1", -1), ("127.0.0.1", 0), ("127.0.0.1", "80"),
                                  ("127.0.0.1", True), ("", 5), (None, 5), "127.0.0.1:5", ("127.0.0.1",)])
async def test_bad_peer_address_is_refused_up_front_and_the_endpoint_stays_usable(peer):
    a, b = await _pair()
    with pytest.raises(LocalProtocolError, match="peer"):
        await a.send(peer, np.ones(10, np.float32))
    out = np.zeros(1000, np.float32)
    await asyncio.gather(a.send(b.local_addr, np.ones(1000, np.float32)), b.recv(out))
    assert out.sum() == 1000
    await a.close()  # must not raise
    await b.close()
    assert a._sock.fileno() == -1


async def test_ipv6_peer_on_an_ipv4_endpoint_names_the_fix():
    a = await ltp.open_endpoint(("127.0.0.1", 0))
    with pytest.raises(LocalProtocolError, match="open the endpoint on '::'"):
        await a.send(("::1", 5000), b"abcd")
    await a.close()


@pytest.mark.parametrize("size", [0, -4, 2.5, True])
def test_bad_element_size_is_a_clear_error(size):
    eng = Engine(Config(), rng=random.Random(0))
    with pytest.raises(LocalProtocolError, match="element_size"):
        eng.send(("10.0.0.2", 1), np.ones(16, np.float32), now=0.0, element_size=size)
    assert not eng._tx  # nothing half-registered


def test_element_size_comes_from_the_dtype():
    eng = Engine(Config(), rng=random.Random(0))
    for dtype, size in ((np.float64, 8), (np.float32, 4), (np.float16, 2), (np.int8, 1)):
        h = eng.send(("10.0.0.2", 1), np.ones(1000, dtype), now=0.0)
        flow = eng._tx_by_handle[h]
        assert flow.element_size == size and flow.seg_size % size == 0
    h = eng.send(("10.0.0.2", 1), b"abc", now=0.0)
    assert eng._tx_by_handle[h].element_size == 1
    # an explicit element size still wins (several float32 per element, say)
    h = eng.send(("10.0.0.2", 1), np.ones(1000, np.float32), now=0.0, element_size=8)
    assert eng._tx_by_handle[h].element_size == 8


def test_float64_segments_never_split_a_double():
    """With a 1452-byte segment budget a float32 message uses 1452-byte segments; a float64 one must
    use 1448 (a multiple of 8), or a lost packet would leave half a double behind."""
    eng = Engine(Config(segment_size=1452), rng=random.Random(0))
    f32 = eng._tx_by_handle[eng.send(("10.0.0.2", 1), np.ones(1000, np.float32), now=0.0)]
    f64 = eng._tx_by_handle[eng.send(("10.0.0.2", 1), np.ones(1000, np.float64), now=0.0)]
    assert f32.seg_size == 1452 and f64.seg_size == 1448


@pytest.mark.parametrize("call", ["send", "recv", "gather", "broadcast"])
async def test_negative_timeouts_are_refused(call):
    a, b = await _pair()
    try:
        with pytest.raises(LocalProtocolError, match="timeout"):
            if call == "send":
                await a.send(b.local_addr, b"abcd", timeout=-1)
            elif call == "recv":
                await a.recv(bytearray(4), timeout=-0.5)
            elif call == "gather":
                await a.gather([b.local_addr], [bytearray(4)], timeout=-1)
            else:
                await a.broadcast([b.local_addr], b"abcd", timeout=float("nan"))
    finally:
        await a.close()
        await b.close()


async def test_gather_and_broadcast_with_no_peers_name_the_problem():
    a = await ltp.open_endpoint(("127.0.0.1", 0))
    with pytest.raises(LocalProtocolError, match="no peers"):
        await a.gather([], [])
    with pytest.raises(LocalProtocolError, match="no peers"):
        await a.broadcast([], b"abcd")
    await a.close()


async def test_timed_out_send_logs_nothing_and_says_how_long_it_waited():
    loop = asyncio.get_running_loop()
    seen = []
    loop.set_exception_handler(lambda lp, ctx: seen.append(ctx))
    silent = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)  # bound, never answers
    silent.bind(("127.0.0.1", 0))
    a = await ltp.open_endpoint(("127.0.0.1", 0))
    try:
        with pytest.raises(TransferTimeout) as ei:
            await a.send(silent.getsockname(), np.ones(1000, np.float32), timeout=0.1)
        msg = str(ei.value)
        assert "0.1 s" in msg and "gave up after 0.1" in msg
        await asyncio.sleep(0.05)
        gc.collect()
        await asyncio.sleep(0)
        assert not [c for c in seen if "never retrieved" in str(c.get("message", ""))], seen
    finally:
        await a.close()
        silent.close()
        loop.set_exception_handler(None)


async def test_recv_timeout_message_states_the_wait():
    a = await ltp.open_endpoint(("127.0.0.1", 0))
    with pytest.raises(TransferTimeout) as ei:
        await a.recv(bytearray(8), timeout=0.05)
    assert "None" not in str(ei.value) and "0.05 s timeout" in str(ei.value) and "waited 0.0" in str(ei.value)
    await a.close()


async def test_blocking_socket_inside_a_running_loop_raises():
    with pytest.raises(LocalProtocolError, match="running asyncio event loop"):
        ltp.Socket(("127.0.0.1", 0))
    s = await asyncio.to_thread(ltp.Socket, ("127.0.0.1", 0))  # from a worker thread it is fine
    try:
        with pytest.raises(LocalProtocolError, match="await ep.send"):
            s.send(("127.0.0.1", 9), b"abcd")
    finally:
        await asyncio.to_thread(s.close)


def test_blocking_socket_outside_a_loop_works():
    with ltp.Socket(("127.0.0.1", 0)) as a, ltp.Socket(("127.0.0.1", 0)) as b:
        import threading
        out = bytearray(4)
        t = threading.Thread(target=lambda: b.recv(out))
        t.start()
        a.send(b.local_addr, b"abcd")
        t.join(10)
        assert bytes(out) == b"abcd"


async def test_port_in_use_names_the_address_and_the_fix():
    a = await ltp.open_endpoint(("127.0.0.1", 0))
    port = a.local_addr[1]
    with pytest.raises(OSError, match=rf"127.0.0.1:{port}.*already in use.*port 0") as ei:
        await ltp.open_endpoint(("127.0.0.1", port))
    import errno
    assert ei.value.errno == errno.EADDRINUSE
    await a.close()


@pytest.mark.parametrize("local", [("127.0.0.1", 70000), ("127.0.0.1",), "127.0.0.1:0", (1, 2)])
async def test_bad_local_address_is_refused_up_front(local):
    with pytest.raises(LocalProtocolError, match="local_addr"):
        await ltp.open_endpoint(local)


def test_a_segment_size_that_receivers_refuse_is_a_config_error():
    """Config(segment_size=3) was accepted and every multi-packet message then drew bad_registration."""
    with pytest.raises(LocalProtocolError, match="min_segment_size"):
        Config(segment_size=3)
    assert Config(segment_size=32, min_segment_size=16).segment_size == 32
