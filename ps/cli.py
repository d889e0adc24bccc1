"""``ltp-ps``: run a PS shard, a worker, or a whole local job.

    ltp-ps launch --workers 4 --epochs 10 --model digits [--lab auto|on|off --loss 0.01]
    ltp-ps server --store HOST:PORT --store-master --workers 4 --model digits
    ltp-ps worker --store HOST:PORT --rank 0 --workers 4 --model digits

Every process needs the same job secret (``$LTP_PS_SECRET`` or
``--secret-file``); ``launch`` makes one up for its children if none is set.
Under torchrun use ``python -m ltp_ps.run`` (see ``ltp_ps/run.py``).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import signal
import socket
import subprocess
import sys
import time

from . import rendezvous as rdv
from . import schedule_cli, tree_views
from .argtypes import bounded, model_name
from .errors import ConfigError, PSError, TrainingFailed
from .metrics import write_summary_json

EXIT_CONFIG = 2  # setup, rendezvous or transport error (the message names the fix)
EXIT_TRAINING_FAILED = 3  # no live worker, no usable gradient, non-finite loss


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", type=model_name, default="digits", help="digits | resnet50 | vgg16 | synthetic:<n> (default digits)")
    p.add_argument("--workers", type=int, default=4, help="number of workers in the job (default 4)")
    p.add_argument("--transport", choices=("auto", "ltp", "tcp"), default="auto",
                   help="gradient/parameter transport (auto: ltp when ltp.open_endpoint exists, else tcp)")
    p.add_argument("--cc", default="cubic", help="TCP congestion control for --transport tcp: cubic|bbr|reno")
    p.add_argument("--link-rate", type=_link_rate, default=None,
                   help="this host's link rate, e.g. 1gbit or 10gbit (LTP only; default unknown): a PS grants each "
                        "worker an equal share of it, so N workers' gradients do not overflow its switch queue, "
                        "and every process splits it among its own sends (ltp/link_share.py)")
    p.add_argument("--inbound-rate", type=_link_rate, default=None,
                   help="this host's inbound link rate where only that side is limited (LTP only): grants as "
                        "--link-rate, sends not split; launch --lab gives it to every PS when --rate is set")
    p.add_argument("--store", default=None, help="HOST:PORT of the TCPStore (default: $MASTER_ADDR:$MASTER_PORT)")
    p.add_argument("--job", default="default", help="job name (store key prefix), lets jobs share a store")
    p.add_argument("--secret-file", default=None, help="file with the job secret (default: $LTP_PS_SECRET)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind the transport to")
    p.add_argument("--advertise", default=None, help="address peers should dial (default: --host)")
    p.add_argument("--num-servers", type=int, default=1, help="PS shards (contiguous ranges of the model)")
    p.add_argument("--colocate", action="store_true",
                   help="shard k shares worker k's host (launch: the same lab namespace; every role: the schedule "
                        "plans with that placement, so RAT roots tree k at worker k's host); K <= --workers, "
                        "--schedule direct or rat")
    p.add_argument("--mode", choices=("bsp", "async"), default="bsp")
    p.add_argument("--compute-delay", type=bounded(float, 0.0, "extra compute seconds per step"), default=0.0, help="extra seconds of compute per step (any model)")
    p.add_argument("--batch-size", type=bounded(int, 1, "samples per worker step"), default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--store-timeout", type=bounded(float, 0.0, "the rendezvous wait in seconds", strict=True),
                   default=120.0, help="seconds to wait for the rendezvous")
    schedule_cli.add_options(p)


def _server_opts(p):
    p.add_argument("--epochs", type=bounded(int, 1, "the number of epochs", "a run of none trains nothing"), default=10)
    p.add_argument("--iterations", type=bounded(int, 1, "the number of rounds", "a run of none trains nothing"), default=None,
                   help="total rounds (overrides --epochs)")
    p.add_argument("--aggregation", choices=("unbiased", "zero_fill"), default="unbiased")
    p.add_argument("--optimizer", choices=("sgd", "adam"), default="sgd")
    p.add_argument("--lr", type=bounded(float, 0.0, "the learning rate"), default=0.1)
    p.add_argument("--momentum", type=bounded(float, 0.0, "SGD momentum", "1 or more never forgets a gradient and "
                                              "diverges", below=1.0), default=None,
                   help="SGD momentum (default 0.9 for BSP rounds; 0 for asynchronous updates, --mode async or "
                        "--schedule mlfabric, whose staleness already acts as momentum: docs/ps.md)")
    p.add_argument("--weight-decay", type=bounded(float, 0.0, "L2 weight decay"), default=0.0)
    p.add_argument("--clip-factor", type=bounded(float, 0.0, "the norm guard's factor (0: off)"), default=2.0,
                   help="divergence guard: clip the aggregated gradient's norm to this x its running mean (0: off)")
    p.add_argument("--gather-timeout", type=bounded(float, 0.0, "the gather timeout in seconds", strict=True),
                   default=None,
                   help="seconds before a gather gives up on a worker (default: derived each round from the "
                        "message size, the workers' compute time and the measured link rate; docs/ps.md)")
    p.add_argument("--broadcast-timeout", type=bounded(float, 0.0, "the broadcast timeout in seconds", strict=True),
                   default=None,
                   help="seconds a reliable parameter broadcast may take before the worker is dropped (default: "
                        "derived each round from the message size and the measured link rate, at least 10 s)")
    p.add_argument("--max-missed", type=bounded(int, 1, "missed rounds before a drop"), default=3, help="missed rounds before a worker is dropped")
    p.add_argument("--max-returns", type=bounded(int, 0, "times a worker declared dead may come back",
                                                 below=tree_views.RETURNS_LIMIT + 1),
                   default=tree_views.MAX_RETURNS,
                   help="tree schedules (rat): times a worker declared dead while alive (paused, cut off, a "
                        f"straggler) may come back into the trees (0: never; default {tree_views.MAX_RETURNS})")
    p.add_argument("--min-workers", type=bounded(int, 1, "the workers a BSP start waits for"), default=None, help="start when this many joined (default: all)")
    p.add_argument("--checkpoint-dir", default=None)
    p.add_argument("--checkpoint-every", type=bounded(int, 0, "rounds between checkpoints"), default=0, help="rounds between checkpoints (0: at the end)")
    p.add_argument("--metrics", default=None,
                   help="JSONL file for per-iteration metrics (shard s > 0 of a PS writes NAME.shard<s>.jsonl beside it)")
    p.add_argument("--progress", action="store_true", help="tqdm progress bar on stderr")
    p.add_argument("--summary-json", default=None,
                   help="write the final summary here (shard 0's, which holds the test accuracy of a sharded "
                        "model; shard s > 0 writes NAME.shard<s>.json beside it)")


def _worker_opts(p):
    p.add_argument("--error-feedback", action="store_true", help="re-send gradient the PS did not receive")
    p.add_argument("--pull-timeout", type=bounded(float, 0.0, "seconds a worker waits for the PS", "a worker "
                                                   "that waits for nothing is dropped at once", strict=True),
                   default=60.0)
    p.add_argument("--rejoin", type=bounded(int, 0, "times a worker rejoins"), default=1, help="times to rejoin after losing the PS's broadcasts")
    p.add_argument("--max-iterations", type=bounded(int, 1, "pushes before a drilled worker exits"), default=None, help="exit after N pushes (failure drills)")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="ltp-ps", description="Parameter server over LTP or TCP")
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("server", help="run one PS shard")
    _common(s)
    _server_opts(s)
    s.add_argument("--shard", type=int, default=0)
    s.add_argument("--store-master", action="store_true", help="host the TCPStore in this process")
    w = sub.add_parser("worker", help="run one worker")
    _common(w)
    _worker_opts(w)
    w.add_argument("--rank", type=int, default=None, help="worker rank (default: $RANK - num_servers)")
    _server_opts(w)  # PS-less schedules (ring): every worker runs the optimizer
    schedule_cli.build_plan_parser(sub)
    st = sub.add_parser("store", help="host the rendezvous TCPStore (outlives PS restarts)")
    st.add_argument("--store", default=None, help="HOST:PORT to serve on (default: $MASTER_ADDR:$MASTER_PORT)")
    st.add_argument("--store-timeout", type=float, default=120.0)
    la = sub.add_parser("launch", help="1 PS + N workers on this machine (optionally in a network lab)")
    _common(la)
    _server_opts(la)
    _worker_opts(la)
    la.add_argument("--lab", choices=("auto", "on", "off"), default="auto",
                    help="network namespaces with impairments (auto: when root and supported)")
    la.add_argument("--loss", type=_loss_rate, default=0.0,
                    help="lab: ingress loss rate at the PS (at every worker for ring/rsgcm, which have none), a fraction in [0, 1) or a percentage such as 1%% "
                         "(needs the lab: root + its packages; an error otherwise)")
    la.add_argument("--rate", type=_lab_rate, default=None,
                    help="lab: PS ingress rate (every worker's for ring/rsgcm): bit/s, or with a unit such as 1gbit, 100mbit (needs the lab)")
    la.add_argument("--delay", type=_lab_delay, default=0.0,
                    help="lab: one-way delay at the PS's ingress (every worker's for ring/rsgcm): seconds, or with a unit such as 20ms (needs the lab)")
    la.add_argument("--lab-gro", action="store_true",
                    help="lab: receive GRO on every host's interface, as a real NIC's driver does (loss then sits "
                         "on the switch side, before the rate limit; see ltp_tools.netlab.lab)")
    la.add_argument("--ps-restarts", type=bounded(int, 0, "PS restarts"), default=0,
                    help="restart a PS that dies up to N times; it resumes from --checkpoint-dir (default 0)")
    la.add_argument("--kill-worker-after", type=bounded(int, 1, "iterations before the drilled worker exits"),
                    default=None,
                    help="failure drill: worker 0 exits after this many iterations")
    return ap


def _store_addr(args) -> tuple[str, int]:
    if args.store:
        host, _, port = args.store.rpartition(":")
        return host or "127.0.0.1", int(port)
    try:
        return os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    except KeyError:
        raise ConfigError("no rendezvous store: pass --store HOST:PORT or set MASTER_ADDR/MASTER_PORT") from None


def _workload(args):
    from .workloads import get_workload

    return get_workload(args.model, compute_delay_s=args.compute_delay, batch_size=args.batch_size, seed=args.seed)


async def _open_transport(args, secret):
    from .transport import open_transport

    return await open_transport(args.transport, args.host, 0, cc=args.cc if args.transport == "tcp" else None,
                                job_key=secret, advertise_host=args.advertise,
                                link_rate_bps=args.link_rate if args.link_rate is not None else args.inbound_rate,
                                inbound_only=args.link_rate is None and args.inbound_rate is not None)


async def serve(args, store=None) -> dict:
    from .server import ParameterServer, ServerConfig, summary_text
    from .sharding import ShardPlan

    schedule_cli.check_server_schedule(args)
    secret = rdv.load_secret(args.secret_file)
    wl = _workload(args)
    if store is None:
        host, port = _store_addr(args)
        store = rdv.make_store(host, port, is_master=getattr(args, "store_master", False),
                               timeout_s=args.store_timeout)
    store = rdv.prefixed(store, args.job)
    plan = ShardPlan(wl.n_params, args.num_servers)
    lo, hi = plan.ranges[args.shard]
    transport = await _open_transport(args, secret)
    try:
        info = rdv.ServerInfo(shard=args.shard, num_servers=args.num_servers, addr=transport.local_addr, lo=lo, hi=hi,
                              n_params=wl.n_params, dtype="float32", world_size=args.workers,
                              transport=args.transport, mode=args.mode, nonce=rdv.new_nonce())
        rv = rdv.ServerRendezvous(store, secret, info)
        cfg = ServerConfig(world_size=args.workers, epochs=args.epochs, iterations=args.iterations, mode=args.mode,
                           aggregation=args.aggregation, optimizer=args.optimizer, lr=args.lr,
                           momentum=schedule_cli.momentum_for(args), weight_decay=args.weight_decay, clip_factor=args.clip_factor,
                           gather_timeout_s=args.gather_timeout, broadcast_timeout_s=args.broadcast_timeout,
                           max_missed=args.max_missed, max_returns=args.max_returns,
                           min_workers=args.min_workers, join_timeout_s=args.store_timeout,
                           checkpoint_dir=args.checkpoint_dir, checkpoint_every=args.checkpoint_every,
                           metrics_path=args.metrics and shard_path(args.metrics, args.shard), progress=args.progress,
                           seed=args.seed)
        ps = ParameterServer(wl, transport, cfg, plan=plan, shard=args.shard, rendezvous=rv,
                             planner=schedule_cli.server_planner(args, wl, plan, args.shard))
        ps.tree_board = schedule_cli.tree_board(args, store, secret, ps.log)
        print(f"[ps{args.shard}] listening on {transport.local_addr} ({args.transport}"
              f"{'/' + args.cc if args.transport == 'tcp' else ''}), model {args.model} "
              f"({wl.n_params} params, shard {lo}:{hi}), waiting for {args.workers} workers", flush=True)
        try:
            summary = await ps.run()
        except PSError as exc:
            store.set(f"failed/{args.shard}", str(exc))
            raise
        print(summary_text(ps, summary), flush=True)
        if args.summary_json:
            write_summary_json(shard_path(args.summary_json, args.shard), summary)
        store.set(f"done/{args.shard}", "1")
        return summary
    finally:
        await transport.close()


def shard_path(path: str, shard: int) -> str:
    """Where shard ``shard`` writes ``--summary-json`` / ``--metrics``: the path itself for shard 0, else
    ``<stem>.shard<s><ext>`` beside it (K shards of one launch share the options)."""
    if shard == 0:
        return path
    stem, ext = os.path.splitext(path)
    return f"{stem}.shard{shard}{ext or '.json'}"


PS_WATCH_S = 0.5  # seconds between a worker's looks at the store for a restarted PS or the job's end
JOB_OVER_GRACE_S = 3.0  # seconds a worker still waits for its STOP once the store says the job is over


async def work(args, store=None) -> dict:
    """Join every shard, train until STOP; rejoin a restarted PS (new incarnation) whenever one appears.

    A PS that restarts publishes a new nonce under ``server/<s>``.  The worker watches
    for it while it trains, so it rejoins at once on any transport; a lost PS (closed
    connection, no parameters within ``--pull-timeout``) makes it wait for the next
    incarnation up to ``--store-timeout``.  Being dropped by a live PS is retried
    ``--rejoin`` times.
    """
    from .errors import Excluded, JobEnded, StaleIncarnation, TransportError
    from .worker import ShardRef, Worker, WorkerConfig

    secret = rdv.load_secret(args.secret_file)
    wl = _workload(args)
    rank = args.rank
    if rank is None:
        rank = int(os.environ.get("RANK", "0")) - args.num_servers
    if store is None:
        host, port = _store_addr(args)
        store = rdv.make_store(host, port, is_master=False, timeout_s=args.store_timeout)
    if schedule_cli.schedule_runs_without_ps(args):  # ring: no PS; peers reduce among themselves
        args.rank = rank
        return await schedule_cli.peer_work(args, store, lambda: _open_transport(args, secret), wl)
    store = rdv.prefixed(store, args.job)
    transport = await _open_transport(args, secret)
    stats = {"iterations": 0}
    try:
        # before any join: a worker the PS counts as joined can always be found by its peers
        await asyncio.to_thread(schedule_cli.publish_address, args, store, secret, rank, transport)
        attempts = 0
        joined: list | None = None  # nonces of the incarnations joined last time
        while True:
            first = await asyncio.to_thread(rdv.fetch_server, store, secret, 0, timeout_s=args.store_timeout)
            infos = [first] + [await asyncio.to_thread(rdv.fetch_server, store, secret, s, timeout_s=args.store_timeout)
                               for s in range(1, first.num_servers)]
            tickets = {}
            try:
                for info in infos:
                    tickets[info.shard] = await asyncio.to_thread(
                        rdv.join, store, secret, info, rank=rank, addr=transport.local_addr, n_params=wl.n_params,
                        dtype="float32", world_size=args.workers, transport=args.transport,
                        timeout_s=args.store_timeout)
            except StaleIncarnation as exc:
                print(f"[worker {rank}] {exc}; joining the new one", flush=True)
                continue
            except JobEnded as exc:
                return _finished_without(stats, store, len(infos), rank, exc)
            nonces = [i.nonce for i in infos]
            if joined is not None and nonces != joined:
                attempts = 0  # a restarted PS is not this worker's fault
            joined = nonces
            shards = [ShardRef(i.shard, i.addr, i.lo, i.hi) for i in infos]
            w = Worker(wl, transport, shards, WorkerConfig(rank=rank, world_size=args.workers,
                                                            error_feedback=args.error_feedback,
                                                            pull_timeout_s=args.pull_timeout, seed=args.seed,
                                                            max_iterations=args.max_iterations,
                                                            max_missed=args.max_missed,
                                                            max_returns=args.max_returns))
            w.join_tickets = tickets
            rounds = [await asyncio.to_thread(rdv.admitted_round, store, s, t) for s, t in tickets.items()]
            # a round program names each round's transfers: one that joins (again) mid-job starts where the
            # shards are (the earliest, so no shard's round is skipped), not at round 0 of rounds long over
            w.start_round = min((r for r in rounds if r is not None), default=0)
            await schedule_cli.prepare_worker(w, args, store, secret, rank, transport, wl, infos)
            # tree schedules agree on dead workers through their own board (a worker in a view asks to come back;
            # Excluded once it has come back --max-returns times)
            drops = None if w.tree_board is not None and getattr(w.planner, "name", None) == "rat" else {
                i.shard: await asyncio.to_thread(rdv.drop_count, store, i.shard, rank) for i in infos}
            try:
                st = await _run_watching(w, store, infos, rank=rank, drops=drops)
            except Excluded as exc:
                # the job goes on without this worker, which came back --max-returns times already: its verdict is the
                # job's, so wait for the job to end and exit with it, whichever transport told this worker first
                print(f"[worker {rank}] {exc}; waiting for the job's verdict", flush=True)
                await _await_job_over(store, len(infos))
                return _finished_without(stats, store, len(infos), rank, "excluded", excluded=True)
            except (TransportError, ConnectionError) as exc:
                if await asyncio.to_thread(rdv.job_over, store, len(infos)):
                    return _finished_without(stats, store, len(infos), rank, exc)
                restarted = await asyncio.to_thread(rdv.wait_new_incarnation, store, infos, PS_WATCH_S, 0.0)
                if not restarted:
                    attempts += 1
                    if attempts > args.rejoin:
                        print(f"[worker {rank}] lost the PS ({type(exc).__name__}: {exc}); waiting up to "
                              f"{args.store_timeout:.0f} s for a restarted PS", flush=True)
                        outcome = await _await_restart_or_end(store, infos, args.store_timeout)
                        if outcome == "over":  # the PS lives and finished without us: its verdict, not a hang
                            return _finished_without(stats, store, len(infos), rank, exc)
                        if outcome is None:
                            raise
                print(f"[worker {rank}] lost the PS's broadcasts ({exc}); rejoining", flush=True)
                continue
            if st is None:
                print(f"[worker {rank}] the PS restarted; rejoining", flush=True)
                continue
            stats["iterations"] += st["iterations"]
            stats.update({k: v for k, v in st.items() if k != "iterations"})
            _raise_if_failed(store, len(infos))
            return stats
    finally:
        await transport.close()


def _finished_without(stats: dict, store, num_servers: int, rank: int, why, **extra) -> dict:
    """The end of a worker whose job ended (or goes on) without it: the job's verdict (raises if a shard failed),
    else ``stats`` marked stopped and dropped, so the worker exits 0."""
    _raise_if_failed(store, num_servers)
    print(f"[worker {rank}] the job finished without this worker ({why})", flush=True)
    stats.update(stopped=True, dropped=True, **extra)
    return stats


async def _await_restart_or_end(store, infos, timeout_s: float) -> str | None:
    """Wait up to ``timeout_s`` for a restarted PS (``"restarted"``) or the job's end (``"over"``: shard 0 finished
    or a shard failed); None when neither came.  A worker dropped past its ``--rejoin`` budget by a PS that is alive
    waits here: it must leave when that PS's job ends, not sit out ``--store-timeout`` (the launch fails a worker
    still running 30 s after its PS)."""
    deadline = time.monotonic() + timeout_s
    while True:
        if await asyncio.to_thread(rdv.wait_new_incarnation, store, infos, PS_WATCH_S, 0.0):
            return "restarted"
        if await _job_over_or_gone(store, len(infos)):
            return "over"
        if time.monotonic() >= deadline:
            return None
        await asyncio.sleep(PS_WATCH_S)


async def _await_job_over(store, num_servers: int) -> None:
    """Return once shard 0 finished or a shard failed, or once the store is gone (its PS's exit code then
    carries the verdict, as in :func:`_raise_if_failed`)."""
    while not await _job_over_or_gone(store, num_servers):
        await asyncio.sleep(PS_WATCH_S)


async def _job_over_or_gone(store, num_servers: int) -> bool:
    """Shard 0 finished, a shard failed, or the store is gone (it went away with the job)."""
    try:
        return await asyncio.to_thread(rdv.job_over, store, num_servers)
    except (RuntimeError, OSError):  # DistNetworkError is a RuntimeError
        return True


def _raise_if_failed(store, num_servers: int) -> None:
    """A worker told to stop by a PS that failed must not exit 0.

    A failing PS writes ``failed/<s>`` before it sends STOP.  Where the store lived inside
    that PS (``--store-master``, manual set-ups) it may be gone by the time the worker
    asks: the worker then says it could not confirm the verdict and exits as told; the
    job's verdict is the PS's exit code (``launch`` and torchrun keep the store alive
    elsewhere, so there the check always answers).
    """
    for s in range(num_servers):
        try:
            failed = store.check([f"failed/{s}"])
            reason = store.get(f"failed/{s}").decode() if failed else ""
        except (RuntimeError, OSError) as exc:  # DistNetworkError is a RuntimeError
            print(f"warning: could not confirm PS shard {s}'s verdict, the store is gone "
                  f"({type(exc).__name__}); its exit code is the job's verdict", file=sys.stderr, flush=True)
            continue
        if failed:
            raise TrainingFailed(f"PS shard {s} stopped the job: {reason}")


async def _run_watching(worker, store, infos, *, rank: int | None = None, drops: dict | None = None) -> dict | None:
    """``worker.run()``, cancelled (returning None) as soon as any shard publishes a new incarnation.

    Also ended when the job is over (shard 0 finished or a shard failed) while the worker still waits: a worker
    the PS dropped while it was stopped (SIGSTOP, a hung host) gets no STOP and would otherwise wait out
    ``--pull-timeout`` after the job ended.  It raises :class:`TransportError` after ``JOB_OVER_GRACE_S``, which
    the caller reports as "the job finished without this worker".  With ``drops`` (shard -> the drop count the
    worker saw when it joined, :func:`rendezvous.drop_count`), a shard posting that it dropped this worker ends the
    run at once with :class:`TransportError`, so the caller rejoins (``--rejoin``) without waiting out
    ``--pull-timeout``."""
    from .errors import TransportError

    run = asyncio.ensure_future(worker.run())
    stop = asyncio.Event()

    async def watch():
        while not stop.is_set():
            if await asyncio.to_thread(rdv.wait_new_incarnation, store, infos, PS_WATCH_S, 0.0):
                return "restarted"
            if await asyncio.to_thread(rdv.job_over, store, len(infos)):
                return "over"
            for shard, seen in (drops or {}).items():
                if await asyncio.to_thread(rdv.drop_count, store, shard, rank) > seen:
                    return f"dropped by PS shard {shard}"
            try:
                await asyncio.wait_for(stop.wait(), PS_WATCH_S)
            except asyncio.TimeoutError:
                pass
        return None

    watcher = asyncio.ensure_future(watch())
    try:
        done, _ = await asyncio.wait({run, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if run in done:
            return run.result()
        why = watcher.result()
        if why is None:
            return await run
        if why == "over":
            done, _ = await asyncio.wait({run}, timeout=JOB_OVER_GRACE_S)  # a live worker's STOP is on its way
            if run in done:
                return run.result()
        run.cancel()
        await asyncio.gather(run, return_exceptions=True)
        if why == "restarted":
            return None
        if why == "over":
            raise TransportError(f"the job ended (PS shard 0 finished or a shard failed) while this worker was "
                                 f"still waiting; nothing came for {JOB_OVER_GRACE_S:g} s more")
        # a shard dropped this worker (it missed --max-missed rounds: stopped, cut off)
        raise TransportError(f"{why} (missed rounds while stopped or cut off)")
    finally:
        stop.set()
        run.cancel()
        await asyncio.gather(watcher, return_exceptions=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _passthrough(args, names) -> list[str]:
    out = []
    for n in dict.fromkeys(names):  # a name in two lists is passed once
        v = getattr(args, n.replace("-", "_"))
        if v is None or v is False:
            continue
        out += [f"--{n}"] if v is True else [f"--{n}", str(v)]
    return out


def _loss_rate(text: str) -> float:
    """``--loss``: ``0.01`` or ``1%``; refuses values outside [0, 1) with the fix in the message."""
    t = str(text).strip()
    try:
        v = float(t[:-1]) / 100 if t.endswith("%") else float(t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad loss rate {text!r}; use a fraction such as 0.01 or a percentage such as 1%")
    if not 0.0 <= v < 1.0:
        raise argparse.ArgumentTypeError(f"loss rate {text!r} is outside [0, 1); use e.g. 0.01 (1 %)")
    return v


def _lab_rate(text: str) -> float:
    """``--rate``: a bare number is bit/s (as before); ``1gbit``/``100mbit``/``500k`` carry their unit."""
    from ltp_tools.bench import parse_rate
    try:
        v = float(text)
    except ValueError:
        v = parse_rate(text)
        if v is None:
            raise argparse.ArgumentTypeError(f"--rate {text!r}: leave --rate out for an unlimited link")
    if v <= 0:
        raise argparse.ArgumentTypeError(f"--rate must be positive (got {text!r}); leave it out for an unlimited link")
    return v


def _link_rate(text: str) -> float:
    """``--link-rate``: ``1gbit``/``100mbit`` or a bare number of bit/s."""
    try:
        return _lab_rate(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"--link-rate {text!r}: give the host's link rate, e.g. 1gbit or 10gbit, "
                                         "or leave it out when it is unknown") from None


def _lab_delay(text: str) -> float:
    """``--delay``: a bare number is seconds (as before); ``20ms``/``500us``/``0.02s`` carry their unit."""
    from ltp_tools.bench import parse_time
    try:
        v = float(text)
    except ValueError:
        v = parse_time(text)
    if v < 0:
        raise argparse.ArgumentTypeError(f"--delay must not be negative (got {text!r})")
    return v


COMMON = ["schedule", "topology", "model", "workers", "transport", "cc", "link-rate", "job", "secret-file", "num-servers", "colocate",
          "mode",
          "compute-delay",
          "batch-size", "seed", "store-timeout", *schedule_cli.PASSTHROUGH]
SERVER = ["epochs", "iterations", "aggregation", "optimizer", "lr", "momentum", "weight-decay", "clip-factor", "inbound-rate",
          "gather-timeout", "broadcast-timeout",
          "max-missed", "max-returns", "min-workers", "checkpoint-dir", "checkpoint-every", "metrics", "progress", "summary-json"]
WORKER = ["error-feedback", "pull-timeout", "rejoin", "max-missed", "max-returns"]


def _lab_choice(args) -> tuple[bool, str]:
    """(use_lab, why) for --lab auto|on|off."""
    if args.lab == "off":
        return False, "--lab off"
    try:
        from ltp_tools.netlab import check_support
    except ImportError as exc:
        reason = f"ltp_tools.netlab is not available ({exc})"
    else:
        reason = check_support()
    if reason is None:
        return True, "network namespaces available"
    if args.lab == "on":
        raise ConfigError(f"--lab on: cannot build the network lab: {reason}")
    return False, reason


IMPAIRMENTS = ("loss", "rate", "delay")
WORKER_EXIT_GRACE_S = 30.0  # seconds workers get to exit after every PS finished
NO_WORKER_GRACE_S = 10.0  # seconds a PS may run on after every worker exited and one of them failed
LAUNCH_POLL_S = 0.1  # seconds between looks at the children


def _check_impairments(args, use_lab: bool, why: str) -> None:
    """``--loss/--rate/--delay`` only exist in the lab: without one they are an error, never ignored."""
    asked = [f"--{n} {getattr(args, n)}" for n in IMPAIRMENTS if getattr(args, n)]
    asked += ["--lab-gro"] if getattr(args, "lab_gro", False) else []
    if asked and not use_lab:
        raise ConfigError(
            f"{' '.join(asked)} need the network lab, which cannot be built here: {why}. Fix: run as root on a "
            f"machine with the lab's packages (`bash tools/install-lab-deps` installs them; "
            f"`ltp-lab check` tells what is missing), or drop {'/'.join(a.split()[0] for a in asked)} "
            f"to train on loopback without impairments")


def _describe_exit(name: str, pid: int, rc: int) -> str:
    if rc < 0:
        try:
            sig = signal.Signals(-rc).name
        except ValueError:
            sig = f"signal {-rc}"
        return f"{name} (pid {pid}) was killed by {sig}"
    return f"{name} (pid {pid}) exited with code {rc}"


def _shell_rc(rc: int) -> int:
    """A child's return code as a shell would report it (128 + signal number for a signal)."""
    return 128 - rc if rc < 0 else rc


