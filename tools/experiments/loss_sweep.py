"""``ltp-lab loss-sweep``: point-to-point goodput vs random (non-congestion) loss, LTP vs kernel TCP.

Theory of operation
    The paper's Fig. 4/12: how much of a link each transport keeps when packets are lost at
    random, not because a queue overflowed. One two-host :class:`~ltp_tools.netlab.Lab` is
    built once; every point is one :func:`ltp_tools.bench.run_bench` transfer h0 -> h1, which
    re-impairs h1's ingress (random drop of data-sized packets, tbf rate on h1's downlink,
    delay on h1's ingress) before it starts. Two link profiles:

    * ``dcn`` -- no added delay (veth RTT ~50 us plus the tbf queue), rate ``--dcn-rate``
      (default 1 Gbit/s, so the link and not this machine's CPU is the bottleneck;
      ``none`` = unlimited veth);
    * ``wan`` -- rate ``--wan-rate`` (default 1 Gbit/s) and ``--wan-delay`` one-way delay
      (default 10 ms) in BOTH directions: the data path on h1's ingress (set by run_bench),
      the ACK path on h0's ingress (set here), so RTT ~ 2 x delay = 20 ms. Loss is applied
      to the data direction only; ACK-sized packets are never dropped (the lab's rule).

    Transports: ``ltp`` (reliable mode by default, every byte delivered and checked
    bit-exact by the receiver, so goodput compares honestly with TCP; ``--ltp-mode
    tolerant`` reports Early Close goodput and the delivered fraction instead, after one
    warm-up message that lets Early Close measure the link) and kernel TCP with
    ``cubic``, ``bbr`` and ``reno`` (``ltp_tools.tcpbench``: the clock stops when the
    receiver has read every byte). Goodput = delivered payload bytes x 8 / duration;
    normalised goodput = goodput / link rate (empty when the link is unlimited).

    Drift control: within each (repeat, profile, loss) the order of the transports is
    shuffled with ``--seed``, so slow drifts of this shared machine's load do not always
    hit the same transport. The summary reports the median over repeats and the min/max.

    Files in ``--out``: ``results.json`` (parameters, environment, every run, summary),
    ``runs.csv`` (one row per transfer), ``summary.csv`` (one row per profile x transport
    x loss), ``goodput.png`` (goodput vs loss per profile, log y) and ``normalised.png``.
"""
from __future__ import annotations

import random
import statistics
import time

from . import _common as C

NAME = "loss-sweep"
TRANSPORTS = ("ltp", "cubic", "bbr", "reno")
LOSSES = (0.0, 0.0001, 0.001, 0.005, 0.01)  # 0, 0.01, 0.1, 0.5, 1 %
PROFILES = ("dcn", "wan")
RUN_COLUMNS = ["profile", "transport", "loss", "repeat", "rate_bps", "delay_s", "size_bytes", "goodput_mbps",
               "normalised", "duration_s", "delivered_fraction", "retransmitted_packets", "measured_loss",
               "ltp_mode", "verified", "error"]
SUMMARY_COLUMNS = ["profile", "transport", "loss", "loss_pct", "n", "goodput_mbps_median", "goodput_mbps_min",
                   "goodput_mbps_max", "normalised_median", "delivered_fraction_median", "measured_loss_mean",
                   "failures"]


