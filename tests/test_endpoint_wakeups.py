"""How often the asyncio adapter wakes up, and what each wake-up costs (issue 8: CPU per byte).

Three adapter rules, each pinned here:

* a timer due within the loop's resolution waits one tick instead of spinning (uvloop rounds a
  sub-millisecond delay to zero: a receiver waiting out its ACK delay used to fire its timer,
  find nothing due and re-arm it, thousands of times per transfer);
* the socket sits in the writing epoll set only while the adapter wants room (an entry on the
  socket's wait queue is woken by every datagram the kernel frees);
* one wake-up reads until the socket is empty, not until the first short batch (unless that
  batch held only a few datagrams: then they arrive slower than they are processed);
* a socket that wakes a receiving endpoint several times a loop tick, one datagram or a few dozen at a
  time, is read on the timer instead, once a tick (receive polling), and watched again when it quietens;

and the engine's handling of the kernel arrival times the adapter passes through unshifted.
"""

from __future__ import annotations

import asyncio
import random
import select

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import ltp
import ltp_ext
from ltp import wire
from ltp.config import Config
from ltp.endpoint import DRAIN_MIN_DATAGRAMS, LOOP_TIMER_RESOLUTION_S, timer_delay
from ltp.engine import QUICKACK_SEGMENTS, Engine

pytestmark = pytest.mark.timeout(120)


# ---------------------------------------------------------------------------- the timer delay rule
@settings(max_examples=300, deadline=None)
@given(now=st.floats(0.0, 1e6), ahead=st.floats(-1.0, 1.0))
def test_timer_delay_is_never_early_never_below_the_loop_resolution(now, ahead):
    when = now + ahead
    d = timer_delay(when, now)
    assert d > 0
    assert now + d >= when  # the engine never sees its timer early
    if when > now:
        assert d >= LOOP_TIMER_RESOLUTION_S  # no zero-delay timer the loop would fire at once
        assert d <= max(when - now, LOOP_TIMER_RESOLUTION_S) + 1e-5  # and not later than one tick
    else:
        assert d <= 1e-5  # already due: the next loop iteration


def test_timer_delay_examples():
    assert timer_delay(10.0005, 10.0) == LOOP_TIMER_RESOLUTION_S
    assert timer_delay(10.0, 10.0) < 1e-5
    assert timer_delay(9.0, 10.0) < 1e-5
    assert abs(timer_delay(10.25, 10.0) - 0.25) < 1e-5


# ---------------------------------------------------------------------------- loopback endpoints
async def _periodic_timer(period_s: float, run_s: float) -> tuple:
    """``(timer wake-ups, seconds elapsed)`` of an endpoint whose engine asks for a wake-up every
    ``period_s``."""
    ep = await ltp.open_endpoint(("127.0.0.1", 0))
    try:
        due = [ltp.endpoint._now() + period_s]

        def get_timer():  # a timer kind that re-arms itself period_s after it was due
            now = ltp.endpoint._now()
            while due[0] <= now:
                due[0] += period_s
            return due[0]

        ep.engine.get_timer = get_timer
        t0 = ltp.endpoint._now()
        ep._flush()
        await asyncio.sleep(run_s)
        return ep.loop_stats["timer"], ltp.endpoint._now() - t0
    finally:
        await ep.close()


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_sub_millisecond_timer_waits_a_loop_tick_instead_of_spinning(loop):
    """Regression: uvloop rounds a 0.5 ms delay to zero, so a receiver waiting out its 0.5 ms ACK
    delay fired its timer, found nothing due, re-armed it... (measured in the lab: 12,967 timer
    wake-ups and 8,399 empty reads per 800 MB). Now one wake-up per loop tick at most."""
    run_s = 0.05
    if loop == "uvloop":
        uvloop = pytest.importorskip("uvloop")
        fired, elapsed = uvloop.run(_periodic_timer(0.0005, run_s))
    else:
        fired, elapsed = asyncio.run(_periodic_timer(0.0005, run_s))
    # at most one per loop tick (about 50) plus slack, however long a loaded machine made the
    # sleep last; the spin fired thousands of times in 50 ms
    assert 1 <= fired <= elapsed / LOOP_TIMER_RESOLUTION_S + 10, (fired, elapsed)


