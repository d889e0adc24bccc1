"""``ltp-lab fairness``: one LTP flow and one kernel-TCP flow sharing a bottleneck.

Theory of operation
    The paper's Fig. 15. Three lab hosts: h1 sends LTP, h2 sends TCP (``cubic``, ``bbr``,
    ``reno`` in turn), both to h0, whose downlink is the shared bottleneck (tbf, ``--rate``,
    default 500 Mbit/s, the lab's default queue of 5 ms at that rate; optional ``--loss``
    on h0's ingress). The LTP sender sends reliable ``--message``-byte messages back to back
    for ``--duration`` seconds (every byte delivered, as in a broadcast; the flow never goes
    idle, so this is a long-running flow as TCP's is); the TCP sender writes for
    ``--duration`` seconds into one connection with the chosen congestion control. Both are
    released at the same moment.

    Measurement is receiver-side and the same for both flows: an nft table in h0's
    namespace counts the bytes of IPv4 packets that reach h0's input hook from h1 and from
    h2 (after the tbf and after any loss, so it is what the receiver got, headers
    included); a sampler process in h0 reads the two counters every ``--interval``
    (100 ms). Throughput per interval = byte delta x 8 / time delta.

    Fairness is evaluated over the overlap window -- from ``--skip`` seconds after the
    release (start-up, default 1 s; 0.5 s with --quick) until the first flow stops -- as
    the two mean throughputs' LTP share ``x_ltp / (x_ltp + x_tcp)`` and Jain's index
    ``(x1 + x2)^2 / (2 (x1^2 + x2^2))`` (1 = equal shares, 0.5 = one flow has everything).
    The per-interval Jain indices' median is reported too (it also punishes oscillation).

    Files in ``--out``: ``results.json``, ``timeseries.csv`` (one row per cc x repeat x
    sample), ``summary.csv`` (one row per cc x repeat), ``throughput.png`` (both flows over
    time, one panel per TCP variant, Jain's index in the title).
"""
from __future__ import annotations

from ltp_tools.argtypes import number

import statistics
import subprocess
import sys
import time

from . import _common as C

NAME = "fairness"
CCS = ("cubic", "bbr", "reno")
LTP_PORT = 7447
TCP_PORT = 5302
TABLE = "ltpexp"
TS_COLUMNS = ["cc", "repeat", "t_s", "ltp_mbps", "tcp_mbps", "ltp_share", "in_window"]
SUMMARY_COLUMNS = ["cc", "repeat", "rate_bps", "loss", "window_s", "ltp_mbps", "tcp_mbps", "ltp_share", "jain",
                   "jain_per_interval_median", "utilisation", "ltp_messages", "ltp_retransmitted", "samples"]


def jain(xs) -> float:
    """Jain's fairness index of the throughputs ``xs`` (1/n .. 1); nan when all are zero."""
    xs = [float(x) for x in xs]
    sq = sum(x * x for x in xs)
    return (sum(xs) ** 2) / (len(xs) * sq) if sq > 0 else float("nan")


