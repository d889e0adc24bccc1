"""Sender threads of ``UdpIO`` (``send_threads``), compiled and twin.

``send_segments`` hands a batch to the thread that serves its destination and
returns at once; the thread sends it (waiting for room in a full socket), the
caller's thread reaps it (stats, the payload's buffer released).  These tests pin
that what reaches the wire is exactly what the caller-side send would have sent,
in order per destination, that nothing is lost or double-counted when the socket
fills, the destination is unreachable or the caller's socket is closed early, and
that threads never outlive their ``UdpIO``.
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import select
import socket
import time

import numpy as np
import pytest

from ltp.config import Config
from ltp.errors import LocalProtocolError
from ltp_ext.constants import SEND_PACE_CREDIT_S, SEND_QUEUE_DEPTH, SEND_THREADS_MAX, SPREAD_PART_MIN
from net_helpers import run_in_fresh_netns
from test_udpio import Sockets, _load, drain  # noqa: E402 (tests/ is on sys.path)

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(params=["compiled", "twin"])
def mod(request):
    return _load(request.param)


@pytest.fixture
def socks():
    s = Sockets()
    yield s
    s.close()


def _headers(n: int, tag: int = 0) -> bytearray:
    return bytearray(b"".join(bytes([0x22, tag & 0xFF]) + k.to_bytes(14, "big") for k in range(n)))


def _expected(headers: bytes, payload: bytes, seqs, seg: int, total: int) -> list[bytes]:
    return [bytes(headers[16 * k:16 * k + 16]) + payload[q * seg:min(total, (q + 1) * seg)]
            for k, q in enumerate(seqs)]


def _threads_now() -> int:
    return len(os.listdir("/proc/self/task"))


def _quiet_threads(settle_s: float = 0.1, limit_s: float = 3.0) -> int:
    """The thread count once earlier tests' dropped ``UdpIO``s have let their threads end (it held still for
    ``settle_s``)."""
    gc.collect()
    count, since, end = _threads_now(), time.monotonic(), time.monotonic() + limit_s
    while time.monotonic() < end and time.monotonic() - since < settle_s:
        time.sleep(0.01)
        now = _threads_now()
        if now != count:
            count, since = now, time.monotonic()
    return count


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("gso", [True, False])
def test_a_threaded_batch_puts_the_same_bytes_on_the_wire_and_copies_the_headers(mod, socks, threads, gso):
    a, b = socks.make(), socks.make()
    rx, tx = mod.UdpIO(a), mod.UdpIO(b, gso=gso, send_threads=threads)
    assert tx.send_threads == threads
    seg, total = 1456, 1456 * 150 + 300
    pay = np.random.default_rng(7).integers(0, 256, total, dtype=np.uint8)
    seqs = np.array(list(range(3, 120)) + [0, 2, 1, 5] + list(range(120, 151)), np.int64)
    hdr = _headers(len(seqs))
    want = _expected(hdr, pay.tobytes(), seqs.tolist(), seg, total)
    assert tx.send_segments(a.getsockname(), hdr, pay, seqs, seg, total) == len(seqs)
    hdr[:] = b"\xee" * len(hdr)  # the caller reuses its header buffer at once: the batch holds a copy
    tx.wait_sent()
    assert [d for d, _ in drain(rx, len(seqs))] == want
    st = tx.stats
    assert st["datagrams_out"] == len(seqs) and st["errors"] == {}
    assert st["syscalls"] >= 1
    assert tx.reap() == 0
    tx.stop_send_threads()


def test_each_destination_keeps_its_order_across_many_batches_and_threads(mod, socks):
    dsts = [socks.make() for _ in range(4)]
    rxs = [mod.UdpIO(d) for d in dsts]
    src = socks.make()
    tx = mod.UdpIO(src, send_threads=2)
    seg, n_seg = 200, 50
    pay = np.arange(seg * n_seg, dtype=np.uint8)
    calls = 3 * SEND_QUEUE_DEPTH  # more than a thread's queue: the caller waits for room in between
    for c in range(calls):
        for i, d in enumerate(dsts):
            seqs = np.array([(c + j) % n_seg for j in range(5)], np.int64)
            assert tx.send_segments(d.getsockname(), _headers(5, tag=c), pay, seqs, seg, seg * n_seg) == 5
    tx.wait_sent()
    for i, rx in enumerate(rxs):
        got = [d for d, _ in drain(rx, calls * 5)]
        assert len(got) == calls * 5
        assert [g[1] for g in got[::5]] == [c & 0xFF for c in range(calls)]  # batch order kept
    assert tx.stats["datagrams_out"] == 4 * calls * 5
    tx.stop_send_threads()


def test_the_payload_is_held_until_its_batch_is_reaped(mod, socks):
    a, b = socks.make(), socks.make()
    rx, tx = mod.UdpIO(a), mod.UdpIO(b, send_threads=1)
    pay = bytearray(b"p" * 10_000)
    tx.send_segments(a.getsockname(), _headers(10), pay, np.arange(10, dtype=np.int64), 1000, 10_000)
    if tx.reap():  # still queued: the buffer is exported, as during any send
        with pytest.raises(BufferError):
            pay.extend(b"x")
    tx.wait_sent()
    assert tx.reap() == 0
    pay.extend(b"x")  # released
    assert len(drain(rx, 10)) == 10


def test_closing_the_callers_socket_does_not_pull_the_socket_from_under_a_thread(mod, socks):
    a = socks.make()
    b = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    b.bind(("127.0.0.1", 0))
    rx, tx = mod.UdpIO(a), mod.UdpIO(b, send_threads=1)
    pay = bytes(range(256)) * 200
    for _ in range(8):
        assert tx.send_segments(a.getsockname(), _headers(40), pay, np.arange(40, dtype=np.int64), 1000,
                                len(pay)) == 40
    b.close()
    tx.wait_sent()
    assert tx.stats["datagrams_out"] == 320
    assert len(drain(rx, 320)) == 320
    tx.stop_send_threads()
    assert tx.send_threads == 0
    with pytest.raises(OSError):  # now the caller sends, on its closed socket
        tx.send_segments(a.getsockname(), _headers(1), pay, np.arange(1, dtype=np.int64), 1000, len(pay))


def test_after_stop_the_caller_sends_and_counts_at_once(mod, socks):
    a, b = socks.make(), socks.make()
    rx, tx = mod.UdpIO(a), mod.UdpIO(b, send_threads=2)
    tx.stop_send_threads()  # before any thread started: idempotent, and sends run in the caller
    tx.stop_send_threads()
    assert tx.send_threads == 0
    pay = bytes(3000)
    assert tx.send_segments(a.getsockname(), _headers(3), pay, np.arange(3, dtype=np.int64), 1000, 3000) == 3
    assert tx.stats["datagrams_out"] == 3  # no reaping needed
    assert len(drain(rx, 3)) == 3


@pytest.mark.parametrize("bad", [-1, SEND_THREADS_MAX + 1])
def test_bad_thread_counts_raise(mod, socks, bad):
    with pytest.raises(ValueError, match="send_threads must be in 0.."):
        mod.UdpIO(socks.make(), send_threads=bad)


@pytest.mark.parametrize("bad", [True, -1, SEND_THREADS_MAX + 1, 1.5])
def test_config_refuses_bad_thread_counts(bad):
    with pytest.raises(LocalProtocolError, match="send_threads="):
        Config(send_threads=bad)


def test_threads_end_with_their_udpio_even_without_stop(mod, socks):
    a, b = socks.make(), socks.make()
    before = _quiet_threads()
    tx = mod.UdpIO(b, send_threads=3)
    assert _threads_now() == before  # started by the first threaded send, not before
    tx.send_segments(a.getsockname(), _headers(2), bytes(2000), np.arange(2, dtype=np.int64), 1000, 2000)
    assert _threads_now() == before + 3
    del tx
    gc.collect()
    deadline = time.monotonic() + 5
    while _threads_now() > before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _threads_now() == before


def test_a_forked_child_is_told_to_make_its_own_udpio(mod, socks):
    a, b = socks.make(), socks.make()
    tx = mod.UdpIO(b, send_threads=1)
    tx.send_segments(a.getsockname(), _headers(1), bytes(1000), np.arange(1, dtype=np.int64), 1000, 1000)
    tx.wait_sent()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child reports through the pipe
        try:
            tx.send_segments(a.getsockname(), _headers(1), bytes(1000), np.arange(1, dtype=np.int64), 1000, 1000)
            os.write(w, b"sent")
        except RuntimeError as exc:
            os.write(w, str(exc).encode()[:500])
        try:
            del tx  # the child's copy goes away: the parent's threads must not be joined from here
            gc.collect()
            os.write(w, b"|freed")
        finally:
            os._exit(0)
    os.close(w)
    chunks, deadline = [], time.monotonic() + 20
    while time.monotonic() < deadline:
        ready, _, _ = select.select([r], [], [], 0.5)
        if ready:
            c = os.read(r, 1000)
            if not c:
                break
            chunks.append(c)
    os.close(r)
    while os.waitpid(pid, os.WNOHANG) == (0, 0) and time.monotonic() < deadline:
        time.sleep(0.01)
    hung = time.monotonic() >= deadline
    if hung:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
    msg = b"".join(chunks).decode()
    assert not hung, f"the forked child hung dropping its copy: {msg!r}"
    assert "forked" in msg and "create the UdpIO" in msg and msg.endswith("|freed")
    tx.send_segments(a.getsockname(), _headers(1), bytes(1000), np.arange(1, dtype=np.int64), 1000, 1000)
    tx.wait_sent()  # the parent's threads are unharmed
    assert tx.stats["datagrams_out"] == 2
    tx.stop_send_threads()


_NETNS_SCRIPT = """
import importlib, json, socket, subprocess, sys
import numpy as np
mode = sys.argv[2]
if mode == "full":
    # lo throttled to 20 Mbit/s and a 4 kB send buffer: the thread meets a full socket again and again
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    subprocess.run(["tc", "qdisc", "add", "dev", "lo", "root", "tbf", "rate", "20mbit", "burst", "3000",
                    "limit", "10000000"], check=True)