def run(*, transports=TRANSPORTS, losses=LOSSES, profiles=PROFILES, dcn_rate_bps: float | None = 1e9,
        wan_rate_bps: float = 1e9, wan_delay_s: float = 0.010, size_dcn: int | None = None,
        size_wan: int | None = None, ltp_mode: str = "reliable", repeats: int | None = None, seed: int = 1,
        quick: bool = False, out: str | None = None, timeout_s: float = 240.0, progress: bool = True,
        verbose: bool = True) -> dict:
    """Run the sweep and write its files; return the results dict (see the module docstring).

    ``quick`` is the CI profile: losses 0 and 1 %, 2 MB (DCN) / 1 MB (WAN) transfers, 1 repeat,
    unless the corresponding argument is given explicitly.
    """
    from ltp_tools.bench import run_bench
    from ltp_tools.netlab import Lab

    for t in transports:
        if t not in TRANSPORTS:
            raise ValueError(f"unknown transport {t!r}; choose from {', '.join(TRANSPORTS)}")
    for p in profiles:
        if p not in PROFILES:
            raise ValueError(f"unknown profile {p!r}; choose from {', '.join(PROFILES)}")
    if ltp_mode not in ("reliable", "tolerant"):
        raise ValueError(f"ltp_mode must be 'reliable' or 'tolerant', got {ltp_mode!r}")
    if quick and tuple(losses) == LOSSES:
        losses = (0.0, 0.01)
    losses = [float(x) for x in losses]
    if any(not 0 <= x < 1 for x in losses):
        raise ValueError(f"losses are drop probabilities in [0, 1): {losses} (0.01 = 1 %)")
    repeats = repeats or (1 if quick else 3)
    size_dcn = size_dcn or (2_000_000 if quick else 100_000_000)
    size_wan = size_wan or (1_000_000 if quick else 20_000_000)
    C.require_lab()
    outdir = C.out_dir(NAME, out)
    params = dict(transports=list(transports), losses=losses, profiles=list(profiles), dcn_rate_bps=dcn_rate_bps,
                  wan_rate_bps=wan_rate_bps, wan_delay_s=wan_delay_s, size_dcn=size_dcn, size_wan=size_wan,
                  ltp_mode=ltp_mode, repeats=repeats, seed=seed, quick=quick, timeout_s=timeout_s)
    prof = {"dcn": dict(rate_bps=dcn_rate_bps, delay_s=0.0, size=size_dcn),
            "wan": dict(rate_bps=wan_rate_bps, delay_s=wan_delay_s, size=size_wan)}
    rng = random.Random(seed)
    rows: list[dict] = []
    env = C.environment()
    t0 = time.time()
    total = repeats * len(profiles) * len(losses) * len(transports)
    with Lab(n_hosts=2) as lab, C.progress(total, NAME, disable=not progress) as bar:
        for profile in profiles:
            pp = prof[profile]
            # ACK path delay (h1 -> h0); run_bench sets the data path (h0 -> h1) itself
            lab.impair(lab.hosts[0], "ingress", delay_s=pp["delay_s"])
            for rep in range(repeats):
                for loss in losses:
                    order = list(transports)
                    rng.shuffle(order)
                    for t in order:
                        bar.set_postfix_str(f"{profile} {t} loss={loss:g}")
                        rows.append(_one(run_bench, lab, profile, t, loss, rep, pp, ltp_mode, timeout_s))
                        bar.update(1)
        backend, lab_prefix = lab.backend, lab.prefix
    summary = _summarise(rows, profiles, transports, losses)
    res = dict(experiment=NAME, params=params, environment=env, backend=backend, lab_prefix=lab_prefix,
               wall_s=round(time.time() - t0, 1), runs=rows, summary=summary, out=outdir)
    C.write_json(f"{outdir}/results.json", res)
    C.write_csv(f"{outdir}/runs.csv", RUN_COLUMNS, rows)
    C.write_csv(f"{outdir}/summary.csv", SUMMARY_COLUMNS, summary)
    _plot(summary, profiles, transports, losses, prof, outdir)
    res["table"] = table(summary)
    if verbose:
        print(res["table"])
        print(f"files in {outdir}")
    return res


