"""Program-driven PS rounds: RAT trees train digits through ParameterServer + Worker (in memory)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from ltp_ps.schedules import Topology, World, create
from ltp_ps.schedules.program import server, worker
from ltp_ps.server import ParameterServer, ServerConfig
from ltp_ps.sharding import ShardPlan
from ltp_ps.transport import MemoryNetwork
from ltp_ps.worker import ShardRef, Worker, WorkerConfig
from ps_helpers import workload

pytestmark = pytest.mark.timeout(180)


def make_tree_job(n_workers, *, n_shards=1, loss=0.0, seed=0, racks=None, **server_kw):
    wl = workload()
    net = MemoryNetwork(loss=loss, segment_size=1024, seed=seed)
    plan = ShardPlan(wl.n_params, n_shards)
    topo = None
    if racks:
        topo = Topology.uniform([f"h{i}" for i in range(n_shards + n_workers)], rate_bps=1e9, racks=racks)
    world = World(workers=range(n_workers), n_elems=wl.n_params, shards=tuple(plan.ranges), topology=topo,
                  layout=tuple(wl.layout()))
    s_eps = [net.endpoint() for _ in range(n_shards)]
    w_eps = [net.endpoint() for _ in range(n_workers)]
    addrs = {**{server(s): e.local_addr for s, e in enumerate(s_eps)},
             **{worker(r): e.local_addr for r, e in enumerate(w_eps)}}
    servers = [ParameterServer(wl, s_eps[s], ServerConfig(world_size=n_workers, **server_kw), plan=plan, shard=s,
                               log=lambda _: None, planner=create("rat", world)) for s in range(n_shards)]
    refs = [ShardRef(s.shard, s.transport.local_addr, s.lo, s.hi) for s in servers]
    workers = []
    for r in range(n_workers):
        for s in servers:
            s.admit(r, w_eps[r].local_addr)
        w = Worker(wl, w_eps[r], refs, WorkerConfig(rank=r, world_size=n_workers), planner=create("rat", world))
        w.executor.addresses.update(addrs)
        workers.append(w)
    return servers, workers


@pytest.mark.parametrize("n_workers,n_shards,racks", [(4, 1, None), (5, 2, [3, 4])])
async def test_rat_trees_train_digits(n_workers, n_shards, racks):
    servers, workers = make_tree_job(n_workers, n_shards=n_shards, racks=racks, epochs=8, lr=0.1)
    out = await asyncio.gather(*(s.run() for s in servers), *(w.run() for w in workers))
    assert all(o.get("stopped") for o in out[n_shards:])
    full = np.concatenate([s.params for s in servers])
    ev = workload().evaluate(full)
    assert ev["accuracy"] >= 0.93
    rows = [r for r in servers[0].metrics.rows if r["event"] == "iteration"]
    assert rows and all(r["contributors"] == n_workers for r in rows)


async def test_rat_under_loss_counts_fewer_contributions_but_trains():
    servers, workers = make_tree_job(4, loss=0.05, seed=2, epochs=10, lr=0.1)
    await asyncio.gather(*(s.run() for s in servers), *(w.run() for w in workers))
    rows = [r for r in servers[0].metrics.rows if r["event"] == "iteration"]
    fr = [r["delivered"]["all"] for r in rows]
    assert 0.8 < np.mean(fr) < 1.0
    assert workload().evaluate(servers[0].params)["accuracy"] >= 0.9


async def test_workers_that_join_mid_job_start_at_the_round_they_were_admitted_at():
    """A round-program worker that joins a job at round R (rejoined, or the PS resumed from a checkpoint) starts
    at R (``Worker.start_round``, which the CLI reads from ``rdv.admitted_round``).  At round 0 it would wait for
    round 0's parameters, which the PS sent long ago: every worker fails at its --pull-timeout."""
    servers, workers = make_tree_job(4, epochs=4, lr=0.1)
    ps = servers[0]
    start = 2 * ps.ipe  # the job is half done
    ps.iteration = ps.version = start
    for w in workers:
        w.cfg.pull_timeout_s = 5.0
        w.start_round = start
    out = await asyncio.wait_for(asyncio.gather(ps.run(), *(w.run() for w in workers)), 120)
    assert all(o.get("stopped") for o in out[1:]), out
    rows = [r for r in ps.metrics.rows if r["event"] == "iteration"]
    assert [r["iteration"] for r in rows] == list(range(start, ps.total))
    assert all(r["contributors"] == 4 for r in rows)