mod = importlib.import_module(sys.argv[1])
r = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
r.setsockopt(socket.SOL_SOCKET, 33, 1 << 23)  # SO_RCVBUFFORCE: every datagram waits here until the end
r.bind(("127.0.0.1", 0))
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
io = mod.UdpIO(s, send_threads=1)
dst = r.getsockname() if mode == "full" else ("10.9.9.9", 7447)
pay = bytes(range(256)) * 800
hdr = b"".join(k.to_bytes(16, "big") for k in range(200))
acc = [io.send_segments(dst, hdr[1600 * c:1600 * c + 1600], pay, np.arange(100 * c, 100 * c + 100) % 200, 1000,
                        len(pay)) for c in range(2)]
io.wait_sent()
got = 0
if mode == "full":  # the last packets may still sit in the 20 Mbit/s queue
    r.settimeout(2.0)
    while got < 200:
        try:
            r.recv(2048)
            got += 1
        except socket.timeout:
            break
print(json.dumps({"accepted": acc, "stats": io.stats, "received": got}))
"""


@pytest.mark.netns
@pytest.mark.parametrize("case", ["full", "unreachable"])
def test_a_thread_waits_out_a_full_socket_and_drops_what_the_kernel_refuses(mod, case):
    proc = run_in_fresh_netns(_NETNS_SCRIPT, mod.__name__, case, tools=("unshare", "tc"),
                              setup_errors=("unshare", "RTNETLINK"))
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["accepted"] == [100, 100]
    st = out["stats"]
    if case == "full":
        assert st["eagain"] > 0 and st["errors"] == {}   # it waited for room, never gave up
        assert st["datagrams_out"] == 200 and out["received"] == 200
    else:  # no route: every message refused twice (ICMP-class errno), counted, dropped like a loss
        assert st["datagrams_out"] == 0
        assert set(st["errors"]) == {"ENETUNREACH"} and st["errors"]["ENETUNREACH"] >= 2


@pytest.mark.parametrize("threads", [0, 1, 3])
async def test_an_endpoint_sends_and_broadcasts_exactly_through_its_threads(threads):
    import ltp

    cfg = Config(send_threads=threads)
    ps = await ltp.open_endpoint(("127.0.0.1", 0), config=cfg)
    workers = [await ltp.open_endpoint(("127.0.0.1", 0), config=cfg) for _ in range(4)]
    try:
        assert ps._io.send_threads == threads
        params = np.random.default_rng(threads).standard_normal(400_000).astype(np.float32)
        for tag in range(2):  # twice: the second broadcast reuses the threads and their queues
            outs = [np.zeros_like(params) for _ in workers]
            reps, *_ = await asyncio.gather(ps.broadcast([w.local_addr for w in workers], params, tag=tag),
                                            *[w.recv(o, tag=tag) for w, o in zip(workers, outs)])
            assert all(r.delivered_fraction == 1.0 for r in reps)
            assert all(np.array_equal(o, params) for o in outs)
        grads = [np.full(100_000, i, np.float32) for i in range(4)]
        outs = [np.zeros(100_000, np.float32) for _ in workers]
        await asyncio.gather(ps.gather([w.local_addr for w in workers], outs, tag=5, timeout=10),
                             *[w.send(ps.local_addr, g, tag=5, reliable=True) for w, g in zip(workers, grads)])
        assert all(np.array_equal(o, g) for o, g in zip(outs, grads))
        sent = ps.io_stats["datagrams_out"]
        assert sent >= 2 * 4 * (params.nbytes // 1456)  # every DATA packet counted once reaped
    finally:
        for e in [ps, *workers]:
            await e.close()
    assert ps._io.send_threads == 0 and ps._io.reap() == 0  # close() stopped them after their last batch


def test_a_foreground_send_goes_out_in_the_caller_unless_its_destination_has_a_batch_queued(mod, socks):
    a, b = socks.make(), socks.make()
    rx, tx = mod.UdpIO(a), mod.UdpIO(b, send_threads=2)
    before = _quiet_threads()
    pay = np.arange(200_000, dtype=np.uint8)
    seg, total = 1000, 200_000
    # idle destination: sent by the caller, counted at once, no thread started
    assert tx.send_segments(a.getsockname(), _headers(3, tag=1), pay, np.arange(3, dtype=np.int64), seg, total,
                            background=False) == 3
    assert tx.stats["datagrams_out"] == 3 and _threads_now() == before and tx.reap() == 0
    # a big background batch, then a foreground one at once: the second queues behind the first (order kept)
    assert tx.send_segments(a.getsockname(), _headers(200, tag=2), pay, np.arange(200, dtype=np.int64), seg,
                            total) == 200
    busy = tx.reap() > 0
    assert tx.send_segments(a.getsockname(), _headers(5, tag=3), pay, np.arange(5, dtype=np.int64), seg, total,
                            background=False) == 5
    tx.wait_sent()
    got = [d for d, _ in drain(rx, 208)]
    assert [g[1] for g in got] == [1] * 3 + [2] * 200 + [3] * 5
    assert tx.stats["datagrams_out"] == 208
    if busy:  # it was still queued behind the big one: it went through the thread, not around it
        assert _threads_now() == before + 2
    tx.stop_send_threads()


async def test_an_endpoint_sends_one_peers_data_itself_and_several_peers_data_through_its_threads():
    import ltp

    before = _quiet_threads()
    cfg = Config(send_threads=2)  # no thread pacing (the default): one peer's DATA stays on the loop's thread
    ps = await ltp.open_endpoint(("127.0.0.1", 0), config=cfg)
    workers = [await ltp.open_endpoint(("127.0.0.1", 0), config=cfg) for _ in range(3)]
    try:
        params = np.arange(300_000, dtype=np.float32)
        out = np.zeros_like(params)
        # reliable, here and below: these tests check which thread sends, exactly; an unreliable receive may close
        # early by design while its sender stalls (once in 40 twins runs of this file on a loaded machine)
        await asyncio.gather(ps.send(workers[0].local_addr, params, tag=1, reliable=True),
                             workers[0].recv(out, tag=1))
        assert np.array_equal(out, params)
        assert _threads_now() == before  # one peer: the loop's thread sent it all, no thread was started
        outs = [np.zeros_like(params) for _ in workers]
        await asyncio.gather(ps.broadcast([w.local_addr for w in workers], params, tag=2),
                             *[w.recv(o, tag=2) for w, o in zip(workers, outs)])
        assert all(np.array_equal(o, params) for o in outs)
        assert _threads_now() == before + 2  # several peers: the sender threads took the DATA
    finally:
        for e in [ps, *workers]:
            await e.close()
    assert _quiet_threads() == before  # a joined thread may take a moment to leave /proc


def test_the_engine_says_when_its_open_sends_go_to_several_peers():
    import random

    from ltp.engine import Engine

    eng = Engine(Config(), rng=random.Random(1))
    assert not eng.sending_to_several
    eng.send(("10.0.0.2", 7447), np.zeros(10_000, np.float32), now=0.0)
    eng.send(("10.0.0.2", 7447), np.zeros(10_000, np.float32), now=0.0)  # two flows, one peer
    assert eng.sending and not eng.sending_to_several
    eng.send(("10.0.0.3", 7447), np.zeros(10_000, np.float32), now=0.0)
    assert eng.sending_to_several


# ---------------------------------------------------------------------------- thread pacing
def _paced_send(tx, rx_sock, n: int, seg: int, rate: float, quantum: int, tag: int = 7):
    pay = np.random.default_rng(tag).integers(0, 256, n * seg, dtype=np.uint8)
    seqs = np.arange(n, dtype=np.int64)
    hdr = _headers(n, tag=tag)
    want = _expected(hdr, pay.tobytes(), seqs.tolist(), seg, n * seg)
    assert tx.send_segments(rx_sock.getsockname(), hdr, pay, seqs, seg, n * seg, background=False,
                            pace_rate=rate, pace_quantum=quantum) == n  # pace_rate implies the thread
    return want


@pytest.mark.parametrize("gso", [True, False])
def test_a_paced_batch_leaves_at_its_rate_in_sub_bursts_and_in_order(mod, socks, gso):
    a, b = socks.make(), socks.make()
    rx, tx = mod.UdpIO(a), mod.UdpIO(b, gso=gso, send_threads=1)
    n, seg = 240, 984  # 1,000-byte datagrams
    rate, quantum = 1_000_000.0, 4_000  # 1 MB/s in sub-bursts of 4 datagrams
    t0 = time.monotonic()
    want = _paced_send(tx, a, n, seg, rate, quantum)
    tx.wait_sent()
    took = time.monotonic() - t0
    # 240 kB at 1 MB/s: the first sub-burst and at most SEND_PACE_CREDIT_S of catch-up leave without waiting
    assert took >= (n * 1000 - quantum) / rate - SEND_PACE_CREDIT_S - 0.01, took
    assert took < 5.0
    assert [d for d, _ in drain(rx, n)] == want  # every byte, in order
    st = tx.stats
    assert st["datagrams_out"] == n and st["errors"] == {}
    assert st["syscalls"] >= n // 4  # one send per sub-burst at least: no GSO message spans two
    assert st["paced_sleeps"] >= 20  # 60 sub-bursts 4 ms apart: most wait for their time
    assert 0 <= st["paced_late_s"] < took
    tx.stop_send_threads()


def test_a_pace_faster_than_the_thread_can_send_counts_the_time_it_ran_late(mod, socks):
    """Asked for 1 TB/s one datagram at a time, the thread falls behind its timeline at once: it never sleeps, and
    the lateness beyond SEND_PACE_CREDIT_S (the rate it did not send) shows in stats["paced_late_s"]."""
    a, b = socks.make(), socks.make()
    tx = mod.UdpIO(b, send_threads=1)
    n, seg = 5000, 984
    t0 = time.monotonic()
    _paced_send(tx, a, n, seg, 1e12, 1000)
    tx.wait_sent()
    took = time.monotonic() - t0
    st = tx.stats
    assert st["datagrams_out"] == n and st["syscalls"] >= n and st["paced_sleeps"] == 0
    assert 0 < st["paced_late_s"] <= took
    tx.stop_send_threads()
    fresh = mod.UdpIO(a).stats
    assert fresh["paced_late_s"] == 0.0 and fresh["paced_sleeps"] == 0


def test_an_unpaced_batch_on_the_same_thread_is_not_held_to_the_pace(mod, socks):
    a, b = socks.make(), socks.make()
    rx, tx = mod.UdpIO(a), mod.UdpIO(b, send_threads=1)
    want = _paced_send(tx, a, 20, 984, 100_000.0, 4_000)  # 20 kB at 100 kB/s
    tx.wait_sent()
    pay = np.zeros(200 * 984, np.uint8)
    t0 = time.monotonic()
    assert tx.send_segments(a.getsockname(), _headers(200, tag=9), pay, np.arange(200, dtype=np.int64), 984,
                            200 * 984) == 200
    tx.wait_sent()
    assert time.monotonic() - t0 < 1.0  # 200 kB that the batch before's pace would have spread over 2 s
    got = [d for d, _ in drain(rx, 220)]
    assert got[:20] == want and len(got) == 220
    tx.stop_send_threads()


def test_stopping_the_threads_sends_what_a_slow_pace_still_holds_at_once(mod, socks):
    a, b = socks.make(), socks.make()
    rx, tx = mod.UdpIO(a), mod.UdpIO(b, send_threads=2)
    want = _paced_send(tx, a, 100, 984, 2_000.0, 2_000)  # 100 kB at 2 kB/s: 50 s if it kept pacing
    time.sleep(0.05)
    t0 = time.monotonic()
    tx.stop_send_threads()
    assert time.monotonic() - t0 < 2.0
    assert [d for d, _ in drain(rx, 100)] == want
    assert tx.stats["datagrams_out"] == 100


@pytest.mark.parametrize("rate, quantum, threads, match", [
    (1e6, 3000, 0, "send_threads >= 1"),
    (float("nan"), 3000, 1, "finite"),
    (float("inf"), 3000, 1, "finite"),
    (-1.0, 3000, 1, "finite"),
    (1e6, 0, 1, "pace_quantum"),
])
def test_bad_pacing_arguments_raise_naming_the_fix(mod, socks, rate, quantum, threads, match):
    a, b = socks.make(), socks.make()
    tx = mod.UdpIO(b, send_threads=threads)
    with pytest.raises(ValueError, match=match):
        tx.send_segments(a.getsockname(), _headers(2), np.zeros(2000, np.uint8), np.arange(2, dtype=np.int64),
                         1000, 2000, pace_rate=rate, pace_quantum=quantum)
    assert tx.stats["datagrams_out"] == 0
    tx.stop_send_threads()


@pytest.mark.parametrize("bad", [-0.0001, 0.5, True, "2e-4", float("nan")])
def test_config_refuses_bad_thread_pacing(bad):
    with pytest.raises(LocalProtocolError, match="thread_pacing_s"):
        Config(thread_pacing_s=bad)


async def _one_peer_transfer(cfg, n: int, *, seed: int, wrap=None):
    """Send ``n`` float32 reliably from one endpoint to another (both with ``cfg``; ``wrap(io)`` replaces the
    sender's UdpIO), assert the bytes arrived exactly, and that every thread started ended with the endpoints.
    Returns (the send's report, whether threads were started, the sender's UdpIO, its ``io_stats``)."""
    import ltp

    before = _quiet_threads()
    a = await ltp.open_endpoint(("127.0.0.1", 0), config=cfg)
    b = await ltp.open_endpoint(("127.0.0.1", 0), config=cfg)
    if wrap is not None:
        a._io = wrap(a._io)
    try:
        data = np.random.default_rng(seed).standard_normal(n).astype(np.float32)
        out = np.zeros_like(data)
        rep, _ = await asyncio.gather(a.send(b.local_addr, data, tag=1, reliable=True), b.recv(out, tag=1))
        assert np.array_equal(out, data) and rep.delivered_fraction == 1.0
        started = _threads_now() > before
        io, stats = a._io, dict(a.io_stats)
    finally:
        await a.close()
        await b.close()
    assert _quiet_threads() == before
    return rep, started, io, stats


async def test_an_endpoint_paces_one_peers_data_in_its_threads_unless_told_not_to():
    assert Config().thread_pacing_s == 0.0  # off unless asked for (docs/performance.md, "Change 15")
    for q, threads_started in ((0.0002, True), (0.0, False)):
        _, started, _, stats = await _one_peer_transfer(Config(thread_pacing_s=q), 2_000_000, seed=3)  # 8 MB
        assert started == threads_started
        assert stats["datagrams_out"] >= 2_000_000 * 4 // 1456


def test_the_endpoint_thread_paces_only_what_its_loop_timer_cannot():
    from ltp.endpoint import LOOP_TIMER_RESOLUTION_S, THREAD_PACING_MIN_TICK_PACKETS, Endpoint

    class _IO:
        send_threads = 2

    class _Tx:
        segment_size = 1472

        def __init__(self, rate):
            self.pace_rate = rate

    ep = Endpoint.__new__(Endpoint)
    ep.config, ep._io = Config(thread_pacing_s=0.0002), _IO()
    fast = 125e6  # 1 Gbit/s: 85 packets a tick
    rate, quantum = ep._thread_pacing(_Tx(fast))
    assert rate == fast and quantum == int(fast * 0.0002)
    slow = THREAD_PACING_MIN_TICK_PACKETS * 1472 / LOOP_TIMER_RESOLUTION_S  # two packets a tick: the timer can
    assert ep._thread_pacing(_Tx(slow)) == (0.0, 0)
    assert ep._thread_pacing(_Tx(0.0)) == (0.0, 0)  # granted path: carries no rate
    rate, quantum = ep._thread_pacing(_Tx(slow * 1.5))
    assert quantum == THREAD_PACING_MIN_TICK_PACKETS * 1472  # never a sub-burst under two packets
    ep._io.send_threads = 0
    assert ep._thread_pacing(_Tx(fast)) == (0.0, 0)
    ep._io.send_threads, ep.config = 2, Config()  # the default: off
    assert ep._thread_pacing(_Tx(fast)) == (0.0, 0)


# ---------------------------------------------------------------------------- batches sent in parts (spread_sends)

@pytest.mark.parametrize("n, lanes, parts", [
    (2 * SPREAD_PART_MIN - 1, 2, 1), (2 * SPREAD_PART_MIN, 2, 2), (2 * SPREAD_PART_MIN, 1, 1),
    (3 * SPREAD_PART_MIN, 2, 2), (3 * SPREAD_PART_MIN - 1, 3, 2), (3 * SPREAD_PART_MIN, 3, 3),
    (10 * SPREAD_PART_MIN, 8, 8), (0, 2, 1), (1, 8, 1)])
def test_a_batch_is_built_in_as_many_lanes_as_get_a_full_part(n, lanes, parts):
    from ltp.path import spread_parts

    assert spread_parts(n, lanes) == parts


@pytest.mark.parametrize("threads", [2, 3])
@pytest.mark.parametrize("gso", [True, False])
def test_a_batch_sent_in_parts_arrives_whole_and_each_part_in_its_order(mod, socks, threads, gso):
    """The parts go out side by side, so they may interleave; every packet arrives once, exactly as the
    caller-side send would have put it on the wire, and within each part in the order given."""
    a, b = socks.make(), socks.make()
    rx, tx = mod.UdpIO(a), mod.UdpIO(b, gso=gso, send_threads=threads)
    seg = 1000
    n = threads * SPREAD_PART_MIN + 17
    total = seg * n
    pay = np.random.default_rng(11).integers(0, 256, total, dtype=np.uint8)
    seqs = np.random.default_rng(12).permutation(n).astype(np.int64)
    hdr = _headers(n)
    want = _expected(hdr, pay.tobytes(), seqs.tolist(), seg, total)
    before = _quiet_threads()
    assert tx.send_segments(a.getsockname(), hdr, pay, seqs, seg, total, background=False, parts=threads) == n
    tx.wait_sent()
    got = [d for d, _ in drain(rx, n)]
    assert sorted(got) == sorted(want) and len(got) == n
    index = {d: k for k, d in enumerate(want)}
    order = [index[d] for d in got]
    for k in range(threads):
        lo, hi = n * k // threads, n * (k + 1) // threads
        mine = [i for i in order if lo <= i < hi]
        assert mine == list(range(lo, hi)), f"part {k} out of order"
    assert _threads_now() == before + threads  # the parts went to the threads, not out of the caller
    assert tx.stats["datagrams_out"] == n and tx.reap() == 0
    tx.stop_send_threads()


def test_a_batch_of_fewer_packets_than_parts_is_sent_as_background_says(mod, socks):
    a, b = socks.make(), socks.make()
    rx, tx = mod.UdpIO(a), mod.UdpIO(b, send_threads=3)
    before = _quiet_threads()
    n, seg = 2, 1000
    pay = np.arange(n * seg, dtype=np.uint32).view(np.uint8)[:n * seg]
    hdr = _headers(n)
    assert tx.send_segments(a.getsockname(), hdr, pay, np.arange(n, dtype=np.int64), seg, n * seg,
                            background=False, parts=3) == n
    assert tx.stats["datagrams_out"] == n and _threads_now() == before  # sent by the caller, at once
    assert [d for d, _ in drain(rx, n)] == _expected(hdr, pay.tobytes(), range(n), seg, n * seg)


@pytest.mark.parametrize("threads, parts, kw, match", [
    (2, 2, {"pace_rate": 1e6, "pace_quantum": 3000}, "pace_rate=0, or parts=1"),
    (2, 3, {}, r"parts must be 1..send_threads \(2\), got 3"),
    (2, 0, {}, r"parts must be 1..send_threads \(2\), got 0"),
    (0, 2, {}, r"parts must be 1..send_threads \(0\), got 2")])
def test_bad_parts_raise_naming_the_fix(mod, socks, threads, parts, kw, match):
    tx = mod.UdpIO(socks.make(), send_threads=threads)
    pay = np.zeros(10_000, np.uint8)
    with pytest.raises(ValueError, match=match):
        tx.send_segments(("127.0.0.1", 9), _headers(2), pay, np.arange(2, dtype=np.int64), 1000, 10_000,
                         parts=parts, **kw)
    assert tx.stats["datagrams_out"] == 0
    tx.stop_send_threads()


def test_a_destination_counts_as_busy_while_a_part_on_another_thread_is_queued(socks):
    """Twin (the compiled check is a C method): a foreground send must queue while any thread still holds a
    part of a batch for its destination, not only the destination's own thread."""
    mod = _load("twin")
    a, b = socks.make(), socks.make()
    rx, tx = mod.UdpIO(a), mod.UdpIO(b, send_threads=2)
    n, seg = 2 * SPREAD_PART_MIN, 1000
    pay = np.zeros(n * seg, np.uint8)
    tx.send_segments(a.getsockname(), _headers(n), pay, np.arange(n, dtype=np.int64), seg, n * seg, parts=2)
    tx.wait_sent()
    drain(rx, n)
    name = tx._resolve(a.getsockname())
    entry = tx._tx_assign[name]
    other = 1 - entry[0]
    assert entry[2] == {other: tx._tx[other][2]}  # the second part went to the other thread, and is remembered
    assert not tx._tx_busy(name)
    entry[2][other] = tx._tx[other][4] + 1  # as if that part were still queued
    assert tx._tx_busy(name)
    entry[2][other] = tx._tx[other][4]
    tx.stop_send_threads()


def test_a_full_destination_table_forgets_only_idle_destinations_and_keeps_a_busy_ones_order(mod, socks):
    """The sender threads' destination table is bounded (``thread_destinations_max``). When it is full the idle
    destinations are forgotten; one with a batch still queued keeps its thread, so that its next batch queues
    behind that one. (The table used to be emptied whole: a slow paced batch's destination then got the least
    loaded thread afresh, and its next batch went out before the rest of the first.)"""
    a, b = socks.make(), socks.make()
    others = [socks.make() for _ in range(6)]
    rx, tx = mod.UdpIO(a), mod.UdpIO(b, send_threads=2)
    tx.thread_destinations_max = 3
    pay = np.zeros(4 * 984, np.uint8)

    def quick(sock, tag):  # a small batch to a new destination, sent before the next
        before = tx.stats["datagrams_out"]
        assert tx.send_segments(sock.getsockname(), _headers(4, tag=tag), pay, np.arange(4, dtype=np.int64), 984,
                                4 * 984) == 4
        end = time.monotonic() + 5.0
        while tx.stats["datagrams_out"] < before + 4 and time.monotonic() < end:
            time.sleep(0.002)

    quick(others[0], 1)  # the first destination takes thread 0, so the slow one below gets thread 1
    slow = _paced_send(tx, a, 30, 984, 40_000.0, 2_000, tag=2)  # 30 kB at 40 kB/s: about 0.7 s on its thread
    for k, sock in enumerate(others[1:], start=3):  # new destinations overflow the table while the slow one runs
        quick(sock, k)
        assert tx.thread_destinations <= 3  # the idle ones were forgotten, the slow one kept
    assert tx.stats["datagrams_out"] < 4 * len(others) + 30  # the slow batch was still going
    pay2 = np.full(20 * 984, 7, np.uint8)
    hdr2 = _headers(20, tag=9)
    assert tx.send_segments(a.getsockname(), hdr2, pay2, np.arange(20, dtype=np.int64), 984, 20 * 984) == 20
    tx.wait_sent()
    got = [d for d, _ in drain(rx, 50)]
    assert got == slow + _expected(hdr2, pay2.tobytes(), range(20), 984, 20 * 984)  # the second batch queued behind
    for sock in others:
        drain(mod.UdpIO(sock), 4)
    assert tx.stats["datagrams_out"] == 4 * len(others) + 50 and tx.stats["errors"] == {}
    tx.stop_send_threads()


@pytest.mark.parametrize("bad", [0, -1, True, 2.5, "3", None])
def test_a_bad_destination_table_bound_raises_naming_the_fix(mod, socks, bad):
    tx = mod.UdpIO(socks.make(), send_threads=1)
    with pytest.raises(ValueError, match="thread_destinations_max must be an int >= 1"):
        tx.thread_destinations_max = bad
    assert tx.thread_destinations_max >= 1


class _DroppingIO:
    """Wraps an endpoint's UdpIO: ``send_segments`` drops each DATA packet with probability ``loss`` (seeded) and
    hands the rest on in one call, in the parts asked for, so that what is left still goes out side by side."""

    def __init__(self, io, loss: float, seed: int) -> None:
        self._io, self.loss, self.rng, self.dropped = io, loss, np.random.default_rng(seed), 0

    def __getattr__(self, name):
        return getattr(self._io, name)

    def send_segments(self, addr, headers, payload, seqs, seg_size, total, parts=1, **kw):
        keep = np.flatnonzero(self.rng.random(len(seqs)) >= self.loss)
        self.dropped += len(seqs) - len(keep)
        hv = np.frombuffer(headers, np.uint8).reshape(-1, 16)[keep]
        if len(keep):
            self._io.send_segments(addr, hv.tobytes(), payload, np.ascontiguousarray(seqs[keep]), seg_size, total,
                                   parts=parts if len(keep) >= parts else 1, **kw)
        return len(seqs)


@pytest.mark.parametrize("loss", [0.0, 0.03])
async def test_an_endpoint_spreads_one_peers_large_batches_over_its_threads_unless_told_not_to(loss):
    """``Config.spread_sends``: one peer's large batches are built in lanes and go out in parts through the
    sender threads; off (the default), the loop's thread sends them. Exact either way; on a clean path the
    interleaved parts cost next to no resends, because loss detection counts each lane apart (before lanes, a
    40 MB transfer resent up to 8 %). With DATA dropped at random before it reaches the threads, the losses are
    found and resent in every lane."""

    assert Config().spread_sends is False  # off unless asked for (docs/performance.md)
    for spread, threads_started in ((True, True), (False, False)):
        wrap = (lambda io: _DroppingIO(io, loss, seed=5)) if loss else None
        rep, started, a_io, _ = await _one_peer_transfer(Config(spread_sends=spread), 4_000_000, seed=5,
                                                         wrap=wrap)  # 16 MB
        assert started == threads_started
        if loss:
            assert rep.retransmitted_packets >= a_io.dropped > 0, rep
        else:
            assert rep.retransmitted_packets <= 0.002 * rep.packets_sent, (spread, rep)


@pytest.mark.parametrize("bad", [1, "yes", None])
def test_config_refuses_a_spread_setting_that_is_not_a_bool(bad):
    with pytest.raises(LocalProtocolError, match="spread_sends"):
        Config(spread_sends=bad)