async def _messages(n_msgs: int):
    """``n_msgs`` reliable messages; the receiver acknowledges on its ACK-delay timer or at the end."""
    # ack_every above the packet count: between bursts every ACK waits for the ack_delay_s timer
    cfg = Config(ack_every=4096, ack_delay_s=0.0005)
    a = await ltp.open_endpoint(("127.0.0.1", 0), config=cfg)
    b = await ltp.open_endpoint(("127.0.0.1", 0), config=cfg)
    try:
        data = (np.arange(300_000) % 251).astype(np.uint8)
        for i in range(n_msgs):
            buf = np.zeros_like(data)
            rx = asyncio.ensure_future(b.recv(buf, tag=i, timeout=10))
            rep = await a.send(b.local_addr, data, reliable=True, tag=i, timeout=10)
            assert rep.delivered_fraction == 1.0
            assert (await rx).regime == "complete"
            assert np.array_equal(buf, data)
        return dict(b.loop_stats)
    finally:
        await a.close()
        await b.close()


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_acks_held_for_the_ack_delay_still_flow(loop):
    """With every ACK held for the ACK-delay timer, transfers complete bit-exact and the receiver
    wakes for its timer a few times per message, not tens (the uvloop spin: 21 for 10 messages).  Timer wake-ups
    that read the socket while it polls (receive polling, once a tick at most) are reads, not spins: not counted."""
    n = 10
    if loop == "uvloop":
        uvloop = pytest.importorskip("uvloop")
        stats = uvloop.run(_messages(n))
    else:
        stats = asyncio.run(_messages(n))
    assert stats["timer"] - stats["polls"] <= n, stats


async def _watch_sets():
    ep = await ltp.open_endpoint(("127.0.0.1", 0))
    try:
        w = ep._watch
        if w._wset is None:
            pytest.skip("no epoll on this platform: the socket is watched directly")
        # an idle, writable socket: nothing is registered for room, so nothing is ready
        assert w._wset.poll(0) == []
        w.want_writable(True)
        assert w._wset.poll(0) == [(ep._sock.fileno(), select.EPOLLOUT)]
        w.want_writable(False)
        assert w._wset.poll(0) == []
        w.want_writable(True)  # and again: registering twice must not fail
        w.want_writable(False)
    finally:
        await ep.close()


def test_socket_joins_the_writing_set_only_while_room_is_wanted():
    asyncio.run(_watch_sets())


class _ScriptedIO:
    """A UdpIO stand-in whose ``recv_batch`` returns a scripted number of garbage datagrams."""

    def __init__(self, counts, batch):
        self.counts = list(counts)
        self.batch = batch
        self.calls = 0
        self.timestamps_enabled = False
        self.recverr_enabled = False
        self.socket_drops = 0
        self.buffer = memoryview(bytearray(64 * batch))
        self.offsets = np.arange(batch, dtype=np.int64) * 64
        self.lengths = np.full(batch, 3, np.int64)
        self._n = 0

    def recv_batch(self):
        self.calls += 1
        self._n = self.counts.pop(0) if self.counts else 0
        return self._n

    def __len__(self):
        return self._n

    def runs(self, start=0):
        return [(("127.0.0.9", 9), start, self._n)] if self._n > start else []


async def _drain():
    batch = 4 * DRAIN_MIN_DATAGRAMS
    k = DRAIN_MIN_DATAGRAMS
    ep = await ltp.open_endpoint(("127.0.0.1", 0), config=Config(io_batch=batch))
    try:
        # short batches of several datagrams: more arrived while we worked, read on
        io = _ScriptedIO([k, k, batch, k], batch=batch)
        real, ep._io = ep._io, io
        ep._receive_pending(woken=True)
        assert io.calls == 5  # four batches, then the empty read that ends the wake-up
        assert ep.stats.datagrams_in == 3 * k + batch
        assert sum(ep.stats.dropped.values()) == 3 * k + batch  # garbage: dropped and counted
        # a batch of fewer than DRAIN_MIN_DATAGRAMS: arrivals are sparse, no second (empty) read
        io = ep._io = _ScriptedIO([1, 5], batch=batch)
        ep._receive_pending(woken=True)
        ep._io = real
        assert io.calls == 1
    finally:
        await ep.close()


def test_one_wake_up_reads_until_the_socket_is_empty():
    asyncio.run(_drain())


# ---------------------------------------------------------------------------- kernel arrival times
def _ack_for_one_packet():
    """A sender engine with one DATA packet sent at t=0, and the receiver's ACK datagram for it."""
    A, B = ("10.0.0.1", 1), ("10.0.0.2", 2)
    snd = Engine(Config(), rng=random.Random(1), local_addr=A)
    rcv = Engine(Config(ack_every=1), rng=random.Random(2), local_addr=B)
    data = np.ones(100, np.uint8)
    rcv.post_receive([(A, 0, np.zeros(100, np.uint8))], now=0.0)
    snd.send(B, data, now=0.0, reliable=True)
    for tx in snd.datagrams_to_send(0.0):
        for d in tx.datagrams():
            rcv.receive_datagram(d, A, 0.001)
    acks = [d for tx in rcv.datagrams_to_send(0.001) for d in tx.datagrams()
            if d[0] & 0x0F == wire.T_ACK and len(d) > wire.HEADER_SIZE]  # not the REG's empty answer
    assert len(acks) == 1, "the receiver did not acknowledge the packet in one ACK"
    return snd, B, acks[0]


