"""``ltp-bench``: one bulk transfer over an emulated link, LTP or kernel TCP, as one JSON line.

Theory of operation
    As root (and where namespaces work) the benchmark builds a two-host
    :class:`~ltp_tools.netlab.Lab` — sender ``h0``, receiver ``h1``, joined
    through the lab's switch — and impairs the receiver's side: ``--loss``
    (random drop of data-sized packets at the receiver's ingress, the lab's
    default rule, so small ACKs survive; ``--loss-both`` also drops in the
    reverse direction and all sizes), ``--rate`` (tbf on the receiver's
    downlink), ``--delay`` (one-way, on the receiver's ingress; ``--jitter``
    adds a uniform ± that reorders packets). Offloads are
    off on the lab's veths, so GSO batches are segmented before the loss point
    and the loss rate holds per wire packet (the lab's ``oversize`` counter
    checks it; it is reported). ``--gro`` turns receive GRO on at the hosts'
    interfaces, as a real NIC's driver does (the loss point moves to the
    switch, before the downlink's rate limit; see :mod:`ltp_tools.netlab.lab`);
    ``receive_gro`` in the result says which path was measured. Without root
    it falls back to loopback (where GRO is on) and refuses impairments.

    Sender and receiver run as two processes (one core each on a 2-core box).
    The two LTP endpoints are connected to each other (``open_endpoint(peer=...)``,
    the sender bound to ``port + 1``), as kernel TCP's sockets are, so the kernel
    demultiplexes their datagrams early; ``--unconnected`` measures endpoints open
    to any peer, as a parameter server's is (``connected`` in the result).
    For LTP the receiver posts one receive into a preallocated buffer; the
    sender's clock runs from ``send()`` until the flow ends (all acknowledged,
    or the receiver's STOP); ``--warmup N`` first sends N messages on the same
    path, as a training job does, so Early Close has measured the link (a cold
    one-shot loss-tolerant transfer is judged by the paper's initial LT formula,
    which assumes the sender is already at full rate). For TCP the lab's ``tcpbench`` is used: the
    client's clock stops when the server has read every byte. Both transports
    move the test message of :mod:`ltp_tools.payload` between message-sized
    buffers, filled and faulted in before the clock and checked after it
    (``verified``); ``--tcp-buffer chunk`` gives the older, cache-hot TCP baseline. ``--mode
    reliable`` (default) delivers every byte so goodput compares honestly with
    TCP; ``--mode tolerant`` reports its delivered fraction beside goodput.
    Goodput counts delivered payload bytes only. The LTP receiver keeps
    answering for ``RECEIVER_LINGER_S`` after its receive before it closes, so
    a sender whose final ACKs were lost is not told the port is gone.

    Where resends came from, for LTP: ``lost_packets`` (the sender's loss
    verdicts), ``spurious_losses`` (those its ACKs later proved wrong;
    ``spurious_timeouts`` of them the tail-loss timer's, the rest the
    reordering rules', :mod:`ltp.reordering`),
    ``receiver_duplicates`` (copies that arrived twice: resends the
    path did not need), ``measured_loss`` and ``reverse_measured_loss`` (the
    lab's drops on the data and on the ACK direction), ``kernel_drops`` (the
    receiving socket's full-buffer drops and every CPU's input-backlog drops
    during the transfer, :mod:`ltp_tools.kernel_drops`), and ``sender_pauses``
    / ``receiver_pauses`` (each end's own stalls and pauses, :mod:`ltp.liveness`).

    ltp-bench --transport ltp --size 1G --loss 0.01 --rate 1gbit --delay 10ms
"""

from __future__ import annotations

import argparse
import json
import math
import re
import resource
import subprocess
import sys
import time

import ltp
from ltp_ext.constants import SEND_THREADS_MAX
from ltp_tools.argtypes import number
from ltp_tools import kernel_drops
from ltp_tools.machine_cpu import cpu_s_per_gb, machine_cpu_s
from ltp_tools.payload import pattern, verify