def _one(run_bench, lab, profile, transport, loss, rep, pp, ltp_mode, timeout_s) -> dict:
    row = dict(profile=profile, transport=transport, loss=loss, repeat=rep, rate_bps=pp["rate_bps"],
               delay_s=pp["delay_s"], size_bytes=pp["size"], ltp_mode=ltp_mode if transport == "ltp" else None)
    try:
        r = run_bench(transport=transport, size=pp["size"], loss=loss, rate_bps=pp["rate_bps"],
                      delay_s=pp["delay_s"], mode=ltp_mode if transport == "ltp" else "reliable", lab=lab,
                      warmup=1 if (transport == "ltp" and ltp_mode == "tolerant") else 0, timeout=timeout_s)
    except Exception as e:  # noqa: BLE001 - one failed point must not lose the whole sweep
        row["error"] = f"{type(e).__name__}: {str(e).strip()[:300]}"
        return row
    gp = r["goodput_gbps"] * 1e3
    row.update(goodput_mbps=round(gp, 2), duration_s=r["duration_s"], delivered_fraction=r["delivered_fraction"],
               retransmitted_packets=r.get("retransmitted_packets"), measured_loss=r.get("measured_loss"),
               verified=r.get("verified"),
               normalised=round(gp * 1e6 / pp["rate_bps"], 4) if pp["rate_bps"] else None)
    if transport == "ltp" and ltp_mode == "reliable" and r.get("verified") is False:
        row["error"] = "LTP reliable transfer was not bit-exact"
    return row


def _summarise(rows, profiles, transports, losses) -> list[dict]:
    out = []
    for p in profiles:
        for t in transports:
            for loss in losses:
                pts = [r for r in rows if r["profile"] == p and r["transport"] == t and r["loss"] == loss]
                ok = [r for r in pts if not r.get("error")]
                gps = [r["goodput_mbps"] for r in ok]
                norms = [r["normalised"] for r in ok if r.get("normalised") is not None]
                ml = [r["measured_loss"] for r in ok if r.get("measured_loss") is not None]
                out.append(dict(
                    profile=p, transport=t, loss=loss, loss_pct=round(loss * 100, 4), n=len(ok),
                    goodput_mbps_median=round(statistics.median(gps), 2) if gps else None,
                    goodput_mbps_min=min(gps) if gps else None, goodput_mbps_max=max(gps) if gps else None,
                    normalised_median=round(statistics.median(norms), 4) if norms else None,
                    delivered_fraction_median=statistics.median([r["delivered_fraction"] for r in ok]) if ok else None,
                    measured_loss_mean=round(statistics.fmean(ml), 5) if ml else None,
                    failures=len(pts) - len(ok)))
    return out


def table(summary) -> str:
    """Summary table: one row per profile x loss, goodput (Mbit/s) and normalised goodput per transport."""
    transports = list(dict.fromkeys(s["transport"] for s in summary))
    keys = list(dict.fromkeys((s["profile"], s["loss"]) for s in summary))
    by = {(s["profile"], s["loss"], s["transport"]): s for s in summary}
    cols = ["profile", "loss %"] + [f"{t} Mbit/s" for t in transports] + [f"{t} norm" for t in transports]
    # LTP in tolerant mode delivers less than every byte: show how much beside its goodput
    tolerant = any(s["transport"] == "ltp" and (s["delivered_fraction_median"] or 1) < 1 for s in summary)
    if tolerant:
        cols.append("ltp delivered")
    rows = []
    for p, loss in keys:
        rows.append([p, round(loss * 100, 4)] + [by[(p, loss, t)]["goodput_mbps_median"] for t in transports]
                    + [by[(p, loss, t)]["normalised_median"] for t in transports]
                    + ([by[(p, loss, "ltp")]["delivered_fraction_median"]] if tolerant else []))
    return C.format_table(cols, rows)


