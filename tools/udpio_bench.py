"""Loopback benchmark of ``ltp_ext._udpio`` (compiled) and its twin ``ltp_ext._udpio_py``.

Run: ``python -m ltp_tools.udpio_bench [--n 2000000] [--size 1472] [--impl compiled twin]``.

Two processes (each pinned to its own CPU when there are two) talk over
127.0.0.1. For each implementation it prints one JSON line with four
measurements, each ``{"datagrams_per_s", "gbit_per_s", "sent", "received",
"seconds"}`` (Gbit/s counts UDP payload only):

* ``recv_recvmmsg``: the implementation under test receives with GRO off
  (one datagram per slot: ``recvmmsg`` for the compiled module, one
  ``recvmsg_into`` per datagram for the twin) while the compiled sender blasts
  with GSO. The rate is received datagrams over the time from the first to
  the last one: the receiver's ceiling when the sender is faster, otherwise
  the sender's pace (``syscalls`` close to ``received`` means the receiver
  mostly found an empty queue). On a busy or 2-CPU machine prefer the drain
  numbers below.
* ``recv_gro``: the same with ``UDP_GRO`` on (coalesced runs split back).
* ``send_gso``: the implementation under test sends with ``UDP_SEGMENT``
  (64 segments per super-datagram); the rate is datagrams accepted per
  second at the sender (on loopback this includes the kernel's delivery to
  the receiving socket, done on the sender's CPU). ``received`` is what a
  compiled GRO receiver got.
* ``send_sendmmsg``: the same with GSO off (``sendmmsg`` batches for the
  compiled module, one ``sendmsg`` per datagram for the twin).
* ``recv_drain`` / ``recv_drain_gro``: one process fills the socket's receive
  queue (``DRAIN_BATCH`` datagrams, sent with GSO), then times draining it;
  this is the receive cost alone, without a sender competing for the CPUs.

This is a command, not a test: numbers depend on the machine and its load.
"""

from __future__ import annotations

import argparse
import importlib
import json
import multiprocessing as mp
import os
import socket
import sys
import time

SO_RCVBUFFORCE = 33
SO_SNDBUFFORCE = 32
SOCK_BUF = 64 << 20          # bytes
IDLE_END = 0.3               # seconds without datagrams that end a receive measurement
SEND_CHUNK_SEGMENTS = 256    # datagrams per send() call in the send measurements

MODULES = {"compiled": "ltp_ext._udpio", "twin": "ltp_ext._udpio_py"}


def _pin(cpu: int) -> None:
    try:
        cpus = sorted(os.sched_getaffinity(0))
        if len(cpus) >= 2:
            os.sched_setaffinity(0, {cpus[cpu % len(cpus)]})
    except (AttributeError, OSError):
        pass


def _socket(bufopt_force: int, bufopt: int) -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        s.setsockopt(socket.SOL_SOCKET, bufopt_force, SOCK_BUF)
    except OSError:
        s.setsockopt(socket.SOL_SOCKET, bufopt, SOCK_BUF)
    return s


def _receiver(conn, sender_done, module: str, gro: bool, expect: int, timeout: float) -> None:
    """Bind, report the port, count datagrams until the sender is done and the queue idle.

    Sends back ``(count, first, last, stats)``.
    """
    _pin(0)
    mod = importlib.import_module(module)
    s = _socket(SO_RCVBUFFORCE, socket.SO_RCVBUF)
    s.bind(("127.0.0.1", 0))
    io = mod.UdpIO(s, batch=64, max_datagram=2048, gro=gro)
    conn.send(s.getsockname())
    got = 0
    first = last = None
    deadline = time.monotonic() + timeout
    while got < expect:
        n = io.recv_batch()
        now = time.perf_counter()
        if n:
            if first is None:
                first = now
            last = now
            got += n
        elif first is not None and now - last > IDLE_END and sender_done.is_set():
            break
        elif time.monotonic() > deadline:
            break
    conn.send((got, first, last, io.stats))
    s.close()


def _sender(conn, module: str, gso: bool, addr, count: int, size: int, timeout: float) -> None:
    """Send ``count`` datagrams of ``size`` bytes to ``addr``; send back (sent, seconds, stats)."""
    _pin(1)
    mod = importlib.import_module(module)
    s = _socket(SO_SNDBUFFORCE, socket.SO_SNDBUF)
    io = mod.UdpIO(s, gso=gso, gro=False)
    chunk = bytes(os.urandom(size)) * SEND_CHUNK_SEGMENTS
    view = memoryview(chunk)
    sent = 0
    t0 = time.perf_counter()
    deadline = t0 + timeout
    while sent < count and time.perf_counter() < deadline:
        k = min(SEND_CHUNK_SEGMENTS, count - sent)
        off, total = 0, k * size
        while off < total:
            off += io.send(addr, view[off:total], size)
        sent += k
    elapsed = time.perf_counter() - t0
    conn.send((sent, elapsed, io.stats))
    s.close()