def _feed(snd, addr, ack, times, offset, now):
    buf = bytearray(ack)
    snd.receive_batch(buf, np.zeros(1, np.int64), np.array([len(ack)], np.int64), 0, 1, addr, now,
                      times, times_offset=offset)
    return snd._paths[addr].srtt


def test_ack_is_timed_by_its_kernel_arrival_shifted_onto_the_engine_clock():
    snd, addr, ack = _ack_for_one_packet()
    # arrived at t = 0.010 on the engine clock (wall clock 1e9 + 0.010), read late at 0.050
    srtt = _feed(snd, addr, ack, np.array([1e9 + 0.010]), 1e9, now=0.050)
    assert srtt == pytest.approx(0.010, abs=1e-6)


def test_unknown_kernel_time_falls_back_to_now():
    snd, addr, ack = _ack_for_one_packet()
    srtt = _feed(snd, addr, ack, np.array([-1.0]), 1e9, now=0.050)
    assert srtt == pytest.approx(0.050, abs=1e-6)


def test_times_without_offset_are_on_the_engine_clock():
    snd, addr, ack = _ack_for_one_packet()
    srtt = _feed(snd, addr, ack, np.array([0.020]), None, now=0.050)
    assert srtt == pytest.approx(0.020, abs=1e-6)


# ---------------------------------------------------------------------------- early ACKs
class _Feed:
    """A receiver engine with one registered reliable flow of ``n`` segments, fed DATA by hand."""

    A, B = ("10.0.0.1", 1), ("10.0.0.2", 2)

    def __init__(self, n: int = 400) -> None:
        self.snd = Engine(Config(), rng=random.Random(1), local_addr=self.A)
        self.rcv = Engine(Config(), rng=random.Random(2), local_addr=self.B)
        seg = Config().segment_size_for(1)
        self.data = (np.arange(n * seg) % 251).astype(np.uint8)
        self.dest = np.zeros_like(self.data)
        self.rcv.post_receive([(self.A, 0, self.dest)], now=0.0)
        self.snd.send(self.B, self.data, now=0.0, reliable=True)
        for tx in self.snd.datagrams_to_send(0.0):
            for d in tx.datagrams():
                if d[0] & 0x0F == wire.T_REG:
                    self.rcv.receive_datagram(d, self.A, 0.0)
        flow = next(iter(self.snd._tx.values()))
        out = bytearray(16 * n)
        flow.window.build(np.arange(n, dtype=np.int64), 0.0, 0, 0.0, 0.0, 0, out, True)
        self.dgs = [bytes(out[16 * k:16 * k + 16]) + self.data[k * seg:(k + 1) * seg].tobytes() for k in range(n)]
        self.next = 0

    def deliver(self, k: int, now: float) -> None:
        for d in self.dgs[self.next:self.next + k]:
            self.rcv.receive_datagram(d, self.A, now)
        self.next += k

    def acks(self, now: float) -> list:
        return [d for tx in self.rcv.datagrams_to_send(now) for d in tx.datagrams()
                if d[0] & 0x0F == wire.T_ACK and len(d) > wire.HEADER_SIZE]


def test_flush_acks_sends_a_slow_start_round_early_and_holds_a_lone_late_entry():
    from ltp.engine import EARLY_ACK_MIN_ENTRIES, QUICKACK_SEGMENTS

    f = _Feed(n=QUICKACK_SEGMENTS + 40)
    r, tick = f.rcv, LOOP_TIMER_RESOLUTION_S
    f.deliver(1, 0.001)  # a flow's first segment: its sender may be waiting for this ACK
    assert r.flush_acks(0.001, due_by=0.001 + tick) == 1
    assert len(f.acks(0.001)) == 1
    f.deliver(QUICKACK_SEGMENTS, 0.002)  # past the quick-ACK phase
    f.acks(0.002)
    f.deliver(1, 0.003)  # a lone entry of a slow flow waits (for company or the timer)
    assert r.flush_acks(0.003, due_by=0.003 + tick) == 0
    f.deliver(EARLY_ACK_MIN_ENTRIES - 1, 0.003)  # now enough entries: out early
    assert r.flush_acks(0.003, due_by=0.003 + tick) == 1
    f.deliver(EARLY_ACK_MIN_ENTRIES, 0.004)
    # not due within the horizon (ack_delay_s = 0.5 ms after 0.004): held
    assert r.flush_acks(0.004, due_by=0.004 + 0.0001) == 0
    assert r.flush_acks(0.004) == 1  # due_by None: everything pending, now
    assert r.flush_acks(0.004, due_by=1.0) == 0  # nothing left
    got = f.acks(0.004)
    assert len(got) == 2


def _acked_seqs(acks) -> list:
    out = []
    for a in acks:
        w3 = wire.unpack_header(a)[5]
        out += (wire.unpack_ack_entries(a, w3) >> 8).tolist()
    return out


