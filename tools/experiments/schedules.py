"""``ltp-lab schedules``: aggregation schedules measured in the lab, each beside the fluid simulator's prediction.

Theory of operation
    One two-rack :class:`~ltp_tools.netlab.Lab` (``racks=[3, 3]``) is built per repeat: every
    host's link limited to ``--rate`` (default 100 Mbit/s) in both directions and each rack's
    uplink to ``--uplink-rate`` (default = host rate), so this 2-core machine can drive it.
    Ranks are interleaved across racks (rank r on h0, h3, h1, h4, h2, h5), so a ring in rank
    order crosses the racks at every hop while a rack-aware ring crosses twice.

    Every job is the project's own processes, started in the namespaces the way
    ``ltp-ps launch`` does (one ``ltp-ps store``, then ``ltp-ps worker`` per rank, and for
    ``direct`` one ``ltp-ps server`` colocated with rank 0, since the racks have six hosts):
    a synthetic model of ``--model-bytes`` (default 4 MB; random gradients, no compute) for
    ``--rounds`` rounds.  The round time is the median gap between rank 0's (the PS's, for
    ``direct``) consecutive metrics rows after ``WARMUP_ROUNDS`` rounds: for rings it is the
    all-reduce time, for ``direct`` the batch synchronisation time (broadcast + gather).
    Schedules in one repeat run back to back in the same lab, in a seeded shuffled order.

    Rows (issue 9 §4, RSGCM):
      * ``ring`` (rank order), ``rsgcm`` and ``direct``: measured round time; targets
        ``rsgcm <= 0.5 x ring`` and ``rsgcm <= 0.5 x direct``;
      * ``rsgcm+block``: ``rsgcm`` again; once rank 0 has reported ``--block-at`` rounds and ran
        the same ring twice in a row (the eq 13 re-ranking settled; at most
        ``BLOCK_SETTLE_ROUNDS`` rounds later in any case) the orchestrator blocks (``Lab.block``) the first edge of the ring rank 0 just ran that does
        not touch rank 0 (the block drops all IPv4 between the two hosts, and the store, the
        workers' coordinator, lives on rank 0's host: blocking it cuts a worker off entirely,
        which the feedback correctly treats as a failed device).  The
        workers' live feedback (``ltp_ps.plan_feedback``) replans; the row reports the retries
        until a complete round (target <= 5), the median round before / after (target after <=
        1.3 x before) and the rounds lost (``--rounds`` minus rounds completed; target 0).
    Rows (issue 11, Hoplite; the PS alone on the first host, five workers on the other five, since a
    worker colocated with the PS would move its gradients over an unlimited loopback):
      * ``direct+async`` and ``hoplite+async`` (``--mode async --momentum 0``): throughput in
        gradients applied per second (the paper's Fig 8b metric, training steps per second), after
        the warm-up; ``direct+async`` runs ``ceil(n/2)`` x ``--rounds`` gradients so both apply as
        many; target ``hoplite+async >= 2 x direct+async``.  ``round_s_median`` is per applied
        update (one gradient for direct, ``ceil(n/2)`` for hoplite).
      * ``hoplite+stagger``: BSP Hoplite with rank r reporting its gradient ``r x STAGGER_S``
        after computing it (``LTP_HOPLITE_READY_STAGGER_S``); ``round_s_median`` is the median
        time from the last worker's arrival at the PS to the apply (the PS's ``gather_s``);
        target ``<= 1.5 S/B``.
    Rows (issue 11, RAT with ``K = 6`` PS shards colocated, shard k on worker k's host, as
    ``ltp-ps launch --num-servers 6 --colocate``; the round time is shard 0's metrics gaps):
      * ``rat6`` and ``direct6``: the same six shards, RAT's trees vs every worker sending each
        shard its slice; targets ``rat6 <= 0.5 x direct6`` and ``rat6 <= 1.0 x ring``.  ``rat6c4``
        is ``rat6`` with cut-through aggregators (``--rat-chunks 4``: each slice reduced in 4 pieces).
      * ``ring+pause`` and ``rat6+pause``: as ``ring`` / ``rat6`` while one worker's egress is
        throttled to ``PAUSE_BPS`` (1 Mbit/s), the throttled worker redrawn every
        ``PAUSE_PERIOD_S`` (2 s) from a seeded RNG (``fluid.RotatingPauses``, the object the
        prediction uses; RAT §4.1's "k paused nodes redrawn every d" with k = 1); target
        ``ring+pause >= 2 x rat6+pause``.  Their prediction is the median over
        ``PAUSE_SEEDS`` of the fluid round under the same pauses.
    Rows (issue 11, Hoplite in the issue's own setup): ``hoplite7`` and ``direct7`` run in a
    second, flat lab of ``FLAT_HOSTS`` (7) hosts built for them in the same repeat, every host at
    ``--rate`` and no racks, the PS alone on the first host and six workers on the others; target
    ``hoplite7 <= 0.4 x direct7`` (batch synchronisation: broadcast + reduce).  ``hoplite7+stagger`` is
    ``hoplite+stagger`` in that flat lab (six workers, the issue's setup; the racks row's hops cross the
    rack uplinks), and ``direct7+async`` / ``hoplite7+async`` are the async rows there (quota ceil(6/2) = 3).
    Every row carries the fluid simulator's prediction for the same topology
    (``Schedule.predict_s`` on ``Topology.from_lab``, hosts in rank order; ``rsgcm+block``
    after the block uses the topology with the pair failed) and the ratio measured/predicted;
    a ratio beyond 1.3 is flagged in the summary for the docs to explain.

    Files in ``--out``: ``results.json`` (parameters, environment, every run with its metrics
    rows, summary, checks), ``runs.csv``, ``summary.csv``, ``checks.csv`` and ``schedules.png``
    (measured vs predicted per schedule).  Exit status: 0 when every job ran (targets may be
    missed: they are reported, not hidden), 1 when a job failed.
"""
from __future__ import annotations

from ltp_tools.argtypes import number

import json
import os
import random
import secrets
import socket
import statistics
import subprocess
import sys
import tempfile
import time

from . import _common as C
from . import schedules_training as T

NAME = "schedules"
EXPERIMENTS = ("rsgcm", "mlfabric", "accuracy")  # --experiment: this module's rows, then schedules_training's
SCHEDULES = ("ring", "rsgcm", "direct", "rsgcm+block", "rat", "hoplite", "direct+async", "hoplite+async",
             "hoplite+stagger", "rat6", "rat6c4", "direct6", "ring+pause", "rat6+pause", "hoplite7", "direct7",
             "hoplite7+stagger", "direct7+async", "hoplite7+async")