DRAIN_BATCH = 20_000          # datagrams queued before each drain (fits a 64 MiB receive buffer)


def _drain(module: str, gro: bool, n: int, size: int) -> dict:
    """Queue ``DRAIN_BATCH`` datagrams, then time receiving them; repeat until ``n``."""
    mod = importlib.import_module(module)
    fast = importlib.import_module(MODULES["compiled"])
    r = _socket(SO_RCVBUFFORCE, socket.SO_RCVBUF)
    r.bind(("127.0.0.1", 0))
    s = _socket(SO_SNDBUFFORCE, socket.SO_SNDBUF)
    rx = mod.UdpIO(r, batch=64, gro=gro)
    tx = fast.UdpIO(s)
    data = os.urandom(size) * DRAIN_BATCH
    got = 0
    busy = 0.0
    while got < n:
        sent = tx.send(r.getsockname(), data, size)
        want = sent // size
        have = 0
        t0 = time.perf_counter()
        while have < want:
            k = rx.recv_batch()
            if k == 0 and time.perf_counter() - t0 > 1.0:
                break          # the queue overflowed: count what arrived
            have += k
        busy += time.perf_counter() - t0
        got += have
    r.close()
    s.close()
    return {**_rate(got, busy, size), "received": got, "seconds": round(busy, 3),
            "syscalls": rx.stats["syscalls"]}


def _rate(datagrams: int, seconds: float, size: int) -> dict:
    dps = datagrams / seconds if seconds > 0 else 0.0
    return {"datagrams_per_s": round(dps), "gbit_per_s": round(dps * size * 8 / 1e9, 3)}


def _pair(recv_module, gro, send_module, gso, n, size, timeout):
    ctx = mp.get_context("fork")
    r_conn, r_child = ctx.Pipe()
    s_conn, s_child = ctx.Pipe()
    sender_done = ctx.Event()
    rp = ctx.Process(target=_receiver, args=(r_child, sender_done, recv_module, gro, n, timeout + 5))
    rp.start()
    addr = r_conn.recv()
    sp = ctx.Process(target=_sender, args=(s_child, send_module, gso, addr, n, size, timeout))
    sp.start()
    sent, send_s, send_stats = s_conn.recv()
    sender_done.set()
    got, first, last, recv_stats = r_conn.recv()
    sp.join()
    rp.join()
    recv_s = (last - first) if got > 1 else 0.0
    return sent, send_s, send_stats, got, recv_s, recv_stats


def bench(impl: str, n: int, size: int, timeout: float) -> dict:
    """Run the four measurements for one implementation; return the JSON-able result."""
    module = MODULES[impl]
    fast = MODULES["compiled"]
    out: dict = {"impl": impl, "module": module, "datagram_bytes": size, "n": n,
                 "cpus": os.cpu_count(), "loadavg_1m_before": os.getloadavg()[0]}
    for name, gro in (("recv_recvmmsg", False), ("recv_gro", True)):
        sent, _, _, got, recv_s, stats = _pair(module, gro, fast, True, n, size, timeout)
        # the first datagram only starts the clock
        out[name] = {**_rate(max(got - 1, 0), recv_s, size), "sent": sent, "received": got,
                     "seconds": round(recv_s, 3), "syscalls": stats["syscalls"]}
    _pin(0)
    out["recv_drain"] = _drain(module, False, min(n, 200_000), size)
    out["recv_drain_gro"] = _drain(module, True, min(n, 200_000), size)
    for name, gso in (("send_gso", True), ("send_sendmmsg", False)):
        sent, send_s, stats, got, _, _ = _pair(fast, True, module, gso, n, size, timeout)
        out[name] = {**_rate(sent, send_s, size), "sent": sent, "received": got,
                     "seconds": round(send_s, 3), "syscalls": stats["syscalls"]}
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=2_000_000, help="datagrams per measurement")
    p.add_argument("--size", type=int, default=1472, help="datagram payload bytes")
    p.add_argument("--timeout", type=float, default=10.0, help="seconds at most per measurement")
    p.add_argument("--impl", nargs="+", choices=sorted(MODULES), default=["compiled", "twin"])
    args = p.parse_args(argv)
    for impl in args.impl:
        try:
            importlib.import_module(MODULES[impl])
        except ImportError as exc:
            print(json.dumps({"impl": impl, "error": f"not importable: {exc}"}), flush=True)
            continue
        print(json.dumps(bench(impl, args.n, args.size, args.timeout)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