class _Child:
    """One process the launcher started (name, argv, restarts used)."""

    def __init__(self, name: str, argv: list, spawn):
        self.name, self.argv, self._spawn = name, argv, spawn
        self.restarts = 0
        self.rc: int | None = None
        self.start()

    def start(self) -> None:
        self.proc = self._spawn(self.argv)
        self.rc = None
        print(f"[launch] started {self.name} (pid {self.proc.pid})", flush=True)

    def poll(self) -> int | None:
        if self.rc is None:
            self.rc = self.proc.poll()
        return self.rc


def launch(args) -> int:
    """Spawn the store, 1 PS (per shard) and N workers, on loopback or each in its own lab namespace.

    The rendezvous store runs in its own process (``ltp-ps store``) so it outlives a PS.
    The exit code reflects every process started: any PS, worker or store that exits
    non-zero or dies by a signal makes the launch fail, and the failure names the process
    and the code or signal (a signal is reported as 128 + its number).  With
    ``--ps-restarts N`` a PS that dies is restarted (up to N times) and resumes from
    ``--checkpoint-dir``; the workers wait for it and rejoin.
    """
    env = dict(os.environ)
    env.setdefault(rdv.DEFAULT_SECRET_ENV, secrets.token_hex(16))
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # c10d chatter about unresolvable lab hostnames
    if args.ps_restarts and not args.checkpoint_dir:
        raise ConfigError("--ps-restarts needs --checkpoint-dir (and --checkpoint-every N) so that a restarted PS "
                          "resumes from its checkpoint instead of starting over")
    if args.workers < 1:
        raise ConfigError(f"--workers must be >= 1 (got {args.workers})")
    if args.min_workers is not None and not 1 <= args.min_workers <= args.workers:
        raise ConfigError(f"--min-workers must be in 1..--workers ({args.workers}), got {args.min_workers}: the PS "
                          f"would wait --store-timeout for workers that are never started")
    peer_job = schedule_cli.schedule_runs_without_ps(args)
    if peer_job:
        if args.num_servers not in (0, 1):  # 1 is the default: only a number asked for on purpose is refused
            raise ConfigError(f"--schedule {args.schedule} runs without a PS (its workers all-reduce among "
                              f"themselves): --num-servers {args.num_servers} would be ignored; leave it out, or "
                              f"shard a PS with --schedule direct or rat")
        args.num_servers = 0  # the workers apply the optimizer: zero PS processes
        schedule_cli.check_peer_schedule(args)
        if args.kill_worker_after is not None:
            raise ConfigError(f"--kill-worker-after drills a PS dropping a worker; --schedule {args.schedule} runs "
                              f"without a PS (its workers wait for each other): leave the drill out, or run it with "
                              f"--schedule direct, rat or hoplite")
    else:
        if args.num_servers < 1:  # no PS at all: the workers would wait for one forever
            raise ConfigError(f"--num-servers must be >= 1 for --schedule {args.schedule} (got {args.num_servers}); "
                              f"the PS-less schedules (ring, rsgcm) need no PS shard")
        schedule_cli.check_server_schedule(args)  # refuse before spawning anything
    schedule_cli.check_colocate(args)
    colocate = bool(args.colocate)
    use_lab, why = _lab_choice(args)
    _check_impairments(args, use_lab, why)
    if use_lab and args.link_rate is not None and args.transport != "tcp":
        print("[launch] note: the lab limits only the PS's inbound link (--rate); --link-rate also caps every "
              "process's sends at that rate, the PS's broadcast included (give a real host its NIC's rate)",
              flush=True)
    ps_inbound = []  # the lab's PS inbound rate, told to every PS as a real host's NIC rate is (--link-rate)
    if use_lab and args.rate and args.link_rate is None and args.inbound_rate is None and args.transport != "tcp" \
            and args.num_servers:
        ps_inbound = ["--inbound-rate", f"{args.rate:.0f}"]
        print(f"[launch] the lab limits each PS's inbound link to {args.rate / 1e6:g} Mbit/s: the PS grants its "
              f"workers equal shares of it (--inbound-rate; on real hosts pass --link-rate)", flush=True)
    print(f"[launch] {'lab' if use_lab else 'loopback'} ({why}{', receive GRO on at the hosts' if args.lab_gro else ''}); "
          f"{args.num_servers} PS + {args.workers} workers"
          f"{' (shard k on worker k' + chr(39) + 's host)' if colocate else ''}, "
          f"transport {args.transport}{'/' + args.cc if args.transport == 'tcp' else ''}", flush=True)
    port = _free_port()
    py = [sys.executable, "-m", "ltp_ps.cli"]
    children: list[_Child] = []
    lab = None
    try:
        if use_lab:
            from ltp_tools.netlab import Lab

            # --colocate: one namespace per worker, shard k in worker k's; else the shards on their own hosts first
            lab = Lab(n_hosts=args.workers if colocate else args.num_servers + args.workers,
                      gro=args.lab_gro).__enter__()
            hosts = lab.hosts
            store_host = hosts[0].addr
            # at the PS; a PS-less job (ring, rsgcm) has none: every worker's ingress then (each carries a ring
            # step), so --loss/--rate/--delay are never ignored
            for h in (hosts[:args.num_servers] if args.num_servers else hosts):
                lab.impair(h, direction="ingress", loss=args.loss, rate_bps=args.rate, queue_bytes=None,
                           delay_s=args.delay)
            if getattr(args, "topology", None) is None:  # schedules plan for the lab as built
                args.topology = schedule_cli.write_lab_topology(lab)

            def spawner(i):
                return lambda argv: lab.popen(hosts[i], argv + ["--host", "0.0.0.0", "--advertise", hosts[i].addr],
                                              env=env)

            def store_spawner():
                return lambda argv: lab.popen(hosts[0], argv, env=env)
        else:
            store_host = "127.0.0.1"

            def spawner(i):
                return lambda argv: subprocess.Popen(argv, env=env)

            store_spawner = spawner
        store = f"{store_host}:{port}"
        store_proc = _Child("store", py + ["store", "--store", store], store_spawner() if use_lab else spawner(0))
        children.append(store_proc)
        servers = [_Child(f"ps{s}", py + ["server", "--shard", str(s), "--store", store]
                          + _passthrough(args, COMMON + SERVER) + ps_inbound, spawner(s))
                   for s in range(args.num_servers)]
        children += servers
        workers = []
        for r in range(args.workers):
            argv = py + ["worker", "--rank", str(r), "--store", store] + _passthrough(
                args, COMMON + WORKER + (SERVER if peer_job else []))
            if args.kill_worker_after is not None and r == 0:
                argv += ["--max-iterations", str(args.kill_worker_after)]
            workers.append(_Child(f"worker {r}", argv, spawner(r if colocate else args.num_servers + r)))
        children += workers
        drilled = workers[0] if args.kill_worker_after is not None and workers else None
        if drilled is not None:
            print(f"[launch] drill (--kill-worker-after): {drilled.name} leaves the job after "
                  f"{args.kill_worker_after} iterations; the others go on without it", flush=True)
        failures: list[tuple[str, int]] = []
        restarts_left = args.ps_restarts
        reported: set = set()
        no_worker_since = None
        while True:
            fatal = False
            # children found ended in one look: a death by signal first (its neighbours' failures are usually its
            # consequence, and with fast exits they end within the same look), so the launch names the cause
            ended = [c for c in children if c.poll() not in (None, 0) and id(c.proc) not in reported]
            for c in sorted(ended, key=lambda c: c.poll() >= 0):
                rc = c.poll()
                reported.add(id(c.proc))
                what = _describe_exit(c.name, c.proc.pid, rc)
                if c in servers and restarts_left > 0:
                    restarts_left -= 1
                    c.restarts += 1
                    print(f"[launch] {what}; restarting it from its checkpoint ({restarts_left} restarts left)",
                          flush=True)
                    c.start()
                    continue
                print(f"[launch] {what}", flush=True)
                failures.append((what, rc))
                fatal = fatal or c in servers or c is store_proc
            finished = all(c.poll() == 0 for c in (servers or workers))
            if drilled is not None and drilled.poll() == 0 and not finished:
                print(f"[launch] {drilled.name} (pid {drilled.proc.pid}) left after {args.kill_worker_after} "
                      f"iterations, as drilled", flush=True)
                drilled = None
            if fatal or finished:
                break
            give_up = None  # why the launch ends the job now ("": nothing more to report than the failures)
            if not servers and failures:
                # a PS-less job (ring, rsgcm): every worker carries a share of every round and no PS can drop one,
                # so the others cannot go on: stop them now, as torchrun's agent does, instead of letting each
                # wait out its own step timeout (a minute by default) before failing on its own
                left = [c for c in workers if c.poll() is None]
                give_up = (f"stopped {', '.join(c.name for c in left)}: a --schedule {args.schedule} job has no PS "
                           f"and cannot go on without every worker") if left else ""
            # Nobody restarts workers: once all have exited and one failed, none can rejoin the PS.
            if servers and no_worker_since is None and failures and all(c.poll() is not None for c in workers):
                no_worker_since = time.monotonic()
            if no_worker_since is not None and time.monotonic() - no_worker_since > NO_WORKER_GRACE_S:
                give_up = (f"every worker exited and {', '.join(c.name for c in servers if c.poll() is None)} "
                           f"was still waiting for them {NO_WORKER_GRACE_S:.0f} s later; no worker can rejoin")
            if give_up is not None:
                if give_up:
                    print(f"[launch] {give_up}", flush=True)
                    failures.append((give_up, 1))
                fatal = True
                break
            time.sleep(LAUNCH_POLL_S)
        if not fatal:
            deadline = time.monotonic() + WORKER_EXIT_GRACE_S
            for c in workers:
                try:
                    c.proc.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    print(f"[launch] {c.name} (pid {c.proc.pid}) still running {WORKER_EXIT_GRACE_S:.0f} s "
                          f"after the PS finished; terminating it", flush=True)
                    c.proc.send_signal(signal.SIGTERM)
                    c.proc.wait(10)
                    failures.append((f"{c.name} (pid {c.proc.pid}) did not exit after the PS finished", 1))
                    continue
                rc = c.poll()
                if rc and id(c.proc) not in reported:
                    what = _describe_exit(c.name, c.proc.pid, rc)
                    print(f"[launch] {what}", flush=True)
                    failures.append((what, rc))
        if failures:
            print(f"[launch] FAILED: {'; '.join(w for w, _ in failures)}", flush=True)
            return _shell_rc(failures[0][1])
        return 0
    except KeyboardInterrupt:
        return 130
    finally:
        for c in reversed(children):  # workers first, the store last
            p = c.proc
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(5)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        if lab is not None:
            lab.__exit__(None, None, None)


