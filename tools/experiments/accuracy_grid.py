"""``ltp-lab accuracy-grid``: does loss-tolerant training hold TCP's accuracy, and does any run diverge?

Theory of operation
    Issue 7's grid: the digits CNN trained by ``ltp-ps launch`` (1 PS + W workers, BSP) over
    LTP (loss-tolerant gradients, Early Close, unbiased mean) and over kernel TCP (cubic),
    for every cell workers x loss x one-way delay, with several seeds. Each run is one
    ``python -m ltp_ps.cli launch`` child process:

    * backend ``lab`` (default): ``--lab on`` -- every process in its own network namespace,
      ``--loss`` random drop of data-sized packets and ``--delay`` one-way delay on the PS's
      ingress (``ltp_tools.netlab``), the same impairment for both transports;
    * backend ``memory``: the job runs in this process on ``ltp_ps``'s in-memory transport
      (random segment loss with LTP's bubble semantics, no delay, no Early Close); fast and
      deterministic, for the test suite and machines without namespaces. Delays other
      than 0 are not modelled there and such cells are refused.

    The seed (``--seed`` of the launch: initial parameters, data order) is the same for
    both transports of a cell, so each pair differs only by the transport; the order of
    the two runs is shuffled (``--grid-seed``) so slow drifts of this shared machine's
    load do not always hit the same one.

    Per run: the accuracy after every epoch (360 test samples: one sample is 0.28
    points), the best and final accuracy, the mean gather delivered fraction and whether
    it **diverged**: the job failed (non-zero exit, e.g. a non-finite loss), or accuracy
    collapsed (:data:`COLLAPSE_ACC` or less -- chance is 0.10 -- after having reached
    :data:`LEARNED_ACC`), or it never reached :data:`LEARNED_ACC`.

    Per cell: mean best accuracy of each transport over seeds and the gap LTP - TCP in
    points. The gap passes when it is within ``max(0.5 points, 2 x its standard
    error)`` (*choice*: with 3 seeds the seed-to-seed spread of the best accuracy is
    about 1 point, so a fixed 0.5-point bound alone would flag noise; the bound is
    printed next to every gap). With fewer than :data:`MIN_SEEDS_TO_JUDGE` seeds the
    gap is reported but not judged (``ok`` is ``-``): one run per transport says
    nothing about a 0.5-point difference.

    Files in ``--out``: ``results.json`` (parameters, environment, every run with its
    accuracy curve, the summary), ``runs.csv``, ``summary.csv`` (one row per cell),
    ``accuracy_gap.png`` (gap vs loss, one panel per delay, one line per worker count)
    and ``delivered.png`` (LTP's delivered fraction). The command exits 1 when a run
    diverged or failed, or a cell's gap is outside its bound.
"""
from __future__ import annotations

from ltp_tools.argtypes import number

import json
import math
import os
import random
import statistics
import subprocess
import sys
import time

from . import _common as C

NAME = "accuracy-grid"
TRANSPORTS = ("ltp", "tcp")
WORKERS = (2, 4, 6, 8)
LOSSES = (0.0, 0.001, 0.003, 0.01, 0.03, 0.10)
DELAYS = (0.0, 0.003, 0.010)  # seconds, one way
#: the --quick profile: a diagonal slice of the grid (workers, loss, delay), issue 7's cell included
QUICK_CELLS = ((2, 0.0, 0.0), (6, 0.003, 0.003), (4, 0.03, 0.0))
QUICK_EPOCHS = 6
FULL_EPOCHS = 10
#: accuracy at or below this after having learned counts as a collapse (chance is 0.10)
COLLAPSE_ACC = 0.20
#: a run that never reaches this accuracy did not train
LEARNED_ACC = 0.50
#: the accuracy target of issue 7: LTP's best accuracy within this many points of TCP's
GAP_POINTS = 0.5
#: seeds per transport needed before a cell's gap is judged (one run has no spread to compare with)
MIN_SEEDS_TO_JUDGE = 2

RUN_COLUMNS = ["workers", "loss", "delay_s", "transport", "seed", "backend", "epochs", "best_acc", "final_acc",
               "min_acc_after_learning", "delivered_mean", "delivered_min", "diverged", "why", "rc", "wall_s",
               "error"]
