"""Per-message CPU of a parameter-server round, LTP against kernel TCP, in one process on loopback.

Theory of operation
    A BSP round of the README's job moves two messages per worker: the PS broadcasts the parameters
    (reliable) and gathers each worker's gradient (LTP: loss-tolerant, the first 64 bytes critical,
    gathered with the Early Close clock started once every gradient registered, ``clock="all"``, as
    ``ltp_ps`` does since session 54; TCP: a stream write). On the digits model each message is 153 kB.
    On this 2-core machine the job is CPU-bound, so what each message costs the processes decides its
    round time (``docs/performance.md``, session 47). This command isolates that cost: one PS endpoint
    and ``--workers`` worker endpoints in ONE process and one event loop (uvloop), over loopback, no
    lab, no training, so the process CPU per round is the transport's work for ``2 x workers`` messages,
    both ends of each, kernel included.

    ``--ready`` adds the 8-byte reliable READY note each worker sent before its gradient until session
    54 (``3 x workers`` messages a round): the round the figures of sessions 47-53 were measured on.

    * ``ltp``: :meth:`ltp.Endpoint.broadcast`, (``recv`` of the READY notes,) :meth:`ltp.Endpoint.gather`
      of the gradients; with a job key (every registration MACed, as ``ltp-ps`` runs) unless
      ``--no-key``.
    * ``tcp``: one loopback TCP connection per worker, moved as ``ltp_ps``'s TCP transport moves them
      (since session 60): the sender hands its own buffer to the kernel (``sock_sendall``) and the
      receiver has the kernel write straight into the message's buffer (``sock_recv_into``). Before,
      asyncio streams copied each message twice more.

    Every round's parameters and gradients are checked byte for byte at the receiver after the clock
    (the gradient's delivered fraction too: on loopback nothing is lost, so anything short is a
    failure). Prints one JSON line per transport: CPU and wall milliseconds per round, microseconds
    of CPU per message, and with both transports the ratio LTP / TCP. Exit status 1 if any message
    arrived wrong or short.

    python -m ltp_tools.msg_round --workers 4 --size 153k --rounds 300 --transport ltp,tcp
"""
from __future__ import annotations

import argparse
import asyncio
import json
import socket
import sys
import time

import numpy as np

from ltp_tools.bench import parse_size

READY_BYTES = 8
CRITICAL = [(0, 64)]


class RoundFailed(RuntimeError):
    """A message of a round arrived wrong or short."""


def _messages(workers: int, size: int):
    rng = np.random.default_rng(0)
    params = rng.integers(0, 256, size, dtype=np.uint8).tobytes()
    grads = [rng.integers(0, 256, size, dtype=np.uint8).tobytes() for _ in range(workers)]
    return params, grads


def messages_per_round(workers: int, ready: bool) -> int:
    """Messages one round moves: the parameters and a gradient per worker, and a READY note with ``ready``."""
    return (3 if ready else 2) * workers


async def _ltp_rounds(workers: int, size: int, rounds: int, warmup: int, key: bool, ready: bool = False) -> dict:
    import ltp

    cfg = ltp.Config(job_key=b"msg-round-bench-key" if key else None)
    ps = await ltp.open_endpoint(("127.0.0.1", 0), config=cfg)
    ws = [await ltp.open_endpoint(("127.0.0.1", 0), config=cfg) for _ in range(workers)]
    try:
        pa, wa = ps.local_addr, [w.local_addr for w in ws]
        params, grads = _messages(workers, size)
        pin = [bytearray(size) for _ in range(workers)]
        gin = [bytearray(size) for _ in range(workers)]
        rin = [bytearray(READY_BYTES) for _ in range(workers)]

        async def worker(i: int, r: int) -> None:
            await ws[i].recv(pin[i], peer=pa, tag=3 * r)
            if ready:
                await ws[i].send(pa, b"R" * READY_BYTES, reliable=True, tag=3 * r + 1)
            await ws[i].send(pa, grads[i], reliable=False, critical=CRITICAL, tag=3 * r + 2)

        async def server(r: int) -> list:
            await ps.broadcast(wa, params, tag=3 * r)
            if ready:
                await asyncio.gather(*(ps.recv(rin[i], peer=wa[i], tag=3 * r + 1) for i in range(workers)))
                return await ps.gather(wa, gin, tag=3 * r + 2)
            return await ps.gather(wa, gin, tag=3 * r + 2, clock="all")

        def check(reports) -> None:
            for i in range(workers):
                if bytes(pin[i]) != params:
                    raise RoundFailed(f"worker {i}: parameters arrived wrong")
                frac = reports[i].delivered_fraction
                if frac < 1.0 or bytes(gin[i]) != grads[i]:
                    raise RoundFailed(f"worker {i}: gradient delivered {frac:.4f}, or wrong, on loopback")

        return await _timed(lambda r: _round(server(r), [worker(i, r) for i in range(workers)]), check,
                            rounds, warmup)
    finally:
        for e in [ps] + ws:
            await e.close()


async def _round(server_coro, worker_coros):
    out = await asyncio.gather(server_coro, *worker_coros)
    return out[0]