def serve_store(args) -> int:
    """``ltp-ps store``: host the rendezvous TCPStore until SIGTERM/SIGINT (or the parent's death)."""
    host, port = _store_addr(args)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})  # store threads inherit it
    try:  # die with the launcher even if it is SIGKILLed
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    store = rdv.make_store(host, port, is_master=True, timeout_s=args.store_timeout)
    print(f"[store] rendezvous store on {host}:{port}", flush=True)
    signal.sigwait({signal.SIGTERM, signal.SIGINT})
    del store
    return 0


def _run(coro):
    """Run ``coro`` to completion on uvloop when it is installed, else on asyncio's loop.

    Only the import of uvloop is guarded: an ImportError raised *inside* the job (a missing
    scikit-learn, say) must reach the user as it is, not be mistaken for "no uvloop".
    """
    try:
        import uvloop
    except ImportError:
        uvloop = None
    if uvloop is None:
        return asyncio.run(coro)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as r:
        return r.run(coro)


def resolve_transport(args) -> None:
    """Turn ``--transport auto`` into ``ltp`` or ``tcp`` (the same answer on every process of one install)."""
    if args.transport == "auto":
        from .transport import resolve_kind

        args.transport = resolve_kind("auto")


def _limit_threads() -> None:
    """One intra-op thread per process unless $LTP_PS_THREADS says otherwise: N workers + PS on few
    cores otherwise oversubscribe the CPU and every step waits on the slowest thread pool."""
    import gc

    import torch

    torch.set_num_threads(int(os.environ.get("LTP_PS_THREADS", "1")))
    gc.freeze()  # as quick_exit.run does for the imports before main: later collections skip torch's objects


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.cmd == "store":
            return serve_store(args)
        if args.cmd == "plan":
            return schedule_cli.plan_main(args)
        resolve_transport(args)
        if args.cmd in ("server", "worker"):
            _limit_threads()
        if args.cmd == "server":
            _run(serve(args))
            return 0
        if args.cmd == "worker":
            st = _run(work(args))
            return 0 if st.get("stopped", True) or args.max_iterations else 1
        return launch(args)
    except TrainingFailed as exc:
        print(f"ltp-ps: training failed: {exc}", file=sys.stderr)
        return EXIT_TRAINING_FAILED
    except PSError as exc:
        print(f"ltp-ps: error: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    except Exception as exc:  # noqa: BLE001 - only the store's own failures are named here; others propagate
        if not store_failure(exc):
            raise
        print(f"ltp-ps: error: {store_gone_message(exc)}", file=sys.stderr)
        return EXIT_CONFIG


def store_failure(exc: BaseException) -> bool:
    """True for torch's errors of a rendezvous store that stopped answering (``DistNetworkError``,
    ``DistStoreError``): the process hosting the TCPStore is gone, and with it the job's rendezvous."""
    dist = sys.modules.get("torch.distributed")
    return dist is not None and isinstance(exc, getattr(dist, "DistError", ()))


def store_gone_message(exc: BaseException) -> str:
    return (f"the rendezvous store stopped answering ({type(exc).__name__}: {str(exc).strip()[:200]}); the "
            f"process that hosted it (torchrun's agent on the master node, or `ltp-ps store`) is gone, so this "
            f"process can neither rejoin nor learn how the job ended; restart the job")


def entry() -> None:
    """The ``ltp-ps`` command: :func:`main`, then exit without the interpreter's teardown (:mod:`ltp_ps.quick_exit`)."""
    from .quick_exit import run

    run(main)


if __name__ == "__main__":
    entry()
