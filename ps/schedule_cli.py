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
import os
import sys

from . import rendezvous as rdv
from .argtypes import bounded
from .errors import ConfigError, RendezvousError

SCHEDULE_NAMES = ("direct", "ring", "rsgcm", "mlfabric", "rat", "hoplite")
PEER_POLL_S = 0.05  # seconds between looks at the store while peers join


# MLfabric's knobs: (option, MLfabricSchedule keyword).  Defaults (None here) are the schedule's own:
# tau_max 8 versions, 1 aggregator per batch, 0.1 s batch window, t_lag 1 s (docs/schedules.md, MLfabric).
MLFABRIC_OPTIONS = (("tau-max", "tau_max"), ("aggregators", "k"), ("batch-window", "batch_window_s"),
                    ("t-lag", "t_lag_s"))
RAT_OPTIONS = (("rat-chunks", "chunks"),)
#: the most pieces per tree slice: a piece's transfers are numbered piece x (tree levels + 1) + level in a
#: tag's 12-bit step field (ltp_ps.schedules.tags), so 1024 pieces fit trees of up to 3 levels
MAX_RAT_CHUNKS = 1024
PASSTHROUGH = tuple(o for o, _ in MLFABRIC_OPTIONS + RAT_OPTIONS)  # options ``ltp-ps launch`` hands to its children


def add_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--schedule", default="direct",
                   help=f"aggregation schedule: {' | '.join(SCHEDULE_NAMES)} (default direct; docs/schedules.md)")
    p.add_argument("--topology", default=None, help="topology JSON file the schedule plans for (docs/schedules.md)")
    g = p.add_argument_group("mlfabric (--schedule mlfabric only; docs/schedules.md)")
    g.add_argument("--tau-max", type=bounded(int, 1, "the staleness bound (model versions)",
                                                   "pass e.g. --tau-max 8"), default=None, metavar="N",
                   help="delay bound tau_max in versions: an update that cannot be applied within it is dropped at "
                        "its worker (default 8)")
    g.add_argument("--aggregators", type=bounded(int, 0, "aggregators per batch (0: all direct)",
                                                       "pass e.g. --aggregators 1"), default=None, metavar="K",
                   help="workers that aggregate others' updates in each batch, Alg 3's k (default 1; at most "
                        "--workers)")
    g.add_argument("--batch-window", type=bounded(float, 0.0, "the batch window in seconds",
                                                   "pass e.g. --batch-window 0.1"), default=None, metavar="S",
                   help="seconds the first update of a batch waits for others before the batch is planned "
                        "(default 0.1, the paper's 100 ms)")
    g.add_argument("--t-lag", type=bounded(float, 0.0, "t_lag in seconds", "pass e.g. --t-lag 1", strict=True),
                   default=None, metavar="S",
                   help="seconds between the link-rate refreshes handed to the planner, the paper's t_lag "
                        "(default 1)")
    r = p.add_argument_group("rat (--schedule rat only; docs/schedules.md)")
    r.add_argument("--rat-chunks", type=bounded(int, 1, "pieces per tree slice",
                                                      "pass e.g. --rat-chunks 4", below=MAX_RAT_CHUNKS + 1),
                   default=None, metavar="C",
                   help="cut-through aggregators: each tree slice's reduce goes up in C pieces, so an aggregator "
                        "sends piece j while its leaves send piece j+1 (default 1: store-and-forward)")


