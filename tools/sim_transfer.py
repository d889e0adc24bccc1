"""One reliable LTP transfer through ``ltp.sim``'s emulated link: the protocol's goodput with no CPU cost at all.

Theory of operation
    The lab's rows measure the protocol and this machine's CPU together. This command takes the CPU out:
    two sans-IO :class:`ltp.engine.Engine` objects (the production state machines, ``Config`` defaults)
    exchange one message through :class:`ltp.sim.SimNetwork` on a virtual clock. The forward link is what
    the lab's ``--rate/--delay/--loss`` make of a host's link:

    * ``rate``: wire bit/s, counted as the lab's tbf counts them (Ethernet frames, the datagram + 42 bytes):
      the simulator's link counts IP packets (the datagram + 28), so its rate is
      ``rate x (datagram + 28) / (datagram + 42)``;
    * ``queue``: the bottleneck's drop-tail queue in bytes (default: the lab's, ``netlab.lab.tbf_queue_bytes``);
    * ``delay``: one-way, both directions; ``loss``: random drop of DATA-sized datagrams (the lab's rule).

    The result names what the run cost the path: datagrams sent, resends, random and queue drops, and a
    trace per ``--interval`` of the sender's BBR state, its BtlBw and what the link sent and dropped. The
    ``ceiling_gbps`` is the goodput an instant start and no tail would give (every packet the message and its
    random losses need, at the link's packet rate). Same seed, same run.

    python -m ltp_tools.sim_transfer --size 200M --rate 1gbit --delay 10ms --loss 0.01 [--trace]
"""
from __future__ import annotations

import argparse
import json
import random

import numpy as np

from ltp_tools.argtypes import number


