"""Ring all-reduce training in one event loop over the in-memory transport (no PS process)."""

from __future__ import annotations

import asyncio
import re

import numpy as np
import pytest

from ltp_ps.allreduce import PeerConfig, PeerWorker
from ltp_ps.errors import TrainingFailed
from ltp_ps.schedules import World, create
from ltp_ps.schedules.program import worker
from ltp_ps.transport import MemoryNetwork
from ps_helpers import workload

pytestmark = pytest.mark.timeout(180)


def make_ring(n, *, loss=0.0, seed=0, name="ring", **kw):
    wl = workload()
    net = MemoryNetwork(loss=loss, segment_size=1024, seed=seed)
    eps = [net.endpoint() for _ in range(n)]
    addrs = {worker(r): eps[r].local_addr for r in range(n)}
    world = World(workers=range(n), n_elems=wl.n_params, layout=tuple(wl.layout()))
    peers = [PeerWorker(wl, eps[r], PeerConfig(rank=r, world_size=n, **kw), planner=create(name, world),
                        addresses=addrs, log=lambda _: None) for r in range(n)]
    return net, peers


async def test_ring_digits_trains_and_replicas_stay_identical():
    _, peers = make_ring(4, epochs=6, lr=0.1)
    out = await asyncio.gather(*(p.run() for p in peers))
    assert out[0]["final_accuracy"] >= 0.93
    for p in peers[1:]:
        np.testing.assert_array_equal(p.params, peers[0].params)
    assert all(p.iteration == peers[0].total for p in peers)
    assert out[0]["delivered_min"] == 1.0


@pytest.mark.parametrize("n", [2, 5])
async def test_ring_under_segment_loss(n):
    # 16 epochs, not 10: at 10 the run stops before SGD has settled, and which elements the seeded loss removes
    # (the draw order follows task scheduling, so it changes under load) moved the final accuracy over
    # 0.89-0.98 across 20 loss patterns with 5 workers (lossless: 0.947).  At 16 the same 20 patterns gave
    # 0.950-0.981 (lossless: 0.978), so 0.9 tests convergence, not luck.
    _, peers = make_ring(n, loss=0.05, seed=n, epochs=16, lr=0.1)
    out = await asyncio.gather(*(p.run() for p in peers))
    for p in peers[1:]:
        np.testing.assert_array_equal(p.params, peers[0].params)  # reliable all-gather: same bits everywhere
    assert 0.8 < out[0]["delivered_mean"] < 1.0
    assert out[0]["final_accuracy"] >= 0.9


async def test_ring_matches_direct_ps_update_without_loss():
    """One round: the ring's reduced gradient equals the mean of the workers' gradients (what direct applies)."""
    _, peers = make_ring(3, iterations=1, lr=0.1, momentum=0.0)
    before = peers[0].params.copy()
    wl = workload()
    grads = []
    for r in range(3):
        m = wl.build_model()
        from ltp_ps.workloads import set_flat
        set_flat(m, before)
        b = next(wl.batches(r, 3, 0))
        grads.append(wl.compute(m, b)[0])
    await asyncio.gather(*(p.run() for p in peers))
    np.testing.assert_allclose(peers[0].params, before - 0.1 * np.mean(grads, axis=0), rtol=1e-5, atol=1e-6)


async def test_dead_neighbour_fails_the_round_with_a_clear_error():
    net, peers = make_ring(3, iterations=4, lr=0.1, step_timeout_s=0.5)
    peers[2].cfg.max_iterations = 1  # worker 2 leaves after one round
    res = await asyncio.gather(*(p.run() for p in peers), return_exceptions=True)
    errs = [r for r in res if isinstance(r, BaseException)]
    assert errs and all(isinstance(e, TrainingFailed) for e in errs)
    assert "never arrived" in str(errs[0])
    # and why, precisely: the in-memory transport's departed worker is silent, not disconnected
    assert re.search(r"first input missing this round: worker:\d sent nothing for 0\.5 s, the whole receive "
                     r"timeout", str(errs[0])), str(errs[0])


@pytest.mark.parametrize("n", [3, 5, 6])
async def test_a_dead_neighbour_fails_every_survivor_within_two_step_timeouts_not_one_per_ring_step(n):
    """Found by trying to break it: each ring step that waited on the dead neighbour spent a whole
    ``--pull-timeout`` (a 4-worker torchrun job with ``--pull-timeout 5`` failed 26 s after the kill; before this
    change the 6-ring here took 5.1 s with 0.5 s steps).  A peer silent for one timeout is now skipped by the
    rest of the round's stages."""
    import time

    net, peers = make_ring(n, iterations=4, lr=0.1, step_timeout_s=0.5)
    peers[n - 1].cfg.max_iterations = 1  # the last worker leaves after one round
    t0 = time.monotonic()

    async def failed_after(p):
        with pytest.raises(TrainingFailed, match="never arrived"):
            await p.run()
        return time.monotonic() - t0

    took = await asyncio.gather(*(failed_after(p) for p in peers[:-1]), peers[-1].run())
    assert max(took[:-1]) < 2 * 0.5 + 0.5, took


async def test_rsgcm_rings_train_through_the_same_peer_loop():
    """Any workers-apply schedule runs on PeerWorker: RSGCM's planned rings train digits too."""
    _, peers = make_ring(4, name="rsgcm", epochs=6, lr=0.1)
    out = await asyncio.gather(*(p.run() for p in peers))
    for p in peers[1:]:
        np.testing.assert_array_equal(p.params, peers[0].params)
    assert out[0]["final_accuracy"] >= 0.9
