"""A process tells its own stall from a peer's silence (``ltp_ps.stall_watch``), and a worker's control stream
outlasts a paused PS (``ControlChannel(patience_s=...)``).

Found with ``ltp-ps launch --schedule hoplite`` (and ``mlfabric``) and the PS SIGSTOPped for 15 s: every worker's
control send failed at LTP's 5 s dead-peer limit and the worker left to rejoin (which those PS loops never
serve), and the resumed PS wrote every worker off as "silent for 10 s" -- the silence was its own.
"""

from __future__ import annotations

import asyncio

import pytest

from ltp_ps import stall_watch
from ltp_ps.errors import TransportTimeout
from ltp_ps.schedules.driver import DOWN, UP, ControlChannel, next_control_message
from ltp_ps.schedules.executor import Executor
from ltp_ps.transport.memory import MemoryNetwork

pytestmark = pytest.mark.timeout(30)


class _Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def test_a_gap_between_ticks_is_a_stall_seen_even_before_the_next_tick():
    clock = _Clock()
    w = stall_watch.StallWatch(clock)
    w.tick()
    clock.t += stall_watch.TICK_S
    w.tick()
    assert not w.stalled_since(90.0) and w.stalls == 0
    clock.t += 15.0  # SIGSTOP for 15 s: on resume the silence timers fire before the ticker runs
    assert w.stalled_since(clock.t - 10.0)  # pending: the last tick is too old
    w.tick()
    assert w.stalls == 1 and w.stalled_since(clock.t - 10.0)
    for _ in range(80):  # 20 s of running normally
        clock.t += stall_watch.TICK_S
        w.tick()
    assert not w.stalled_since(clock.t - 10.0)  # a window that began after the stall: a real silence


async def test_one_watch_per_loop_ticks_on_its_own():
    w = stall_watch.watch()
    assert stall_watch.watch() is w
    t = w.last_tick
    await asyncio.sleep(stall_watch.TICK_S * 2.5)
    assert w.last_tick > t


class _Silent:
    """A control stream whose first ``n`` receives time out."""

    def __init__(self, n):
        self.n = n

    async def recv(self, timeout_s):
        if self.n:
            self.n -= 1
            return None
        return {"alive": True}


async def test_a_silence_that_overlaps_our_own_stall_gets_a_fresh_window(monkeypatch):
    fake = type("W", (), {"clock": staticmethod(lambda: 0.0), "stalled_since": lambda self, t0: True})()
    monkeypatch.setattr(stall_watch, "watch", lambda: fake)
    failed, counters = [], {"undecodable": 0, "closed": 0, "silent": 0}
    assert await next_control_message(_Silent(2), 10.0, counters, failed.append) == {"alive": True}
    assert failed == [] and counters["own_stall"] == 2


async def test_a_real_silence_still_fails_the_worker():
    failed, counters = [], {"undecodable": 0, "closed": 0, "silent": 0}
    assert await next_control_message(_Silent(1), 10.0, counters, failed.append) is None
    assert failed == ["silent for 10 s"] and counters["silent"] == 1


async def test_a_control_send_outlasts_a_paused_peer_with_patience_and_keeps_the_stream_in_order():
    net = MemoryNetwork()
    a, b = net.endpoint(), net.endpoint()
    exa = Executor(a, "worker:0", {"server:0": b.local_addr})
    exb = Executor(b, "server:0", {"worker:0": a.local_addr})
    up = ControlChannel(exa, "server:0", out_dir=UP, in_dir=DOWN, patience_s=5.0)
    ps_side = ControlChannel(exb, "worker:0", out_dir=DOWN, in_dir=UP)
    net.stall(b.local_addr)  # the PS is stopped

    async def resume_later():
        # after two timed-out tries, not after a fixed time: the executor's first run may import for longer than
        # that on a slow machine (2.2 s once, alone), and the PS would be back before the first try began
        while up.retries < 2:
            await asyncio.sleep(0.01)
        net.resume(b.local_addr)

    await asyncio.gather(up.send({"n": 1}, timeout_s=0.1), resume_later())
    await up.send({"n": 2}, timeout_s=0.1)
    assert up.retries >= 2
    assert [await ps_side.recv(2.0), await ps_side.recv(2.0)] == [{"n": 1}, {"n": 2}]


async def test_without_patience_a_control_send_to_a_paused_peer_fails():
    net = MemoryNetwork()
    a, b = net.endpoint(), net.endpoint()
    ch = ControlChannel(Executor(a, "worker:0", {"server:0": b.local_addr}), "server:0", out_dir=UP, in_dir=DOWN)
    net.stall(b.local_addr)
    with pytest.raises(TransportTimeout):
        await ch.send({"n": 1}, timeout_s=0.1)
    assert ch.retries == 0
