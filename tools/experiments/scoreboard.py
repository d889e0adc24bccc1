"""``ltp-lab scoreboard``: issue 8's performance targets, measured side by side, pass/fail per row.

Theory of operation
    Every target is a *ratio* against a baseline measured in the same run (absolute figures
    on this 2-core machine drift up to 2x over hours), or an absolute rate where the target
    is a line rate.  One invocation runs every requested row in turn, each transfer in a
    fresh two-host lab (:func:`ltp_tools.bench.run_bench`), so no impairment leaks between
    rows.  Rows and what they compare:

    ``cpu``        unlimited path, 0 % loss: LTP's machine-wide CPU-seconds per delivered GB
                   <= 1.25x cubic's, and LTP goodput >= 0.9x cubic's.
    ``loss``       unlimited path, 1 % loss: LTP goodput >= 1.0x cubic, >= 1.0x bbr, and
                   >= 0.95x LTP's own 0 % goodput (from the ``cpu`` row; measured here if
                   that row is not requested).
    ``tbf``        tbf 1 Gbit/s, 1 % loss: LTP goodput >= 0.93 Gbit/s.
    ``wan``        tbf 1 Gbit/s + 10 ms one way, 1 % loss: LTP >= 0.93 Gbit/s and >= 50x cubic.
    ``incast``     N workers x S bytes into one 1 Gbit/s PS link at 0.1 % and 1 % loss
                   (:mod:`.incast`): LTP's slowest round <= 1.1x the line-rate bound, its
                   p95/median <= 1.2, and <= 0.7x bbr's slowest round.
    ``bcast``      reliable broadcast of 100 MB to 4 peers from one process: LTP's
                   ``Endpoint.broadcast`` <= 1.0x the time of four cubic connections from one
                   process (:mod:`ltp_tools.broadcast_bench`).
    ``psround``    1 PS + 4 workers, ResNet-50- and VGG-16-sized models, LTP vs bbr at 0 % and
                   1 % loss and cubic at 1 %: round time and the gather's delivered fraction
                   (:mod:`.scoreboard_rows`).
    ``tta``        the README main job (digits, 4 workers, 15 epochs) at 1 % loss over LTP
                   and over TCP cubic: LTP's time to 95 % accuracy <= 0.8x cubic's
                   (:mod:`.scoreboard_rows`).
    ``twins``      the compiled path is the default, and the pure-Python twins pass the
                   transport tests CI runs against them (:mod:`.scoreboard_rows`).

    ``--gro`` runs the single-flow rows (``cpu``, ``loss``, ``tbf``, ``wan``) on labs with
    receive GRO on at the hosts' interfaces, as a real NIC's driver does (both transports on
    the same path; see :mod:`ltp_tools.netlab.lab` for where loss then sits). The issue's
    targets were set on the default path, where each packet reaches the receiver alone; the
    table's title says which path was measured.

    Machine-wide CPU comes from ``/proc/stat`` (:mod:`ltp_tools.machine_cpu`): run the
    scoreboard on an otherwise idle machine, or the CPU rows measure the other load too.
    ``--repeats N`` measures every transfer of the single-flow rows N times, the transports of
    a row interleaved (LTP, cubic, LTP, cubic, ...) so slow drift of the machine hits both, and
    judges the **median** of each figure (the raw runs are kept beside it, under ``runs``); the
    incast row takes N repeats too, and so do the ``bcast`` and ``tta`` rows (LTP and cubic
    alternated, medians judged: with one run each, boards of the same code read tta 0.86-1.25
    and bcast 1.77-2.51 over two days). One run of one transfer is not a verdict here: cubic's own
    CPU per GB has moved 1.7-2.6 s/GB between runs minutes apart. The ``psround`` row runs each of
    its ten jobs once (each takes minutes).
    ``--quick`` shrinks every size so the whole board runs in about a minute (CI uses it
    to check the plumbing; its verdicts are not the issue's verdicts).

    Files in ``--out``: ``results.json`` (every raw measurement and the table) and
    ``scoreboard.csv`` (one line per check).  Exit status 0 whether targets pass or not
    (a missed target is a measurement, not an error); non-zero only if a measurement
    failed: it raised, or its transfer reported an ``error`` (a reliable transfer that did not
    complete, or data that arrived corrupted), in any of its repeats.
"""
from __future__ import annotations

import statistics
import time

from . import _common as C

NAME = "scoreboard"
#: the PS link's queue in the incast row: the issue's "shallow (32 KB) queue"
INCAST_QUEUE_BYTES = 32_000
ROWS = ("cpu", "loss", "tbf", "wan", "incast", "bcast", "psround", "tta", "twins")
CHECK_COLUMNS = ["row", "check", "value", "target", "passed", "detail"]