FLAT_ROWS = {"hoplite7": "hoplite", "direct7": "direct",  # row -> schedule, in the flat lab of FLAT_HOSTS hosts
             "hoplite7+stagger": "hoplite", "direct7+async": "direct", "hoplite7+async": "hoplite"}
STAGGER_ROWS = ("hoplite+stagger", "hoplite7+stagger")  # workers' gradients ready STAGGER_S apart (rank r: r x it)
FLAT_HOSTS = 7  # issue 11's Hoplite setup: the PS on its own host and six workers, every host at --rate, no racks
ASYNC_ROWS = ("direct+async", "hoplite+async",  # issue 11: Hoplite's half-batch async PS vs async direct
              "direct7+async", "hoplite7+async")  # the same in the flat lab (the PS + 6 workers)
ASYNC_PAIRS = (("hoplite+async", "direct+async", "racks [3,3], the PS and five workers"),
               ("hoplite7+async", "direct7+async", "the issue's setup: 7 hosts, the PS on its own"))
PS_ALONE_ROWS = ASYNC_ROWS + STAGGER_ROWS + tuple(FLAT_ROWS)  # the PS alone on rank 0's host, workers on the other five (a
#                                                    colocated worker's loopback transfers are not rate limited)
STAGGER_S = 0.1  # seconds between workers' gradient arrivals in the hoplite+stagger row (rank r: r x this)
PS_SCHEDULES = ("direct", "rat", "hoplite")  # rows that run one `ltp-ps server` (colocated with rank 0)
COLOCATED_ROWS = {"rat6": "rat", "rat6c4": "rat", "direct6": "direct", "rat6+pause": "rat"}  # row -> schedule, K = 6
ROW_OPTIONS = {"rat6c4": {"chunks": 4}}  # schedule options of a row (rat6c4: cut-through, --rat-chunks 4)
PAUSE_ROWS = ("ring+pause", "rat6+pause")  # one worker's egress throttled, the worker redrawn every period
PAUSE_BPS = 1e6  # bit/s a paused worker still sends (issue 11: "egress throttled to 1 Mbit/s")
PAUSE_PERIOD_S = 2.0  # seconds between redraws of the paused worker (issue 11: "rotating every 2 s")
PAUSE_SEEDS = (1, 2, 3)  # seeds of the fluid prediction of a paused row (median)
RACKS = (3, 3)
INTERLEAVE = (0, 3, 1, 4, 2, 5)  # rank r runs on host INTERLEAVE[r]
WARMUP_ROUNDS = 2  # rounds left out of the median (endpoint set-up, RSGCM's first measurements)
MEASURE_POLL_S = 0.05  # seconds between looks at rank 0's metrics while waiting to block
JOB_TIMEOUT_S = 420.0  # seconds one job may take before it is killed and reported failed
BLOCK_SETTLE_ROUNDS = 4  # rounds past --block-at the block waits for rank 0 to run the same ring twice
FAILED_JOB_GRACE_S = 30.0  # seconds the other processes of a job get after one of them failed
FEEDBACK_PULL_TIMEOUT_S = 1.0  # seconds a ring step waits for its neighbour (how fast a blocked pair shows)
TARGET_RING_RATIO = 0.5
TARGET_DIRECT_RATIO = 0.5
TARGET_REPLAN_ROUNDS = 5
TARGET_AFTER_RATIO = 1.3
TARGET_RAT_DIRECT = 0.5  # issue 11: RAT <= 0.5 x direct
TARGET_RAT_RING = 1.0  # issue 11: RAT <= 1.0 x ring
TARGET_RING_OVER_RAT_PAUSED = 2.0  # issue 11: with a paused worker, ring >= 2 x RAT
TARGET_HOPLITE_DIRECT = 0.4  # issue 11: Hoplite BST <= 0.4 x direct
TARGET_HOPLITE_ASYNC = 2.0  # issue 11: async half-batch >= 2 x async direct (gradients applied per second)
TARGET_STAGGER_SB = 1.5  # issue 11: staggered reduce ends within the last arrival + 1.5 S/B
PREDICTION_TOLERANCE = 1.3  # measured / predicted beyond this (or below 1/this) needs an explanation

RUN_COLUMNS = ["repeat", "schedule", "transport", "rounds", "completed", "round_s_median", "predicted_s",
               "measured_over_predicted", "block_pair", "block_at", "block_in_place_after", "retries",
               "replanned_after_attempts", "before_s", "after_s", "after_over_before", "predicted_after_s",
               "rounds_lost", "grads_per_s", "updates_per_s", "reduce_after_last_s", "stagger_bound_s", "pauses",
               "loadavg_1m", "error"]
