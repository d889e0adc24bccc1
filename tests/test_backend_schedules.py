"""The ``ltp`` backend's all-reduce on the schedule layer (ring / RSGCM programs run by the executor).

Several ranks in one process (threads, a HashStore), real sockets.  Exactness:
integer-valued float inputs have exact sums, so results are compared element
by element; random inputs check that every replica gets the same bits.
"""

from __future__ import annotations

import datetime
import time

import pytest
import torch
import torch.distributed as dist

import ltp_ps  # noqa: F401  (registers the backend)
from ltp_ps import backend as B
from ltp_ps import collectives as C
from ltp_ps.errors import ConfigError

from test_backend import ar_opts, make_groups, run_all

pytestmark = pytest.mark.torch


@pytest.fixture
def groups():
    made = []

    def make(world, transport="ltp", schedule="ring", timeout_s=20.0, algorithm="auto"):
        pgs = make_groups(world, transport, algorithm, timeout_s=timeout_s, schedule=schedule)
        made.extend(pgs)
        return pgs

    yield make
    for pg in made:
        pg.shutdown()


def test_default_schedule_rule():
    big = C.RING_MIN_BYTES
    assert C.default_schedule(1, 10 * big) == "direct"
    assert C.default_schedule(2, 10 * big) == "direct"
    assert C.default_schedule(3, big - 1) == "direct"
    assert C.default_schedule(3, big) == "ring"
    assert C.default_schedule(8, 100 << 20) == "ring"


def test_reliable_program_keeps_the_steps_and_makes_every_transfer_reliable():
    tol = C.schedule_program("ring", 2, 4, 1000, 7, exact=False)
    ex = C.schedule_program("ring", 2, 4, 1000, 7)
    assert {s.mode for s in tol.steps() if s.op in ("send", "recv")} == {"tolerant", "reliable"}
    assert {s.mode for s in ex.steps() if s.op in ("send", "recv")} == {"reliable"}
    assert [(s.op, getattr(s, "lo", None), getattr(s, "tag", None)) for s in tol.steps()] == \
        [(s.op, getattr(s, "lo", None), getattr(s, "tag", None)) for s in ex.steps()]
    with pytest.raises(ValueError, match="ring_plan"):
        C.schedule_program("rsgcm", 0, 4, 10, 0)
    with pytest.raises(ValueError, match="direct"):
        C.schedule_program("direct", 0, 4, 10, 0)


@pytest.mark.parametrize("transport", ["ltp", "tcp"])
@pytest.mark.parametrize("schedule,world", [("ring", 2), ("ring", 3), ("ring", 4), ("rsgcm", 3), ("rsgcm", 4)])
def test_schedule_allreduce_is_exact(groups, transport, schedule, world):
    pgs = groups(world, transport, schedule)
    for n in (world, 1001, 65_537):  # one element per rank, uneven chunks, several packets per chunk
        ins = [torch.arange(n, dtype=torch.float32) * (r + 1) - 7 * r for r in range(world)]
        want = sum(ins[1:], ins[0].clone())
        ts = [t.clone() for t in ins]
        run_all(pgs, lambda r, pg: pg.allreduce([ts[r]]))
        for r in range(world):
            assert torch.equal(ts[r], want), (n, r)
        avg = [t.clone() for t in ins]
        run_all(pgs, lambda r, pg: pg.allreduce([avg[r]], ar_opts(dist.ReduceOp.AVG)))
        assert all(torch.equal(a, want / world) for a in avg)
    assert all(pg.stats["schedule_runs"] == 6 for pg in pgs)


