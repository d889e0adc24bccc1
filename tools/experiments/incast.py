"""``ltp-lab incast``: batch synchronisation time (BST) of N workers and one parameter server.

Theory of operation
    The paper's Fig. 3/14. Lab hosts: h0 is the PS, h1..hN the workers, all on one switch.
    The bottleneck is the PS's link: h0's ingress gets ``--rate`` (tbf on its downlink, the
    incast direction) and ``--loss`` (random drop of data-sized packets); h0's egress gets
    the same rate and loss (tbf on its uplink; drop at the switch port), so the broadcast
    back also crosses a rate-limited, lossy link. Workers' own links are not impaired.

    One run = one transport at one loss rate: N+1 long-lived processes
    (:mod:`ltp_tools.experiments._procs`) do ``--iterations`` BSP iterations each. In
    iteration i every worker sends one ``--size``-byte float32 gradient to the PS; the PS
    gathers all N (LTP: ``Endpoint.gather`` with Early Close, loss-tolerant; TCP: one
    persistent connection per worker, all N messages read completely), then sends one
    ``--size``-byte message back to every worker (LTP: reliable ``broadcast``; TCP: the
    same bytes on each connection); a worker starts iteration i+1 as soon as it holds the
    broadcast. Iteration 0 starts when all workers are released at once (``GO``).

    Timing, from CLOCK_MONOTONIC in different processes (one clock per machine):

        start_i   = earliest worker send start of iteration i
        gather_i  = PS has all N messages (LTP: gather returned)      - start_i
        bcast_i   = last worker holds the broadcast                    - PS gather end
        BST_i     = gather_i + bcast_i

    Iteration 0 is the warm-up: for LTP it is the message that measures each link for
    Early Close (the LT threshold becomes the shortest complete delivery). It is reported
    (``warmup=true``) and left out of the summary and the box plots. The line-rate lower
    bound drawn in the plot is ``N x size x 8 / rate`` for the gather plus the same for
    the broadcast (payload only; tbf also charges headers, so the bound is a little low).

    For LTP each row also carries the gather's Early Close regimes (how many links ended
    ``complete`` / ``early`` / ``deadline`` / ``timeout``) and the mean and minimum
    delivered fraction over the N links, and the senders' own path model at the end of
    their flows (median BtlBw and RTprop over the workers; total retransmitted packets),
    and the PS's broadcast: packets sent to all workers and how many were resends.

    Files in ``--out``: ``results.json``, ``iterations.csv`` (one row per transport x loss
    x repeat x iteration), ``summary.csv`` (one row per transport x loss), ``bst.png``
    (box plots of BST per transport, one panel per loss rate, lower bound dashed) and
    ``gather_fct.png`` (per-worker gather completion times: the long tail of Fig. 3).
"""
from __future__ import annotations

from ltp_tools.argtypes import number

import statistics
import subprocess
import sys
import time
from collections import Counter

from ltp.regimes import Regime

from . import _common as C

NAME = "incast"
TRANSPORTS = ("ltp", "cubic", "bbr", "reno")
#: LTP with the PS not told its link rate (no rate grants, ltp/link_share.py): the behaviour before grants,
#: for side-by-side runs (``--transports ltp,ltp-nogrant``)
LTP_NO_GRANT = "ltp-nogrant"
KNOWN_TRANSPORTS = TRANSPORTS + (LTP_NO_GRANT,)
LOSSES = (0.0, 0.0001, 0.001, 0.005, 0.01)
LTP_PORT = 7447
TCP_PORT = 5301
ITER_COLUMNS = ["transport", "loss", "repeat", "iteration", "warmup", "bst_s", "gather_s", "bcast_s",
                "lower_bound_s", "bst_over_bound", "delivered_mean", "delivered_min", "regimes", "worker_fct_max_s",
                "worker_fct_median_s", "ltp_btlbw_mbps_median", "ltp_rtprop_ms_median", "ltp_retransmitted",
                "ltp_bcast_packets", "ltp_bcast_retransmitted"]
SUMMARY_COLUMNS = ["transport", "loss", "loss_pct", "workers", "size_bytes", "n_iterations", "bst_median_s",
                   "bst_mean_s", "bst_p95_s", "bst_max_s", "gather_median_s", "bcast_median_s", "lower_bound_s",
                   "bst_median_over_bound", "delivered_mean", "delivered_min", "regimes", "failures"]


