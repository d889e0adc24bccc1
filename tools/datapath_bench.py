"""Micro-benchmark of ``ltp_ext._datapath`` (compiled) and its twin ``ltp_ext._datapath_py``.

Run: ``python -m ltp_tools.datapath_bench [--packets 50000] [--seg-size 1456] [--batch 64]
[--repeat 5] [--impl compiled twin]``.

For each implementation it prints one JSON line with nanoseconds per packet
(best of ``--repeat`` runs; the twin runs ``--twin-packets`` packets, it is
~100x slower):

* ``ingest_ns``: ``RecvWindow.ingest`` of runs of ``--batch`` datagrams
  (``16 + seg_size`` bytes each) from a hot receive buffer into a fresh
  message, plus one ``take_acks`` per run, as the engine does after a
  ``recvmmsg``. Includes the payload copy into the (cold) destination: with
  streaming stores in the compiled module on x86-64 once the message is
  ``ltp_ext.constants.STREAM_COPY_MIN`` bytes or more (the default
  ``--packets`` make a 73 MB message), ``memcpy`` below that.
* ``ingest_dup_ns``: the same datagrams a second time: every one is a
  duplicate, so this is the per-datagram cost *without* the payload copy
  (header parse, checks, ACK entry).
* ``build_ns``: ``SendWindow.build`` of ``--batch`` new segments per call
  into one reused ``bytearray`` (header + payload ``memcpy`` + bookkeeping).
* ``on_ack_ns``: ``SendWindow.on_ack`` per ACK entry, 364 entries per call
  (a full ACK datagram), every 50th packet missing so loss detection runs.
* ``expire_ns``: one ``expire`` over the whole window, per declared loss.

Only the kernel calls are timed (the rewrite of the receive buffer between
runs is not). This is a command, not a test: numbers depend on the machine.
"""

from __future__ import annotations

import argparse
import importlib
import json
import platform
import time

import numpy as np

MODULES = {"compiled": "ltp_ext._datapath", "twin": "ltp_ext._datapath_py"}
HEADER = 16            # bytes
ACK_ENTRIES = 364      # entries per full ACK datagram
LOSS_EVERY = 50        # on_ack: every 50th packet is never acknowledged
FLOW_ID = 0x0102
TOKEN = 0xA0B0C0D0


def _best(fn, repeat: int) -> float:
    return min(fn() for _ in range(repeat))


def bench_ingest(mod, n: int, seg: int, batch: int, repeat: int) -> tuple[float, float]:
    stride = HEADER + seg
    total = n * seg
    # one hot receive buffer of `batch` datagrams; word 2 (seq, attempt) is rewritten per run
    sender = mod.SendWindow(bytes(seg * batch), seg * batch, seg, FLOW_ID, TOKEN, 0, np.zeros(batch, np.uint8))
    rx = bytearray(batch * stride)
    sender.build(np.arange(batch, dtype=np.int64), 0.0, 0, 0.0, 0.0, 0, rx)
    rows = np.frombuffer(rx, np.uint8).reshape(batch, stride)
    word2 = np.empty((n + batch, 4), np.uint8)
    w2 = (np.arange(n + batch, dtype=np.uint32) << 8) | 1
    word2[:] = w2.astype(">u4").view(np.uint8).reshape(-1, 4)
    offsets = np.arange(batch, dtype=np.int64) * stride
    lengths = np.full(batch, stride, np.int64)
    mv = memoryview(rx)
    dest = bytearray(total)

    def run(window) -> float:
        spent = 0
        for base in range(0, n, batch):
            m = min(batch, n - base)
            rows[:m, 8:12] = word2[base:base + m]
            t0 = time.perf_counter_ns()
            window.ingest(mv, offsets, lengths, 0, m)
            window.take_acks()
            spent += time.perf_counter_ns() - t0
        assert window.n_acks == 0
        return spent / n

    def fresh() -> float:
        w = mod.RecvWindow(dest, total, seg, FLOW_ID, TOKEN, None, batch)
        ns = run(w)
        assert w.received == n
        return ns

    first = _best(fresh, repeat)
    w = mod.RecvWindow(dest, total, seg, FLOW_ID, TOKEN, None, batch)
    run(w)
    dup = _best(lambda: run(w), repeat)
    return first, dup