def run(*, size: int, rate_bps: float, delay_s: float = 0.0, loss: float = 0.0, queue_bytes: int | None = None,
        interval_s: float = 0.02, seed: int = 0, limit_s: float = 600.0) -> dict:
    """One transfer of ``size`` bytes; the result dict (see the module docstring). Raises RuntimeError when the
    message did not arrive whole within ``limit_s`` of virtual time."""
    from ltp import Config
    from ltp.engine import Engine
    from ltp.link_share import WIRE_OVERHEAD_BYTES
    from ltp.sim import IP_UDP_HEADER_BYTES, SimNetwork
    from ltp.wire import HEADER_SIZE
    from ltp_tools.netlab.lab import DATA_MIN_IP_LEN, tbf_queue_bytes
    from ltp_tools.payload import pattern, verify

    if size < 1 or rate_bps <= 0 or delay_s < 0 or not 0 <= loss < 1 or interval_s <= 0:
        raise ValueError(f"need size >= 1, rate > 0, delay >= 0, 0 <= loss < 1 and interval > 0 (got {size}, "
                         f"{rate_bps}, {delay_s}, {loss}, {interval_s})")
    cfg = Config()
    seg = cfg.segment_size_for(1)  # the message is bytes
    datagram = seg + HEADER_SIZE
    # the simulator's bytes/s: its links time IP packets, the tbf Ethernet frames
    link_rate = rate_bps / 8 * (datagram + IP_UDP_HEADER_BYTES) / (datagram + WIRE_OVERHEAD_BYTES)
    queue = tbf_queue_bytes(rate_bps, datagram + WIRE_OVERHEAD_BYTES) if queue_bytes is None else int(queue_bytes)
    net = SimNetwork(seed=seed)
    a, b = ("10.0.0.1", 7447), ("10.0.0.2", 7447)
    tx = Engine(cfg, rng=random.Random(seed * 2 + 1), local_addr=a)
    rx = Engine(cfg, rng=random.Random(seed * 2 + 2), local_addr=b)
    net.add_host(a, tx)
    net.add_host(b, rx)
    # random loss takes what the lab's rule takes: IP packets longer than DATA_MIN_IP_LEN (the simulator counts
    # datagrams, 28 bytes shorter)
    fwd = net.set_link(a, b, rate=link_rate, delay_s=delay_s, loss=loss,
                       loss_min_size=DATA_MIN_IP_LEN - IP_UDP_HEADER_BYTES, queue_bytes=queue)
    net.set_link(b, a, delay_s=delay_s)
    data = pattern(size)
    buf = np.zeros(size, np.uint8)
    rx.post_receive([(a, 1, buf)], now=0.0, timeout=None)
    tx.send(b, data, now=0.0, reliable=True, tag=1)
    done: list = []
    trace: list = []
    last = {"t": -interval_s, "sent": 0, "queue_drop": 0, "lost": 0}

    def stop() -> bool:
        if net.now - last["t"] >= interval_s:
            st = fwd.stats
            path = tx._paths.get(b)
            trace.append({"t": round(net.now, 6), "sent": st["sent"] - last["sent"],
                          "queue_drops": st["queue_drop"] - last["queue_drop"], "random_drops": st["lost"] - last["lost"],
                          "state": path.bbr.state if path else None,
                          "btlbw_gbps": round(path.bbr.btlbw * 8e-9, 4) if path else 0.0})
            last.update(t=net.now, sent=st["sent"], queue_drop=st["queue_drop"], lost=st["lost"])
        while (ev := tx.next_event()) is not None:
            done.append(ev)
        while rx.next_event() is not None:
            pass
        return bool(done)

    net.run(until=limit_s, stop=stop)
    if not done or getattr(done[0], "error", None) is not None:
        raise RuntimeError(f"the transfer did not complete within {limit_s} s of virtual time: "
                           f"{done[0].error if done else 'no event'}")
    rep = done[0].report
    if rep.delivered_fraction != 1.0 or not verify(buf):
        raise RuntimeError(f"the message did not arrive whole: delivered {rep.delivered_fraction}")
    packets = -(-size // seg)
    # every packet once, and each random loss again (in expectation), timed as the link times it: the payload and
    # each packet's headers (the last packet may be short)
    link_s = (size + packets * (HEADER_SIZE + IP_UDP_HEADER_BYTES)) / link_rate / (1 - loss)
    st = fwd.stats
    return dict(size_bytes=size, rate_bps=rate_bps, delay_s=delay_s, loss=loss, queue_bytes=queue, seed=seed,
                duration_s=round(rep.duration_s, 6), goodput_gbps=_sig(size * 8 / rep.duration_s / 1e9),
                ceiling_gbps=_sig(size * 8 / link_s / 1e9),
                packets_sent=rep.packets_sent, retransmitted=rep.retransmitted_packets,
                queue_drops=st["queue_drop"], random_drops=st["lost"],
                btlbw_gbps=round(rep.btlbw_bps * 8e-9, 4), trace=trace)


def _sig(x: float) -> float:
    """``x`` to 4 significant digits (a 1-byte message's Gbit/s is not 0.0)."""
    return float(f"{x:.4g}")


def main(argv=None) -> int:
    from ltp_tools.bench import parse_rate, parse_size, parse_time

    ap = argparse.ArgumentParser(prog="python -m ltp_tools.sim_transfer", description=__doc__.splitlines()[0])
    ap.add_argument("--size", type=parse_size, default=parse_size("200M"))
    ap.add_argument("--rate", type=parse_rate, default=parse_rate("1gbit"), help="wire rate, e.g. 1gbit")
    ap.add_argument("--delay", type=parse_time, default=0.0, help="one-way delay, e.g. 10ms")
    ap.add_argument("--loss", type=number(float, 0.0, 0.99, what="loss"), default=0.0)
    ap.add_argument("--queue", type=parse_size, default=None,
                    help="bottleneck queue bytes (default the lab's: 5 ms of --rate, at least 10 frames)")
    ap.add_argument("--interval", type=number(float, 1e-4, 10.0, what="trace interval"), default=0.02)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--trace", action="store_true", help="print the trace too (one line per interval)")
    a = ap.parse_args(argv)
    if a.rate is None:
        ap.error("--rate: the simulated link needs a rate (e.g. 1gbit)")
    res = run(size=a.size, rate_bps=a.rate, delay_s=a.delay, loss=a.loss, queue_bytes=a.queue,
              interval_s=a.interval, seed=a.seed)
    trace = res.pop("trace")
    if a.trace:
        for row in trace:
            print(json.dumps(row))
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
