"""Training rows of ``ltp-lab schedules`` (issue 9 §4): MLfabric's time to accuracy, and every schedule's accuracy.

Theory of operation
    Both row sets train the digits model with the project's own processes in a
    :class:`~ltp_tools.netlab.Lab` of one host per process (the way ``ltp-ps launch --lab``
    places them): ``ltp-ps store`` on host 0, for PS schedules one ``ltp-ps server`` on host 0
    and worker ``r`` on host ``r + 1``; for PS-less schedules (rings) worker ``r`` on host
    ``r + 1`` as well, so every schedule's workers sit on the same links.  Every job gets a
    ``--topology`` written from the lab as it is when the job starts (hosts in the order the
    schedule places its nodes).  Accuracy is the PS's (rings: rank 0's) evaluation at every
    epoch end (360 test samples: one sample is 0.28 points).

    ``--experiment mlfabric`` (:func:`run_tta`): PS + ``MLF_WORKERS`` = 6 workers, every host's
    rate redrawn independently in each direction every ``--redraw-period`` seconds (default
    the paper's T = 5 s) from MLfabric's N3 profile scaled / 100 (:data:`N3_PROFILE_BPS`:
    10 Mbit/s or 100 Mbit/s with probability 0.5 each).  Each job restarts the redrawers
    with the same seed, so the three jobs of a repeat see the same rate sequence.  Rows:
    ``mlfabric`` (async, delay bound ``--tau-max``, 1 aggregator), ``direct --mode async``
    and the synchronous ``ring``.  Per job: the training time (from the first applied
    update, so process start-up and rendezvous are excluded) until the accuracy first
    reaches the target; the target is 0.95 when every job of the repeat reached it, else
    the best accuracy every job reached (the highest *common* accuracy; the report says
    which).  Also per job: updates applied with staleness beyond ``tau_max`` (counted
    from the PS's metrics: every member of an aggregate), and the staleness spread
    (population standard deviation, p10-p90 and max of per-update staleness).
    Targets (issue 9 §4): mlfabric's time <= 0.75 x ring's and <= 0.8 x async direct's;
    0 updates beyond ``tau_max``; mlfabric's staleness spread (std) <= 0.5 x async direct's.

    ``--experiment accuracy`` (:func:`run_accuracy`): every schedule in
    :data:`ACCURACY_SCHEDULES` that ``ltp-ps`` can run here (others are listed with the
    reason) over LTP and over TCP, with ``--loss`` (default 0 and 1 %) random drop at
    *every* host's ingress (so every packet, whatever its path, crosses one lossy hop),
    ``ACC_WORKERS`` = 4 workers, no rate limit.  Row: final accuracy, and its gap to
    ``direct`` over TCP without loss in points; target ``|gap| <= 0.5`` points.  Training
    settings per schedule are :data:`TRAIN_ARGS` (asynchronous MLfabric runs without
    momentum, as ``docs/schedules.md`` explains).

    Files in ``--out`` (``mlfabric-tta/`` or ``accuracy/``): ``results.json`` (parameters,
    environment, every job with its epoch curve and exit codes, summary, checks), a
    ``runs.csv`` and ``failed-logs/`` (every process log of a failed job).  Exit status 1 when a job failed (a target missed is reported, not hidden).
"""
from __future__ import annotations

import dataclasses
import json
import os
import secrets
import socket
import statistics
import subprocess
import sys
import tempfile
import time

from . import _common as C