# The thresholds, named once.
CPU_PER_GB_MAX_VS_CUBIC = 1.25
GOODPUT_MIN_VS_CUBIC_CLEAN = 0.9
GOODPUT_MIN_VS_TCP_LOSSY = 1.0
GOODPUT_MIN_VS_OWN_CLEAN = 0.95
LINE_RATE_MIN_GBPS = 0.93
WAN_MIN_VS_CUBIC = 50.0
INCAST_SLOWEST_MAX_VS_BOUND = 1.1
INCAST_TAIL_MAX = 1.2
INCAST_SLOWEST_MAX_VS_BBR = 0.7
BCAST_MAX_VS_TCP = 1.0
BCAST_PEERS = 4


def _sizes(quick: bool) -> dict:
    if quick:
        return dict(clean=50_000_000, lossy=30_000_000, tbf=20_000_000, wan_ltp=20_000_000, wan_tcp=2_000_000,
                    incast_workers=4, incast_size=2_000_000, incast_iterations=2, bcast=10_000_000)
    return dict(clean=1_000_000_000, lossy=500_000_000, tbf=200_000_000, wan_ltp=200_000_000, wan_tcp=20_000_000,
                incast_workers=8, incast_size=20_000_000, incast_iterations=5, bcast=100_000_000)


def _check(row: str, name: str, value, target: str, passed: bool | None, detail: str = "") -> dict:
    return dict(row=row, check=name, value=None if value is None else round(float(value), 4), target=target,
                passed=passed, detail=detail)


def _busy(r) -> str:
    """How busy a rate-limited transfer kept the LTP sender's core: on this lab the emulated link's per-packet work
    (tbf timers, the NFQUEUE delayer) runs beside the sender, so a sender near 100 % is CPU-bound, not link-bound."""
    if not r or not r.get("duration_s") or r.get("sender_cpu_s") is None:
        return ""
    return f"LTP sender CPU {r['sender_cpu_s'] / r['duration_s']:.0%} of the transfer"


def _ratio(a, b):
    return None if a is None or not b else a / b


def _median_run(runs: list[dict]) -> dict | None:
    """One transfer's figures over its repeats: the median of every numeric field, the first run's other
    fields, and every run under ``runs`` (None when no run succeeded; the run itself when there was one)."""
    if not runs:
        return None
    if len(runs) == 1:
        return runs[0]
    merged = dict(runs[0])
    for k in runs[0]:
        vals = [r.get(k) for r in runs]
        if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in vals):
            merged[k] = statistics.median(vals)
    merged["runs"] = runs
    return merged