def run(*, ccs=CCS, rate_bps: float = 500e6, loss: float = 0.0, duration_s: float | None = None,
        message: int | None = None, interval_s: float = 0.1, skip_s: float | None = None,
        repeats: int | None = None, seed: int = 1, quick: bool = False, out: str | None = None,
        progress: bool = True, verbose: bool = True) -> dict:
    """Run LTP against each TCP variant in ``ccs`` and write the files; return the results dict.

    ``quick`` (CI): 2.5 s per pair, 5 MB LTP messages, 0.5 s skipped, 1 repeat.
    """
    from ltp_tools.netlab import Lab

    if not rate_bps or rate_bps <= 0:
        raise ValueError("fairness needs a finite bottleneck rate (e.g. rate_bps=500e6)")
    duration_s = duration_s or (2.5 if quick else 10.0)
    message = message or (5_000_000 if quick else 50_000_000)
    skip_s = (0.5 if quick else 1.0) if skip_s is None else skip_s
    repeats = repeats or 1
    if duration_s <= skip_s + 5 * interval_s:
        raise ValueError(f"duration_s ({duration_s}) must exceed skip_s ({skip_s}) by at least 5 intervals")
    C.require_lab()
    outdir = C.out_dir(NAME, out)
    params = dict(ccs=list(ccs), rate_bps=rate_bps, loss=loss, duration_s=duration_s, message=message,
                  interval_s=interval_s, skip_s=skip_s, repeats=repeats, seed=seed, quick=quick,
                  topology="h1 (LTP) and h2 (TCP) -> h0; bottleneck = tbf on h0's downlink")
    env = C.environment()
    series: list[dict] = []
    summary: list[dict] = []
    t0 = time.time()
    with Lab(n_hosts=3) as lab, C.progress(repeats * len(ccs), NAME, disable=not progress) as bar:
        h0, h1, h2 = lab.hosts
        lab.impair(h0, "ingress", loss=loss, rate_bps=rate_bps)
        for rep in range(repeats):
            for cc in ccs:
                bar.set_postfix_str(f"ltp vs {cc}")
                ts, s = _one_pair(lab, cc, duration_s, message, interval_s, skip_s, seed + rep)
                for r in ts:
                    r.update(cc=cc, repeat=rep)
                s.update(cc=cc, repeat=rep, rate_bps=rate_bps, loss=loss,
                         utilisation=round((s["ltp_mbps"] + s["tcp_mbps"]) * 1e6 / rate_bps, 4))
                series += ts
                summary.append(s)
                bar.update(1)
        backend, lab_prefix = lab.backend, lab.prefix
    res = dict(experiment=NAME, params=params, environment=env, backend=backend, lab_prefix=lab_prefix,
               wall_s=round(time.time() - t0, 1), timeseries=series, summary=summary, out=outdir)
    C.write_json(f"{outdir}/results.json", res)
    C.write_csv(f"{outdir}/timeseries.csv", TS_COLUMNS, series)
    C.write_csv(f"{outdir}/summary.csv", SUMMARY_COLUMNS, summary)
    _plot(series, summary, ccs, repeats, rate_bps, outdir)
    res["table"] = table(summary)
    if verbose:
        print(res["table"])
        print(f"files in {outdir}")
    return res


