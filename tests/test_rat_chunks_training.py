"""RAT's cut-through reduce (``--rat-chunks C``) trains the PS: per-piece Applies step the optimizer once per round."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from ltp_ps.schedules.partial import assemble as _assemble
from ltp_ps.schedules import World, create
from ltp_ps.schedules.partial import Partial
from ltp_ps.schedules.program import server, worker
from ltp_ps.server import ParameterServer, ServerConfig
from ltp_ps.sharding import ShardPlan
from ltp_ps.transport import MemoryNetwork
from ltp_ps.worker import ShardRef, Worker, WorkerConfig
from ps_helpers import workload

pytestmark = pytest.mark.timeout(120)


def _job(n_workers, chunks, shards=1, loss=0.0):
    wl = workload()
    net = MemoryNetwork(loss=loss, segment_size=1024, seed=0)
    plan = ShardPlan(wl.n_params, shards)
    world = World(workers=range(n_workers), n_elems=wl.n_params, shards=tuple(plan.ranges), layout=tuple(wl.layout()))
    s_eps = [net.endpoint() for _ in range(shards)]
    w_eps = [net.endpoint() for _ in range(n_workers)]
    addrs = {**{server(k): e.local_addr for k, e in enumerate(s_eps)},
             **{worker(r): e.local_addr for r, e in enumerate(w_eps)}}
    servers = [ParameterServer(wl, s_eps[k], ServerConfig(world_size=n_workers, iterations=8, lr=0.1, evaluate=False),
                               plan=plan, shard=k, log=lambda _: None, planner=create("rat", world, chunks=chunks))
               for k in range(shards)]
    refs = [ShardRef(k, s_eps[k].local_addr, *plan.ranges[k]) for k in range(shards)]
    workers = []
    for r in range(n_workers):
        for ps in servers:
            ps.admit(r, w_eps[r].local_addr)
        w = Worker(wl, w_eps[r], refs, WorkerConfig(rank=r, world_size=n_workers),
                   planner=create("rat", world, chunks=chunks))
        w.executor.addresses.update(addrs)
        workers.append(w)
    for ps in servers:
        ps.executor.addresses.update(addrs)
    return servers, workers


async def _run(servers, workers):
    return await asyncio.gather(*(s.run() for s in servers), *(w.run() for w in workers))


@pytest.mark.parametrize("n_workers,shards,chunks", [(4, 1, 4), (3, 2, 3), (5, 1, 7)])
def test_pieces_give_the_model_whole_slices_give(n_workers, shards, chunks):
    whole = _job(n_workers, 1, shards)
    cut = _job(n_workers, chunks, shards)
    asyncio.run(_run(*whole))
    asyncio.run(_run(*cut))
    for a, b in zip(whole[0], cut[0]):
        assert a.iteration == b.iteration == 8 and a.version == b.version == 8  # one step per round, not per piece
        np.testing.assert_allclose(b.params, a.params, rtol=1e-5, atol=1e-6)


def test_assembled_pieces_keep_per_element_counts_and_missing_pieces_count_zero():
    a = Partial.of_gradient(np.ones(4, np.float32), lo=10, samples=3, loss=2.0)
    a.add_gradient(np.ones(4, np.float32), [(0, 2)], samples=3, loss=1.0)  # second contributor lost 10..11
    b = Partial.of_gradient(np.full(3, 2.0, np.float32), lo=14, samples=3, loss=2.0)
    full = _assemble({(10, 14): a, (14, 17): b, (17, 20): None}, 10, 10)
    np.testing.assert_array_equal(full.counts(), [1, 1, 2, 2, 1, 1, 1, 0, 0, 0])
    np.testing.assert_allclose(full.mean("unbiased"), [1, 1, 1, 1, 2, 2, 2, 0, 0, 0])
    assert full.contributors == 2 and full.samples == 6 and full.loss_sum == 3.0
    assert _assemble({(0, 5): None}, 0, 5).contributors == 0


def test_more_pieces_than_the_tag_step_field_holds_is_a_clear_error():
    world = World(workers=range(4), n_elems=1_000_000, shards=((0, 1_000_000),))
    with pytest.raises(ValueError, match="use at most 2048 chunks"):
        create("rat", world, chunks=4000).plan(0)
    create("rat", world, chunks=2048).plan(0)  # one level: 2048 x 2 steps fit
