"""Small measurement probes run inside lab hosts: ICMP ping, a UDP blast and a UDP sink.

Theory of operation
    The lab must not depend on iputils being installed, so :func:`ping` sends ICMP echo
    requests from a raw socket (root inside the namespace) and times the kernel's echo
    replies; :func:`udp_blast` sends N UDP datagrams of a given size as fast as the socket
    allows (optionally paced) so nft counters at a loss point can be compared with the
    requested loss. Both run as ``python -m ltp_tools.netlab.measure ...`` inside the source
    host's namespace and print one JSON line; the Python wrappers parse it.
    :func:`start_udp_sink` receives on the destination host (with ``UDP_GRO`` set, as LTP's
    receiver does) until it has been idle for a while, and counts datagrams and receive calls,
    so a test can tell whether the host's interface coalesced them (a lab built with ``gro``).
"""
from __future__ import annotations

import argparse
import json
import os
import select
import socket
import struct
import subprocess
import sys
import time

from ltp_ext._udpio_py import SOL_UDP, UDP_GRO, UDP_SEGMENT  # the socket options LTP's own I/O sets


def _checksum(b: bytes) -> int:
    if len(b) % 2:
        b += b"\0"
    s = sum(struct.unpack(f"!{len(b) // 2}H", b))
    s = (s >> 16) + (s & 0xFFFF)
    s += s >> 16
    return ~s & 0xFFFF