def _one_pair(lab, cc, duration_s, message, interval_s, skip_s, seed):
    h0, h1, h2 = lab.hosts
    script = (f"table inet {TABLE} {{\n  counter flow_ltp {{}}\n  counter flow_tcp {{}}\n"
              f"  chain input {{ type filter hook input priority 0; policy accept;\n"
              f'    ip saddr {h1.addr} counter name "flow_ltp"\n'
              f'    ip saddr {h2.addr} counter name "flow_tcp"\n  }}\n}}\n')
    lab.run(h0, ["nft", "delete", "table", "inet", TABLE], capture_output=True)  # from an earlier pair
    r = lab.run(h0, ["nft", "-f", "-"], input=script, capture_output=True, text=True)
    if r.returncode != 0:
        raise C.ExperimentError(f"cannot install the nft byte counters in {h0.netns}: {r.stderr.strip()}")
    py = sys.executable
    mod = ["-m", "ltp_tools.experiments._procs"]
    kw = dict(stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    timeout = duration_s * 4 + 60
    procs = []
    try:
        lr = lab.popen(h0, [py, *mod, "fair-ltp-recv", "--port", str(LTP_PORT), "--size", str(message),
                            "--timeout", str(timeout), "--seed", str(seed)], **kw)
        tr = lab.popen(h0, [py, *mod, "fair-tcp-recv", "--port", str(TCP_PORT)], **kw)
        procs += [lr, tr]
        C.wait_ready(lr, 60, "LTP receiver")
        C.wait_ready(tr, 60, "TCP receiver")
        ls = lab.popen(h1, [py, *mod, "fair-ltp-send", "--to", f"{h0.addr}:{LTP_PORT}", "--size", str(message),
                            "--duration", str(duration_s), "--timeout", str(timeout), "--seed", str(seed + 1)], **kw)
        tsd = lab.popen(h2, [py, *mod, "fair-tcp-send", "--to", f"{h0.addr}:{TCP_PORT}", "--cc", cc,
                             "--duration", str(duration_s)], **kw)
        smp = lab.popen(h0, [py, *mod, "sampler", "--table", TABLE, "--interval", str(interval_s),
                             "--duration", str(timeout)], **kw)
        procs += [ls, tsd, smp]
        C.wait_ready(ls, 60, "LTP sender")
        C.wait_ready(tsd, 60, f"TCP ({cc}) sender")
        C.wait_ready(smp, 60, "byte-counter sampler")
        time.sleep(2 * interval_s)  # a baseline sample before the release
        t_go = time.monotonic()
        for p in (ls, tsd):
            p.stdin.write("GO\n")
            p.stdin.flush()
        ltp_s = C.read_json_lines(ls, timeout, "LTP sender")[-1]
        tcp_s = C.read_json_lines(tsd, timeout, f"TCP ({cc}) sender")[-1]
        C.read_json_lines(lr, 30, "LTP receiver")
        C.read_json_lines(tr, 30, "TCP receiver")
        smp.stdin.write("\n")
        smp.stdin.flush()
        samples = C.read_json_lines(smp, 30, "byte-counter sampler")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=5)
    w0 = t_go + skip_s
    w1 = min(ltp_s["t_end"], tcp_s["t_end"])
    if w1 - w0 < 3 * interval_s:
        raise C.ExperimentError(f"overlap window of LTP and {cc} is only {w1 - w0:.2f} s: raise --duration")
    ts = []
    for a, b in zip(samples, samples[1:]):
        dt = b["t"] - a["t"]
        if dt <= 0:
            continue
        x_l = (b["bytes"]["flow_ltp"] - a["bytes"]["flow_ltp"]) * 8 / dt / 1e6
        x_t = (b["bytes"]["flow_tcp"] - a["bytes"]["flow_tcp"]) * 8 / dt / 1e6
        ts.append(dict(t_s=round(b["t"] - t_go, 3), ltp_mbps=round(x_l, 2), tcp_mbps=round(x_t, 2),
                       ltp_share=round(x_l / (x_l + x_t), 4) if x_l + x_t > 0 else None,
                       in_window=a["t"] >= w0 and b["t"] <= w1))
    win = [s for s in samples if w0 <= s["t"] <= w1]
    if len(win) < 2:
        raise C.ExperimentError(f"fewer than 2 counter samples inside the overlap window ({w1 - w0:.2f} s)")
    span = win[-1]["t"] - win[0]["t"]
    x_l = (win[-1]["bytes"]["flow_ltp"] - win[0]["bytes"]["flow_ltp"]) * 8 / span / 1e6
    x_t = (win[-1]["bytes"]["flow_tcp"] - win[0]["bytes"]["flow_tcp"]) * 8 / span / 1e6
    per = [jain([r["ltp_mbps"], r["tcp_mbps"]]) for r in ts if r["in_window"]]
    per = [j for j in per if j == j]
    summ = dict(window_s=round(span, 3), ltp_mbps=round(x_l, 2), tcp_mbps=round(x_t, 2),
                ltp_share=round(x_l / (x_l + x_t), 4) if x_l + x_t > 0 else None,
                jain=round(jain([x_l, x_t]), 4),
                jain_per_interval_median=round(statistics.median(per), 4) if per else None,
                ltp_messages=ltp_s["messages"], ltp_retransmitted=ltp_s["retransmitted"], samples=len(win))
    return ts, summ


