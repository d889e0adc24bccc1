"""Hoplite's controller driving the real schedule executor over the in-memory transport.

Every grant becomes a one-stage program that the node's ``Executor`` runs; receive reports become
``TransferDone`` / ``ChunkArrived`` events for the controller.  This checks the grants against the layer's
executor conventions (partial encoding, raw chunk slots bound by the role, tags), not just our own model.
"""

import asyncio
import random

import numpy as np
import pytest

from ltp_ps.schedules.executor import Executor, Slots
from ltp_ps.schedules.hoplite import HopliteController, parse_chunk_slot
from ltp_ps.schedules.partial import Partial
from ltp_ps.schedules.program import ChunkArrived, NodeReady, Program, TransferDone, server, worker
from ltp_ps.transport.base import RecvReport
from ltp_ps.transport.memory import MemoryNetwork

pytestmark = pytest.mark.timeout(120)


class ServerRole:
    def __init__(self):
        self.applied = {}

    def apply(self, step, slots):
        p = slots.assembled(step.slot, step.lo, step.hi)  # the pieces' partials when the reduce ran in pieces
        self.applied[(step.lo, step.hi)] = (p.mean("unbiased"), p.counts(), p.contributors)


async def _round(n, shards, grads, init, *, loss, seed, latency_s, order, piece_bytes=None):
    net = MemoryNetwork(loss=loss, segment_size=512, seed=seed)
    nodes = [server(k) for k in range(len(shards))] + [worker(r) for r in range(n)]
    eps = {x: net.endpoint() for x in nodes}
    addrs = {x: eps[x].local_addr for x in nodes}
    exes = {x: Executor(eps[x], x, addrs, timeout_s=3.0) for x in nodes}
    slots = {x: Slots() for x in nodes}
    params = {x: (init.copy() if x.startswith("server:") else np.zeros_like(init)) for x in nodes}
    roles = {x: ServerRole() for x in nodes if x.startswith("server:")}
    for r in range(n):
        slots[worker(r)].put_partial("grad", Partial.of_gradient(grads[r]))
    ctrl = HopliteController(shards, chunk_bytes=1024, latency_s=latency_s, rng=random.Random(seed),
                             reduce_piece_bytes=piece_bytes)
    queues = {x: asyncio.Queue() for x in nodes}

    def dispatch(grants):
        for g in grants:
            queues[g.node].put_nowait(g)

    async def loop(x):
        while True:
            g = await queues[x].get()
            if g is None:
                return
            for s in g.steps:  # the role binds every chunk slot to a view of its parameters
                if getattr(s, "payload", None) == "params":
                    slots[x].bind(s.slot, params[x][s.lo:s.hi].view(np.uint8))
            res = await exes[x].run(Program(x, (g.steps,)), slots[x], roles.get(x), iteration=0)
            for s, rep in zip(g.steps, res.reports):
                if s.op != "recv":
                    continue
                ok = isinstance(rep, RecvReport) and rep.received_bytes > 0
                if ok and s.payload == "params":
                    k, _ = parse_chunk_slot(s.slot)
                    dispatch(ctrl.on_event(ChunkArrived(x, f"params:{k}", s.lo, s.hi), now=0.0))
                dispatch(ctrl.on_event(TransferDone(s.peer, x, s.tag, ok=ok), now=0.0))

    tasks = [asyncio.create_task(loop(x)) for x in nodes]
    dispatch(ctrl.start(0, [worker(r) for r in range(n)], now=0.0))
    while not all(b.complete(worker(r)) for b in ctrl.broadcasts for r in range(n)):
        await asyncio.sleep(0.002)
    for r in order:
        dispatch(ctrl.on_event(NodeReady(worker(r), 0), now=0.0))
        await asyncio.sleep(0.001)
    while not (ctrl.done() and all(len(ro.applied) == 1 for ro in roles.values())):
        await asyncio.sleep(0.002)
    for x in nodes:
        queues[x].put_nowait(None)
    await asyncio.gather(*tasks)
    return ctrl, params, roles


@pytest.mark.parametrize("piece_bytes", [None, 700], ids=["whole", "pieces"])
@pytest.mark.parametrize("n,K,latency_s,loss", [(5, 1, 1e-9, 0.0), (7, 2, 125e-6, 0.0), (6, 2, 125e-6, 0.03)])
def test_hoplite_round_through_the_executor(n, K, latency_s, loss, piece_bytes):
    n_elems = 1500
    shards = [(round(n_elems * k / K), round(n_elems * (k + 1) / K)) for k in range(K)]
    rng = np.random.default_rng(n)
    grads = {r: rng.standard_normal(n_elems).astype(np.float32) for r in range(n)}
    init = np.arange(n_elems, dtype=np.float32)
    order = list(range(n))
    random.Random(n).shuffle(order)
    ctrl, params, roles = asyncio.run(_round(n, shards, grads, init, loss=loss, seed=1, latency_s=latency_s,
                                             order=order, piece_bytes=piece_bytes))
    assert len(ctrl.reduces) == (1 if piece_bytes is None else K * -(-(1500 // K * 4) // 700))
    assert ctrl.reduce.dimensions == (1 if latency_s < 1e-6 else 2)
    for r in range(n):  # reliable receiver-driven broadcast: exact parameters everywhere
        np.testing.assert_array_equal(params[worker(r)], init)
    full = np.mean([grads[r] for r in range(n)], axis=0)
    for k, (lo, hi) in enumerate(shards):
        mean, counts, contributors = roles[server(k)].applied[(lo, hi)]
        assert contributors == n and ctrl.contributions() == {worker(r) for r in range(n)}
        if loss == 0:
            assert (counts == n).all()
            np.testing.assert_allclose(mean, full[lo:hi], rtol=1e-5, atol=1e-6)
        else:  # loss-tolerant hops: elements lost on a hop count fewer contributors, never a biased mean
            assert counts.max() == n and counts.min() >= 0
            assert (mean[counts == 0] == 0).all()
            full_rows = counts == n
            np.testing.assert_allclose(mean[full_rows], full[lo:hi][full_rows], rtol=1e-5, atol=1e-6)
