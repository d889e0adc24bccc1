"""A cancelled transfer leaves no "Future exception was never retrieved" behind (issue 7, mlfabric shutdown).

The PS's mlfabric role cancels its listener and grant tasks at the end of a job;
a reliable send in flight in one of them was failed by the engine with
``TransferAborted('send cancelled')`` on a future nobody awaited any more, and
asyncio logged it at garbage collection.
"""

from __future__ import annotations

import asyncio
import gc
import socket

import numpy as np
import pytest

import ltp

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("timeout", [30.0, None])
async def test_cancelled_send_and_receive_log_no_unretrieved_exception(timeout):
    loop = asyncio.get_running_loop()
    seen = []
    loop.set_exception_handler(lambda _loop, ctx: seen.append(ctx))
    a = await ltp.open_endpoint(("127.0.0.1", 0))
    b = await ltp.open_endpoint(("127.0.0.1", 0))
    sink = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)  # bound, never answers: the send stays in flight
    sink.bind(("127.0.0.1", 0))
    try:
        big = np.ones(1_000_000, np.uint8)
        send = asyncio.ensure_future(a.send(sink.getsockname(), big, reliable=True, timeout=timeout))
        recv = asyncio.ensure_future(b.recv(np.zeros(16, np.uint8), peer=a.local_addr, tag=99, timeout=timeout))
        await asyncio.sleep(0.05)
        send.cancel()
        recv.cancel()
        res = await asyncio.gather(send, recv, return_exceptions=True)
        assert all(isinstance(r, asyncio.CancelledError) for r in res), res
        del send, recv, res  # their CancelledError tracebacks hold the endpoint's frames (and its future)
        await asyncio.sleep(0.05)  # let the engine's events for the cancelled flows be processed
        gc.collect()
        await asyncio.sleep(0)
    finally:
        await a.close()
        await b.close()
        sink.close()
    gc.collect()
    await asyncio.sleep(0)
    assert not [c for c in seen if "never retrieved" in str(c.get("message", ""))], seen