SUMMARY_COLUMNS = ["workers", "loss", "delay_s", "n_seeds", "ltp_best_mean", "tcp_best_mean", "gap_points",
                   "bound_points", "gap_ok", "ltp_final_mean", "tcp_final_mean", "ltp_delivered_mean",
                   "ltp_delivered_min", "ltp_diverged", "tcp_diverged"]


def parse_cells(text: str) -> list[tuple]:
    """``"6:0.003:0.003,2:0:0"`` -> ``[(6, 0.003, 0.003), (2, 0.0, 0.0)]`` (workers:loss:delay_s)."""
    out = []
    for part in str(text).split(","):
        if not part.strip():
            continue
        try:
            w, loss, delay = part.split(":")
            out.append((int(w), float(loss), float(delay)))
        except ValueError:
            raise ValueError(f"bad cell {part!r}: write WORKERS:LOSS:DELAY_S, e.g. 6:0.003:0.003") from None
    return out


def judge(accs: list, rc: int, losses: list | None = None) -> tuple:
    """``(diverged, why)`` for one run's per-epoch accuracies and exit code."""
    if rc != 0:
        return True, f"exit {rc}"
    if losses and any(not math.isfinite(x) for x in losses):
        return True, "non-finite loss"
    if not accs:
        return True, "no evaluation"
    learned = next((i for i, a in enumerate(accs) if a >= LEARNED_ACC), None)
    if learned is None:
        return True, f"never reached {LEARNED_ACC:.2f}"
    low = min(accs[learned:])
    if low <= COLLAPSE_ACC:
        return True, f"collapsed to {low:.3f} at epoch {accs.index(low, learned) + 1}"
    return False, ""


def gap_bound(ltp: list, tcp: list) -> float:
    """Allowed |gap| of mean best accuracies, in points: max(GAP_POINTS, 2 x standard error)."""
    se = 0.0
    if len(ltp) > 1 and len(tcp) > 1:
        se = math.sqrt(statistics.variance(ltp) / len(ltp) + statistics.variance(tcp) / len(tcp)) * 100
    return max(GAP_POINTS, 2 * se)


def run(*, workers=WORKERS, losses=LOSSES, delays=DELAYS, cells=None, transports=TRANSPORTS, seeds=None,
        epochs: int | None = None, backend: str = "lab", quick: bool = False, grid_seed: int = 1,
        out: str | None = None, timeout_s: float = 600.0, progress: bool = True, verbose: bool = True,
        extra_args: tuple = ()) -> dict:
    """Run the grid and write its files; return the results dict (see the module docstring).

    ``cells`` (a list of ``(workers, loss, delay_s)``) replaces the cross product of
    ``workers`` x ``losses`` x ``delays``. ``seeds`` is a list of launch seeds (default:
    ``[0]`` with ``quick``, else ``[0, 1, 2]``). ``quick``: :data:`QUICK_CELLS`,
    :data:`QUICK_EPOCHS` epochs, unless given explicitly.
    """
    if backend not in ("lab", "memory"):
        raise ValueError(f"backend must be 'lab' or 'memory', got {backend!r}")
    for t in transports:
        if t not in TRANSPORTS:
            raise ValueError(f"unknown transport {t!r}; choose from {', '.join(TRANSPORTS)}")
    if cells is None:
        if quick and (tuple(workers), tuple(losses), tuple(delays)) == (WORKERS, LOSSES, DELAYS):
            cells = list(QUICK_CELLS)
        else:
            cells = [(int(w), float(l), float(d)) for w in workers for l in losses for d in delays]
    cells = [(int(w), float(l), float(d)) for w, l, d in cells]
    for w, l, d in cells:
        if w < 1 or not 0 <= l < 1 or d < 0:
            raise ValueError(f"bad cell ({w}, {l}, {d}): workers >= 1, loss in [0, 1), delay >= 0 seconds")
    if backend == "memory" and any(d for _, _, d in cells):
        raise ValueError("the memory backend has no delay; use --backend lab or delays 0")
    seeds = list(seeds) if seeds is not None else ([0] if quick else [0, 1, 2])
    epochs = epochs or (QUICK_EPOCHS if quick else FULL_EPOCHS)
    if backend == "lab":
        C.require_lab()
    outdir = C.out_dir(NAME, out)
    params = dict(cells=cells, transports=list(transports), seeds=seeds, epochs=epochs, backend=backend,
                  quick=quick, grid_seed=grid_seed, timeout_s=timeout_s, extra_args=list(extra_args))
    env = C.environment()
    rng = random.Random(grid_seed)
    rows: list[dict] = []
    t0 = time.time()
    total = len(cells) * len(seeds) * len(transports)
    with C.progress(total, NAME, disable=not progress) as bar:
        for w, loss, delay in cells:
            for seed in seeds:
                order = list(transports)
                rng.shuffle(order)
                for t in order:
                    bar.set_postfix_str(f"W={w} loss={loss:g} delay={delay * 1e3:g}ms {t} seed={seed}")
                    one = _run_lab if backend == "lab" else _run_memory
                    rows.append(one(w, loss, delay, t, seed, epochs, outdir, timeout_s, extra_args))
                    bar.update(1)
    summary = summarise(rows, cells)
    res = dict(experiment=NAME, params=params, environment=env, wall_s=round(time.time() - t0, 1), runs=rows,
               summary=summary, out=outdir)
    C.write_json(f"{outdir}/results.json", res)
    C.write_csv(f"{outdir}/runs.csv", RUN_COLUMNS, rows)
    C.write_csv(f"{outdir}/summary.csv", SUMMARY_COLUMNS, summary)
    _plot(summary, outdir)
    res["table"] = table(summary)
    if verbose:
        print(res["table"])
        bad = [r for r in rows if r["diverged"]]
        for r in bad:
            print(f"DIVERGED: {r['transport']} W={r['workers']} loss={r['loss']:g} delay={r['delay_s']:g} "
                  f"seed={r['seed']}: {r['why']}")
        print(f"files in {outdir}")
    return res