async def _tcp_rounds(workers: int, size: int, rounds: int, warmup: int, ready: bool = False) -> dict:
    loop = asyncio.get_running_loop()
    params, grads = _messages(workers, size)
    lsock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    wsocks, psocks = [], []
    try:
        lsock.bind(("127.0.0.1", 0))
        lsock.listen(workers)
        lsock.setblocking(False)
        for _ in range(workers):
            w = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            w.setblocking(False)
            wsocks.append(w)
            await asyncio.gather(loop.sock_connect(w, lsock.getsockname()), _accept(loop, lsock, psocks))
        for s in wsocks + psocks:
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        pin = [bytearray(size) for _ in range(workers)]
        gin = [bytearray(size) for _ in range(workers)]
        rin = [bytearray(READY_BYTES) for _ in range(workers)]
        ready_note = b"R" * READY_BYTES

        async def worker(i: int) -> None:
            w = wsocks[i]
            await _recv_into(loop, w, pin[i])
            if ready:
                await loop.sock_sendall(w, ready_note)
            await loop.sock_sendall(w, grads[i])

        async def read_one(i: int) -> None:
            if ready:
                await _recv_into(loop, psocks[i], rin[i])
            await _recv_into(loop, psocks[i], gin[i])

        async def server() -> None:
            await asyncio.gather(*(loop.sock_sendall(p, params) for p in psocks))
            await asyncio.gather(*(read_one(i) for i in range(workers)))

        def check(_result) -> None:
            for i in range(workers):
                if pin[i] != params:
                    raise RoundFailed(f"worker {i}: parameters arrived wrong")
                if gin[i] != grads[i]:
                    raise RoundFailed(f"worker {i}: gradient arrived wrong")

        return await _timed(lambda r: _round(server(), [worker(i) for i in range(workers)]), check, rounds, warmup)
    finally:
        for s in wsocks + psocks + [lsock]:
            s.close()


async def _accept(loop, lsock, into: list) -> None:
    conn, _ = await loop.sock_accept(lsock)
    conn.setblocking(False)
    into.append(conn)


async def _recv_into(loop, sock, buf: bytearray) -> None:
    """Read exactly ``len(buf)`` bytes into ``buf`` itself (the kernel writes there; no intermediate copy)."""
    view = memoryview(buf)
    got = 0
    while got < len(buf):
        n = await loop.sock_recv_into(sock, view[got:])
        if n == 0:
            raise RoundFailed(f"the connection closed after {got} of {len(buf)} bytes")
        got += n


async def _timed(one_round, check, rounds: int, warmup: int) -> dict:
    for r in range(warmup):
        check(await one_round(r))
    c0, t0 = time.process_time(), time.perf_counter()
    for r in range(warmup, warmup + rounds):
        result = await one_round(r)
        check(result)  # inside the clock for both transports alike: a byte compare per message
    cpu, wall = time.process_time() - c0, time.perf_counter() - t0
    return dict(cpu_s=cpu, wall_s=wall)


def run(transport: str, *, workers: int, size: int, rounds: int, warmup: int, key: bool = True,
        ready: bool = False) -> dict:
    """One transport's rounds; returns its result row (raises :class:`RoundFailed` on a wrong message)."""
    import uvloop

    if transport == "ltp":
        coro = _ltp_rounds(workers, size, rounds, warmup, key, ready)
    elif transport == "tcp":
        coro = _tcp_rounds(workers, size, rounds, warmup, ready)
    else:
        raise ValueError(f"unknown transport {transport!r}: ltp or tcp")
    res = uvloop.run(coro)
    messages = messages_per_round(workers, ready) * rounds
    return dict(transport=transport, workers=workers, size_bytes=size, rounds=rounds, ready_notes=ready,
                cpu_ms_per_round=res["cpu_s"] / rounds * 1e3, wall_ms_per_round=res["wall_s"] / rounds * 1e3,
                cpu_us_per_message=res["cpu_s"] / messages * 1e6, job_key=key if transport == "ltp" else None)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--size", type=parse_size, default=153_128,
                    help="bytes per parameter and gradient message (default 153128, the digits model's)")
    ap.add_argument("--rounds", type=int, default=300)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--transport", default="ltp,tcp", help="ltp, tcp or both (ltp,tcp): alternated per --repeats")
    ap.add_argument("--repeats", type=int, default=1, help="runs per transport, alternated")
    ap.add_argument("--no-key", action="store_true", help="LTP without a job key (no REG MACs)")
    ap.add_argument("--ready", action="store_true",
                    help="each worker also sends an 8-byte READY note before its gradient (the PS round before "
                         "session 54, which the figures of sessions 47-53 measured)")
    args = ap.parse_args(argv)
    transports = [t.strip() for t in args.transport.split(",") if t.strip()]
    if args.workers < 1 or args.rounds < 1 or args.warmup < 0 or args.repeats < 1 or args.size < 64:
        ap.error("--workers, --rounds and --repeats must be >= 1, --warmup >= 0, --size >= 64 bytes")
    if not transports or any(t not in ("ltp", "tcp") for t in transports):
        ap.error("--transport takes ltp, tcp or ltp,tcp")
    rows: dict = {t: [] for t in transports}
    for _ in range(args.repeats):
        for t in transports:
            try:
                row = run(t, workers=args.workers, size=args.size, rounds=args.rounds, warmup=args.warmup,
                          key=not args.no_key, ready=args.ready)
            except RoundFailed as exc:
                print(f"msg_round: {t}: {exc}", file=sys.stderr)
                return 1
            rows[t].append(row)
            print(json.dumps(row), flush=True)
    if len(transports) == 2:
        med = {t: float(np.median([r["cpu_ms_per_round"] for r in rows[t]])) for t in transports}
        print(json.dumps(dict(ltp_over_tcp_cpu=med["ltp"] / med["tcp"], ltp_cpu_ms_per_round=med["ltp"],
                              tcp_cpu_ms_per_round=med["tcp"], repeats=args.repeats)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
