"""Reliable many-to-one: N senders each send ``size`` bytes to one receiving process, LTP vs N kernel-TCP connections.

Theory of operation
    The parameter server's gather without the rest of the job. A lab of N + 1 unlimited hosts (as
    the ``cpu`` row), the receiver on the first, one sender process on each of the others; ``rounds``
    rounds, each timed on its own.

    * LTP: the receiver posts one :meth:`ltp.Endpoint.gather` of the N messages (one buffer per
      sender), then prints ``ready``; each sender then sends its message reliably. The round's clock
      runs in the receiver, from the post to the gather's return. Since change 23 the receiving endpoint
      reads each sender's datagrams from a peer socket of their own (``Config.peer_sockets``).
    * ``ltp-one-socket``: the same with ``Config(peer_sockets=0)``: every datagram on the endpoint's one
      unconnected socket, as before change 23 (``docs/performance.md``).
    * ``ltp-connected``: the same, except that the receiver opens one *connected* endpoint per sender
      (``ltp.open_endpoint(peer=...)``, each on its own port, ``PORT + 10 + i`` for sender ``i``) and posts
      one ``recv`` on each, so the kernel delivers each sender's datagrams by early demux to a socket of
      their own (no wildcard socket lookup per datagram, and a receive queue per sender). Session 64 measured it
      against ``ltp`` (``docs/performance.md``): what a parameter server with an endpoint per worker would gain.
    * TCP: the receiver has accepted one connection per sender; per round it starts one thread per
      connection, each reading that sender's whole message into its buffer with ``recv_into``
      (``recv_into`` releases the GIL, so the copies run on every core, as N TCP streams into one
      PS would), then prints ``ready``; the round ends when every thread has its bytes. ``cc`` is the
      senders' congestion control.

    The harness releases the senders (one line on each one's stdin) when the receiver says ``ready``,
    and measures machine-wide CPU (:mod:`ltp_tools.machine_cpu`) from that release to the receiver's
    ``done`` line. Both transports move the test message of :mod:`ltp_tools.payload` between cold
    message-sized buffers; the receiver checks every byte of every message after each round's clock
    stops, before it posts the next round. Each process reports its own CPU (user + system) per round:
    a sender's includes the kernel work of the receiving host's stack, which runs in the sender's
    context on a veth path.

    Result: one JSON line with the per-round ``gather_s``, ``machine_cpu_s``, ``receiver_cpu_s`` and
    ``sender_cpu_s`` (summed over the senders; LTP's rows also count the datagrams read so far from peer
    sockets and from the endpoints' own sockets, and the senders' loop wake-ups, socket syscalls, datagrams sent
    and packets retransmitted in the round, summed), their medians over the rounds after the first (the
    first, a cold start, is reported but not in the medians), and ``goodput_gbps`` from the median.

    python -m ltp_tools.gather_bench --transport ltp|ltp-one-socket|ltp-connected|cubic|bbr --size 100M --peers 4 \
        --rounds 5
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

from ltp_tools.argtypes import number
from ltp_tools.machine_cpu import machine_cpu_s

PORT = 7447  # the LTP receiver's port; its senders bind PORT + 1
TCP_PORT = 5201
#: the LTP variants: ``--transport`` -> the receiver script's mode
LTP_VARIANTS = {"ltp": "one", "ltp-one-socket": "single", "ltp-connected": "connected"}

_COMMON = r'''
import json, sys, time
cpu = time.process_time  # this process's user + system CPU, every thread's, at the clock's resolution
'''

_LTP_RECV = _COMMON + r'''
import asyncio, numpy as np, ltp
from ltp_tools.payload import verify
async def main():
    size, rounds, timeout, port = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])
    connected = sys.argv[5] == "connected"
    peers = [(h, port + 1) for h in sys.argv[6:]]
    if connected:  # an endpoint per sender, sender i's on port + 10 + i
        eps = [await ltp.open_endpoint(("0.0.0.0", port + 10 + i), peer=p) for i, p in enumerate(peers)]
    else:  # "one": peer sockets as configured by default; "single": none
        cfg = ltp.Config(peer_sockets=0) if sys.argv[5] == "single" else None
        eps = [await ltp.open_endpoint(("0.0.0.0", port), config=cfg)]
    bufs = [np.zeros(size, np.uint8) for _ in peers]
    for b in bufs:
        b.fill(1)  # fault the pages in before any clock
    for r in range(rounds):
        for b in bufs:
            b.fill(0)
        if connected:
            task = asyncio.gather(*[ep.recv(b, peer=p, tag=r + 1, timeout=timeout)
                                    for ep, b, p in zip(eps, bufs, peers)])
        else:
            task = asyncio.ensure_future(eps[0].gather(peers, bufs, tag=r + 1, timeout=timeout))
        await asyncio.sleep(0)  # posted
        t0, c0 = time.monotonic(), cpu()
        print("ready", flush=True)
        reports = await task
        t1, c1 = time.monotonic(), cpu()
        ok = all(verify(b) for b in bufs)
        # where the datagrams were read, so far: peer sockets (Config.peer_sockets) or the endpoints' own
        print(json.dumps({"gather_s": t1 - t0, "receiver_cpu_s": c1 - c0, "verified": ok,
                          "delivered": [rep.delivered_fraction for rep in reports],
                          "peer_socket_datagrams": sum(s["datagrams_in"] for ep in eps
                                                       for s in ep.peer_sockets.values()),
                          "own_socket_datagrams": sum(ep.io_stats["datagrams_in"] for ep in eps)}), flush=True)
    for ep in eps:
        await ep.close(linger=0.3)
ltp.run(main())
'''

_LTP_SEND = _COMMON + r'''
import asyncio, ltp
from ltp_tools.payload import pattern
def wakeups(ep):  # the loop's wake-ups so far: readable, timer and writable callbacks
    return sum(ep.loop_stats[k] for k in ("readable", "timer", "writable"))
async def main():
    size, rounds, timeout, port, dst = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
    ep = await ltp.open_endpoint(("0.0.0.0", int(sys.argv[6])))  # our own port (argv 4 is the receiver's)
    data = pattern(size)
    loop = asyncio.get_running_loop()
    print("ready", flush=True)
    for r in range(rounds):
        await loop.run_in_executor(None, sys.stdin.readline)
        c0 = cpu()
        w0, io0 = wakeups(ep), ep.io_stats
        rep = await ep.send((dst, port), data, reliable=True, tag=r + 1, timeout=timeout)
        io1 = ep.io_stats
        print(json.dumps({"sender_cpu_s": cpu() - c0, "sender_wakeups": wakeups(ep) - w0,
                          "sender_syscalls": io1["syscalls"] - io0["syscalls"],
                          "sender_datagrams_out": io1["datagrams_out"] - io0["datagrams_out"],
                          "sender_retransmitted": rep.retransmitted_packets}), flush=True)
    await ep.close(linger=0.3)
ltp.run(main())
'''

_TCP_RECV = _COMMON + r'''
import socket, threading, numpy as np
from ltp_tools.payload import verify
size, rounds, n = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[4])
ls = socket.socket()
ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
ls.bind(("0.0.0.0", int(sys.argv[3])))
ls.listen(n)
print("listening", flush=True)
conns = [ls.accept()[0] for _ in range(n)]
bufs = [np.zeros(size, np.uint8) for _ in conns]
for b in bufs:
    b.fill(1)
def read(c, b, got):
    mv, k = memoryview(b), 0
    while k < size:
        m = c.recv_into(mv[k:])
        if not m:
            return
        k += m
    got.append(k)
for r in range(rounds):
    for b in bufs:
        b.fill(0)
    got = []
    threads = [threading.Thread(target=read, args=(c, b, got)) for c, b in zip(conns, bufs)]
    t0, c0 = time.monotonic(), cpu()
    for t in threads:
        t.start()
    print("ready", flush=True)
    for t in threads:
        t.join()
    t1, c1 = time.monotonic(), cpu()
    ok = len(got) == n and all(verify(b) for b in bufs)
    print(json.dumps({"gather_s": t1 - t0, "receiver_cpu_s": c1 - c0, "verified": ok}), flush=True)
    if not ok:
        sys.exit(1)
'''

_TCP_SEND = _COMMON + r'''
import socket
from ltp_tools.payload import pattern
size, rounds, dst, port, cc = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), sys.argv[5]
data = pattern(size)
s = socket.socket()
s.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, cc.encode())
s.connect((dst, port))
print("ready", flush=True)
for r in range(rounds):
    sys.stdin.readline()
    c0 = cpu()
    s.sendall(data)
    print(json.dumps({"sender_cpu_s": cpu() - c0}), flush=True)
s.close()
'''


def _line(p: subprocess.Popen, what: str) -> str:
    line = p.stdout.readline()
    if not line:
        raise RuntimeError(f"the {what} exited early: {p.stderr.read()[-1500:]}")
    return line.strip()


def _median(xs: list) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def run(*, transport: str = "ltp", size: int = 100_000_000, peers: int = 4, rounds: int = 5,
        timeout: float = 120.0) -> dict:
    """``rounds`` gathers in a fresh lab of ``peers + 1`` hosts; the result dict (see the module docstring).

    Raises :class:`RuntimeError` when a process fails or a message arrives incomplete or wrong."""
    from ltp_tools.netlab import Lab

    if peers < 1 or size < 1 or rounds < 1:
        raise ValueError(f"need peers >= 1, size >= 1 and rounds >= 1 (got {peers}, {size}, {rounds})")
    py = sys.executable
    kw = dict(stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    rows = []
    with Lab(n_hosts=peers + 1) as lab:
        rx_host, tx_hosts = lab.hosts[0], lab.hosts[1:]
        if transport in LTP_VARIANTS:
            connected = transport == "ltp-connected"
            rx = lab.popen(rx_host, [py, "-c", _LTP_RECV, str(size), str(rounds), str(timeout), str(PORT),
                                     LTP_VARIANTS[transport], *[h.addr for h in tx_hosts]], **kw)
            # every sender binds PORT + 1; it sends to PORT, or to its own endpoint's PORT + 10 + i where connected
            txs = [lab.popen(h, [py, "-c", _LTP_SEND, str(size), str(rounds), str(timeout),
                                 str(PORT + 10 + i if connected else PORT), rx_host.addr,
                                 str(PORT + 1)], **kw) for i, h in enumerate(tx_hosts)]
        else:
            rx = lab.popen(rx_host, [py, "-c", _TCP_RECV, str(size), str(rounds), str(TCP_PORT), str(peers)], **kw)
            if _line(rx, "TCP receiver") != "listening":
                raise RuntimeError(f"the TCP receiver did not start: {rx.stderr.read()[-1500:]}")
            txs = [lab.popen(h, [py, "-c", _TCP_SEND, str(size), str(rounds), rx_host.addr, str(TCP_PORT), transport],
                             **kw) for h in tx_hosts]
        for p in txs:
            if _line(p, "sender") != "ready":
                raise RuntimeError(f"a sender did not start: {p.stderr.read()[-1500:]}")
        for _ in range(rounds):
            if _line(rx, "receiver") != "ready":
                raise RuntimeError(f"the receiver did not post its round: {rx.stderr.read()[-1500:]}")
            m0 = machine_cpu_s()
            for p in txs:
                p.stdin.write("go\n")
                p.stdin.flush()
            row = json.loads(_line(rx, "receiver"))
            m1 = machine_cpu_s()
            sent = [json.loads(_line(p, "sender")) for p in txs]
            for key in sent[0]:  # summed over the senders (LTP's also count wake-ups, syscalls, datagrams)
                row[key] = sum(s[key] for s in sent)
            row["machine_cpu_s"] = None if m0 is None or m1 is None else round(m1 - m0, 3)
            if not row.pop("verified") or any(d != 1.0 for d in row.get("delivered", [1.0])):
                raise RuntimeError(f"{transport}: a message arrived incomplete or wrong in round {len(rows)}: {row}")
            rows.append(row)
        for p in (rx, *txs):
            try:
                p.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
    steady = rows[1:] or rows
    med = {k: _median([r.get(k) for r in steady]) for k in ("gather_s", "machine_cpu_s", "receiver_cpu_s",
                                                             "sender_cpu_s")}
    return dict(transport=transport, size_bytes=size, peers=peers, rounds=rows, median=med,
                goodput_gbps=peers * size * 8 / med["gather_s"] / 1e9)


def main(argv=None) -> int:
    from ltp_tools.bench import parse_size

    ap = argparse.ArgumentParser(prog="python -m ltp_tools.gather_bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--transport", default="ltp",
                    help="ltp, ltp-one-socket (no peer sockets), ltp-connected (an endpoint per sender), or a TCP "
                         "congestion control: cubic, bbr, reno")
    ap.add_argument("--size", type=parse_size, default=parse_size("100M"), help="bytes per sender per round")
    ap.add_argument("--peers", type=number(int, 1, 60, what="senders"), default=4)
    ap.add_argument("--rounds", type=number(int, 1, 1000, what="rounds"), default=5)
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds one round may take")
    a = ap.parse_args(argv)
    print(json.dumps(run(transport=a.transport, size=a.size, peers=a.peers, rounds=a.rounds, timeout=a.timeout)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