def _ping_main(dst: str, count: int, interval_s: float, size: int, timeout_s: float) -> dict:
    sock = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP)
    ident = os.getpid() & 0xFFFF
    payload = bytes(range(256)) * (size // 256 + 1)
    payload = payload[:size]
    sent_at: dict[int, float] = {}
    rtts: list[float] = []
    next_send = time.monotonic()
    seq = 0
    deadline = None
    while True:
        now = time.monotonic()
        if seq < count and now >= next_send:
            hdr = struct.pack("!BBHHH", 8, 0, 0, ident, seq)
            pkt = hdr[:2] + struct.pack("!H", _checksum(hdr + payload)) + hdr[4:] + payload
            sent_at[seq] = time.monotonic()
            sock.sendto(pkt, (dst, 0))
            seq += 1
            next_send += interval_s
            if seq == count:
                deadline = time.monotonic() + timeout_s
        if deadline is not None and (now >= deadline or len(rtts) == count):
            break
        wait = (next_send - now) if seq < count else (deadline - now)
        r, _, _ = select.select([sock], [], [], max(0.0, wait))
        if r:
            data = sock.recv(65535)
            t = time.monotonic()
            ihl = (data[0] & 0x0F) * 4
            typ, _, _, rid, rseq = struct.unpack("!BBHHH", data[ihl:ihl + 8])
            if typ == 0 and rid == ident and rseq in sent_at:
                rtts.append(t - sent_at.pop(rseq))
    return dict(sent=count, received=len(rtts), rtts_s=rtts)


def _blast_main(dst: str, port: int, count: int, size: int, rate_pps: float, burst: int = 1) -> dict:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
    if burst > 1:  # whole bursts of `burst` datagrams per send, segmented by the kernel on the way out
        sock.setsockopt(SOL_UDP, UDP_SEGMENT, size)
        sent, t0 = 0, time.monotonic()
        while sent < count:
            n = min(burst, count - sent)
            try:
                sock.sendto(b"\xa5" * (size * n), (dst, port))
            except (BlockingIOError, ConnectionRefusedError):
                continue
            sent += n
        return dict(sent=sent, size=size, duration_s=time.monotonic() - t0)
    buf = b"\xa5" * size
    t0 = time.monotonic()
    sent = 0
    for i in range(count):
        if rate_pps > 0:
            due = t0 + i / rate_pps
            d = due - time.monotonic()
            if d > 0:
                time.sleep(d)
        while True:
            try:
                sock.sendto(buf, (dst, port))
                sent += 1
                break
            except (BlockingIOError, ConnectionRefusedError):
                continue  # an ICMP port-unreachable or a full queue: retry
    return dict(sent=sent, size=size, duration_s=time.monotonic() - t0)


SO_RCVBUFFORCE = 33  # SOL_SOCKET option (asm-generic/socket.h): SO_RCVBUF past rmem_max, for root


def _sink_main(port: int, idle_s: float, gro: bool) -> dict:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:  # root in the lab: past rmem_max, so a burst is not dropped at a slow Python reader
        sock.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, 64 << 20)
    except OSError:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 20)
    if gro:
        sock.setsockopt(SOL_UDP, UDP_GRO, 1)
    sock.bind(("0.0.0.0", port))
    print(json.dumps(dict(ready=True)), flush=True)
    calls = datagrams = nbytes = coalesced_calls = 0
    sock.settimeout(30.0)  # the first datagram
    while True:
        try:
            data, anc, _flags, _addr = sock.recvmsg(1 << 16, socket.CMSG_SPACE(4))
        except TimeoutError:
            break
        sock.settimeout(idle_s)
        seg = next((struct.unpack("=i", d[:4])[0] for lvl, typ, d in anc
                    if lvl == SOL_UDP and typ == UDP_GRO), 0)
        calls += 1
        nbytes += len(data)
        n = -(-len(data) // seg) if seg else 1
        datagrams += n
        coalesced_calls += n > 1
    return dict(calls=calls, datagrams=datagrams, bytes=nbytes, coalesced_calls=coalesced_calls)


def start_udp_sink(lab, h, port: int = 9000, gro: bool = True, idle_s: float = 1.0):
    """Start a UDP receiver on ``h``'s port; :func:`sink_result` waits for it to go idle and returns
    dict(calls, datagrams, bytes, coalesced_calls)."""
    p = lab.popen(h, [sys.executable, "-m", "ltp_tools.netlab.measure", "sink", "--port", str(port),
                      "--idle", str(idle_s), *(["--gro"] if gro else [])],
                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = p.stdout.readline()
    if not line.strip():
        raise RuntimeError(f"udp sink on {h.name} did not start: {p.stderr.read().strip()}")
    return p


def sink_result(p, timeout_s: float = 60.0) -> dict:
    out, err = p.communicate(timeout=timeout_s)
    if p.returncode != 0:
        raise RuntimeError(f"udp sink failed: {err.strip()}")
    return json.loads(out.strip().splitlines()[-1])


def _run_json(lab, h, argv: list[str], timeout_s: float) -> dict:
    r = lab.run(h, [sys.executable, "-m", "ltp_tools.netlab.measure", *argv],
                capture_output=True, text=True, timeout=timeout_s)
    if r.returncode != 0:
        raise RuntimeError(f"measure {argv[0]} in {h.name} failed: {r.stderr.strip()}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def ping(lab, src, dst, count: int = 5, interval_s: float = 0.05, size: int = 56, timeout_s: float = 2.0) -> dict:
    """ICMP-ping ``dst`` (a Host or address) from ``src``; returns dict(sent, received, rtts_s)."""
    addr = dst if isinstance(dst, str) else dst.addr
    return _run_json(lab, src, ["ping", addr, "--count", str(count), "--interval", str(interval_s),
                                "--size", str(size), "--timeout", str(timeout_s)],
                     timeout_s=count * interval_s + timeout_s + 15)


def udp_blast(lab, src, dst, count: int = 20000, size: int = 1000, port: int = 9, rate_pps: float = 0.0,
              timeout_s: float = 60.0, burst: int = 1) -> dict:
    """Send ``count`` UDP datagrams of ``size`` payload bytes from ``src`` to ``dst``; returns dict(sent, size, duration_s).

    ``burst`` > 1 sends them ``burst`` at a time with ``UDP_SEGMENT`` (as LTP's sender does; ``rate_pps`` is then
    ignored), so they reach the receiving interface back to back.
    """
    addr = dst if isinstance(dst, str) else dst.addr
    return _run_json(lab, src, ["blast", addr, "--count", str(count), "--size", str(size), "--port", str(port),
                                "--rate-pps", str(rate_pps), "--burst", str(burst)], timeout_s=timeout_s)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ltp_tools.netlab.measure", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("ping")
    p.add_argument("dst")
    p.add_argument("--count", type=int, default=5)
    p.add_argument("--interval", type=float, default=0.05)
    p.add_argument("--size", type=int, default=56)
    p.add_argument("--timeout", type=float, default=2.0)
    b = sub.add_parser("blast")
    b.add_argument("dst")
    b.add_argument("--count", type=int, default=20000)
    b.add_argument("--size", type=int, default=1000)
    b.add_argument("--port", type=int, default=9)
    b.add_argument("--rate-pps", type=float, default=0.0)
    b.add_argument("--burst", type=int, default=1)
    k = sub.add_parser("sink")
    k.add_argument("--port", type=int, default=9000)
    k.add_argument("--idle", type=float, default=1.0)
    k.add_argument("--gro", action="store_true")
    a = ap.parse_args(argv)
    if a.cmd == "ping":
        res = _ping_main(a.dst, a.count, a.interval, a.size, a.timeout)
    elif a.cmd == "sink":
        res = _sink_main(a.port, a.idle, a.gro)
    else:
        res = _blast_main(a.dst, a.port, a.count, a.size, a.rate_pps, a.burst)
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