def schedule_options(args) -> dict:
    """Keyword arguments for the schedule ``args`` names (``--tau-max`` etc. for mlfabric); validated.

    An MLfabric option with another schedule, or more aggregators than workers, is a
    :class:`ConfigError` that names the fix (never silently ignored).
    """
    name = getattr(args, "schedule", "direct") or "direct"
    rat = {kw: getattr(args, opt.replace("-", "_"), None) for opt, kw in RAT_OPTIONS}
    rat = {k: v for k, v in rat.items() if v is not None}
    if rat and name != "rat":
        raise ConfigError(f"--rat-chunks applies only to --schedule rat (this job runs --schedule {name}); drop it "
                          f"or pass --schedule rat")
    given = {kw: getattr(args, opt.replace("-", "_"), None) for opt, kw in MLFABRIC_OPTIONS}
    given = {k: v for k, v in given.items() if v is not None}
    if name != "mlfabric":
        if given:
            names = [f"--{o}" for o, kw in MLFABRIC_OPTIONS if kw in given]
            raise ConfigError(f"{' '.join(names)} {'applies' if len(names) == 1 else 'apply'} only to --schedule mlfabric (this job runs --schedule "
                              f"{name}); drop {'/'.join(names)} or pass --schedule mlfabric")
        return rat
    workers = getattr(args, "workers", None)
    if "k" in given and workers is not None and given["k"] > workers:
        raise ConfigError(f"--aggregators {given['k']} is more than the job's {workers} workers (aggregators are "
                          f"workers); pass --aggregators between 0 and {workers}")
    return given


def schedule_class(args):
    from .schedules import schedule_class as cls_of

    schedule_options(args)  # every role asks for the class first: bad options fail before anything starts
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