def run(*, rows=ROWS, quick: bool = False, out: str | None = None, progress: bool = True, seed: int = 1,
        verbose: bool = True, bench=None, incast_run=None, launch_job=None, twins=None, broadcast=None,
        gro: bool = False, repeats: int = 1) -> dict:
    """Run the requested rows; return ``dict(checks=[...], raw={...}, table=str, failures=[...])``.

    ``repeats``: measurements of every single-flow transfer (interleaved across the row's transports; the
    verdicts use their medians) and of every incast point.

    ``bench``, ``incast_run``, ``launch_job`` and ``twins`` default to
    :func:`ltp_tools.bench.run_bench`, :func:`.incast.run`, :func:`.scoreboard_rows.launch_job`
    and the twin checks of :mod:`.scoreboard_rows`; tests pass fakes to check the verdict logic
    without a lab.
    """
    from ltp_tools import bench as B
    from . import incast as I
    from . import scoreboard_rows as SR

    bench = bench or B.run_bench
    incast_run = incast_run or I.run
    launch_job = launch_job or SR.launch_job
    from ltp_tools import broadcast_bench as BB

    broadcast = broadcast or BB.run
    for r in rows:
        if r not in ROWS:
            raise ValueError(f"unknown scoreboard row {r!r}; choose from {', '.join(ROWS)}")
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats={repeats!r}: measure each point at least once (a positive integer)")
    needs_lab = {"cpu": bench is B.run_bench, "loss": bench is B.run_bench, "tbf": bench is B.run_bench,
                 "wan": bench is B.run_bench, "incast": incast_run is I.run, "tta": launch_job is SR.launch_job,
                 "bcast": broadcast is BB.run, "psround": launch_job is SR.launch_job, "twins": False}
    if any(needs_lab[r] for r in rows):
        C.require_lab()
    sz = _sizes(quick)
    outdir = C.out_dir(NAME, out)
    raw: dict = {}
    checks: list[dict] = []
    failures: list[dict] = []
    t0 = time.time()
    runs: dict[str, list] = {}

    def measure(key, **kw):
        try:
            r = bench(gro=gro, **kw)
            runs.setdefault(key, []).append(r)
            if r.get("error"):  # a reliable transfer that did not complete, or corrupted data: the board fails
                failures.append(dict(measurement=key, error=str(r["error"])[:2000]))
        except Exception as e:  # noqa: BLE001 - a failed measurement is reported, the board goes on
            failures.append(dict(measurement=key, error=f"{type(e).__name__}: {e}"[:2000]))
            runs.setdefault(key, [])
        raw[key] = _median_run(runs[key])
        bar.update(1)
        return raw[key]

    def alternated(row, call):
        """``repeats`` runs of ``call(transport)`` for LTP and cubic, alternated; transport -> its results (None
        for a run that raised). A run that raised or exited non-zero (a job's ``rc``) is a failed measurement."""
        got: dict[str, list] = {"ltp": [], "cubic": []}
        for _ in range(n):
            for tr, rs in got.items():
                try:
                    r = call(tr)
                    if r.get("rc", 0) != 0:
                        failures.append(dict(measurement=f"{row}/{tr}", error=f"exit {r['rc']}: {r['tail'][-500:]}"))
                except Exception as e:  # noqa: BLE001 - a failed measurement is reported, the board goes on
                    failures.append(dict(measurement=f"{row}/{tr}", error=f"{type(e).__name__}: {e}"[:2000]))
                    r = None
                rs.append(r)
                bar.update(1)
        return got

    def g(key, field="goodput_gbps"):
        r = raw.get(key)
        return None if r is None else r.get(field)

    ps_jobs = SR.PS_ROUND_QUICK if quick else SR.PS_ROUND_JOBS
    n = repeats
    plan = {"cpu": 2 * n, "loss": (3 + ("cpu" not in rows)) * n, "tbf": n, "wan": 2 * n, "incast": 1, "bcast": 2 * n,
            "tta": 2 * n, "twins": 1, "psround": len(ps_jobs) * len(SR.PS_ROUND_CASES)}
    with C.progress(sum(plan[r] for r in rows), NAME, disable=not progress) as bar:
        if "cpu" in rows or "loss" in rows:
            for _ in range(n):
                for t in (("ltp", "cubic") if "cpu" in rows else ("ltp",)):
                    measure(f"clean/{t}", transport=t, size=sz["clean"])
        if "cpu" in rows:
            ratio = _ratio(g("clean/ltp", "machine_cpu_s_per_gb"), g("clean/cubic", "machine_cpu_s_per_gb"))
            checks.append(_check("cpu", "LTP/cubic machine CPU per GB", ratio, f"<= {CPU_PER_GB_MAX_VS_CUBIC}",
                                 None if ratio is None else ratio <= CPU_PER_GB_MAX_VS_CUBIC,
                                 f"ltp {g('clean/ltp', 'machine_cpu_s_per_gb')} s/GB, "
                                 f"cubic {g('clean/cubic', 'machine_cpu_s_per_gb')} s/GB"))
            ratio = _ratio(g("clean/ltp"), g("clean/cubic"))
            checks.append(_check("cpu", "LTP/cubic goodput, 0% loss", ratio, f">= {GOODPUT_MIN_VS_CUBIC_CLEAN}",
                                 None if ratio is None else ratio >= GOODPUT_MIN_VS_CUBIC_CLEAN,
                                 f"ltp {g('clean/ltp')} Gbit/s, cubic {g('clean/cubic')} Gbit/s"))
        if "loss" in rows:
            for _ in range(n):
                for t in ("ltp", "cubic", "bbr"):
                    measure(f"lossy/{t}", transport=t, size=sz["lossy"], loss=0.01)
            for base in ("cubic", "bbr"):
                ratio = _ratio(g("lossy/ltp"), g(f"lossy/{base}"))
                checks.append(_check("loss", f"LTP/{base} goodput, 1% loss", ratio, f">= {GOODPUT_MIN_VS_TCP_LOSSY}",
                                     None if ratio is None else ratio >= GOODPUT_MIN_VS_TCP_LOSSY,
                                     f"ltp {g('lossy/ltp')}, {base} {g(f'lossy/{base}')} Gbit/s"))
            ratio = _ratio(g("lossy/ltp"), g("clean/ltp"))
            checks.append(_check("loss", "LTP 1% / LTP 0% goodput", ratio, f">= {GOODPUT_MIN_VS_OWN_CLEAN}",
                                 None if ratio is None else ratio >= GOODPUT_MIN_VS_OWN_CLEAN))
        if "tbf" in rows:
            for _ in range(n):
                measure("tbf/ltp", transport="ltp", size=sz["tbf"], loss=0.01, rate_bps=1e9)
            v = g("tbf/ltp")
            checks.append(_check("tbf", "LTP goodput, 1 Gbit/s tbf, 1% loss (Gbit/s)", v,
                                 f">= {LINE_RATE_MIN_GBPS}", None if v is None else v >= LINE_RATE_MIN_GBPS,
                                 _busy(raw.get("tbf/ltp"))))
        if "wan" in rows:
            for _ in range(n):
                measure("wan/ltp", transport="ltp", size=sz["wan_ltp"], loss=0.01, rate_bps=1e9, delay_s=0.01)
                measure("wan/cubic", transport="cubic", size=sz["wan_tcp"], loss=0.01, rate_bps=1e9, delay_s=0.01)
            v = g("wan/ltp")
            checks.append(_check("wan", "LTP goodput, 1 Gbit/s + 10 ms, 1% loss (Gbit/s)", v,
                                 f">= {LINE_RATE_MIN_GBPS}", None if v is None else v >= LINE_RATE_MIN_GBPS,
                                 _busy(raw.get("wan/ltp"))))
            ratio = _ratio(v, g("wan/cubic"))
            checks.append(_check("wan", "LTP/cubic goodput, WAN 1% loss", ratio, f">= {WAN_MIN_VS_CUBIC}",
                                 None if ratio is None else ratio >= WAN_MIN_VS_CUBIC,
                                 f"cubic {g('wan/cubic')} Gbit/s"))
        if "incast" in rows:
            try:
                res = incast_run(workers=sz["incast_workers"], size=sz["incast_size"],
                                 iterations=sz["incast_iterations"], transports=("ltp", "bbr"),
                                 losses=(0.001, 0.01), rate_bps=1e9, queue_bytes=INCAST_QUEUE_BYTES,
                                 repeats=n, seed=seed,
                                 out=f"{outdir}/incast", progress=False, verbose=False)
                raw["incast"] = res["summary"]
                failures += [dict(measurement="incast", error=str(f)[:2000]) for f in res.get("failures", [])]
            except Exception as e:  # noqa: BLE001
                failures.append(dict(measurement="incast", error=f"{type(e).__name__}: {e}"[:2000]))
                raw["incast"] = []
            bar.update(1)
            by = {(s["transport"], s["loss"]): s for s in raw["incast"]}
            for loss in (0.001, 0.01):
                lt, bb = by.get(("ltp", loss)), by.get(("bbr", loss))
                if lt is None:
                    continue
                ratio = _ratio(lt.get("bst_max_s"), lt.get("lower_bound_s"))
                checks.append(_check("incast", f"LTP slowest / line-rate bound, {loss:.1%}", ratio,
                                     f"<= {INCAST_SLOWEST_MAX_VS_BOUND}",
                                     None if ratio is None else ratio <= INCAST_SLOWEST_MAX_VS_BOUND))
                ratio = _ratio(lt.get("bst_p95_s"), lt.get("bst_median_s"))
                checks.append(_check("incast", f"LTP p95/median, {loss:.1%}", ratio, f"<= {INCAST_TAIL_MAX}",
                                     None if ratio is None else ratio <= INCAST_TAIL_MAX))
                ratio = _ratio(lt.get("bst_max_s"), None if bb is None else bb.get("bst_max_s"))
                checks.append(_check("incast", f"LTP/bbr slowest, {loss:.1%}", ratio,
                                     f"<= {INCAST_SLOWEST_MAX_VS_BBR}",
                                     None if ratio is None else ratio <= INCAST_SLOWEST_MAX_VS_BBR))
        if "bcast" in rows:
            bruns = alternated("bcast", lambda tr: broadcast(transport=tr, size=sz["bcast"], peers=BCAST_PEERS))
            for tr, rs in bruns.items():
                bruns[tr] = [r for r in rs if r is not None]
                raw[f"bcast/{tr}"] = _median_run(bruns[tr])
            lt, cu = g("bcast/ltp", "duration_s"), g("bcast/cubic", "duration_s")
            ratio = _ratio(lt, cu)
            checks.append(_check("bcast", f"LTP broadcast / {BCAST_PEERS} cubic connections, time", ratio,
                                 f"<= {BCAST_MAX_VS_TCP}", None if ratio is None else ratio <= BCAST_MAX_VS_TCP,
                                 f"{sz['bcast'] / 1e6:g} MB to {BCAST_PEERS} peers: ltp {lt} s, cubic {cu} s"
                                 + (f" (medians of {len(bruns['ltp'])} and {len(bruns['cubic'])} runs)"
                                    if n > 1 else "")))
        if "psround" in rows:
            raw["psround"] = {}
            for job in ps_jobs:
                stats = {}
                for tr, loss in SR.PS_ROUND_CASES:
                    key = f"psround/{job['name']}/{tr}/{loss:g}"
                    try:
                        r = launch_job(tr, job=job, loss=loss, seed=seed)
                        stats[(tr, loss)] = SR.round_stats(r["rows"]) if r["rc"] == 0 else None
                        if r["rc"] != 0:
                            failures.append(dict(measurement=key, error=f"exit {r['rc']}: {r['tail'][-500:]}"))
                    except Exception as e:  # noqa: BLE001
                        failures.append(dict(measurement=key, error=f"{type(e).__name__}: {e}"[:2000]))
                        stats[(tr, loss)] = None
                    raw["psround"][key] = stats[(tr, loss)]
                    bar.update(1)
                checks.extend(SR.ps_round_checks(job["name"], stats, _check))
        if "tta" in rows:
            job, acc = (SR.TTA_QUICK, SR.TTA_QUICK_ACCURACY) if quick else (SR.TTA_JOB, SR.TTA_ACCURACY)
            truns = alternated("tta", lambda tr: launch_job(tr, job=job, loss=SR.TTA_LOSS, seed=seed))
            raw["tta"] = {tr: SR.tta_raw(rs, acc) for tr, rs in truns.items()}
            checks.extend(SR.tta_checks(truns, acc, _check))
        if "twins" in rows:
            try:
                loaded, twin = twins() if twins is not None else _twins(SR)
                raw["twins"] = dict(loaded=loaded, twin_tests=twin)
                checks.extend(SR.twins_checks(loaded, twin, _check))
                if twin is not None and twin["rc"] != 0:
                    failures.append(dict(measurement="twins",
                                         error="; ".join([twin["summary"], *twin.get("failed", [])])[:2000]))
            except Exception as e:  # noqa: BLE001
                failures.append(dict(measurement="twins", error=f"{type(e).__name__}: {e}"[:2000]))
            bar.update(1)
    table = C.format_table(CHECK_COLUMNS[:5], [[c[k] for k in CHECK_COLUMNS[:5]] for c in checks])
    repeated = [r for r in rows if r in ("cpu", "loss", "tbf", "wan", "bcast", "tta")]
    if repeats > 1 and "incast" in rows:  # its checks read the slowest, p95 and median of every repeat's rounds
        table = f"row incast: the rounds of {repeats} repeats\n" + table
    if repeats > 1 and repeated:
        table = f"rows {', '.join(repeated)}: medians of {repeats} interleaved runs per point\n" + table
    if gro and any(r in rows for r in ("cpu", "loss", "tbf", "wan")):
        table = "single-flow rows measured with receive GRO on at the lab hosts (--gro)\n" + table
    res = dict(experiment=NAME, params=dict(rows=list(rows), quick=quick, seed=seed, sizes=sz, gro=gro,
                                            repeats=repeats),
               environment=C.environment(), wall_s=round(time.time() - t0, 1), checks=checks, raw=raw,
               failures=failures, table=table, out=outdir)
    C.write_json(f"{outdir}/results.json", res)
    C.write_csv(f"{outdir}/scoreboard.csv", CHECK_COLUMNS, checks)
    if verbose:
        print(table)
        passed = sum(c["passed"] is True for c in checks)
        print(f"{passed}/{len(checks)} targets met; files in {outdir}")
        for f in failures:
            print(f"FAILED {f}")
    return res


def _twins(SR) -> tuple[dict, dict | None]:
    root = SR.repo_root()
    files = SR.twin_test_files(root)
    return SR.compiled_default(), (None if files is None else SR.run_twin_tests(root, files))


def register(subparsers) -> None:
    """Add ``ltp-lab scoreboard``."""
    p = subparsers.add_parser(NAME, help="issue 8's performance targets side by side, pass/fail per row",
                              description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default=",".join(ROWS), help=f"comma list of {','.join(ROWS)}")
    p.add_argument("--gro", action="store_true",
                   help="single-flow rows on labs with receive GRO on at the hosts, as a NIC driver does")
    C.add_common_args(p)
    p.set_defaults(func=_cli)


def _cli(args) -> int:
    repeats = args.repeats if args.repeats is not None else (1 if args.quick else 3)
    res = run(rows=C.parse_list(args.rows, str), quick=args.quick, out=args.out, progress=not args.no_progress,
              seed=args.seed, gro=args.gro, repeats=repeats)
    return 1 if res["failures"] else 0
