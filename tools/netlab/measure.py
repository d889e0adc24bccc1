"""Small measurement probes run inside lab hosts: ICMP ping and a UDP blast.

Theory of operation
    The lab must not depend on iputils being installed, so :func:`ping` sends ICMP echo
    requests from a raw socket (root inside the namespace) and times the kernel's echo
    replies; :func:`udp_blast` sends N UDP datagrams of a given size as fast as the socket
    allows (optionally paced) so nft counters at a loss point can be compared with the
    requested loss. Both run as ``python -m ltp_tools.netlab.measure ...`` inside the source
    host's namespace and print one JSON line; the Python wrappers parse it.
"""
from __future__ import annotations

import argparse
import json
import os
import select
import socket
import struct
import sys
import time


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


def _blast_main(dst: str, port: int, count: int, size: int, rate_pps: float) -> dict:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
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
              timeout_s: float = 60.0) -> dict:
    """Send ``count`` UDP datagrams of ``size`` payload bytes from ``src`` to ``dst``; returns dict(sent, size, duration_s)."""
    addr = dst if isinstance(dst, str) else dst.addr
    return _run_json(lab, src, ["blast", addr, "--count", str(count), "--size", str(size), "--port", str(port),
                                "--rate-pps", str(rate_pps)], timeout_s=timeout_s)


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
    a = ap.parse_args(argv)
    if a.cmd == "ping":
        res = _ping_main(a.dst, a.count, a.interval, a.size, a.timeout)
    else:
        res = _blast_main(a.dst, a.port, a.count, a.size, a.rate_pps)
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
