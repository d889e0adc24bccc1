"""Child processes of the experiments, run inside the lab's namespaces.

    python -m ltp_tools.experiments._procs ROLE [options]

Theory of operation
    Every role is one long-lived process that does all iterations itself, so Python start-up
    and endpoint set-up are paid once and the transport keeps what it learned about the
    link (Early Close's LT history, the BBR model, TCP's persistent connections).

    Protocol with the orchestrator: a role prints ``READY`` on stdout when its socket is
    bound (and, for servers, listening); senders then block on one line from stdin (``GO``)
    so that all of them start at the same moment; every result is printed as ONE JSON
    object per line. Timestamps are ``time.monotonic()``: CLOCK_MONOTONIC is shared by all
    network namespaces of the machine, so the orchestrator can subtract times taken in
    different processes.

    Incast roles (``incast-ltp-ps``, ``incast-ltp-worker``, ``incast-tcp-ps``,
    ``incast-tcp-worker``) loop over iterations: workers send one gradient message, the PS
    gathers all N, then broadcasts one message of the same size back; a worker starts the
    next iteration as soon as it holds the broadcast (BSP). Workers print
    ``t_send_start`` / ``t_bcast_done`` per iteration, the PS ``t_gather_end`` plus, for
    LTP, each link's Early Close regime and delivered fraction.

    Fairness roles (``fair-ltp-send``, ``fair-ltp-recv``, ``fair-tcp-send``,
    ``fair-tcp-recv``, ``sampler``): senders push as fast as their transport lets them for
    ``--duration`` seconds (LTP: reliable messages back to back); ``sampler`` reads the
    receiver host's per-source nft byte counters every ``--interval`` seconds.
"""
from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import threading
import time

from ltp.regimes import Regime

TCP_CHUNK = 256 * 1024  # bytes per send()/recv_into() call
END_TAG = 1 << 30  # fairness: tag of the 4-byte message that ends an LTP sender's stream


def _emit(obj: dict) -> None:
    print(json.dumps(obj), flush=True)


def _ready_and_wait_go() -> None:
    print("READY", flush=True)
    line = sys.stdin.readline()
    if line.strip() != "GO":
        raise SystemExit(f"expected GO on stdin, got {line!r}")


def _addr(text: str) -> tuple[str, int]:
    host, port = text.rsplit(":", 1)
    return host, int(port)