def run(*, workers: int | None = None, size: int | None = None, iterations: int | None = None,
        transports=TRANSPORTS, losses=LOSSES, rate_bps: float = 1e9, slack_s: float = 0.03,
        queue_bytes: int | None = None, repeats: int | None = None, seed: int = 1, quick: bool = False, out: str | None = None,
        timeout_s: float | None = None, progress: bool = True, verbose: bool = True) -> dict:
    """Run the incast experiment and write its files; return the results dict.

    ``iterations`` counts the measured iterations; one warm-up iteration is added in front.
    ``quick`` (CI): 4 workers x 2 MB x 3 iterations, losses 0 and 1 %, unless given explicitly.
    ``queue_bytes``: the PS link's tbf queue (None: the lab's default, 5 ms at the rate).
    """
    from ltp_tools.netlab import Lab

    for t in transports:
        if t not in KNOWN_TRANSPORTS:
            raise ValueError(f"unknown transport {t!r}; choose from {', '.join(KNOWN_TRANSPORTS)}")
    workers = workers or (4 if quick else 8)
    size = size or (2_000_000 if quick else 98_000_000)
    size -= size % 4  # float32 elements
    iterations = iterations or (3 if quick else 5)
    if quick and tuple(losses) == LOSSES:
        losses = (0.0, 0.01)
    losses = [float(x) for x in losses]
    repeats = repeats or 1
    if workers < 1 or workers > 60:
        raise ValueError(f"workers must be in 1..60 (one lab host each), got {workers}")
    if size < 4096:
        raise ValueError(f"size must be at least 4096 bytes, got {size}")
    if not rate_bps or rate_bps <= 0:
        raise ValueError("incast needs a finite PS link rate (e.g. rate_bps=1e9): the bound and the "
                         "bottleneck are defined by it")
    bound_s = 2 * workers * size * 8 / rate_bps
    if timeout_s is None:
        timeout_s = max(60.0, 20 * bound_s)
    C.require_lab()
    outdir = C.out_dir(NAME, out)
    params = dict(workers=workers, size=size, iterations=iterations, warmup_iterations=1,
                  transports=list(transports), losses=losses, rate_bps=rate_bps, slack_s=slack_s,
                  queue_bytes=queue_bytes, repeats=repeats, seed=seed, quick=quick, timeout_s=timeout_s,
                  impairment="h0 ingress and egress: tbf rate + random loss of data-sized packets")
    env = C.environment()
    rows: list[dict] = []
    fcts: dict = {}
    failures: list[dict] = []
    measured: dict = {}  # measured drop rate at the PS link per 'loss/direction'
    t_start = time.time()
    total = repeats * len(losses) * len(transports)
    with Lab(n_hosts=workers + 1) as lab, C.progress(total, NAME, disable=not progress) as bar:
        for loss in losses:
            for d in ("ingress", "egress"):
                lab.impair(lab.hosts[0], d, loss=loss, rate_bps=rate_bps, queue_bytes=queue_bytes)
            for rep in range(repeats):
                for t in transports:
                    bar.set_postfix_str(f"{t} loss={loss:g}")
                    try:
                        its, fct = _one_run(lab, t, workers, size, iterations + 1, slack_s, seed + rep, timeout_s,
                                            rate_bps)
                    except C.ExperimentError as e:
                        failures.append(dict(transport=t, loss=loss, repeat=rep, error=str(e)[:2000]))
                        bar.update(1)
                        continue
                    for r in its:
                        r.update(transport=t, loss=loss, repeat=rep, lower_bound_s=round(bound_s, 4),
                                 bst_over_bound=round(r["bst_s"] / bound_s, 3))
                    rows += its
                    fcts.setdefault((t, loss), []).extend(
                        x for r, f in zip(its, fct) if not r["warmup"] for x in f)
                    bar.update(1)
            for d in ("ingress", "egress"):
                st = lab.loss_stats(lab.hosts[0], d)
                measured[f"{loss:g}/{d}"] = round(st["measured_loss"], 5)
                if st["oversize"]:
                    failures.append(dict(loss=loss, error=f"{st['oversize']} oversize packets at the {d} loss "
                                                          "point: offloads are on, the loss is not per packet"))
        backend, lab_prefix = lab.backend, lab.prefix
    summary = _summarise(rows, transports, losses, workers, size, bound_s, failures)
    res = dict(experiment=NAME, params=params, environment=env, backend=backend, lab_prefix=lab_prefix,
               wall_s=round(time.time() - t_start, 1), lower_bound_s=bound_s, measured_loss=measured,
               iterations=rows,
               summary=summary, failures=failures, out=outdir)
    C.write_json(f"{outdir}/results.json", res)
    C.write_csv(f"{outdir}/iterations.csv", ITER_COLUMNS, rows)
    C.write_csv(f"{outdir}/summary.csv", SUMMARY_COLUMNS, summary)
    _plot(rows, fcts, transports, losses, bound_s, workers, size, rate_bps, outdir)
    res["table"] = table(summary)
    if verbose:
        print(res["table"])
        for f in failures:
            print(f"FAILED {f}")
        print(f"files in {outdir}")
    return res