def _row(w, loss, delay, transport, seed, backend, epochs) -> dict:
    return dict(workers=w, loss=loss, delay_s=delay, transport=transport, seed=seed, backend=backend, epochs=epochs)


def _finish(row: dict, epoch_rows: list, rc: int, wall: float, error: str | None) -> dict:
    accs = [float(e["accuracy"]) for e in epoch_rows if "accuracy" in e]
    losses = [float(e["loss"]) for e in epoch_rows if "loss" in e]
    deliv = [float(e["delivered_mean"]) for e in epoch_rows if e.get("delivered_mean") == e.get("delivered_mean")
             and "delivered_mean" in e]
    diverged, why = judge(accs, rc, losses)
    learned = next((i for i, a in enumerate(accs) if a >= LEARNED_ACC), None)
    row.update(accuracy=accs, best_acc=max(accs) if accs else None, final_acc=accs[-1] if accs else None,
               min_acc_after_learning=min(accs[learned:]) if learned is not None else None,
               delivered_mean=statistics.fmean(deliv) if deliv else None, delivered_min=min(deliv) if deliv else None,
               diverged=diverged, why=why, rc=rc, wall_s=round(wall, 1), error=error)
    return row


def _run_lab(w, loss, delay, transport, seed, epochs, outdir, timeout_s, extra_args) -> dict:
    row = _row(w, loss, delay, transport, seed, "lab", epochs)
    tag = f"W{w}-l{loss:g}-d{delay:g}-{transport}-s{seed}"
    metrics = os.path.join(outdir, f"metrics-{tag}.jsonl")
    cmd = [sys.executable, "-m", "ltp_ps.cli", "launch", "--model", "digits", "--workers", str(w),
           "--transport", transport, "--epochs", str(epochs), "--seed", str(seed), "--metrics", metrics,
           "--lab", "on", *extra_args]
    if transport == "tcp":
        cmd += ["--cc", "cubic"]
    if loss:
        cmd += ["--loss", repr(loss)]
    if delay:
        cmd += ["--delay", repr(delay)]
    t0 = time.monotonic()
    error = None
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
        rc = p.returncode
        if rc != 0:
            error = (p.stderr or p.stdout or "")[-600:].strip()
    except subprocess.TimeoutExpired:
        rc, error = 124, f"did not finish within {timeout_s:.0f} s"
    epoch_rows = []
    if os.path.exists(metrics):
        with open(metrics) as f:
            epoch_rows = [r for r in (json.loads(line) for line in f if line.startswith("{"))
                          if r.get("event") == "epoch"]
    return _finish(row, epoch_rows, rc, time.monotonic() - t0, error)