TTA_SCHEDULES = ("mlfabric", "direct-async", "ring")
ACCURACY_SCHEDULES = ("direct", "ring", "rsgcm", "mlfabric", "rat", "hoplite")
N3_PROFILE_BPS = ((10e6, 0.5), (100e6, 0.5))  # MLfabric §7 N3 = {1 Gbit/s: 0.5, 10 Gbit/s: 0.5}, scaled / 100
REDRAW_PERIOD_S = 5.0  # seconds between rate redraws (the paper's T)
QUICK_REDRAW_PERIOD_S = 2.0  # seconds, --quick: shorter jobs still see several draws
MLF_WORKERS = 6
ACC_WORKERS = 4
TARGET_ACCURACY = 0.95
TTA_EPOCHS, QUICK_TTA_EPOCHS = 12, 3
ACC_EPOCHS, QUICK_ACC_EPOCHS = 10, 2
ACC_LOSSES = (0.0, 0.01)
TARGET_RING_RATIO = 0.75  # mlfabric time to accuracy / ring's
TARGET_ASYNC_RATIO = 0.8  # mlfabric time to accuracy / async direct's
TARGET_SPREAD_RATIO = 0.5  # mlfabric staleness std / async direct's
TARGET_ACC_GAP_POINTS = 0.5
JOB_TIMEOUT_S = 420.0  # seconds one training job may take before it is killed and reported failed
FAILED_JOB_GRACE_S = 30.0  # seconds the other processes get after one of them failed
POLL_S = 0.2  # seconds between looks at the job's processes
STORE_TIMEOUT_S = 120.0  # seconds a process waits for the rendezvous

#: training options per row (everything else is ``ltp-ps``'s default: lr 0.1, momentum 0.9, batch 32)
TRAIN_ARGS = {
    "direct": [],
    "direct-async": ["--schedule", "direct", "--mode", "async", "--momentum", "0"],
    "ring": ["--schedule", "ring"],
    "rsgcm": ["--schedule", "rsgcm"],
    "mlfabric": ["--schedule", "mlfabric", "--momentum", "0"],
    "rat": ["--schedule", "rat"],
    "hoplite": ["--schedule", "hoplite"],
}

RUN_COLUMNS = ["experiment", "repeat", "row", "transport", "loss", "exit", "epochs_done", "final_accuracy",
               "best_accuracy", "time_to_target_s", "target", "updates", "beyond_tau", "staleness_std",
               "staleness_p10", "staleness_p90", "staleness_max", "gap_points", "loadavg_1m", "error"]


def n3_draw(rng) -> float:
    """One draw of the N3 profile scaled / 100 (bit/s)."""
    x, acc = rng.random(), 0.0
    for bps, p in N3_PROFILE_BPS:
        acc += p
        if x < acc:
            return bps
    return N3_PROFILE_BPS[-1][0]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def base_schedule(row: str) -> str:
    return TRAIN_ARGS[row][TRAIN_ARGS[row].index("--schedule") + 1] if "--schedule" in TRAIN_ARGS[row] else "direct"


def runs_without_ps(row: str) -> bool:
    from ltp_ps.schedules import schedule_class
    from ltp_ps.schedules.program import APPLY_AT_WORKERS

    return schedule_class(base_schedule(row)).apply_at == APPLY_AT_WORKERS


def unavailable(row: str) -> str | None:
    """Why ``ltp-ps`` cannot run ``row`` here (None: it can): the same checks the CLI makes before spawning."""
    import argparse

    from ltp_ps import schedule_cli

    args = argparse.Namespace(schedule=base_schedule(row), mode="async" if "async" in TRAIN_ARGS[row] else "bsp",
                              workers=ACC_WORKERS)
    try:
        if not schedule_cli.schedule_runs_without_ps(args):
            schedule_cli.check_server_schedule(args)
    except Exception as exc:  # ConfigError: not wired / not installed
        return f"{type(exc).__name__}: {exc}"
    return None


def _topology_file(lab, order, path: str) -> None:
    import dataclasses as dc

    from ltp_ps.schedules import Topology

    t = Topology.from_lab(lab)
    by_name = {h.name: h for h in t.hosts}
    t = dc.replace(t, hosts=tuple(by_name[lab.hosts[i].name] for i in order))
    with open(path, "w") as f:
        json.dump(t.to_json(), f)


