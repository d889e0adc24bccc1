"""Per-message CPU of a parameter-server round, LTP against kernel TCP, in one process on loopback.

Theory of operation
    A PS round of the README's job moves three messages per worker: the PS broadcasts the parameters
    (reliable), each worker answers with an 8-byte READY note (reliable) and its gradient (LTP:
    loss-tolerant, the first 64 bytes critical; TCP: a stream write). On the digits model each
    message is 153 kB. On this 2-core machine the job is CPU-bound, so what each message costs the
    processes decides its round time (``docs/performance.md``, session 47). This command isolates that
    cost: one PS endpoint and ``--workers`` worker endpoints in ONE process and one event loop
    (uvloop), over loopback, no lab, no training, so the process CPU per round is the transport's
    work for ``3 x workers`` messages, both ends of each, kernel included.

    * ``ltp``: :meth:`ltp.Endpoint.broadcast`, ``recv`` of the READY notes, :meth:`ltp.Endpoint.gather`
      of the gradients; with a job key (every registration MACed, as ``ltp-ps`` runs) unless
      ``--no-key``.
    * ``tcp``: one loopback TCP connection per worker (asyncio streams); the PS writes the parameters
      to every connection and reads each READY and gradient with ``readexactly``.

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


async def _ltp_rounds(workers: int, size: int, rounds: int, warmup: int, key: bool) -> dict:
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
            await ws[i].send(pa, b"R" * READY_BYTES, reliable=True, tag=3 * r + 1)
            await ws[i].send(pa, grads[i], reliable=False, critical=CRITICAL, tag=3 * r + 2)

        async def server(r: int) -> list:
            await ps.broadcast(wa, params, tag=3 * r)
            await asyncio.gather(*(ps.recv(rin[i], peer=wa[i], tag=3 * r + 1) for i in range(workers)))
            return await ps.gather(wa, gin, tag=3 * r + 2)

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


async def _tcp_rounds(workers: int, size: int, rounds: int, warmup: int) -> dict:
    params, grads = _messages(workers, size)
    accepted: asyncio.Queue = asyncio.Queue()

    async def on_conn(reader, writer):
        await accepted.put((reader, writer))

    srv = await asyncio.start_server(on_conn, "127.0.0.1", 0)
    port = srv.sockets[0].getsockname()[1]
    wconns, pconns = [], []
    try:
        for _ in range(workers):
            wconns.append(await asyncio.open_connection("127.0.0.1", port))
            pconns.append(await accepted.get())
        got_params: list = [b""] * workers
        got_grads: list = [b""] * workers

        async def worker(i: int) -> None:
            reader, writer = wconns[i]
            got_params[i] = await reader.readexactly(size)
            writer.write(b"R" * READY_BYTES)
            writer.write(grads[i])
            await writer.drain()

        async def read_one(i: int) -> None:
            reader = pconns[i][0]
            await reader.readexactly(READY_BYTES)
            got_grads[i] = await reader.readexactly(size)

        async def server() -> None:
            for _, writer in pconns:
                writer.write(params)
            await asyncio.gather(*(w.drain() for _, w in pconns))
            await asyncio.gather(*(read_one(i) for i in range(workers)))

        def check(_result) -> None:
            for i in range(workers):
                if got_params[i] != params:
                    raise RoundFailed(f"worker {i}: parameters arrived wrong")
                if got_grads[i] != grads[i]:
                    raise RoundFailed(f"worker {i}: gradient arrived wrong")

        return await _timed(lambda r: _round(server(), [worker(i) for i in range(workers)]), check, rounds, warmup)
    finally:
        for _, writer in wconns + pconns:
            writer.close()
        srv.close()


async def _timed(one_round, check, rounds: int, warmup: int) -> dict:
    for r in range(warmup):
        check(await one_round(r))
    c0, t0 = time.process_time(), time.perf_counter()
    for r in range(warmup, warmup + rounds):
        result = await one_round(r)
        check(result)  # inside the clock for both transports alike: a byte compare per message
    cpu, wall = time.process_time() - c0, time.perf_counter() - t0
    return dict(cpu_s=cpu, wall_s=wall)


def run(transport: str, *, workers: int, size: int, rounds: int, warmup: int, key: bool = True) -> dict:
    """One transport's rounds; returns its result row (raises :class:`RoundFailed` on a wrong message)."""
    import uvloop

    if transport == "ltp":
        coro = _ltp_rounds(workers, size, rounds, warmup, key)
    elif transport == "tcp":
        coro = _tcp_rounds(workers, size, rounds, warmup)
    else:
        raise ValueError(f"unknown transport {transport!r}: ltp or tcp")
    res = uvloop.run(coro)
    messages = 3 * workers * rounds
    return dict(transport=transport, workers=workers, size_bytes=size, rounds=rounds,
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
                          key=not args.no_key)
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
