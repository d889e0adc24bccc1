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
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time

from . import rendezvous as rdv
from .errors import ConfigError, PSError


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="digits", help="digits | resnet50 | vgg16 | synthetic:<n> (default digits)")
    p.add_argument("--workers", type=int, default=4, help="number of workers in the job (default 4)")
    p.add_argument("--transport", choices=("auto", "ltp", "tcp"), default="auto",
                   help="gradient/parameter transport (auto: ltp when ltp.open_endpoint exists, else tcp)")
    p.add_argument("--cc", default="cubic", help="TCP congestion control for --transport tcp: cubic|bbr|reno")
    p.add_argument("--store", default=None, help="HOST:PORT of the TCPStore (default: $MASTER_ADDR:$MASTER_PORT)")
    p.add_argument("--job", default="default", help="job name (store key prefix), lets jobs share a store")
    p.add_argument("--secret-file", default=None, help="file with the job secret (default: $LTP_PS_SECRET)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind the transport to")
    p.add_argument("--advertise", default=None, help="address peers should dial (default: --host)")
    p.add_argument("--num-servers", type=int, default=1, help="PS shards (contiguous ranges of the model)")
    p.add_argument("--mode", choices=("bsp", "async"), default="bsp")
    p.add_argument("--compute-delay", type=float, default=0.0, help="extra seconds of compute per step (any model)")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--store-timeout", type=float, default=120.0, help="seconds to wait for the rendezvous")


def _server_opts(p):
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--iterations", type=int, default=None, help="total rounds (overrides --epochs)")
    p.add_argument("--aggregation", choices=("unbiased", "zero_fill"), default="unbiased")
    p.add_argument("--optimizer", choices=("sgd", "adam"), default="sgd")
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--gather-timeout", type=float, default=10.0, help="seconds before a gather gives up on a worker")
    p.add_argument("--max-missed", type=int, default=3, help="missed rounds before a worker is dropped")
    p.add_argument("--min-workers", type=int, default=None, help="start when this many joined (default: all)")
    p.add_argument("--checkpoint-dir", default=None)
    p.add_argument("--checkpoint-every", type=int, default=0, help="rounds between checkpoints (0: at the end)")
    p.add_argument("--metrics", default=None, help="JSONL file for per-iteration metrics")
    p.add_argument("--progress", action="store_true", help="tqdm progress bar on stderr")
    p.add_argument("--summary-json", default=None, help="write the final summary here")


def _worker_opts(p):
    p.add_argument("--error-feedback", action="store_true", help="re-send gradient the PS did not receive")
    p.add_argument("--pull-timeout", type=float, default=60.0)
    p.add_argument("--rejoin", type=int, default=1, help="times to rejoin after losing the PS's broadcasts")
    p.add_argument("--max-iterations", type=int, default=None, help="exit after N pushes (failure drills)")


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
    la = sub.add_parser("launch", help="1 PS + N workers on this machine (optionally in a network lab)")
    _common(la)
    _server_opts(la)
    _worker_opts(la)
    la.add_argument("--lab", choices=("auto", "on", "off"), default="auto",
                    help="network namespaces with impairments (auto: when root and supported)")
    la.add_argument("--loss", type=float, default=0.0, help="lab: ingress loss rate at the PS")
    la.add_argument("--rate", type=float, default=None, help="lab: PS ingress rate in bit/s")
    la.add_argument("--delay", type=float, default=0.0, help="lab: one-way delay in seconds")
    la.add_argument("--kill-worker-after", type=int, default=None,
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
                                job_key=secret, advertise_host=args.advertise)


async def serve(args, store=None) -> dict:
    from .server import ParameterServer, ServerConfig, summary_text
    from .sharding import ShardPlan

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
                           momentum=args.momentum, weight_decay=args.weight_decay,
                           gather_timeout_s=args.gather_timeout, max_missed=args.max_missed,
                           min_workers=args.min_workers, join_timeout_s=args.store_timeout,
                           checkpoint_dir=args.checkpoint_dir, checkpoint_every=args.checkpoint_every,
                           metrics_path=args.metrics, progress=args.progress, seed=args.seed)
        ps = ParameterServer(wl, transport, cfg, plan=plan, shard=args.shard, rendezvous=rv)
        print(f"[ps{args.shard}] listening on {transport.local_addr} ({args.transport}"
              f"{'/' + args.cc if args.transport == 'tcp' else ''}), model {args.model} "
              f"({wl.n_params} params, shard {lo}:{hi}), waiting for {args.workers} workers", flush=True)
        summary = await ps.run()
        print(summary_text(ps, summary), flush=True)
        if args.summary_json:
            with open(args.summary_json, "w") as f:
                json.dump(summary, f, default=float)
        store.set(f"done/{args.shard}", "1")
        return summary
    finally:
        await transport.close()


