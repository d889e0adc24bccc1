"""Reliable one-to-many: one process sends the same ``size`` bytes to N peers, LTP vs N kernel-TCP connections.

Theory of operation
    Issue 8's target 5 ("reliable broadcast of 100 MB to 4 peers: <= 1.0x the time of four
    kernel-TCP connections from one process").  A lab of N + 1 hosts (unlimited veths, as the
    ``cpu`` row), the sender on the first.

    * LTP: one receiver process per peer posts a receive for the message; the sender process
      calls :meth:`ltp.Endpoint.broadcast` (reliable) once and its clock stops when every peer's
      transfer is acknowledged in full. Each receiver's endpoint is connected to the sender
      (``open_endpoint(peer=...)``), as a TCP peer's socket is and as ``ltp-bench``'s are;
      ``--unconnected`` opens them to any peer (before session 56, the only way).
    * TCP: a ``tcpbench server --once --size`` per peer; the sender process runs one
      :func:`ltp_tools.tcpbench.send` per peer on its own thread (``send()`` releases the GIL),
      all from one message buffer, each stopping when its receiver confirmed the byte count;
      the broadcast time is from the start until the last confirmation.

    Both transports move the test message of :mod:`ltp_tools.payload` from one message-sized
    buffer into one per peer, faulted in before the clock; every peer checks every byte after it,
    once the sender's clock has stopped (one line on each peer's stdin releases it): the peers share
    the sender's machine, and a peer that finished first would otherwise check its 100 MB on the
    cores the transfers still running need. Until session 56 they checked as soon as their own
    transfer ended, which charged LTP, whose flows end further apart than TCP's, for that work.

    Result: one JSON line per run with ``duration_s``, ``goodput_gbps`` (N x size over the
    duration) and the machine-wide CPU over the transfer; for LTP also what each process's
    event loop did: the sender's wake-ups (``sender_wakeups``, :attr:`ltp.Endpoint.loop_stats`)
    and datagrams in (its ACKs) and out, and per receiver (``receivers``) the same three, so a
    run says how many datagrams each receiver read per wake-up and per ACK it sent. Both transports
    report when the sender's clock stopped (``clock_stop_s``) and, per receiver, when its check began
    (``check_start_s``), both CLOCK_MONOTONIC on the one machine.

    python -m ltp_tools.broadcast_bench --transport ltp|cubic|bbr --size 100M --peers 4
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time

from ltp_ext.constants import SEND_THREADS_MAX
from ltp_tools.argtypes import number
from ltp_tools.machine_cpu import machine_cpu_s

PORT = 7447
TCP_PORT = 5201

_LTP_RECV = r'''
import asyncio, json, sys, time, numpy as np, ltp
from ltp_tools.payload import verify
async def main():
    # connected to the sender (argv[4:6]: its address and port), as a TCP peer's socket is, unless none is given
    peer = (sys.argv[4], int(sys.argv[5])) if len(sys.argv) > 5 else None
    ep = await ltp.open_endpoint(("0.0.0.0", int(sys.argv[1])), peer=peer)
    buf = np.empty(int(sys.argv[2]), np.uint8)
    buf.fill(0)  # fault the pages in before the clock starts, as ltp-bench's receiver and the TCP servers
    print("ready", flush=True)
    reports = await ep.recv(buf, tag=7, timeout=float(sys.argv[3]))
    # the check waits for the sender's clock to stop (a line on stdin): the peers share its machine, and a peer
    # that finished first would otherwise check its bytes on the cores the transfers still running need.
    # The endpoint keeps answering meanwhile (the line is read off the event loop)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    check_start = time.monotonic()
    ok = verify(buf)  # every byte
    await asyncio.sleep(0.5)  # let the last ACKs leave (and be counted below)
    print(json.dumps({"wakeups": dict(ep.loop_stats), "datagrams_in": ep.stats.datagrams_in,
                      "datagrams_out": ep.stats.datagrams_out, "check_start_s": check_start,
                      "connected": ep.peer is not None}), flush=True)
    print("done" if ok else "corrupt", flush=True)
    await ep.close()
ltp.run(main())
'''

_LTP_SEND = r'''
import asyncio, json, sys, time, ltp
from ltp_tools.machine_cpu import machine_cpu_s
from ltp_tools.payload import pattern
async def main():
    peers = [(h, int(sys.argv[1])) for h in sys.argv[7:]]
    threads = int(sys.argv[4])
    ltp.Endpoint.stage_sends = sys.argv[5] == "1"  # read when the endpoint opens
    ep = await ltp.open_endpoint(("0.0.0.0", int(sys.argv[6])),
                                 config=ltp.Config(**({} if threads < 0 else {"send_threads": threads})))
    data = pattern(int(sys.argv[2]))
    m0, t0 = machine_cpu_s(), time.monotonic()
    reports = await ep.broadcast(peers, data, tag=7, timeout=float(sys.argv[3]))
    t1, m1 = time.monotonic(), machine_cpu_s()
    print(json.dumps({"duration_s": t1 - t0, "clock_stop_s": t1, "machine_cpu_s": None if m0 is None else round(m1 - m0, 3),
                      "delivered": [getattr(r, "delivered_fraction", None) for r in reports],
                      "send_threads": ep.config.send_threads, "stage_sends": ep.stage_sends,
                      "sender_wakeups": dict(ep.loop_stats), "sender_port": ep.local_addr[1],
                      "sender_datagrams_in": ep.stats.datagrams_in, "sender_datagrams_out": ep.stats.datagrams_out}),
          flush=True)
    await ep.close()
ltp.run(main())
'''


def tcp_broadcast(hosts: list[str], size: int, cc: str = "cubic", port: int = TCP_PORT) -> dict:
    """One process, one thread and one TCP connection per peer, all at once; returns the timing dict."""
    from ltp_tools.payload import pattern
    from ltp_tools.tcpbench import send

    results: list = [None] * len(hosts)
    data = pattern(size)  # one message, as the LTP sender has: filled before the clock, shared by the threads

    def one(i, h):
        try:
            results[i] = send(h, port, size, cc=cc, data=data)
        except Exception as e:  # noqa: BLE001 - reported below
            results[i] = e

    threads = [threading.Thread(target=one, args=(i, h)) for i, h in enumerate(hosts)]
    m0, t0 = machine_cpu_s(), time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    t1, m1 = time.monotonic(), machine_cpu_s()
    bad = [r for r in results if isinstance(r, Exception)]
    if bad:
        raise RuntimeError(f"TCP broadcast failed: {bad[0]}")
    return {"duration_s": t1 - t0, "clock_stop_s": t1, "machine_cpu_s": None if m0 is None else round(m1 - m0, 3)}


def _release(procs, timeout: float) -> list[list[str]]:
    """Tell every receiver the sender's clock has stopped (one line on its stdin: it checks its bytes now) and
    collect its output lines; a receiver that does not finish within ``timeout`` s is killed (no lines)."""
    for p in procs:
        try:
            p.stdin.write("go\n")
            p.stdin.flush()
        except (BrokenPipeError, OSError):
            pass  # it already exited; its output says why
    out = []
    for p in procs:
        try:
            out.append(p.communicate(timeout=timeout)[0].strip().splitlines())
        except subprocess.TimeoutExpired:
            p.kill()
            p.communicate()
            out.append([])
    return out


def run(*, transport: str = "ltp", size: int = 100_000_000, peers: int = 4, timeout: float = 300.0,
        send_threads: int | None = None, stage_sends: bool = True, connected: bool = True) -> dict:
    """One broadcast in a fresh lab of ``peers + 1`` hosts; the result dict (see the module docstring).

    ``send_threads``: the LTP sender's ``Config.send_threads`` (None: its default); ``stage_sends=False``: its
    ``Endpoint.stage_sends`` off (two buffers per DATA packet to the kernel). ``connected`` (default): each LTP
    receiver's endpoint is connected to the sender (``open_endpoint(peer=...)``, the sender bound to ``PORT + 1``),
    as each TCP peer's socket is to its connection and as ``ltp-bench`` does, so the kernel demultiplexes its
    datagrams early; ``connected=False`` leaves them open to any peer, as a worker's endpoint is."""
    from ltp_tools.netlab import Lab

    if peers < 1 or size < 1:
        raise ValueError(f"need peers >= 1 and size >= 1 (got {peers}, {size})")
    py = sys.executable
    kw = dict(stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    with Lab(n_hosts=peers + 1) as lab:
        snd, rcvs = lab.hosts[0], lab.hosts[1:]
        addrs = [h.addr for h in rcvs]
        if transport == "ltp":
            conn = [snd.addr, str(PORT + 1)] if connected else []
            procs = [lab.popen(h, [py, "-c", _LTP_RECV, str(PORT), str(size), str(timeout), *conn],
                               stdin=subprocess.PIPE, **kw) for h in rcvs]
            for p in procs:  # each receiver has bound and posted before the sender starts
                if p.stdout.readline().strip() != "ready":
                    raise RuntimeError(f"an LTP receiver did not start: {p.stderr.read()[-800:]}")
            s = lab.run(snd, [py, "-c", _LTP_SEND, str(PORT), str(size), str(timeout),
                              str(-1 if send_threads is None else send_threads), "1" if stage_sends else "0",
                              str(PORT + 1 if connected else 0), *addrs],
                        capture_output=True, text=True, timeout=timeout + 30)
            outs = _release(procs, 30)  # the clock has stopped: the receivers check their bytes now
            if s.returncode != 0:
                raise RuntimeError(f"LTP broadcast sender failed: {s.stderr[-1500:]}")
            res = json.loads(s.stdout.strip().splitlines()[-1])
            if not all(len(o) >= 2 and o[-1] == "done" for o in outs):
                raise RuntimeError(f"an LTP receiver did not get the whole message intact: {outs}")
            res["receivers"] = [json.loads(o[-2]) for o in outs]
            res["connected"] = connected
        else:
            from ltp_tools.ready import wait_ready
            from ltp_tools.tcpbench import READY_BASE_S, READY_PER_BYTE_S

            procs = [lab.popen(h, [py, "-m", "ltp_tools.tcpbench", "server", "--port", str(TCP_PORT), "--once",
                                   "--size", str(size), "--hold"], stdin=subprocess.PIPE, **kw) for h in rcvs]
            for p in procs:  # each receiver has faulted its message buffer in before the sender starts
                wait_ready(p, READY_BASE_S + size * READY_PER_BYTE_S, "tcpbench server")
            s = lab.run(snd, [py, "-c", f"import json; from ltp_tools.broadcast_bench import tcp_broadcast; "
                                        f"print(json.dumps(tcp_broadcast({addrs!r}, {size}, {transport!r})))"],
                        capture_output=True, text=True, timeout=timeout + 30)
            rx = _release(procs, 30 + size * READY_PER_BYTE_S)
            if s.returncode != 0:
                raise RuntimeError(f"TCP broadcast sender failed: {s.stderr[-1500:]}")
            res = json.loads(s.stdout.strip().splitlines()[-1])
            if not all(o and json.loads(o[-1]).get("verified") is True for o in rx):
                raise RuntimeError(f"a TCP receiver did not get the whole message intact: {rx}")
            res["receivers"] = [{"check_start_s": json.loads(o[-1])["check_start_s"]} for o in rx]
    res.update(transport=transport, size_bytes=size, peers=peers,
               goodput_gbps=peers * size * 8 / res["duration_s"] / 1e9)
    return res


def main(argv=None) -> int:
    from ltp_tools.bench import parse_size

    ap = argparse.ArgumentParser(prog="python -m ltp_tools.broadcast_bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--transport", default="ltp", help="ltp, or a TCP congestion control: cubic, bbr, reno")
    ap.add_argument("--size", type=parse_size, default=parse_size("100M"))
    ap.add_argument("--peers", type=int, default=4)
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument("--send-threads", type=number(int, 0, SEND_THREADS_MAX, what="LTP sender threads"), default=None,
                    help="LTP: the sender's Config.send_threads (default: the Config default)")
    ap.add_argument("--no-stage", action="store_true",
                    help="LTP: the sender hands the kernel two buffers per DATA packet (Endpoint.stage_sends off)")
    ap.add_argument("--unconnected", action="store_true",
                    help="LTP: each receiver's endpoint is open to any peer (default: connected to the sender, as a "
                         "TCP peer's socket is)")
    a = ap.parse_args(argv)
    print(json.dumps(run(transport=a.transport, size=a.size, peers=a.peers, timeout=a.timeout,
                         send_threads=a.send_threads, stage_sends=not a.no_stage, connected=not a.unconnected)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