def test_early_acks_do_not_change_what_is_acknowledged():
    """Every segment is acknowledged exactly once whether ACKs go early or on the timer; early
    ones are smaller and more frequent, never later."""
    counts = {}
    for early in (False, True):
        f = _Feed(n=300)
        now, seqs, n_acks = 0.0, [], 0
        while f.next < len(f.dgs):
            now += 0.0002
            f.deliver(3, now)
            if early:
                f.rcv.flush_acks(now, due_by=now + LOOP_TIMER_RESOLUTION_S)
            got = f.acks(now)
            n_acks += len(got)
            seqs += _acked_seqs(got)
        got = f.acks(now + 0.01)  # what the flow's close did not already send
        n_acks += len(got)
        seqs += _acked_seqs(got)
        assert np.array_equal(f.dest, f.data)
        assert sorted(seqs) == list(range(300))
        counts[early] = n_acks
    assert counts[True] > counts[False]


async def _cold_messages(n: int) -> int:
    """Receiver timer wake-ups over ``n`` first messages on fresh paths (slow start from 10 packets)."""
    fired = 0
    for _ in range(n):
        a = await ltp.open_endpoint(("127.0.0.1", 0))
        b = await ltp.open_endpoint(("127.0.0.1", 0))
        try:
            data = (np.arange(300_000) % 251).astype(np.uint8)
            buf = np.zeros_like(data)
            rx = asyncio.ensure_future(b.recv(buf, timeout=10))
            await a.send(b.local_addr, data, reliable=True, timeout=10)
            assert (await rx).regime == "complete" and np.array_equal(buf, data)
            fired += b.loop_stats["timer"]
        finally:
            await a.close()
            await b.close()
    return fired


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_slow_start_rounds_are_acknowledged_without_waiting_for_the_timer(loop):
    """Regression: with the timer a loop tick out, each slow-start round of a cold path waited
    1-2 ms for its ACK (a cold 300 kB message: 1.5 ms -> 4.5 ms); its ACKs now go out at once."""
    if loop == "uvloop":
        uvloop = pytest.importorskip("uvloop")
        fired = uvloop.run(_cold_messages(3))
    else:
        fired = asyncio.run(_cold_messages(3))
    assert fired <= 3, fired


# ---------------------------------------------------------------------------- receive polling
_TRICKLE = """
import socket, sys, time
port, n, gap = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
t = time.perf_counter()
for _ in range(n):
    s.sendto(bytes(40), ("127.0.0.1", port))
    t += gap
    while time.perf_counter() < t:
        pass
"""


async def _polling(polling: bool, n: int = 3000, gap_s: float = 100e-6) -> dict:
    """Datagrams ``gap_s`` apart from another process (a busy-waiting sender: a paced flow as its receiver sees
    it, one datagram per wake-up) into an endpoint; its wake-up counters once they are all read."""
    import sys

    ep = await ltp.open_endpoint(("127.0.0.1", 0), config=Config(receive_polling=polling))
    try:
        proc = await asyncio.create_subprocess_exec(sys.executable, "-c", _TRICKLE, str(ep.local_addr[1]), str(n),
                                                    str(gap_s))
        assert await asyncio.wait_for(proc.wait(), 60) == 0
        await asyncio.sleep(0.05)  # the last ticks: every datagram read, polling left
        stats = dict(ep.loop_stats)
        stats["datagrams_in"] = ep.stats.datagrams_in
        stats["reading"] = ep._watch.reading
        stats["polling"] = ep._polling
        # a small reliable message after the trickle: read at once again (no tick of latency)
        async with await ltp.open_endpoint(("127.0.0.1", 0)) as peer:
            into = np.empty(100, np.float32)
            data = np.arange(100, dtype=np.float32)
            await asyncio.gather(peer.send(ep.local_addr, data, reliable=True, tag=1), ep.recv(into, tag=1))
            assert (into == data).all()
        return stats
    finally:
        await ep.close()


def test_a_socket_woken_for_one_datagram_at_a_time_is_polled_once_a_tick_then_watched_again():
    """3,000 datagrams 100 us apart (a paced ~100 Mbit/s flow as its receiver sees it): with polling, the
    endpoint stops waking per datagram, reads them on its timer, and watches the socket again once the
    trickle stops; every datagram is still read (dropped as garbage and counted)."""
    on = asyncio.run(_polling(True))
    off = asyncio.run(_polling(False))
    assert on["datagrams_in"] == off["datagrams_in"] == 3000
    assert on["poll_entries"] >= 1 and on["polls"] > 0 and off["poll_entries"] == off["polls"] == 0
    assert on["reading"] and not on["polling"]  # back to watching the socket after the trickle
    assert on["readable"] + on["timer"] < 0.6 * (off["readable"] + off["timer"]), (on, off)