async def work(args, store=None) -> dict:
    from .errors import TransportTimeout
    from .worker import ShardRef, Worker, WorkerConfig

    secret = rdv.load_secret(args.secret_file)
    wl = _workload(args)
    rank = args.rank
    if rank is None:
        rank = int(os.environ.get("RANK", "0")) - args.num_servers
    if store is None:
        host, port = _store_addr(args)
        store = rdv.make_store(host, port, is_master=False, timeout_s=args.store_timeout)
    store = rdv.prefixed(store, args.job)
    transport = await _open_transport(args, secret)
    stats = {"iterations": 0}
    try:
        attempts = 0
        while True:
            first = await asyncio.to_thread(rdv.fetch_server, store, secret, 0, timeout_s=args.store_timeout)
            infos = [first] + [await asyncio.to_thread(rdv.fetch_server, store, secret, s, timeout_s=args.store_timeout)
                               for s in range(1, first.num_servers)]
            for info in infos:
                await asyncio.to_thread(rdv.join, store, secret, info, rank=rank, addr=transport.local_addr,
                                        n_params=wl.n_params, dtype="float32", world_size=args.workers,
                                        transport=args.transport, timeout_s=args.store_timeout)
            shards = [ShardRef(i.shard, i.addr, i.lo, i.hi) for i in infos]
            w = Worker(wl, transport, shards, WorkerConfig(rank=rank, world_size=args.workers,
                                                            error_feedback=args.error_feedback,
                                                            pull_timeout_s=args.pull_timeout, seed=args.seed,
                                                            max_iterations=args.max_iterations))
            try:
                st = await w.run()
                stats["iterations"] += st["iterations"]
                stats.update({k: v for k, v in st.items() if k != "iterations"})
                return stats
            except TransportTimeout:
                attempts += 1
                if attempts > args.rejoin or (store.check(["done/0"])):
                    raise
                print(f"[worker {rank}] lost the PS's broadcasts; rejoining", flush=True)
    finally:
        await transport.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _passthrough(args, names) -> list[str]:
    out = []
    for n in names:
        v = getattr(args, n.replace("-", "_"))
        if v is None or v is False:
            continue
        out += [f"--{n}"] if v is True else [f"--{n}", str(v)]
    return out


COMMON = ["model", "workers", "transport", "cc", "job", "secret-file", "num-servers", "mode", "compute-delay",
          "batch-size", "seed", "store-timeout"]
SERVER = ["epochs", "iterations", "aggregation", "optimizer", "lr", "momentum", "weight-decay", "gather-timeout",
          "max-missed", "min-workers", "checkpoint-dir", "checkpoint-every", "metrics", "progress", "summary-json"]
WORKER = ["error-feedback", "pull-timeout", "rejoin"]


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


def launch(args) -> int:
    """Spawn 1 PS (per shard) + N workers, on loopback or each in its own lab namespace."""
    env = dict(os.environ)
    env.setdefault(rdv.DEFAULT_SECRET_ENV, secrets.token_hex(16))
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # c10d chatter about unresolvable lab hostnames
    use_lab, why = _lab_choice(args)
    if args.loss and not use_lab:
        print(f"[launch] WARNING: --loss {args.loss} ignored: no lab ({why})", flush=True)
    print(f"[launch] {'lab' if use_lab else 'loopback'} ({why}); {args.num_servers} PS + {args.workers} workers, "
          f"transport {args.transport}{'/' + args.cc if args.transport == 'tcp' else ''}", flush=True)
    port = _free_port()
    py = [sys.executable, "-m", "ltp_ps.cli"]
    procs: list[subprocess.Popen] = []
    lab = None
    try:
        if use_lab:
            from ltp_tools.netlab import Lab

            lab = Lab(n_hosts=args.num_servers + args.workers).__enter__()
            hosts = lab.hosts
            store_host = hosts[0].addr
            for h in hosts[:args.num_servers]:
                lab.impair(h, direction="ingress", loss=args.loss, rate_bps=args.rate, queue_bytes=None,
                           delay_s=args.delay)

            def spawn(i, argv):
                return lab.popen(hosts[i], argv + ["--host", "0.0.0.0", "--advertise", hosts[i].addr], env=env)
        else:
            store_host = "127.0.0.1"

            def spawn(i, argv):
                return subprocess.Popen(argv, env=env)
        store = f"{store_host}:{port}"
        for s in range(args.num_servers):
            argv = py + ["server", "--shard", str(s), "--store", store] + (["--store-master"] if s == 0 else [])
            procs.append(spawn(s, argv + _passthrough(args, COMMON + SERVER)))
        for r in range(args.workers):
            argv = py + ["worker", "--rank", str(r), "--store", store] + _passthrough(args, COMMON + WORKER)
            if args.kill_worker_after is not None and r == 0:
                argv += ["--max-iterations", str(args.kill_worker_after)]
            procs.append(spawn(args.num_servers + r, argv))
        servers = procs[:args.num_servers]
        rc = 0
        for p in servers:
            rc = rc or p.wait()
        deadline = time.monotonic() + 30
        for p in procs[args.num_servers:]:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.send_signal(signal.SIGTERM)
        return rc
    except KeyboardInterrupt:
        return 130
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(5)
                except subprocess.TimeoutExpired:
                    p.kill()
        if lab is not None:
            lab.__exit__(None, None, None)


def _run(coro):
    try:
        import uvloop

        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as r:
            return r.run(coro)
    except ImportError:
        return asyncio.run(coro)


def resolve_transport(args) -> None:
    """Turn ``--transport auto`` into ``ltp`` or ``tcp`` (the same answer on every process of one install)."""
    if args.transport == "auto":
        from .transport import resolve_kind

        args.transport = resolve_kind("auto")


def _limit_threads() -> None:
    """One intra-op thread per process unless $LTP_PS_THREADS says otherwise: N workers + PS on few
    cores otherwise oversubscribe the CPU and every step waits on the slowest thread pool."""
    import torch

    torch.set_num_threads(int(os.environ.get("LTP_PS_THREADS", "1")))


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    resolve_transport(args)
    if args.cmd in ("server", "worker"):
        _limit_threads()
    try:
        if args.cmd == "server":
            _run(serve(args))
            return 0
        if args.cmd == "worker":
            st = _run(work(args))
            return 0 if st.get("stopped", True) or args.max_iterations else 1
        return launch(args)
    except PSError as exc:
        print(f"ltp-ps: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