__all__ = ["main", "parse_size", "parse_rate", "parse_time", "run_bench"]

_UNITS = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12, "ki": 1024, "mi": 1024 ** 2, "gi": 1024 ** 3}


def parse_size(text: str) -> int:
    """'100M' -> 100_000_000 bytes; 'Mi'/'Gi' suffixes are binary."""
    m = re.fullmatch(r"\s*([0-9.]+)\s*([kmgt]i?)?b?\s*", str(text).lower())
    if not m:
        raise argparse.ArgumentTypeError(f"bad size {text!r}; use e.g. 98M, 1G, 512Mi")
    try:
        exact = float(m.group(1)) * _UNITS[m.group(2) or ""]
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad size {text!r}; use e.g. 98M, 1G, 512Mi") from None
    n = round(exact)
    if abs(exact - n) > 1e-6 * max(1.0, exact):
        raise argparse.ArgumentTypeError(f"size {text!r} is {exact:g} bytes, not a whole number; "
                                         f"give whole bytes (e.g. {math.floor(exact)} or {math.ceil(exact)})")
    if n < 1:
        raise argparse.ArgumentTypeError(f"size {text!r} is empty; a transfer needs at least 1 byte (e.g. 200M)")
    return n


def parse_rate(text: str | None) -> float | None:
    """'1gbit' / '1g' / '500mbit' -> bits/s; 'none' -> None."""
    if text is None or str(text).lower() in ("none", "0", "unlimited"):
        return None
    m = re.fullmatch(r"\s*([0-9.]+)\s*([kmgt]?)(bit|bps|b)?(/s)?\s*", str(text).lower())
    if not m:
        raise argparse.ArgumentTypeError(f"bad rate {text!r}; use e.g. 1gbit, 500mbit, none")
    return float(m.group(1)) * _UNITS[m.group(2)]


def parse_time(text: str) -> float:
    """'10ms' / '0.01s' / '10' (ms) -> seconds."""
    m = re.fullmatch(r"\s*([0-9.]+)\s*(ms|s|us)?\s*", str(text).lower())
    if not m:
        raise argparse.ArgumentTypeError(f"bad time {text!r}; use e.g. 10ms")
    v = float(m.group(1))
    return {"s": v, "ms": v / 1e3, "us": v / 1e6, None: v / 1e3}[m.group(2)]