def _data(n_bytes: int, seed: int):
    """A float32 gradient-like message of ``n_bytes`` (a multiple of 4)."""
    import numpy as np

    return np.random.default_rng(seed).standard_normal(n_bytes // 4, dtype=np.float32)


# --------------------------------------------------------------------------- incast, LTP
def incast_ltp_ps(a) -> None:
    import random

    import numpy as np

    import ltp

    peers = [_addr(x) for x in a.peers.split(",")]

    async def main():
        cfg = ltp.Config(deadline_slack_s=a.slack, link_rate=a.link_rate / 8 if a.link_rate else None)
        ep = await ltp.open_endpoint(("0.0.0.0", a.port), config=cfg, rng=random.Random(a.seed))
        bufs = [np.zeros(a.size // 4, np.float32) for _ in peers]
        params = _data(a.size, a.seed)
        print("READY", flush=True)  # the gather is posted right away: the workers wait for GO
        for it in range(a.iterations):
            reps = await ep.gather(peers, into=bufs, tag=2 * it, timeout=a.timeout)
            t_g = time.monotonic()
            sent = await ep.broadcast(peers, params, tag=2 * it + 1, timeout=a.timeout)
            _emit(dict(iteration=it, t_gather_end=t_g, t_bcast_sent=time.monotonic(),
                       bcast_packets=sum(r.packets_sent for r in sent),
                       bcast_retransmitted=sum(r.retransmitted_packets for r in sent),
                       regimes=[r.regime for r in reps], delivered=[r.delivered_fraction for r in reps],
                       flow_s=[r.duration_s for r in reps], bubbles=[len(r.bubbles) for r in reps]))
        await ep.close()

    ltp.run(main())


def incast_ltp_worker(a) -> None:
    import asyncio
    import random

    import numpy as np

    import ltp

    ps = _addr(a.ps)

    async def main():
        cfg = ltp.Config(deadline_slack_s=a.slack)
        ep = await ltp.open_endpoint(("0.0.0.0", a.port), config=cfg, rng=random.Random(a.seed))
        grad = _data(a.size, a.seed)
        params = np.zeros(a.size // 4, np.float32)
        loop = asyncio.get_running_loop()
        print("READY", flush=True)
        line = await loop.run_in_executor(None, sys.stdin.readline)
        if line.strip() != "GO":
            raise SystemExit(f"expected GO on stdin, got {line!r}")
        for it in range(a.iterations):
            t0 = time.monotonic()
            done = {}

            async def timed(name, coro):
                r = await coro
                done[name] = time.monotonic()
                return r

            srep, rrep = await asyncio.gather(
                timed("send", ep.send(ps, grad, tag=2 * it, timeout=a.timeout)),
                timed("recv", ep.recv(params, tag=2 * it + 1, timeout=a.timeout)))
            _emit(dict(iteration=it, t_send_start=t0, t_send_done=done["send"], t_bcast_done=done["recv"],
                       send_close=srep.close_reason, send_fraction=srep.delivered_fraction,
                       bcast_regime=rrep.regime, retransmitted=srep.retransmitted_packets,
                       packets_sent=srep.packets_sent, btlbw_bps=srep.btlbw_bps, rtprop_s=srep.rtprop_s))
        await ep.close()

    ltp.run(main())


# --------------------------------------------------------------------------- incast, TCP
def _recv_exact(conn: socket.socket, view: memoryview) -> None:
    got = 0
    n_total = len(view)
    while got < n_total:
        n = conn.recv_into(view[got:], min(TCP_CHUNK, n_total - got))
        if n == 0:
            raise ConnectionError("peer closed mid-message")
        got += n


def incast_tcp_ps(a) -> None:
    ls = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    ls.bind(("0.0.0.0", a.port))
    ls.listen(64)
    print("READY", flush=True)
    conns = []
    for _ in range(a.workers):
        c, _peer = ls.accept()
        c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conns.append(c)
    params = memoryview(bytearray(_data(a.size, a.seed).tobytes()))
    gather_end: list[float] = []  # one entry per iteration, appended when all N messages are in
    recv_done = [[0.0] * len(conns) for _ in range(a.iterations)]
    barrier = threading.Barrier(len(conns), action=lambda: gather_end.append(time.monotonic()))
    errors = []

    def serve(i, c):
        buf = memoryview(bytearray(a.size))
        try:
            for it in range(a.iterations):
                _recv_exact(c, buf)
                recv_done[it][i] = time.monotonic()
                barrier.wait()
                c.sendall(params)
        except Exception as e:  # noqa: BLE001
            errors.append(f"worker connection {i}: {e}")
            barrier.abort()

    ths = [threading.Thread(target=serve, args=(i, c), daemon=True) for i, c in enumerate(conns)]
    for t in ths:
        t.start()
    for t in ths:
        t.join()
    if errors:
        raise SystemExit("; ".join(errors))
    for it in range(a.iterations):
        _emit(dict(iteration=it, t_gather_end=gather_end[it], t_recv_done=recv_done[it]))


def _tcp_connect(host: str, port: int, cc: str, timeout_s: float = 20.0) -> socket.socket:
    """A TCP connection using congestion control ``cc``, retried while the peer is still starting."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, cc.encode())
    except OSError as e:
        s.close()
        raise SystemExit(f"congestion control {cc!r} unavailable: {e}; `modprobe tcp_{cc}`") from e
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            s.connect((host, port))
            return s
        except OSError:
            if time.monotonic() > deadline:
                s.close()
                raise
            time.sleep(0.05)


def incast_tcp_worker(a) -> None:
    host, port = _addr(a.ps)
    s = _tcp_connect(host, port, a.cc)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    grad = memoryview(bytearray(_data(a.size, a.seed).tobytes()))
    buf = memoryview(bytearray(a.size))
    _ready_and_wait_go()
    for it in range(a.iterations):
        t0 = time.monotonic()
        s.sendall(grad)
        t1 = time.monotonic()
        _recv_exact(s, buf)
        _emit(dict(iteration=it, t_send_start=t0, t_send_done=t1, t_bcast_done=time.monotonic()))
    s.close()


# --------------------------------------------------------------------------- fairness
#: seconds of silence before a fairness flow declares its peer dead (LTP's floor is 1 s, as the PS's 5 s): on a slow
#: bottleneck a TCP flow keeps full, every registration of a new message can be dropped for over a second (found:
#: ``ltp-lab fairness --quick --ccs cubic --rate 5mbit`` lost the LTP sender to "registration unanswered")
FAIR_PEER_SILENCE_S = 5.0


def fair_ltp_recv(a) -> None:
    import random

    import numpy as np

    import ltp

    async def main():
        ep = await ltp.open_endpoint(("0.0.0.0", a.port), config=ltp.Config(peer_silence_min_s=FAIR_PEER_SILENCE_S),
                                     rng=random.Random(a.seed))
        buf = np.zeros(a.size, np.uint8)
        print("READY", flush=True)
        n = 0
        t_first = None
        while True:
            rep = await ep.recv(buf, timeout=a.timeout)
            if rep.tag == END_TAG:
                break
            t_first = t_first or time.monotonic() - rep.duration_s
            n += 1
            if rep.regime != Regime.COMPLETE or rep.received_bytes != a.size:
                raise SystemExit(f"reliable message {rep.tag} ended {rep.regime} with {rep.received_bytes} B")
        _emit(dict(messages=n, bytes=n * a.size, t_first=t_first, t_end=time.monotonic()))
        await ep.close()

    ltp.run(main())


def fair_ltp_send(a) -> None:
    import asyncio
    import random

    import numpy as np

    import ltp

    async def main():
        ep = await ltp.open_endpoint(("0.0.0.0", 0), config=ltp.Config(peer_silence_min_s=FAIR_PEER_SILENCE_S),
                                     rng=random.Random(a.seed))
        data = np.random.default_rng(a.seed).integers(0, 255, a.size, dtype=np.uint8)
        loop = asyncio.get_running_loop()
        print("READY", flush=True)
        line = await loop.run_in_executor(None, sys.stdin.readline)
        if line.strip() != "GO":
            raise SystemExit(f"expected GO, got {line!r}")
        t0 = time.monotonic()
        n = 0
        retx = 0
        while True:
            rep = await ep.send(_addr(a.to), data, reliable=True, tag=n, timeout=a.timeout)
            retx += rep.retransmitted_packets
            n += 1
            if n >= a.count or time.monotonic() - t0 >= a.duration:
                break
        t_end = time.monotonic()
        await ep.send(_addr(a.to), np.zeros(4, np.uint8), reliable=True, tag=END_TAG, timeout=a.timeout)
        _emit(dict(messages=n, bytes=n * a.size, t_start=t0, t_end=t_end, retransmitted=retx))
        await ep.close()

    ltp.run(main())


def fair_tcp_recv(a) -> None:
    ls = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    ls.bind(("0.0.0.0", a.port))
    ls.listen(4)
    print("READY", flush=True)
    c, _ = ls.accept()
    buf = memoryview(bytearray(TCP_CHUNK))
    total = 0
    while True:
        n = c.recv_into(buf)
        if n == 0:
            break
        total += n
    c.close()
    _emit(dict(bytes=total, t_end=time.monotonic()))


def fair_tcp_send(a) -> None:
    host, port = _addr(a.to)
    s = _tcp_connect(host, port, a.cc)
    block = memoryview(bytearray(b"\x5a" * TCP_CHUNK))
    _ready_and_wait_go()
    t0 = time.monotonic()
    sent = 0
    while time.monotonic() - t0 < a.duration:
        sent += s.send(block)
    s.shutdown(socket.SHUT_WR)
    s.recv(1)  # EOF from the receiver: everything was read
    _emit(dict(bytes=sent, t_start=t0, t_end=time.monotonic()))
    s.close()


def sampler(a) -> None:
    """Print ``{"t": monotonic, "bytes": {counter: bytes}}`` every ``--interval`` s.

    Stops when a line (or EOF) arrives on stdin, or after ``--duration`` seconds.
    """
    stop = threading.Event()

    def watch_stdin():
        sys.stdin.readline()
        stop.set()

    threading.Thread(target=watch_stdin, daemon=True).start()
    print("READY", flush=True)
    t_end = time.monotonic() + a.duration
    nxt = time.monotonic()
    while not stop.is_set() and time.monotonic() < t_end:
        t_before = time.monotonic()
        r = subprocess.run(["nft", "-j", "list", "counters", "table", "inet", a.table],
                           capture_output=True, text=True)
        t_after = time.monotonic()
        t = (t_before + t_after) / 2  # the read happened somewhere in between
        if r.returncode != 0:
            raise SystemExit(f"nft failed: {r.stderr.strip()}")
        c = {item["counter"]["name"]: item["counter"]["bytes"]
             for item in json.loads(r.stdout)["nftables"] if "counter" in item}
        _emit(dict(t=t, read_s=round(t_after - t_before, 4), bytes=c))
        nxt += a.interval
        stop.wait(max(0.0, nxt - time.monotonic()))


ROLES = {"incast-ltp-ps": incast_ltp_ps, "incast-ltp-worker": incast_ltp_worker, "incast-tcp-ps": incast_tcp_ps,
         "incast-tcp-worker": incast_tcp_worker, "fair-ltp-recv": fair_ltp_recv, "fair-ltp-send": fair_ltp_send,
         "fair-tcp-recv": fair_tcp_recv, "fair-tcp-send": fair_tcp_send, "sampler": sampler}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ltp_tools.experiments._procs")
    ap.add_argument("role", choices=sorted(ROLES))
    ap.add_argument("--port", type=int, default=7447)
    ap.add_argument("--peers", default="", help="incast PS: comma list of worker host:port")
    ap.add_argument("--ps", default="", help="incast worker: the PS's host:port")
    ap.add_argument("--to", default="", help="fairness sender: the receiver's host:port")
    ap.add_argument("--workers", type=int, default=0)
    ap.add_argument("--size", type=int, default=0)
    ap.add_argument("--iterations", type=int, default=1)
    ap.add_argument("--count", type=int, default=1 << 30, help="fairness LTP: messages to send/receive")
    ap.add_argument("--duration", type=float, default=10.0)
    ap.add_argument("--interval", type=float, default=0.1)
    ap.add_argument("--table", default="ltpexp")
    ap.add_argument("--cc", default="cubic")
    ap.add_argument("--slack", type=float, default=0.03)
    ap.add_argument("--link-rate", type=float, default=None, help="incast LTP PS: its link rate, bit/s (grants)")
    ap.add_argument("--timeout", type=float, default=120.0)
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args(argv)
    ROLES[a.role](a)
    return 0


if __name__ == "__main__":
    sys.exit(main())
