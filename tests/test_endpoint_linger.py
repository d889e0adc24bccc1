"""Loopback tier: ``Endpoint.close(linger=...)``, the receiver's TIME_WAIT.

A receive completes; its last ACKs and its STOP are lost on the way back.  The sender probes again: a closed
port answers with an ICMP unreachable (the send fails with PeerUnreachable, or times out where no ICMP comes),
a lingering endpoint with the STOP (the send completes).  ``ltp-bench``'s sender failed this way on a lossy
path before its receiver lingered.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

import ltp
from ltp.blocking import Socket
from ltp.errors import LocalProtocolError, PeerUnreachable, TransferTimeout

pytestmark = pytest.mark.timeout(60)


class MutedIO:
    """Wraps an endpoint's UdpIO: while ``muted``, every datagram it is asked to send is dropped (counted)."""

    def __init__(self, io) -> None:
        self._io = io
        self.muted = True
        self.dropped = 0

    def __getattr__(self, name):
        return getattr(self._io, name)

    def send(self, addr, data, segment_size):
        if self.muted:
            self.dropped += 1
            return len(data)
        return self._io.send(addr, data, segment_size)

    def send_many(self, items):
        if self.muted:
            self.dropped += len(items)
            return len(items)
        return self._io.send_many(items)

    def send_segments(self, addr, headers, payload, seqs, seg_size, total, **kw):
        if self.muted:
            self.dropped += len(seqs)
            return len(seqs)
        return self._io.send_segments(addr, headers, payload, seqs, seg_size, total, **kw)


async def _received_with_every_answer_lost(linger: float, *, answers_after: bool = True):
    """``a`` sends 8 kB reliably (inside the initial window, so it needs no ACK to get it all out) to ``b``, whose
    every answer is lost until its receive is complete; ``b`` then closes with ``linger``, its answers getting
    through from then on if ``answers_after`` (else the close's own STOPs are lost too).  Returns the outcome of
    ``a``'s send (its report or its exception), what ``b`` dropped, and whether the send had ended while ``b``
    still lingered."""
    a = await ltp.open_endpoint(("127.0.0.1", 0))
    b = await ltp.open_endpoint(("127.0.0.1", 0))
    b._io = muted = MutedIO(b._io)
    data = np.arange(2048, dtype=np.float32)
    out = np.zeros_like(data)
    async with a:
        send = asyncio.ensure_future(a.send(b.local_addr, data, reliable=True, tag=1, timeout=5.0))
        report = await b.recv(out, peer=a.local_addr, tag=1)
        assert report.regime == "complete" and np.array_equal(out, data)
        assert not send.done()  # it heard nothing: not an ACK, not the STOP
        muted.muted = not answers_after
        closing = asyncio.ensure_future(b.close(linger=linger))
        await asyncio.wait([send], timeout=linger / 2 if linger else None)
        during_linger = send.done() and not closing.done()
        await closing
        outcome = await asyncio.gather(send, return_exceptions=True)
    return outcome[0], muted.dropped, during_linger


async def test_a_lingering_receiver_answers_the_probe_of_a_sender_whose_last_acks_were_lost():
    outcome, dropped, during_linger = await _received_with_every_answer_lost(linger=1.0)
    assert dropped > 0
    assert not isinstance(outcome, BaseException), outcome
    assert outcome.delivered_fraction == 1.0 and outcome.reliable
    assert during_linger  # the probe's answer ended it, not the STOPs the close sends when the linger is over


async def test_without_linger_the_closing_stops_answer_the_same_sender():
    """A close sends the STOP of every flow received in the last second once more (``CLOSING_STOP_WINDOW_S``)."""
    outcome, _, _ = await _received_with_every_answer_lost(linger=0.0)
    assert not isinstance(outcome, BaseException), outcome
    assert outcome.delivered_fraction == 1.0


async def test_without_linger_a_sender_whose_closing_stop_is_lost_too_fails_although_its_message_arrived():
    """The case linger is for: the probe finds a closed port."""
    outcome, _, _ = await _received_with_every_answer_lost(linger=0.0, answers_after=False)
    assert isinstance(outcome, (PeerUnreachable, TransferTimeout)), outcome


async def test_a_lingering_endpoint_takes_no_new_calls_and_a_cancelled_linger_still_closes():
    a = await ltp.open_endpoint(("127.0.0.1", 0))
    closing = asyncio.ensure_future(a.close(linger=30.0))
    await asyncio.sleep(0.05)
    with pytest.raises(LocalProtocolError, match="closing"):
        await a.send(("127.0.0.1", 9), b"x")
    with pytest.raises(LocalProtocolError, match="closing"):
        await a.recv(bytearray(4), peer=("127.0.0.1", 9))
    closing.cancel()
    with pytest.raises(asyncio.CancelledError):
        await closing
    with pytest.raises(LocalProtocolError, match="is closed"):
        await a.send(("127.0.0.1", 9), b"x")


async def test_a_close_called_while_lingering_closes_at_once():
    a = await ltp.open_endpoint(("127.0.0.1", 0))
    lingering = asyncio.ensure_future(a.close(linger=30.0))
    await asyncio.sleep(0.05)
    await asyncio.wait_for(a.close(), 2.0)
    with pytest.raises(LocalProtocolError, match="is closed"):
        await a.send(("127.0.0.1", 9), b"x")
    lingering.cancel()
    await asyncio.gather(lingering, return_exceptions=True)


@pytest.mark.parametrize("bad", [-1, float("inf"), float("nan"), True, "1", None])
async def test_a_bad_linger_is_refused_and_the_endpoint_stays_open(bad):
    async with await ltp.open_endpoint(("127.0.0.1", 0)) as a:
        with pytest.raises(LocalProtocolError, match="linger"):
            await a.close(linger=bad)
        assert not a._closed


def test_the_blocking_socket_lingers_too():
    s = Socket(("127.0.0.1", 0))
    with pytest.raises(LocalProtocolError, match="linger"):
        s.close(linger=-0.5)
    s.close(linger=0.2)
    with pytest.raises(LocalProtocolError):
        s.send(("127.0.0.1", 9), b"x")