def bench_send(mod, n: int, seg: int, batch: int, repeat: int) -> tuple[float, float, float]:
    total = n * seg
    data = np.random.default_rng(1).integers(0, 256, total, dtype=np.uint8)
    out = bytearray(batch * (HEADER + seg))
    chunks = [np.arange(b, min(b + batch, n), dtype=np.int64) for b in range(0, n, batch)]
    keep = np.ones(n, bool)
    keep[::LOSS_EVERY] = False
    entries = (np.flatnonzero(keep).astype(np.uint32) << 8) | 1
    acks = [entries[k:k + ACK_ENTRIES] for k in range(0, entries.shape[0], ACK_ENTRIES)]

    def one() -> tuple[float, float, float]:
        w = mod.SendWindow(data, total, seg, FLOW_ID, TOKEN, 0, np.zeros(n, np.uint8))
        t0 = time.perf_counter_ns()
        for i, c in enumerate(chunks):
            w.build(c, i * 1e-6, i, 0.0, 0.0, 0, out)
        t1 = time.perf_counter_ns()
        delivered, dtime = 0, 0.0
        for a in acks:
            r = w.on_ack(a, 1.0, delivered, dtime)
            delivered, dtime = r[2], r[3]
        t2 = time.perf_counter_ns()
        w2 = mod.SendWindow(data, total, seg, FLOW_ID, TOKEN, 0, np.zeros(n, np.uint8))
        for i, c in enumerate(chunks):
            w2.build(c, 0.0, 0, 0.0, 0.0, 0, out)
        t3 = time.perf_counter_ns()
        lost = w2.expire(1.0)
        t4 = time.perf_counter_ns()
        assert w.acked_count == entries.shape[0] and lost.shape[0] == n
        return (t1 - t0) / n, (t2 - t1) / entries.shape[0], (t4 - t3) / n

    runs = [one() for _ in range(repeat)]
    return tuple(min(r[k] for r in runs) for k in range(3))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--packets", type=int, default=50_000, help="packets per run (compiled)")
    ap.add_argument("--twin-packets", type=int, default=5_000, help="packets per run (twin)")
    ap.add_argument("--seg-size", type=int, default=1456, help="payload bytes per datagram")
    ap.add_argument("--batch", type=int, default=64, help="datagrams per ingest/build call")
    ap.add_argument("--repeat", type=int, default=5, help="runs; the best is reported")
    ap.add_argument("--impl", nargs="+", choices=sorted(MODULES), default=["compiled", "twin"])
    args = ap.parse_args(argv)
    for impl in args.impl:
        try:
            mod = importlib.import_module(MODULES[impl])
        except ImportError as exc:
            print(json.dumps({"impl": impl, "error": f"not built: {exc}"}), flush=True)
            continue
        n = args.packets if impl == "compiled" else args.twin_packets
        repeat = args.repeat if impl == "compiled" else max(1, min(args.repeat, 2))
        ingest, dup = bench_ingest(mod, n, args.seg_size, args.batch, repeat)
        build, on_ack, expire = bench_send(mod, n, args.seg_size, args.batch, repeat)
        print(json.dumps({
            "impl": impl, "packets": n, "seg_size": args.seg_size, "batch": args.batch,
            "ingest_ns": round(ingest, 1), "ingest_dup_ns": round(dup, 1), "build_ns": round(build, 1),
            "on_ack_ns": round(on_ack, 1), "expire_ns": round(expire, 1),
            "cpu": platform.processor() or platform.machine(),
        }), flush=True)


if __name__ == "__main__":
    main()
