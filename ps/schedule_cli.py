"""Schedule options of ``ltp-ps``: ``--schedule``/``--topology``, PS-less worker jobs, and ``ltp-ps plan``.

``ltp-ps`` (``ltp_ps.cli``) calls into this module; it holds everything the
CLI needs to know about schedules:

* :func:`add_options` -- ``--schedule NAME`` and ``--topology FILE``;
* :func:`schedule_runs_without_ps` -- whether the chosen schedule applies the
  optimizer on the workers (``ring``: the job has zero PS processes);
* :func:`peer_work` -- one worker of a PS-less job: rendezvous through the
  store (every worker publishes its signed address; rank 0, the coordinator,
  publishes the membership every worker plans from), then
  :class:`~ltp_ps.allreduce.PeerWorker`;
* :func:`plan_main` -- ``ltp-ps plan``: one round's plan as JSON plus the
  predicted communication time on the topology.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys

from . import rendezvous as rdv
from .errors import ConfigError, RendezvousError

SCHEDULE_NAMES = ("direct", "ring", "rsgcm", "mlfabric", "rat", "hoplite")
PEER_POLL_S = 0.05  # seconds between looks at the store while peers join


def add_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--schedule", default="direct",
                   help=f"aggregation schedule: {' | '.join(SCHEDULE_NAMES)} (default direct; docs/schedules.md)")
    p.add_argument("--topology", default=None, help="topology JSON file the schedule plans for (docs/schedules.md)")


def schedule_class(args):
    from .schedules import schedule_class as cls_of

    return cls_of(getattr(args, "schedule", "direct") or "direct")


def schedule_runs_without_ps(args) -> bool:
    """True for schedules whose workers apply the optimizer themselves (no PS process)."""
    from .schedules.program import APPLY_AT_WORKERS

    return schedule_class(args).apply_at == APPLY_AT_WORKERS


def load_topology(args):
    from .schedules import Topology

    path = getattr(args, "topology", None)
    if not path:
        return None
    try:
        return Topology.from_json(path)
    except ValueError as exc:
        raise ConfigError(f"--topology {path}: {exc}") from None


def check_server_schedule(args) -> None:
    """A PS shard runs the schedules whose round the PS loop implements; say so for the others."""
    cls = schedule_class(args)
    if schedule_runs_without_ps(args):
        raise ConfigError(f"--schedule {args.schedule} runs with zero PS processes (the workers apply the optimizer); "
                          f"start only workers (ltp-ps launch does this)")
    if cls.name != "direct":
        raise ConfigError(f"--schedule {args.schedule}: its PS-side round is not wired into ltp-ps server yet; "
                          f"use --schedule direct or ring")


# -- PS-less jobs ---------------------------------------------------------------------------------------------------

def _sign(secret: bytes, d: dict) -> str:
    body = json.dumps(d, sort_keys=True, separators=(",", ":"))
    return json.dumps({"body": body, "mac": rdv._mac(secret, body.encode())})


def _verify(secret: bytes, raw: bytes, what: str) -> dict:
    import hmac

    try:
        env = json.loads(raw)
        ok = hmac.compare_digest(env["mac"], rdv._mac(secret, env["body"].encode()))
    except (ValueError, KeyError, TypeError):
        ok = False
    if not ok:
        raise RendezvousError(f"{what} in the store is not signed with this job's secret; give every process the "
                              f"same $LTP_PS_SECRET / --secret-file")
    return json.loads(env["body"])


def _wait_keys(store, keys, timeout_s: float) -> None:
    import time

    t_end = time.monotonic() + timeout_s
    while not store.check(keys):
        if time.monotonic() > t_end:
            missing = [k for k in keys if not store.check([k])]
            raise RendezvousError(f"peers did not join within {timeout_s:.0f} s (missing {missing[:6]}); start every "
                                  f"worker (same --store, --job, secret, --workers)")
        time.sleep(PEER_POLL_S)


async def peer_work(args, store, open_transport, workload) -> dict:
    """Run one worker of a PS-less job (``--schedule ring``); returns its summary."""
    from .allreduce import PeerConfig, PeerWorker
    from .schedules import World, create
    from .schedules.program import worker as worker_node

    secret = rdv.load_secret(args.secret_file)
    wl = workload
    rank = args.rank
    if rank is None or not 0 <= rank < args.workers:
        raise ConfigError(f"worker rank {rank} is outside 0..{args.workers - 1}; pass --rank")
    store = rdv.prefixed(store, args.job)
    transport = await open_transport()
    try:
        me = {"rank": rank, "addr": list(transport.local_addr), "n_params": wl.n_params, "schedule": args.schedule,
              "transport": args.transport, "workers": args.workers}
        store.set(f"peer/{rank}", _sign(secret, me))
        if rank == 0:  # the coordinator: collect everybody, publish the membership
            keys = [f"peer/{r}" for r in range(args.workers)]
            await asyncio.to_thread(_wait_keys, store, keys, args.store_timeout)
            peers = [_verify(secret, store.get(k), k) for k in keys]
            for p in peers:
                for field in ("n_params", "schedule", "transport", "workers"):
                    if p[field] != me[field]:
                        raise RendezvousError(f"worker {p['rank']} has {field}={p[field]!r}, worker 0 {me[field]!r}; "
                                              f"start every worker with the same options")
            store.set("peer/world", _sign(secret, {"workers": list(range(args.workers)), "schedule": args.schedule,
                                                   "addresses": {worker_node(p["rank"]): p["addr"] for p in peers}}))
        await asyncio.to_thread(_wait_keys, store, ["peer/world"], args.store_timeout)
        world_d = _verify(secret, store.get("peer/world"), "peer/world")
        if world_d["schedule"] != args.schedule:
            raise RendezvousError(f"the coordinator plans schedule {world_d['schedule']!r}, this worker "
                                  f"{args.schedule!r}")
        addrs = {k: tuple(v) for k, v in world_d["addresses"].items()}
        world = World(workers=world_d["workers"], n_elems=wl.n_params, me=worker_node(rank), addresses=addrs,
                      topology=load_topology(args), layout=tuple(wl.layout()), aggregation=args.aggregation)
        planner = create(args.schedule, world)
        cfg = PeerConfig(rank=rank, world_size=args.workers, epochs=args.epochs, iterations=args.iterations,
                         aggregation=args.aggregation, optimizer=args.optimizer, lr=args.lr, momentum=args.momentum,
                         weight_decay=args.weight_decay, step_timeout_s=args.pull_timeout, seed=args.seed,
                         metrics_path=args.metrics, max_iterations=args.max_iterations)
        peer = PeerWorker(wl, transport, cfg, planner=planner, addresses=addrs)
        if rank == 0:
            print(f"[{args.schedule} w0] {args.workers} workers, no PS, transport {args.transport}, model "
                  f"{args.model} ({wl.n_params} params)", flush=True)
        summary = await peer.run()
        if rank == 0:
            from .metrics import format_summary

            print(format_summary(summary, f"ltp-ps {args.schedule} ({args.transport}, {args.workers} workers)"),
                  flush=True)
            if args.summary_json:
                with open(args.summary_json, "w") as f:
                    json.dump(summary, f, default=float)
        store.set(f"peer/done/{rank}", "1")
        # Stay reachable until every peer finished its last round (they may still send to us).
        await asyncio.to_thread(_wait_keys, store, [f"peer/done/{r}" for r in range(args.workers)],
                                args.store_timeout)
        return summary
    finally:
        await transport.close()


# -- ltp-ps plan ------------------------------------------------------------------------------------------------------

def build_plan_parser(sub) -> None:
    p = sub.add_parser("plan", help="print one round's plan as JSON with its predicted time")
    add_options(p)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--num-servers", type=int, default=1, help="PS shards (ignored by PS-less schedules)")
    p.add_argument("--bytes", type=float, default=4e6, help="model size in bytes (default 4e6)")
    p.add_argument("--iteration", type=int, default=0)
    p.add_argument("--summary", action="store_true", help="print edges and the prediction, not every step")


def plan_main(args) -> int:
    from .schedules import World, create
    from .sharding import ShardPlan

    cls = schedule_class(args)
    n_elems = max(1, int(args.bytes) // 4)
    shards = () if not cls.needs_servers else tuple(ShardPlan(n_elems, max(1, args.num_servers)).ranges)
    world = World(workers=range(args.workers), n_elems=n_elems, shards=shards, topology=load_topology(args))
    try:
        sched = create(args.schedule, world)
        plan = sched.plan(args.iteration)
        plan.check()
        predicted = sched.predict_s(int(args.bytes))
    except (ValueError, KeyError) as exc:
        raise ConfigError(f"cannot plan --schedule {args.schedule} for {args.workers} workers: {exc}") from None
    out = {"schedule": args.schedule, "workers": args.workers, "bytes": int(args.bytes),
           "apply_at": plan.apply_at, "predicted_s": predicted,
           "predicted_by": "fluid max-min simulation of the plan's transfers on the topology (ltp_ps.schedules.estimate)",
           "topology": (world.effective_topology().to_json()),
           "edges": [{"src": a, "dst": b, "lo": lo, "hi": hi, "tag": t, "mode": m}
                     for a, b, lo, hi, t, m in plan.edges()]}
    if not args.summary:
        out["plan"] = plan.to_json()
    json.dump(out, sys.stdout, indent=1, default=float)
    sys.stdout.write("\n")
    return 0