def _plot(summary, profiles, transports, losses, prof, outdir) -> None:
    plt = C.pyplot()
    x = list(range(len(losses)))
    labels = [f"{loss * 100:g}%" for loss in losses]
    for fname, key, ylabel, logy in (("goodput.png", "goodput_mbps", "goodput (Mbit/s)", True),
                                     ("normalised.png", "normalised", "goodput / link rate", False)):
        fig, axes = plt.subplots(1, len(profiles), figsize=(5.5 * len(profiles), 4), squeeze=False)
        for ax, p in zip(axes[0], profiles):
            for t in transports:
                pts = [next(s for s in summary if s["profile"] == p and s["transport"] == t and s["loss"] == loss)
                       for loss in losses]
                if key == "goodput_mbps":
                    y = [s["goodput_mbps_median"] for s in pts]
                    lo = [(s["goodput_mbps_median"] - s["goodput_mbps_min"]) if s["n"] else 0 for s in pts]
                    hi = [(s["goodput_mbps_max"] - s["goodput_mbps_median"]) if s["n"] else 0 for s in pts]
                    y = [v if v is not None else float("nan") for v in y]
                    ax.errorbar(x, y, yerr=[lo, hi], marker="o", capsize=3, label=t)
                else:
                    y = [s["normalised_median"] if s["normalised_median"] is not None else float("nan") for s in pts]
                    ax.plot(x, y, marker="o", label=t)
            rate = prof[p]["rate_bps"]
            if key == "goodput_mbps" and rate:
                ax.axhline(rate / 1e6, color="grey", ls="--", lw=1, label="link rate")
            if logy:
                ax.set_yscale("log")
            elif rate:
                ax.set_ylim(0, 1.1)
            ax.set_xticks(x, labels)
            ax.set_xlabel("random loss rate")
            ax.set_ylabel(ylabel)
            rate_txt = f"{rate / 1e9:g} Gbit/s" if rate else "unlimited"
            delay_txt = f", {prof[p]['delay_s'] * 1e3:g} ms one-way" if prof[p]["delay_s"] else ""
            ax.set_title(f"{p.upper()}: {rate_txt}{delay_txt}")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(f"{outdir}/{fname}", dpi=110)
        plt.close(fig)


# ----------------------------------------------------------------------------- CLI
def register(subparsers) -> None:
    """Add ``ltp-lab loss-sweep``."""
    from ltp_tools.bench import parse_rate, parse_size, parse_time

    p = subparsers.add_parser(NAME, help="goodput vs random loss, LTP vs cubic/bbr/reno (paper Fig. 4/12)",
                              description=__doc__.split("\n\n")[0])
    p.add_argument("--transports", default=",".join(TRANSPORTS), help="comma list of ltp,cubic,bbr,reno")
    p.add_argument("--losses", default=",".join(f"{x:g}" for x in LOSSES),
                   help="comma list of drop probabilities (0.01 = 1%%); --quick: 0,0.01")
    p.add_argument("--profiles", default="dcn,wan", help="comma list of dcn,wan")
    p.add_argument("--dcn-rate", type=parse_rate, default=1e9,
                   help="DCN link rate (default 1gbit; 'none' = unlimited)")
    p.add_argument("--wan-rate", type=parse_rate, default=1e9, help="WAN link rate (default 1gbit)")
    p.add_argument("--wan-delay", type=parse_time, default=0.010,
                   help="WAN one-way delay, each direction (default 10ms)")
    p.add_argument("--size-dcn", type=parse_size, default=None, help="bytes per DCN transfer (default 100M; --quick 2M)")
    p.add_argument("--size-wan", type=parse_size, default=None, help="bytes per WAN transfer (default 20M; --quick 1M)")
    p.add_argument("--ltp-mode", choices=["reliable", "tolerant"], default="reliable")
    p.add_argument("--timeout", type=float, default=240.0, help="seconds one transfer may take")
    C.add_common_args(p)
    p.set_defaults(func=_cli)


def _cli(args) -> int:
    if args.wan_rate is None:
        raise SystemExit("ltp-lab loss-sweep: the WAN profile needs a rate (e.g. --wan-rate 1gbit)")
    res = run(transports=C.parse_list(args.transports, str), losses=C.parse_list(args.losses),
              profiles=C.parse_list(args.profiles, str), dcn_rate_bps=args.dcn_rate, wan_rate_bps=args.wan_rate,
              wan_delay_s=args.wan_delay, size_dcn=args.size_dcn, size_wan=args.size_wan, ltp_mode=args.ltp_mode,
              repeats=args.repeats, seed=args.seed, quick=args.quick, out=args.out, timeout_s=args.timeout,
              progress=not args.no_progress)
    fails = sum(s["failures"] for s in res["summary"])
    if fails:
        print(f"{fails} transfer(s) failed; see 'error' in {res['out']}/runs.csv")
    return 1 if fails else 0
