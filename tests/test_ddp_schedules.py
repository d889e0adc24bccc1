"""The PS-less DDP hook (ring / RSGCM schedule programs per bucket): verdict rules (pure), then rounds of the hook
over the seeded in-memory transport: exact without loss, the unbiased mean under loss, repairs, a silent rank."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from ltp_ps import collectives as C
from ltp_ps import ddp as D
from ltp_ps import ddp_schedules as S
from ltp_ps.backend import LtpBackendError
from ltp_ps.schedules.partial import Partial
from ltp_ps.schedules.program import worker
from ltp_ps.transport import MemoryNetwork

pytestmark = pytest.mark.torch


# --- the verdict (pure) -----------------------------------------------------------------------------------------

def _part(vals, lo=0, contributors=3, lost=()):
    p = Partial(len(vals), lo=lo)
    p.sum[:] = vals
    p.contributors = contributors
    for a, b, k in lost:
        p._deficit()[a:b] = k
    return p


def test_verdict_rules_in_order():
    full = [_part([3.0] * 4), _part([3.0] * 4, lo=4)]
    assert S.judge(full, 8, 3, 0.8) == S.ScheduleVerdict(S.FULL, 1.0)
    lossy = [_part([3.0] * 4, lost=[(0, 1, 1)]), _part([3.0] * 4, lo=4)]
    v = S.judge(lossy, 8, 3, 0.8)
    assert v.action == S.LOSSY and v.fraction == pytest.approx(23 / 24)
    assert S.judge(lossy, 8, 3, 0.99).action == S.REPAIR  # below min_fraction
    assert S.judge(lossy, 8, 3, 1.0).action == S.REPAIR  # exact buckets
    zero = [_part([3.0] * 4, lost=[(2, 3, 3)]), _part([3.0] * 4, lo=4)]
    v = S.judge(zero, 8, 3, 0.1)
    assert v.action == S.REPAIR and "no rank's contribution" in v.reason  # never applied as zeros
    v = S.judge(full[:1], 8, 3, 0.8)
    assert v.action == S.REPAIR and "cover 4 of 8" in v.reason
    # 0 accepts any lossy round, as the direct hook's RoundPolicy (register() allows [0, 1] for every schedule;
    # before, the ring hooks raised this at the first backward pass); uncovered elements still repair
    assert S.judge(lossy, 8, 3, 0.0).action == S.LOSSY
    assert S.judge(zero, 8, 3, 0.0).action == S.REPAIR
    for bad in (-0.1, 1.5, float("nan")):
        with pytest.raises(ValueError, match="min_fraction"):
            S.judge(full, 8, 3, bad)


def test_critical_bytes_become_element_ranges():
    crit = [(0, D.HDR), (D.HDR, D.HDR + 4), (D.HDR + 4 * 9, D.HDR + 4 * 11), (D.HDR + 4 * 99, D.HDR + 4 * 200)]
    assert S.critical_elements(crit, 100) == [(0, 1), (9, 11), (99, 100)]


def test_default_schedule_rule_and_bad_names():
    assert D.default_schedule(2) == "direct" and D.default_schedule(3) == "ring" and D.default_schedule(16) == "ring"
    assert D.SCHEDULES == C.SCHEDULES


# --- rounds over the memory transport ------------------------------------------------------------------------------

def run_ring(world, grads_per_round, *, schedule="ring", loss=0.0, min_fraction=D.MIN_FRACTION, timeout_s=2.0,
             seed=0, silent_rank=None, segment_size=256):
    """Rounds of the PS-less hook; returns (per-rank results or exceptions per round, states)."""

    async def main():
        net = MemoryNetwork(loss=loss, seed=seed, segment_size=segment_size)
        eps = [net.endpoint() for _ in range(world)]
        nodes = {worker(r): e.local_addr for r, e in enumerate(eps)}
        plan = C.rsgcm_ring_plan(world) if schedule == "rsgcm" else None
        n_max = max(len(g[0]) for g in grads_per_round)
        states = [S.ScheduleHookState(r, world, "memory", n_max, timeout_s, transport=eps[r], nodes=nodes,
                                      schedule=schedule, min_fraction=min_fraction, ring_plan=plan)
                  for r in range(world)]
        results = []
        for rnd, grads in enumerate(grads_per_round):
            async def one(r):
                if r == silent_rank:
                    return None
                n = len(grads[r])
                crit = [(0, D.HDR), (D.HDR, D.HDR + 4), (D.HDR + 4 * (n - 1), D.HDR + 4 * n)]
                return await states[r].exchange(rnd, 0, grads[r], crit)

            results.append(await asyncio.gather(*(one(r) for r in range(world)), return_exceptions=True))
        return results, states

    return asyncio.run(main())


@pytest.mark.parametrize("schedule,world", [("ring", 2), ("ring", 3), ("ring", 5), ("rsgcm", 4)])
def test_no_loss_every_round_full_and_replicas_identical(schedule, world):
    rng = np.random.default_rng(world)
    rounds = [[rng.standard_normal(n).astype(np.float32) for _ in range(world)] for n in (3001, 2, 1)]
    res, states = run_ring(world, rounds, schedule=schedule)
    for grads, got in zip(rounds, res):
        want = np.mean(np.stack(grads).astype(np.float64), axis=0)
        for g in got:
            assert not isinstance(g, BaseException), g
            np.testing.assert_array_equal(g, got[0])  # every rank applies the same bits
        np.testing.assert_allclose(got[0], want, rtol=1e-5, atol=1e-6)
    for s in states:
        assert s.stats.rounds == 3 and s.stats.full_rounds == 3 and s.stats.min_delivered_fraction == 1.0


def test_lossy_rounds_use_the_unbiased_mean_warn_and_agree():
    world, n = 4, 6000
    rng = np.random.default_rng(7)
    rounds = [[rng.standard_normal(n).astype(np.float32) + 5 for _ in range(world)] for _ in range(5)]
    with pytest.warns(RuntimeWarning, match="partially delivered"):
        res, states = run_ring(world, rounds, loss=0.02, seed=11)
    s = states[0].stats
    assert s.rounds == 5 and s.lossy_rounds >= 1 and s.min_delivered_fraction < 1.0
    same = [{k: v for k, v in st.stats.as_dict().items() if k != "max_path_loss"} for st in states]
    assert all(d == same[0] for d in same)  # the same verdicts on every rank
    # each rank's own sends measured the loss (found by trying to break it: the ring hook never updated this)
    assert all(0.0 < st.stats.max_path_loss < 0.2 for st in states), [st.stats.max_path_loss for st in states]
    for grads, got in zip(rounds, res):
        for g in got:
            np.testing.assert_array_equal(g, got[0])
        mean = np.mean(np.stack(grads), axis=0)
        lo, hi = np.min(np.stack(grads), axis=0), np.max(np.stack(grads), axis=0)
        assert np.all(got[0] >= lo - 1e-5) and np.all(got[0] <= hi + 1e-5)  # a mean of some contributions
        assert np.isclose(got[0], mean, rtol=1e-5).mean() > 0.8
        assert not np.any(got[0] == 0)  # values are ~5: no element averaged with zeros


def test_min_fraction_one_is_exact_under_loss():
    world, n = 3, 5000
    rng = np.random.default_rng(3)
    rounds = [[rng.standard_normal(n).astype(np.float32) for _ in range(world)] for _ in range(3)]
    clean, _ = run_ring(world, rounds)
    res, states = run_ring(world, rounds, loss=0.03, min_fraction=1.0, seed=5)
    for a, b in zip(clean, res):
        for g in b:
            np.testing.assert_array_equal(g, a[0])  # the reliable program: the same bits as without loss
    s = states[0].stats
    assert s.lossy_rounds == 0 and s.full_rounds + s.repaired_rounds == 3


def test_heavy_loss_is_repaired_not_averaged():
    world, n = 3, 4000
    grads = [[np.full(n, 1.0 + r, np.float32) for r in range(world)]]
    with pytest.warns(RuntimeWarning, match="reliably"):
        res, states = run_ring(world, grads, loss=0.5, seed=2)
    for g in res[0]:
        np.testing.assert_array_equal(g, np.full(n, 2.0, np.float32))
    assert states[0].stats.repaired_rounds == 1 and states[0].stats.reasons


def test_silent_rank_ends_the_round_with_a_named_error():
    grads = [[np.ones(300, np.float32) for _ in range(3)]]
    t0 = time.monotonic()
    res, states = run_ring(3, grads, timeout_s=0.5, silent_rank=2)
    took = time.monotonic() - t0
    assert took < 4 * 0.5 + 1.0, took
    for r in (0, 1):
        err = res[0][r]
        assert isinstance(err, LtpBackendError), err
        msg = str(err)
        assert f"rank {r}: bucket 0 round 0" in msg and "dead or stuck" in msg, msg
        assert states[r].stats.errors == 1
    assert "rank 2" in str(res[0][0]) + str(res[0][1])


def test_register_picks_the_schedule_and_refuses_unknown_ones(monkeypatch):
    """One rank under DDP: register(schedule=...) validates, the env sets the default, a ring of one reduces."""
    import datetime

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from ltp_ps.errors import ConfigError

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=20))
    try:
        net = torch.nn.Linear(8, 3)
        model = DDP(net)
        with pytest.raises(ConfigError, match="schedule='tree' is unknown"):
            D.register(model, schedule="tree", transport="tcp")
        monkeypatch.setenv(D.ENV_SCHEDULE, "ring")
        state = D.register(model, transport="tcp", timeout_s=10.0)
        try:
            assert isinstance(state, S.ScheduleHookState) and state.schedule == "ring"
            x = torch.randn(5, 8)
            model(x).sum().backward()
            want = torch.autograd.grad(net(x).sum(), net.weight)[0]
            torch.testing.assert_close(net.weight.grad, want)
            assert state.stats.rounds >= 1 and state.stats.full_rounds == state.stats.rounds
        finally:
            state.close()
    finally:
        dist.destroy_process_group()