def test_schedule_allreduce_replicas_bit_identical_async_and_mixed_dtypes(groups):
    world = 4
    pgs = groups(world, "ltp", "ring")
    g = torch.Generator().manual_seed(3)
    ins = [[torch.randn(30_011, generator=g) for _ in range(3)] for _ in range(world)]
    outs = [[t.clone() for t in row] for row in ins]
    works = [[pg.allreduce([outs[r][k]]) for k in range(3)] for r, pg in enumerate(pgs)]  # 3 in flight per rank
    for row in works:
        for w in reversed(row):
            w.wait()
    for k in range(3):
        for r in range(1, world):
            assert torch.equal(outs[r][k], outs[0][k])
        ref = sum(ins[r][k].double() for r in range(world)).float()
        torch.testing.assert_close(outs[0][k], ref)
    # int64 and MAX do not run as partials: they take the ring plan, still exact
    ints = [torch.arange(5000, dtype=torch.int64) * (r + 2) for r in range(world)]
    run_all(pgs, lambda r, pg: pg.allreduce_coalesced([ints[r]]))
    assert all(torch.equal(t, torch.arange(5000, dtype=torch.int64) * sum(range(2, world + 2))) for t in ints)
    mx = [torch.full((4000,), float(r)) for r in range(world)]
    run_all(pgs, lambda r, pg: pg.allreduce([mx[r]], ar_opts(dist.ReduceOp.MAX)))
    assert all(torch.equal(t, torch.full((4000,), float(world - 1))) for t in mx)
    assert pgs[0].stats["schedule_runs"] == 3


def test_routes(groups):
    pgs = groups(4, "tcp", "auto")
    pg = pgs[0]
    f32, sm = torch.float32, dist.ReduceOp.SUM
    assert pg._allreduce_route(f32, sm, 1000, 4) == "direct"  # below RING_MIN_BYTES
    assert pg._allreduce_route(f32, sm, 1 << 20, 4) == "schedule:ring"
    assert pg._allreduce_route(torch.int64, sm, 1 << 20, 8) == "ring"
    assert pg._allreduce_route(f32, dist.ReduceOp.MIN, 1 << 20, 4) == "ring"
    pg.schedule = "rsgcm"
    assert pg._allreduce_route(f32, sm, 1000, 4) == "schedule:rsgcm"
    assert pg._allreduce_route(f32, sm, 3, 4) == "direct"  # fewer elements than ranks
    pg.schedule = "direct"
    assert pg._allreduce_route(f32, sm, 1 << 20, 4) == "direct"
    two = groups(2, "tcp", "auto")
    assert two[0]._allreduce_route(f32, sm, 1 << 24, 4) == "direct"  # <= 2 ranks: direct


def test_dead_rank_fails_a_schedule_allreduce_with_a_named_cause(groups):
    pgs = groups(3, "ltp", "ring", timeout_s=2.0)
    t0 = time.monotonic()
    works = [pgs[r].allreduce([torch.ones(3000)]) for r in (0, 1)]  # rank 2 never calls
    msgs = []
    for r, w in zip((0, 1), works):
        with pytest.raises(B.LtpBackendError) as ei:
            w.wait()
        msgs.append(str(ei.value))
        assert f"rank {r}" in msgs[-1] and "ring schedule" in msgs[-1] and "dead, stuck" in msgs[-1], msgs[-1]
    # rank 0 receives from rank 2 in the ring: it names the silent rank; rank 1 waits on rank 0 (a cascade)
    assert "from rank 2" in msgs[0], msgs[0]
    took = time.monotonic() - t0
    assert took < 2.0 + 4.0, f"took {took:.1f} s with a 2 s timeout"


def test_options_from_pg_options_env_and_errors(monkeypatch):
    monkeypatch.setenv(B.ENV_SCHEDULE, "tree")
    with pytest.raises(ConfigError, match="LTP_PG_SCHEDULE"):
        B.BackendOptions.from_env()
    monkeypatch.setenv(B.ENV_SCHEDULE, "rsgcm")
    assert B.BackendOptions.from_env().schedule == "rsgcm"
    monkeypatch.delenv(B.ENV_SCHEDULE)
    for pg_options in (B.BackendOptions(transport="tcp", schedule="ring"), {"transport": "tcp", "schedule": "ring"}):
        dist.init_process_group("ltp", store=dist.HashStore(), rank=0, world_size=1,
                                timeout=datetime.timedelta(seconds=10), pg_options=pg_options)
        try:
            pg = dist.group.WORLD
            assert pg.schedule == "ring" and pg.options.transport == "tcp"
            t = torch.arange(6.0)
            dist.all_reduce(t)
            assert t.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
        finally:
            dist.destroy_process_group()
    with pytest.raises(Exception, match="pg_options must be"):
        dist.init_process_group("ltp", store=dist.HashStore(), rank=0, world_size=1,
                                timeout=datetime.timedelta(seconds=10), pg_options=42)
    if dist.is_initialized():
        dist.destroy_process_group()
