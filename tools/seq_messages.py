"""Sequential messages on a rate-limited lab ring: per-message time against wire time.

Reproduces the ring all-reduce's transfer pattern without the parameter server:
``N`` lab hosts (namespaces, tbf on every host link) form a ring; in each step
every host sends one ``--size``-byte message to its right neighbour and
receives one from its left neighbour, and waits for both before the next step
(as the ring's reduce-scatter and all-gather steps do). Messages are
loss-tolerant (``--mode tolerant``), reliable (``--mode reliable``) or
alternate (``--mode ring``: the first ``N-1`` steps tolerant, the next ``N-1``
reliable, the ring's order).

Each host prints one JSON line per step (send and receive durations, regime,
delivered fraction, packets sent, retransmissions, the path's BBR state after
the step) and one summary line with the engine's drop and refusal counters.
The driver prints, per step, the slowest host's step time and its ratio to the
wire time ``size * 8 / rate``.

    python -m ltp_tools.seq_messages --hosts 3 --rate 100e6 --size 667000 --steps 10 --mode ring

Timing runs go under ``flock /tmp/ltp-timing.lock``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time

PORT = 9400
#: every host waits (at most this long) for the driver's go, sent once all have opened their endpoints
STARTUP_TIMEOUT_S = 60.0
#: one step's exchange may take at most this long before the run is declared failed
STEP_TIMEOUT_S = 30.0


def _overrides(pairs) -> dict:
    """``["ack_every=8", ...]`` -> Config keyword arguments (ints, floats or strings)."""
    out = {}
    for pair in pairs or ():
        key, _, val = pair.partition("=")
        for conv in (int, float):
            try:
                out[key] = conv(val)
                break
            except ValueError:
                continue
        else:
            out[key] = val
    return out


def _bbr_state(ep, peer) -> dict:
    path = ep.engine._paths.get(peer)
    if path is None:
        return {}
    b = path.bbr
    return dict(state=b.state, btlbw_mbit=round(b.btlbw * 8 / 1e6, 2),
                rtprop_ms=round((b.rtprop or 0.0) * 1e3, 3), pacing_mbit=round(b.pacing_rate * 8 / 1e6, 2),
                srtt_ms=round((path.srtt or 0.0) * 1e3, 3), filled_pipe=b.filled_pipe)


async def _host(args) -> int:
    import numpy as np

    from ltp import Config, open_endpoint

    n = len(args.addrs)
    me = args.index
    right = (args.addrs[(me + 1) % n], PORT)
    left = (args.addrs[(me - 1) % n], PORT)
    ep = await open_endpoint((args.addrs[me], PORT), config=Config(**_overrides(args.set)))
    data = np.full(args.size // 4, me + 1, np.float32)
    into = np.zeros(args.size // 4, np.float32)
    # start barrier: the driver says go once every host's endpoint is open (processes import at
    # different speeds; DATA to a port nobody listens on yet would fail the send with ICMP unreachable)
    print(json.dumps(dict(host=me, ready=True)), flush=True)
    line = await asyncio.wait_for(asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline),
                                  STARTUP_TIMEOUT_S)
    if line.strip() != "go":
        print(json.dumps(dict(host=me, error=f"driver did not say go: {line!r}")), flush=True)
        await ep.close()
        return 1
    ok = True
    for step in range(args.steps + 1):  # step 0: warm-up (its time is not counted)
        if args.mode == "ring":
            reliable = (step % (2 * (n - 1))) >= n - 1
        else:
            reliable = args.mode == "reliable"
        t0 = time.monotonic()
        rtask = asyncio.ensure_future(ep.recv(into, peer=left, tag=step, timeout=STEP_TIMEOUT_S))
        if args.recv_lag > 0:
            await asyncio.sleep(0)  # the receive is posted first; the send may be delayed
        try:
            sent = await ep.send(right, data, reliable=reliable, tag=step, timeout=STEP_TIMEOUT_S,
                                 critical=[(0, 64)] if not reliable else ())
            t_send = time.monotonic() - t0
            got = await rtask
        except Exception as exc:  # noqa: BLE001 - reported, the run fails
            print(json.dumps(dict(host=me, step=step, error=repr(exc))), flush=True)
            ok = False
            break
        t_step = time.monotonic() - t0
        print(json.dumps(dict(
            host=me, step=step, reliable=reliable, step_s=round(t_step, 4), send_s=round(t_send, 4),
            send_report_s=round(sent.duration_s, 4), close=sent.close_reason, pkts=sent.packets_sent,
            rexmit=sent.retransmitted_packets, lost=sent.lost_packets, recv_s=round(got.duration_s, 4),
            regime=got.regime, frac=round(got.delivered_fraction, 4), lt_s=got.lt_threshold_s,
            deadline_s=got.deadline_s, bbr=_bbr_state(ep, right))), flush=True)
        if args.gap > 0:
            await asyncio.sleep(args.gap)
    st = ep.stats
    print(json.dumps(dict(host=me, summary=True, dropped=st.dropped, refused=st.refused,
                          reregistrations=st.reregistrations, datagrams_out=st.datagrams_out,
                          io=dict(ep.io_stats) if isinstance(ep.io_stats, dict) else str(ep.io_stats))),
          flush=True)
    await asyncio.sleep(0.3)  # let STOPs/ACKs of the last step leave
    await ep.close()
    return 0 if ok else 1


def _ring_order(racks: list) -> list:
    """Host indices in ring order: round-robin over the racks, so every hop crosses racks where it can
    (the order ``ltp-lab schedules`` uses for the rank-order ring)."""
    starts = [sum(racks[:r]) for r in range(len(racks))]
    order = []
    for k in range(max(racks)):
        order += [starts[r] + k for r in range(len(racks)) if k < racks[r]]
    return order


def _flows_per_bottleneck(order: list, rack_of: list) -> int:
    """Most ring hops that share one directed rack uplink (1 in a single-rack lab)."""
    up: dict = {}
    n = len(order)
    for i, h in enumerate(order):
        dst = order[(i + 1) % n]
        if rack_of[h] != rack_of[dst]:
            up[(rack_of[h], "up")] = up.get((rack_of[h], "up"), 0) + 1
            up[(rack_of[dst], "down")] = up.get((rack_of[dst], "down"), 0) + 1
    return max(up.values(), default=1)


def _qdisc_drops(lab) -> dict:
    """Packets dropped by every tbf in the lab (switch ports and uplinks, host uplinks), by device."""
    out = {}
    for ns in [lab.switch_ns] + [h.netns for h in lab.hosts]:
        r = subprocess.run(["ip", "netns", "exec", ns, "tc", "-s", "qdisc", "show"], capture_output=True, text=True)
        dev = None
        for line in r.stdout.splitlines():
            f = line.split()
            if f[:2] == ["qdisc", "tbf"]:
                dev = f[4]
            elif dev and "(dropped" in f:
                n = int(f[f.index("(dropped") + 1].rstrip(","))
                if n:
                    out[f"{ns.rsplit('-', 1)[1]}:{dev}"] = n
                dev = None
    return out


def _drive(args) -> int:
    from ltp_tools.netlab import Lab

    racks = [int(x) for x in args.racks.split(",")] if args.racks else None
    lab_kw = dict(racks=racks) if racks else dict(n_hosts=args.hosts)
    with Lab(**lab_kw) as lab:
        if args.rate > 0:
            for h in lab.hosts:
                lab.impair(h, direction="both", rate_bps=args.rate, loss=args.loss)
            for r in range(len(racks or ())):
                lab.uplink(r, rate_bps=args.rate)
        elif args.loss > 0:
            for h in lab.hosts:
                lab.impair(h, direction="ingress", loss=args.loss)
        order = _ring_order(racks) if racks else list(range(len(lab.hosts)))
        share = _flows_per_bottleneck(order, [h.rack for h in lab.hosts])
        wire_s = args.size * 8 * share / args.rate if args.rate > 0 else 0.0
        args.hosts = len(lab.hosts)
        addrs = [lab.hosts[i].addr for i in order]
        procs = []
        for rank, i in enumerate(order):
            argv = [sys.executable, "-m", "ltp_tools.seq_messages", "--host", str(rank), "--addrs", ",".join(addrs),
                    "--size", str(args.size), "--steps", str(args.steps), "--mode", args.mode,
                    "--gap", str(args.gap)] + [a for kv in args.set or () for a in ("--set", kv)]
            procs.append(lab.popen(lab.hosts[i], argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True))
        for p in procs:  # every endpoint is open...
            first = p.stdout.readline()
            if not first.strip() or not json.loads(first).get("ready"):
                raise RuntimeError(f"a host process failed to start: {first!r}")
        for p in procs:  # ...so all may start
            p.stdin.write("go\n")
            p.stdin.flush()
        outs = [p.communicate(timeout=STEP_TIMEOUT_S * (args.steps + 2))[0] for p in procs]
        rcs = [p.returncode for p in procs]
        drops = _qdisc_drops(lab)
    rows: dict = {}
    for out in outs:
        for line in out.splitlines():
            r = json.loads(line)
            if args.verbose:
                print(line)
            if r.get("summary"):
                print(json.dumps(r))
            elif "step_s" in r:
                rows.setdefault(r["step"], []).append(r)
    steps = []
    for step in sorted(rows):
        if step == 0:
            continue  # warm-up
        rs = rows[step]
        worst = max(r["step_s"] for r in rs)
        steps.append(worst)
        print(f"step {step:2d} {'rel' if rs[0]['reliable'] else 'tol'}  slowest {worst * 1e3:7.1f} ms"
              + (f"  ({worst / wire_s:4.2f}x wire)" if wire_s else "")
              + "  send " + " ".join(f"{r['send_report_s'] * 1e3:6.1f}" for r in rs)
              + "  regimes " + ",".join(f"{r['regime']}:{r['frac']:.2f}" for r in rs)
              + "  rexmit " + ",".join(str(r["rexmit"]) for r in rs)
              + "  bbr " + ",".join(f"{r['bbr'].get('state', '?')}/{r['bbr'].get('btlbw_mbit', 0):.0f}"
                                    for r in rs))
    per_host: dict = {}
    for step, rs in rows.items():
        for r in rs:
            if step:
                per_host[r["host"]] = per_host.get(r["host"], 0.0) + r["step_s"]
    total = max(per_host.values(), default=0.0)
    if steps:
        med = statistics.median(steps)
        print(json.dumps(dict(size=args.size, rate=args.rate, hosts=args.hosts, racks=args.racks, mode=args.mode,
                              flows_per_bottleneck=share, wire_s=round(wire_s, 4),
                              median_step_s=round(med, 4), max_step_s=round(max(steps), 4),
                              median_over_wire=round(med / wire_s, 3) if wire_s else None,
                              total_s=round(total, 3), total_over_wire=round(total / (wire_s * len(steps)), 3)
                              if wire_s else None, rcs=rcs,
                              tbf_drops=drops)))
    if any(rcs) or len(steps) < args.steps:
        print(f"FAILED: host exit codes {rcs}, {len(steps)}/{args.steps} steps", file=sys.stderr)
        return 1
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hosts", type=int, default=3, help="ring size (lab hosts, one rack)")
    p.add_argument("--racks", default=None, help="two-tier lab, e.g. 3,3 (as ltp-lab schedules): hosts per rack, "
                   "uplinks at --rate, ring order alternating racks so every hop crosses an uplink")
    p.add_argument("--rate", type=float, default=100e6, help="tbf rate of every host link, bit/s (0 = unlimited)")
    p.add_argument("--loss", type=float, default=0.0, help="random loss on every host's downlink")
    p.add_argument("--size", type=int, default=667_000, help="message bytes (a multiple of 4)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--mode", choices=("tolerant", "reliable", "ring"), default="ring")
    p.add_argument("--gap", type=float, default=0.0, help="idle seconds between steps")
    p.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help="ltp.Config override for every host (repeatable), e.g. --set aggregation_cap_s=0.01")
    p.add_argument("--verbose", action="store_true", help="print every host's per-step JSON")
    p.add_argument("--host", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--addrs", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.size -= args.size % 4
    if args.host is not None:
        args.index = args.host
        args.addrs = args.addrs.split(",")
        args.recv_lag = 0
        return asyncio.run(_host(args))
    return _drive(args)


if __name__ == "__main__":
    sys.exit(main())