def _one_run(lab, transport, workers, size, n_iter, slack_s, seed, timeout_s, rate_bps=None):
    """One PS + N workers for ``n_iter`` iterations; return (per-iteration rows, per-iteration worker FCTs).

    ``ltp``: the PS is told its link rate (``rate_bps``), as a user tells it the NIC's, so it grants each
    worker an equal share and splits its broadcast (``ltp/link_share.py``); ``ltp-nogrant``: it is not."""
    grants = transport == "ltp" and rate_bps
    transport = "ltp" if transport == LTP_NO_GRANT else transport
    py = sys.executable
    mod = ["-m", "ltp_tools.experiments._procs"]
    kw = dict(stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    ps_h, w_hosts = lab.hosts[0], lab.hosts[1:workers + 1]
    common = ["--size", str(size), "--iterations", str(n_iter), "--timeout", str(timeout_s)]
    procs = []
    run_timeout = timeout_s * n_iter + 60
    try:
        if transport == "ltp":
            peers = ",".join(f"{h.addr}:{LTP_PORT}" for h in w_hosts)
            ps = lab.popen(ps_h, [py, *mod, "incast-ltp-ps", "--port", str(LTP_PORT), "--peers", peers,
                                  "--slack", str(slack_s), "--seed", str(seed), *common]
                           + (["--link-rate", str(rate_bps)] if grants else []), **kw)
            procs.append(ps)
            ws = [lab.popen(h, [py, *mod, "incast-ltp-worker", "--port", str(LTP_PORT), "--ps",
                                f"{ps_h.addr}:{LTP_PORT}", "--slack", str(slack_s), "--seed", str(seed * 1000 + i),
                                *common], **kw) for i, h in enumerate(w_hosts, 1)]
        else:
            ps = lab.popen(ps_h, [py, *mod, "incast-tcp-ps", "--port", str(TCP_PORT), "--workers", str(workers),
                                  "--seed", str(seed), *common], **kw)
            procs.append(ps)
            C.wait_ready(ps, 60, "incast PS")
            ws = [lab.popen(h, [py, *mod, "incast-tcp-worker", "--ps", f"{ps_h.addr}:{TCP_PORT}", "--cc", transport,
                                "--seed", str(seed * 1000 + i), *common], **kw) for i, h in enumerate(w_hosts, 1)]
        procs += ws
        if transport == "ltp":
            C.wait_ready(ps, 60, "incast PS")
        for i, w in enumerate(ws, 1):
            C.wait_ready(w, 60, f"incast worker h{i}")
        time.sleep(0.1)  # the PS's gather is posted / every connection accepted
        for w in ws:  # release all workers at once
            w.stdin.write("GO\n")
        for w in ws:
            w.stdin.flush()
        w_out = [C.read_json_lines(w, run_timeout, f"{transport} incast worker h{i}") for i, w in enumerate(ws, 1)]
        ps_out = C.read_json_lines(ps, 60, f"{transport} incast PS")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=5)
    if len(ps_out) != n_iter or any(len(w) != n_iter for w in w_out):
        raise C.ExperimentError(f"{transport}: expected {n_iter} iterations from every process, got PS "
                                f"{len(ps_out)} and workers {[len(w) for w in w_out]}")
    rows, fcts = [], []
    for it in range(n_iter):
        start = min(w[it]["t_send_start"] for w in w_out)
        g_end = ps_out[it]["t_gather_end"]
        b_end = max(w[it]["t_bcast_done"] for w in w_out)
        row = dict(iteration=it, warmup=it == 0, gather_s=round(g_end - start, 5), bcast_s=round(b_end - g_end, 5),
                   bst_s=round(b_end - start, 5))
        if transport == "ltp":
            dl = ps_out[it]["delivered"]
            row.update(delivered_mean=round(statistics.fmean(dl), 5), delivered_min=round(min(dl), 5),
                       regimes=_regimes(ps_out[it]["regimes"]),
                       # the senders' own model of their path at the end of the flow (bytes/s -> Mbit/s)
                       ltp_btlbw_mbps_median=round(statistics.median(w[it]["btlbw_bps"] for w in w_out) * 8e-6, 1),
                       ltp_rtprop_ms_median=round(statistics.median(w[it]["rtprop_s"] for w in w_out) * 1e3, 3),
                       ltp_retransmitted=sum(w[it]["retransmitted"] for w in w_out),
                       # the PS's broadcast: packets it sent to all workers and how many of them were resends
                       ltp_bcast_packets=ps_out[it]["bcast_packets"],
                       ltp_bcast_retransmitted=ps_out[it]["bcast_retransmitted"])
            # a flow's time at the PS runs from its registration; add how late the worker started
            fct = [ps_out[it]["flow_s"][k] + (w_out[k][it]["t_send_start"] - start) for k in range(len(w_out))]
        else:
            row.update(delivered_mean=1.0, delivered_min=1.0, regimes=f"{Regime.COMPLETE}={len(w_out)}")
            fct = [ps_out[it]["t_recv_done"][k] - start for k in range(len(w_out))]
        row.update(worker_fct_max_s=round(max(fct), 5), worker_fct_median_s=round(statistics.median(fct), 5))
        rows.append(row)
        fcts.append(fct)
    return rows, fcts