def _run_memory(w, loss, delay, transport, seed, epochs, outdir, timeout_s, extra_args) -> dict:
    import asyncio

    from ltp_ps.server import ParameterServer, ServerConfig
    from ltp_ps.sharding import ShardPlan
    from ltp_ps.transport import MemoryNetwork
    from ltp_ps.worker import ShardRef, Worker, WorkerConfig
    from ltp_ps.workloads import get_workload

    row = _row(w, loss, delay, transport, seed, "memory", epochs)
    wl = get_workload("digits", seed=seed)
    net = MemoryNetwork(loss=loss if transport == "ltp" else 0.0, segment_size=1456, seed=seed)
    plan = ShardPlan(wl.n_params, 1)
    server = ParameterServer(wl, net.endpoint(), ServerConfig(world_size=w, epochs=epochs, lr=0.1, seed=seed),
                             plan=plan, shard=0, log=lambda _: None)
    ref = ShardRef(0, server.transport.local_addr, server.lo, server.hi)
    workers = []
    for r in range(w):
        t = net.endpoint()
        server.admit(r, t.local_addr)
        workers.append(Worker(wl, t, [ref], WorkerConfig(rank=r, world_size=w, seed=seed)))

    async def main():
        return await asyncio.wait_for(asyncio.gather(server.run(), *(x.run() for x in workers)), timeout_s)

    t0 = time.monotonic()
    rc, error = 0, None
    try:
        asyncio.run(main())
    except Exception as e:  # noqa: BLE001 - a failed run is a result (diverged), not a crash of the grid
        rc, error = 1, f"{type(e).__name__}: {e}"
    epoch_rows = [r for r in server.metrics.rows if r.get("event") == "epoch"]
    return _finish(row, epoch_rows, rc, time.monotonic() - t0, error)


def summarise(rows: list, cells: list) -> list[dict]:
    out = []
    for w, loss, delay in cells:
        rs = [r for r in rows if (r["workers"], r["loss"], r["delay_s"]) == (w, loss, delay)]
        by = {t: [r for r in rs if r["transport"] == t] for t in TRANSPORTS}
        best = {t: [r["best_acc"] for r in by[t] if r["best_acc"] is not None] for t in TRANSPORTS}
        final = {t: [r["final_acc"] for r in by[t] if r["final_acc"] is not None] for t in TRANSPORTS}
        mean = lambda xs: statistics.fmean(xs) if xs else None  # noqa: E731
        gap = bound = ok = None
        if best["ltp"] and best["tcp"]:
            gap = round((mean(best["ltp"]) - mean(best["tcp"])) * 100, 3)
            bound = round(gap_bound(best["ltp"], best["tcp"]), 3)
            # one seed per transport has no spread to judge a gap by: reported, not judged
            ok = gap >= -bound if min(len(best["ltp"]), len(best["tcp"])) >= MIN_SEEDS_TO_JUDGE else None
        deliv = [r["delivered_mean"] for r in by["ltp"] if r["delivered_mean"] is not None]
        dmin = [r["delivered_min"] for r in by["ltp"] if r["delivered_min"] is not None]
        out.append(dict(workers=w, loss=loss, delay_s=delay, n_seeds=len({r["seed"] for r in rs}),
                        ltp_best_mean=mean(best["ltp"]), tcp_best_mean=mean(best["tcp"]), gap_points=gap,
                        bound_points=bound, gap_ok=ok, ltp_final_mean=mean(final["ltp"]),
                        tcp_final_mean=mean(final["tcp"]), ltp_delivered_mean=mean(deliv),
                        ltp_delivered_min=min(dmin) if dmin else None,
                        ltp_diverged=sum(r["diverged"] for r in by["ltp"]),
                        tcp_diverged=sum(r["diverged"] for r in by["tcp"])))
    return out


def table(summary) -> str:
    cols = ["workers", "loss %", "delay ms", "seeds", "LTP best", "TCP best", "gap pts", "bound", "ok",
            "LTP delivered", "LTP div", "TCP div"]
    rows = [[s["workers"], s["loss"] * 100, s["delay_s"] * 1e3, s["n_seeds"], s["ltp_best_mean"], s["tcp_best_mean"],
             s["gap_points"], s["bound_points"], {True: "yes", False: "NO", None: "-"}[s["gap_ok"]],
             s["ltp_delivered_mean"], s["ltp_diverged"], s["tcp_diverged"]] for s in summary]
    return C.format_table(cols, rows)