def table(summary) -> str:
    """Summary table: one row per TCP variant x repeat."""
    cols = ["vs", "repeat", "LTP Mbit/s", "TCP Mbit/s", "LTP share", "Jain", "Jain/interval (median)",
            "utilisation", "window s"]
    rows = [[s["cc"], s["repeat"], s["ltp_mbps"], s["tcp_mbps"], s["ltp_share"], s["jain"],
             s["jain_per_interval_median"], s["utilisation"], s["window_s"]] for s in summary]
    return C.format_table(cols, rows)


def _plot(series, summary, ccs, repeats, rate_bps, outdir) -> None:
    plt = C.pyplot()
    fig, axes = plt.subplots(len(ccs), 1, figsize=(8, 2.6 * len(ccs)), squeeze=False, sharex=True)
    for ax, cc in zip(axes[:, 0], ccs):
        for rep in range(repeats):
            pts = [r for r in series if r["cc"] == cc and r["repeat"] == rep]
            t = [r["t_s"] for r in pts]
            kw = dict(alpha=1.0 if rep == 0 else 0.35, lw=1.2)
            ax.plot(t, [r["ltp_mbps"] for r in pts], color="C0", label="LTP" if rep == 0 else None, **kw)
            ax.plot(t, [r["tcp_mbps"] for r in pts], color="C1", label=f"TCP {cc}" if rep == 0 else None, **kw)
        ax.axhline(rate_bps / 1e6, color="grey", ls="--", lw=1, label="link rate")
        ax.axhline(rate_bps / 2e6, color="grey", ls=":", lw=1, label="fair share")
        js = [s["jain"] for s in summary if s["cc"] == cc]
        shares = [s["ltp_share"] for s in summary if s["cc"] == cc]
        ax.set_title(f"LTP vs {cc}: Jain {statistics.fmean(js):.3f}, LTP share {statistics.fmean(shares):.2f}",
                     fontsize=10)
        ax.set_ylabel("Mbit/s")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8, loc="upper right")
    axes[-1, 0].set_xlabel("time since release (s), 100 ms samples at the receiver")
    fig.tight_layout()
    fig.savefig(f"{outdir}/throughput.png", dpi=110)
    plt.close(fig)


# ----------------------------------------------------------------------------- CLI
def register(subparsers) -> None:
    """Add ``ltp-lab fairness``."""
    from ltp_tools.bench import parse_rate, parse_size

    p = subparsers.add_parser(NAME, help="one LTP flow vs one TCP flow on a shared link (paper Fig. 15)",
                              description=__doc__.split("\n\n")[0])
    p.add_argument("--ccs", default=",".join(CCS), help="TCP variants, in turn (comma list of cubic,bbr,reno)")
    p.add_argument("--rate", type=parse_rate, default=500e6, help="bottleneck rate (default 500mbit)")
    p.add_argument("--loss", type=float, default=0.0, help="random drop probability at the receiver (default 0)")
    p.add_argument("--duration", type=number(float, 0.0, what="seconds each pair runs", open_lo=True), default=None, help="seconds each pair runs (default 10; --quick 2.5)")
    p.add_argument("--message", type=parse_size, default=None,
                   help="LTP reliable message size, sent back to back (default 50M; --quick 5M)")
    p.add_argument("--interval", type=number(float, 0.0, what="the sampling interval", open_lo=True), default=0.1, help="sampling interval, s (default 0.1)")
    p.add_argument("--skip", type=float, default=None, help="start-up seconds left out of the fairness figures")
    C.add_common_args(p)
    p.set_defaults(func=_cli)


def _cli(args) -> int:
    run(ccs=C.parse_list(args.ccs, str), rate_bps=args.rate, loss=args.loss, duration_s=args.duration,
        message=args.message, interval_s=args.interval, skip_s=args.skip, repeats=args.repeats, seed=args.seed,
        quick=args.quick, out=args.out, progress=not args.no_progress)
    return 0