def test_sparse_datagrams_never_start_polling():
    """One datagram every 3 ms (control traffic): every one is read when it arrives, no polling."""
    stats = asyncio.run(_polling(True, n=60, gap_s=0.003))
    assert stats["datagrams_in"] == 60 and stats["poll_entries"] == 0 and stats["polls"] == 0


async def _batches_poll() -> dict:
    """``POLL_ENTER_WAKEUPS`` wake-ups within one loop tick, each reading a batch (an unlimited flow: the sender's
    softirq wakes the receiver as soon as it sleeps, a few dozen datagrams at a time); the caller sets whether the
    engine says a bulk receive is open (``Engine.streaming``)."""
    import socket

    ep = await ltp.open_endpoint(("127.0.0.1", 0))
    tx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        for _ in range(ltp.endpoint.POLL_ENTER_WAKEUPS):
            assert not ep._polling
            for _ in range(3 * DRAIN_MIN_DATAGRAMS):
                tx.sendto(bytes(40), ep.local_addr)  # loopback: queued at the receiver when sendto returns
            before = ep.stats.datagrams_in
            ep._on_readable()
            assert ep.stats.datagrams_in - before == 3 * DRAIN_MIN_DATAGRAMS  # one batch per wake-up
        return dict(polling=ep._polling, reading=ep._watch.reading, entries=ep.loop_stats["poll_entries"])
    finally:
        tx.close()
        await ep.close()


@pytest.mark.parametrize("streaming", [True, False])
def test_wake_ups_that_read_batches_start_polling_only_while_a_bulk_receive_is_open(monkeypatch, streaming):
    """During a bulk receive (``Engine.streaming``) wake-ups that read batches count toward polling as single
    datagrams do; without one (a burst of small messages, the next of which would wait a tick) they do not."""
    monkeypatch.setattr(ltp.endpoint, "_now", lambda: 100.0)  # every wake-up within one loop tick
    monkeypatch.setattr(Engine, "streaming", property(lambda self: streaming))
    got = asyncio.run(_batches_poll())
    if streaming:
        assert got == dict(polling=True, reading=False, entries=1)
    else:
        assert got == dict(polling=False, reading=True, entries=0)


def test_streaming_is_a_receive_past_its_quick_ack_segments():
    A, B = ("10.0.0.1", 1), ("10.0.0.2", 2)
    snd = Engine(Config(), rng=random.Random(1), local_addr=A)
    rcv = Engine(Config(), rng=random.Random(2), local_addr=B)
    data = np.ones(1456 * (QUICKACK_SEGMENTS + 50), np.uint8)
    rcv.post_receive([(A, 0, np.zeros_like(data))], now=0.0)
    snd.send(B, data, now=0.0, reliable=True)
    assert not rcv.streaming and not rcv.quickacking
    seen, now = [], 0.0
    while not seen or seen[-1] is not None:
        now += 1e-4
        for tx in snd.datagrams_to_send(now):
            for d in tx.datagrams():
                rcv.receive_datagram(d, A, now)
        for tx in rcv.datagrams_to_send(now):
            for d in tx.datagrams():
                snd.receive_datagram(d, B, now)
        seen.append(rcv.streaming if rcv._rx else None)
        assert now < 5, "the transfer did not finish"
    states = [x for x in seen if x is not None]
    assert states[0] is False and True in states  # quick-ACK segments first, then a bulk receive
    assert states.index(True) == len(states) - states[::-1].index(False)  # never back once streaming
    assert not rcv.streaming  # the receive completed: nothing open


_BULK_SENDER = """
import asyncio, sys
import numpy as np
import ltp
port, n = int(sys.argv[1]), int(sys.argv[2])
async def main():
    async with await ltp.open_endpoint(("127.0.0.1", 0)) as ep:
        await ep.send(("127.0.0.1", port), np.arange(n, dtype=np.float32), reliable=True, tag=7, timeout=60)
ltp.run(main())
"""


async def _bulk_receive(n: int) -> dict:
    """A reliable message of ``n`` float32 from another process (an unlimited loopback flow) into an endpoint;
    its wake-up counters, and whether every element arrived."""
    import sys

    ep = await ltp.open_endpoint(("127.0.0.1", 0))
    try:
        into = np.zeros(n, np.float32)
        recv = asyncio.ensure_future(ep.recv(into, tag=7, timeout=60))
        proc = await asyncio.create_subprocess_exec(sys.executable, "-c", _BULK_SENDER, str(ep.local_addr[1]),
                                                    str(n))
        assert await asyncio.wait_for(proc.wait(), 90) == 0
        rep = await recv
        stats = dict(ep.loop_stats)
        stats["intact"] = bool((into == np.arange(n, dtype=np.float32)).all()) and rep.delivered_fraction == 1.0
        return stats
    finally:
        await ep.close()