SUMMARY_COLUMNS = ["schedule", "n", "round_s_median", "round_s_min", "round_s_max", "predicted_s",
                   "measured_over_predicted", "grads_per_s", "loadavg_1m", "failures"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _topology(lab, order, failed=()):
    """``Topology.from_lab`` with hosts listed in rank order (worker r = host r) and ``failed`` host pairs."""
    import dataclasses

    from ltp_ps.schedules import Topology

    t = Topology.from_lab(lab)
    by_name = {h.name: h for h in t.hosts}
    hosts = tuple(by_name[lab.hosts[i].name] for i in order)
    fail = frozenset(frozenset(p) for p in failed) | t.failed
    return dataclasses.replace(t, hosts=hosts, failed=fail)


def predict(schedule: str, topo, n_workers: int, model_bytes: int) -> float | None:
    """The fluid simulator's round time for ``schedule`` on ``topo`` (one PS colocated with rank 0 for the
    PS schedules: direct, rat, hoplite)."""
    from ltp_ps.schedules import World, create
    from ltp_ps.schedules.program import server, worker

    n = max(1, int(model_bytes) // 4)
    names = topo.names
    if schedule in ASYNC_ROWS or schedule in STAGGER_ROWS:
        return _predict_hoplite_rows(schedule, topo, n_workers, model_bytes)
    if schedule in COLOCATED_ROWS or schedule in PAUSE_ROWS:
        return _predict_colocated_or_paused(schedule, topo, n_workers, model_bytes)
    if schedule in FLAT_ROWS:  # the PS alone on the first host, worker r on host r + 1
        placement = {server(0): names[0], **{worker(r): names[r + 1] for r in range(n_workers)}}
        w = World(workers=range(n_workers), n_elems=n, shards=((0, n),), topology=topo, placement=placement)
        return create(FLAT_ROWS[schedule], w).predict_s(int(model_bytes))
    if schedule in PS_SCHEDULES:
        placement = {server(0): names[0], **{worker(r): names[r] for r in range(n_workers)}}
        w = World(workers=range(n_workers), n_elems=n, shards=((0, n),), topology=topo, placement=placement)
    else:
        w = World(workers=range(n_workers), n_elems=n, topology=topo)
    return create(schedule.split("+")[0], w).predict_s(int(model_bytes))


def _world_of_row(schedule: str, topo, n_workers: int, model_bytes: int):
    """The ``World`` a colocated / paused row plans with (``K = n_workers`` shards colocated for ``rat6``)."""
    from ltp_ps.schedules import World
    from ltp_ps.schedules.program import server, worker
    from ltp_ps.sharding import ShardPlan

    n = max(1, int(model_bytes) // 4)
    names = topo.names
    base = base_schedule(schedule)
    if schedule in COLOCATED_ROWS:
        placement = {**{worker(r): names[r] for r in range(n_workers)},
                     **{server(k): names[k] for k in range(n_workers)}}
        w = World(workers=range(n_workers), n_elems=n, shards=tuple(ShardPlan(n, n_workers).ranges), topology=topo,
                  placement=placement)
    else:
        w = World(workers=range(n_workers), n_elems=n, topology=topo)
    return base, w


class _HostPauses:
    """``fluid.RotatingPauses`` over topology hosts, seen by the estimate's flows, which run between nodes
    (a host's pause throttles every node placed on it)."""

    def __init__(self, pauses, world):
        self._p, self._nodes = pauses, {}
        for node in world.server_nodes + world.worker_nodes:
            self._nodes.setdefault(world.host_of(node), []).append(node)
        self.rate_bps = pauses.rate_bps

    def paused(self, t):
        return frozenset(n for h in self._p.paused(t) for n in self._nodes.get(h, ()))

    def next_change(self, t):
        return self._p.next_change(t)


def rotating_pauses(topo, n_workers: int, seed: int):
    """The paused-worker rotation of the ``+pause`` rows: one of the workers' hosts at a time, ``PAUSE_BPS``."""
    from ltp_ps.schedules.fluid import RotatingPauses

    return RotatingPauses(list(topo.names[:n_workers]), 1, PAUSE_PERIOD_S, random.Random(seed), rate_bps=PAUSE_BPS)


def _predict_colocated_or_paused(schedule: str, topo, n_workers: int, model_bytes: int) -> float:
    from ltp_ps.schedules import create
    from ltp_ps.schedules.estimate import plan_flows
    from ltp_ps.schedules.fluid import FluidNetwork, simulate

    base, w = _world_of_row(schedule, topo, n_workers, model_bytes)
    sched = create(base, w, **ROW_OPTIONS.get(schedule, {}))
    if schedule not in PAUSE_ROWS:
        return sched.predict_s(int(model_bytes))
    net = FluidNetwork.from_topology(w.effective_topology())
    flows = plan_flows(sched.plan(0), w, int(model_bytes))
    return statistics.median(simulate(net, flows, pauses=_HostPauses(rotating_pauses(topo, n_workers, s), w))
                             .completion_s for s in PAUSE_SEEDS)


def stagger_bound_s(topo, model_bytes: int) -> float:
    """Issue 11's bound on a staggered row's reduce end after the last arrival: ``1.5 S/B``, B the slowest host."""
    return TARGET_STAGGER_SB * 8 * model_bytes / min(h.up_bps for h in topo.hosts)


def _predict_hoplite_rows(schedule: str, topo, n_workers: int, model_bytes: int) -> float:
    """Fluid predictions of the Hoplite rows (PS on rank 0's host; S = model bytes, B = the slowest host rate).

    ``direct+async``: seconds per applied gradient, the PS's link carrying one S down and one S up per gradient
    (full duplex): ``S/B``.  ``hoplite+async``: seconds per update of ``ceil(n/2)`` gradients, the update's
    pipelined reduce chain (``reduce_flows``) then its broadcast to those workers (``broadcast_flows``), not
    overlapped with the next update.  ``hoplite+stagger``: seconds from the last arrival (ranks ready
    ``STAGGER_S`` apart) to the end of the pipelined reduce."""
    from ltp_ps.schedules.fluid import FluidNetwork, simulate
    from ltp_ps.schedules.hoplite import broadcast_flows, reduce_flows
    from ltp_ps.schedules.hoplite_async import half_batch

    names = list(topo.names)
    workers = names[1:1 + n_workers]  # the PS alone on names[0] (PS_ALONE_ROWS)
    net = FluidNetwork.from_topology(topo)
    rate = min(h.up_bps for h in topo.hosts)
    if schedule in ASYNC_ROWS and base_schedule(schedule) == "direct":
        return 8 * model_bytes / rate
    if schedule in ASYNC_ROWS:
        m = workers[:half_batch(n_workers)]
        t_r = simulate(net, reduce_flows(m, names[0], model_bytes, bandwidth_bps=rate,
                                         latency_s=net.latency_s)).completion_s
        t_b = simulate(net, broadcast_flows(names[0], m, model_bytes)).completion_s
        return t_r + t_b
    ready = {w: STAGGER_S * i for i, w in enumerate(workers)}
    end = simulate(net, reduce_flows(workers, names[0], model_bytes, bandwidth_bps=rate, latency_s=net.latency_s,
                                     ready_s=ready)).completion_s
    return end - max(ready.values())


def base_schedule(schedule: str) -> str:
    """The ``--schedule`` a row runs (``rat6`` -> rat, ``hoplite7+async`` -> hoplite, ``ring+pause`` -> ring)."""
    return COLOCATED_ROWS.get(schedule) or FLAT_ROWS.get(schedule) or schedule.split("+")[0]


def _rows(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    out = []
    with open(path) as f:
        for line in f:
            try:
                d = json.loads(line)
            except ValueError:
                continue  # a line being written
            if d.get("event") == "iteration":
                out.append(d)
    return out


def _gaps(rows: list[dict]) -> list[float]:
    ts = [r["t"] for r in rows]
    return [b - a for a, b in zip(ts, ts[1:])]


def run_job(lab, schedule: str, *, order, topo_path: str, model_bytes: int, rounds: int, transport: str = "ltp",
            block_at: int | None = None, seed: int = 1, workdir: str, timeout_s: float = JOB_TIMEOUT_S,
            pauses=None, rate_bps: float = 0.0) -> dict:
    """One job of ``schedule`` in ``lab``; returns its metrics rows and, with ``block_at``, the pair blocked.

    ``pauses`` (an object with ``paused(t)`` -> host names, t = seconds since the processes started):
    those workers' egress is throttled to ``PAUSE_BPS`` and set back to ``rate_bps`` (0: unlimited)
    when they leave the set and at the end."""
    from ltp_ps import rendezvous as rdv

    base = base_schedule(schedule)
    shards = len(order) if schedule in COLOCATED_ROWS else 1  # K = 6 colocated: shard k on worker k's host
    env = dict(os.environ, PYTHONUNBUFFERED="1", TORCH_CPP_LOG_LEVEL="ERROR")
    env[rdv.DEFAULT_SECRET_ENV] = secrets.token_hex(16)
    hosts = [lab.hosts[i] for i in order]
    w_hosts = hosts[1:] if schedule in PS_ALONE_ROWS else hosts  # worker r runs on w_hosts[r]
    n = len(w_hosts)
    store = f"{hosts[0].addr}:{_free_port()}"
    py = [sys.executable, "-m", "ltp_ps.cli"]
    metrics = os.path.join(workdir, f"{schedule}-metrics.jsonl")
    if os.path.exists(metrics):
        os.unlink(metrics)
    pull = FEEDBACK_PULL_TIMEOUT_S if block_at is not None else 30.0
    if schedule in ASYNC_ROWS and base == "direct":  # as many gradients as hoplite's `rounds` updates of ceil(n/2)
        from ltp_ps.schedules.hoplite_async import half_batch

        rounds = rounds * half_batch(n)
    common = ["--workers", str(n), "--model", f"synthetic:{max(1, model_bytes // 4)}", "--iterations", str(rounds),
              "--schedule", base, "--transport", transport, "--topology", topo_path, "--seed", str(seed)]
    if schedule in ASYNC_ROWS:
        common += ["--mode", "async", "--momentum", "0"]
    if shards > 1:
        common += ["--num-servers", str(shards), "--colocate"]
    for opt, value in ROW_OPTIONS.get(schedule, {}).items():
        common += [f"--rat-{opt}", str(value)]
    if schedule in STAGGER_ROWS:
        from ltp_ps.hoplite_roles import READY_STAGGER_ENV

        env[READY_STAGGER_ENV] = str(STAGGER_S)
    procs, logs = [], []

    def spawn(h, argv, name):
        log = open(os.path.join(workdir, f"{schedule}-{name}.log"), "w")
        logs.append(log)
        p = lab.popen(h, argv, env=env, stdout=log, stderr=subprocess.STDOUT)
        procs.append((name, p))
        return p

    res = {"rows": [], "block_pair": None, "error": None}
    try:
        spawn(hosts[0], py + ["store", "--store", store], "store")
        if base in PS_SCHEDULES:
            for k in range(shards):  # shard 0 writes `metrics`, shard k > 0 metrics.shard<k>.jsonl beside it
                h = hosts[0] if shards == 1 else w_hosts[k]
                spawn(h, py + ["server", "--shard", str(k), "--store", store, "--metrics", metrics, "--host",
                               "0.0.0.0", "--advertise", h.addr] + common, "ps" if shards == 1 else f"ps{k}")
        for r in range(n):
            argv = py + ["worker", "--rank", str(r), "--store", store, "--pull-timeout", str(pull), "--host",
                         "0.0.0.0", "--advertise", w_hosts[r].addr] + common
            if base not in PS_SCHEDULES and r == 0:
                argv += ["--metrics", metrics]
            spawn(w_hosts[r], argv, f"w{r}")
        t_end = time.monotonic() + timeout_s
        jobs = [p for name, p in procs if name != "store"]
        failed_since = None
        if pauses is not None:
            t_pause0, throttled = time.monotonic(), frozenset()
            res["pauses"] = []
        while any(p.poll() is None for p in jobs):
            if pauses is not None:  # the rotating throttle: one worker's egress at PAUSE_BPS at a time
                now_paused = frozenset(pauses.paused(time.monotonic() - t_pause0))
                if now_paused != throttled:
                    by_name = {h.name: h for h in w_hosts}
                    for name in throttled - now_paused:
                        lab.impair(by_name[name], direction="egress", rate_bps=rate_bps or None)
                    for name in now_paused - throttled:
                        lab.impair(by_name[name], direction="egress", rate_bps=PAUSE_BPS)
                    throttled = now_paused
                    res["pauses"].append([round(time.monotonic() - t_pause0, 3), sorted(now_paused)])
            if time.monotonic() > t_end:
                raise C.ExperimentError(f"{schedule}: not done within {timeout_s:.0f} s (logs in {workdir})")
            if failed_since is None and any(p.poll() not in (None, 0) for p in jobs):
                failed_since = time.monotonic()
            if failed_since is not None and time.monotonic() - failed_since > FAILED_JOB_GRACE_S:
                break  # one process failed and the rest are stuck waiting for it: reported below
            if block_at is not None and res["block_pair"] is None:
                rows = _rows(metrics)
                rings = [r.get("plan", {}).get("rings") for r in rows[-2:]]
                settled = len(rings) == 2 and rings[0] == rings[1]  # the re-ranking stopped rotating candidates
                if len(rows) >= block_at and rings[-1] and (settled or len(rows) >= block_at + BLOCK_SETTLE_ROUNDS):
                    ring = rows[-1]["plan"]["rings"][0]
                    # the first edge of the ring rank 0 just ran that spares rank 0: the block drops every IPv4
                    # packet between the two hosts, and the rendezvous store lives on rank 0's host
                    edges = [tuple(sorted((ring[i], ring[(i + 1) % len(ring)]))) for i in range(len(ring))]
                    a, b = next(e for e in edges if 0 not in e)
                    lab.block(hosts[a], hosts[b])
                    res["block_pair"] = [a, b]
                    res["block_t"] = time.time()
                    res["block_after_iteration"] = rows[-1]["iteration"]
                    # rounds rank 0 finished while the rules went in: the round after the last of them may
                    # have crossed the pair before the block; every later round started behind it
                    done = _rows(metrics)
                    res["block_in_place_after"] = done[-1]["iteration"] if done else rows[-1]["iteration"]
            time.sleep(MEASURE_POLL_S)
        bad = [(name, p.poll()) for name, p in procs if name != "store" and p.poll() != 0]
        if bad:
            for log in logs:
                log.flush()
            why = "; ".join(f"{nm}: {_last_line(os.path.join(workdir, f'{schedule}-{nm}.log'))}"
                            for nm, rc in bad if rc is not None)
            raise C.ExperimentError(f"{schedule}: {', '.join(f'{nm} exit {rc}' for nm, rc in bad)} "
                                    f"(None: still running, stopped) "
                                    f"(logs in {workdir}, deleted with the lab; last lines: {why})")
        res["rows"] = _rows(metrics)
    except C.ExperimentError as exc:
        res["error"] = str(exc)
        res["rows"] = _rows(metrics)
    finally:
        for name, p in procs:
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        for log in logs:
            log.close()
        if res["block_pair"] is not None:
            a, b = res["block_pair"]
            lab.unblock(hosts[a], hosts[b])
        if pauses is not None:  # the next job starts on unthrottled links
            for h in w_hosts:
                lab.impair(h, direction="egress", rate_bps=rate_bps or None)
    return res


def _last_line(path: str) -> str:
    """The last non-empty line of a log (the error a failed process printed), or ''."""
    from ltp_tools.bench import last_line

    try:
        with open(path, errors="replace") as f:
            return last_line(f.read()[-4000:])[:300]
    except OSError:
        return ""


def _summarise_job(schedule: str, job: dict, rounds: int) -> dict:
    rows = job["rows"]
    gaps = _gaps(rows)
    row = {"schedule": schedule, "rounds": rounds, "completed": len(rows), "error": job["error"]}
    if schedule in ASYNC_ROWS:  # throughput: gradients applied per second after the warm-up updates
        skip = WARMUP_ROUNDS * (3 if base_schedule(schedule) == "direct" else 1)
        after = rows[skip:]
        if len(after) >= 2 and after[-1]["t"] > after[0]["t"]:
            grads = sum(r.get("contributors", 1) for r in after[1:])
            row["grads_per_s"] = grads / (after[-1]["t"] - after[0]["t"])
            row["updates_per_s"] = (len(after) - 1) / (after[-1]["t"] - after[0]["t"])
    if schedule in STAGGER_ROWS:  # from the last worker's arrival at the PS to the apply
        g = [r["gather_s"] for r in rows[WARMUP_ROUNDS:] if r.get("gather_s") is not None]
        row["reduce_after_last_s"] = row["round_s_median"] = statistics.median(g) if g else None
        return row  # its prediction is the same quantity
    if job.get("block_pair") is None:
        g = gaps[WARMUP_ROUNDS - 1:] if len(gaps) >= WARMUP_ROUNDS else gaps
        row["round_s_median"] = statistics.median(g) if g else None
        return row
    k = job["block_after_iteration"]  # the last row rank 0 had written when the pair was blocked
    before = [g for i, g in enumerate(gaps) if WARMUP_ROUNDS - 1 <= i < k]
    hit = next((r for r in rows if r["iteration"] > k and r.get("attempts", 1) > 1), None)
    after_from = (hit["iteration"] if hit else k + 1) + 1
    after = [gaps[i - 1] for i in range(after_from + 1, len(rows)) if i - 1 < len(gaps)]
    row.update(block_pair=f"{job['block_pair'][0]}-{job['block_pair'][1]}", block_at=k + 1,
               retries=sum(r.get("attempts", 1) - 1 for r in rows),
               replanned_after_attempts=(hit.get("attempts") if hit else None),
               block_in_place_after=job.get("block_in_place_after", k),
               before_s=statistics.median(before) if before else None,
               after_s=statistics.median(after) if after else None, rounds_lost=rounds - len(rows))
    row["round_s_median"] = row["before_s"]
    if row["before_s"] and row["after_s"]:
        row["after_over_before"] = row["after_s"] / row["before_s"]
    return row


def run(*, schedules=SCHEDULES, model_bytes: int | None = None, rounds: int | None = None, rate_bps: float = 100e6,
        uplink_bps: float | None = None, block_at: int | None = None, transport: str = "ltp",
        repeats: int | None = None, seed: int = 1, quick: bool = False, out: str | None = None,
        progress: bool = True, verbose: bool = True, fluid: bool = True) -> dict:
    """Run the lab rows and write their files; returns the results dict (see the module docstring).

    ``quick`` is the CI profile: a 1 MB model, 6 rounds (10 with the block at round 4), 1 repeat.
    """
    from ltp_tools.netlab import Lab

    for s in schedules:
        if s not in SCHEDULES:
            raise ValueError(f"unknown schedule row {s!r}; choose from {', '.join(SCHEDULES)}")
    C.require_lab()
    model_bytes = int(model_bytes or (1_000_000 if quick else 4_000_000))
    rounds = int(rounds or (6 if quick else 12))
    block_at = int(block_at or (4 if quick else 5))
    block_rounds = max(rounds, block_at + BLOCK_SETTLE_ROUNDS + 4)
    repeats = repeats or (1 if quick else 3)
    uplink_bps = uplink_bps or rate_bps
    out = C.out_dir(NAME, out)
    rng = random.Random(seed)
    params = dict(schedules=list(schedules), model_bytes=model_bytes, rounds=rounds, block_at=block_at,
                  block_rounds=block_rounds, rate_bps=rate_bps, uplink_bps=uplink_bps, transport=transport,
                  repeats=repeats, seed=seed, quick=quick, racks=list(RACKS), interleave=list(INTERLEAVE))
    runs, predictions, prefixes = [], {}, []
    bar = C.progress(repeats * len(schedules), NAME, disable=not progress)
    try:
        for rep in range(repeats):
            order = list(schedules)
            rng.shuffle(order)
            flat = [s for s in order if s in FLAT_ROWS]
            order = [s for s in order if s not in FLAT_ROWS]
            if flat:
                with Lab(n_hosts=FLAT_HOSTS) as lab, tempfile.TemporaryDirectory(prefix="ltp-sched-") as work:
                    prefixes.append(lab.prefix)
                    _run_flat_rows(lab, flat, work, rep=rep, runs=runs, predictions=predictions, bar=bar,
                                   model_bytes=model_bytes, rounds=rounds, rate_bps=rate_bps, transport=transport,
                                   seed=seed, verbose=verbose)
            if not order:
                continue
            with Lab(racks=list(RACKS)) as lab, tempfile.TemporaryDirectory(prefix="ltp-sched-") as work:
                prefixes.append(lab.prefix)
                if rate_bps > 0:  # 0: unlimited veths (the CPU floor of the same jobs)
                    for h in lab.hosts:
                        lab.impair(h, direction="both", rate_bps=rate_bps)
                    for r in range(len(RACKS)):
                        lab.uplink(r, rate_bps=uplink_bps)
                topo = _topology(lab, INTERLEAVE)
                topo_path = os.path.join(work, "topology.json")
                with open(topo_path, "w") as f:
                    json.dump(topo.to_json(), f)
                for s in order:
                    if s not in predictions:
                        predictions[s] = predict(s, topo, len(INTERLEAVE) - (s in PS_ALONE_ROWS), model_bytes)
                    n_rounds = block_rounds if s == "rsgcm+block" else rounds
                    pz = rotating_pauses(topo, len(INTERLEAVE), seed + rep) if s in PAUSE_ROWS else None
                    job = run_job(lab, s, order=INTERLEAVE, topo_path=topo_path, model_bytes=model_bytes,
                                  rounds=n_rounds, transport=transport,
                                  block_at=block_at if s == "rsgcm+block" else None, seed=seed + rep, workdir=work,
                                  pauses=pz, rate_bps=rate_bps)
                    row = _summarise_job(s, job, n_rounds)
                    row.update(repeat=rep, transport=transport, predicted_s=predictions[s],
                               loadavg_1m=os.getloadavg()[0])  # this shared machine's load: CPU-bound rows
                    if s in STAGGER_ROWS:
                        row["stagger_bound_s"] = stagger_bound_s(topo, model_bytes)
                    if job.get("block_pair") is not None:
                        a, b = job["block_pair"]
                        names = topo.names
                        row["predicted_after_s"] = predict(s, _topology(lab, INTERLEAVE, [(names[a], names[b])]),
                                                           len(INTERLEAVE), model_bytes)
                    if row.get("round_s_median") and row["predicted_s"]:
                        row["measured_over_predicted"] = row["round_s_median"] / row["predicted_s"]
                    row["metrics"] = job["rows"]
                    if job.get("pauses") is not None:
                        row["pauses"] = len(job["pauses"])  # throttle changes applied during the job
                        row["pause_log"] = job["pauses"]
                    runs.append(row)
                    bar.update(1)
                    if verbose and row["error"]:
                        print(f"[{NAME}] {s}: {row['error']}", file=sys.stderr, flush=True)
    finally:
        bar.close()
    summary = summarise(runs, list(schedules))
    checks = check(summary, runs)
    res = dict(name=NAME, params=params, environment=C.environment(), runs=runs, summary=summary, checks=checks,
               command=command_line(params), lab_prefixes=prefixes,
               fluid_only=fluid_only_rows() if fluid else None)
    C.write_json(os.path.join(out, "results.json"), res)
    C.write_csv(os.path.join(out, "runs.csv"), RUN_COLUMNS, runs)
    C.write_csv(os.path.join(out, "summary.csv"), SUMMARY_COLUMNS, summary)
    C.write_csv(os.path.join(out, "checks.csv"), ["target", "value", "limit", "passed", "note"], checks)
    _plot(summary, out)
    res["out"] = out
    if verbose:
        print(format_report(res), flush=True)
    return res


def _run_flat_rows(lab, rows, work, *, rep, runs, predictions, bar, model_bytes, rounds, rate_bps, transport, seed,
                   verbose) -> None:
    """The ``FLAT_ROWS`` jobs of one repeat in the flat lab: every host at ``rate_bps``, the PS on ``h0``."""
    if rate_bps > 0:
        for h in lab.hosts:
            lab.impair(h, direction="both", rate_bps=rate_bps)
    order = tuple(range(FLAT_HOSTS))
    topo = _topology(lab, order)
    topo_path = os.path.join(work, "topology.json")
    with open(topo_path, "w") as f:
        json.dump(topo.to_json(), f)
    for s in rows:
        if s not in predictions:
            predictions[s] = predict(s, topo, FLAT_HOSTS - 1, model_bytes)
        job = run_job(lab, s, order=order, topo_path=topo_path, model_bytes=model_bytes, rounds=rounds,
                      transport=transport, seed=seed + rep, workdir=work, rate_bps=rate_bps)
        row = _summarise_job(s, job, rounds)
        row.update(repeat=rep, transport=transport, predicted_s=predictions[s], loadavg_1m=os.getloadavg()[0])
        if s in STAGGER_ROWS:
            row["stagger_bound_s"] = stagger_bound_s(topo, model_bytes)
        if row.get("round_s_median") and row["predicted_s"]:
            row["measured_over_predicted"] = row["round_s_median"] / row["predicted_s"]
        row["metrics"] = job["rows"]
        runs.append(row)
        bar.update(1)
        if verbose and row["error"]:
            print(f"[{NAME}] {s}: {row['error']}", file=sys.stderr, flush=True)


def fluid_only_rows() -> list[dict]:
    """Issue 11's RAT and Hoplite lab rows as the fluid simulator predicts them (``schedules_fluid.lab_predictions``).

    The same setups are measured by the ``rat6``/``rat6c4``/``direct6``/``+pause`` and Hoplite rows; this list
    is the model's view of the issue's exact setups (PS on its own host for Hoplite) beside them.
    """
    from . import schedules_fluid as F

    p = F.lab_predictions()
    rat, hop = p["rat_lab"], p["hoplite_lab"]
    return [
        {"row": "RAT / direct (racks [3,3], 50 Mbit/s uplinks, K=6)", "predicted": rat["rat_over_direct"],
         "target": "<= 0.5"},
        {"row": "RAT / ring", "predicted": rat["rat_over_ring"], "target": "<= 1.0"},
        {"row": "ring / RAT, one worker paused (1 Mbit/s, rotating 2 s)", "predicted": rat["ring_over_rat_paused"],
         "target": ">= 2"},
        {"row": "Hoplite BST / direct (PS + 6 workers, 4 MB)", "predicted": hop["hoplite_over_direct"],
         "target": "<= 0.4"},
        {"row": "Hoplite staggered reduce end (s) vs last arrival + 1.5 S/B",
         "predicted": hop["staggered_reduce_end_s"], "target": f"<= {hop['staggered_bound_s']:.3g}"},
    ]


def summarise(runs: list[dict], schedules: list[str]) -> list[dict]:
    out = []
    for s in schedules:
        rs = [r for r in runs if r["schedule"] == s]
        vals = [r["round_s_median"] for r in rs if r.get("round_s_median") and not r["error"]]
        pred = rs[0]["predicted_s"] if rs else None
        med = statistics.median(vals) if vals else None
        row = {"schedule": s, "n": len(vals), "round_s_median": med, "round_s_min": min(vals) if vals else None,
               "round_s_max": max(vals) if vals else None, "predicted_s": pred,
               "measured_over_predicted": med / pred if med and pred else None,
               "loadavg_1m": statistics.median([r["loadavg_1m"] for r in rs]) if rs else None,
               "failures": sum(1 for r in rs if r["error"])}
        for k in ("grads_per_s", "updates_per_s", "reduce_after_last_s"):
            v = [r[k] for r in rs if r.get(k) is not None and not r["error"]]
            if v:
                row[k] = statistics.median(v)
        if s == "rsgcm+block":
            for k in ("after_s", "after_over_before", "replanned_after_attempts", "rounds_lost", "predicted_after_s"):
                v = [r[k] for r in rs if r.get(k) is not None]
                row[k] = statistics.median(v) if v else None
            row["rounds_lost_max"] = max((r["rounds_lost"] for r in rs if r.get("rounds_lost") is not None),
                                         default=None)
        out.append(row)
    return out


def check(summary: list[dict], runs: list[dict]) -> list[dict]:
    """The issue's targets, each with its value and pass/fail (None: not measured)."""
    by = {r["schedule"]: r for r in summary}
    m = lambda s: (by.get(s) or {}).get("round_s_median")  # noqa: E731
    out = []

    def add(target, value, limit, ok, note=""):
        out.append({"target": target, "value": value, "limit": limit, "passed": ok, "note": note})

    if m("rsgcm") and m("ring"):
        v = m("rsgcm") / m("ring")
        add("rsgcm / ring all-reduce time", v, TARGET_RING_RATIO, v <= TARGET_RING_RATIO)
    if m("rsgcm") and m("direct"):
        v = m("rsgcm") / m("direct")
        add("rsgcm all-reduce / direct BST", v, TARGET_DIRECT_RATIO, v <= TARGET_DIRECT_RATIO)
    if m("rat") and m("direct"):
        v = m("rat") / m("direct")
        add("rat round / direct BST (issue 11)", v, TARGET_RAT_DIRECT, v <= TARGET_RAT_DIRECT,
            "one PS shard colocated with rank 0, not K = 6")
    if m("rat") and m("ring"):
        v = m("rat") / m("ring")
        add("rat round / ring all-reduce (issue 11)", v, TARGET_RAT_RING, v <= TARGET_RAT_RING)
    if m("hoplite") and m("direct"):
        v = m("hoplite") / m("direct")
        add("hoplite round / direct BST (issue 11)", v, TARGET_HOPLITE_DIRECT, v <= TARGET_HOPLITE_DIRECT)
    if m("hoplite7") and m("direct7"):
        v = m("hoplite7") / m("direct7")
        add("hoplite round / direct BST, PS + 6 workers, flat (issue 11)", v, TARGET_HOPLITE_DIRECT,
            v <= TARGET_HOPLITE_DIRECT, f"the issue's setup: {FLAT_HOSTS} hosts, the PS on its own")
    if m("rat6") and m("direct6"):
        v = m("rat6") / m("direct6")
        add("rat round / direct BST, K = 6 colocated shards (issue 11)", v, TARGET_RAT_DIRECT,
            v <= TARGET_RAT_DIRECT, "shard k on worker k's host, --num-servers 6 --colocate")
    if m("rat6c4") and m("direct6"):
        v = m("rat6c4") / m("direct6")
        add("rat round, cut-through (4 pieces), / direct BST, K = 6 colocated (issue 11)", v, TARGET_RAT_DIRECT,
            v <= TARGET_RAT_DIRECT, "--rat-chunks 4")
    if m("rat6") and m("ring"):
        v = m("rat6") / m("ring")
        add("rat round (K = 6 colocated) / ring all-reduce (issue 11)", v, TARGET_RAT_RING, v <= TARGET_RAT_RING)
    if m("ring+pause") and m("rat6+pause"):
        v = m("ring+pause") / m("rat6+pause")
        add("ring / rat (K = 6) with one worker paused (issue 11)", v, TARGET_RING_OVER_RAT_PAUSED,
            v >= TARGET_RING_OVER_RAT_PAUSED,
            f"egress {PAUSE_BPS / 1e6:g} Mbit/s, redrawn every {PAUSE_PERIOD_S:g} s")
    g = lambda s: (by.get(s) or {}).get("grads_per_s")  # noqa: E731
    for hop, direct, where in ASYNC_PAIRS:
        if g(hop) and g(direct):
            v = g(hop) / g(direct)
            flat = ", flat" if hop in FLAT_ROWS else ""
            add(f"hoplite async half-batch / async direct{flat}, gradients applied per second (issue 11)", v,
                TARGET_HOPLITE_ASYNC, v >= TARGET_HOPLITE_ASYNC,
                f"the paper's metric: training steps per second; {where}")
    for row_name, where in (("hoplite+stagger", "racks [3,3], the PS and five workers"),
                            ("hoplite7+stagger", f"the issue's setup: {FLAT_HOSTS} hosts, the PS on its own")):
        st = by.get(row_name) or {}
        p = next((r for r in runs if r["schedule"] == row_name), {})
        bound = p.get("stagger_bound_s")
        if st.get("reduce_after_last_s") is not None and bound:
            v = st["reduce_after_last_s"]
            flat = ", flat" if row_name in FLAT_ROWS else ""
            add(f"hoplite staggered arrivals{flat}: reduce end after the last arrival (s) (issue 11)", v, bound,
                v <= bound, f"{TARGET_STAGGER_SB} S/B; arrivals {STAGGER_S:g} s apart; {where}")
    b = by.get("rsgcm+block")
    if b and b["n"]:
        att = b.get("replanned_after_attempts")
        add("attempts until a complete round after the block", att, TARGET_REPLAN_ROUNDS,
            att is not None and att <= TARGET_REPLAN_ROUNDS, "1 = the failed attempt's retry completed")
        ab = b.get("after_over_before")
        add("time after / before the block", ab, TARGET_AFTER_RATIO, ab is not None and ab <= TARGET_AFTER_RATIO)
        add("rounds lost (max over repeats)", b.get("rounds_lost_max"), 0, b.get("rounds_lost_max") == 0)
    for s in summary:
        r = s.get("measured_over_predicted")
        if r is not None:
            add(f"{s['schedule']}: measured / fluid prediction", r, PREDICTION_TOLERANCE,
                1 / PREDICTION_TOLERANCE <= r <= PREDICTION_TOLERANCE, "outside: explained in docs/experiments.md")
    return out


def command_line(params: dict) -> str:
    cmd = ["ltp-lab", NAME]
    if params["quick"]:
        cmd.append("--quick")
    cmd += ["--schedules", ",".join(params["schedules"]), "--model-bytes", str(params["model_bytes"]),
            "--rounds", str(params["rounds"]), "--block-at", str(params["block_at"]), "--rate",
            f"{params['rate_bps']:g}", "--uplink-rate", f"{params['uplink_bps']:g}", "--transport",
            params["transport"], "--repeats", str(params["repeats"]), "--seed", str(params["seed"])]
    return " ".join(cmd)


def _plot(summary: list[dict], out: str) -> None:
    plt = C.pyplot()
    if plt is None:
        return
    names = [s["schedule"] for s in summary]
    meas = [s["round_s_median"] or 0.0 for s in summary]
    pred = [s["predicted_s"] or 0.0 for s in summary]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    x = range(len(names))
    ax.bar([i - 0.2 for i in x], meas, 0.4, label="measured (median)")
    ax.bar([i + 0.2 for i in x], pred, 0.4, label="fluid prediction")
    ax.set_xticks(list(x), names)
    ax.set_ylabel("round time (s)")
    ax.set_title("racks [3,3], ranks interleaved")
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(out, "schedules.png"), dpi=120)
    plt.close(fig)


def format_report(res: dict) -> str:
    cols = SUMMARY_COLUMNS
    lines = [f"== ltp-lab {NAME} ==", res["command"], "",
             C.format_table(cols, [[s.get(c) for c in cols] for s in res["summary"]])]
    blk = [r for r in res["runs"] if r.get("block_pair")]
    if blk:
        bc = ["repeat", "block_pair", "block_at", "replanned_after_attempts", "before_s", "after_s",
              "after_over_before", "predicted_after_s", "rounds_lost"]
        lines += ["", C.format_table(bc, [[r.get(c) for c in bc] for r in blk])]
    if res.get("fluid_only"):
        lines += ["", "not measured in the lab (fluid prediction only):",
                  C.format_table(["row", "predicted", "target"],
                                 [[r["row"], r["predicted"], r["target"]] for r in res["fluid_only"]])]
    lines += ["", C.format_table(["target", "value", "limit", "passed"],
                                 [[c["target"], c["value"], c["limit"], "PASS" if c["passed"] else "FAIL"]
                                  for c in res["checks"]]),
              f"files: {res.get('out', '')}"]
    return "\n".join(lines)


def register(subparsers) -> None:
    """Add ``ltp-lab schedules``."""
    p = subparsers.add_parser(NAME, help="aggregation schedules in the lab vs the fluid simulator (issues 9, 11)",
                              description=__doc__.split("\n\n")[0])
    p.add_argument("--experiment", choices=EXPERIMENTS, default="rsgcm",
                   help="rsgcm: round times of ring/rsgcm/direct (+ a blocked pair); mlfabric: time to accuracy of "
                        "mlfabric vs async direct vs ring under redrawn N3 rates; accuracy: every schedule over LTP "
                        "and TCP at 0 and 1 %% loss (issue 9 §4; module docstrings of schedules*.py)")
    p.add_argument("--schedules", default=None,
                   help=f"comma list of rows (rsgcm: {','.join(SCHEDULES)}; mlfabric: {','.join(T.TTA_SCHEDULES)}; "
                        f"accuracy: {','.join(T.ACCURACY_SCHEDULES)}; default all)")
    p.add_argument("--epochs", type=number(int, 1, what="epochs per job"), default=None,
                   help=f"mlfabric/accuracy: training epochs (default {T.TTA_EPOCHS}/{T.ACC_EPOCHS}; --quick "
                        f"{T.QUICK_TTA_EPOCHS}/{T.QUICK_ACC_EPOCHS})")
    p.add_argument("--tau-max", type=int, default=8, help="mlfabric: the delay bound of the mlfabric row (default 8)")
    p.add_argument("--lr", type=float, default=None,
                   help="mlfabric: learning rate of the two asynchronous rows (default ltp-ps's 0.1)")
    p.add_argument("--redraw-period", type=float, default=None,
                   help=f"mlfabric: seconds between rate redraws (default {T.REDRAW_PERIOD_S:g}; --quick "
                        f"{T.QUICK_REDRAW_PERIOD_S:g})")
    p.add_argument("--batch-window", type=float, default=None,
                   help="mlfabric: the mlfabric row's --batch-window (default ltp-ps's 0.1 s)")
    p.add_argument("--aggregators", type=int, default=None,
                   help="mlfabric: the mlfabric row's --aggregators (default ltp-ps's 1)")
    p.add_argument("--losses", default=",".join(f"{x:g}" for x in T.ACC_LOSSES),
                   help="accuracy: comma list of loss rates at every host's ingress (default 0,0.01)")
    p.add_argument("--transports", default="ltp,tcp", help="accuracy: comma list of transports (default ltp,tcp)")
    p.add_argument("--model-bytes", type=int, default=None, help="model size (default 4000000; --quick 1000000)")
    p.add_argument("--rounds", type=number(int, 1, what="rounds per job"), default=None, help="rounds per job (default 12; --quick 6)")
    p.add_argument("--block-at", type=int, default=None, help="rsgcm+block: block after this many rounds")
    p.add_argument("--rate", type=float, default=100e6,
                   help="host link rate, bit/s (default 100e6; 0 = unlimited: the jobs' CPU floor)")
    p.add_argument("--uplink-rate", type=float, default=None, help="rack uplink rate, bit/s (default: --rate)")
    p.add_argument("--transport", default="ltp", choices=("ltp", "tcp"))
    p.add_argument("--no-fluid", action="store_true", help="skip the fluid-only RAT/Hoplite lab predictions")
    C.add_common_args(p)
    p.set_defaults(func=_cli)


def _cli(args) -> int:
    rows = C.parse_list(args.schedules, str) if args.schedules else None
    if args.experiment == "mlfabric":
        res = T.run_tta(rows=rows or T.TTA_SCHEDULES, epochs=args.epochs, repeats=args.repeats, seed=args.seed,
                        quick=args.quick, transport=args.transport, tau_max=args.tau_max, lr=args.lr,
                        redraw_period_s=args.redraw_period, batch_window_s=args.batch_window,
                        aggregators=args.aggregators, out=args.out, progress=not args.no_progress)
        return 1 if any(r["error"] for r in res["runs"]) else 0
    if args.experiment == "accuracy":
        res = T.run_accuracy(rows=rows or T.ACCURACY_SCHEDULES, transports=C.parse_list(args.transports, str),
                             losses=C.parse_list(args.losses, float), epochs=args.epochs, seed=args.seed,
                             quick=args.quick, out=args.out, progress=not args.no_progress)
        return 1 if any(r["error"] for r in res["runs"]) else 0
    res = run(schedules=rows or SCHEDULES, model_bytes=args.model_bytes, rounds=args.rounds,
              rate_bps=args.rate, uplink_bps=args.uplink_rate, block_at=args.block_at, transport=args.transport,
              repeats=args.repeats, seed=args.seed, quick=args.quick, out=args.out, progress=not args.no_progress,
              fluid=not args.no_fluid)
    return 1 if any(r["error"] for r in res["runs"]) else 0
