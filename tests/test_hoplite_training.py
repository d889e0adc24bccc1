"""Hoplite end to end: the PS's directory drives ParameterServer + Worker rounds (in memory, then launch)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from ltp_ps.schedules import World, create
from ltp_ps.schedules.program import server, worker
from ltp_ps.server import ParameterServer, ServerConfig
from ltp_ps.sharding import ShardPlan
from ltp_ps.transport import MemoryNetwork
from ltp_ps.worker import ShardRef, Worker, WorkerConfig
from ps_helpers import workload

pytestmark = pytest.mark.timeout(120)


def make_job(n_workers, *, loss=0.0, seed=0, **server_kw):
    wl = workload()
    net = MemoryNetwork(loss=loss, segment_size=1024, seed=seed)
    plan = ShardPlan(wl.n_params, 1)
    world = World(workers=range(n_workers), n_elems=wl.n_params, shards=tuple(plan.ranges),
                  layout=tuple(wl.layout()))
    s_ep = net.endpoint()
    w_eps = [net.endpoint() for _ in range(n_workers)]
    addrs = {server(0): s_ep.local_addr, **{worker(r): e.local_addr for r, e in enumerate(w_eps)}}
    ps = ParameterServer(wl, s_ep, ServerConfig(world_size=n_workers, **server_kw), plan=plan, shard=0,
                         log=lambda _: None, planner=create("hoplite", world))
    refs = [ShardRef(0, s_ep.local_addr, ps.lo, ps.hi)]
    workers = []
    for r in range(n_workers):
        ps.admit(r, w_eps[r].local_addr)
        w = Worker(wl, w_eps[r], refs, WorkerConfig(rank=r, world_size=n_workers), planner=create("hoplite", world))
        w.executor.addresses.update(addrs)
        workers.append(w)
    return ps, workers


@pytest.mark.parametrize("n_workers", [2, 3, 5])
async def test_hoplite_trains_digits_in_memory(n_workers):
    ps, workers = make_job(n_workers, epochs=6, lr=0.1)
    out = await asyncio.gather(ps.run(), *(w.run() for w in workers))
    assert all(o.get("stopped") for o in out[1:])
    ev = workload().evaluate(ps.params)
    assert ev["accuracy"] >= 0.9, ev
    rows = [r for r in ps.metrics.rows if r["event"] == "iteration"]
    assert rows and all(r["schedule"] == "hoplite" and r["contributors"] == n_workers for r in rows)
    assert len(rows) == ps.total