_REGIME_ORDER = (Regime.COMPLETE, Regime.EARLY, Regime.DEADLINE, Regime.TIMEOUT, Regime.CANCELLED)


def _regimes(names) -> str:
    c = Counter(names)
    return " ".join(f"{k}={c[k]}" for k in _REGIME_ORDER if c[k])


def _summarise(rows, transports, losses, workers, size, bound_s, failures) -> list[dict]:
    out = []
    for t in transports:
        for loss in losses:
            pts = [r for r in rows if r["transport"] == t and r["loss"] == loss and not r["warmup"]]
            bst = [r["bst_s"] for r in pts]
            reg = Counter()
            for r in pts:
                for part in (r.get("regimes") or "").split():
                    k, v = part.split("=")
                    reg[k] += int(v)
            med = statistics.median(bst) if bst else None
            out.append(dict(
                transport=t, loss=loss, loss_pct=round(loss * 100, 4), workers=workers, size_bytes=size,
                n_iterations=len(pts), bst_median_s=_r(med), bst_mean_s=_r(statistics.fmean(bst) if bst else None),
                bst_p95_s=_r(C.percentile(bst, 95) if bst else None), bst_max_s=_r(max(bst) if bst else None),
                gather_median_s=_r(statistics.median([r["gather_s"] for r in pts]) if pts else None),
                bcast_median_s=_r(statistics.median([r["bcast_s"] for r in pts]) if pts else None),
                lower_bound_s=_r(bound_s), bst_median_over_bound=_r(med / bound_s if med else None, 3),
                delivered_mean=_r(statistics.fmean([r["delivered_mean"] for r in pts]) if pts else None, 5),
                delivered_min=_r(min(r["delivered_min"] for r in pts) if pts else None, 5),
                regimes=" ".join(f"{k}={v}" for k, v in reg.items()),
                failures=sum(1 for f in failures if f.get("transport") == t and f.get("loss") == loss)))
    return out


def _r(v, nd=4):
    return None if v is None else round(v, nd)


def table(summary) -> str:
    """Summary table: one row per transport x loss."""
    cols = ["transport", "loss %", "BST median s", "BST p95 s", "gather s", "bcast s", "bound s", "BST/bound",
            "delivered", "regimes (LTP gathers)"]
    rows = [[s["transport"], s["loss_pct"], s["bst_median_s"], s["bst_p95_s"], s["gather_median_s"],
             s["bcast_median_s"], s["lower_bound_s"], s["bst_median_over_bound"], s["delivered_mean"],
             s["regimes"] if s["transport"].startswith("ltp") else "-"] for s in summary]
    return C.format_table(cols, rows)