def _plot(summary, outdir) -> None:
    plt = C.pyplot()
    delays = sorted({s["delay_s"] for s in summary})
    for fname, key, ylabel in (("accuracy_gap.png", "gap_points", "best accuracy LTP - TCP (points)"),
                               ("delivered.png", "ltp_delivered_mean", "LTP gather delivered fraction")):
        fig, axes = plt.subplots(1, len(delays), figsize=(5 * len(delays), 3.8), squeeze=False)
        for ax, d in zip(axes[0], delays):
            for w in sorted({s["workers"] for s in summary}):
                pts = sorted((s["loss"], s[key]) for s in summary
                             if s["delay_s"] == d and s["workers"] == w and s[key] is not None)
                if pts:
                    ax.plot([p[0] * 100 for p in pts], [p[1] for p in pts], marker="o", label=f"{w} workers")
            if key == "gap_points":
                ax.axhline(-GAP_POINTS, color="grey", linestyle="--", linewidth=0.8)
            ax.set_xscale("symlog", linthresh=0.1)
            ax.set_xlabel("loss at the PS (%)")
            ax.set_ylabel(ylabel)
            ax.set_title(f"one-way delay {d * 1e3:g} ms")
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(os.path.join(outdir, fname), dpi=110)
        plt.close(fig)


# ----------------------------------------------------------------------------- CLI
def register(subparsers) -> None:
    """Add ``ltp-lab accuracy-grid``."""
    p = subparsers.add_parser(NAME, help="digits accuracy LTP vs TCP over workers x loss x delay; flags divergence",
                              description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", default=",".join(map(str, WORKERS)), help="comma list of worker counts")
    p.add_argument("--losses", default=",".join(f"{x:g}" for x in LOSSES),
                   help="comma list of drop probabilities at the PS (0.01 = 1%%)")
    p.add_argument("--delays", default=",".join(f"{x:g}" for x in DELAYS), help="comma list of one-way delays (s)")
    p.add_argument("--cells", default=None,
                   help="explicit cells WORKERS:LOSS:DELAY_S,... instead of the cross product (e.g. 6:0.003:0.003)")
    p.add_argument("--transports", default=",".join(TRANSPORTS), help="comma list of ltp,tcp")
    p.add_argument("--seeds", default=None, help="number of seeds (0..N-1) or a comma list (default 3; --quick 1)")
    p.add_argument("--epochs", type=number(int, 1, what="epochs per run"), default=None, help=f"epochs per run (default {FULL_EPOCHS}; "
                                                            f"--quick {QUICK_EPOCHS})")
    p.add_argument("--backend", choices=["lab", "memory"], default="lab",
                   help="lab: real transports in namespaces (root); memory: in-process, no delay")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds one training run may take")
    p.add_argument("--full", action="store_true", help="the whole grid (the default without --quick)")
    p.add_argument("--quick", action="store_true",
                   help=f"CI profile: cells {', '.join(':'.join(f'{v:g}' for v in c) for c in QUICK_CELLS)}, "
                        f"{QUICK_EPOCHS} epochs, 1 seed")
    p.add_argument("--grid-seed", type=int, default=1, help="seeds the shuffled order of the transports")
    p.add_argument("--out", default=None, help="output directory (default ./results/<name>-<timestamp>)")
    p.add_argument("--no-progress", action="store_true", help="no tqdm progress bar")
    p.set_defaults(func=_cli)


def _seeds(text):
    if text is None:
        return None
    vals = C.parse_list(text, int)
    return list(range(vals[0])) if len(vals) == 1 and "," not in str(text) else vals


def _cli(args) -> int:
    if args.quick and args.full:
        raise SystemExit("ltp-lab accuracy-grid: choose --quick or --full, not both")
    res = run(workers=C.parse_list(args.workers, int), losses=C.parse_list(args.losses),
              delays=C.parse_list(args.delays), cells=parse_cells(args.cells) if args.cells else None,
              transports=C.parse_list(args.transports, str), seeds=_seeds(args.seeds), epochs=args.epochs,
              backend=args.backend, quick=args.quick, grid_seed=args.grid_seed, out=args.out,
              timeout_s=args.timeout, progress=not args.no_progress)
    diverged = sum(r["diverged"] for r in res["runs"])
    gaps = sum(1 for s in res["summary"] if s["gap_ok"] is False)
    if diverged or gaps:
        print(f"{diverged} run(s) diverged or failed, {gaps} cell(s) outside the accuracy bound; "
              f"see {res['out']}/runs.csv")
    return 1 if (diverged or gaps) else 0
