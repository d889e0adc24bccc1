"""A control stream (``ControlChannel``) over real LTP on loopback whose sender goes silent half-way through a
message, as a PS SIGSTOPped while it sends a grant batch does.

Found by the project's CI (``test_pause_launch.py``, ``hoplite``, the PS paused for 10 s): the PS stopped in the
middle of a multi-datagram grant batch to worker 0.  The worker's LTP closed the flow as idle after
``idle_timeout_s`` (10 s) with part of it in; its control stream decoded the part, failed, and moved on to the next
sequence number; the resumed PS heard STOP ``deadline`` and counted the batch sent.  The worker waited 60 s for a
message that never came and left to rejoin.  Now the receiver reads that sequence number again and the sender
sends a message its peer's receive closed without again (``TURNED_AWAY_RESENDS``).

The pause is played by a relay between the two endpoints that lets the first datagrams of the message through
and then drops the sender's datagrams for longer than the receiver's ``idle_timeout_s``.
"""

from __future__ import annotations

import asyncio

import pytest

from ltp_ps.errors import TransportTimeout
from ltp_ps.schedules.driver import DOWN, TURNED_AWAY_RESENDS, UP, ControlChannel
from ltp_ps.schedules.executor import Executor
from ltp_ps.transport.ltp import LtpTransport

pytestmark = pytest.mark.timeout(60)

IDLE_S = 0.4  # the receiver's idle_timeout_s
# no job key: REG MACs bind the source address, and the relay is the source each end sees


class _Relay:
    """Two UDP sockets between a sender S and a receiver R: S sends to ``to_r``, R to ``to_s``.  After
    ``pass_first`` datagrams from S, S's datagrams are dropped for ``hold_s`` (S "paused"); R's always pass."""

    def __init__(self, s_addr, r_addr, *, pass_first: int, hold_s: float):
        self.s_addr, self.r_addr = s_addr, r_addr
        self.pass_first, self.hold_s = pass_first, hold_s
        self.from_s = 0
        self.dropped = 0
        self.hold_until = None

    async def start(self):
        loop = asyncio.get_running_loop()
        relay = self

        class _Side(asyncio.DatagramProtocol):
            def __init__(self, forward):
                self.forward = forward

            def connection_made(self, transport):
                self.transport = transport

            def datagram_received(self, data, addr):
                self.forward(data)

        self._s_side, _ = await loop.create_datagram_endpoint(lambda: _Side(self._from_s), local_addr=("127.0.0.1", 0))
        self._r_side, _ = await loop.create_datagram_endpoint(lambda: _Side(self._from_r), local_addr=("127.0.0.1", 0))
        self.to_r = self._s_side.get_extra_info("sockname")  # where S sends (R's address as S sees it)
        self.to_s = self._r_side.get_extra_info("sockname")  # where R sends
        del relay

    def _from_s(self, data):
        loop = asyncio.get_running_loop()
        self.from_s += 1
        if self.from_s == self.pass_first + 1:
            self.hold_until = loop.time() + self.hold_s
        if self.hold_until is not None and loop.time() < self.hold_until:
            self.dropped += 1
            return
        self._r_side.sendto(data, self.r_addr)

    def _from_r(self, data):
        self._s_side.sendto(data, self.s_addr)

    def close(self):
        self._s_side.close()
        self._r_side.close()


async def _pair(*, pass_first: int, hold_s: float, sender_patience=None):
    s_tr = await LtpTransport.open("127.0.0.1", 0, config_kwargs={"peer_silence_min_s": 5.0})
    r_tr = await LtpTransport.open("127.0.0.1", 0, config_kwargs={"idle_timeout_s": IDLE_S})
    relay = _Relay(s_tr.local_addr, r_tr.local_addr, pass_first=pass_first, hold_s=hold_s)
    await relay.start()
    ps = ControlChannel(Executor(s_tr, "server:0", {"worker:0": relay.to_r}), "worker:0", out_dir=DOWN, in_dir=UP,
                        patience_s=sender_patience)
    worker = ControlChannel(Executor(r_tr, "worker:0", {"server:0": relay.to_s}), "server:0", out_dir=UP,
                            in_dir=DOWN)
    return ps, worker, relay, (s_tr, r_tr)


async def _close(relay, transports):
    relay.close()
    for t in transports:
        await t.close()


async def test_a_message_whose_sender_stalls_half_way_arrives_whole_and_the_stream_stays_in_order():
    ps, worker, relay, trs = await _pair(pass_first=4, hold_s=3 * IDLE_S)
    try:
        big = {"grants": ["x" * 100] * 300}  # ~31 kB of JSON: ~22 datagrams
        async def read_two():
            return [await worker.recv(20.0), await worker.recv(20.0)]  # one read at a time, as the roles read

        got = asyncio.ensure_future(read_two())
        await ps.send(big, timeout_s=10.0)
        await ps.send({"n": 2}, timeout_s=10.0)
        first, second = await asyncio.wait_for(got, 20.0)
    finally:
        await _close(relay, trs)
    assert relay.dropped > 0, "the relay never played the pause"
    assert worker.partial >= 1 and ps.resends >= 1, (worker.partial, ps.resends)
    assert first == big and second == {"n": 2}


async def test_a_message_turned_away_every_time_fails_after_its_resends():
    """A peer that no longer reads the stream (its receive for that number timed out and it never reads it
    again): the message is sent ``1 + TURNED_AWAY_RESENDS`` times, then the send fails, not "sent"."""
    ps, worker, relay, trs = await _pair(pass_first=10**9, hold_s=0.0)
    try:
        assert await worker.recv(0.05) is None  # read once, timed out, never read again
        with pytest.raises(TransportTimeout, match="turned away"):
            await ps.send({"n": 1}, timeout_s=5.0)
    finally:
        await _close(relay, trs)
    assert ps.resends == TURNED_AWAY_RESENDS


async def test_a_patient_sender_turned_away_backs_off_instead_of_spinning():
    """A worker's channel (patience: its --pull-timeout) whose PS no longer reads the stream: the copies it sends
    again within its patience are spaced out (doubling up to RESEND_BACKOFF_MAX_S), not one per round trip."""
    ps, worker, relay, trs = await _pair(pass_first=10**9, hold_s=0.0, sender_patience=1.5)
    try:
        assert await worker.recv(0.05) is None
        t0 = asyncio.get_running_loop().time()
        with pytest.raises(TransportTimeout, match="turned away"):
            await ps.send({"n": 1}, timeout_s=5.0)
        took = asyncio.get_running_loop().time() - t0
    finally:
        await _close(relay, trs)
    assert 1.5 <= took < 4.0, took
    assert TURNED_AWAY_RESENDS <= ps.resends <= 9, ps.resends  # 0.02 s doubling: ~7 copies in 1.5 s, not hundreds
