"""ltp_ps's LTP transport: a send the receiver refuses for want of room is retried (back-pressure), others fail."""

import asyncio
import types

import pytest

import ltp
from ltp_ps.errors import TransportError
from ltp_ps.transport import ltp as T


class _Ep:
    def __init__(self, refusals):
        self.refusals = list(refusals)
        self.calls = []

    async def send(self, peer, data, **kw):
        self.calls.append(kw["timeout"])
        if self.refusals:
            raise ltp.errors.TransferRefused(self.refusals.pop(0))
        return types.SimpleNamespace(peer=peer, tag=kw["tag"], total_bytes=len(data), delivered_bytes=len(data),
                                     delivered_fraction=1.0, duration_s=0.0, close_reason="acked", reliable=True)

    local_addr = ("127.0.0.1", 1)


def _transport(refusals):
    ep = _Ep(refusals)
    return T.LtpTransport(ep, ltp, None), ep


def test_refused_for_room_is_retried_until_it_goes_through(monkeypatch):
    monkeypatch.setattr(T, "REFUSED_RETRY_S", 0.001)
    tr, ep = _transport(["out_of_memory", "too_many_flows", "out_of_memory"])
    r = asyncio.run(tr.send(("127.0.0.1", 2), b"abcd", reliable=True, tag=3, timeout=5.0))
    assert r.delivered_fraction == 1.0 and tr.refused_retries == 3 and len(ep.calls) == 4
    assert ep.calls[0] == pytest.approx(5.0, abs=0.05) and ep.calls[-1] < ep.calls[0]  # one budget for all tries


@pytest.mark.parametrize("reason", ["unauthenticated", "too_large", "stale"])
def test_other_refusals_fail_at_once(reason):
    tr, ep = _transport([reason])
    with pytest.raises(TransportError, match=reason):
        asyncio.run(tr.send(("127.0.0.1", 2), b"abcd", tag=3, timeout=5.0))
    assert len(ep.calls) == 1


def test_back_pressure_gives_up_when_the_timeout_is_spent(monkeypatch):
    monkeypatch.setattr(T, "REFUSED_RETRY_S", 0.05)
    tr, ep = _transport(["out_of_memory"] * 100)
    with pytest.raises(TransportError, match="out_of_memory"):
        asyncio.run(tr.send(("127.0.0.1", 2), b"abcd", tag=3, timeout=0.3))
    assert 2 <= len(ep.calls) <= 5