def _plot(rows, fcts, transports, losses, bound_s, workers, size, rate_bps, outdir) -> None:
    plt = C.pyplot()
    fig, axes = plt.subplots(1, len(losses), figsize=(3.2 * len(losses) + 1, 4), squeeze=False, sharey=True)
    for ax, loss in zip(axes[0], losses):
        data = [[r["bst_s"] for r in rows if r["transport"] == t and r["loss"] == loss and not r["warmup"]]
                for t in transports]
        ax.boxplot([d if d else [float("nan")] for d in data], showfliers=True)
        ax.set_xticks(range(1, len(transports) + 1), list(transports))
        ax.axhline(bound_s, color="red", ls="--", lw=1, label="line-rate bound")
        ax.set_title(f"loss {loss * 100:g}%")
        ax.grid(True, axis="y", alpha=0.3)
    axes[0][0].set_ylabel("batch synchronisation time (s)")
    axes[0][0].legend(fontsize=8)
    fig.suptitle(f"incast: {workers} workers x {size / 1e6:g} MB, PS link {rate_bps / 1e9:g} Gbit/s "
                 "(gather + broadcast, warm-up excluded)", fontsize=10)
    fig.tight_layout()
    fig.savefig(f"{outdir}/bst.png", dpi=110)
    plt.close(fig)

    fig, axes = plt.subplots(1, len(losses), figsize=(3.2 * len(losses) + 1, 4), squeeze=False, sharey=True)
    for ax, loss in zip(axes[0], losses):
        data = [fcts.get((t, loss), []) for t in transports]
        ax.boxplot([d if d else [float("nan")] for d in data])
        ax.set_xticks(range(1, len(transports) + 1), list(transports))
        ax.axhline(bound_s / 2, color="red", ls="--", lw=1, label="gather bound")
        ax.set_title(f"loss {loss * 100:g}%")
        ax.grid(True, axis="y", alpha=0.3)
    axes[0][0].set_ylabel("per-worker gather completion (s)")
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(f"{outdir}/gather_fct.png", dpi=110)
    plt.close(fig)


# ----------------------------------------------------------------------------- CLI
def register(subparsers) -> None:
    """Add ``ltp-lab incast``."""
    from ltp_tools.bench import parse_rate, parse_size

    p = subparsers.add_parser(NAME, help="batch synchronisation time, N workers -> one PS (paper Fig. 3/14)",
                              description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=number(int, 1, 60, what="worker hosts"), default=None, help="worker hosts h1..hN (default 8; --quick 4)")
    p.add_argument("--size", type=parse_size, default=None, help="gradient message bytes (default 98M; --quick 2M)")
    p.add_argument("--iterations", type=number(int, 1, what="iterations per point"), default=None,
                   help="measured iterations per run, after one warm-up (default 5; --quick 3)")
    p.add_argument("--transports", default=",".join(TRANSPORTS), help="comma list of ltp,cubic,bbr,reno and ltp-nogrant (LTP without the PS's "
                   "rate grants)")
    p.add_argument("--losses", default=",".join(f"{x:g}" for x in LOSSES),
                   help="comma list of drop probabilities on the PS link (0.01 = 1%%); --quick: 0,0.01")
    p.add_argument("--rate", type=parse_rate, default=1e9, help="PS link rate, both directions (default 1gbit)")
    p.add_argument("--slack", type=float, default=0.03, help="LTP Early Close deadline slack C, s (DCN 0.03)")
    p.add_argument("--queue", type=parse_size, default=None,
                   help="the PS link's queue, bytes (e.g. 32k; default 5 ms at --rate)")
    p.add_argument("--timeout", type=float, default=None, help="seconds one transfer may take (default 20x bound)")
    C.add_common_args(p)
    p.set_defaults(func=_cli)


def _cli(args) -> int:
    res = run(workers=args.workers, size=args.size, iterations=args.iterations,
              transports=C.parse_list(args.transports, str), losses=C.parse_list(args.losses), rate_bps=args.rate,
              slack_s=args.slack, queue_bytes=args.queue, repeats=args.repeats, seed=args.seed, quick=args.quick,
              out=args.out, timeout_s=args.timeout, progress=not args.no_progress)
    return 1 if res["failures"] else 0