def _cpu() -> tuple[float, float]:
    """This process's CPU seconds so far: ``(user + system, user)`` (user: the interpreter and compiled modules)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime, r.ru_utime


def _machine_delta(m0: float | None) -> float | None:
    m1 = machine_cpu_s()
    return None if m0 is None or m1 is None else round(m1 - m0, 3)


#: seconds the LTP receiver allows the sender's process to start, on top of --timeout
SENDER_STARTUP_S = 30.0
#: bytes per second the sender fills its message at before sending (the receiver's wait scales with --size)
PATTERN_FILL_BPS = 100e6
#: the receiver closes with ``Endpoint.close(linger=...)`` of this long, answering the sender: when the final
#: ACKs are lost (loss on ACKs), the sender's probes must reach a socket that still answers, not one whose close
#: turns them into ICMP port unreachable (found by CI: a 20 MB transfer through 1 % loss both ways, complete and
#: verified at the receiver, failed at the sender with PeerUnreachable 0.6 s in)
RECEIVER_LINGER_S = 0.5

# ---------------------------------------------------------------------------- LTP roles
def _threads(args) -> dict:
    """``Config`` keywords for ``--send-threads``, ``--thread-pacing`` and ``--spread`` (absent: the Config
    defaults)."""
    kw = {} if args.send_threads is None else {"send_threads": args.send_threads}
    if args.thread_pacing is not None:
        kw["thread_pacing_s"] = args.thread_pacing
    if args.spread is not None:
        kw["spread_sends"] = args.spread == "on"
    return kw


def _ltp_receiver(args) -> int:
    import numpy as np

    import ltp

    async def main():
        cfg = ltp.Config(mtu=args.mtu, deadline_slack_s=0.1 if args.delay_s else 0.03, **_threads(args))
        peer = None if args.peer is None else (args.peer, args.peer_port)
        ep = await ltp.open_endpoint((args.bind, args.port), config=cfg, peer=peer)
        ep.bulk_drain = not args.no_bulk_drain
        buf = np.empty(args.size, np.uint8)
        buf.fill(0)  # fault the pages in before the clock starts
        base_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        print("READY", flush=True)
        # the sender's --timeout counts from its send(); the receiver also waits out the sender's start-up
        # (a process, and a message of --size to fill) before the first registration arrives
        wait = args.timeout + SENDER_STARTUP_S + args.size / PATTERN_FILL_BPS
        for w in range(args.warmup):  # same path, earlier messages: the link is measured
            await ep.recv(buf, tag=w, timeout=wait)
        cpu0, user0 = _cpu()
        udp0 = kernel_drops.udp_drops()
        rep = await ep.recv(buf, tag=args.warmup, timeout=wait)
        cpu1, user1 = _cpu()
        udp = kernel_drops.delta(udp0, kernel_drops.udp_drops())
        cpu, user = cpu1 - cpu0, user1 - user0
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        ok = None
        if rep.total_bytes == args.size:  # every byte is checked: the pattern where it arrived, zeros in bubbles
            ok = verify(buf, rep.bubbles)
        out = dict(regime=rep.regime, received_bytes=rep.received_bytes, delivered_fraction=rep.delivered_fraction,
                   receiver_cpu_s=round(cpu, 3), receiver_user_s=round(user, 3), verified=ok, receiver_peak_rss=peak,
                   receiver_rss_before_transfer=base_rss, dropped=dict(ep.stats.dropped),
                   duplicates=rep.duplicates, udp_drops=udp, receiver_pauses=ep.stats.own_pauses + ep.stats.own_stalls,
                   extensions=ltp.using_extensions(), receiver_wakeups=dict(ep.loop_stats),
                   receiver_io={k: ep.io_stats[k] for k in ("syscalls", "datagrams_in", "slots_in")})
        await ep.close(linger=RECEIVER_LINGER_S)
        print(json.dumps(out), flush=True)

    ltp.run(main())
    return 0


def _ltp_sender(args) -> int:
    import ltp

    async def main():
        peer = (args.host, args.port) if args.connected else None
        ltp.Endpoint.stage_sends = not args.no_stage  # read when the endpoint opens
        ep = await ltp.open_endpoint(("0.0.0.0", args.bind_port), config=ltp.Config(mtu=args.mtu, **_threads(args)),
                                     peer=peer)
        data = pattern(args.size)
        reliable = args.mode == "reliable"
        for w in range(args.warmup):
            await ep.send((args.host, args.port), data, reliable=reliable, tag=w, timeout=args.timeout)
        cpu0, user0 = _cpu()
        m0 = machine_cpu_s()
        t0 = time.perf_counter()
        rep = await ep.send((args.host, args.port), data, reliable=reliable, tag=args.warmup, timeout=args.timeout)
        dt = time.perf_counter() - t0
        cpu1, user1 = _cpu()
        cpu, user = cpu1 - cpu0, user1 - user0
        machine = _machine_delta(m0)
        out = dict(duration_s=round(dt, 4), delivered_bytes=rep.delivered_bytes,
                   delivered_fraction=rep.delivered_fraction, retransmitted_packets=rep.retransmitted_packets,
                   packets_sent=rep.packets_sent, lost_packets=rep.lost_packets, spurious_losses=rep.spurious_losses,
                   spurious_timeouts=rep.spurious_timeouts, close_reason=rep.close_reason,
                   sender_cpu_s=round(cpu, 3), sender_pauses=ep.stats.own_pauses + ep.stats.own_stalls,
                   sender_user_s=round(user, 3), machine_cpu_s=machine,
                   rtprop_ms=round(rep.rtprop_s * 1e3, 3), btlbw_gbps=round(rep.btlbw_bps * 8 / 1e9, 3),
                   sender_wakeups=dict(ep.loop_stats), send_threads=ep.config.send_threads,
                   thread_pacing_s=ep.config.thread_pacing_s, spread_sends=ep.config.spread_sends,
                   connected=ep.peer is not None)
        await ep.close()
        print(json.dumps(out), flush=True)

    ltp.run(main())
    return 0


# ---------------------------------------------------------------------------- orchestration
def _read_json(p: subprocess.Popen, timeout: float) -> dict:
    out, err = p.communicate(timeout=timeout)
    for line in reversed(out.splitlines()):
        line = line.strip()
        if line.startswith("{"):
            return json.loads(line)
    raise RuntimeError(f"exit {p.returncode}: {last_line(err) or '(nothing on stderr)'}")


def last_line(text: str | None) -> str:
    """The last non-empty line of a process's output (a traceback's exception line: the error it printed), or ''."""
    lines = [x.strip() for x in (text or "").splitlines() if x.strip()]
    return lines[-1] if lines else ""


def _outcome(p: subprocess.Popen, timeout: float) -> str:
    """What became of a helper process: its result line or its last stderr line."""
    try:
        return json.dumps(_read_json(p, timeout))
    except subprocess.TimeoutExpired:
        p.kill()
        return f"still running after {timeout:g} s (killed)"
    except RuntimeError as exc:
        return str(exc)


def _wait_ready(p: subprocess.Popen, timeout: float) -> None:
    from ltp_tools.ready import wait_ready

    wait_ready(p, timeout, "the LTP receiver")


def run_bench(*, transport: str = "ltp", size: int = 100_000_000, loss: float = 0.0, rate_bps: float | None = None,
              delay_s: float = 0.0, mtu: int = 1500, mode: str = "reliable", loss_both: bool = False,
              timeout: float = 300.0, lab=None, port: int = 7447, warmup: int = 0, gro: bool = False,
              tcp_buffer: str = "message", send_threads: int | None = None, bulk_drain: bool = True,
              stage_sends: bool = True,
              connected: bool = True, thread_pacing_s: float | None = None, spread: bool | None = None,
              jitter_s: float = 0.0) -> dict:
    """Run one transfer and return the result dict (see module docstring).

    ``tcp_buffer`` says where a TCP transfer's bytes live (:data:`ltp_tools.tcpbench.BUFFERS`): ``"message"``
    moves them between message-sized buffers as LTP does (the default, and the only like-for-like
    comparison of CPU per byte); ``"chunk"`` is the cache-hot block the TCP baseline used before 2026-11-29.

    ``gro=True`` builds the lab with receive GRO on the hosts' interfaces (:class:`~ltp_tools.netlab.Lab`);
    it needs the lab (loopback always has GRO) and is ignored when ``lab`` is given (that lab's setting holds).
    ``send_threads`` sets both LTP endpoints' ``Config.send_threads`` (None: its default), ``thread_pacing_s``
    their ``Config.thread_pacing_s`` (None: its default), ``spread`` their ``Config.spread_sends`` (None: its
    default).
    ``bulk_drain=False`` makes the LTP receiver hand every batch to the engine (``Endpoint.bulk_drain``), for
    comparison with the default compiled drain.
    ``stage_sends=False`` makes the LTP sender hand the kernel two buffers per DATA packet
    (``Endpoint.stage_sends``), for comparison with the default staged send.
    ``connected`` (default) opens both LTP endpoints connected to each other (``open_endpoint(peer=...)``), as a
    point-to-point transfer between two hosts would be and as kernel TCP's sockets are; the sender then binds
    ``port + 1``. ``connected=False`` leaves them open to any peer, as a parameter server's endpoint is.
    """
    from ltp_tools.netlab import Lab, check_support

    if not 0.0 <= jitter_s <= delay_s:
        raise ValueError(f"jitter must be in 0..delay (the delay is {delay_s * 1e3:g} ms ± jitter), "
                         f"got {jitter_s * 1e3:g} ms")
    own_lab = None
    problem = check_support() if lab is None else None
    if lab is None and problem is None:
        own_lab = lab = Lab(n_hosts=2, mtu=mtu, gro=gro).start()
    elif lab is None and (loss or rate_bps or delay_s or gro):
        raise SystemExit(f"impairments and --gro need the network lab, which is unavailable here: {problem}")
    try:
        if lab is not None:
            snd, rcv = lab.hosts[0], lab.hosts[1]
            lab.impair(rcv, "ingress", loss=loss, rate_bps=rate_bps, delay_s=delay_s, jitter_s=jitter_s,
                       queue_bytes=None if rate_bps is None else max(256_000, int(rate_bps / 8 * 0.005)))
            # the reverse direction too, every time: a lab shared by runs kept an earlier run's loss on the ACKs
            lab.impair(snd, "ingress", loss=loss if loss_both else 0.0, all_sizes=loss_both)
            host = rcv.addr
            popen = lab.popen
        else:
            snd = rcv = None
            host = "127.0.0.1"

            def popen(_h, argv, **kw):
                return subprocess.Popen(argv, **kw)
        py = sys.executable
        kw = dict(stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        common = ["--size", str(size), "--mtu", str(mtu), "--timeout", str(timeout), "--mode", mode,
                  "--delay", f"{delay_s * 1e3}ms", "--warmup", str(warmup)]
        if send_threads is not None:
            common += ["--send-threads", str(send_threads)]
        if thread_pacing_s is not None:
            common += ["--thread-pacing", repr(float(thread_pacing_s))]
        if spread is not None:
            common += ["--spread", "on" if spread else "off"]
        if not bulk_drain:
            common += ["--no-bulk-drain"]
        if not stage_sends:
            common += ["--no-stage"]
        snd_host = snd.addr if snd is not None else host  # loopback: both ends on the same address
        rcv_conn = ["--peer", snd_host, "--peer-port", str(port + 1)] if connected else []
        snd_conn = ["--connected", "--bind-port", str(port + 1)] if connected else []
        t_wall = time.time()
        backlog0 = kernel_drops.backlog_drops()
        if transport == "ltp":
            rp = popen(rcv, [py, "-m", "ltp_tools.bench", "_ltp_recv", "--port", str(port), *rcv_conn, *common],
                       **kw)
            _wait_ready(rp, 60)
            sp = popen(snd, [py, "-m", "ltp_tools.bench", "_ltp_send", "--host", host, "--port", str(port), *snd_conn,
                             *common], **kw)
            try:
                s = _read_json(sp, timeout + 30)
            except RuntimeError as exc:  # name both ends' own last words, not a wall of traceback
                raise RuntimeError(f"the LTP sender failed ({exc}); the receiver: {_outcome(rp, 10)}") from None
            try:
                r = _read_json(rp, 60)
            except RuntimeError as exc:
                raise RuntimeError(f"the LTP receiver failed ({exc}); the sender reported {json.dumps(s)}") from None
            delivered = s["delivered_bytes"]
            result = dict(transport="ltp", mode=mode, **{k: s[k] for k in (
                "duration_s", "retransmitted_packets", "packets_sent", "sender_cpu_s", "close_reason",
                "rtprop_ms", "btlbw_gbps", "machine_cpu_s", "sender_wakeups", "sender_user_s", "lost_packets",
                "spurious_losses", "spurious_timeouts",
                "sender_pauses")},
                delivered_fraction=r["delivered_fraction"], receiver_cpu_s=r["receiver_cpu_s"],
                receiver_user_s=r["receiver_user_s"],
                verified=r["verified"], receiver_peak_rss=r["receiver_peak_rss"],
                receiver_overhead_bytes=r["receiver_peak_rss"] - size, dropped_by_receiver=r["dropped"],
                extensions=r["extensions"], receiver_wakeups=r["receiver_wakeups"], receiver_io=r["receiver_io"],
                receiver_duplicates=r["duplicates"], receiver_pauses=r["receiver_pauses"])
            backlog1 = kernel_drops.backlog_drops()
            udp = r["udp_drops"] or {}
            result["kernel_drops"] = dict(
                receiver_socket=udp.get("udp_rcvbuf_errors"),
                input_backlog=None if backlog0 is None or backlog1 is None else backlog1 - backlog0)
            io = r["receiver_io"]  # > 1 only where the receiving interface coalesced (GRO)
            result["receiver_datagrams_per_slot"] = round(io["datagrams_in"] / io["slots_in"], 2) if io["slots_in"] else None
            result["goodput_gbps"] = round(min(delivered, r["received_bytes"]) * 8 / s["duration_s"] / 1e9, 4)
        else:
            from ltp_tools import tcpbench

            if lab is not None:
                res = tcpbench.run_tcp_transfer(lab, snd, rcv, size, cc=transport, timeout_s=timeout,
                                                buffer=tcp_buffer)
            else:
                res = _tcp_loopback(size, transport, timeout, tcp_buffer)
            rx = res.get("receiver", {})
            result = dict(transport=transport, mode="reliable", duration_s=res["duration_s"],
                          retransmitted_packets=res.get("total_retrans"), sender_cpu_s=res.get("sender_cpu_s"),
                          receiver_cpu_s=rx.get("receiver_cpu_s", rx.get("cpu_s")), delivered_fraction=1.0,
                          machine_cpu_s=res.get("machine_cpu_s"), verified=rx.get("verified"),
                          tcp_buffer=res.get("buffer", tcp_buffer),
                          goodput_gbps=round(size * 8 / res["duration_s"] / 1e9, 4))
        delivered_bytes = int(result["goodput_gbps"] * 1e9 / 8 * result["duration_s"])
        per_gb = cpu_s_per_gb(result.get("machine_cpu_s"), delivered_bytes)
        result["machine_cpu_s_per_gb"] = None if per_gb is None else round(per_gb, 3)
        stats = lab.loss_stats(rcv) if lab is not None else {}
        reverse = lab.loss_stats(snd, "ingress") if lab is not None else {}
        if transport == "ltp":
            result["send_threads"] = s.get("send_threads")
            result["thread_pacing_s"] = s.get("thread_pacing_s")
            result["spread_sends"] = s.get("spread_sends")
            result["bulk_drain"] = bulk_drain
            result["stage_sends"] = stage_sends
            result["connected"] = s.get("connected")
        result.update(warmup=warmup if transport == "ltp" else 0, size_bytes=size, loss=loss, rate=rate_bps, delay_s=delay_s,
                      jitter_s=jitter_s, mtu=mtu, loss_both=loss_both,
                      measured_loss=stats.get("measured_loss"), oversize_packets=stats.get("oversize"),
                      reverse_measured_loss=reverse.get("measured_loss"),
                      backend=lab.backend if lab is not None else "loopback",
                      receive_gro=lab.gro if lab is not None else True, wall_s=round(time.time() - t_wall, 2))
        if result.get("mode") == "reliable" and (result.get("delivered_fraction", 1.0) < 1.0
                                                 or result.get("verified") is False):
            result["error"] = (f"the reliable transfer did not complete: delivered {result['delivered_fraction']:.4f} "
                               f"(close reason {result.get('close_reason')}, verified {result.get('verified')})")
        elif result.get("verified") is False:
            result["error"] = ("the received bytes differ from the message outside the reported bubbles, or the "
                               "bubbles are not zero-filled: the transfer corrupted data")
        order = ["transport", "size_bytes", "loss", "rate", "goodput_gbps", "duration_s", "delivered_fraction",
                 "retransmitted_packets", "sender_cpu_s", "receiver_cpu_s", "machine_cpu_s", "machine_cpu_s_per_gb"]
        return {k: result[k] for k in order} | {k: v for k, v in result.items() if k not in order}
    finally:
        if own_lab is not None:
            own_lab.close()


def _tcp_loopback(size: int, cc: str, timeout: float, buffer: str = "message") -> dict:
    from ltp_tools.ready import wait_ready
    from ltp_tools.tcpbench import READY_BASE_S, READY_PER_BYTE_S

    py = sys.executable
    kw = dict(stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    sized = ["--size", str(size)] if buffer == "message" else []
    srv = subprocess.Popen([py, "-m", "ltp_tools.tcpbench", "server", "--port", "5299", "--once", "--bind",
                            "127.0.0.1", *sized], **kw)
    try:
        wait_ready(srv, READY_BASE_S + size * READY_PER_BYTE_S, "tcpbench server")
        cli = subprocess.run([py, "-m", "ltp_tools.tcpbench", "client", "--host", "127.0.0.1", "--port", "5299",
                              "--size", str(size), "--cc", cc, "--buffer", buffer], timeout=timeout, **kw)
        res = json.loads(cli.stdout.strip().splitlines()[-1])
        res["receiver"] = _read_json(srv, 30 + size * READY_PER_BYTE_S)
        return res
    finally:
        if srv.poll() is None:
            srv.kill()


def main(argv=None) -> int:
    """Entry point of ``ltp-bench``."""
    ap = argparse.ArgumentParser(prog="ltp-bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--transport", default="ltp", choices=["ltp", "cubic", "bbr", "reno"])
    ap.add_argument("--size", type=parse_size, default=parse_size("200M"))
    ap.add_argument("--loss", type=number(float, 0.0, 1.0, what="the drop probability", open_hi=True), default=0.0,
                    help="random drop probability of data packets (0.01 = 1%%)")
    ap.add_argument("--loss-both", action="store_true", help="drop in both directions and all sizes")
    ap.add_argument("--rate", type=parse_rate, default=None, help="tbf rate, e.g. 1gbit (default: unlimited)")
    ap.add_argument("--delay", type=parse_time, default=0.0, help="one-way delay, e.g. 10ms")
    ap.add_argument("--jitter", type=parse_time, default=0.0,
                    help="each packet's delay is --delay plus or minus up to this much, uniformly, which reorders "
                         "them as netem's jitter does (at most --delay)")
    ap.add_argument("--mtu", type=number(int, 576, 65535, what="the link MTU"), default=1500)
    ap.add_argument("--mode", choices=["reliable", "tolerant"], default="reliable")
    ap.add_argument("--timeout", type=number(float, 0.0, what="seconds a transfer may take", open_lo=True),
                    default=300.0)
    ap.add_argument("--repeats", type=number(int, 1, what="the number of runs"), default=1)
    ap.add_argument("--warmup", type=number(int, 0, what="warm-up messages"), default=0,
                    help="LTP: messages sent on the same path before the measured one (Early Close learns the link)")
    ap.add_argument("--gro", action="store_true",
                    help="receive GRO on the lab hosts' interfaces, as a NIC driver does (default: off, every "
                         "packet reaches the receiver alone)")
    ap.add_argument("--tcp-buffer", choices=["message", "chunk"], default="message",
                    help="TCP: send from and receive into message-sized buffers, as LTP does (default), or "
                         "resend one cache-hot block and read into another (the baseline before 2026-11-29)")
    ap.add_argument("--send-threads", type=number(int, 0, SEND_THREADS_MAX, what="LTP sender threads"), default=None,
                    help="LTP: threads that make the DATA sends (Config.send_threads; 0: the event loop's thread; "
                         "default: the Config default)")
    ap.add_argument("--thread-pacing", type=number(float, 0.0, 0.001, what="seconds of thread pacing"),
                    default=None, metavar="SECONDS",
                    help="LTP: a sender thread paces one peer's DATA in sub-bursts of this much time at the path's "
                         "rate (Config.thread_pacing_s; 0: off, the default; e.g. 0.0002)")
    ap.add_argument("--spread", choices=["on", "off"], default=None,
                    help="LTP: cut one peer's large DATA batches across the sender threads, so that one flow's "
                         "kernel path runs on several cores (Config.spread_sends; default: the Config default)")
    ap.add_argument("--no-bulk-drain", action="store_true",
                    help="LTP: the receiver hands every batch to the engine in Python (Endpoint.bulk_drain off) "
                         "instead of draining a bulk receive into its window in compiled code")
    ap.add_argument("--no-stage", action="store_true",
                    help="LTP: hand the kernel two buffers per DATA packet (header, segment) instead of each message "
                         "as one buffer copied into a cache-sized stage (Endpoint.stage_sends off)")
    ap.add_argument("--unconnected", action="store_true",
                    help="LTP: both endpoints accept any peer, as a parameter server's does (default: each is "
                         "connected to the other, open_endpoint(peer=...), as kernel TCP's sockets are)")
    args = ap.parse_args(argv)
    if args.jitter > args.delay:
        ap.error(f"--jitter ({args.jitter * 1e3:g} ms) must not exceed --delay ({args.delay * 1e3:g} ms): each "
                 "packet's delay is --delay plus or minus up to --jitter")
    for _ in range(args.repeats):
        try:
            res = run_bench(transport=args.transport, size=args.size, loss=args.loss, rate_bps=args.rate,
                            delay_s=args.delay, mtu=args.mtu, mode=args.mode, loss_both=args.loss_both,
                            timeout=args.timeout, warmup=args.warmup, gro=args.gro, tcp_buffer=args.tcp_buffer,
                            send_threads=args.send_threads, bulk_drain=not args.no_bulk_drain,
                            stage_sends=not args.no_stage, connected=not args.unconnected,
                            thread_pacing_s=args.thread_pacing,
                            spread=None if args.spread is None else args.spread == "on", jitter_s=args.jitter)
        except (TimeoutError, subprocess.TimeoutExpired, ltp.LTPError, RuntimeError) as exc:
            # a transfer that did not finish is a result to report, not a crash
            print(f"ltp-bench: {args.transport} transfer of {args.size} B failed: {type(exc).__name__}: {exc}",
                  file=sys.stderr, flush=True)
            return 1
        print(json.dumps(res), flush=True)
        if "error" in res:  # printed (it is a measurement), and the exit code says the transfer failed
            print(f"ltp-bench: {res['error']}", file=sys.stderr, flush=True)
            return 1
    return 0


def _role_main(argv) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("role", choices=["_ltp_recv", "_ltp_send"])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--bind", default="0.0.0.0")
    ap.add_argument("--port", type=int, default=7447)
    ap.add_argument("--size", type=int, required=True)
    ap.add_argument("--mtu", type=int, default=1500)
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument("--mode", default="reliable")
    ap.add_argument("--delay", type=parse_time, default=0.0)
    ap.add_argument("--warmup", type=int, default=0)
    ap.add_argument("--send-threads", type=int, default=None)
    ap.add_argument("--thread-pacing", type=float, default=None)
    ap.add_argument("--spread", choices=["on", "off"], default=None)
    ap.add_argument("--no-bulk-drain", action="store_true")
    ap.add_argument("--no-stage", action="store_true")
    ap.add_argument("--peer", default=None, help="receiver: connect to this sender address")
    ap.add_argument("--peer-port", type=int, default=0)
    ap.add_argument("--connected", action="store_true", help="sender: connect to the receiver")
    ap.add_argument("--bind-port", type=int, default=0)
    args = ap.parse_args(argv)
    args.delay_s = args.delay
    return _ltp_receiver(args) if args.role == "_ltp_recv" else _ltp_sender(args)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1].startswith("_"):
        sys.exit(_role_main(sys.argv[1:]))
    sys.exit(main())
