"""torchrun entry point: ranks ``< --num-servers`` are PS shards, the others workers.

    torchrun --nproc-per-node 5 -m ltp_ps.run --model digits --epochs 10 --transport tcp
    torchrun --nnodes 3 --node-rank K --master-addr HOST --master-port 29500 \\
             --nproc-per-node 4 -m ltp_ps.run --host 0.0.0.0 --advertise <this node's IP> ...

Rendezvous uses torchrun's TCPStore (MASTER_ADDR/MASTER_PORT; torchrun's
agent hosts it, otherwise rank 0 does).  The agent's store outlives the PS
process; a restarted PS resumes from ``--checkpoint-dir`` (the restart path is
tested through ``ltp-ps launch --ps-restarts``, not under torchrun's
``--max-restarts``).  A job that trains nothing
exits 3 (``TrainingFailed``), other errors 2.  ``LTP_PS_ROLE=server|worker`` overrides
the role; the number of workers is ``WORLD_SIZE - num_servers`` unless
``--workers`` is given.  All processes need the same ``LTP_PS_SECRET``.
"""

from __future__ import annotations

import argparse
import os
import sys

from . import cli
from . import rendezvous as rdv
from .errors import PSError, TrainingFailed


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m ltp_ps.run", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    cli._common(ap)
    cli._server_opts(ap)
    cli._worker_opts(ap)
    ap.set_defaults(workers=None)
    return ap


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    cli.resolve_transport(args)
    try:
        rank = int(os.environ["RANK"])
        world = int(os.environ["WORLD_SIZE"])
    except KeyError as exc:
        print(f"ltp_ps.run: {exc.args[0]} is not set; start this module with torchrun", file=sys.stderr)
        return 2
    try:
        if cli.schedule_cli.schedule_runs_without_ps(args):
            args.num_servers = 0  # ring-family schedules: every rank is a worker, no PS process
    except PSError as exc:
        print(f"ltp_ps.run: error: {exc}", file=sys.stderr)
        return 2
    role = os.environ.get("LTP_PS_ROLE") or ("server" if rank < args.num_servers else "worker")
    if args.workers is None:
        args.workers = world - args.num_servers
        if args.workers < 1:
            print(f"ltp_ps.run: error: torchrun started {world} processes and --num-servers {args.num_servers} of "
                  f"them are PS shards, which leaves no worker; start more (--nproc-per-node "
                  f"{args.num_servers + 1} or more) or pass a smaller --num-servers", file=sys.stderr)
            return 2
    cli._limit_threads()
    try:
        store = rdv.store_from_env(args.store_timeout)
        if role == "server":
            args.shard = rank
            cli._run(cli.serve(args, store=store))
        else:
            args.rank = rank - args.num_servers
            cli._run(cli.work(args, store=store))
        return 0
    except TrainingFailed as exc:
        print(f"ltp-ps[{role} rank {rank}]: training failed: {exc}", file=sys.stderr)
        return cli.EXIT_TRAINING_FAILED
    except PSError as exc:
        print(f"ltp-ps[{role} rank {rank}]: error: {exc}", file=sys.stderr)
        return cli.EXIT_CONFIG
    except Exception as exc:  # noqa: BLE001 - only the store's own failures are named here; others propagate
        if not cli.store_failure(exc):
            raise
        print(f"ltp-ps[{role} rank {rank}]: error: {cli.store_gone_message(exc)}", file=sys.stderr)
        return cli.EXIT_CONFIG


if __name__ == "__main__":
    from .quick_exit import run as _run_quick

    _run_quick(main)