def _read_rows(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    out = []
    with open(path) as f:
        for line in f:
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
    return out


@dataclasses.dataclass
class Job:
    """What one training job left: exit codes, metrics rows, the PS's summary, the error if it failed."""

    row: str
    transport: str
    exits: dict
    rows: list
    summary: dict
    error: str | None
    wall_s: float

    @property
    def iterations(self) -> list:
        return [r for r in self.rows if r.get("event") == "iteration"]

    @property
    def epochs(self) -> list:
        return [r for r in self.rows if r.get("event") == "epoch"]


def run_job(lab, row: str, *, workers: int, epochs: int, transport: str, workdir: str, seed: int = 1,
            extra: tuple = (), timeout_s: float = JOB_TIMEOUT_S, keep_logs: str | None = None) -> Job:
    """Train ``row`` once in ``lab`` (store + PS on host 0, worker r on host r + 1); returns the :class:`Job`.

    A failed job's logs are copied to ``keep_logs`` (``workdir`` is usually temporary) and the error names them.
    """
    from ltp_ps import rendezvous as rdv

    peer = runs_without_ps(row)
    hosts = lab.hosts
    if len(hosts) < workers + 1:
        raise ValueError(f"the lab has {len(hosts)} hosts; {row} with {workers} workers needs {workers + 1}")
    env = dict(os.environ, PYTHONUNBUFFERED="1", TORCH_CPP_LOG_LEVEL="ERROR")
    env[rdv.DEFAULT_SECRET_ENV] = secrets.token_hex(16)
    store = f"{hosts[0].addr}:{_free_port()}"
    tag = f"{row}-{transport}-{len(os.listdir(workdir))}"
    metrics, summary = os.path.join(workdir, f"{tag}-metrics.jsonl"), os.path.join(workdir, f"{tag}-summary.json")
    topo = os.path.join(workdir, f"{tag}-topology.json")
    _topology_file(lab, list(range(1, workers + 1)) if peer else list(range(workers + 1)), topo)
    py = [sys.executable, "-m", "ltp_ps.cli"]
    common = ["--workers", str(workers), "--model", "digits", "--epochs", str(epochs), "--transport", transport,
              "--topology", topo, "--seed", str(seed), "--store", store, "--store-timeout", str(STORE_TIMEOUT_S),
              *TRAIN_ARGS[row], *extra]
    procs, logs = [], []

    def spawn(h, argv, name):
        log = open(os.path.join(workdir, f"{tag}-{name}.log"), "w")
        logs.append(log)
        procs.append((name, lab.popen(h, argv, env=env, stdout=log, stderr=subprocess.STDOUT)))

    t0 = time.monotonic()
    error = None
    try:
        spawn(hosts[0], py + ["store", "--store", store], "store")
        if not peer:
            spawn(hosts[0], py + ["server", "--shard", "0", "--metrics", metrics, "--summary-json", summary,
                                  "--host", "0.0.0.0", "--advertise", hosts[0].addr] + common, "ps")
        for r in range(workers):
            argv = py + ["worker", "--rank", str(r), "--host", "0.0.0.0", "--advertise", hosts[r + 1].addr] + common
            if peer and r == 0:
                argv += ["--metrics", metrics, "--summary-json", summary]
            spawn(hosts[r + 1], argv, f"w{r}")
        jobs = [(n, p) for n, p in procs if n != "store"]
        failed_since = None
        while any(p.poll() is None for _, p in jobs):
            if time.monotonic() - t0 > timeout_s:
                raise C.ExperimentError(f"{row}/{transport}: not done within {timeout_s:.0f} s (logs in {workdir})")
            if failed_since is None and any(p.poll() not in (None, 0) for _, p in jobs):
                failed_since = time.monotonic()
            if failed_since is not None and time.monotonic() - failed_since > FAILED_JOB_GRACE_S:
                break
            time.sleep(POLL_S)
        bad = [(n, p.poll()) for n, p in jobs if p.poll() != 0]
        if bad:
            raise C.ExperimentError(f"{row}/{transport}: {', '.join(f'{n} exit {rc}' for n, rc in bad)} "
                                    f"(None: still running, stopped; logs in {workdir})")
    except C.ExperimentError as exc:
        error = str(exc)
    finally:
        for _, p in procs:
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        for log in logs:
            log.close()
    if error is not None and keep_logs:
        import shutil

        os.makedirs(keep_logs, exist_ok=True)
        for log in logs:
            shutil.copy(log.name, keep_logs)
        error = error.replace(f"logs in {workdir}", f"logs in {keep_logs}")
    s = {}
    if os.path.exists(summary):
        with open(summary) as f:
            s = json.load(f)
    return Job(row, transport, {n: p.poll() for n, p in procs}, _read_rows(metrics), s, error,
               time.monotonic() - t0)


def staleness_of(job: Job) -> list[int]:
    """Per applied gradient: the PS version at apply minus the version it was computed on (every aggregate member)."""
    out = []
    for r in job.iterations:
        if "staleness_all" in r:
            out += [int(s) for s in r["staleness_all"]]
        elif "staleness" in r:
            out.append(int(r["staleness"]))
    return out


def time_to(job: Job, acc: float) -> float | None:
    """Seconds from the first applied update to the first epoch end with accuracy >= ``acc`` (None: never)."""
    its = job.iterations
    if not its:
        return None
    t0 = its[0]["t"]
    for e in job.epochs:
        if e.get("accuracy") is not None and e["accuracy"] >= acc - 1e-9:
            return e["t"] - t0
    return None


def best(job: Job) -> float | None:
    return max((e["accuracy"] for e in job.epochs if e.get("accuracy") is not None), default=None)


def final(job: Job) -> float | None:
    acc = [e["accuracy"] for e in job.epochs if e.get("accuracy") is not None]
    return acc[-1] if acc else None


def spread(st: list[int]) -> dict:
    if not st:
        return {"staleness_std": None, "staleness_p10": None, "staleness_p90": None, "staleness_max": None}
    s = sorted(st)
    return {"staleness_std": statistics.pstdev(s), "staleness_p10": C.percentile(s, 10),
            "staleness_p90": C.percentile(s, 90), "staleness_max": s[-1]}


def _curve(job: Job) -> list:
    its = job.iterations
    t0 = its[0]["t"] if its else None
    return [[e.get("epoch"), e.get("accuracy"), None if t0 is None else e["t"] - t0] for e in job.epochs]


# -- MLfabric: time to accuracy under redrawn rates ------------------------------------------------------------------

def run_tta(*, rows=TTA_SCHEDULES, epochs: int | None = None, repeats: int | None = None, seed: int = 1,
            quick: bool = False, transport: str = "ltp", tau_max: int = 8, lr: float | None = None,
            redraw_period_s: float | None = None, batch_window_s: float | None = None,
            aggregators: int | None = None, out: str | None = None, progress: bool = True,
            verbose: bool = True) -> dict:
    """MLfabric vs async direct vs sync ring under N3 rates (see the module docstring); returns the results."""
    import random

    from ltp_tools.netlab import Lab

    for r in rows:
        if r not in TTA_SCHEDULES:
            raise ValueError(f"unknown row {r!r}; choose from {', '.join(TTA_SCHEDULES)}")
    C.require_lab()
    epochs = int(epochs or (QUICK_TTA_EPOCHS if quick else TTA_EPOCHS))
    repeats = int(repeats or (1 if quick else 3))
    period = float(redraw_period_s or (QUICK_REDRAW_PERIOD_S if quick else REDRAW_PERIOD_S))
    out = C.out_dir("schedules", out)
    out = os.path.join(out, "mlfabric-tta")
    os.makedirs(out, exist_ok=True)
    params = dict(experiment="mlfabric", rows=list(rows), workers=MLF_WORKERS, epochs=epochs, repeats=repeats,
                  seed=seed, quick=quick, transport=transport, tau_max=tau_max, lr=lr, redraw_period_s=period,
                  batch_window_s=batch_window_s, aggregators=aggregators,
                  profile_bps=[list(p) for p in N3_PROFILE_BPS], train_args={r: TRAIN_ARGS[r] for r in rows})
    runs = []
    order_rng = random.Random(seed)
    bar = C.progress(repeats * len(rows), "schedules mlfabric", disable=not progress)
    try:
        for rep in range(repeats):
            order = list(rows)
            order_rng.shuffle(order)
            jobs = {}
            with Lab(n_hosts=MLF_WORKERS + 1) as lab, tempfile.TemporaryDirectory(prefix="ltp-mlf-tta-") as work:
                for row in order:
                    rd = [lab.redraw_rates(lab.hosts, period, n3_draw, seed=seed * 1000 + rep * 10 + i,
                                           direction=d) for i, d in enumerate(("egress", "ingress"))]
                    extra = []
                    if row == "mlfabric":
                        extra += ["--tau-max", str(tau_max)]
                        if batch_window_s is not None:
                            extra += ["--batch-window", str(batch_window_s)]
                        if aggregators is not None:
                            extra += ["--aggregators", str(aggregators)]
                    if lr is not None and row != "ring":
                        extra += ["--lr", str(lr)]
                    try:
                        job = run_job(lab, row, workers=MLF_WORKERS, epochs=epochs, transport=transport,
                                      workdir=work, seed=seed + rep, extra=tuple(extra),
                                      keep_logs=os.path.join(out, "failed-logs"))
                    finally:
                        for r in rd:
                            r.stop()
                    job.summary["rate_draws"] = sum(len(r.history) for r in rd)
                    job.summary["redraw_errors"] = [e for r in rd for e in r.errors]
                    jobs[row] = job
                    bar.update(1)
                    if verbose and job.error:
                        print(f"[schedules mlfabric] {row}: {job.error}", file=sys.stderr, flush=True)
            runs += _tta_rows(jobs, rep, tau_max, transport)
    finally:
        bar.close()
    summary = _tta_summary(runs, list(rows))
    checks = _tta_checks(summary)
    res = dict(name="schedules", experiment="mlfabric", params=params, environment=C.environment(), runs=runs,
               summary=summary, checks=checks, command=_tta_command(params), out=out)
    C.write_json(os.path.join(out, "results.json"), res)
    C.write_csv(os.path.join(out, "runs.csv"), RUN_COLUMNS, runs)
    if verbose:
        print(format_tta(res), flush=True)
    return res


def _tta_rows(jobs: dict, rep: int, tau_max: int, transport: str) -> list[dict]:
    reached = [best(j) for j in jobs.values()]
    if all(b is not None and b >= TARGET_ACCURACY for b in reached):
        target, kind = TARGET_ACCURACY, "0.95"
    else:
        common = min((b for b in reached if b is not None), default=None)
        target, kind = common, "best common"
    out = []
    for row, j in jobs.items():
        st = staleness_of(j)
        out.append({"experiment": "mlfabric", "repeat": rep, "row": row, "transport": transport, "loss": 0.0,
                    "exit": j.error is None, "epochs_done": len(j.epochs), "final_accuracy": final(j),
                    "best_accuracy": best(j), "target": target, "target_kind": kind,
                    "time_to_target_s": time_to(j, target) if target is not None else None,
                    "updates": len(st), "beyond_tau": (sum(1 for s in st if s > tau_max) if row == "mlfabric"
                                                       else None),
                    **spread(st), "loadavg_1m": os.getloadavg()[0], "error": j.error, "wall_s": j.wall_s,
                    "rate_draws": j.summary.get("rate_draws"), "redraw_errors": j.summary.get("redraw_errors"),
                    "curve": _curve(j)})
    return out


def _tta_summary(runs: list[dict], rows: list[str]) -> list[dict]:
    out = []
    for row in rows:
        rs = [r for r in runs if r["row"] == row]
        t = [r["time_to_target_s"] for r in rs if r["time_to_target_s"] is not None and not r["error"]]
        std = [r["staleness_std"] for r in rs if r["staleness_std"] is not None]
        out.append({"row": row, "n": len(rs), "reached": len(t), "time_to_target_s": statistics.median(t) if t
                    else None, "targets": sorted({f"{r['target_kind']} {r['target']:.3f}" for r in rs
                                                  if r["target"] is not None}),
                    "best_accuracy": statistics.median([r["best_accuracy"] for r in rs
                                                        if r["best_accuracy"] is not None] or [float("nan")]),
                    "staleness_std": statistics.median(std) if std else None,
                    "staleness_max": max((r["staleness_max"] for r in rs if r["staleness_max"] is not None),
                                         default=None),
                    "beyond_tau": (sum(r["beyond_tau"] or 0 for r in rs) if row == "mlfabric" else None),
                    "loadavg_1m": statistics.median([r["loadavg_1m"] for r in rs]) if rs else None,
                    "failures": sum(1 for r in rs if r["error"])})
    return out


def _tta_checks(summary: list[dict]) -> list[dict]:
    by = {s["row"]: s for s in summary}
    out = []

    def add(target, value, limit, ok, note=""):
        out.append({"target": target, "value": value, "limit": limit, "passed": ok, "note": note})

    m = by.get("mlfabric", {})
    for other, limit in (("ring", TARGET_RING_RATIO), ("direct-async", TARGET_ASYNC_RATIO)):
        o = by.get(other, {})
        if m.get("time_to_target_s") and o.get("time_to_target_s"):
            v = m["time_to_target_s"] / o["time_to_target_s"]
            add(f"mlfabric / {other} time to target accuracy", v, limit, v <= limit)
    if m:
        add("mlfabric updates applied beyond tau_max", m.get("beyond_tau"), 0, m.get("beyond_tau") == 0)
    a = by.get("direct-async", {})
    if m.get("staleness_std") is not None and a.get("staleness_std"):
        v = m["staleness_std"] / a["staleness_std"]
        add("mlfabric / async direct staleness std", v, TARGET_SPREAD_RATIO, v <= TARGET_SPREAD_RATIO)
    return out


def _tta_command(p: dict) -> str:
    cmd = ["ltp-lab", "schedules", "--experiment", "mlfabric"]
    if p["quick"]:
        cmd.append("--quick")
    cmd += ["--epochs", str(p["epochs"]), "--repeats", str(p["repeats"]), "--seed", str(p["seed"]), "--transport",
            p["transport"], "--tau-max", str(p["tau_max"]), "--redraw-period", f"{p['redraw_period_s']:g}"]
    if p["lr"] is not None:
        cmd += ["--lr", f"{p['lr']:g}"]
    if p.get("batch_window_s") is not None:
        cmd += ["--batch-window", f"{p['batch_window_s']:g}"]
    if p.get("aggregators") is not None:
        cmd += ["--aggregators", str(p["aggregators"])]
    return " ".join(cmd)


def format_tta(res: dict) -> str:
    cols = ["row", "n", "reached", "time_to_target_s", "targets", "best_accuracy", "staleness_std", "staleness_max",
            "beyond_tau", "loadavg_1m", "failures"]
    rc = ["repeat", "row", "final_accuracy", "best_accuracy", "target", "time_to_target_s", "updates", "beyond_tau",
          "staleness_std", "staleness_p10", "staleness_p90", "staleness_max", "wall_s", "loadavg_1m"]
    return "\n".join(["== ltp-lab schedules --experiment mlfabric ==", res["command"], "",
                      C.format_table(rc, [[r.get(c) for c in rc] for r in res["runs"]]), "",
                      C.format_table(cols, [[s.get(c) for c in cols] for s in res["summary"]]), "",
                      _format_checks(res["checks"]), f"files: {res['out']}"])


def _format_checks(checks: list[dict]) -> str:
    return C.format_table(["target", "value", "limit", "passed"],
                          [[c["target"], c["value"], c["limit"], "PASS" if c["passed"] else "FAIL"] for c in checks])


# -- every schedule's accuracy over LTP and TCP, with and without loss ------------------------------------------------

def run_accuracy(*, rows=ACCURACY_SCHEDULES, transports=("ltp", "tcp"), losses=ACC_LOSSES, epochs: int | None = None,
                 seed: int = 1, quick: bool = False, out: str | None = None, progress: bool = True,
                 verbose: bool = True) -> dict:
    """Final accuracy of every runnable schedule x transport x loss, gap to direct/TCP/0 % (module docstring)."""
    import random

    from ltp_tools.netlab import Lab

    for r in rows:
        if r not in ACCURACY_SCHEDULES:
            raise ValueError(f"unknown row {r!r}; choose from {', '.join(ACCURACY_SCHEDULES)}")
    C.require_lab()
    epochs = int(epochs or (QUICK_ACC_EPOCHS if quick else ACC_EPOCHS))
    skipped = {r: why for r in rows if (why := unavailable(r)) is not None}
    runnable = [r for r in rows if r not in skipped]
    cells = [(r, t, l) for r in runnable for t in transports for l in losses]
    if ("direct", "tcp", 0.0) not in cells:
        cells.append(("direct", "tcp", 0.0))  # the reference every gap is measured against
    random.Random(seed).shuffle(cells)  # slow drifts of this shared machine's load hit no row systematically
    out = os.path.join(C.out_dir("schedules", out), "accuracy")
    os.makedirs(out, exist_ok=True)
    params = dict(experiment="accuracy", rows=list(rows), transports=list(transports), losses=list(losses),
                  workers=ACC_WORKERS, epochs=epochs, seed=seed, quick=quick,
                  train_args={r: TRAIN_ARGS[r] for r in runnable}, loss_at="every host's ingress")
    runs = []
    bar = C.progress(len(cells), "schedules accuracy", disable=not progress)
    try:
        with Lab(n_hosts=ACC_WORKERS + 1) as lab, tempfile.TemporaryDirectory(prefix="ltp-sched-acc-") as work:
            for row, transport, loss in cells:
                for h in lab.hosts:
                    lab.impair(h, direction="ingress", loss=loss)
                job = run_job(lab, row, workers=ACC_WORKERS, epochs=epochs, transport=transport, workdir=work,
                              seed=seed, keep_logs=os.path.join(out, "failed-logs"))
                st = staleness_of(job)
                runs.append({"experiment": "accuracy", "repeat": 0, "row": row, "transport": transport, "loss": loss,
                             "exit": job.error is None, "epochs_done": len(job.epochs), "final_accuracy": final(job),
                             "best_accuracy": best(job), "updates": len(st), **spread(st),
                             "loadavg_1m": os.getloadavg()[0], "error": job.error, "wall_s": job.wall_s,
                             "curve": _curve(job)})
                bar.update(1)
                if verbose and job.error:
                    print(f"[schedules accuracy] {row}/{transport}/{loss}: {job.error}", file=sys.stderr, flush=True)
    finally:
        bar.close()
    ref = next((r["final_accuracy"] for r in runs if (r["row"], r["transport"], r["loss"]) == ("direct", "tcp", 0.0)
                and not r["error"]), None)
    for r in runs:
        r["gap_points"] = (None if ref is None or r["final_accuracy"] is None
                           else 100.0 * (r["final_accuracy"] - ref))
    runs = order_runs(runs)
    checks = [{"target": f"{r['row']} {r['transport']} loss {r['loss']:g}: final accuracy - direct/tcp/0 (points)",
               "value": r["gap_points"], "limit": TARGET_ACC_GAP_POINTS,
               "passed": r["gap_points"] is not None and abs(r["gap_points"]) <= TARGET_ACC_GAP_POINTS,
               "note": r["error"] or ""} for r in runs]
    res = dict(name="schedules", experiment="accuracy", params=params, environment=C.environment(), runs=runs,
               reference_final_accuracy=ref, skipped=skipped, checks=checks, command=_acc_command(params), out=out)
    C.write_json(os.path.join(out, "results.json"), res)
    C.write_csv(os.path.join(out, "runs.csv"), RUN_COLUMNS, runs)
    if verbose:
        print(format_accuracy(res), flush=True)
    return res


def order_runs(runs: list[dict]) -> list[dict]:
    """Rows in :data:`ACCURACY_SCHEDULES` order (the reference ``direct`` included when not asked for), then
    transport and loss."""
    return sorted(runs, key=lambda r: (ACCURACY_SCHEDULES.index(r["row"]), r["transport"], r["loss"]))


def _acc_command(p: dict) -> str:
    cmd = ["ltp-lab", "schedules", "--experiment", "accuracy"]
    if p["quick"]:
        cmd.append("--quick")
    cmd += ["--schedules", ",".join(p["rows"]), "--epochs", str(p["epochs"]), "--seed", str(p["seed"]),
            "--losses", ",".join(f"{x:g}" for x in p["losses"]), "--transports", ",".join(p["transports"])]
    return " ".join(cmd)


def format_accuracy(res: dict) -> str:
    cols = ["row", "transport", "loss", "final_accuracy", "best_accuracy", "gap_points", "epochs_done", "wall_s",
            "loadavg_1m", "error"]
    lines = ["== ltp-lab schedules --experiment accuracy ==", res["command"], "",
             f"reference: direct over TCP without loss, final accuracy {res['reference_final_accuracy']}",
             C.format_table(cols, [[r.get(c) for c in cols] for r in res["runs"]])]
    for row, why in res["skipped"].items():
        lines.append(f"not run: {row}: {why}")
    lines += ["", _format_checks(res["checks"]), f"files: {res['out']}"]
    return "\n".join(lines)