def test_a_bulk_receive_read_on_the_timer_arrives_whole(monkeypatch):
    """40 MB over loopback from another process into an endpoint that polls from its first wake-up after the
    quick-ACK segments (``POLL_ENTER_WAKEUPS`` = 1 here, so the polled path is taken whatever the machine's
    load): its datagrams and ACKs go once a tick, and every element arrives."""
    monkeypatch.setattr(ltp.endpoint, "POLL_ENTER_WAKEUPS", 1)
    stats = asyncio.run(_bulk_receive(10_000_000))
    assert stats["intact"], stats
    assert stats["poll_entries"] >= 1 and stats["polls"] > 0, stats


async def _poll_pace():
    """While polling, the endpoint's timer fires at least once a tick although the engine wants none."""
    ep = await ltp.open_endpoint(("127.0.0.1", 0))
    try:
        assert ep.engine.get_timer() is None
        for _ in range(ltp.endpoint.POLL_ENTER_WAKEUPS):
            ep._note_wakeup(1)
        assert ep._polling and not ep._watch.reading
        ep._flush()
        assert ep._timer is not None  # armed for the poll
        await asyncio.sleep(0.02)
        assert not ep._polling and ep._watch.reading  # empty ticks: watched again
        assert ep.loop_stats["polls"] >= 1
        for _ in range(ltp.endpoint.POLL_ENTER_WAKEUPS - 1):
            ep._note_wakeup(1)
        await asyncio.sleep(3 * LOOP_TIMER_RESOLUTION_S)
        ep._note_wakeup(1)  # the count is per loop tick: wake-ups spread wider are sparse traffic
        assert not ep._polling
    finally:
        await ep.close()
    assert not ep._watch.reading


def test_polling_arms_the_timer_and_an_empty_tick_ends_it():
    asyncio.run(_poll_pace())


async def _sender_never_polls():
    """An endpoint with a send open does not poll: its ACK wake-ups are its chances to send between pacing ticks
    (measured: a polling sender on the WAN row, 1 Gbit/s + 10 ms at 1 % loss, fell from 0.90 to 0.58-0.70
    Gbit/s, its BtlBw estimate with it).  A send that opens while polling ends it at the next flush."""
    a = await ltp.open_endpoint(("127.0.0.1", 0))
    b = await ltp.open_endpoint(("127.0.0.1", 0))
    try:
        data = np.arange(2_000_000, dtype=np.float32)
        into = np.empty_like(data)
        recv = asyncio.ensure_future(b.recv(into, tag=1))
        send = asyncio.ensure_future(a.send(b.local_addr, data, reliable=True, tag=1))
        await asyncio.sleep(0)
        assert a.engine.sending
        for _ in range(2 * ltp.endpoint.POLL_ENTER_WAKEUPS):
            a._note_wakeup(1)
        assert not a._polling and a.loop_stats["poll_entries"] == 0
        for _ in range(ltp.endpoint.POLL_ENTER_WAKEUPS):  # the receiver may poll; a send it opens ends that
            b._note_wakeup(1)
        assert b._polling
        peer_send = asyncio.ensure_future(b.send(a.local_addr, np.ones(10, np.float32), reliable=True, tag=2))
        await asyncio.sleep(0)  # the send task runs and asks for a flush (Endpoint._flush_soon)...
        await asyncio.sleep(0)  # ...which the loop runs after the callbacks already due
        assert not b._polling and b._watch.reading
        small = np.empty(10, np.float32)
        await asyncio.gather(send, recv, peer_send, a.recv(small, tag=2))
        assert (into == data).all() and (small == 1).all()
    finally:
        await a.close()
        await b.close()


def test_an_endpoint_with_a_send_open_does_not_poll():
    asyncio.run(_sender_never_polls())


# ---------------------------------------------------------------------------- one syscall per flush's control datagrams
async def _control_run(refuse_middle: bool):
    import socket

    ep = await ltp.open_endpoint(("0.0.0.0", 0))
    peers = [socket.socket(socket.AF_INET, socket.SOCK_DGRAM) for _ in range(3)]
    try:
        for s in peers:
            s.bind(("127.0.0.1", 0))
            s.setblocking(False)
        addrs = [s.getsockname() for s in peers]
        if refuse_middle:  # EACCES (a broadcast address without SO_BROADCAST) between two good peers
            addrs.insert(1, ("255.255.255.255", 5000))
        eng = ep.engine
        for k, a in enumerate(addrs):  # what a flush of a receiver sends: ACKs and STOPs, one datagram each
            eng._ctrl.append((wire.pack_header(wire.T_ACK, 0, k + 1, 7, 0, 0), a))
        real = ep._io
        calls = []

        class Counting:  # counts the adapter's calls into the socket layer, passes everything through
            def __getattr__(self, name):
                attr = getattr(real, name)
                if name.startswith("send") and callable(attr):  # not send_threads
                    def counted(*a, **k):
                        calls.append(name)
                        return attr(*a, **k)
                    return counted
                return attr

        before = real.stats["syscalls"]
        ep._io = Counting()
        try:
            ep._flush()
        finally:
            ep._io = real
        syscalls = (real.stats["syscalls"] - before, calls)
        got = []
        for s in peers:
            try:
                got.append(wire.unpack_header(s.recv(64))[2])
            except BlockingIOError:
                got.append(None)
        return syscalls, got, ep.loop_stats.get("send_refused", 0)
    finally:
        for s in peers:
            s.close()
        await ep.close()