def write_lab_topology(lab) -> str:
    """The lab's topology (``Topology.from_lab``) as a JSON file for the children's ``--topology``."""
    import tempfile

    from .schedules import Topology

    fd, path = tempfile.mkstemp(prefix="ltp-ps-topology-", suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump(Topology.from_lab(lab).to_json(), f)
    import atexit

    atexit.register(_unlink_quietly, path)  # the launcher outlives its children
    return path


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


#: SGD momentum when --momentum is not given: BSP rounds average every worker's gradient into one
#: update and take the usual heavy-ball momentum ...
BSP_MOMENTUM = 0.9
#: ... asynchronous updates (--mode async, --schedule mlfabric) apply each worker's gradient on its
#: own, against parameters a few versions old, and that staleness already acts as momentum
#: ("asynchrony begets momentum"); 0.9 on top diverged digits at lr 0.1 over LTP and over TCP alike
#: (4 workers, 5 epochs: best 0.19-0.29, last 0.100, chance) while 0 reached 0.85
ASYNC_MOMENTUM = 0.0


def momentum_for(args) -> float:
    """``--momentum`` if given, else ``BSP_MOMENTUM`` or, for asynchronous updates, ``ASYNC_MOMENTUM``."""
    if getattr(args, "momentum", None) is not None:
        return args.momentum
    asynchronous = getattr(args, "mode", "bsp") == "async" or args.schedule in _async_controller_schedules()
    return ASYNC_MOMENTUM if asynchronous else BSP_MOMENTUM


def check_peer_schedule(args) -> None:
    """A PS-less schedule (ring, rsgcm) runs BSP all-reduce rounds: refuse ``--mode async`` instead of quietly
    running BSP (with momentum 0)."""
    if getattr(args, "mode", "bsp") != "bsp":
        raise ConfigError(f"--schedule {args.schedule} runs BSP all-reduce rounds without a PS; use --mode bsp "
                          f"(async runs with direct, hoplite or mlfabric)")
    _check_every_worker(args)


def check_server_schedule(args) -> None:
    """A PS shard runs the schedules whose round the PS loop implements; say so for the others."""
    cls = schedule_class(args)
    if schedule_runs_without_ps(args):
        raise ConfigError(f"--schedule {args.schedule} runs with zero PS processes (the workers apply the optimizer); "
                          f"start only workers (ltp-ps launch does this)")
    if cls.name == "direct":
        if getattr(args, "mode", "bsp") == "async" and getattr(args, "num_servers", 1) != 1:
            raise ConfigError(f"--mode async runs with one PS shard (got --num-servers {args.num_servers}): its "
                              f"shards would apply updates at their own pace and a worker's pull spans versions no "
                              f"shard agreed on; pass --num-servers 1, or --mode bsp to shard the model")
        return
    # mlfabric: asynchronous by design, whatever --mode says; hoplite (ltp_ps.hoplite_roles): BSP rounds or async
    # half-batch. Both run their own PS loop, with one shard
    one_shard = {**{n: "paper §5: one PS orders and applies the updates" for n in _async_controller_schedules()},
                 "hoplite": "it holds the object directory and receives the reduce"}
    if cls.name in one_shard:
        if getattr(args, "num_servers", 1) != 1:
            raise ConfigError(f"--schedule {cls.name} runs with one PS shard ({one_shard[cls.name]}); pass "
                              f"--num-servers 1 (got {args.num_servers})")
        return
    if getattr(cls, "controller", None) is not None and cls.controller is not _base_controller():
        raise ConfigError(f"--schedule {args.schedule} decides its steps at run time (a controller); its PS loop is "
                          f"not wired into ltp-ps server yet; available PS schedules: direct, rat, mlfabric")
    if getattr(args, "mode", "bsp") != "bsp":
        raise ConfigError(f"--schedule {args.schedule} runs BSP rounds; use --mode bsp (async runs with direct)")
    _check_every_worker(args)


def _check_every_worker(args) -> None:
    """Round-program schedules name every worker in every round: a start without all of them cannot run."""
    mw = getattr(args, "min_workers", None)
    if mw is not None and mw < args.workers:
        raise ConfigError(f"--schedule {args.schedule} plans every round over all {args.workers} workers, so it cannot "
                          f"start with --min-workers {mw}; leave --min-workers out (or use --schedule direct, hoplite "
                          f"or mlfabric, whose PS grants transfers only among the workers that joined)")


def _async_controller_schedules():
    from .dynamic_roles import ASYNC_CONTROLLER_SCHEDULES

    return ASYNC_CONTROLLER_SCHEDULES


def _base_controller():
    from .schedules.base import Schedule

    return Schedule.controller


#: schedules whose PS shards may share their hosts with workers (``--colocate``)
COLOCATE_SCHEDULES = ("direct", "rat")


def check_colocate(args) -> None:
    """``--colocate`` (shard k on worker k's host): refuse the combinations it cannot mean."""
    if not getattr(args, "colocate", False):
        return
    if schedule_runs_without_ps(args):
        raise ConfigError(f"--colocate places PS shards on worker hosts, but --schedule {args.schedule} runs no PS; "
                          f"drop --colocate")
    if args.schedule not in COLOCATE_SCHEDULES:
        raise ConfigError(f"--colocate applies to --schedule {' or '.join(COLOCATE_SCHEDULES)} (got "
                          f"{args.schedule}); drop --colocate")
    k = getattr(args, "num_servers", 1)
    if not 1 <= k <= args.workers:
        raise ConfigError(f"--colocate puts shard k on worker k's host, so --num-servers must be between 1 and "
                          f"--workers ({args.workers}); got {k}")


def colocated_placement(args, topology) -> dict:
    """``World.placement`` for ``--colocate``: worker r on host r, shard k on worker k's host (by name).

    Without a topology a node's host is its own name, so shard k is placed on ``worker:k``; a topology
    must have a host per worker (hosts in rank order, as ``ltp-ps launch --colocate`` builds the lab)."""
    from .schedules.program import server, worker

    if not getattr(args, "colocate", False):
        return {}
    k = getattr(args, "num_servers", 1)
    if topology is None:
        return {server(s): worker(s) for s in range(k)}
    names = topology.names
    if len(names) < args.workers:
        raise ConfigError(f"--colocate: the topology has {len(names)} hosts for {args.workers} workers; it needs one "
                          f"host per worker (worker r on host r, shard k on host k)")
    return {**{worker(r): names[r] for r in range(args.workers)}, **{server(s): names[s] for s in range(k)}}


def checked_world(args, world):
    """``world``, or a ConfigError when ``--topology`` has no host for some of its nodes."""
    missing = world.unplaced()
    if missing:
        raise ConfigError(f"--topology {args.topology}: {len(world.topology.names)} hosts for "
                          f"{len(world.server_nodes) + len(world.worker_nodes)} nodes; no host for "
                          f"{', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''}; give one host per PS shard "
                          f"and worker (or one per worker with --colocate), or leave --topology out")
    return world


def _world(args, wl, shards, me=None):
    from .schedules import World

    check_colocate(args)
    topology = load_topology(args)
    return checked_world(args, World(workers=range(args.workers), n_elems=wl.n_params, shards=tuple(shards), me=me,
                                     topology=topology, layout=tuple(wl.layout()), aggregation=args.aggregation,
                                     placement=colocated_placement(args, topology)))


def server_planner(args, wl, plan, shard: int):
    """The round planner a PS shard runs (``direct`` unless ``--schedule`` names a PS-side tree schedule)."""
    from .schedules import create
    from .schedules.program import server

    return create(args.schedule, _world(args, wl, plan.ranges, server(shard)), **schedule_options(args))


def tree_board(args, store, secret: bytes, log=None):
    """The board on which a tree schedule's processes agree on dead workers (``ltp_ps.tree_views``); None for
    ``direct`` (its PS keeps per-worker membership itself)."""
    from .tree_views import StoreBoard

    if (args.schedule or "direct") == "direct":
        return None
    return StoreBoard(store, secret, log=log)


def publish_address(args, store, secret: bytes, rank: int, transport) -> None:
    """A worker of a schedule with worker-to-worker transfers publishes its signed address, *before* it joins a PS.

    So every worker a PS counts as joined can be found by its peers: one paused (or slow) between its join and
    its publishing never holds the others in their look-up while the PS waits on their heartbeats."""
    if (args.schedule or "direct") == "direct":
        return
    store.set(f"tree/{rank}", _sign(secret, {"rank": rank, "addr": list(transport.local_addr)}))


def _peer_address(store, secret: bytes, rank: int) -> tuple | None:
    """Worker ``rank``'s published address, or None if it has published none (yet)."""
    key = f"tree/{rank}"
    if not store.check([key]):
        return None
    d = _verify(secret, store.get(key), key)
    if d.get("rank") != rank:
        raise RendezvousError(f"{key} in the store names rank {d.get('rank')!r}; the store holds another job's keys")
    return tuple(d["addr"])


def store_resolver(store, secret: bytes):
    """``Executor.resolve`` for a worker: a worker node's published address from the store, else None (a server
    node, a worker that published nothing, or a store that is gone because the job ended)."""
    from .schedules.program import ROLE_WORKER, parse_node

    def resolve(node: str) -> tuple | None:
        role, r = parse_node(node)
        if role != ROLE_WORKER:
            return None
        try:
            return _peer_address(store, secret, r)
        except (RuntimeError, OSError):  # DistNetworkError is a RuntimeError
            return None

    return resolve


async def prepare_worker(w, args, store, secret: bytes, rank: int, transport, wl, infos) -> None:
    """Give worker ``w`` its schedule's planner and its peers' addresses (published by :func:`publish_address`).

    Round-program schedules wait for every peer's address (their rounds name every worker).  Under a PS's
    controller (Hoplite, MLfabric) the PS grants transfers only with workers that joined it, and a worker
    publishes before it joins: such a worker never waits for absent peers (``--min-workers``, a late or paused
    one); an address it lacks is looked up when a grant first names that peer."""
    from .schedules import create
    from .schedules.program import server, worker

    if (args.schedule or "direct") == "direct":
        return
    w.planner = create(args.schedule, _world(args, wl, [(i.lo, i.hi) for i in infos], worker(rank)),
                       **schedule_options(args))
    w.executor.addresses.update({server(i.shard): tuple(i.addr) for i in infos})
    w.tree_board = tree_board(args, store, secret)
    from .dynamic_roles import runs_async_controller
    from .hoplite_roles import runs_hoplite

    # a peer missing from the book, or whose send bounced (a restarted process: a new port), is looked up again
    w.executor.resolve = store_resolver(store, secret)
    if not (runs_async_controller(w.planner) or runs_hoplite(w.planner)):
        await asyncio.to_thread(_wait_keys, store, [f"tree/{r}" for r in range(args.workers)], args.store_timeout)
    for r in range(args.workers):
        a = await asyncio.to_thread(_peer_address, store, secret, r)
        if a is not None:
            w.executor.addresses[worker(r)] = a


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

    check_peer_schedule(args)
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
        world = checked_world(args, World(workers=world_d["workers"], n_elems=wl.n_params, me=worker_node(rank),
                                          addresses=addrs, topology=load_topology(args), layout=tuple(wl.layout()),
                                          aggregation=args.aggregation))
        planner = create(args.schedule, world)
        cfg = PeerConfig(rank=rank, world_size=args.workers, epochs=args.epochs, iterations=args.iterations,
                         aggregation=args.aggregation, optimizer=args.optimizer, lr=args.lr, momentum=momentum_for(args),
                         weight_decay=args.weight_decay, step_timeout_s=args.pull_timeout, seed=args.seed,
                         metrics_path=args.metrics, max_iterations=args.max_iterations)
        from .plan_feedback import StoreFeedback, wants_feedback

        feedback = None
        if wants_feedback(planner):  # adaptive planners (rsgcm): rank 0 feeds failures and round times to all
            feedback = StoreFeedback(store, rank, list(range(args.workers)), sign=lambda d: _sign(secret, d),
                                     verify=lambda raw, what: _verify(secret, raw, what),
                                     timeout_s=max(60.0, 4 * args.pull_timeout))  # a failed attempt's stages
                                                                                   # each wait out pull_timeout
        peer = PeerWorker(wl, transport, cfg, planner=planner, addresses=addrs, feedback=feedback)
        if rank == 0:
            print(f"[{args.schedule} w0] {args.workers} workers, no PS, transport {args.transport}, model "
                  f"{args.model} ({wl.n_params} params)", flush=True)
        summary = await peer.run()
        if rank == 0:
            from .metrics import format_summary, write_summary_json

            print(format_summary(summary, f"ltp-ps {args.schedule} ({args.transport}, {args.workers} workers)"),
                  flush=True)
            if args.summary_json:
                write_summary_json(args.summary_json, summary)
        store.set(f"peer/done/{rank}", "1")
        # Stay reachable until every peer finished its last round (they may still send to us).
        alive = feedback.ranks if feedback is not None else range(args.workers)  # minus workers found silent
        await asyncio.to_thread(_wait_keys, store, [f"peer/done/{r}" for r in alive], args.store_timeout)
        return summary
    finally:
        await transport.close()


# -- ltp-ps plan ------------------------------------------------------------------------------------------------------

def build_plan_parser(sub) -> None:
    p = sub.add_parser("plan", help="print one round's plan as JSON with its predicted time")
    add_options(p)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--num-servers", type=int, default=1, help="PS shards (ignored by PS-less schedules)")
    p.add_argument("--colocate", action="store_true", help="shard k on worker k's host (as ltp-ps launch --colocate)")
    p.add_argument("--bytes", type=float, default=4e6, help="model size in bytes (default 4e6)")
    p.add_argument("--iteration", type=int, default=0)
    p.add_argument("--summary", action="store_true", help="print edges and the prediction, not every step")


def plan_main(args) -> int:
    from .schedules import World, create
    from .sharding import ShardPlan

    cls = schedule_class(args)
    n_elems = max(1, int(args.bytes) // 4)
    shards = () if not cls.needs_servers else tuple(ShardPlan(n_elems, max(1, args.num_servers)).ranges)
    check_colocate(args)
    topology = load_topology(args)
    world = checked_world(args, World(workers=range(args.workers), n_elems=n_elems, shards=shards, topology=topology,
                                      placement=colocated_placement(args, topology)))
    try:
        sched = create(args.schedule, world, **schedule_options(args))
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