def test_the_control_datagrams_of_one_flush_go_out_in_one_syscall():
    """A receiver's flush holds several one-datagram transmits (an ACK per sender, STOPs, REG answers):
    they go out in one ``sendmmsg``, not one syscall each (measured: a 4 kB message cost its receiver three
    send syscalls, now one)."""
    (syscalls, calls), got, refused = asyncio.run(_control_run(refuse_middle=False))
    assert got == [1, 2, 3] and refused == 0
    assert calls == ["send_many"]
    if ltp_ext.loaded.get("udpio"):  # the twin has no sendmmsg: one sendmsg per datagram
        assert syscalls == 1


def test_a_refused_address_inside_a_run_fails_only_its_own_peer():
    """The kernel refuses the run's second item: the first went out in the batch, the refusal is recorded for
    that peer alone (its transfers fail, nothing raises into the loop), and the items after it still go out."""
    _, got, refused = asyncio.run(_control_run(refuse_middle=True))
    assert got == [1, 3, 4], got  # flow ids: 2 went to the refused broadcast address
    assert refused == 1


@pytest.mark.skipif(not hasattr(select, "epoll"), reason="the private epoll sets are Linux-only")
async def test_a_socket_not_watched_is_off_its_wait_queue_and_watched_again_at_once():
    """While an endpoint reads on its timer (receive polling) its socket leaves the private reading set as well
    as the loop: every datagram the kernel queued would otherwise run the set's wake-up (a lock and a ready-list
    entry, in the sending host's softirq on a veth path) for a watch nobody reads. Watched again, a datagram
    that arrived meanwhile wakes it at once (level-triggered)."""
    import socket

    from ltp.endpoint import _SocketWatch

    loop = asyncio.get_running_loop()
    rx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    tx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    rx.bind(("127.0.0.1", 0))
    rx.setblocking(False)
    woke = asyncio.Event()
    watch = _SocketWatch(loop, rx.fileno(), woke.set, lambda: None)
    try:
        watch.want_readable(False)
        tx.sendto(b"x", rx.getsockname())
        await asyncio.sleep(0.05)
        assert not woke.is_set()
        assert watch._rset.poll(0) == []  # not in the set at all: the kernel has no entry to wake
        watch.want_readable(True)
        await asyncio.wait_for(woke.wait(), 1.0)  # the datagram queued while unwatched
        assert rx.recv(16) == b"x"
        rx.close()
        watch.want_readable(False)  # a socket closed under the watch: nothing raises
    finally:
        watch.close()
        tx.close()
        if rx.fileno() >= 0:
            rx.close()


# ---------------------------------------------------------------------------- the compiled bulk drain
async def _bulk(drain: bool, *, size: int, second: bool = False, mode_reliable: bool = True,
                same_sender: bool = False):
    a = await ltp.open_endpoint(("127.0.0.1", 0))
    b = await ltp.open_endpoint(("127.0.0.1", 0))
    c = (a if same_sender else await ltp.open_endpoint(("127.0.0.1", 0))) if second else None
    b.bulk_drain = drain
    try:
        data = np.random.default_rng(1).integers(0, 256, size, dtype=np.uint8)
        out = np.zeros(size, np.uint8)
        sends = [a.send(b.local_addr, data, tag=1, reliable=mode_reliable)]
        recvs = [b.recv(out, peer=a.local_addr, tag=1, timeout=30)]
        if c is not None:
            out2 = np.zeros(size, np.uint8)
            sends.append(c.send(b.local_addr, data, tag=2, reliable=True))
            recvs.append(b.recv(out2, peer=c.local_addr, tag=2, timeout=30))
        got = await asyncio.gather(*recvs, *sends)
        reps = got[:len(recvs)]
        assert np.array_equal(out, data)
        if c is not None:
            assert np.array_equal(out2, data)
        return reps, dict(b.loop_stats), b.stats
    finally:
        for ep in {a, b, c} - {None}:
            await ep.close()


@pytest.mark.parametrize("drain", [True, False])
def test_a_bulk_receive_is_drained_into_its_window_only_when_asked(drain):
    reps, loops, stats = asyncio.run(_bulk(drain, size=30_000_000))
    assert reps[0].regime == "complete"
    if drain:
        # everything past the first segments can take the drain; loopback batches are large, so most do
        assert loops["drained"] > 0.5 * (30_000_000 // 1456 - QUICKACK_SEGMENTS)
    else:
        assert loops["drained"] == 0
    assert stats.datagrams_in >= 30_000_000 // 1456
    assert not stats.dropped.get("internal_error")


@pytest.mark.parametrize("same_sender", [False, True])
def test_interleaved_receives_are_drained_together_and_exact(monkeypatch, same_sender):
    """Two bulk receives open at once (a gather; from two senders, or two messages of one sender, whose
    datagrams share a source address): the drain serves every one past its first segments, most of their
    datagrams take it, and both arrive exact. Before session 58 neither was drained while the other was open."""
    served = []
    real = Engine.bulk_flows

    def watched(self):
        flows = real(self)
        served.append(len(flows))
        return flows

    monkeypatch.setattr(Engine, "bulk_flows", watched)
    size = 8_000_000
    reps, loops, stats = asyncio.run(_bulk(True, size=size, second=True, same_sender=same_sender))
    assert [r.regime for r in reps] == ["complete", "complete"]
    # one sender serves its flows to a peer in order (ltp.path), so its two messages may never overlap
    assert max(served) == 2 or (same_sender and max(served) == 1)
    assert 2 * (size // 1456 + 1) >= loops["drained"] > 0.5 * 2 * (size // 1456 - QUICKACK_SEGMENTS)
    assert not stats.dropped.get("internal_error")


# ---------------------------------------------------------------------------- sends started together leave together
async def _first_flush_sees(n_peers: int) -> tuple[list, float]:
    a = await ltp.open_endpoint(("127.0.0.1", 0))
    peers = [await ltp.open_endpoint(("127.0.0.1", 0)) for _ in range(n_peers)]
    try:
        data = np.random.default_rng(2).integers(0, 256, 150_000, dtype=np.uint8)
        outs = [np.zeros_like(data) for _ in peers]
        seen = []
        real = a.engine.datagrams_to_send

        def spy(now):
            seen.append(len(a.engine._tx))
            return real(now)

        a.engine.datagrams_to_send = spy
        recvs = [p.recv(o, tag=5) for p, o in zip(peers, outs)]
        t0 = ltp.endpoint._now()
        await asyncio.gather(*recvs, *(a.send(p.local_addr, data, reliable=True, tag=5) for p in peers))
        assert all((o == data).all() for o in outs)
        return seen, ltp.endpoint._now() - t0
    finally:
        for ep in (a, *peers):
            await ep.close()


@pytest.mark.parametrize("n_peers", [1, 4])
def test_sends_started_in_one_loop_iteration_go_out_in_one_flush(n_peers):
    """A broadcast made of per-peer sends (as ltp_ps's transport makes it): the first flush already sees every
    flow open, so the peers' first flights leave together (one flush per send put each peer's first flight
    on the wire before the next send was opened)."""
    seen, took = asyncio.run(_first_flush_sees(n_peers))
    assert seen[0] == n_peers
    assert took < 10.0


def test_a_failure_while_accounting_for_a_drain_is_counted_and_the_loop_goes_on(monkeypatch):
    """A bug in the engine's accounting of a drain must not escape into the event loop: it is counted as
    ``internal_error`` (one per datagram of that drain) and logged, and the transfer still completes."""
    real = Engine.bulk_ingested
    failed = []

    def once(self, flow, datagrams, nbytes, now):
        if not failed:
            failed.append(datagrams)
            raise RuntimeError("injected")
        return real(self, flow, datagrams, nbytes, now)

    monkeypatch.setattr(Engine, "bulk_ingested", once)
    reps, loops, stats = asyncio.run(_bulk(True, size=20_000_000))
    assert failed and reps[0].regime == "complete"
    assert stats.dropped.get("internal_error") == failed[0]
    assert loops["drained"] > failed[0]


def test_a_failing_drain_is_counted_and_the_endpoint_reads_per_batch_from_then_on(monkeypatch):
    """If the compiled drain itself fails (a bug, not a socket error), the endpoint counts it, stops draining
    and finishes the transfer on the per-batch path."""
    calls = []

    class Failing:
        def __init__(self, real):
            self._real = real

        def drain_flows(self, *a, **k):
            calls.append(1)
            raise RuntimeError("injected")

        def __getattr__(self, name):
            return getattr(self._real, name)

        def __len__(self):
            return len(self._real)

    real_open = ltp.endpoint.Endpoint.__init__

    def patched(self, *a, **k):
        real_open(self, *a, **k)
        self._io = Failing(self._io)

    monkeypatch.setattr(ltp.endpoint.Endpoint, "__init__", patched)
    reps, loops, stats = asyncio.run(_bulk(True, size=10_000_000))
    assert reps[0].regime == "complete"
    assert len(calls) == 1 and loops["drained"] == 0
    assert stats.dropped.get("internal_error") == 1
